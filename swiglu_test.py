"""
Step 12 (tests) -- Correctness tests for the fused SwiGLU (swiglu_kernel.py).

Every comparison is against a float64 truth (``F.silu(gate) * up`` evaluated in
float64, gradients by autograd): our output and both gradients must be no worse
than about twice the error of the PyTorch path (HF's eager ``F.silu(gate) * up``)
at the same dtype, for irregular sizes, every dtype, strided inputs, and for
``TritonLlamaMLP`` swapped into a LLaMA. The same for GeGLU (``geglu`` against
``F.gelu(gate, approximate="tanh") * up``, Gemma's MLP), for Phi-3's fused
gate_up layout (read in place, one gradient), and for whole Gemma and Phi-3
models; an MLP that computes something else is refused (SwapMismatch) and the
model left as it was. Without a GPU the kernels run in the Triton interpreter
and the GPU-only tests (64-bit offsets, CUDA graphs) are skipped.

Usage:
    python swiglu_test.py          # or: python -m pytest swiglu_test.py
"""

import copy
import sys

import pytest
import torch

from conftest import DEVICE, DTYPES, check_outputs, need_gpu, rel_err, saved_bytes
from swap_common import SwapMismatch
import swiglu_kernel
from swiglu_kernel import TritonSwiGLUFunction, geglu, geglu_reference, swiglu, swiglu_reference
from swiglu_kernel import (
    TritonGateUpMLP,
    TritonLlamaMLP,
    check_same_mlp,
    module_activation,
    replace_swiglu,
    swiglu_down_proj,
)


def make_inputs(shape, dtype, seed=0, up_dtype=None):
    """Random gate (wide enough to reach sigmoid's tails), up and upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * 3.0 - 0.5).to(dtype)
    up = torch.randn(shape, generator=g).to(up_dtype or dtype)
    dy = torch.randn(shape, generator=g).to(torch.promote_types(gate.dtype, up.dtype))
    return gate.to(DEVICE), up.to(DEVICE), dy.to(DEVICE)


def run(fn, gate, up, dy):
    """Forward and backward of fn(gate, up) on fresh leaves that keep the inputs' strides."""
    g = gate.detach().requires_grad_()
    u = up.detach().requires_grad_()
    y = fn(g, u)
    y.backward(dy.to(y.dtype))
    return y.detach(), g.grad, u.grad


def compare_to_truth(gate, up, dy, fn=swiglu, reference=swiglu_reference):
    """Ours and PyTorch against float64 for y, d_gate, d_up: ours no worse than ~2x."""
    ours = run(fn, gate, up, dy)
    torch_path = run(reference, gate, up, dy)
    truth = run(reference, gate.double(), up.double(), dy.double())
    check_outputs(("y", "dgate", "dup"), ours, torch_path, truth)


# (shape, dtype): irregular intermediate sizes (1, 7, 123, 4097), 1 and 7 rows,
# every dtype, many short rows in one tile, and a 3-D [batch, seq, I] input.
CASES = [
    pytest.param((7, 123), "fp32", id="fp32 7x123"),
    pytest.param((1, 4097), "fp32", id="fp32 1x4097"),
    pytest.param((7, 1), "fp32", id="fp32 7x1"),
    pytest.param((2, 3, 123), "fp32", id="fp32 2x3x123 (3-D)"),
    pytest.param((7, 4097), "bf16", id="bf16 7x4097"),
    pytest.param((1, 7), "bf16", id="bf16 1x7"),
    pytest.param((300, 7), "bf16", id="bf16 300x7 (many rows/tile)"),
    pytest.param((2, 5, 123), "bf16", id="bf16 2x5x123 (3-D)"),
    pytest.param((7, 123), "fp16", id="fp16 7x123"),
    pytest.param((1, 4097), "fp16", id="fp16 1x4097"),
    pytest.param((7, 1), "fp16", id="fp16 7x1"),
]


@pytest.mark.parametrize("shape,dtype", CASES)
def test_matches_float64_truth(shape, dtype):
    compare_to_truth(*make_inputs(shape, DTYPES[dtype]))


def test_dtype_promotion():
    # bf16 gate, float32 up: silu rounds to bf16, the product is float32 (PyTorch promotion).
    gate, up, dy = make_inputs((7, 123), torch.bfloat16, up_dtype=torch.float32)
    compare_to_truth(gate, up, dy)
    assert swiglu(gate, up).dtype == torch.float32


def test_row_strided_slices_of_fused_projection():
    # gate and up as the two halves of one fused [N, 2I] projection: read in place.
    gate_up, _, _ = make_inputs((7, 2 * 123), torch.bfloat16)
    gate, up = gate_up[:, :123], gate_up[:, 123:]
    dy = make_inputs((7, 123), torch.bfloat16, seed=1)[2]
    assert not gate.is_contiguous() and gate.stride() == (246, 1)
    compare_to_truth(gate, up, dy)
    # The gradient reaches the wide tensor through the slices.
    x = gate_up.detach().requires_grad_()
    swiglu(x[:, :123], x[:, 123:]).backward(dy)
    xr = gate_up.detach().requires_grad_()
    swiglu_reference(xr[:, :123], xr[:, 123:]).backward(dy)
    err = rel_err(x.grad, xr.grad)
    assert err < 1e-2, f"gradient of the fused projection differs from PyTorch's by {err:.2e}"


def test_transposed_inputs():
    # Last dimension not contiguous (stride(-1) != 1): the one layout that is copied.
    gate_t, up_t, dy = make_inputs((123, 7), torch.float32)
    gate, up = gate_t.t(), up_t.t()
    assert gate.stride(-1) != 1
    compare_to_truth(gate, up, dy.t().contiguous())


def test_non_contiguous_upstream_grad():
    gate, up, dy_wide = make_inputs((7, 246), torch.bfloat16)
    gate, up = gate[:, :123].contiguous(), up[:, :123].contiguous()
    dy_rows = dy_wide[:, ::2]  # every other column: stride(-1) == 2
    dy_cols = dy_wide[:, :123].t().contiguous().t()  # column-major
    assert not dy_rows.is_contiguous() and not dy_cols.is_contiguous()
    compare_to_truth(gate, up, dy_rows)
    compare_to_truth(gate, up, dy_cols)


def test_forward_under_no_grad():
    gate, up, _ = make_inputs((7, 123), torch.float32)
    with torch.no_grad():
        y = swiglu(gate.requires_grad_(), up)
    assert not y.requires_grad
    ref = swiglu_reference(gate.detach().double(), up.double())
    err = rel_err(y, ref)
    assert err < 1e-6, f"no_grad forward error {err:.2e}"


def test_one_input_requires_grad():
    gate, up, dy = make_inputs((7, 123), torch.float32)
    truth = run(swiglu_reference, gate.double(), up.double(), dy.double())
    # Only gate (e.g. up_proj frozen and its input detached)...
    g = gate.detach().requires_grad_()
    swiglu(g, up).backward(dy)
    e_g = rel_err(g.grad, truth[1])
    # ... and only up.
    u = up.detach().requires_grad_()
    swiglu(gate, u).backward(dy)
    e_u = rel_err(u.grad, truth[2])
    assert gate.grad is None and up.grad is None
    assert e_g < 1e-6 and e_u < 1e-6, f"dgate {e_g:.2e} dup {e_u:.2e}"


def test_zero_rows():
    gate, up, dy = make_inputs((0, 123), torch.bfloat16)
    y, dg, du = run(swiglu, gate, up, dy)
    assert y.shape == dg.shape == du.shape == (0, 123)
    y3 = swiglu(*make_inputs((2, 0, 41), torch.float32)[:2])
    assert y3.shape == (2, 0, 41)


def test_function_apply_matches_functional():
    # The autograd Function without the checks in swiglu(): same numbers.
    gate, up, _ = make_inputs((3, 41), torch.float16)
    assert torch.equal(TritonSwiGLUFunction.apply(gate, up), swiglu(gate, up))


def test_bad_inputs_raise():
    gate, up, _ = make_inputs((4, 32), torch.float32)
    with pytest.raises(TypeError, match="expects tensors"):
        swiglu(gate, 1.0)
    with pytest.raises(ValueError, match="does not match up shape"):
        swiglu(gate, up[:, :31])
    with pytest.raises(TypeError, match="unsupported gate dtype"):
        swiglu(gate.to(torch.int32), up)
    with pytest.raises(TypeError, match="unsupported up dtype"):
        swiglu(gate, up.double())
    with pytest.raises(ValueError, match="same device"):
        swiglu(gate, up.to("meta"))
    with pytest.raises(ValueError, match="I >= 1"):
        swiglu(gate[0, 0], up[0, 0])


def _tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=257, hidden_size=64, intermediate_size=123, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def _mlp_out_and_grads(mlp, x, dy):
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = mlp(x)
    y.backward(dy.to(y.dtype))
    params = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    return [y.detach(), x.grad] + [p.grad.clone() for p in params]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_from_llama_mlp(dtype):
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg, dtype = _tiny_llama_config(), DTYPES[dtype]
    torch.manual_seed(0)
    hf = LlamaMLP(cfg).to(DEVICE, dtype)
    truth_mlp = copy.deepcopy(hf).double()
    ours = TritonLlamaMLP.from_llama_mlp(hf)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert getattr(ours, name) is getattr(hf, name), f"{name} must be the same module"
        assert getattr(ours, name).weight is getattr(hf, name).weight, f"{name}.weight must be the same Parameter"
    assert ours.config is cfg and (ours.hidden_size, ours.intermediate_size) == (64, 123)
    assert set(ours.state_dict()) == set(hf.state_dict()), "state dict keys must match LlamaMLP's"
    x, _, _ = make_inputs((2, 5, 64), dtype, seed=3)
    dy = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    got = _mlp_out_and_grads(ours, x, dy)
    ref = _mlp_out_and_grads(hf, x, dy)
    true = _mlp_out_and_grads(truth_mlp, x.double(), dy.double())
    assert all(a.dtype == dtype for a in got), f"{dtype}: dtypes {[a.dtype for a in got]}"
    check_outputs(("y", "dx", "dW_gate", "dW_up", "dW_down"), got, ref, true, dtype, peer_name=f"HF {dtype}")
    fresh = TritonLlamaMLP(cfg)
    assert fresh.gate_proj.weight.shape == (123, 64) and fresh.down_proj.weight.shape == (64, 123)


def test_replace_swiglu_in_llama_model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config()).to(DEVICE)
    reference = copy.deepcopy(model)
    params_before = {id(p) for p in model.parameters()}
    ids = torch.randint(0, 257, (2, 16), device=DEVICE)

    count = replace_swiglu(model)
    assert count == 2, f"replaced {count}, expected 2 (one MLP per layer)"
    assert sum(isinstance(m, TritonLlamaMLP) for m in model.modules()) == 2
    assert {id(p) for p in model.parameters()} == params_before, "the Parameters must be the same objects"
    assert replace_swiglu(model) == 0, "a second pass must find nothing left to replace"

    loss = model(ids, labels=ids).loss
    loss_ref = reference(ids, labels=ids).loss
    loss.backward()
    loss_ref.backward()
    e_loss = rel_err(loss, loss_ref)
    e_grad = max(rel_err(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    assert e_loss < 1e-6, f"patched loss differs by {e_loss:.2e}"
    assert e_grad < 1e-4, f"patched gradients differ by up to {e_grad:.2e}"

    # A gated MLP with another activation is not SwiGLU: left alone.
    gelu_model = LlamaForCausalLM(_tiny_llama_config(hidden_act="gelu"))
    assert replace_swiglu(gelu_model) == 0, "an MLP with GELU must not be replaced"
    with pytest.raises(ValueError, match="SiLU and tanh-GELU gating only"):
        TritonLlamaMLP(_tiny_llama_config(hidden_act="gelu"))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fused", [False, True], ids=["gate, up", "gate_up"])
def test_backward_writes_forward_hidden(activation, dtype, fused):
    # swiglu_backward_and_hidden: the backward kernel also writes h for down_proj's
    # weight gradient. h must be swiglu_forward's bits and the gradients
    # swiglu_backward's, whichever gradients are asked for.
    from swiglu_kernel import swiglu_backward, swiglu_backward_and_hidden, swiglu_forward

    gate, up, dy = make_inputs((5, 3, 300), DTYPES[dtype], seed=11)
    if fused:
        gate, up = torch.cat([gate, up], dim=-1), None
    for need_gate, need_up in ((True, True), (True, False), (False, True), (False, False)):
        dg, du, h = swiglu_backward_and_hidden(dy, gate, up, need_gate, need_up, activation)
        assert torch.equal(h, swiglu_forward(gate, up, activation)), (need_gate, need_up)
        for ours, theirs in zip((dg, du), swiglu_backward(dy, gate, up, need_gate, need_up, activation)):
            assert torch.equal(ours, theirs), (need_gate, need_up)
    assert swiglu_backward_and_hidden(dy, gate, up, True, True, activation, store_h=False)[2] is None


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "gate and up frozen"])
def test_down_proj_weight_gradient_from_the_hidden_it_recomputes(frozen):
    # dW_down is dout^T @ h with h the forward's bits: written by the backward kernel
    # when gate and up need gradients, by a forward launch when they do not.
    from swiglu_kernel import swiglu_forward
    from swiglu_kernel import swiglu_down_proj_backward

    gate, up, _ = make_inputs((4, 6, 96), torch.bfloat16, seed=12)
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(13)).to(DEVICE, torch.bfloat16)
    dout = torch.randn(4, 6, 40, generator=torch.Generator().manual_seed(14)).to(DEVICE, torch.bfloat16)
    dg, du, dw = swiglu_down_proj_backward(dout, gate, up, weight, not frozen, not frozen, True)
    h = swiglu_forward(gate, up)
    assert torch.equal(dw, dout.reshape(-1, 40).t() @ h.reshape(-1, 96))
    assert (dg.numel(), du.numel()) == ((0, 0) if frozen else (gate.numel(), up.numel()))


def test_recompute_hidden_instead_of_saving():
    # TritonLlamaMLP's default recomputes h = silu(gate) * up in backward instead of
    # letting down_proj save it: same results, one [N, I] tensor less kept alive.
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = TritonLlamaMLP.from_llama_mlp(LlamaMLP(_tiny_llama_config()).to(DEVICE, torch.bfloat16))
    truth_mlp = copy.deepcopy(mlp.down_proj).double(), copy.deepcopy(mlp.gate_proj).double(), copy.deepcopy(mlp.up_proj).double()
    x, _, _ = make_inputs((3, 7, 64), torch.bfloat16, seed=5)
    dy = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.bfloat16)
    results, saved = {}, {}
    for recompute in (True, False):
        mlp.recompute_hidden = recompute
        for p in mlp.parameters():
            p.grad = None
        xx = x.detach().requires_grad_()
        y, saved[recompute] = saved_bytes(lambda xx=xx: mlp(xx))
        y.backward(dy)
        results[recompute] = [y.detach(), xx.grad] + [p.grad.clone() for p in mlp.parameters()]
    h_bytes = 3 * 7 * 123 * 2
    assert saved[False] - saved[True] == h_bytes, f"saved {saved[True]} vs {saved[False]} bytes, expected {h_bytes} fewer"
    down, gate, up = truth_mlp
    xt = x.detach().double().requires_grad_()
    yt = down(torch.nn.functional.silu(gate(xt)) * up(xt))
    yt.backward(dy.double())
    true = [yt.detach(), xt.grad, gate.weight.grad, up.weight.grad, down.weight.grad]
    check_outputs(("y", "dx", "dW_gate", "dW_up", "dW_down"), results[True], results[False], true, torch.bfloat16,
                  peer_name="h saved")


def _lora_mlp(dtype, dropout=0.0, layout="llama", targets=("gate_proj", "up_proj", "down_proj")):
    """A TritonLlamaMLP (layout "phi3": TritonGateUpMLP, one gate_up_proj) inside a PEFT model,
    LoRA r4 on ``targets`` (B random, not PEFT's zeros, so that every adapter gradient is
    nonzero), routed by lora_kernel.fuse_lora."""
    import peft
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    import lora_kernel

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if layout == "phi3":
                self.mlp = TritonGateUpMLP.from_mlp(Phi3MLP(_tiny_phi3_config()))
            else:
                self.mlp = TritonLlamaMLP.from_llama_mlp(LlamaMLP(_tiny_llama_config()))

        def forward(self, x):
            return self.mlp(x)

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                             target_modules=list(targets))
    model = peft.get_peft_model(Block().to(DEVICE, dtype), config)
    assert lora_kernel.fuse_lora(model) == len(targets)
    return model


LORA_DOWN_CASES = {  # case: (_lora_mlp's arguments, whether h is recomputed)
    "bf16": (dict(dtype=torch.bfloat16), True),
    "float32 under bf16 autocast": (dict(dtype=torch.float32), True),
    "gate_up_proj (Phi-3)": (dict(dtype=torch.bfloat16, layout="phi3", targets=("gate_up_proj", "down_proj")), True),
    # gate and up need no gradient: keeping h beats keeping them both.
    "only down_proj adapted": (dict(dtype=torch.bfloat16, targets=("down_proj",)), False),
    "dropout": (dict(dtype=torch.bfloat16, dropout=0.25), False),
    "hooked down_proj": (dict(dtype=torch.bfloat16), False),
}


@pytest.mark.parametrize("case", list(LORA_DOWN_CASES))
def test_lora_down_proj_recomputes_hidden_with_the_same_bits(case):
    # A LoRA down_proj keeps h for its adapter's dA; TritonSwiGLULoRADownFunction recomputes
    # it in backward: the same output and gradients bit for bit, one [N, I] tensor less kept.
    # With dropout (the adapter reads dropout(h)), a hook on the layer or gate and up frozen,
    # the layer's own call runs: nothing changes.
    arguments, recomputes = LORA_DOWN_CASES[case]
    model = _lora_mlp(**arguments)
    mlp = model.base_model.model.mlp
    hooked = []
    if case == "hooked down_proj":
        mlp.down_proj.register_forward_pre_hook(lambda module, args: hooked.append(args[0].shape))
    x, _, _ = make_inputs((3, 7, 64), torch.bfloat16, seed=5)
    dy = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.bfloat16)
    trained = [p for p in model.parameters() if p.requires_grad]
    results, saved = {}, {}
    for recompute in (True, False):
        mlp.recompute_hidden = recompute
        for p in trained:
            p.grad = None
        # x needs no gradient where only down_proj is adapted: then gate and up need none either.
        xx = x.detach().to(arguments["dtype"]).requires_grad_(case != "only down_proj adapted")
        torch.manual_seed(7)  # dropout's draws
        with torch.autocast(DEVICE.type, torch.bfloat16, enabled="autocast" in case):
            y, saved[recompute] = saved_bytes(lambda xx=xx: model(xx))
        y.backward(dy.to(y.dtype))
        results[recompute] = [y.detach(), xx.grad] + [p.grad.clone() for p in trained]
    assert len(trained) == 2 * len(arguments.get("targets", "abc"))
    assert all(g.abs().sum() > 0 for g in results[True][2:])
    for i, (ours, theirs) in enumerate(zip(results[True], results[False])):
        assert (ours is None and theirs is None) or torch.equal(ours, theirs), f"{case}: output/gradient {i} differs"
    h_bytes = 3 * 7 * mlp.intermediate_size * 2  # h in bf16 (autocast's dtype)
    assert saved[False] - saved[True] == (h_bytes if recomputes else 0), \
        f"{case}: saved {saved[True]} vs {saved[False]} bytes"
    assert len(hooked) == (2 if case == "hooked down_proj" else 0)


# ---------------------------------------------------------------- GeGLU (Gemma)
@pytest.mark.parametrize("shape,dtype", CASES)
def test_geglu_matches_float64_truth(shape, dtype):
    # The gates reach -15: GELU's far negative tail, where PyTorch's 1 + tanh cancels.
    compare_to_truth(*make_inputs(shape, DTYPES[dtype]), fn=geglu, reference=geglu_reference)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_geglu_matches_pytorch_formula(dtype):
    # Next to HF's own formula at the same dtype: the same values up to rounding
    # (the sigmoid form differs from F.gelu's tanh form only by a few float32 ulps,
    # and where 1 + tanh cancels, in values below 1e-2).
    dtype = DTYPES[dtype]
    gate, up, dy = make_inputs((7, 123), dtype, seed=2)
    y, dg, du = run(geglu, gate, up, dy)
    y_ref, dg_ref, du_ref = run(lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u, gate, up, dy)
    assert y.dtype == y_ref.dtype == dtype
    for name, a, b in (("y", y, y_ref), ("dgate", dg, dg_ref), ("dup", du, du_ref)):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
    # geglu is not swiglu: the activation switch reaches the kernel.
    assert not torch.allclose(y, swiglu(gate, up))


def test_geglu_strided_promoted_no_grad_and_one_grad():
    # Row-strided slices, a transposed (copied) input, a non-contiguous upstream gradient.
    wide, _, _ = make_inputs((7, 2 * 123), torch.bfloat16, seed=3)
    dy = make_inputs((7, 246), torch.bfloat16, seed=4)[2][:, ::2]
    compare_to_truth(wide[:, :123], wide[:, 123:], dy, fn=geglu, reference=geglu_reference)
    gate_t, up_t, dy32 = make_inputs((123, 7), torch.float32, seed=5)
    compare_to_truth(gate_t.t(), up_t.t(), dy32.t().contiguous(), fn=geglu, reference=geglu_reference)
    # bf16 gate, float32 up: gelu rounds to bf16, the product is float32.
    gate, up, dy = make_inputs((7, 123), torch.bfloat16, up_dtype=torch.float32, seed=6)
    compare_to_truth(gate, up, dy, fn=geglu, reference=geglu_reference)
    assert geglu(gate, up).dtype == torch.float32
    # Forward under no_grad.
    gate, up, dy = make_inputs((7, 123), torch.float32, seed=7)
    with torch.no_grad():
        y = geglu(gate.requires_grad_(), up)
    assert not y.requires_grad
    err = rel_err(y, geglu_reference(gate.detach().double(), up.double()))
    assert err < 1e-6, f"no_grad forward error {err:.2e}"
    # Only up needs a gradient.
    u = up.detach().requires_grad_()
    geglu(gate.detach(), u).backward(dy)
    truth = run(geglu_reference, gate.double(), up.double(), dy.double())
    assert rel_err(u.grad, truth[2]) < 1e-6


def test_geglu_bad_inputs_name_geglu():
    gate, up, _ = make_inputs((4, 32), torch.float32)
    with pytest.raises(ValueError, match="geglu: gate shape"):
        geglu(gate, up[:, :31])
    with pytest.raises(TypeError, match="geglu: unsupported up dtype"):
        geglu(gate, up.double())


# ---------------------------------------------------------------- the fused gate_up layout (Phi-3)
def _chunked(reference):
    """HF Phi3MLP's formula on one [..., 2I] tensor: chunk(2, dim=-1), then act(gate) * up."""
    def fn(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return reference(gate, up)
    return fn


def run_fused(fn, gate_up, dy):
    x = gate_up.detach().requires_grad_()
    y = fn(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad


FUSED_CASES = [
    pytest.param((7, 2 * 123), "fp32", id="fp32 7x(2x123)"),
    pytest.param((2, 5, 2 * 41), "bf16", id="bf16 2x5x(2x41) (3-D)"),
    pytest.param((1, 2 * 4097), "fp16", id="fp16 1x(2x4097)"),
    pytest.param((300, 2 * 7), "bf16", id="bf16 300x(2x7)"),
]


@pytest.mark.parametrize("fn,reference", [(swiglu, swiglu_reference), (geglu, geglu_reference)],
                         ids=["swiglu", "geglu"])
@pytest.mark.parametrize("shape,dtype", FUSED_CASES)
def test_fused_gate_up_matches_float64_truth(shape, dtype, fn, reference):
    gate_up, _, _ = make_inputs(shape, DTYPES[dtype], seed=8)
    dy = make_inputs(shape[:-1] + (shape[-1] // 2,), DTYPES[dtype], seed=9)[2]
    ours = run_fused(fn, gate_up, dy)
    peer = run_fused(_chunked(reference), gate_up, dy)
    truth = run_fused(_chunked(reference), gate_up.double(), dy.double())
    check_outputs(("y", "d_gate_up"), ours, peer, truth)
    # Row-strided: gate_up itself a slice of a wider tensor, and a strided dy.
    wide = torch.cat([gate_up, gate_up[..., :3]], dim=-1)[..., : shape[-1]]
    dy_strided = torch.cat([dy, dy], dim=-1)[..., ::2]
    assert wide.stride(-2) == shape[-1] + 3 and dy_strided.stride(-1) == 2
    check_outputs(("y (strided)", "d_gate_up (strided)"), run_fused(fn, wide, dy_strided),
                  run_fused(_chunked(reference), wide, dy_strided), truth)


def test_fused_gate_up_reads_in_place_and_returns_one_gradient():
    # No chunk, no copy: the autograd graph is our node straight on the leaf (no
    # SplitBackward, no CatBackward), and the only tensor saved is gate_up itself.
    gate_up, _, _ = make_inputs((2, 5, 2 * 41), torch.bfloat16, seed=10)
    x = gate_up.detach().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = geglu(x)
    assert y.shape == (2, 5, 41)
    assert [type(f).__name__ for f, _ in y.grad_fn.next_functions if f is not None] == ["AccumulateGrad"]
    assert len(saved) == 1 and saved[0].data_ptr() == x.data_ptr(), "gate_up must be saved as is, not copied"
    y.backward(torch.ones_like(y))
    assert x.grad.shape == x.shape


def test_fused_gate_up_bad_inputs():
    odd = torch.randn(3, 7, device=DEVICE)
    with pytest.raises(ValueError, match=r"fused gate_up input must be \[..., 2I\]"):
        swiglu(odd)
    with pytest.raises(ValueError, match="weight must be"):
        swiglu_down_proj(torch.randn(3, 8, device=DEVICE), None, torch.randn(5, 8, device=DEVICE))


# ---------------------------------------------------------------- the modules
def _tiny_gemma_config():
    from transformers import GemmaConfig

    return GemmaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _tiny_phi3_config():
    from transformers import Phi3Config

    return Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=2)


def _out_and_grads(mlp, x, dy):
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = mlp(x)
    y.backward(dy.to(y.dtype))
    return [y.detach(), x.grad] + [p.grad.clone() for p in mlp.parameters()]


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute h", "keep h"])
@pytest.mark.parametrize("family", ["gemma", "phi3"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mlp_from_gemma_and_phi3(family, dtype, recompute):
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    hf_class, config, ours_class, names = {
        "gemma": (GemmaMLP, _tiny_gemma_config(), TritonLlamaMLP, ("gate_proj", "up_proj", "down_proj")),
        "phi3": (Phi3MLP, _tiny_phi3_config(), TritonGateUpMLP, ("gate_up_proj", "down_proj")),
    }[family]
    dtype = DTYPES[dtype]
    torch.manual_seed(0)
    hf = hf_class(config).to(DEVICE, dtype)
    for p in hf.parameters():  # weights of a trained model's size: gates of order 1
        torch.nn.init.normal_(p, std=0.15)
    truth_mlp = copy.deepcopy(hf).double()
    ours = ours_class.from_mlp(hf)
    ours.recompute_hidden = recompute
    assert ours.activation == {"gemma": "gelu_tanh", "phi3": "silu"}[family]
    assert ours.recomputes_hidden() == recompute
    for name in names:
        assert getattr(ours, name) is getattr(hf, name), f"{name} must be the same module"
    assert set(ours.state_dict()) == set(hf.state_dict()), "state dict keys must match the HF module's"
    assert (ours.hidden_size, ours.intermediate_size) == (64, 128)
    x, _, _ = make_inputs((2, 5, 64), dtype, seed=11)
    dy = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(12)).to(DEVICE, dtype)
    got, ref = _out_and_grads(ours, x, dy), _out_and_grads(hf, x, dy)
    true = _out_and_grads(truth_mlp, x.double(), dy.double())
    names = ["y", "dx"] + [f"d{n}" for n, _ in hf.named_parameters()]
    check_outputs(names, got, ref, true, dtype, peer_name=f"HF {dtype}")
    # Built from the config: the same layout, parameter names and activation.
    fresh = ours_class(config)
    assert set(fresh.state_dict()) == set(hf.state_dict()) and fresh.activation == ours.activation


def _loss_logits_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _tiny_family(family):
    import transformers

    if family == "phi3":
        return transformers.Phi3ForCausalLM(_tiny_phi3_config())
    config_class, model_class = {
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[family]
    return model_class(config_class(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16))


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3", "phi3"])
def test_replace_swiglu_in_gemma_and_phi3(family):
    torch.manual_seed(0)
    model = _tiny_family(family).to(DEVICE)
    reference = copy.deepcopy(model)
    params_before = {id(p) for p in model.parameters()}
    hf_mlps = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith("MLP")]
    assert len(hf_mlps) == 2, hf_mlps

    assert replace_swiglu(model) == 2, "every MLP (one per layer) must be replaced"
    expected = TritonGateUpMLP if family == "phi3" else TritonLlamaMLP
    mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    assert len(mlps) == 2 and all(type(m) is expected for m in mlps), [type(m).__name__ for m in mlps]
    assert all(m.activation == ("silu" if family == "phi3" else "gelu_tanh") for m in mlps)
    assert {id(p) for p in model.parameters()} == params_before, "the Parameters must be the same objects"
    assert replace_swiglu(model) == 0

    ids = torch.randint(0, 512, (2, 16), device=DEVICE)
    logits, grads = _loss_logits_grads(model, ids)
    logits_ref, grads_ref = _loss_logits_grads(reference, ids)
    assert rel_err(logits, logits_ref) < 1e-5, f"logits differ by {rel_err(logits, logits_ref):.2e}"
    assert grads.keys() == grads_ref.keys()
    worst = max(grads, key=lambda n: rel_err(grads[n], grads_ref[n]))
    assert rel_err(grads[worst], grads_ref[worst]) < 1e-5, f"gradient of {worst} differs by " \
        f"{rel_err(grads[worst], grads_ref[worst]):.2e}"


# ---------------------------------------------------------------- refusing what computes something else
def _doubling_mlp_class():
    from transformers.models.llama.modeling_llama import LlamaMLP

    class DoublingMLP(LlamaMLP):  # LlamaMLP's names and SiLU, another result
        def forward(self, x):
            return 2 * super().forward(x)

    return DoublingMLP


def test_mlp_that_computes_something_else_is_refused():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config()).to(DEVICE)
    doubling = _doubling_mlp_class()
    # Layer 0 keeps its LlamaMLP (which alone would be swapped), layer 1 doubles.
    odd = doubling(model.config).to(DEVICE)
    odd.load_state_dict(model.model.layers[1].mlp.state_dict())
    model.model.layers[1].mlp = odd
    before = list(model.modules())
    ids = torch.randint(0, 257, (1, 8), device=DEVICE)
    with torch.no_grad():
        logits_before = model(ids).logits

    with pytest.raises(SwapMismatch, match=r"^DoublingMLP computes something else than TritonLlamaMLP "
                                           r"\(max difference [0-9.e+-]+ on a random input\)$") as info:
        replace_swiglu(model)
    assert "\n" not in str(info.value)
    assert list(model.modules()) == before, "nothing may be swapped when one class is refused"
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits_before)


def test_refused_fused_layout_with_halves_the_other_way_round():
    # Same attribute names as Phi-3, [up | gate] instead of [gate | up].
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    class SwappedHalvesMLP(Phi3MLP):
        def forward(self, x):
            up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * self.activation_fn(gate))

    torch.manual_seed(0)
    mlp = SwappedHalvesMLP(_tiny_phi3_config()).to(DEVICE)
    with pytest.raises(SwapMismatch, match="SwappedHalvesMLP computes something else than TritonGateUpMLP"):
        check_same_mlp(mlp, TritonGateUpMLP.from_mlp(mlp))
    holder = torch.nn.Sequential(mlp)
    with pytest.raises(SwapMismatch):
        replace_swiglu(holder)
    assert holder[0] is mlp


def test_only_exact_activations_are_taken():
    # The erf GELU, and HF's GELUTanh built with its Python formula (five ops, each
    # rounded), are not what the kernel computes: such MLPs are never offered.
    from transformers.activations import ACT2FN, GELUTanh
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    mlp = GemmaMLP(_tiny_gemma_config())
    assert module_activation(mlp) == "gelu_tanh"
    for act, expected in ((torch.nn.GELU(approximate="tanh"), "gelu_tanh"), (torch.nn.GELU(), None),
                          (ACT2FN["gelu"], None), (ACT2FN["gelu_new"], None),
                          (GELUTanh(use_gelu_tanh_python=True), None), (torch.nn.SiLU(), "silu"),
                          (ACT2FN["silu"], "silu"), (torch.nn.ReLU(), None)):
        mlp.act_fn = act
        assert module_activation(mlp) == expected, type(act).__name__
        assert replace_swiglu(torch.nn.Sequential(mlp)) == (0 if expected is None else 1)


def test_check_keeps_the_random_state_and_shared_dropout():
    # A dropout inside a shared projection (as a LoRA layer's) in training mode:
    # both modules draw the same mask, so the check passes; and the global random
    # state is the same before and after the swap.
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(_tiny_llama_config()).to(DEVICE).train()
    mlp.gate_proj = torch.nn.Sequential(torch.nn.Dropout(0.3), mlp.gate_proj)
    model = torch.nn.Sequential(mlp)
    state = torch.get_rng_state()
    assert replace_swiglu(model) == 1
    assert torch.equal(torch.get_rng_state(), state), "the check must not move the global random state"
    assert isinstance(model[0], TritonLlamaMLP)


def test_meta_device_is_swapped_unchecked():
    from transformers import LlamaForCausalLM, Phi3ForCausalLM

    with torch.device("meta"):
        models = [LlamaForCausalLM(_tiny_llama_config()), Phi3ForCausalLM(_tiny_phi3_config())]
    assert [replace_swiglu(m) for m in models] == [2, 2]


def test_check_on_a_device_the_kernels_cannot_run_on(monkeypatch):
    # CPU modules on a GPU machine (no interpreter): the check runs our module's
    # formula in PyTorch instead of the kernel, and still refuses what differs.
    monkeypatch.setattr(swiglu_kernel, "INTERPRET", False)
    monkeypatch.setattr(swiglu_kernel, "gated_activation", None)  # a kernel launch would fail loudly
    monkeypatch.setattr(swiglu_kernel, "swiglu_down_proj", None)
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    torch.manual_seed(0)
    gemma = GemmaMLP(_tiny_gemma_config())
    check_same_mlp(gemma, TritonLlamaMLP.from_mlp(gemma))
    doubling = _doubling_mlp_class()(_tiny_llama_config())
    with pytest.raises(SwapMismatch, match="DoublingMLP computes something else"):
        check_same_mlp(doubling, TritonLlamaMLP.from_mlp(doubling))


def test_check_names_a_forward_that_fails():
    from transformers.models.llama.modeling_llama import LlamaMLP

    class NeedsMaskMLP(LlamaMLP):
        def forward(self, x, mask):
            return super().forward(x) * mask

    mlp = NeedsMaskMLP(_tiny_llama_config())
    with pytest.raises(SwapMismatch, match=r"^NeedsMaskMLP cannot be checked against TritonLlamaMLP: its forward "
                                           r"failed on a \[4, 64\] input \(TypeError: "):
        replace_swiglu(torch.nn.Sequential(mlp))


def test_mlp_from_config_picks_the_activation():
    from transformers import Gemma2Config

    assert TritonLlamaMLP(_tiny_gemma_config()).activation == "gelu_tanh"  # hidden_act
    assert TritonLlamaMLP(Gemma2Config(hidden_size=64, intermediate_size=128)).activation == "gelu_tanh"
    assert TritonGateUpMLP(_tiny_phi3_config()).activation == "silu"
    assert TritonLlamaMLP(_tiny_llama_config()).activation == "silu"


# ---------------------------------------------------------------- torch.compile
def test_geglu_and_fused_layout_compile_into_one_graph():
    # The activation and the layout are arguments of the same operators: fullgraph
    # compiles (no break), and the results equal eager bit for bit (aot_eager runs
    # the same kernels; on a GPU Inductor compiles the code around them).
    from torch._dynamo.testing import CompileCounterWithBackend

    def loss(gate, up, gate_up, w):
        return ((geglu(gate, up).float() ** 2).sum() + (swiglu(gate_up).float() ** 2).sum()
                + (swiglu_down_proj(gate_up, None, w, "gelu_tanh").float() ** 2).sum())

    def leaves(rows, seed):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(shape, generator=g) * scale).to(DEVICE).requires_grad_()
                for shape, scale in (((rows, 48), 2.0), ((rows, 48), 1.0), ((rows, 96), 2.0), ((24, 48), 0.2))]

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor" if DEVICE.type == "cuda" else "aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    for rows in (5, 9):
        inputs = leaves(rows, rows)
        eager = loss(*inputs)
        grads = torch.autograd.grad(eager, inputs)
        c_loss = compiled(*inputs)
        c_grads = torch.autograd.grad(c_loss, inputs)
        torch.testing.assert_close(c_loss, eager, rtol=0 if DEVICE.type == "cpu" else None,
                                   atol=0 if DEVICE.type == "cpu" else None)
        for a, b in zip(c_grads, grads):
            torch.testing.assert_close(a, b, rtol=0 if DEVICE.type == "cpu" else None,
                                       atol=0 if DEVICE.type == "cpu" else None)
    targets = {str(n.target) for gm in counter.graphs for n in gm.graph.nodes}
    assert {"llama_kernels.swiglu_forward.default", "llama_kernels.swiglu_down_proj_forward.default"} <= targets


@pytest.mark.parametrize("case", ["geglu", "fused", "fused geglu backward", "down_proj fused"])
def test_opcheck_activation_and_layout(case):
    ops = torch.ops.llama_kernels
    g, u = torch.randn(5, 48, device=DEVICE, requires_grad=True), torch.randn(5, 48, device=DEVICE, requires_grad=True)
    gu, w = torch.randn(5, 96, device=DEVICE, requires_grad=True), torch.randn(24, 48, device=DEVICE, requires_grad=True)
    op, args = {
        "geglu": (ops.swiglu_forward, (g, u, "gelu_tanh")),
        "fused": (ops.swiglu_forward, (gu, None, "silu")),
        "fused geglu backward": (ops.swiglu_backward, (torch.randn(5, 48, device=DEVICE), gu.detach(), None,
                                                       True, False, "gelu_tanh")),
        "down_proj fused": (ops.swiglu_down_proj_forward, (gu, None, w, torch.float32, "gelu_tanh")),
    }[case]
    torch.library.opcheck(op, args)


# ---------------------------------------------------------------- GPU only
def test_int64_offsets():
    need_gpu()
    # 150,000 x 14,336 = 2.15e9 elements > 2**31: int32 offsets would wrap.
    # gate, up, y, dy, d_gate, d_up: 6 x 4.3 GB of bf16.
    rows, inter = 150_000, 14_336
    torch.manual_seed(0)
    gate = (torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16) * 3).requires_grad_()
    up = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16).requires_grad_()
    y = swiglu(gate, up)
    dy = torch.randn_like(y)
    dg, du = torch.autograd.grad(y, (gate, up), dy)
    sample = torch.tensor([0, 1, 74_999, 149_796, 149_797, rows - 1], device="cuda")  # 149,797 * I > 2**31
    g_s, u_s, dy_s = gate.detach()[sample], up.detach()[sample], dy[sample]
    ours = (y[sample], dg[sample], du[sample])
    peer = run(swiglu_reference, g_s, u_s, dy_s)
    truth = run(swiglu_reference, g_s.double(), u_s.double(), dy_s.double())
    check_outputs(("y on sampled rows", "dgate on sampled rows", "dup on sampled rows"), ours, peer, truth, torch.bfloat16)


def test_cuda_graph_capture():
    need_gpu()
    gate, up, dy = make_inputs((512, 14336), torch.bfloat16)
    gate.requires_grad_()
    up.requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up compiles the kernels outside the capture
        for _ in range(2):
            torch.autograd.grad(swiglu(gate, up), (gate, up), dy)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = swiglu(gate, up)
        dg, du = torch.autograd.grad(y, (gate, up), dy)
    new_gate, new_up, _ = make_inputs((512, 14336), torch.bfloat16, seed=1)
    with torch.no_grad():
        gate.copy_(new_gate)
        up.copy_(new_up)
    graph.replay()
    torch.cuda.synchronize()
    y_ref, dg_ref, du_ref = run(swiglu, new_gate, new_up, dy)
    assert torch.equal(y, y_ref) and torch.equal(dg, dg_ref) and torch.equal(du, du_ref), "replay differs from eager"



def test_mlp_under_autocast():
    # Mixed precision as trainers use it: float32 weights, bf16 compute under
    # torch.autocast. Backward runs outside autocast and must redo its casts.
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    hf = LlamaMLP(_tiny_llama_config()).to(DEVICE)
    ours = TritonLlamaMLP.from_llama_mlp(copy.deepcopy(hf))
    truth_mlp = copy.deepcopy(hf).double()
    x, _, _ = make_inputs((2, 5, 64), torch.float32, seed=3)
    dy = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def autocast_run(mlp):  # forward under autocast, backward outside it (as trainers do)
        xg = x.detach().requires_grad_()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            y = mlp(xg)
        y.backward(dy.to(y.dtype))
        return [y.detach(), xg.grad] + [m.weight.grad for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]

    got, ref = autocast_run(ours), autocast_run(hf)
    true = _mlp_out_and_grads(truth_mlp, x.double(), dy.double())
    check_outputs(("y", "dx", "dW_gate", "dW_up", "dW_down"), got, ref, true, torch.bfloat16,
                  peer_name="HF under autocast")

def test_create_graph_is_refused():
    gate, up, _ = make_inputs((3, 41), torch.float32)
    gate.requires_grad_()
    with pytest.raises(RuntimeError, match="swiglu/geglu: create_graph=True"):
        torch.autograd.grad(swiglu(gate, up).sum(), gate, create_graph=True)


# --------------------------------------------------------------------------------
# MoE experts: the fused gate inside transformers' experts module
# --------------------------------------------------------------------------------
def _tiny_moe(model_type, **extra):
    from kernel_ft import models
    from tools.family_matrix import family_config
    torch.manual_seed(0)
    config = family_config(model_type, {"num_experts_per_tok": 2, **extra})
    return models.build_random(config, torch.device(DEVICE), torch.float32)


MOE = [("mixtral", {"num_local_experts": 4}), ("qwen3_moe", {"num_experts": 4, "moe_intermediate_size": 64})]


@pytest.mark.parametrize("model_type, extra", MOE, ids=[m[0] for m in MOE])
def test_experts_gate_is_fused_and_used(model_type, extra, monkeypatch):
    model = _tiny_moe(model_type, **extra)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    reference = model(ids).logits
    experts = [m for m in model.modules() if swiglu_kernel.experts_activation(m)]
    assert len(experts) == model.config.num_hidden_layers
    count = replace_swiglu(model)
    assert count >= len(experts)
    calls = []
    real = swiglu_kernel.gated_activation
    monkeypatch.setattr(swiglu_kernel, "gated_activation", lambda *a: calls.append(a[0].shape) or real(*a))
    torch.testing.assert_close(model(ids).logits, reference, rtol=1e-5, atol=1e-5)
    # Every layer's experts ran the kernel on the [S, 2I] output of their grouped products.
    assert len(calls) >= len(experts) and all(shape[-1] == experts[0].gate_up_proj.shape[1] for shape in calls)


def test_experts_eager_implementation_refused():
    model = _tiny_moe("mixtral", num_local_experts=4)
    model.config._experts_implementation = "eager"
    with pytest.raises(SwapMismatch, match="eager experts implementation"):
        replace_swiglu(model)
    assert all("_apply_gate" not in vars(m)  # the class's own gate, nothing set on the instance
               for m in model.modules() if swiglu_kernel.experts_activation(m))


def test_experts_with_another_gate_refused(monkeypatch):
    model = _tiny_moe("mixtral", num_local_experts=4)
    experts = next(m for m in model.modules() if swiglu_kernel.experts_activation(m))

    def clamped(self, gate_up_out):  # a family that clamps its gate, under the same names
        gate, up = gate_up_out.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=0.5)) * up
    monkeypatch.setattr(type(experts), "_apply_gate", clamped)
    with pytest.raises(SwapMismatch, match="computes something else than the fused gate"):
        replace_swiglu(model)
    assert not any(isinstance(m, TritonLlamaMLP) for m in model.modules())  # nothing changed


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))
