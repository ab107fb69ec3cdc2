"""
Step 12 (tests) -- Correctness tests for the fused SwiGLU (swiglu_kernel.py).

Every comparison is against a float64 truth (``F.silu(gate) * up`` evaluated in
float64, gradients by autograd): our output and both gradients must be no worse
than about twice the error of the PyTorch path (HF's eager ``F.silu(gate) * up``)
at the same dtype, for irregular sizes, every dtype, strided inputs, and for
``TritonLlamaMLP`` swapped into a LLaMA. Without a GPU the kernels run in the
Triton interpreter and the GPU-only tests (64-bit offsets, CUDA graphs) are skipped.

Usage:
    python swiglu_test.py          # or: python -m pytest swiglu_test.py
"""

import copy
import sys

import pytest
import torch

from conftest import DEVICE, DTYPES, check_outputs, need_gpu, rel_err
from swiglu_kernel import (
    TritonLlamaMLP,
    TritonSwiGLUFunction,
    replace_swiglu,
    swiglu,
    swiglu_reference,
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


def compare_to_truth(gate, up, dy):
    """Ours and PyTorch against float64 for y, d_gate, d_up: ours no worse than ~2x."""
    ours = run(swiglu, gate, up, dy)
    torch_path = run(swiglu_reference, gate, up, dy)
    truth = run(swiglu_reference, gate.double(), up.double(), dy.double())
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
    with pytest.raises(ValueError, match="SiLU gating only"):
        TritonLlamaMLP(_tiny_llama_config(hidden_act="gelu"))


def _saved_bytes(fn):
    """Bytes autograd keeps from forward to backward while fn() builds the graph."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


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
        y, saved[recompute] = _saved_bytes(lambda xx=xx: mlp(xx))
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
    with pytest.raises(RuntimeError, match="swiglu: create_graph=True"):
        torch.autograd.grad(swiglu(gate, up).sum(), gate, create_graph=True)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))
