"""
Step 14 (tests) -- Correctness tests for the fused RoPE (rope_kernel.py).

Every comparison is against a float64 truth (HF's formula evaluated in float64,
gradients by autograd): q_embed, k_embed, dq and dk must be no worse than about
twice the error of the PyTorch path (HF's eager ``apply_rotary_pos_emb``) at the
same dtype, and the forward must reproduce HF's roundings (bit for bit in bf16
and fp16, within float32's own rounding for float32), for every head size and
layout, broadcast tables and a patched LLaMA. Without a GPU the kernels run in
the Triton interpreter and the GPU-only tests (LLaMA-8B shapes, 64-bit offsets,
CUDA graphs) are skipped.

Usage:
    python rope_test.py            # or: python -m pytest rope_test.py
"""

import copy
import sys

import pytest
import torch

from conftest import DEVICE, DTYPES, check_outputs, need_gpu, rel_err
import rope_kernel
from rope_kernel import TritonRoPEFunction, apply_rotary_pos_emb, rope, rope_reference
from rope_kernel import RopeMismatch, check_same_rope, fuse_rope, patched_rope, rope_patch_targets


def rope_tables(batch, seq_len, head_dim, dtype, seed=0, scaling=1.0):
    """HF-style cos/sin [batch, T, D]: random positions, inv_freq = 10000^(-2i/D), cat(freqs, freqs)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 8192, (batch, seq_len), generator=g).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(DEVICE, dtype), (emb.sin() * scaling).to(DEVICE, dtype)


def make_inputs(batch, seq_len, n_q, n_k, head_dim, dtype, layout="hf", seed=0, table_batch=None):
    """q, k in [B, H, T, D] plus cos, sin and upstream gradients for q_embed, k_embed.

    layout "hf": transposed views of contiguous [B, T, H, D] tensors (what
    LlamaAttention passes); "bhtd": contiguous [B, H, T, D].
    """
    g = torch.Generator().manual_seed(seed)

    def qk(n_heads):
        if layout == "hf":
            return torch.randn(batch, seq_len, n_heads, head_dim, generator=g).to(DEVICE, dtype).transpose(1, 2)
        return torch.randn(batch, n_heads, seq_len, head_dim, generator=g).to(DEVICE, dtype)

    q, k = qk(n_q), qk(n_k)
    cos, sin = rope_tables(table_batch or batch, seq_len, head_dim, dtype, seed=seed + 1)
    dq_out = torch.randn(q.shape, generator=g).to(DEVICE, dtype)
    dk_out = torch.randn(k.shape, generator=g).to(DEVICE, dtype)
    return q, k, cos, sin, dq_out, dk_out


def run(fn, q, k, cos, sin, dq_out, dk_out, **kwargs):
    """Forward and backward of fn(q, k, cos, sin) on fresh leaves that keep the inputs' strides."""
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    q_embed, k_embed = fn(q, k, cos, sin, **kwargs)
    torch.autograd.backward((q_embed, k_embed), (dq_out.to(q_embed.dtype), dk_out.to(k_embed.dtype)))
    return q_embed.detach(), k_embed.detach(), q.grad, k.grad


def same_layout(a, b):
    """Same shape and the same strides on every dimension longer than 1."""
    return a.shape == b.shape and all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1)


def compare_to_truth(q, k, cos, sin, dq_out, dk_out, **kwargs):
    """Ours and PyTorch against float64 for q_embed, k_embed, dq, dk: ours no worse than ~2x.

    Also: the forward equals HF's bit for bit (bf16/fp16) or within float32
    rounding, and outputs and gradients have PyTorch's dtypes and layouts.
    """
    ours = run(rope, q, k, cos, sin, dq_out, dk_out, **kwargs)
    torch_path = run(rope_reference, q, k, cos, sin, dq_out, dk_out, **kwargs)
    truth = run(rope_reference, q.double(), k.double(), cos.double(), sin.double(), dq_out.double(),
                dk_out.double(), **kwargs)
    check_outputs(("q", "k", "dq", "dk"), ours, torch_path, truth)
    for name, a, b in zip(("q_embed", "k_embed"), ours, torch_path):
        assert same_layout(a, b), f"{name}: strides {a.stride()}, PyTorch gives {b.stride()}"
        if a.dtype == torch.float32:
            assert rel_err(a, b) <= 1e-7, f"{name}: differs from HF's float32 result by {rel_err(a, b):.2e}"
        else:
            assert torch.equal(a, b), f"{name}: not bitwise equal to HF's {a.dtype} result"
    # Gradients come back laid out like q and k when those are dense (HF's
    # views), so autograd's transpose/view upstream is free. (For a non-dense
    # leaf, autograd itself restrides .grad.)
    for name, grad, x in (("dq", ours[2], q), ("dk", ours[3], k)):
        if same_layout(torch.empty_like(x), x):
            assert same_layout(grad, x), f"{name}: strides {grad.stride()}, the input has {x.stride()}"


# (dtype, D, (nh, n_kv), (B, T), layout): every head dim with every head
# pair for every dtype; token counts and layouts rotate between the dtypes so
# that each pairing is seen somewhere. LLaMA's own (D=128, 32/8, HF layout) is
# in every dtype.
def _cases():
    cases = []
    combos = [(d, h) for d in (6, 64, 128) for h in ((3, 1), (4, 4), (32, 8))]
    for j, dt in enumerate(("fp32", "bf16", "fp16")):
        for i, (d, (nh, nkv)) in enumerate(combos):
            bt = ((1, 1), (2, 7))[(i + j) % 2]
            layout = ("hf", "bhtd")[(i // 2 + j) % 2]
            if (d, nh) == (128, 32):
                bt, layout = (2, 7), "hf"
            label = f"{dt} D={d} h={nh}/{nkv} B,T={bt[0]},{bt[1]} {layout}"
            cases.append(pytest.param(dt, d, (nh, nkv), bt, layout, id=label))
    return cases


@pytest.mark.parametrize("dtype,d,heads,bt,layout", _cases())
def test_matches_float64_truth(dtype, d, heads, bt, layout):
    compare_to_truth(*make_inputs(bt[0], bt[1], heads[0], heads[1], d, DTYPES[dtype], layout=layout))


# ---------------------------------------------------------------- edge cases and API
def test_tokens_over_several_programs():
    # 3 x 50 tokens: in the interpreter three programs of up to 64 tokens, across rows
    # (the last one's tail masked), each token's rows of the tables picked by its own b
    # and t; a table shared by the batch too. On a GPU (one token per program) it is one
    # more case against the truth.
    assert rope_kernel._tokens_per_program(150, torch.device("cpu")) == rope_kernel.INTERPRET_TOKENS == 64
    compare_to_truth(*make_inputs(3, 50, 4, 2, 64, torch.bfloat16))
    compare_to_truth(*make_inputs(3, 50, 3, 1, 6, torch.float32, layout="bhtd", table_batch=1))


def test_tables_broadcast_over_batch():
    # One cos/sin table [1, T, D] shared by the batch (batch stride 0 in the kernel).
    inputs = make_inputs(2, 7, 4, 2, 64, torch.bfloat16, table_batch=1)
    assert inputs[2].shape == (1, 7, 64)
    compare_to_truth(*inputs)


def test_tables_broadcast_over_time():
    # A table [B, 1, D] (one position for every token) broadcasts over T as in HF.
    q, k, _, _, dq_out, dk_out = make_inputs(2, 5, 3, 1, 6, torch.float32)
    cos, sin = rope_tables(2, 1, 6, torch.float32, seed=7)
    compare_to_truth(q, k, cos, sin, dq_out, dk_out)


def test_arbitrary_tables():
    # Random tables with c1 != c2 and s1 != s2 (and cos^2 + sin^2 != 1): HF's
    # formula is used with the halves separately, forward and backward.
    q, k, _, _, dq_out, dk_out = make_inputs(2, 7, 4, 2, 10, torch.float32)
    g = torch.Generator().manual_seed(11)
    cos = torch.randn(2, 7, 10, generator=g).to(DEVICE)
    sin = torch.randn(2, 7, 10, generator=g).to(DEVICE)
    compare_to_truth(q, k, cos.to(torch.bfloat16).float(), sin.to(torch.bfloat16).float(), dq_out, dk_out)
    compare_to_truth(q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16(), dq_out, dk_out)


def test_scaled_tables():
    # attention_scaling != 1 (YaRN, longrope) scales both tables.
    q, k, _, _, dq_out, dk_out = make_inputs(2, 7, 4, 2, 64, torch.bfloat16)
    cos, sin = rope_tables(2, 7, 64, torch.bfloat16, scaling=1.37)
    compare_to_truth(q, k, cos, sin, dq_out, dk_out)


def test_partial_rotary_matches_hf():
    # Tables narrower than the head (Phi-3's partial_rotary_factor): the first dims
    # turn, the rest pass through, as in HF's Phi-3 function; gradients included.
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

    q, k, _, _, dq_out, dk_out = make_inputs(2, 7, 4, 2, 16, torch.float32)
    cos, sin = rope_tables(2, 7, 8, torch.float32)
    ours = run(rope, q, k, cos.to(DEVICE), sin.to(DEVICE), dq_out, dk_out)
    theirs = run(phi3_rope, q, k, cos.to(DEVICE), sin.to(DEVICE), dq_out, dk_out)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[0][..., 8:], q[..., 8:])  # the rest untouched


def test_the_swap_checks_what_the_family_computes():
    from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb as cohere_rope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

    model = _tiny_llama()
    check_same_rope(llama_rope, model, "llama")  # the same function: no error
    with pytest.raises(RopeMismatch, match="cohere.apply_rotary_pos_emb computes another rotation"):
        check_same_rope(cohere_rope, model, "cohere")  # interleaved pairs
    with pytest.raises(RopeMismatch, match="does not take"):
        check_same_rope(lambda q, k, cos, sin, position_ids: (q, k), model, "old")


def test_bf16_qk_with_fp32_tables():
    # bf16 q, k with float32 tables: PyTorch promotes, q_embed is float32; dq stays bf16.
    q, k, _, _, dq_out, dk_out = make_inputs(2, 7, 4, 2, 64, torch.bfloat16)
    cos, sin = rope_tables(2, 7, 64, torch.float32)
    compare_to_truth(q, k, cos, sin, dq_out, dk_out)
    q_embed, _, dq, _ = run(rope, q, k, cos, sin, dq_out, dk_out)
    assert q_embed.dtype == torch.float32 and dq.dtype == torch.bfloat16


def test_unsqueeze_dim_2():
    # q, k as [B, T, H, D] with unsqueeze_dim=2 (contiguous: the q_proj output viewed).
    q, k, cos, sin, dq_out, dk_out = make_inputs(2, 7, 4, 2, 64, torch.bfloat16)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    assert q.is_contiguous()
    compare_to_truth(q, k, cos, sin, dq_out.transpose(1, 2), dk_out.transpose(1, 2), unsqueeze_dim=2)
    ours = rope(q, k, cos, sin, unsqueeze_dim=-2)
    assert torch.equal(ours[0], rope_reference(q, k, cos, sin, unsqueeze_dim=2)[0])


def test_non_contiguous_upstream_grads():
    q, k, cos, sin, dq_out, dk_out = make_inputs(2, 7, 4, 2, 64, torch.bfloat16)
    wide_q = torch.randn(2, 4, 7, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    wide_k = torch.randn(2, 2, 7, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    strided = wide_q[..., ::2], wide_k[..., ::2]  # stride(-1) == 2: copied
    permuted = dq_out.permute(2, 0, 3, 1).contiguous().permute(1, 3, 0, 2), dk_out.transpose(0, 1).contiguous().transpose(0, 1)
    assert strided[0].stride(-1) == 2 and not permuted[0].is_contiguous() and not permuted[1].is_contiguous()
    compare_to_truth(q, k, cos, sin, *strided)
    compare_to_truth(q, k, cos, sin, *permuted)


def test_sliced_and_strided_qk():
    # q, k slices of wider tensors (not dense: outputs come back contiguous) and
    # a last dim with stride 2 (copied).
    q, k, cos, sin, dq_out, dk_out = make_inputs(2, 7, 6, 3, 64, torch.float16)
    compare_to_truth(q[:, 1:5], k[:, :2], cos, sin, dq_out[:, 1:5], dk_out[:, :2])
    wide = torch.randn(2, 4, 7, 128, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    compare_to_truth(wide[..., ::2], k[:, :2], cos, sin, dq_out[:, :4], dk_out[:, :2])


def test_forward_under_no_grad():
    q, k, cos, sin, _, _ = make_inputs(2, 7, 4, 2, 64, torch.bfloat16)
    q.requires_grad_()
    with torch.no_grad():
        q_embed, k_embed = rope(q, k, cos, sin)
    assert not q_embed.requires_grad and not k_embed.requires_grad
    ref = rope_reference(q.detach(), k, cos, sin)
    assert torch.equal(q_embed, ref[0]) and torch.equal(k_embed, ref[1])


def test_only_q_or_k_embed_needs_grad():
    q, k, cos, sin, dq_out, dk_out = make_inputs(2, 7, 4, 2, 64, torch.float32)
    truth = run(rope_reference, q.double(), k.double(), cos.double(), sin.double(), dq_out.double(), dk_out.double())
    qq = q.detach().requires_grad_()
    q_embed, k_embed = rope(qq, k, cos, sin)
    assert q_embed.requires_grad and not k_embed.requires_grad
    q_embed.backward(dq_out)
    e_q = rel_err(qq.grad, truth[2])
    assert k.grad is None and e_q < 1e-6, f"dq {e_q:.2e}"
    # Only k_embed reaches the loss: q gets no gradient (as in eager), k the right one.
    qq, kk = q.detach().requires_grad_(), k.detach().requires_grad_()
    rope(qq, kk, cos, sin)[1].backward(dk_out)
    e_k = rel_err(kk.grad, truth[3])
    assert qq.grad is None and e_k < 1e-6, f"dk {e_k:.2e}"


def test_cos_requires_grad_falls_back():
    q, k, cos, sin, dq_out, dk_out = make_inputs(2, 7, 4, 2, 64, torch.float32)
    leaves = [t.detach().requires_grad_() for t in (q, k, cos, sin)]
    ref_leaves = [t.detach().requires_grad_() for t in (q, k, cos, sin)]
    out = rope(*leaves)
    assert "TritonRoPE" not in type(out[0].grad_fn).__name__, "cos requires grad: must use the reference"
    torch.autograd.backward(out, (dq_out, dk_out))
    torch.autograd.backward(rope_reference(*ref_leaves), (dq_out, dk_out))
    for name, a, b in zip(("dq", "dk", "dcos", "dsin"), leaves, ref_leaves):
        assert a.grad is not None and torch.equal(a.grad, b.grad), f"{name} differs from the reference"
    # Under no_grad the tables' requires_grad is irrelevant: the kernel runs.
    with torch.no_grad():
        assert torch.equal(rope(q, k, leaves[2], leaves[3])[0], rope_reference(q, k, cos, sin)[0])


def test_gradients_laid_out_like_qk():
    # HF's q is a transposed view; dq gets the same strides, so autograd's
    # transpose + view back to q_proj's [B, T, nh * D] output needs no copy.
    q, k, cos, sin, dq_out, dk_out = make_inputs(2, 7, 4, 2, 64, torch.bfloat16)
    _, _, dq, dk = run(rope, q, k, cos, sin, dq_out, dk_out)
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    assert dq.transpose(1, 2).is_contiguous()


def test_zero_sizes():
    for shape in ((2, 0, 4, 2), (0, 7, 4, 2), (2, 7, 0, 2)):
        b, t, nh, nkv = shape
        q, k, cos, sin, dq_out, dk_out = make_inputs(b, t, nh, nkv, 8, torch.float32)
        q_embed, k_embed, dq, dk = run(rope, q, k, cos, sin, dq_out, dk_out)
        assert q_embed.shape == dq.shape == q.shape and k_embed.shape == dk.shape == k.shape


def test_function_apply_and_hf_alias():
    q, k, cos, sin, _, _ = make_inputs(2, 7, 3, 1, 6, torch.float16)
    a = TritonRoPEFunction.apply(q, k, cos, sin)
    b = rope(q, k, cos, sin)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert apply_rotary_pos_emb is rope


def test_bad_inputs_raise():
    q, k, cos, sin, _, _ = make_inputs(2, 7, 4, 2, 8, torch.float32)
    with pytest.raises(TypeError, match="expects tensors"):
        rope(q, k, 1.0, sin)
    with pytest.raises(TypeError, match="unsupported q dtype"):
        rope(q.to(torch.int32), k, cos, sin)
    with pytest.raises(TypeError, match="unsupported cos dtype"):
        rope(q, k, cos.double(), sin)
    with pytest.raises(TypeError, match="same dtype"):
        rope(q, k, cos, sin.bfloat16())
    with pytest.raises(ValueError, match="must be even"):
        rope(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match="cos shape"):
        rope(q, k, cos[:, :6], sin[:, :6])  # wrong T
    with pytest.raises(ValueError, match="sin shape"):
        rope(q, k, cos, sin[..., :6])  # wrong D
    with pytest.raises(ValueError, match="cos shape"):
        rope(q, k, cos[0], sin[0])  # 2-D tables
    with pytest.raises(ValueError, match="cos shape"):
        rope(q, k, torch.cat((cos, cos)), torch.cat((sin, sin)))  # wrong batch
    with pytest.raises(ValueError, match="k's batch, T and D"):
        rope(q, k[:, :, :6], cos, sin)
    with pytest.raises(ValueError, match="must be 4-D"):
        rope(q[0], k[0], cos, sin)
    with pytest.raises(ValueError, match="same device"):
        rope(q, k, cos.to("meta"), sin.to("meta"))
    with pytest.raises(NotImplementedError, match=r"\[B, heads, T, D\]"):
        rope(q, k, cos, sin, unsqueeze_dim=0)


# ---------------------------------------------------------------- model patching
def _tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(DEVICE, dtype)


def _count_rope_nodes(tensor):
    """Number of TritonRoPEFunction nodes in the autograd graph behind tensor."""
    seen, stack, count = set(), [tensor.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += "TritonRoPEFunction" in type(node).__name__
        stack.extend(n for n, _ in node.next_functions)
    return count


def test_patched_rope_on_llama_fp32():
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    modules, count = rope_patch_targets(model)
    assert count == 2 and modules == [modeling_llama], f"targets {modules}, {count} attention modules"

    with patched_rope(model) as n:
        assert n == 2 and modeling_llama.apply_rotary_pos_emb is apply_rotary_pos_emb
        loss = model(ids, labels=ids).loss
    assert modeling_llama.apply_rotary_pos_emb is original, "not restored after the block"
    loss_ref = reference(ids, labels=ids).loss  # outside the block: HF's function
    assert _count_rope_nodes(loss) == 2 and _count_rope_nodes(loss_ref) == 0
    loss.backward()  # outside the block: our Function's backward needs no patch
    loss_ref.backward()

    e_loss = rel_err(loss, loss_ref)
    e_grad = max(rel_err(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters()))
    assert e_loss <= 1e-6, f"patched loss differs by {e_loss:.2e}"
    assert e_grad <= 1e-6, f"patched gradients differ by up to {e_grad:.2e}"


def test_fused_forward_reaches_through_a_keyword_renaming_decorator():
    # transformers 5.24 wraps LlamaAttention.forward in deprecate_kwarg (functools.wraps,
    # the wrapped function in a closure cell): the copy must reach that function, and the
    # wrapper's own work (renaming an old keyword) must still run.
    import functools

    from rope_kernel import _forward_with_fused_rope

    def rename(old, new):
        def decorator(fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                if old in kwargs:
                    kwargs[new] = kwargs.pop(old)
                return fn(*args, **kwargs)
            return wrapper
        return decorator

    namespace = {"apply_rotary_pos_emb": lambda q, k, cos, sin: ("hf's", q, k)}
    exec("def forward(self, q, k, cos, sin, cache=None):\n"
         "    return apply_rotary_pos_emb(q, k, cos, sin), cache\n", namespace)
    cls = type("ToyAttention", (), {"forward": rename("past_key_values", "cache")(namespace["forward"])})
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 2, 4, 8, generator=g)
    angles = torch.rand(1, 4, 4, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    (q_out, k_out), cache = _forward_with_fused_rope(cls)(None, q.to(DEVICE), k.to(DEVICE), cos.to(DEVICE),
                                                          sin.to(DEVICE), past_key_values="kept")
    assert cache == "kept"  # the decorator ran
    unwrapped = _forward_with_fused_rope(cls).__wrapped__  # the copy it calls, not HF's function
    assert unwrapped.__globals__["apply_rotary_pos_emb"] is not namespace["apply_rotary_pos_emb"]
    q_ref, k_ref = rope_reference(q, k, cos, sin)
    torch.testing.assert_close(q_out.cpu(), q_ref)
    torch.testing.assert_close(k_out.cpu(), k_ref)
    assert cls.forward(None, q, k, cos, sin)[0][0] == "hf's"  # the class itself is untouched


def test_fuse_rope_with_gradient_checkpointing(monkeypatch):
    # Checkpointing reruns each attention layer during backward; the fused RoPE
    # must run there too (else PyTorch's CheckpointError: different saved tensors).
    import rope_kernel
    from kernel_ft.models import enable_checkpointing
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    assert fuse_rope(model) == 2 and fuse_rope(model) == 2, "two layers, wrapped once"
    calls = []
    real_forward = rope_kernel.rope_forward
    monkeypatch.setattr(rope_kernel, "rope_forward", lambda *a: calls.append(1) or real_forward(*a))
    enable_checkpointing(model)
    model.train()
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    loss = model(ids, labels=ids).loss
    assert modeling_llama.apply_rotary_pos_emb is original, "the swap must end with each layer's call"
    assert len(calls) == 2, "forward: once per layer"
    loss.backward()
    assert len(calls) == 4, "backward: once more per layer (the recomputation)"
    loss_ref = reference(ids, labels=ids).loss  # HF's function, no checkpointing
    loss_ref.backward()
    assert rel_err(loss, loss_ref) <= 1e-6
    e_grad = max(rel_err(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters()))
    assert e_grad <= 1e-6, f"gradients differ by up to {e_grad:.2e}"


def test_compiled_fused_layers_read_our_function(monkeypatch):
    # torch.compile reads a global of the copied forward as an attribute of the python
    # module its globals name, and guards on it there: where HF's function sits, not
    # ours. transformers 5.25 (with the `kernels` package) keeps there an nn.Module that
    # wraps the function; the same stand-in here must neither break the guards nor
    # take the place of our kernel in the compiled layers.
    from transformers.models.llama import modeling_llama

    class Wrapped(torch.nn.Module):  # a callable with no __defaults__ / __code__
        def __init__(self, function):
            super().__init__()
            self.function = function

        def forward(self, *args, **kwargs):
            return self.function(*args, **kwargs)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", Wrapped(modeling_llama.apply_rotary_pos_emb))
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    assert fuse_rope(model) == 2
    graphs = []

    def backend(graph_module, example_inputs):  # keeps what each compilation traced
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile(backend=backend)
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    model(ids, labels=ids)
    compiled = len(graphs)
    loss = model(ids, labels=ids).loss  # the cached graphs: their guards hold
    torch._dynamo.reset()
    assert compiled >= 1 and len(graphs) == compiled, f"{compiled} graphs, then {len(graphs) - compiled} more"
    for graph in graphs:
        targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
        assert any("rope_forward" in t for t in targets), f"our RoPE op is not in a compiled layer: {targets}"
    loss_ref = reference(ids, labels=ids).loss  # HF's function, eager
    assert rel_err(loss, loss_ref) <= 1e-6


def test_patch_scope_restore_and_nesting():
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    model = _tiny_llama()
    # Restored after an exception inside the block.
    with pytest.raises(RuntimeError, match="boom"):
        with patched_rope(model):
            assert modeling_llama.apply_rotary_pos_emb is rope
            raise RuntimeError("boom")
    assert modeling_llama.apply_rotary_pos_emb is original, "not restored after an exception"
    # Nested blocks: the inner exit keeps the outer patch, the outer exit restores HF's.
    with patched_rope(model):
        with patched_rope(model):
            assert modeling_llama.apply_rotary_pos_emb is rope
        assert modeling_llama.apply_rotary_pos_emb is rope, "inner exit removed the outer patch"
    assert modeling_llama.apply_rotary_pos_emb is original
    # Whatever was installed before (another patch, a wrapper) is what comes back.
    sentinel = lambda *args, **kwargs: original(*args, **kwargs)  # noqa: E731
    modeling_llama.apply_rotary_pos_emb = sentinel
    try:
        with patched_rope(model):
            assert modeling_llama.apply_rotary_pos_emb is rope
        assert modeling_llama.apply_rotary_pos_emb is sentinel
    finally:
        modeling_llama.apply_rotary_pos_emb = original
    # A model without rotary attention: nothing to patch.
    modules, count = rope_patch_targets(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert modules == [] and count == 0


def test_patched_rope_on_llama_bf16():
    # bf16: the forward is bitwise HF's, so the loss is identical; the gradients
    # differ only by our single rounding (ours is closer to float64).
    model = _tiny_llama(torch.bfloat16)
    reference = copy.deepcopy(model)
    truth = copy.deepcopy(model).double()
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with patched_rope(model):
        loss = model(ids, labels=ids).loss
    loss.backward()
    loss_ref = reference(ids, labels=ids).loss
    loss_ref.backward()
    truth(ids, labels=ids).loss.backward()
    assert torch.equal(loss, loss_ref), f"bf16 loss {loss.item()} vs HF {loss_ref.item()}"
    names = [f"grad of {name}" for name, _ in model.named_parameters()]
    grads = [[p.grad for p in m.parameters()] for m in (model, reference, truth)]
    check_outputs(names, *grads, torch.bfloat16, peer_name="HF")


# ---------------------------------------------------------------- GPU only
def test_llama8b_shapes():
    need_gpu()
    # One LLaMA-3.1-8B attention layer at 2 x 2048 tokens, HF layout, bf16.
    inputs = make_inputs(2, 2048, 32, 8, 128, torch.bfloat16)
    compare_to_truth(*inputs)


def test_int64_offsets():
    need_gpu()
    # q of 1 x 32 x 540,000 x 128 = 2.2e9 elements > 2**31: int32 offsets would wrap.
    seq_len, n_q, n_k, d = 540_000, 32, 8, 128
    q, k, cos, sin, dq_out, dk_out = make_inputs(1, seq_len, n_q, n_k, d, torch.bfloat16)
    q_embed, k_embed, dq, dk = run(rope, q, k, cos, sin, dq_out, dk_out)
    sample = torch.tensor([0, 1, 270_000, 524_287, 524_288, seq_len - 1], device="cuda")  # 524,288 * 4096 = 2**31
    sub = lambda t: t[:, :, sample]  # noqa: E731
    ref = run(rope_reference, sub(q), sub(k), cos[:, sample], sin[:, sample], sub(dq_out), sub(dk_out))
    for name, a, b in zip(("q_embed", "k_embed", "dq", "dk"), (q_embed, k_embed, dq, dk), ref):
        if name.endswith("embed"):
            assert torch.equal(sub(a), b), f"{name} on sampled tokens differs from HF"
        else:
            err = rel_err(sub(a), b)
            assert err < 1e-2, f"{name} on sampled tokens: {err:.2e}"


def test_cuda_graph_capture():
    need_gpu()
    q, k, cos, sin, dq_out, dk_out = make_inputs(2, 512, 32, 8, 128, torch.bfloat16)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up compiles the kernels outside the capture
        for _ in range(2):
            torch.autograd.grad(rope(q, k, cos, sin), (q, k), (dq_out, dk_out))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_embed, k_embed = rope(q, k, cos, sin)
        dq, dk = torch.autograd.grad((q_embed, k_embed), (q, k), (dq_out, dk_out))
    new = make_inputs(2, 512, 32, 8, 128, torch.bfloat16, seed=1)
    with torch.no_grad():
        q.copy_(new[0])
        k.copy_(new[1])
    graph.replay()
    torch.cuda.synchronize()
    eager = run(rope, new[0], new[1], cos, sin, dq_out, dk_out)
    for name, a, b in zip(("q_embed", "k_embed", "dq", "dk"), (q_embed, k_embed, dq, dk), eager):
        assert torch.equal(a, b), f"{name}: replay differs from eager"



def test_create_graph_is_refused():
    q, k, cos, sin, _, _ = make_inputs(1, 5, 2, 1, 8, torch.float32)
    q = q.detach().requires_grad_()
    q_embed, k_embed = rope(q, k, cos, sin)
    with pytest.raises(RuntimeError, match="rope: create_graph=True"):
        torch.autograd.grad(q_embed.sum(), q, create_graph=True)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))
