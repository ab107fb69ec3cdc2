"""
Step 8 -- A fused cross-entropy loss in Triton with online softmax.

What it computes
----------------
For each token row r with logits z (length V = 128,256 for LLaMA-3) and target t::

    loss_r = logsumexp(z) - z[t]                       (0 if t == ignore_index)
    dloss_r / dz = softmax(z) - onehot(t)

reduced by ``mean`` (over non-ignored rows), ``sum`` or ``none``; the exact
semantics of ``F.cross_entropy(logits.float(), targets, ...)``, which is what HF's
LLaMA loss calls. The loss is float32, the gradient has the logits' dtype.

Why a custom kernel
-------------------
The logits are the largest tensor of LLaMA-3 training: [tokens, 128256], 2 GB in
bf16 at 8,192 tokens. HF upcasts them to float32 (4 GB), log_softmax writes
another 4 GB, and backward builds a float32 gradient (4 GB) before casting it to
bf16. This step is limited by memory *capacity* as much as by bandwidth.

Online softmax (Milakov & Gimelshein, 2018) computes logsumexp in one streaming
pass over vocabulary chunks with two running scalars, the maximum m and the sum
d of exp(z - m). When a chunk raises the maximum, the old sum is rescaled::

    m_new = max(m, max(chunk))
    d     = d * exp(m - m_new) + sum(exp(chunk - m_new))

No softmax tensor is ever written. Memory traffic of this kernel:

* forward with gradient (training): read the logits (pass 1), read them again
  (pass 2, often served by L2 since the row was just read) and write the
  gradient: 2 reads + 1 write of [N, V] at most, and nothing else of that size.
* forward only (``no_grad``): 1 read.

Design choices, each marked in the code:

1. The gradient is written by the *forward* launch (pass 2), while the row is
   still hot in L2, instead of re-reading the logits from HBM in backward.
   This is what makes the loss cheaper than a separate forward and backward.
2. The gradient written in forward assumes an upstream gradient of 1 (the
   common case: ``loss.backward()``). Backward launches a tiny kernel that
   reads the upstream gradient *on the device* and rescales only when it is not
   1 -- no ``.item()``, no host synchronization, so the loss and its backward can
   be captured in a CUDA graph. With ``reduction="none"`` (a weight per token,
   rarely all 1) backward instead recomputes the gradient from the logits with
   the upstream gradient applied before the single rounding to bf16.
3. ``mean`` divides by the number of non-ignored targets, counted on the device.
   If every target is ignored the loss is 0 and the gradient is 0 (PyTorch
   returns NaN, which would kill a training run on an all-padding batch).
4. Row offsets are 64-bit: rows x V passes 2**31 at 16,744 rows of LLaMA-3.
5. Opt-in in-place mode (``inplace_backward=True``) writes the gradient into the
   logits buffer itself and saves [N, V] of memory. The logits' autograd version
   counter is bumped, so any other op that saved them for its backward fails
   loudly instead of silently using the overwritten values. Only use it when
   nothing else needs the logits after the loss (the usual LM-head case).
6. ``exp2`` with a log2(e) factor: the GPU's fast exponential is base 2, so
   exp(t) costs a multiply plus one ex2 instruction.

Out-of-range targets (not in [0, V) and not ignore_index) are a bug in the
caller. On CPU tensors we raise a ValueError naming the first bad one. On CUDA,
checking would need a host synchronization, so by default the kernel makes the
loss of such a row NaN (and its gradient NaN): never a silent number. Pass
``check_targets=True`` to get the ValueError on CUDA too, at the cost of a sync.

Triton concepts new in this step (see rmsnorm_kernel.py for the basics)
-----------------------------------------------------------------------
* A loop over chunks inside one program, carrying scalar state (m, d) between
  iterations: rows too long for registers are streamed.
* ``tl.constexpr`` flags (WRITE_GRAD) that remove whole code paths at compile time.
* Scalar loads of a device value (the target, the count of valid rows, the
  upstream gradient) used to steer the computation without the host knowing it.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# Imported first: it switches on the Triton interpreter when there is no GPU.
from rmsnorm_kernel import INTERPRET, SUPPORTED_DTYPES, cast_to, check_kernel_device

import triton
import triton.language as tl

from triton.language.extra import libdevice

# Module-level constants used inside @triton.jit code must be declared constexpr.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(t) == exp2(t * LOG2E)

REDUCTIONS = ("mean", "sum", "none")


# --------------------------------------------------------------------------------
# The reference: what HF's LLaMA loss computes. Tests compare against it and
# against its float64 version; the benchmark times it as "PyTorch eager".
# --------------------------------------------------------------------------------
def cross_entropy_reference(logits, targets, ignore_index=-100, reduction="mean"):
    """``F.cross_entropy(logits.float(), targets)`` on [..., V] logits, as HF does."""
    v = logits.shape[-1]
    return F.cross_entropy(
        logits.float().reshape(-1, v), targets.reshape(-1).long(), ignore_index=ignore_index, reduction=reduction
    ).reshape(targets.shape if reduction == "none" else ())


# --------------------------------------------------------------------------------
# exp, fast or precise
# --------------------------------------------------------------------------------
# The fast path (bf16/fp16 logits) is exp2(t * log2 e): one multiply and the GPU's
# ex2.approx instruction, ~2 ulp of float32, far below bf16's resolution. Float32
# logits deserve a float32-accurate exp, as PyTorch's expf is: libdevice's exp on
# the GPU; in the CPU interpreter (which has no libdevice) see _log below.
# In the CPU interpreter tl.exp / tl.log become NumPy's float32 exp / log, SIMD
# approximations with errors up to ~3 ulp: measurably worse (2-4x in the float32
# tests) than both PyTorch's CPU kernels and libdevice on the GPU. The interpreter
# therefore evaluates them in float64 and rounds once, which is what the GPU's
# accurate functions come close to.
@triton.jit
def _log(t, INTERPRET: tl.constexpr):
    # Once per row, so always the accurate one.
    if INTERPRET:
        return tl.log(t.to(tl.float64)).to(tl.float32)
    else:
        return libdevice.log(t)


@triton.jit
def _exp(t, PRECISE: tl.constexpr, INTERPRET: tl.constexpr):
    if PRECISE:
        if INTERPRET:
            return tl.exp(t.to(tl.float64)).to(tl.float32)
        else:
            return libdevice.exp(t)
    else:
        return tl.exp2(t * LOG2E)


# --------------------------------------------------------------------------------
# Forward kernel (computes the loss and, when training, the gradient)
# --------------------------------------------------------------------------------
# The row work is written as three @triton.jit helpers (Triton inlines them): the
# online logsumexp, the loss, the gradient. The kernel below reads as the
# algorithm, and each helper can be read (and changed) on its own.
@triton.jit
def _row_stats(logits_row, col_start, n_blocks, V, ignored, BLOCK_V: tl.constexpr, PRECISE_EXP: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Online logsumexp over columns [col_start, col_start + n_blocks * BLOCK_V) of one row: (m, d)."""
    # m is the running max of the logits, d the running sum of exp(z - m).
    m = float("-inf")
    d = 0.0
    for i in range(0, n_blocks):
        cols = col_start + i * BLOCK_V + tl.arange(0, BLOCK_V)
        z = tl.load(logits_row + cols, mask=(cols < V) & ~ignored, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # While every logit seen so far is -inf, m_new is -inf too and z - m_new
        # would be NaN; shifting by 0 instead keeps d at exactly 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # We subtract before exponentiating: z - m is exact for the terms that
        # matter (z close to m), while z * log2(e) would carry the rounding of
        # |z| * log2(e) into every term.
        d = d * _exp(m - m_safe, PRECISE_EXP, INTERPRET) + tl.sum(_exp(z - m_safe, PRECISE_EXP, INTERPRET), axis=0)
        m = m_new
    return m, d


@triton.jit
def _row_loss(logits_row, target, V, ignore_index, m, d, INTERPRET: tl.constexpr):
    """From the row's (m, d): (m, log d, loss), with the ignore and out-of-range rules applied."""
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < V)
    # logsumexp = m + log(d). We keep the two parts apart, as PyTorch's
    # log_softmax does: m + log(d) would round at the scale of m (ulp(12) ~ 1e-6),
    # while (z - m) - log(d) stays exact where the probabilities are large.
    # Ignored rows loaded nothing (m = -inf, d = 0): give them finite stand-ins so
    # the gradient pass computes 0 * finite, not 0 * inf.
    m = tl.where(ignored, 0.0, m)
    log_d = _log(tl.where(ignored, 1.0, d), INTERPRET)
    # The target logit is one scalar load, not a search through the chunks. Out of
    # range targets read index 0 but their loss is forced to NaN just below.
    safe_target = tl.where(in_range, target, 0)
    z_target = tl.load(logits_row + safe_target, mask=~ignored, other=0.0).to(tl.float32)
    loss = tl.where(ignored, 0.0, tl.where(in_range, (m - z_target) + log_d, float("nan")))
    return m, log_d, loss


@triton.jit
def _row_grad(logits_row, grad_row, col_start, n_blocks, V, target, ignore_index, m, log_d, N_VALID, UPSTREAM,
              up_offset, MEAN: tl.constexpr, HAS_UPSTREAM: tl.constexpr, BLOCK_V: tl.constexpr,
              SOFT_BF16: tl.constexpr, PRECISE_EXP: tl.constexpr, INTERPRET: tl.constexpr):
    """Write (softmax - onehot) * scale for columns [col_start, col_start + n_blocks * BLOCK_V)."""
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < V)
    scale = 1.0
    if MEAN:
        scale = 1.0 / tl.maximum(tl.load(N_VALID), 1.0)
    if HAS_UPSTREAM:
        scale = scale * tl.load(UPSTREAM + up_offset).to(tl.float32)
    # Ignored rows get a zero gradient, out-of-range rows a NaN one.
    scale = tl.where(ignored, 0.0, tl.where(in_range, scale, float("nan")))
    for i in range(0, n_blocks):
        cols = col_start + i * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        # Ignored rows skip the load (masked lanes move no memory).
        z = tl.load(logits_row + cols, mask=col_mask & ~ignored, other=0.0).to(tl.float32)
        p = _exp((z - m) - log_d, PRECISE_EXP, INTERPRET)  # softmax, never stored on its own
        g = (p - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(grad_row + cols, cast_to(g, grad_row.dtype.element_ty, SOFT_BF16), mask=col_mask)


@triton.jit
def _cross_entropy_fwd_kernel(
    LOGITS,  # logits; row r starts at (r // inner) * stride_outer + (r % inner) * stride_inner
    TARGETS,  # [N] int32 or int64 target ids
    LOSS,  # [N] float32 output: per-row loss, 0 for ignored rows
    GRAD,  # gradient output, same row layout with grad strides (may alias LOGITS)
    N_VALID,  # [1] float32: number of non-ignored targets, counted on the device
    UPSTREAM,  # upstream gradient, one value per row (stride_up) or one scalar (stride_up = 0)
    stride_up,
    inner,  # rows per outer index (T for [B, T, V] logits)
    stride_outer,
    stride_inner,
    grad_stride_outer,
    grad_stride_inner,
    V,
    ignore_index,
    MEAN: tl.constexpr,  # reduction == "mean": scale the gradient by 1 / N_VALID
    WRITE_GRAD: tl.constexpr,  # training: write d(loss)/d(logits) in pass 2
    HAS_UPSTREAM: tl.constexpr,  # scale the gradient by UPSTREAM (else by 1)
    BLOCK_V: tl.constexpr,  # vocabulary chunk streamed per loop iteration
    SOFT_BF16: tl.constexpr,  # interpreter only: round to bf16 by hand (rmsnorm_kernel.cast_to)
    PRECISE_EXP: tl.constexpr,  # float32 logits: float32-accurate exp (see _exp)
    INTERPRET: tl.constexpr,  # running in the CPU interpreter
):
    # One program per token row. The row index is 64-bit from the start so that
    # every offset computed from it is too (design choice 4).
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner
    logits_row = LOGITS + outer * stride_outer + (row - outer * inner) * stride_inner
    target = tl.load(TARGETS + row).to(tl.int64)
    n_blocks = tl.cdiv(V, BLOCK_V)

    # ---- pass 1: online logsumexp, then the loss --------------------------------
    m, d = _row_stats(logits_row, 0, n_blocks, V, target == ignore_index, BLOCK_V, PRECISE_EXP, INTERPRET)
    m, log_d, loss = _row_loss(logits_row, target, V, ignore_index, m, d, INTERPRET)
    tl.store(LOSS + row, loss)

    # ---- pass 2: the gradient, while the row is still in L2 (design choice 1) ---
    if WRITE_GRAD:
        grad_row = GRAD + outer * grad_stride_outer + (row - outer * inner) * grad_stride_inner
        _row_grad(logits_row, grad_row, 0, n_blocks, V, target, ignore_index, m, log_d, N_VALID, UPSTREAM,
                  row * stride_up, MEAN, HAS_UPSTREAM, BLOCK_V, SOFT_BF16, PRECISE_EXP, INTERPRET)


# --------------------------------------------------------------------------------
# Backward kernel: apply the upstream gradient (design choice 2)
# --------------------------------------------------------------------------------
# Chain rule: d(out)/d(logits) = upstream * d(loss)/d(logits). The forward pass
# wrote the gradient for upstream == 1. This kernel reads the upstream value on
# the device; rows whose upstream gradient is exactly 1 (every row after
# loss.backward() on a mean or sum) return after one scalar load, so the common
# case costs a few microseconds instead of another pass over [N, V].
@triton.jit
def _cross_entropy_bwd_scale_kernel(
    GRAD,  # gradient written by the forward kernel (may alias the logits)
    GRAD_OUT,  # upstream gradient: a scalar (stride 0) or one value per row
    stride_go,
    inner,
    grad_stride_outer,
    grad_stride_inner,
    V,
    BLOCK_V: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g_out = tl.load(GRAD_OUT + row * stride_go).to(tl.float32)
    if g_out != 1.0:
        outer = row // inner
        grad_row = GRAD + outer * grad_stride_outer + (row - outer * inner) * grad_stride_inner
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            g = tl.load(grad_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(grad_row + cols, cast_to(g * g_out, GRAD.dtype.element_ty, SOFT_BF16), mask=mask)


# --------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------
# Vocabulary chunk and warps per program on the GPU, from a sweep on an H200
# (.ci/tune_kernels.py, NOTES.md): 8,192 bf16 values = 16 KB per iteration and 8
# warps (32 values per thread) was fastest at 8,192 rows; few rows (<= 2,048, too
# few programs to fill the GPU) prefer 16,384-wide chunks with 4 warps.
BLOCK_V_GPU = 8192
NUM_WARPS_GPU = 8
FEW_ROWS = 2048
BLOCK_V_FEW_ROWS, NUM_WARPS_FEW_ROWS = 16384, 4


def _launch_config(v, n_rows, device):
    """(BLOCK_V, num_warps) for a vocabulary size and row count."""
    if device.type != "cuda":
        # The interpreter runs each block op as one NumPy call: bigger is faster.
        return min(32768, triton.next_power_of_2(v)), 4
    if n_rows <= FEW_ROWS:
        return min(BLOCK_V_FEW_ROWS, triton.next_power_of_2(v)), NUM_WARPS_FEW_ROWS
    return min(BLOCK_V_GPU, triton.next_power_of_2(v)), NUM_WARPS_GPU


def _row_layout(t):
    """Describe [..., V] as (outer, inner) row indices with two strides, without copying.

    Returns (tensor, inner, stride_outer, stride_inner). A slice such as
    logits[:, :-1, :] keeps its strides; only layouts that cannot be described by
    two strides (rare: >3-d, non-mergeable) or a non-unit vocabulary stride copy.
    """
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:
        return t, max(t.shape[0], 1), 0, t.stride(0)
    if t.dim() > 3:
        try:
            t = t.view(-1, t.shape[-2], t.shape[-1])
        except RuntimeError:
            t = t.reshape(-1, t.shape[-2], t.shape[-1])
    return t, max(t.shape[1], 1), t.stride(0), t.stride(1)


def _check_targets(op, targets, ignore_index, reduction, rows_name, rows):
    """The checks cross_entropy and fused_linear_cross_entropy share: targets
    (dtype, shape [...] of ``rows`` [..., X] without its last dim), ignore_index,
    reduction. ``op`` names the function in the messages."""
    if targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: targets must be int64 or int32 class indices, got {targets.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if tuple(targets.shape) != tuple(rows.shape[:-1]):
        raise ValueError(
            f"{op}: targets shape {tuple(targets.shape)} does not match {rows_name} shape "
            f"{tuple(rows.shape)} (expected {tuple(rows.shape[:-1])})"
        )
    if not isinstance(ignore_index, int):
        raise TypeError(f"{op}: ignore_index must be an int, got {type(ignore_index).__name__}")


def _check_inputs(logits, targets, ignore_index, reduction):
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError("cross_entropy expects tensors for logits and targets")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"cross_entropy: unsupported logits dtype {logits.dtype}; use float32, float16 or bfloat16")
    if logits.dim() < 2:
        raise ValueError(f"cross_entropy: logits must be [..., V] with at least 2 dims, got shape {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("cross_entropy: vocabulary size must be at least 1")
    _check_targets("cross_entropy", targets, ignore_index, reduction, "logits", logits)
    check_kernel_device(logits, targets)


def _check_target_range(targets, v, ignore_index):
    """Raise on a target outside [0, V) that is not ignore_index (synchronizes on CUDA)."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= v))
    if bool(bad.any()):
        idx = int(bad.reshape(-1).nonzero()[0])
        value = int(targets.reshape(-1)[idx])
        raise ValueError(
            f"cross_entropy: target {value} at flat position {idx} is out of range for a vocabulary "
            f"of {v} (valid: 0..{v - 1}, or ignore_index={ignore_index})"
        )


# --------------------------------------------------------------------------------
# Autograd function
# --------------------------------------------------------------------------------
def _launch_forward(rows, layout, tgt, loss, grad, grad_layout, n_valid, ignore_index, mean, upstream=None):
    """One launch of the forward kernel: loss per row and, if ``grad`` is given, the gradient."""
    inner, s_outer, s_inner = layout
    g_outer, g_inner = grad_layout
    v, n_rows = rows.shape[-1], tgt.numel()
    block_v, num_warps = _launch_config(v, n_rows, rows.device)
    _cross_entropy_fwd_kernel[(n_rows,)](
        rows, tgt, loss, grad if grad is not None else loss, n_valid,  # GRAD is never written without WRITE_GRAD
        upstream if upstream is not None else loss, upstream.stride(0) if upstream is not None else 0,
        inner, s_outer, s_inner, g_outer, g_inner, v, ignore_index,
        MEAN=mean, WRITE_GRAD=grad is not None, HAS_UPSTREAM=upstream is not None,
        BLOCK_V=block_v, SOFT_BF16=INTERPRET,
        PRECISE_EXP=rows.dtype == torch.float32, INTERPRET=INTERPRET, num_warps=num_warps,
    )


def _reduce(loss, n_valid, reduction, lead_shape):
    """Per-row float32 losses -> the requested reduction (mean over the valid rows, 0 if none)."""
    if reduction == "mean":
        return loss.sum() / n_valid.clamp(min=1.0).squeeze(0)
    if reduction == "sum":
        return loss.sum()
    return loss.view(lead_shape)


def _claim_backward(ctx, op):
    """The gradient was prepared once, in forward: a second backward must fail loudly."""
    if ctx.used:
        raise RuntimeError(
            f"{op}: backward called twice through the same graph; the gradient is prepared once "
            "(do not use retain_graph=True through it)"
        )
    ctx.used = True


class TritonCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction, write_grad, inplace_backward):
        v = logits.shape[-1]
        lead_shape = logits.shape[:-1]
        n_rows = targets.numel()
        rows, inner, s_outer, s_inner = _row_layout(logits)
        tgt = targets.reshape(-1)
        loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        inplace = inplace_backward and rows.data_ptr() == logits.data_ptr() and rows.shape[-1] == v

        # reduction="none" is the one case where the upstream gradient is normally
        # not 1 (a weight per token). Rescaling a gradient already rounded to bf16
        # would round twice, so there backward recomputes the gradient from the
        # saved logits with the upstream gradient applied before the only rounding
        # (one more read of the logits). In-place mode has no logits left to reread
        # and keeps the fused path.
        ctx.recompute = write_grad and reduction == "none" and not inplace
        ctx.ignore_index = ignore_index
        ctx.reduction = reduction
        ctx.used = False

        # Where the gradient goes: a fresh [N, V] buffer, or (opt-in) the logits
        # themselves when they were not copied by _row_layout.
        grad = None
        g_outer, g_inner = 0, 0
        if write_grad and not ctx.recompute:
            if inplace:
                grad, g_outer, g_inner = rows, s_outer, s_inner
            else:
                grad = torch.empty(lead_shape + (v,), dtype=logits.dtype, device=logits.device)
                _, _, g_outer, g_inner = _row_layout(grad)

        # Count valid targets on the device: no .item(), so no host sync.
        n_valid = (tgt != ignore_index).sum(dtype=torch.float32).reshape(1)
        if n_rows > 0:
            _launch_forward(rows, (inner, s_outer, s_inner), tgt, loss, grad, (g_outer, g_inner), n_valid, ignore_index,
                            mean=reduction == "mean")
        if grad is not None and grad is rows:
            # In-place mode: the logits now hold the gradient. Bump their version
            # counter so autograd rejects any other backward that saved them.
            torch.autograd.graph.increment_version(logits)

        # What backward hands to autograd: the buffer, or the logits tensor itself.
        ctx.grad = logits.detach() if (grad is not None and grad is rows) else grad
        if ctx.recompute:
            ctx.save_for_backward(logits, targets)

        return _reduce(loss, n_valid, reduction, lead_shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        _claim_backward(ctx, "cross_entropy")
        if ctx.recompute:
            logits, targets = ctx.saved_tensors
            rows, *layout = _row_layout(logits)
            tgt = targets.reshape(-1)
            grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
            if tgt.numel() > 0:
                scratch = torch.empty(tgt.numel(), dtype=torch.float32, device=logits.device)
                _launch_forward(rows, layout, tgt, scratch, grad, _row_layout(grad)[2:], scratch,
                                ctx.ignore_index, mean=False, upstream=grad_output.reshape(-1))
            return grad, None, None, None, None, None
        if ctx.grad is None:
            raise RuntimeError(
                "cross_entropy: no gradient was prepared in forward (the forward ran without "
                "grad mode or with logits that did not require grad)"
            )
        grad = ctx.grad
        ctx.grad = None  # release our reference once autograd owns the gradient
        rows, inner, g_outer, g_inner = _row_layout(grad)  # the layout forward wrote it with
        v, n_rows = grad.shape[-1], grad.numel() // grad.shape[-1]
        if n_rows > 0:
            if ctx.reduction == "none":
                go = grad_output.reshape(-1)
                stride_go = go.stride(0)
            else:
                go = grad_output.reshape(1)
                stride_go = 0  # one scalar for every row
            block_v, num_warps = _launch_config(v, n_rows, grad.device)
            _cross_entropy_bwd_scale_kernel[(n_rows,)](
                rows, go, stride_go, inner, g_outer, g_inner, v,
                BLOCK_V=block_v, SOFT_BF16=INTERPRET, num_warps=num_warps,
            )
        return grad, None, None, None, None, None


def cross_entropy(logits, targets, ignore_index=-100, reduction="mean", inplace_backward=False, check_targets=None):
    """Fused cross-entropy with the semantics of ``F.cross_entropy(logits.float(), targets)``.

    logits: [..., V] float32/float16/bfloat16 (may be non-contiguous, e.g. a slice).
    targets: [...] int64 or int32; ``ignore_index`` entries contribute nothing.
    reduction: "mean" (over non-ignored targets; 0 if there are none), "sum", "none".
    inplace_backward: write the gradient into the logits buffer (saves [N, V]
        memory; the logits' values are destroyed and their version is bumped).
    check_targets: raise on out-of-range targets. Default: on for CPU tensors, off
        on CUDA (checking needs a host sync; unchecked bad rows give a NaN loss).
    """
    _check_inputs(logits, targets, ignore_index, reduction)
    if check_targets is None:
        check_targets = logits.device.type == "cpu"
    if check_targets:
        _check_target_range(targets, logits.shape[-1], ignore_index)
    write_grad = torch.is_grad_enabled() and logits.requires_grad
    return TritonCrossEntropyFunction.apply(logits, targets, ignore_index, reduction, write_grad, inplace_backward)


class TritonCrossEntropyLoss(nn.Module):
    """Drop-in for ``nn.CrossEntropyLoss`` on [..., V] logits; forward(logits, targets)."""

    def __init__(self, ignore_index=-100, reduction="mean", inplace_backward=False):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.inplace_backward = inplace_backward

    def forward(self, logits, targets):
        return cross_entropy(logits, targets, self.ignore_index, self.reduction, self.inplace_backward)

    def extra_repr(self):
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, inplace_backward={self.inplace_backward}"


# ================================================================================
# Step 13 -- Fused linear cross-entropy: the logits are never materialized
# ================================================================================
# The LM head turns hidden states [N, H] into logits [N, V] = hidden @ weight.T,
# and the loss reads nothing else. For LLaMA-3.1-8B (H = 4096, V = 128256) the
# sizes follow from the shapes (benchmark_kernels.py --kernel flce measures peaks):
#
#   tokens   logits [N, V] bf16   their float32 copy (HF)   this step: one bf16 chunk
#    4,096        1.05 GB               2.1 GB               263 MB (4 chunks of 1,024 rows)
#   16,384        4.2  GB               8.4 GB               525 MB (8 chunks of 2,048 rows)
#
# HF holds the bf16 logits, a float32 copy, a float32 log-softmax and, in
# backward, a float32 and a bf16 gradient; the fused cross-entropy of step 8
# still needs the logits and their gradient. This step holds one chunk.
#
# The idea: cut the N rows into chunks. For each chunk of C rows
#
#   z   = h_c @ W.T                 [C, V]  cuBLAS, into one reused buffer
#   z   <- softmax(z) - onehot      the cross-entropy kernel above, in place (loss per row too)
#   dh_c = z @ W                    [C, H]  cuBLAS, straight into the hidden gradient
#   dW  += z.T @ h_c                [V, H]  cuBLAS, accumulated over chunks
#
# so the largest live tensor is one [C, V] chunk. Nothing is computed twice: the
# three matmuls are the ones the plain path runs (forward, and two in backward);
# they simply run during forward, chunk by chunk, while the chunk is at hand.
# Backward is left with rescaling the two gradients by the upstream gradient, and
# only when it is not 1 (the device-side check of _cross_entropy_bwd_scale_kernel).
#
# What it costs:
# * The gradients ([N, H] and [V, H]) exist from forward on, not from backward on;
#   training holds them anyway a moment later.
# * dW is accumulated in the weight's dtype: cuBLAS adds each chunk's product in
#   float32 and rounds once per chunk, so k chunks add k bf16 roundings. A float32
#   accumulator would cost V x H x 4 = 2.1 GB, four times the chunk buffer. The
#   rounding drift grows like sqrt(k): measured on CPU on a CE gradient (N = 4096,
#   H = 256, V = 2048), the relative error of dW vs float64 is 1.2x the
#   single-matmul path's at k = 2, 1.5x at k = 4, 2.0x at k = 8 (2.8x at 16, 3.8x
#   at 32). So the chunk count stays small: it grows only as the square root of
#   the logits' size (_flce_chunk_rows), and so does the chunk. Liger-Kernel 0.8.5
#   cuts N into ceil(V / H) = 32 chunks for LLaMA-3 at any N: at 4,096 tokens that
#   is 128-row matmuls, too small to keep the tensor cores busy.
# * reduction="none" (an upstream gradient per token) cannot fold the upstream
#   into a gradient computed in forward without rounding twice; that path saves
#   hidden and weight and recomputes chunk by chunk in backward (one more matmul).
#
# The logits' gradient is rounded to the logits' dtype before the two gradient
# matmuls, exactly as the plain path's bf16 gradient is, so dh and dW match what
# `cross_entropy(hidden @ weight.T, targets)` gives.
#
# The weight gradient has no bias term: LLaMA's LM head has none.

def linear_cross_entropy_reference(hidden, weight, targets, ignore_index=-100, reduction="mean"):
    """The plain path: the LM head matmul, then HF's loss on the [..., V] logits."""
    return cross_entropy_reference(hidden @ weight.t(), targets, ignore_index, reduction)


# The chunk-size rule: chunk bytes ~ sqrt(logits bytes * FLCE_CHUNK_UNIT). Both the
# chunk count (drift) and the chunk (memory) grow as the square root of the size:
# 4,096 x 128256 bf16 -> 4 chunks of 1,024 rows; 16,384 -> 8 chunks of 2,048.
FLCE_CHUNK_UNIT = 64 * 2**20
# Chunk rows are a multiple of this (tensor-core friendly matmul shapes).
FLCE_ROW_ALIGN = 64


def _flce_chunk_rows(n_rows, v, element_size):
    """Rows per chunk for [n_rows, v] logits of ``element_size`` bytes."""
    total = n_rows * v * element_size
    n_chunks = max(1, math.ceil(math.sqrt(total / FLCE_CHUNK_UNIT)))
    rows = triton.cdiv(n_rows, n_chunks)
    return max(1, min(n_rows, triton.cdiv(rows, FLCE_ROW_ALIGN) * FLCE_ROW_ALIGN))


def _flce_chunks(h2, weight, tgt, loss, n_valid, ignore_index, mean, grad_h, grad_w, chunk_rows, upstream=None):
    """The chunk loop: loss per row into ``loss``; gradients into ``grad_h`` / ``grad_w`` if given.

    h2: [N, H] contiguous; weight: [V, H]; tgt: [N]; upstream: [N] per-row upstream
    gradient (backward of reduction="none") or None (upstream 1).
    """
    n, v = h2.shape[0], weight.shape[0]
    write_grad = grad_h is not None or grad_w is not None
    # One [C, V] buffer for every chunk: the only logits-sized memory of the step.
    z_buf = torch.empty((min(chunk_rows, n), v), dtype=h2.dtype, device=h2.device)
    for start in range(0, n, chunk_rows):
        end = min(start + chunk_rows, n)
        h_c, z = h2[start:end], z_buf[: end - start]
        torch.mm(h_c, weight.t(), out=z)  # logits of the chunk, on cuBLAS
        # Loss per row; when training, the gradient overwrites the logits in place
        # (row stride v in both roles).
        _launch_forward(z, (end - start, 0, v), tgt[start:end], loss[start:end], z if write_grad else None, (0, v),
                        n_valid, ignore_index, mean, upstream[start:end] if upstream is not None else None)
        if grad_h is not None:
            torch.mm(z, weight, out=grad_h[start:end])  # rows are independent: no accumulation
        if grad_w is not None:
            if start == 0:
                torch.mm(z.t(), h_c, out=grad_w)
            else:
                grad_w.addmm_(z.t(), h_c)  # float32 inside cuBLAS, one rounding per chunk


def _scale_by_upstream(grad, grad_output):
    """grad *= grad_output (a device scalar), skipped on the device when it is 1."""
    rows = grad.reshape(-1, grad.shape[-1])
    n_rows, width = rows.shape
    if n_rows == 0:
        return
    block_v, num_warps = _launch_config(width, n_rows, grad.device)
    _cross_entropy_bwd_scale_kernel[(n_rows,)](
        rows, grad_output.reshape(1), 0, n_rows, 0, rows.stride(0), width,
        BLOCK_V=block_v, SOFT_BF16=INTERPRET, num_warps=num_warps,
    )


def _check_flce_inputs(hidden, weight, targets, ignore_index, reduction):
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight, targets)):
        raise TypeError("fused_linear_cross_entropy expects tensors for hidden, weight and targets")
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"fused_linear_cross_entropy: unsupported {name} dtype {t.dtype}; use float32, float16 or bfloat16")
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"fused_linear_cross_entropy: hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype"
        )
    if hidden.dim() < 2:
        raise ValueError(f"fused_linear_cross_entropy: hidden must be [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"fused_linear_cross_entropy: weight shape {tuple(weight.shape)} does not match hidden size "
            f"{hidden.shape[-1]} (expected [V, {hidden.shape[-1]}])"
        )
    if weight.shape[0] < 1 or hidden.shape[-1] < 1:
        raise ValueError("fused_linear_cross_entropy: vocabulary and hidden size must be at least 1")
    _check_targets("fused_linear_cross_entropy", targets, ignore_index, reduction, "hidden", hidden)
    check_kernel_device(hidden, weight, targets)


class TritonFusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, need_grad_h, need_grad_w, chunk_rows):
        lead_shape, h = hidden.shape[:-1], hidden.shape[-1]
        h2 = hidden.reshape(-1, h).contiguous()  # a view for the usual [B, T, H] activations
        tgt = targets.reshape(-1)
        n = tgt.numel()
        chunk_rows = chunk_rows or _flce_chunk_rows(n, weight.shape[0], hidden.element_size())
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        n_valid = (tgt != ignore_index).sum(dtype=torch.float32).reshape(1)
        # reduction="none": recompute in backward with the per-token upstream gradient.
        recompute = reduction == "none" and (need_grad_h or need_grad_w)
        fused = (need_grad_h or need_grad_w) and not recompute
        grad_h = torch.empty_like(h2) if fused and need_grad_h else None
        grad_w = torch.empty_like(weight) if fused and need_grad_w else None
        if n > 0:
            _flce_chunks(h2, weight, tgt, loss, n_valid, ignore_index, reduction == "mean", grad_h, grad_w, chunk_rows)
        elif grad_w is not None:
            grad_w.zero_()
        ctx.hidden_shape = hidden.shape
        ctx.ignore_index, ctx.chunk_rows, ctx.recompute = ignore_index, chunk_rows, recompute
        ctx.grads = (grad_h, grad_w)
        ctx.used = False
        if recompute:
            ctx.save_for_backward(h2, weight, tgt)
        return _reduce(loss, n_valid, reduction, lead_shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        _claim_backward(ctx, "fused_linear_cross_entropy")
        if ctx.recompute:
            h2, weight, tgt = ctx.saved_tensors
            grad_h = torch.empty_like(h2) if ctx.needs_input_grad[0] else None
            grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
            if tgt.numel() > 0:
                scratch = torch.empty(tgt.numel(), dtype=torch.float32, device=h2.device)
                _flce_chunks(h2, weight, tgt, scratch, scratch, ctx.ignore_index, False, grad_h, grad_w,
                             ctx.chunk_rows, upstream=grad_output.reshape(-1))
            elif grad_w is not None:
                grad_w.zero_()
        else:
            grad_h, grad_w = ctx.grads
            ctx.grads = None  # autograd owns them from here
            for g in (grad_h, grad_w):
                if g is not None:
                    _scale_by_upstream(g, grad_output)
        if grad_h is not None:
            grad_h = grad_h.view(ctx.hidden_shape)
        return grad_h, grad_w, None, None, None, None, None, None


def fused_linear_cross_entropy(hidden, weight, targets, ignore_index=-100, reduction="mean", chunk_rows=None,
                               check_targets=None):
    """``cross_entropy(hidden @ weight.T, targets)`` without ever holding the [N, V] logits.

    hidden: [N, H] or [B, T, H]; weight: [V, H] (same dtype); targets: hidden.shape[:-1].
    Returns the loss (float32) with gradients to hidden and weight; same reductions,
    ignore_index and all-ignored rule (loss 0, zero gradients) as ``cross_entropy``.
    chunk_rows: rows per chunk (default: the square-root rule of _flce_chunk_rows).
    check_targets: as in ``cross_entropy`` (default on for CPU tensors only).
    """
    _check_flce_inputs(hidden, weight, targets, ignore_index, reduction)
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"fused_linear_cross_entropy: chunk_rows must be a positive int, got {chunk_rows!r}")
    if check_targets is None:
        check_targets = hidden.device.type == "cpu"
    if check_targets:
        _check_target_range(targets, weight.shape[0], ignore_index)
    grad_on = torch.is_grad_enabled()
    return TritonFusedLinearCrossEntropyFunction.apply(
        hidden, weight, targets, ignore_index, reduction,
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad, chunk_rows,
    )


class TritonFusedLinearCrossEntropyLoss(nn.Module):
    """LM head + loss in one: forward(hidden, weight, targets), e.g. with ``model.lm_head.weight``."""

    def __init__(self, ignore_index=-100, reduction="mean", chunk_rows=None):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.chunk_rows = chunk_rows

    def forward(self, hidden, weight, targets):
        return fused_linear_cross_entropy(hidden, weight, targets, self.ignore_index, self.reduction, self.chunk_rows)

    def extra_repr(self):
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, chunk_rows={self.chunk_rows}"
