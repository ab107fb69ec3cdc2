"""
Tests of the packed flash attention (attention_kernel.py, Step 21).

* forward and the gradients of q, k and v against a float64 truth computed
  document by document, no worse than twice PyTorch's error at the same dtype
  (conftest.check_outputs): documents of length 1, one document filling the row,
  many short ones, a padding tail (a document of its own), GQA ratios 1, 4 and 8,
  head dims 16, 24 (padded to 32) and 64, rows that end inside a tile;
* document starts and ends from position ids; bad input named in one line;
* in a model: a packed batch without a mask gives the loss and gradients of the
  dense-mask path (float32, 1e-4); families whose attention does more are
  refused in one line; torch.compile (fullgraph) runs the operator;
* on a GPU: bf16 rows of 1,024 tokens, head dim 128, GQA 4.

Usage:
    python -m pytest attention_test.py -v
    python attention_test.py
"""

import contextlib
import io
import math
import sys

import pytest
import torch

from conftest import DEVICE, check_outputs, need_gpu

import attention_kernel
import attention_routing
from kernel_ft import dataloader, flags, models, training
from attention_kernel import attention_reference, document_ends, document_starts, packed_attention
from kernel_ft.run import apply_kernels
from tools.family_matrix import family_config


def positions_of(rows, T):
    """[B, T] position ids of rows of documents (lengths), the rest a padding document."""
    out = torch.zeros(len(rows), T, dtype=torch.long)
    for b, lengths in enumerate(rows):
        pieces = [torch.arange(n) for n in lengths]
        used = sum(lengths)
        if used < T:
            pieces.append(torch.arange(T - used))
        out[b] = torch.cat(pieces)[:T]
    return out


def run(q, k, v, doc_start, dout, fn):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, doc_start)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def ours(window=0, softcap=0.0):
    return lambda q, k, v, doc_start: packed_attention(q, k, v, doc_start, window=window, softcap=softcap)


def reference(window=0, softcap=0.0):
    return lambda q, k, v, doc_start: attention_reference(q, k, v, doc_start, 1.0 / math.sqrt(q.shape[-1]),
                                                          window, softcap).transpose(1, 2)


CASES = {  # rows of document lengths, T, query heads, key/value heads, head dim, sliding window, score cap
    "one document": ([[57]], 57, 4, 4, 16, 0, 0.0),
    "lengths of 1": ([[1] * 40], 40, 4, 1, 16, 0, 0.0),
    "many short, GQA 4": ([[3, 1, 9, 2, 17, 5, 11, 4]], 52, 8, 2, 16, 0, 0.0),
    "padding tail, GQA 8": ([[20, 13], [7, 30, 2]], 61, 8, 1, 16, 0, 0.0),
    "head dim 24": ([[16, 18, 1, 9]], 44, 4, 2, 24, 0, 0.0),
    "head dim 64, two rows": ([[33, 31], [64]], 64, 2, 1, 64, 0, 0.0),
    "sliding window 7": ([[40, 3, 17]], 60, 4, 2, 16, 7, 0.0),
    "sliding window 20, one document": ([[50]], 50, 2, 2, 16, 20, 0.0),
    # Whole tiles inside a document that starts mid-tile: the unmasked runs of every kernel.
    "long document between short ones": ([[5, 70, 9]], 84, 4, 2, 16, 0, 0.0),
    "sliding window 33, long documents": ([[3, 90], [93]], 93, 2, 1, 16, 33, 0.0),
    # Gemma-2's soft-capped scores (cap tanh(s / cap)); caps small enough to bend most
    # scores of these random rows (Gemma-2's own is 50), with windows and GQA.
    "soft cap 2, GQA 2": ([[20, 13], [33]], 33, 4, 2, 16, 0, 2.0),
    "soft cap 1.5, sliding window 9, long document": ([[5, 70, 9]], 84, 4, 2, 16, 9, 1.5),
    "head dim 128, soft cap 3": ([[20, 12]], 32, 2, 1, 128, 0, 3.0),
    "head dim 256, soft cap 3, window 8": ([[9, 23]], 32, 2, 1, 256, 8, 3.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_truth(case, dtype):
    rows, T, Hq, Hkv, D, window, softcap = CASES[case]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(rows), Hq, T, D, generator=g)
    k = torch.randn(len(rows), Hkv, T, D, generator=g)
    v = torch.randn(len(rows), Hkv, T, D, generator=g)
    dout = torch.randn(len(rows), T, Hq, D, generator=g)
    doc_start = document_starts(positions_of(rows, T)).to(DEVICE)
    q, k, v, dout = (t.to(DEVICE, dtype) for t in (q, k, v, dout))
    got = run(q, k, v, doc_start, dout, ours(window, softcap))
    peer = run(q, k, v, doc_start, dout, reference(window, softcap))
    truth = run(q.double(), k.double(), v.double(), doc_start, dout.double(), reference(window, softcap))
    check_outputs(["out", "dq", "dk", "dv"], got, peer, truth)


@pytest.mark.parametrize("case", ["padding tail, GQA 8", "long document between short ones",
                                  "head dim 256, soft cap 3, window 8"])
def test_pointer_loads_give_what_tma_loads_give(case, monkeypatch):
    """The forward and dK/dV kernels read tiles through TMA descriptors where the layout
    allows (the truth test above runs that path); the plain pointer loads they fall
    back to compute the same numbers."""
    rows, T, Hq, Hkv, D, window, softcap = CASES[case]
    g = torch.Generator().manual_seed(2)
    q, dout = torch.randn(len(rows), Hq, T, D, generator=g), torch.randn(len(rows), T, Hq, D, generator=g)
    k, v = torch.randn(len(rows), Hkv, T, D, generator=g), torch.randn(len(rows), Hkv, T, D, generator=g)
    q, k, v, dout = (t.to(DEVICE, torch.bfloat16) for t in (q, k, v, dout))
    doc_start = document_starts(positions_of(rows, T)).to(DEVICE)
    hopper = attention_kernel.INTERPRET or torch.cuda.get_device_capability() >= (9, 0)
    assert attention_kernel._tma_ok(q, k, v, dout) == hopper
    tma = run(q, k, v, doc_start, dout, ours(window, softcap))
    monkeypatch.setattr(attention_kernel, "USE_TMA", False)
    pointers = run(q, k, v, doc_start, dout, ours(window, softcap))
    check_outputs(["out", "dq", "dk", "dv"], pointers, tma, run(q.double(), k.double(), v.double(), doc_start,
                                                                  dout.double(), reference(window, softcap)))


def test_tma_only_for_layouts_the_copies_allow():
    x = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    hopper = attention_kernel.INTERPRET or torch.cuda.get_device_capability() >= (9, 0)
    assert attention_kernel._tma_ok(x) == hopper
    assert attention_kernel._tma_ok(x[..., :12]) == hopper  # 12 columns of rows 32 bytes apart: the copy clips
    assert not attention_kernel._tma_ok(torch.randn(1, 4, 8, 12, dtype=torch.bfloat16, device=DEVICE))  # 24-byte rows
    assert not attention_kernel._tma_ok(x.flatten()[1:].view(1, 1, 1, -1)[..., :16].expand(1, 4, 8, 16))  # stride 0
    odd = torch.randn(1 * 4 * 8 * 16 + 1, dtype=torch.bfloat16, device=DEVICE)[1:].view(1, 4, 8, 16)
    assert not attention_kernel._tma_ok(odd)  # starts 2 bytes past an aligned address


def test_non_contiguous_inputs_and_upstream_gradient():
    """HF hands q, k, v as transposed views of [B, T, H, D] projections."""
    g = torch.Generator().manual_seed(1)
    B, T, Hq, Hkv, D = 2, 33, 4, 2, 16
    q = torch.randn(B, T, Hq, D, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, generator=g).to(DEVICE).transpose(1, 2)
    dout = torch.randn(B, T, Hq, 2 * D, generator=g).to(DEVICE)[..., ::2]  # strided last dim: copied
    doc_start = document_starts(positions_of([[10, 23], [33]], T)).to(DEVICE)
    got = run(q, k, v, doc_start, dout, ours())
    want = run(q.contiguous(), k.contiguous(), v.contiguous(), doc_start, dout.contiguous(), ours())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_document_starts_and_ends():
    positions = positions_of([[3, 1, 4]], 10)  # a padding document of 2 at the end
    starts = document_starts(positions)
    assert starts.tolist() == [[0, 0, 0, 3, 4, 4, 4, 4, 8, 8]] and starts.dtype == torch.int32
    assert document_ends(starts).tolist() == [[3, 3, 3, 4, 8, 8, 8, 8, 10, 10]]
    assert document_starts(torch.arange(6)[None]).tolist() == [[0] * 6]  # one document: plain causal
    assert document_starts(torch.arange(6)[None] + 40).tolist() == [[0] * 6]  # from any start
    # transformers' rule: a document begins wherever the position does not follow by 1
    # (not only at a 0): a restart at 1, a jump forward, a step back.
    positions = torch.tensor([[0, 1, 2, 1, 2, 3, 9, 10, 4, 5]])
    assert document_starts(positions).tolist() == [[0, 0, 0, 3, 3, 3, 6, 6, 8, 8]]


def test_bad_inputs():
    q = torch.randn(1, 4, 8, 16, device=DEVICE)
    k = torch.randn(1, 2, 8, 16, device=DEVICE)
    starts = torch.zeros(1, 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="3 key/value heads"):
        packed_attention(q, torch.randn(1, 3, 8, 16, device=DEVICE), torch.randn(1, 3, 8, 16, device=DEVICE), starts)
    with pytest.raises(ValueError, match="must be \\[B, Hkv, T, D\\]"):
        packed_attention(q, k, torch.randn(1, 2, 7, 16, device=DEVICE), starts)
    with pytest.raises(TypeError, match="one dtype"):
        packed_attention(q, k.double().float().half(), k.half(), starts)
    with pytest.raises(ValueError, match="doc_start must be an int32"):
        packed_attention(q, k, k, starts.long())
    with pytest.raises(ValueError, match="doc_end must be None or an int32"):
        packed_attention(q, k, k, starts, doc_end=document_ends(starts).long())
    with pytest.raises(ValueError, match="doc_end must be None or an int32 \\[B, T\\] = \\[1, 8\\]"):
        packed_attention(q, k, k, starts, doc_end=document_ends(starts)[:, :4])
    with pytest.raises(ValueError, match="head dim 300"):
        packed_attention(torch.randn(1, 1, 2, 300), torch.randn(1, 1, 2, 300), torch.randn(1, 1, 2, 300),
                         torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="must be a \\[B, H, T, D\\]"):
        packed_attention(q[0], k, k, starts)


# --------------------------------------------------------------------------------
# In a model
# --------------------------------------------------------------------------------
def packed_batch(model, rows, T):
    """A packed batch of random tokens with the dense block mask, as the dataloader makes it."""
    g = torch.Generator().manual_seed(2)
    positions = positions_of(rows, T)
    document = (positions == 0).long().cumsum(-1)
    ids = torch.randint(3, model.config.vocab_size, positions.shape, generator=g)
    batch = dataloader.lm_batch(ids.to(DEVICE))
    batch["position_ids"] = positions.to(DEVICE)
    batch["attention_mask"] = dataloader.block_causal_mask(document).to(DEVICE)
    return batch


def loss_and_grads(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type, extra", [("llama", {}), ("qwen2", {}), ("phi3", {"pad_token_id": 0})])
def test_packed_model_matches_the_dense_mask(model_type, extra):
    torch.manual_seed(0)
    model = models.build_random(family_config(model_type, extra), torch.device(DEVICE), torch.float32)
    batch = packed_batch(model, [[9, 4, 13, 6], [20, 12]], 32)
    want_loss, want_grads = loss_and_grads(model, training.hf_loss, batch)
    with contextlib.redirect_stdout(io.StringIO()):
        apply_kernels(model, {"attention": True})
    assert model.config._attn_implementation == attention_routing.NAME
    maskless = {**batch, "attention_mask": None}  # what the dataloader gives with the kernel on
    loss, grads = loss_and_grads(model, training.hf_loss, maskless)
    assert abs(loss.item() - want_loss.item()) <= 1e-4
    assert grads.keys() == want_grads.keys()
    for name in grads:
        scale = max(want_grads[name].abs().max().item(), 1.0)
        assert (grads[name] - want_grads[name]).abs().max().item() <= 1e-4 * scale, name


def test_document_bounds_are_made_once_a_step():
    """Every layer reads the step's position ids: their document starts (one cummax) and ends (one
    cummin) are made once a step in an eager step, not once a layer; the next batch's anew. (The
    dense-mask test above checks that the layers given those bounds compute the right gradients.)"""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = models.build_random(family_config("llama", {}), torch.device(DEVICE), torch.float32)
    assert model.config.num_hidden_layers >= 2
    with contextlib.redirect_stdout(io.StringIO()):
        apply_kernels(model, {"attention": True})
    for rows in ([[9, 4, 13, 6], [20, 12]], [[3, 29], [16, 16]]):
        batch = dict(packed_batch(model, rows, 32), attention_mask=None)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss_and_grads(model, training.hf_loss, batch)
        names = [event.name for event in prof.events()]
        assert names.count("aten::_cummax_helper") == 1 and names.count("aten::_cummin_helper") == 1, rows


@pytest.mark.parametrize("model_type, extra", [("llama", {}), ("qwen3", {}), ("phi3", {"pad_token_id": 0})])
def test_strided_dq_flows_through_the_patched_model(model_type, extra, monkeypatch):
    """On a Hopper GPU the backward may return dq as a strided view of its float32 buffer (rows 2 x D
    apart, attention_hopper_kernel.cast_in_place). Given that layout here (the same values), every
    kernel the gradient meets next in a patched model (RoPE's backward, a q norm, the projections)
    takes it: the same loss and gradients, bit for bit, as with a contiguous dq."""
    torch.manual_seed(0)
    model = models.build_random(family_config(model_type, extra), torch.device(DEVICE), torch.float32)
    batch = dict(packed_batch(model, [[9, 4, 13, 6], [20, 12]], 32), attention_mask=None)
    with contextlib.redirect_stdout(io.StringIO()):
        apply_kernels(model, {name: True for name in ("attention", "rope", "rmsnorm", "swiglu")})
    want_loss, want_grads = loss_and_grads(model, training.hf_loss, batch)
    original, views = attention_kernel.attention_backward, []

    def strided_dq(*args):
        dq, dk, dv = original(*args)
        view = dq.new_empty(*dq.shape[:-1], 2 * dq.shape[-1])[..., :dq.shape[-1]].copy_(dq)
        views.append(view)
        return view, dk, dv

    monkeypatch.setattr(attention_kernel, "attention_backward", strided_dq)
    loss, grads = loss_and_grads(model, training.hf_loss, batch)
    assert len(views) == model.config.num_hidden_layers and not views[0].is_contiguous()
    assert torch.equal(loss, want_loss) and grads.keys() == want_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], want_grads[name]), name


def test_rows_without_position_ids_reach_the_kernel_as_one_document(monkeypatch):
    """A call with no position ids holds one document per row: the decoder says so to every layer,
    and the kernel gets one_document_rows (what lets the Hopper forward take them, no host sync);
    packed rows get their documents' starts. Both as HF computes them (loss against the dense mask)."""
    torch.manual_seed(0)
    model = models.build_random(family_config("llama", {}), torch.device(DEVICE), torch.float32)
    batch = packed_batch(model, [[9, 4, 13, 6], [20, 12]], 32)
    plain = dict(batch, attention_mask=None, position_ids=None)
    want = [loss_and_grads(model, training.hf_loss, b)[0] for b in (batch, plain)]
    with contextlib.redirect_stdout(io.StringIO()):
        apply_kernels(model, {"attention": True})
    seen = []
    original = attention_routing.packed_attention

    def spy(q, k, v, doc_start, *args):
        seen.append(attention_kernel._one_document(doc_start))
        return original(q, k, v, doc_start, *args)

    monkeypatch.setattr(attention_routing, "packed_attention", spy)
    for b, loss_wanted, one in ((dict(batch, attention_mask=None), want[0], False), (plain, want[1], True)):
        seen.clear()
        loss = loss_and_grads(model, training.hf_loss, b)[0]
        assert abs(loss.item() - loss_wanted.item()) <= 1e-4
        assert seen and all(s == one for s in seen), (one, seen)


def test_sliding_window_model_matches_hf():
    """A family with a sliding window shorter than the row (Mistral's config here): HF
    builds its own sliding mask for an unpacked row; ours applies the same window."""
    torch.manual_seed(0)
    model = models.build_random(family_config("mistral", {"sliding_window": 8}), torch.device(DEVICE),
                                torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(5))
    batch = dataloader.lm_batch(ids.to(DEVICE))
    want_loss, want_grads = loss_and_grads(model, training.hf_loss, batch)
    with contextlib.redirect_stdout(io.StringIO()):
        apply_kernels(model, {"attention": True})
    loss, grads = loss_and_grads(model, training.hf_loss, batch)
    assert abs(loss.item() - want_loss.item()) <= 1e-4
    for name in grads:
        scale = max(want_grads[name].abs().max().item(), 1.0)
        assert (grads[name] - want_grads[name]).abs().max().item() <= 1e-4 * scale, name


def test_dense_mask_carries_the_sliding_window():
    """--no-use-custom-attention on packed rows of a sliding-window family: the dense
    mask HF applies as given must hold the window (every layer slides here), and then
    gives the kernel's loss and gradients; the mask is the kernel's visible_keys."""
    positions = positions_of([[20, 3, 9]], 32)
    document = (positions == 0).long().cumsum(-1)
    mask = dataloader.block_causal_mask(document, window=8)
    assert torch.equal(mask[:, 0], attention_kernel.visible_keys(document_starts(positions), 8))
    torch.manual_seed(0)
    model = models.build_random(family_config("mistral", {"sliding_window": 8}), torch.device(DEVICE), torch.float32)
    args = flags.settle(__import__("finetune_optimized").parse_args(
        ["--tiny", "--seq-len", "32", "--no-use-custom-attention"]))
    assert models.dense_mask_window(args, object(), model.config) == 8
    batch = packed_batch(model, [[20, 3, 9]], 32)
    batch["attention_mask"] = mask.to(DEVICE)
    want_loss, want_grads = loss_and_grads(model, training.hf_loss, batch)
    with contextlib.redirect_stdout(io.StringIO()):
        apply_kernels(model, {"attention": True})
    loss, grads = loss_and_grads(model, training.hf_loss, {**batch, "attention_mask": None})
    assert abs(loss.item() - want_loss.item()) <= 1e-4
    for name in grads:
        scale = max(want_grads[name].abs().max().item(), 1.0)
        assert (grads[name] - want_grads[name]).abs().max().item() <= 1e-4 * scale, name


def test_dense_mask_window_refuses_mixed_layers():
    short = flags.settle(__import__("finetune_optimized").parse_args(
        ["--tiny", "--seq-len", "4096", "--no-use-custom-attention"]))
    long = flags.settle(__import__("finetune_optimized").parse_args(
        ["--tiny", "--seq-len", "8192", "--no-use-custom-attention"]))
    kernel = flags.settle(__import__("finetune_optimized").parse_args(["--tiny", "--seq-len", "8192"]))
    gemma2 = family_config("gemma2", {})  # sliding (4,096) and full layers alternate
    assert models.dense_mask_window(short, object(), gemma2) == 0  # rows no longer than the window
    assert models.dense_mask_window(kernel, object(), gemma2) == 0  # the kernel takes each layer's window
    assert models.dense_mask_window(long, None, gemma2) == 0  # synthetic rows: one document, HF's own masks
    with pytest.raises(SystemExit, match=r"^error: --packing with a dense mask: gemma2 mixes sliding-window "
                                         r"\(4096 tokens\) and full attention layers"):
        models.dense_mask_window(long, object(), gemma2)
    qwen2 = family_config("qwen2", {"use_sliding_window": True, "sliding_window": 8})
    assert models.dense_mask_window(long, object(), qwen2) == 0  # its layers all attend in full


def test_dataloader_leaves_the_mask_out():
    args = flags.settle(__import__("finetune_optimized").parse_args(["--tiny"]))
    # None: on where it applies (run.assemble puts the mask back where it cannot go in).
    assert flags.kernels_from_args(args)["attention"] is None and models.document_attention(args)
    off = flags.settle(__import__("finetune_optimized").parse_args(["--tiny", "--no-use-custom-attention"]))
    assert not models.document_attention(off)
    synthetic = __import__("finetune_optimized").parse_args(["--tiny", "--dataset", "synthetic"])
    assert not flags.kernels_from_args(synthetic)["attention"]  # one document per row: SDPA's own
    baseline = __import__("finetune_baseline").parse_args(["--tiny", "--packing"])
    assert not models.document_attention(baseline)  # the baseline keeps the dense mask
    data = dataloader.prepare_data(args, dataloader.load_records(args.dataset), 8192)
    batch = dataloader.StepBatches(data.train, 2, 128, True, 0, data.pad_id, dense_mask=False)[0]
    assert batch["attention_mask"] is None and batch["position_ids"] is not None


def test_soft_capped_family_runs_the_kernel():
    """Gemma-2's capped scores (cap tanh(s / cap)): packed rows through the kernel give
    the loss and gradients of its own eager attention with the dense block mask. The
    random weights' scores are small: q and k are scaled up and the cap is 0.1, so that
    it bends them (the loss moves by ~1e-2 without it)."""
    positions = positions_of([[20, 3, 9]], 32)
    mask = dataloader.block_causal_mask((positions == 0).long().cumsum(-1))
    torch.manual_seed(0)
    model = models.build_random(family_config("gemma2", {"attn_logit_softcapping": 0.1}), torch.device(DEVICE),
                                torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    assert model.config._attn_implementation == "eager"
    batch = packed_batch(model, [[20, 3, 9]], 32)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)  # eager adds it
    want_loss, want_grads = loss_and_grads(model, training.hf_loss, {**batch, "attention_mask": additive.to(DEVICE)})
    with contextlib.redirect_stdout(io.StringIO()):
        apply_kernels(model, {"attention": True})
    assert model.config._attn_implementation == attention_routing.NAME
    loss, grads = loss_and_grads(model, training.hf_loss, {**batch, "attention_mask": None})
    assert abs(loss.item() - want_loss.item()) <= 1e-4
    for name in grads:
        scale = max(want_grads[name].abs().max().item(), 1.0)
        assert (grads[name] - want_grads[name]).abs().max().item() <= 1e-4 * scale, name


def test_eager_families_take_the_kernel_by_default(tmp_path):
    """A family whose own attention is transformers' eager one (Gemma-2) runs ours by
    default on every row, one document per row included; --no-use-custom-attention
    keeps its own."""
    import json

    family_config("gemma2", {}).save_pretrained(tmp_path / "model")
    ran = {}
    for flag in ([], ["--no-use-custom-attention"]):
        out = tmp_path / f"run{len(flag)}.json"
        with contextlib.redirect_stdout(io.StringIO()):
            __import__("finetune_optimized").main(["--model", str(tmp_path / "model"), "--random-init",
                                                   "--dataset", "synthetic", "--seq-len", "16", "--steps", "1",
                                                   "--warmup-steps", "0", "--json", str(out), *flag])
        ran[bool(flag)] = json.loads(out.read_text())["kernels"]["attention"]
    assert ran == {False: True, True: False}


def test_probe_measures_eager_rounding_also_after_fused_rope():
    """The probe's drift for an eager family is its attention in float64 against its
    own: swapped where the layers look it up, also in the forward copies fuse_rope gives
    them (a drift of 0 would make the probe refuse a correct kernel in bf16)."""
    from rope_kernel import fuse_rope

    torch.manual_seed(0)
    model = models.build_random(family_config("gemma2", {}), torch.device(DEVICE), torch.bfloat16).eval()
    assert fuse_rope(model) == model.config.num_hidden_layers
    ids = torch.arange(1, 9, device=DEVICE)[None]
    with torch.no_grad():
        own = model(input_ids=ids).logits
        with attention_routing._eager_in_float64(model) as wide:
            assert wide
            in_float64 = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert not torch.equal(in_float64, own) and torch.equal(again, own)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bf16_probe_passes_ours_and_refuses_a_wrong_attention(family):
    """In 16-bit weights the probe allows the model's own drift (its eager attention vs
    its SDPA one; Gemma-2's eager attention, soft-capped, vs the same in float64), not
    more: an attention that looks across examples is still refused."""
    from transformers import AttentionInterface

    def across_examples(module, query, key, value, mask, scaling=None, dropout=0.0, **kwargs):
        kwargs.pop("position_ids")  # without them: one causal document per row
        return attention_routing.hf_packed_attention(module, query, key, value, mask, scaling, dropout, **kwargs)

    torch.manual_seed(0)
    model = models.build_random(family_config(family, {"num_hidden_layers": 6}), torch.device(DEVICE), torch.bfloat16)
    assert model.config.num_hidden_layers == 6
    theirs = model.config._attn_implementation
    assert theirs == ("eager" if family == "gemma2" else "sdpa")
    AttentionInterface.register(attention_routing.NAME, attention_routing.hf_packed_attention)
    attention_routing.check_same_attention(model, theirs)  # ours: passes
    try:
        AttentionInterface.register(attention_routing.NAME, across_examples)
        with pytest.raises(attention_routing.SwapMismatch, match="computes something else .* own two"):
            attention_routing.check_same_attention(model, theirs)
        assert model.config._attn_implementation == theirs  # left as it was
    finally:
        AttentionInterface.register(attention_routing.NAME, attention_routing.hf_packed_attention)


def test_inside_torch_compile():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g).to(DEVICE) for _ in range(3))
    doc_start = document_starts(positions_of([[10, 14]], 24)).to(DEVICE)
    compiled = torch.compile(packed_attention, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, doc_start), packed_attention(q, k, v, doc_start), rtol=0, atol=0)
    # The document ends a caller made (the decoder, once for its layers) reach the traced backward:
    # the same gradients as the ends the backward makes itself, eager and traced.
    dout = torch.randn(1, 24, 2, 16, generator=g).to(DEVICE)
    want = run(q, k, v, doc_start, dout, packed_attention)
    ends = document_ends(doc_start)
    for fn in (packed_attention, compiled):
        got = run(q, k, v, doc_start, dout, lambda *a: fn(*a, doc_end=ends))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gpu_bf16_long_rows():
    need_gpu()
    g = torch.Generator().manual_seed(4)
    B, T, Hq, Hkv, D = 2, 1024, 8, 2, 128
    q = torch.randn(B, Hq, T, D, generator=g).cuda().bfloat16()
    k = torch.randn(B, Hkv, T, D, generator=g).cuda().bfloat16()
    v = torch.randn(B, Hkv, T, D, generator=g).cuda().bfloat16()
    dout = torch.randn(B, T, Hq, D, generator=g).cuda().bfloat16()
    doc_start = document_starts(positions_of([[100, 300, 7, 500, 117], [1024]], T)).cuda()
    got = run(q, k, v, doc_start, dout, ours())
    peer = run(q, k, v, doc_start, dout, reference())
    truth = run(q.double(), k.double(), v.double(), doc_start, dout.double(), reference())
    check_outputs(["out", "dq", "dk", "dv"], got, peer, truth)


def test_hopper_forward_reads_each_head_where_it_is():
    """The Gluon forward reads [B, H, T, D] tensors through rank-3 views [X, T, C] (what its TMA
    descriptors describe), head (b, h) at x = b * xb + h * xh, columns from h * ch: HF's layout and
    stacked heads without a copy, anything else copied first. Checked on the CPU, element by element."""
    hopper = attention_kernel.attention_hopper_kernel
    if hopper is None:
        pytest.skip("this Triton has no Gluon")
    g = torch.Generator().manual_seed(6)
    B, H, T, D = 2, 3, 5, 16
    layouts = {"HF": torch.randn(B, T, H, D, generator=g).transpose(1, 2),
               "stacked": torch.randn(B, H, T, D, generator=g),
               "every other token": torch.randn(B, H, 2 * T, D, generator=g)[:, :, ::2],
               "heads padded in a row": torch.randn(B, T, H, 2 * D, generator=g)[..., :D].transpose(1, 2)}
    for name, t in layouts.items():
        view, xb, xh, ch = hopper._rows_view(t)
        assert view.dim() == 3 and view.stride(-1) == 1, name
        for b in range(B):
            for h in range(H):
                assert torch.equal(view[b * xb + h * xh, :, h * ch:h * ch + D], t[b, h]), (name, b, h)
    x = torch.randn(1, 4, 8, 128, dtype=torch.bfloat16)
    assert hopper.supports(x, x, x)
    assert not hopper.supports(x.float(), x.float(), x.float())  # 16-bit only
    assert not hopper.supports(x[..., :96], x[..., :96], x[..., :96])  # head dim 64 or 128
    odd = torch.randn(4 * 8 * 128 + 1, dtype=torch.bfloat16)[1:].view(1, 4, 8, 128)
    assert not hopper.supports(odd, x, x)  # starts 2 bytes past an aligned address


HOPPER_ROWS = {  # rows of document lengths, T, query heads, key/value heads, head dim, HF's [B, T, H, D] layout
    "one document of 1,000, GQA 4": ([[1000]], 1000, 8, 2, 128, True),
    "two rows of one document, GQA 8, head dim 64": ([[257], [257]], 257, 8, 1, 64, True),
    "one token": ([[1]], 1, 2, 1, 128, True),
    "stacked heads, a row ending mid-tile": ([[700]], 700, 4, 4, 128, False),
    "packed, rows ending mid-tile": ([[100, 300, 7, 500, 117], [1024]], 1100, 4, 2, 128, True),
    "packed, head dim 64, lengths of 1 to 5": ([[1, 5, 2, 3, 4] * 40], 600, 4, 4, 64, False),
}


def test_dq_cast_in_place():
    """cast_in_place turns a float32 buffer of rows into 16-bit values inside its own memory, each row's
    copy in the first half of its bytes: every value as torch casts it (the interpreter's bfloat16 cast
    drops the low bits instead of rounding), rows of several programs, the last one part full. Enough rows
    on a GPU that programs run side by side (a program writing another's rows would show here)."""
    hopper = attention_kernel.attention_hopper_kernel
    if hopper is None:
        pytest.skip("no Gluon in this Triton")
    g = torch.Generator().manual_seed(3)
    rows = 7 if attention_kernel.INTERPRET else 40_000
    for D, dtype in ((128, torch.bfloat16), (64, torch.float16), (128, torch.float16)):
        buffer = (torch.randn(5, rows, D, generator=g) * 100).to(DEVICE)
        values = buffer.clone()
        got = hopper.cast_in_place(buffer, dtype)
        assert got.shape == buffer.shape and got.dtype == dtype and got.stride() == (rows * 2 * D, 2 * D, 1)
        assert got.data_ptr() == buffer.data_ptr()
        if dtype == torch.bfloat16 and attention_kernel.INTERPRET:
            want = (values.view(torch.int32) & -65536).view(torch.float32).to(dtype)
        else:
            want = values.to(dtype)
        assert torch.equal(got, want)
    for buffer, dtype in ((torch.zeros(4, 128, dtype=torch.float16), torch.bfloat16),
                          (torch.zeros(128, 4).t(), torch.bfloat16), (torch.zeros(4, 96), torch.bfloat16),
                          (torch.zeros(4, 128), torch.float32)):
        with pytest.raises(ValueError, match="cast_in_place"):
            hopper.cast_in_place(buffer.to(DEVICE), dtype)


def hopper_inputs(case, seed):
    """The Hopper kernels' test rows of HOPPER_ROWS[case] on an H100 / H200 (skipped elsewhere):
    (rows, T, Hq, D, q, k, v in bf16, their document starts, the generator for more)."""
    need_gpu()
    if torch.cuda.get_device_capability() != (9, 0) or attention_kernel.attention_hopper_kernel is None:
        pytest.skip("the Gluon kernels run on Hopper only")
    rows, T, Hq, Hkv, D, hf = HOPPER_ROWS[case]
    g = torch.Generator().manual_seed(seed)
    make = ((lambda h: torch.randn(len(rows), T, h, D, generator=g).transpose(1, 2)) if hf
            else (lambda h: torch.randn(len(rows), h, T, D, generator=g)))
    q, k, v = (make(h).cuda().bfloat16() for h in (Hq, Hkv, Hkv))
    return rows, T, Hq, D, q, k, v, document_starts(positions_of(rows, T)).cuda(), g


@pytest.mark.parametrize("case", list(HOPPER_ROWS))
def test_hopper_forward_matches_truth_and_the_triton_forward(case, monkeypatch):
    """On an H100 / H200, 16-bit rows of one document (one_document_rows) of head dim 64 or 128 go
    through the Gluon forward (attention_hopper_kernel.py): fwd+bwd against float64 and against the
    same rows with the Triton forward. Packed rows stay with the Triton forward; the Gluon kernel's
    own document path is checked on them directly, forward and log-sum-exp."""
    rows, T, Hq, D, q, k, v, packed_starts, g = hopper_inputs(case, seed=5)
    scale = 1.0 / math.sqrt(D)
    if any(len(lengths) > 1 for lengths in rows):
        assert not attention_kernel._hopper_forward_ok(q, k, v, packed_starts, 0, 0.0)
        out, lse = attention_kernel.attention_hopper_kernel.attention_forward_hopper(q, k, v, scale, packed_starts)
        triton_out, triton_lse = attention_kernel.attention_forward(q, k, v, packed_starts, scale, 0, 0.0)
        truth = attention_reference(q.double(), k.double(), v.double(), packed_starts, scale).transpose(1, 2)
        check_outputs(["out"], [out], [triton_out], [truth], peer_name="the Triton forward")
        torch.testing.assert_close(lse, triton_lse, rtol=0, atol=1e-4)  # both log2 units, float32 sums
        return
    doc_start = attention_kernel.one_document_rows(len(rows), T, q.device)
    assert attention_kernel._hopper_forward_ok(q, k, v, doc_start, 0, 0.0)
    # What stays with the Triton forward: the same rows given as packed ones (one token is one document
    # either way), a window, a cap, float32.
    assert attention_kernel._hopper_forward_ok(q, k, v, packed_starts, 0, 0.0) == (T == 1)
    for window, softcap, x in ((7, 0.0, q), (0, 2.0, q), (0, 0.0, q.float())):
        assert not attention_kernel._hopper_forward_ok(x, k, v, doc_start, window, softcap)
    dout = torch.randn(len(rows), T, Hq, D, generator=g).cuda().bfloat16()
    gluon = run(q, k, v, doc_start, dout, ours())
    monkeypatch.setattr(attention_kernel, "USE_HOPPER_FORWARD", False)
    triton_forward = run(q, k, v, doc_start, dout, ours())
    truth = run(q.double(), k.double(), v.double(), packed_starts, dout.double(), reference())
    check_outputs(["out", "dq", "dk", "dv"], gluon, triton_forward, truth, peer_name="the Triton forward")


@pytest.mark.parametrize("case", list(HOPPER_ROWS))
def test_hopper_backward_matches_truth_and_the_triton_backward(case, monkeypatch):
    """On an H100 / H200: the Gluon backward (five products per tile) against float64 and against
    the Triton backward on the same rows, dQ summed by relaxed atomics and, where Triton has them
    (3.8 on), by TMA reductions, its programs in groups of key/value heads of several sizes, dQ cast
    in place or not, the gradients in the inputs' layout (grads_like_inputs: a transposed view of HF's
    [B, T, H, D] where q, k and v are such views) or contiguous; attention_backward takes it on rows of
    one document where TMA reductions exist, and on packed rows behind USE_HOPPER_BACKWARD_PACKED where
    dQ may be a view (and then asks for the inputs' layout)."""
    rows, T, Hq, D, q, k, v, starts, g = hopper_inputs(case, seed=7)
    hopper = attention_kernel.attention_hopper_kernel
    dout = torch.randn(len(rows), T, Hq, D, generator=g).cuda().bfloat16()
    packed = any(len(lengths) > 1 for lengths in rows)
    scale = 1.0 / math.sqrt(D)
    out, lse = attention_kernel.attention_forward(q, k, v, starts, scale, 0, 0.0)
    delta = attention_kernel.backward_delta(out, dout)
    monkeypatch.setattr(attention_kernel, "USE_HOPPER_BACKWARD", False)
    triton_grads = attention_kernel.attention_backward(dout, q, k, v, out, lse, starts, scale, 0, 0.0)
    truth = run(q.double(), k.double(), v.double(), starts, dout.double(), reference())[1:]
    # kv_group: the default, one (row, key/value head) pair at a time, three (a last group smaller), all of them;
    # dq cast into its float32 buffer (a strided view) or into a tensor of its own; the gradients in the inputs' layout
    like = {"grads_like_inputs": True}
    modes = [{"dq_tma": False}, {"dq_tma": False, "kv_group": 3}, {"dq_tma": False, "dq_in_place": True},
             {"dq_tma": False, **like}]
    if hopper.TMA_REDUCE:
        modes += [{"dq_tma": True}, {"dq_tma": True, "kv_group": 1}, {"dq_tma": True, "kv_group": 3},
                  {"dq_tma": True, "kv_group": len(rows) * k.shape[1]}, {"dq_tma": True, "dq_in_place": True},
                  {"dq_tma": True, **like}, {"dq_tma": True, "dq_in_place": True, **like}]
    hf = HOPPER_ROWS[case][-1]
    for opts in modes:
        got = hopper.attention_backward_hopper(dout, q, k, v, lse, delta, document_ends(starts) if packed else None,
                                               scale, **opts)
        check_outputs(["dq", "dk", "dv"], got, triton_grads, truth, peer_name="the Triton backward")
        for grad, x in zip(got, (q, k, v)):
            if grad is got[0] and opts.get("dq_in_place"):
                assert not grad.is_contiguous()  # a view of its float32 buffer
                continue
            if hf and opts.get("grads_like_inputs"):
                assert grad.stride() == x.stride()  # the layers' backward reshapes it without a copy
            else:
                assert grad.is_contiguous()
    monkeypatch.setattr(attention_kernel, "USE_HOPPER_BACKWARD", True)
    one = attention_kernel.one_document_rows(len(rows), T, q.device)
    assert attention_kernel._hopper_backward_ok(q, k, v, one, 0, 0.0) == hopper.TMA_REDUCE
    assert attention_kernel._hopper_backward_ok(q, k, v, starts, 0, 0.0) == (T == 1 and hopper.TMA_REDUCE)
    for window, softcap, x in ((7, 0.0, q), (0, 2.0, q), (0, 0.0, q.float())):
        assert not attention_kernel._hopper_backward_ok(x, k, v, one, window, softcap)
    if not packed:  # the routed call, as autograd makes it in eager mode (dq a view) and traced (dq contiguous)
        for dq_view in (True, False):
            routed = attention_kernel.attention_backward(dout, q, k, v, out, lse, one, scale, 0, 0.0, dq_view)
            check_outputs(["dq", "dk", "dv"], routed, triton_grads, truth, peer_name="the Triton backward")
            assert routed[0].is_contiguous() == (not dq_view or not hopper.TMA_REDUCE)
            for grad, x in zip(routed[1:], (k, v)):  # in the inputs' layout in eager mode
                assert grad.stride() == x.stride() if dq_view and hopper.TMA_REDUCE else grad.is_contiguous()
    monkeypatch.setattr(attention_kernel, "USE_HOPPER_BACKWARD_PACKED", True)  # packed rows, dq cast in place
    takes = attention_kernel._hopper_backward_ok(q, k, v, starts, 0, 0.0, dq_view=True)
    assert takes == hopper.TMA_REDUCE
    if takes:
        ends = document_ends(starts)
        strided_ends = torch.stack([ends, ends], dim=-1)[..., 0]  # the same values, every other int32
        for dq_view in (True, False):  # without the view: the Triton backward (dQ's two buffers: memory)
            for doc_end in (None, strided_ends):  # made by the backward, or the caller's in any layout
                routed = attention_kernel.attention_backward(dout, q, k, v, out, lse, starts, scale, 0, 0.0,
                                                             dq_view, doc_end)
                check_outputs(["dq", "dk", "dv"], routed, triton_grads, truth, peer_name="the Triton backward")
                assert routed[0].is_contiguous() != dq_view


def test_rows_of_one_document_as_a_broadcast_start():
    """one_document_rows gives doc_start as one broadcast zero, which the launchers read as rows of
    one document without a host sync; every kernel computes on it what it computes on the same
    rows given by their position ids (the Triton kernels on a contiguous copy), fwd+bwd."""
    B, T, H, D = 2, 37, 2, 16
    for b, t in ((B, T), (1, T), (1, 1), (3, 1)):  # a dim of size 1 keeps its stride in a broadcast
        one = attention_kernel.one_document_rows(b, t, DEVICE)
        assert one.shape == (b, t) and one.dtype == torch.int32 and attention_kernel._one_document(one)
    one = attention_kernel.one_document_rows(B, T, DEVICE)
    starts = document_starts(torch.arange(T).expand(B, T).to(DEVICE))
    assert torch.equal(one, starts) and not attention_kernel._one_document(starts)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(DEVICE) for _ in range(3))
    dout = torch.randn(B, T, H, D, generator=g).to(DEVICE)
    for got, want in zip(run(q, k, v, one, dout, ours()), run(q, k, v, starts, dout, ours())):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
