"""
Step 6 -- Correctness tests for the fused RMSNorm (rmsnorm_kernel.py).

Every comparison is against a float64 truth (the HF formula evaluated in
float64): our y, dx and dw must be no worse than about twice the error of the
PyTorch path (HF ``LlamaRMSNorm`` in eager mode) at the same dtype, for
irregular sizes, every dtype, strided inputs and the module swap in a LLaMA.
Without a GPU the kernels run in the Triton interpreter and the GPU-only tests
(64-bit offsets, CUDA graphs, determinism) are skipped.

Usage:
    python rmsnorm_test.py          # or: python -m pytest rmsnorm_test.py
"""

import sys

import pytest
import torch

from conftest import DEVICE, DTYPES, check_outputs, need_gpu, rel_err
from rmsnorm_kernel import (
    MAX_HIDDEN_SIZE,
    TritonRMSNorm,
    rmsnorm,
    rmsnorm_reference,
    replace_rmsnorm,
)

EPS = 1e-6


def make_inputs(shape, dtype, seed=0, weight_dtype=None):
    """Random input, random non-unit weight and a random upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    x = (torch.randn(shape, generator=g) * 2.0 + 0.3).to(dtype)
    w = (1.0 + 0.5 * torch.randn(hidden, generator=g)).to(weight_dtype or dtype)
    dy = torch.randn(shape, generator=g).to(torch.promote_types(dtype, w.dtype))
    return x.to(DEVICE), w.to(DEVICE), dy.to(DEVICE)


def run_ours(x, w, dy):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = rmsnorm(x, w, EPS)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def run_torch(x, w, dy, compute_dtype=torch.float32):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = rmsnorm_reference(x, w, EPS, compute_dtype)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, w.grad


def compare_to_truth(x, w, dy):
    """Ours and PyTorch against float64 for y, dx, dw: ours no worse than ~2x."""
    ours = run_ours(x, w, dy)
    torch_path = run_torch(x, w, dy)
    truth = run_torch(x.double(), w.double(), dy.double(), torch.float64)
    check_outputs(("y", "dx", "dw"), ours, torch_path, truth, x.dtype)


# (shape, dtype): irregular hidden sizes, 1 and 7 rows, every dtype, many short
# rows (several rows per program) and a 3-D [batch, seq, hidden] input.
CASES = [
    pytest.param((7, 41), "fp32", id="fp32 7x41"),
    pytest.param((1, 4097), "fp32", id="fp32 1x4097"),
    pytest.param((2, 3, 123), "fp32", id="fp32 2x3x123"),
    pytest.param((7, 123), "bf16", id="bf16 7x123"),
    pytest.param((1, 4097), "bf16", id="bf16 1x4097"),
    pytest.param((300, 64), "bf16", id="bf16 300x64 (many rows/program)"),
    pytest.param((4, 4096), "bf16", id="bf16 4x4096 (LLaMA hidden)"),
    pytest.param((7, 4097), "fp16", id="fp16 7x4097"),
    pytest.param((5, 41), "fp16", id="fp16 5x41"),
]


@pytest.mark.parametrize("shape,dtype", CASES)
def test_matches_float64_truth(shape, dtype):
    compare_to_truth(*make_inputs(shape, DTYPES[dtype]))


def test_fp32_weight_on_bf16_input():
    # A float32 weight on bf16 activations: HF promotes the product to float32.
    x, w, dy = make_inputs((5, 123), torch.bfloat16, weight_dtype=torch.float32)
    compare_to_truth(x, w, dy)
    assert rmsnorm(x, w).dtype == torch.float32


def test_non_contiguous_input_and_grad():
    # Input and upstream gradient as strided views (every other row / a column slice).
    x, w, dy = make_inputs((14, 200), torch.bfloat16)
    xs = x[::2, :123]
    dys = dy[::2, :123].t().contiguous().t()  # column-major: stride(-1) != 1
    ws = w[:123].contiguous()
    assert not xs.is_contiguous() and not dys.is_contiguous()
    compare_to_truth(xs, ws, dys)


@pytest.mark.parametrize("layout", ["column of a matrix", "expanded scalar"])
def test_weight_of_any_layout(layout):
    x, w, dy = make_inputs((7, 123), torch.float32)
    if layout == "column of a matrix":
        w = torch.stack([w, -w, 2 * w], dim=1)[:, 0]  # stride 3
    else:
        w = w[:1].expand(123)  # stride 0: one value read 123 times
    assert not w.is_contiguous()
    compare_to_truth(x, w, dy)


def test_create_graph_is_refused():
    x, w, _ = make_inputs((3, 41), torch.float32)
    x.requires_grad_()
    y = rmsnorm(x, w, EPS)
    with pytest.raises(RuntimeError, match="rmsnorm: create_graph=True"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_forward_under_no_grad():
    x, w, _ = make_inputs((7, 123), torch.float32)
    with torch.no_grad():
        y = rmsnorm(x, w, EPS)
    assert not y.requires_grad
    ref = rmsnorm_reference(x.double(), w.double(), EPS, torch.float64)
    err = rel_err(y, ref)
    assert err < 1e-6, f"no_grad forward error {err:.2e}"


def test_frozen_weight_gives_dx_only():
    # Frozen weight (e.g. LoRA): dw is skipped, dx still right.
    x, w, dy = make_inputs((7, 123), torch.float32)
    xg = x.detach().requires_grad_()
    y = rmsnorm(xg, w, EPS)
    y.backward(dy)
    assert w.grad is None
    xr = x.double().requires_grad_()
    rmsnorm_reference(xr, w.double(), EPS, torch.float64).backward(dy.double())
    err = rel_err(xg.grad, xr.grad)
    assert err < 1e-5, f"dx error {err:.2e}"


def test_bad_inputs_raise():
    x, w, _ = make_inputs((4, 32), torch.float32)
    with pytest.raises(ValueError, match="does not match the hidden size"):
        rmsnorm(x, w[:31])
    with pytest.raises(TypeError, match="unsupported input dtype"):
        rmsnorm(x.double(), w)
    with pytest.raises(TypeError, match="unsupported input dtype"):
        rmsnorm(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="same device"):
        rmsnorm(x, w.to("meta"))
    with pytest.raises(ValueError, match="exceeds the supported maximum"):
        rmsnorm(torch.empty(1, MAX_HIDDEN_SIZE + 1, device=DEVICE), torch.empty(MAX_HIDDEN_SIZE + 1, device=DEVICE))
    with pytest.raises(ValueError, match="eps must be"):
        rmsnorm(x, w, eps=-1.0)


def test_from_llama_rmsnorm_shares_parameter():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(123, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        hf.weight.mul_(torch.linspace(0.5, 1.5, 123, device=DEVICE))
    ours = TritonRMSNorm.from_llama_rmsnorm(hf)
    assert ours.weight is hf.weight, "from_llama_rmsnorm must reuse the same Parameter object"
    assert ours.variance_epsilon == 1e-5
    x, _, _ = make_inputs((3, 123), torch.float32)
    err = rel_err(ours(x), hf(x))
    assert err < 1e-6, f"module output differs from LlamaRMSNorm by {err:.2e}"
    fresh = TritonRMSNorm(41, eps=1e-6)
    assert fresh.weight.shape == (41,) and fresh.variance_epsilon == 1e-6


def test_replace_rmsnorm_in_llama_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1.0 + 0.3 * torch.randn_like(p))
    ids = torch.randint(0, 257, (2, 16), device=DEVICE)
    with torch.no_grad():
        before = model(ids).logits
    count = replace_rmsnorm(model)
    assert count == 2 * 2 + 1, f"replaced {count}, expected 5 (2 per layer + final norm)"
    assert sum(isinstance(m, TritonRMSNorm) for m in model.modules()) == 5
    assert replace_rmsnorm(model) == 0, "a second pass must find nothing left to replace"
    with torch.no_grad():
        after = model(ids).logits
    err = rel_err(after, before)
    assert err < 1e-5, f"patched model output differs by {err:.2e}"


# ---------------------------------------------------------------- GPU only
def test_int64_offsets():
    need_gpu()
    # 524,800 x 4,096 = 2.15e9 elements > 2**31: int32 offsets would wrap.
    rows, hidden = 524_800, 4096
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (1.0 + 0.5 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    y = rmsnorm(x, w, EPS)
    dy = torch.randn_like(y)
    y.backward(dy)
    tail = slice(rows - 1024, rows)  # the rows beyond 2**31 elements
    xt = x.detach()[tail].double().requires_grad_()
    wt = w.detach().double().requires_grad_()
    yt = rmsnorm_reference(xt, wt, EPS, torch.float64)
    yt.backward(dy[tail].double())
    e_y, e_dx = rel_err(y[tail], yt), rel_err(x.grad[tail], xt.grad)
    assert e_y < 1e-2 and e_dx < 1e-2, f"tail rows wrong: y {e_y:.2e} dx {e_dx:.2e}"
    # dw over all rows, against a float32 reduction done in PyTorch.
    x_hat = x.detach().float() * torch.rsqrt(x.detach().float().pow(2).mean(-1, keepdim=True) + EPS)
    dw_ref = (dy.float() * x_hat).sum(0)
    e_dw = rel_err(w.grad, dw_ref)
    assert e_dw < 1e-2, f"dw error {e_dw:.2e}"


def test_cuda_graph_capture():
    need_gpu()
    x, w, dy = make_inputs((256, 4096), torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up compiles the kernels outside the capture
        for _ in range(2):
            x.grad = w.grad = None
            rmsnorm(x, w, EPS).backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = rmsnorm(x, w, EPS)
        y.backward(dy)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    y_ref, dx_ref, dw_ref = run_ours(x, w, dy)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, dx_ref) and torch.equal(w.grad, dw_ref)


def test_bitwise_determinism():
    need_gpu()
    x, w, dy = make_inputs((16384, 4096), torch.bfloat16)
    a, b = run_ours(x, w, dy), run_ours(x, w, dy)
    assert all(torch.equal(p, q) for p, q in zip(a, b)), "two identical runs differ"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))
