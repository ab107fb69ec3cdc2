"""
Step 9 -- Correctness and memory tests for the fused cross-entropy (cross_entropy_kernel.py).

Every comparison is against a float64 truth (``F.cross_entropy`` on float64
logits): our loss and logits gradient must be no worse than about twice the
error of the PyTorch path HF uses (``F.cross_entropy(logits.float(), ...)``) at
the same dtype, for irregular vocabularies, every dtype and reduction, ignored
and extreme targets, sliced logits and the opt-in in-place gradient. Without a
GPU the kernels run in the Triton interpreter and the GPU-only tests (64-bit
offsets, CUDA graphs, peak memory, determinism) are skipped.

Usage:
    python cross_entropy_test.py          # or: python -m pytest cross_entropy_test.py
"""

import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, DTYPES, check_outputs, need_gpu, peak_extra_mb, rel_err
from cross_entropy_kernel import TritonCrossEntropyLoss, cross_entropy, cross_entropy_reference

IGNORE = -100


def make_inputs(lead, v, dtype, seed=0, ignore_frac=0.25, scale=3.0):
    """Random logits (a few large values, like a trained LM head) and targets with some ignored."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*lead, v, generator=g) * scale
    targets = torch.randint(0, v, lead, generator=g)
    ignored = torch.rand(lead, generator=g) < ignore_frac
    targets[ignored] = IGNORE
    return logits.to(dtype).to(DEVICE), targets.to(DEVICE)


def loss_and_grad(fn, logits, targets, reduction, upstream):
    x = logits.detach().requires_grad_()
    loss = fn(x, targets, ignore_index=IGNORE, reduction=reduction)
    loss.backward(upstream.to(loss.dtype))
    return loss.detach(), x.grad


def truth(logits, targets, reduction, upstream):
    x = logits.detach().double().requires_grad_()
    v = x.shape[-1]
    loss = F.cross_entropy(x.reshape(-1, v), targets.reshape(-1).long(), ignore_index=IGNORE, reduction=reduction)
    loss = loss.reshape(targets.shape) if reduction == "none" else loss
    loss.backward(upstream.double())
    return loss.detach(), x.grad


def compare_to_truth(logits, targets, reduction="mean", upstream=None):
    """Ours and PyTorch against float64 for the loss and the logits gradient: ours no worse than ~2x."""
    if upstream is None:
        # A per-token weight for "none" (seeded: the check must not depend on test order).
        g = torch.Generator().manual_seed(1)
        upstream = torch.ones((), device=DEVICE) if reduction != "none" else (torch.rand(targets.shape, generator=g) + 0.5).to(DEVICE)
    l_ours, g_ours = loss_and_grad(cross_entropy, logits, targets, reduction, upstream)
    l_torch, g_torch = loss_and_grad(cross_entropy_reference, logits, targets, reduction, upstream)
    l_true, g_true = truth(logits, targets, reduction, upstream)
    assert l_ours.dtype == torch.float32, f"loss dtype {l_ours.dtype}, expected float32"
    assert g_ours.dtype == logits.dtype and g_ours.shape == logits.shape
    # The loss is always float32 (for both paths): judge it against float32's budget.
    check_outputs(("loss", "grad"), (l_ours, g_ours), (l_torch, g_torch), (l_true, g_true), (torch.float32, logits.dtype))


# (leading shape, vocab, dtype, reduction): irregular vocabularies (2, 123,
# 4097, 128257), 1 and 7 rows, every dtype and reduction, 3-D input.
CASES = [
    pytest.param((7,), 123, "fp32", "mean", id="fp32 7x123 mean"),
    pytest.param((1,), 2, "fp32", "sum", id="fp32 1x2 sum"),
    pytest.param((7,), 4097, "fp32", "none", id="fp32 7x4097 none"),
    pytest.param((7,), 128257, "bf16", "mean", id="bf16 7x128257 mean"),
    pytest.param((1,), 128257, "bf16", "sum", id="bf16 1x128257 sum"),
    pytest.param((2, 5), 123, "bf16", "mean", id="bf16 2x5x123 mean (3-D)"),
    pytest.param((7,), 2, "bf16", "none", id="bf16 7x2 none"),
    pytest.param((7,), 123, "fp16", "mean", id="fp16 7x123 mean"),
    pytest.param((3,), 4097, "fp16", "none", id="fp16 3x4097 none"),
]


@pytest.mark.parametrize("lead,v,dtype,reduction", CASES)
def test_matches_float64_truth(lead, v, dtype, reduction):
    logits, targets = make_inputs(lead, v, DTYPES[dtype], ignore_frac=0.0 if lead == (1,) else 0.25)
    compare_to_truth(logits, targets, reduction)


def test_shifted_logits_slice_without_copy():
    # The causal-LM shift: logits[:, :-1, :] and labels[:, 1:], no .contiguous().
    full, labels = make_inputs((2, 9), 1000, torch.bfloat16)
    sliced, shifted = full[:, :-1, :], labels[:, 1:]
    assert not sliced.is_contiguous() and not shifted.is_contiguous()
    compare_to_truth(sliced, shifted, "mean")


def test_non_contiguous_upstream_grad():
    # 64 rows: at float32 a handful of rows make the error norm a coin toss at the
    # 1-ulp level (a few elements dominate it), for PyTorch and for us alike.
    logits, targets = make_inputs((64,), 123, torch.float32)
    upstream = (torch.rand(128, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEVICE)[::2]
    assert not upstream.is_contiguous()
    compare_to_truth(logits, targets, "none", upstream)


def test_scaled_upstream_grad():
    # e.g. loss / gradient_accumulation_steps: the backward rescale kernel runs.
    logits, targets = make_inputs((7,), 321, torch.bfloat16)
    compare_to_truth(logits, targets, "mean", torch.tensor(0.25, device=DEVICE))


def test_all_targets_ignored():
    logits, _ = make_inputs((5,), 123, torch.bfloat16)
    targets = torch.full((5,), IGNORE, device=DEVICE)
    for reduction in ("mean", "sum"):
        x = logits.detach().requires_grad_()
        loss = cross_entropy(x, targets, ignore_index=IGNORE, reduction=reduction)
        loss.backward()
        assert loss.item() == 0.0, f"{reduction}: all-ignored loss {loss.item()}, expected 0.0"
        assert torch.count_nonzero(x.grad) == 0 and not torch.isnan(x.grad).any(), "gradient must be exactly 0"
    x = logits.detach().requires_grad_()
    per_row = cross_entropy(x, targets, ignore_index=IGNORE, reduction="none")
    assert torch.count_nonzero(per_row) == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_extreme_logits(dtype):
    logits, targets = make_inputs((7,), 300, DTYPES[dtype], ignore_frac=0.0)
    logits[:, :50] = 1e4
    logits[:, 50:100] = -1e4
    logits[:, 100:150] = float("-inf")
    logits[0] = float("-inf")  # a row of -inf except its target: loss 0
    logits[0, targets[0]] = 5.0
    targets[(targets >= 100) & (targets < 150)] = 200  # a target at -inf has infinite loss
    targets[1] = 7  # a target sitting on the +1e4 plateau
    compare_to_truth(logits, targets, "mean")


def test_forward_under_no_grad():
    logits, targets = make_inputs((7,), 4097, torch.bfloat16)
    with torch.no_grad():
        loss = cross_entropy(logits.requires_grad_(), targets)
    assert not loss.requires_grad
    l_true = truth(logits, targets, "mean", torch.tensor(1.0, device=DEVICE))[0]
    err = rel_err(loss, l_true)
    assert err < 1e-6, f"loss error {err:.2e}"


def test_int32_targets():
    logits, targets = make_inputs((7,), 123, torch.float32)
    compare_to_truth(logits, targets.to(torch.int32), "mean")


def test_logits_not_modified():
    logits, targets = make_inputs((7,), 1000, torch.bfloat16)
    x = logits.clone().requires_grad_()
    cross_entropy(x, targets).backward()
    assert torch.equal(x.detach(), logits), "default mode must not modify the logits"


def test_inplace_gradient_mode():
    logits, targets = make_inputs((7,), 1000, torch.bfloat16)
    _, g_ref = loss_and_grad(cross_entropy, logits, targets, "mean", torch.tensor(1.0, device=DEVICE))
    w = torch.ones((), device=DEVICE, requires_grad=True)
    x = logits * w  # a non-leaf, like the LM head's output
    version = x._version
    loss = cross_entropy(x, targets, inplace_backward=True)
    assert x._version > version, "in-place mode must bump the logits' version counter"
    (g,) = torch.autograd.grad(loss, x)
    assert torch.equal(g, g_ref), "in-place gradient differs from the default mode"
    # Misuse: another op saved the logits for its backward -> loud error, not garbage.
    x = logits.float() * w
    side = x.pow(2).sum()  # pow saves its input
    loss = cross_entropy(x, targets, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + side).backward()


def test_inplace_refuses_logits_that_share_memory():
    logits, targets = make_inputs((1,), 50, torch.float32)
    w = torch.ones((), device=DEVICE, requires_grad=True)
    expanded = (logits * w).expand(6, 50)  # six rows, one row of memory
    with pytest.raises(ValueError, match="inplace_backward=True needs logits whose elements do not share memory"):
        cross_entropy(expanded, targets.expand(6), inplace_backward=True)
    # The default mode reads them as they are: the same loss as a real copy.
    loss = cross_entropy(expanded, targets.expand(6))
    assert torch.allclose(loss, cross_entropy(expanded.contiguous(), targets.expand(6)))
    # Slices that only skip memory are fine in place (the shifted-logits case).
    x = make_inputs((2, 9), 50, torch.float32)[0] * w
    loss = cross_entropy(x[:, :-1], make_inputs((2, 9), 50, torch.float32)[1][:, 1:], inplace_backward=True)
    assert torch.isfinite(loss)


def test_backward_twice_raises():
    logits, targets = make_inputs((3,), 50, torch.float32)
    x = logits.requires_grad_()
    loss = cross_entropy(x, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward called twice"):
        loss.backward()


def test_module_matches_functional():
    logits, targets = make_inputs((2, 5), 123, torch.float32)
    module = TritonCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")
    a = module(logits, targets)
    b = cross_entropy(logits, targets, IGNORE, "sum")
    assert torch.equal(a, b)


def test_bad_inputs_raise():
    logits, targets = make_inputs((4,), 10, torch.float32, ignore_frac=0.0)
    with pytest.raises(ValueError, match="does not match logits shape"):
        cross_entropy(logits, targets[:3])
    bad = targets.clone()
    bad[2] = 10
    # Checked by default on CPU; on CUDA on request (it needs a host sync).
    with pytest.raises(ValueError, match="target 10 at flat position 2 is out of range"):
        cross_entropy(logits, bad, check_targets=True)
    bad[2] = -3
    with pytest.raises(ValueError, match="out of range"):
        cross_entropy(logits, bad, check_targets=True)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="out of range"):
            cross_entropy(logits, bad)
    with pytest.raises(TypeError, match="unsupported logits dtype"):
        cross_entropy(logits.double(), targets)
    with pytest.raises(TypeError, match="targets must be int64 or int32"):
        cross_entropy(logits, targets.float())
    with pytest.raises(ValueError, match="reduction must be one of"):
        cross_entropy(logits, targets, reduction="avg")
    with pytest.raises(ValueError, match="same device"):
        cross_entropy(logits, targets.to("meta"))
    with pytest.raises(ValueError, match="at least 2 dims"):
        cross_entropy(logits[0], targets[0])


# ---------------------------------------------------------------- GPU only
def test_int64_offsets():
    need_gpu()
    # 16,800 x 128,256 = 2.15e9 elements > 2**31. The playbook's kernel hits an
    # illegal memory access here; ours must give the right loss and gradient.
    n, v = 16_800, 128_256
    torch.manual_seed(0)
    logits = (torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda")
    loss = cross_entropy(logits, targets)
    loss.backward()
    ref_sum = 0.0
    for start in range(0, n, 2048):  # reference in chunks: float64 of all of it would not fit
        ref_sum += F.cross_entropy(logits.detach()[start : start + 2048].double(), targets[start : start + 2048], reduction="sum").item()
    e_loss = abs(loss.item() - ref_sum / n) / (ref_sum / n)
    tail = slice(n - 64, n)  # rows whose offsets exceed 2**31
    xt = logits.detach()[tail].double().requires_grad_()
    (F.cross_entropy(xt, targets[tail], reduction="sum") / n).backward()
    e_grad = rel_err(logits.grad[tail], xt.grad)
    assert e_loss < 1e-5 and e_grad < 1e-2, f"loss {e_loss:.2e} grad {e_grad:.2e}"


def test_cuda_graph_capture():
    need_gpu()
    logits, targets = make_inputs((1024,), 128256, torch.bfloat16)
    logits.requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile kernels outside the capture
        for _ in range(2):
            torch.autograd.grad(cross_entropy(logits, targets), logits)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = cross_entropy(logits, targets)
        (grad,) = torch.autograd.grad(loss * 0.5, logits)  # exercises the device-side rescale too
    new_logits, new_targets = make_inputs((1024,), 128256, torch.bfloat16, seed=1)
    with torch.no_grad():
        logits.copy_(new_logits)
        targets.copy_(new_targets)
    graph.replay()
    torch.cuda.synchronize()
    x = new_logits.clone().requires_grad_()
    ref_loss = cross_entropy(x, new_targets)
    (ref_grad,) = torch.autograd.grad(ref_loss * 0.5, x)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad), "graph replay differs from eager"


def test_bitwise_determinism():
    need_gpu()
    logits, targets = make_inputs((4096,), 128256, torch.bfloat16)
    one = torch.tensor(1.0, device="cuda")
    a = loss_and_grad(cross_entropy, logits, targets, "mean", one)
    b = loss_and_grad(cross_entropy, logits, targets, "mean", one)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "two identical runs differ"


def test_out_of_range_target_on_cuda():
    need_gpu()
    logits, targets = make_inputs((8,), 1000, torch.bfloat16, ignore_frac=0.0)
    targets[3] = 5000
    loss = cross_entropy(logits, targets)  # unchecked by default on CUDA: no host sync
    assert torch.isnan(loss).item(), "an out-of-range target must never give a finite loss"
    with pytest.raises(ValueError, match="out of range"):
        cross_entropy(logits, targets, check_targets=True)
    torch.cuda.synchronize()  # the context is still healthy


def memory_comparison(n=8192, v=128256):
    """Peak extra memory of forward+backward, beyond the caller's logits and targets."""
    logits, targets = make_inputs((n,), v, torch.bfloat16)
    results = {}
    for name, fn, kwargs in [
        ("PyTorch (HF: logits.float())", cross_entropy_reference, {}),
        ("Fused Triton CE", cross_entropy, {}),
        ("Fused Triton CE, in-place grad", cross_entropy, {"inplace_backward": True}),
    ]:
        x = logits.detach().clone().requires_grad_()  # the caller's logits: allocated before, not counted

        def step(fn=fn, kwargs=kwargs, x=x):
            loss = fn(x, targets, **kwargs)
            (g,) = torch.autograd.grad(loss, x)
            del g, loss

        results[name] = peak_extra_mb(step)
        del x
        torch.cuda.empty_cache()
    return results


def test_peak_memory():
    need_gpu()
    res = memory_comparison()
    grad_mb = 8192 * 128256 * 2 / 2**20  # the bf16 logits gradient itself
    ours, torch_mb, inplace = res["Fused Triton CE"], res["PyTorch (HF: logits.float())"], res["Fused Triton CE, in-place grad"]
    assert ours <= grad_mb + 64, f"fused CE used {ours:.0f} MB, more than the gradient ({grad_mb:.0f} MB) + 64 MB"
    assert inplace <= 64, f"in-place fused CE used {inplace:.0f} MB beyond the logits"
    assert ours < torch_mb



@pytest.mark.parametrize("reduction,scale", [("mean", 65536.0), ("sum", 1024.0)])
def test_fp16_loss_scaling_keeps_small_gradients(reduction, scale):
    # fp16 training multiplies the loss by a large scale so that small gradients
    # stay above fp16's smallest value; ours must apply it before rounding.
    # (The float32 loss itself is checked by the cases above; here the two paths
    # often differ by one ulp of a single sum, noise for a ratio of errors.)
    logits, targets = make_inputs((16,), 4000, torch.float16, scale=6.0)
    upstream = torch.tensor(scale, device=DEVICE)
    _, g_ours = loss_and_grad(cross_entropy, logits, targets, reduction, upstream)
    _, g_torch = loss_and_grad(cross_entropy_reference, logits, targets, reduction, upstream)
    _, g_true = truth(logits, targets, reduction, upstream)
    check_outputs(("grad",), (g_ours,), (g_torch,), (g_true,), torch.float16)
    assert (g_ours == 0).sum() <= (g_torch == 0).sum(), "entries flushed to zero that PyTorch keeps"

def test_create_graph_is_refused():
    logits, targets = make_inputs((5,), 33, torch.float32)
    logits.requires_grad_()
    loss = cross_entropy(logits, targets, ignore_index=IGNORE)
    with pytest.raises(RuntimeError, match="cross_entropy: create_graph=True"):
        torch.autograd.grad(loss, logits, create_graph=True)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))
