"""
Step 9 -- Correctness and memory tests for the fused cross-entropy (cross_entropy_kernel.py).

Every check compares against a float64 truth (``F.cross_entropy`` on float64
logits) and requires our error to be no worse than about twice the error of the
PyTorch path HF uses (``F.cross_entropy(logits.float(), ...)``) at the same dtype.

Usage:
    python cross_entropy_test.py          # readable PASSED/FAILED report (+ memory on GPU)
    python -m pytest cross_entropy_test.py

Without a GPU the kernels run through the Triton interpreter on CPU tensors;
tests marked GPU-only (64-bit offsets, CUDA graphs, memory, determinism) are skipped.
"""

import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, DTYPES, WHERE, Report, check_outputs, need_gpu, no_worse, rel_err
from cross_entropy_kernel import TritonCrossEntropyLoss, cross_entropy, cross_entropy_reference
from linear_cross_entropy_kernel import (
    TritonFusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
)

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
    e_l, e_lt = rel_err(l_ours, l_true), rel_err(l_torch, l_true)
    assert no_worse(e_l, e_lt, torch.float32), f"loss error {e_l:.2e} vs PyTorch {e_lt:.2e}"
    e_g, e_gt = rel_err(g_ours, g_true), rel_err(g_torch, g_true)
    assert no_worse(e_g, e_gt, logits.dtype), f"grad error {e_g:.2e} vs PyTorch {e_gt:.2e}"
    return f"loss {e_l:.1e}/{e_lt:.1e}  grad {e_g:.1e}/{e_gt:.1e}"


# (label, leading shape, vocab, dtype, reduction): irregular vocabularies
# (2, 123, 4097, 128257), 1 and 7 rows, every dtype and reduction, 3-D input.
CASES = [
    ("fp32 7x123 mean", (7,), 123, "fp32", "mean"),
    ("fp32 1x2 sum", (1,), 2, "fp32", "sum"),
    ("fp32 7x4097 none", (7,), 4097, "fp32", "none"),
    ("bf16 7x128257 mean", (7,), 128257, "bf16", "mean"),
    ("bf16 1x128257 sum", (1,), 128257, "bf16", "sum"),
    ("bf16 2x5x123 mean (3-D)", (2, 5), 123, "bf16", "mean"),
    ("bf16 7x2 none", (7,), 2, "bf16", "none"),
    ("fp16 7x123 mean", (7,), 123, "fp16", "mean"),
    ("fp16 3x4097 none", (3,), 4097, "fp16", "none"),
]


@pytest.mark.parametrize("label,lead,v,dtype,reduction", CASES, ids=[c[0] for c in CASES])
def test_matches_float64_truth(label, lead, v, dtype, reduction):
    check_case(lead, v, dtype, reduction)


def check_case(lead, v, dtype, reduction):
    """One CASES row (pytest and the script report)."""
    logits, targets = make_inputs(lead, v, DTYPES[dtype], ignore_frac=0.0 if lead == (1,) else 0.25)
    return compare_to_truth(logits, targets, reduction)


def check_sliced_logits():
    # The causal-LM shift: logits[:, :-1, :] and labels[:, 1:], no .contiguous().
    full, labels = make_inputs((2, 9), 1000, torch.bfloat16)
    sliced, shifted = full[:, :-1, :], labels[:, 1:]
    assert not sliced.is_contiguous() and not shifted.is_contiguous()
    return compare_to_truth(sliced, shifted, "mean")


def check_non_contiguous_upstream():
    # 64 rows: at float32 a handful of rows make the error norm a coin toss at the
    # 1-ulp level (a few elements dominate it), for PyTorch and for us alike.
    logits, targets = make_inputs((64,), 123, torch.float32)
    upstream = (torch.rand(128, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEVICE)[::2]
    assert not upstream.is_contiguous()
    return compare_to_truth(logits, targets, "none", upstream)


def check_scaled_upstream():
    # e.g. loss / gradient_accumulation_steps: the backward rescale kernel runs.
    logits, targets = make_inputs((7,), 321, torch.bfloat16)
    return compare_to_truth(logits, targets, "mean", torch.tensor(0.25, device=DEVICE))


def check_all_ignored():
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
    return "loss 0.0, grad 0 (PyTorch: NaN)"


def check_extreme_logits():
    details = []
    for dtype in (torch.float32, torch.bfloat16):
        logits, targets = make_inputs((7,), 300, dtype, ignore_frac=0.0)
        logits[:, :50] = 1e4
        logits[:, 50:100] = -1e4
        logits[:, 100:150] = float("-inf")
        logits[0] = float("-inf")  # a row of -inf except its target: loss 0
        logits[0, targets[0]] = 5.0
        targets[(targets >= 100) & (targets < 150)] = 200  # a target at -inf has infinite loss
        targets[1] = 7  # a target sitting on the +1e4 plateau
        details.append(compare_to_truth(logits, targets, "mean"))
    return details[-1]


def check_no_grad_forward():
    logits, targets = make_inputs((7,), 4097, torch.bfloat16)
    with torch.no_grad():
        loss = cross_entropy(logits.requires_grad_(), targets)
    assert not loss.requires_grad
    l_true = truth(logits, targets, "mean", torch.tensor(1.0, device=DEVICE))[0]
    err = rel_err(loss, l_true)
    assert err < 1e-6, f"loss error {err:.2e}"
    return f"loss {err:.1e}"


def check_int32_targets():
    logits, targets = make_inputs((7,), 123, torch.float32)
    return compare_to_truth(logits, targets.to(torch.int32), "mean")


def check_logits_untouched():
    logits, targets = make_inputs((7,), 1000, torch.bfloat16)
    x = logits.clone().requires_grad_()
    cross_entropy(x, targets).backward()
    assert torch.equal(x.detach(), logits), "default mode must not modify the logits"
    return "bitwise unchanged after fwd+bwd"


def check_inplace_mode():
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
    return "same grad; misuse raises"


def check_backward_twice():
    logits, targets = make_inputs((3,), 50, torch.float32)
    x = logits.requires_grad_()
    loss = cross_entropy(x, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward called twice"):
        loss.backward()
    return "clear RuntimeError"


def check_module():
    logits, targets = make_inputs((2, 5), 123, torch.float32)
    module = TritonCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")
    a = module(logits, targets)
    b = cross_entropy(logits, targets, IGNORE, "sum")
    assert torch.equal(a, b)
    return "module == functional"


def check_bad_inputs():
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
    return "8 kinds rejected"


# ---------------------------------------------------------------- GPU-only checks
def check_int64_offsets():
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
    return f"loss {e_loss:.1e}  tail grad {e_grad:.1e}"


def check_cuda_graph_capture():
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
    return "replay == eager, bitwise"


def check_determinism():
    need_gpu()
    logits, targets = make_inputs((4096,), 128256, torch.bfloat16)
    one = torch.tensor(1.0, device="cuda")
    a = loss_and_grad(cross_entropy, logits, targets, "mean", one)
    b = loss_and_grad(cross_entropy, logits, targets, "mean", one)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "two identical runs differ"
    return "loss, grad bitwise equal"


def check_out_of_range_on_gpu():
    need_gpu()
    logits, targets = make_inputs((8,), 1000, torch.bfloat16, ignore_frac=0.0)
    targets[3] = 5000
    loss = cross_entropy(logits, targets)  # unchecked by default on CUDA: no host sync
    assert torch.isnan(loss).item(), "an out-of-range target must never give a finite loss"
    with pytest.raises(ValueError, match="out of range"):
        cross_entropy(logits, targets, check_targets=True)
    torch.cuda.synchronize()  # the context is still healthy
    return "NaN by default; check_targets=True raises"


def peak_extra_mb(fn):
    """Peak memory during fn() above what was allocated before it, in MB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


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


def check_memory():
    need_gpu()
    res = memory_comparison()
    grad_mb = 8192 * 128256 * 2 / 2**20  # the bf16 logits gradient itself
    ours, torch_mb, inplace = res["Fused Triton CE"], res["PyTorch (HF: logits.float())"], res["Fused Triton CE, in-place grad"]
    assert ours <= grad_mb + 64, f"fused CE used {ours:.0f} MB, more than the gradient ({grad_mb:.0f} MB) + 64 MB"
    assert inplace <= 64, f"in-place fused CE used {inplace:.0f} MB beyond the logits"
    assert ours < torch_mb
    return f"ours {ours:.0f} MB, in-place {inplace:.0f} MB, PyTorch {torch_mb:.0f} MB"


# One list of checks serves both pytest and the script report.
EDGE_CHECKS = [
    ("logits[:, :-1] slice, no copy", check_sliced_logits),
    ("non-contiguous upstream grad", check_non_contiguous_upstream),
    ("upstream grad 0.25", check_scaled_upstream),
    ("all targets ignored", check_all_ignored),
    ("extreme logits (+-1e4, -inf)", check_extreme_logits),
    ("forward under no_grad", check_no_grad_forward),
    ("int32 targets", check_int32_targets),
    ("logits not modified", check_logits_untouched),
    ("in-place gradient mode", check_inplace_mode),
    ("backward twice", check_backward_twice),
    ("TritonCrossEntropyLoss", check_module),
    ("bad inputs raise", check_bad_inputs),
]
GPU_CHECKS = [
    ("64-bit offsets (16,800 x 128,256)", check_int64_offsets),
    ("CUDA graph capture", check_cuda_graph_capture),
    ("bitwise determinism", check_determinism),
    ("out-of-range target on CUDA", check_out_of_range_on_gpu),
    ("peak memory (8192 x 128256)", check_memory),
]


# ------------------------------------------------- fused linear cross-entropy (step 13)
def make_flce_inputs(lead, h, v, dtype, seed=0, ignore_frac=0.25):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (2.0 / h**0.5)  # logits of a few units, like a trained head
    targets = torch.randint(0, v, lead, generator=g)
    targets[torch.rand(lead, generator=g) < ignore_frac] = IGNORE
    return hidden.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE), targets.to(DEVICE)


def flce_loss_and_grads(fn, hidden, weight, targets, reduction, upstream, **kwargs):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    loss = fn(h, w, targets, ignore_index=IGNORE, reduction=reduction, **kwargs)
    loss.backward(upstream.to(loss.dtype))
    return loss.detach(), h.grad, w.grad


def flce_compare_to_truth(hidden, weight, targets, reduction="mean", upstream=None, chunk_rows=None, factor=3.0):
    """Ours vs the plain path, both against float64; the issue's bar: no worse than ~3x."""
    if upstream is None:
        g = torch.Generator().manual_seed(1)
        upstream = (torch.rand(targets.shape, generator=g) + 0.5).to(DEVICE) if reduction == "none" else torch.tensor(1.0, device=DEVICE)
    ours = flce_loss_and_grads(fused_linear_cross_entropy, hidden, weight, targets, reduction, upstream, chunk_rows=chunk_rows)
    plain = flce_loss_and_grads(linear_cross_entropy_reference, hidden, weight, targets, reduction, upstream)
    true = flce_loss_and_grads(linear_cross_entropy_reference, hidden.double(), weight.double(), targets, reduction, upstream.double())
    assert ours[0].dtype == torch.float32 and ours[1].dtype == hidden.dtype and ours[2].dtype == weight.dtype
    assert ours[1].shape == hidden.shape and ours[2].shape == weight.shape
    return check_outputs(("loss", "dh", "dW"), ours, plain, true, (torch.float32, hidden.dtype, weight.dtype), factor,
                         peer_name="the plain path")


# (label, leading shape, hidden, vocab, dtype, reduction, chunk_rows): several chunks
# with a ragged last one, one chunk, 3-D input, vocab 2 and 128257, every reduction.
# Float32 scalar losses are exact to the last bit often enough on either path that a
# ratio of errors is noise; float32 is checked with reduction="none" (one error per row).
FLCE_CASES = [
    ("fp32 37x41 V=123 none, 5 chunks", (37,), 41, 123, "fp32", "none", 8),
    ("bf16 37x41 V=123 mean, 5 chunks", (37,), 41, 123, "bf16", "mean", 8),
    ("bf16 2x9x64 V=4097 sum, 3 chunks", (2, 9), 64, 4097, "bf16", "sum", 7),
    ("bf16 64x32 V=300 none, 4 chunks", (64,), 32, 300, "bf16", "none", 16),
    ("fp16 7x123 V=2 mean, 1 chunk", (7,), 123, 2, "fp16", "mean", None),
    ("bf16 3x41 V=128257 mean, auto", (3,), 41, 128257, "bf16", "mean", None),
]


@pytest.mark.parametrize("label,lead,h,v,dtype,reduction,chunk", FLCE_CASES, ids=[c[0] for c in FLCE_CASES])
def test_flce_matches_float64_truth(label, lead, h, v, dtype, reduction, chunk):
    check_flce_case(lead, h, v, dtype, reduction, chunk)


def check_flce_case(lead, h, v, dtype, reduction, chunk):
    """One FLCE_CASES row (pytest and the script report)."""
    return flce_compare_to_truth(*make_flce_inputs(lead, h, v, DTYPES[dtype]), reduction, chunk_rows=chunk)


def check_flce_shifted_hidden():
    # The causal-LM shift on activations: hidden[:, :-1] (not contiguous) and labels[:, 1:].
    hidden, weight, labels = make_flce_inputs((2, 10), 48, 500, torch.bfloat16)
    sliced = hidden[:, :-1]
    assert not sliced.is_contiguous()
    return flce_compare_to_truth(sliced, weight, labels[:, 1:], "mean", chunk_rows=5)


def check_flce_scaled_upstream():
    hidden, weight, targets = make_flce_inputs((20,), 32, 200, torch.bfloat16)
    return flce_compare_to_truth(hidden, weight, targets, "mean", torch.tensor(0.25, device=DEVICE), chunk_rows=6)


def check_flce_frozen_weight():
    # LoRA-style: only the hidden states need a gradient; no weight gradient is built.
    hidden, weight, targets = make_flce_inputs((12,), 32, 200, torch.bfloat16)
    h = hidden.detach().requires_grad_()
    fused_linear_cross_entropy(h, weight, targets, ignore_index=IGNORE, chunk_rows=5).backward()
    h_ref = hidden.detach().requires_grad_()
    linear_cross_entropy_reference(h_ref, weight, targets).backward()
    assert weight.grad is None
    truth_h = hidden.double().requires_grad_()
    linear_cross_entropy_reference(truth_h, weight.double(), targets).backward()
    err, err_ref = rel_err(h.grad, truth_h.grad), rel_err(h_ref.grad, truth_h.grad)
    assert no_worse(err, err_ref, torch.bfloat16, 3.0), f"dh error {err:.2e} vs plain {err_ref:.2e}"
    return f"dh {err:.1e}/{err_ref:.1e}, no dW"


def check_flce_all_ignored():
    hidden, weight, _ = make_flce_inputs((6,), 16, 50, torch.bfloat16)
    targets = torch.full((6,), IGNORE, device=DEVICE)
    for reduction in ("mean", "sum"):
        loss, dh, dw = flce_loss_and_grads(fused_linear_cross_entropy, hidden, weight, targets, reduction,
                                           torch.tensor(1.0, device=DEVICE), chunk_rows=4)
        assert loss.item() == 0.0, f"{reduction}: all-ignored loss {loss.item()}, expected 0.0"
        assert torch.count_nonzero(dh) == 0 and torch.count_nonzero(dw) == 0, "gradients must be exactly 0"
    return "loss 0.0, dh = dW = 0"


def check_flce_no_grad():
    hidden, weight, targets = make_flce_inputs((9,), 32, 700, torch.bfloat16)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden.requires_grad_(), weight, targets, ignore_index=IGNORE, chunk_rows=4)
    assert not loss.requires_grad
    ref = linear_cross_entropy_reference(hidden.detach(), weight, targets)
    truth_loss = linear_cross_entropy_reference(hidden.detach().double(), weight.double(), targets)
    err, err_ref = rel_err(loss, truth_loss), rel_err(ref, truth_loss)
    assert no_worse(err, err_ref, torch.float32), f"loss error {err:.2e} vs plain {err_ref:.2e}"
    return f"loss {err:.1e}/{err_ref:.1e}"


def check_flce_module_and_errors():
    hidden, weight, targets = make_flce_inputs((5,), 8, 20, torch.float32, ignore_frac=0.0)
    a = TritonFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")(hidden, weight, targets)
    assert torch.equal(a, fused_linear_cross_entropy(hidden, weight, targets, IGNORE, "sum"))
    loss = fused_linear_cross_entropy(hidden.requires_grad_(), weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward called twice"):
        loss.backward()
    with pytest.raises(TypeError, match="same dtype"):
        fused_linear_cross_entropy(hidden, weight.half(), targets)
    with pytest.raises(ValueError, match="does not match hidden size"):
        fused_linear_cross_entropy(hidden, weight[:, :7], targets)
    with pytest.raises(ValueError, match="targets shape"):
        fused_linear_cross_entropy(hidden, weight, targets[:4])
    bad = targets.clone()
    bad[1] = 20
    with pytest.raises(ValueError, match="out of range"):
        fused_linear_cross_entropy(hidden, weight, bad, check_targets=True)
    with pytest.raises(ValueError, match="chunk_rows"):
        fused_linear_cross_entropy(hidden, weight, targets, chunk_rows=0)
    with pytest.raises(ValueError, match="same device"):
        fused_linear_cross_entropy(hidden, weight.to("meta"), targets)
    return "module == functional; 7 misuses rejected"


def check_flce_llama_size():
    need_gpu()
    # LLaMA-3.1-8B head at 4,096 tokens, auto chunking (4 chunks): against a float64 truth.
    hidden, weight, targets = make_flce_inputs((4096,), 4096, 128256, torch.bfloat16)
    return flce_compare_to_truth(hidden, weight, targets, "mean")


def check_flce_cuda_graph():
    need_gpu()
    hidden, weight, targets = make_flce_inputs((1024,), 512, 32000, torch.bfloat16)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile and warm cuBLAS outside the capture
        for _ in range(2):
            torch.autograd.grad(fused_linear_cross_entropy(h, w, targets), (h, w))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = fused_linear_cross_entropy(h, w, targets)
        dh, dw = torch.autograd.grad(loss * 0.5, (h, w))
    new_h, _, new_t = make_flce_inputs((1024,), 512, 32000, torch.bfloat16, seed=1)
    with torch.no_grad():
        h.copy_(new_h)
        targets.copy_(new_t)
    graph.replay()
    torch.cuda.synchronize()
    ref = flce_loss_and_grads(fused_linear_cross_entropy, new_h, weight, new_t, "mean", torch.tensor(0.5, device="cuda"))
    assert torch.equal(loss, ref[0]) and torch.equal(dh, ref[1]) and torch.equal(dw, ref[2]), "replay differs from eager"
    return "replay == eager, bitwise"


def flce_memory(n=4096, h=4096, v=128256):
    """Peak extra MB of forward+backward beyond inputs, weight and the two gradients."""
    hidden, weight, targets = make_flce_inputs((n,), h, v, torch.bfloat16)
    grads_mb = (hidden.numel() + weight.numel()) * 2 / 2**20
    results = {}
    for name, fn in (("plain (matmul, then HF loss)", linear_cross_entropy_reference), ("fused linear CE", fused_linear_cross_entropy)):
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def step(fn=fn, hh=hh, ww=ww):
            grads = torch.autograd.grad(fn(hh, ww, targets), (hh, ww))
            del grads

        results[name] = peak_extra_mb(step) - grads_mb
        del hh, ww
        torch.cuda.empty_cache()
    return results


def check_flce_memory():
    need_gpu()
    res = flce_memory()
    ours, plain = res["fused linear CE"], res["plain (matmul, then HF loss)"]
    logits_mb = 4096 * 128256 * 2 / 2**20
    assert ours <= 300, f"fused linear CE used {ours:.0f} MB beyond its gradients (target 300)"
    assert ours < logits_mb / 3
    return f"ours {ours:.0f} MB, plain {plain:.0f} MB (bf16 logits alone: {logits_mb:.0f} MB)"


FLCE_CHECKS = [
    ("hidden[:, :-1] slice", check_flce_shifted_hidden),
    ("upstream grad 0.25", check_flce_scaled_upstream),
    ("frozen weight (LoRA)", check_flce_frozen_weight),
    ("all targets ignored", check_flce_all_ignored),
    ("forward under no_grad", check_flce_no_grad),
    ("module, misuse raises", check_flce_module_and_errors),
    ("GPU: 4096 x 4096 -> 128256 vs float64", check_flce_llama_size),
    ("GPU: CUDA graph capture", check_flce_cuda_graph),
    ("GPU: peak memory at 4096 tokens", check_flce_memory),
]


ALL_CHECKS = EDGE_CHECKS + GPU_CHECKS + FLCE_CHECKS


@pytest.mark.parametrize("label,check", ALL_CHECKS, ids=[c[0] for c in ALL_CHECKS])
def test_check(label, check):
    check()


def main():
    report = Report(f"Cross-Entropy Correctness Tests on {WHERE}\n(error vs float64: ours / PyTorch, relative)")
    report.cases_by_dtype(CASES, lambda c: c[3], lambda c: check_case(*c[1:]))
    report.checks("Test 4: Edge cases and API", EDGE_CHECKS)
    report.checks("Test 5: GPU only", GPU_CHECKS)
    report.section("Test 6: Fused linear cross-entropy (error vs float64: ours / matmul-then-CE)")
    for label, lead, h, v, dtype, reduction, chunk in FLCE_CASES:
        report.run(label, lambda c=(lead, h, v, dtype, reduction, chunk): check_flce_case(*c))
    for label, fn in FLCE_CHECKS:
        report.run(label, fn)
    if torch.cuda.is_available():
        print("\nMemory Comparison: peak extra memory of forward+backward, 8,192 x 128,256 bf16")
        print("(beyond the caller's logits and targets; the logits gradient is counted)")
        print("-" * 72)
        for name, mb in memory_comparison().items():
            print(f"  {name:<34} {mb:10,.0f} MB")
    return report.finish("cross-entropy")


if __name__ == "__main__":
    sys.exit(main())
