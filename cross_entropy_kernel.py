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

import torch
import torch.nn as nn
import torch.nn.functional as F

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import (
    SUPPORTED_DTYPES, cast_to, check_kernel_device, exp, fast_launch, first_order_only, kernel_op, log, next_power_of_2,
    nothing,
)
from swap_common import SwapMismatch, error_line, probe_ids, probing

import triton
import triton.language as tl

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
# Forward kernel (computes the loss and, when training, the gradient)
# --------------------------------------------------------------------------------
# The row work is written as three @triton.jit helpers (Triton inlines them): the
# online logsumexp, the loss, the gradient. The kernel below reads as the
# algorithm, and each helper can be read (and changed) on its own.
@triton.jit
def _row_stats(logits_row, col_start, n_blocks, V, ignored, BLOCK_V: tl.constexpr, PRECISE_EXP: tl.constexpr):
    """Online logsumexp over columns [col_start, col_start + n_blocks * BLOCK_V) of one row: (m, d)."""
    # m is the running max of the logits, d the running sum of exp(z - m).
    m = float("-inf")
    d = 0.0
    # Ignored rows load nothing: a column bound of 0 masks every lane. (One bound
    # instead of `(cols < V) & ~ignored`: the same mask, and the form that
    # every Triton release's interpreter broadcasts correctly.)
    n_load = tl.where(ignored, 0, V)
    for i in range(0, n_blocks):
        cols = col_start + i * BLOCK_V + tl.arange(0, BLOCK_V)
        z = tl.load(logits_row + cols, mask=cols < n_load, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # While every logit seen so far is -inf, m_new is -inf too and z - m_new
        # would be NaN; shifting by 0 instead keeps d at exactly 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # We subtract before exponentiating: z - m is exact for the terms that
        # matter (z close to m), while z * log2(e) would carry the rounding of
        # |z| * log2(e) into every term.
        d = d * exp(m - m_safe, PRECISE_EXP) + tl.sum(exp(z - m_safe, PRECISE_EXP), axis=0)
        m = m_new
    return m, d


@triton.jit
def _row_loss(logits_row, target, V, ignore_index, m, d):
    """From the row's (m, d): (m, log d, loss), with the ignore and out-of-range rules applied."""
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < V)
    # logsumexp = m + log(d). We keep the two parts apart, as PyTorch's
    # log_softmax does: m + log(d) would round at the scale of m (ulp(12) ~ 1e-6),
    # while (z - m) - log(d) stays exact where the probabilities are large.
    # Ignored rows loaded nothing (m = -inf, d = 0): give them finite stand-ins so
    # the gradient pass computes 0 * finite, not 0 * inf.
    m = tl.where(ignored, 0.0, m)
    log_d = log(tl.where(ignored, 1.0, d))
    # The target logit is one scalar load, not a search through the chunks. Out of
    # range targets read index 0 but their loss is forced to NaN just below.
    safe_target = tl.where(in_range, target, 0)
    z_target = tl.load(logits_row + safe_target).to(tl.float32)
    loss = tl.where(ignored, 0.0, tl.where(in_range, (m - z_target) + log_d, float("nan")))
    return m, log_d, loss


@triton.jit
def _row_grad(logits_row, grad_row, col_start, n_blocks, V, target, ignore_index, m, log_d, N_VALID, UPSTREAM,
              up_offset, MEAN: tl.constexpr, HAS_UPSTREAM: tl.constexpr, BLOCK_V: tl.constexpr,
              PRECISE_EXP: tl.constexpr):
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
    n_load = tl.where(ignored, 0, V)  # as in _row_stats: ignored rows load nothing
    for i in range(0, n_blocks):
        cols = col_start + i * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        # Masked lanes move no memory: ignored rows only write their zeros.
        z = tl.load(logits_row + cols, mask=cols < n_load, other=0.0).to(tl.float32)
        p = exp((z - m) - log_d, PRECISE_EXP)  # softmax, never stored on its own
        g = (p - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(grad_row + cols, cast_to(g, grad_row.dtype.element_ty), mask=col_mask)


@fast_launch
@triton.jit(do_not_specialize=["inner"])  # a varying count: not specialized (rmsnorm_kernel.py)
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
    PRECISE_EXP: tl.constexpr,  # float32 logits: float32-accurate exp (kernel_common.exp)
):
    # One program per token row. The row index is 64-bit from the start so that
    # every offset computed from it is too (design choice 4).
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner
    logits_row = LOGITS + outer * stride_outer + (row - outer * inner) * stride_inner
    target = tl.load(TARGETS + row).to(tl.int64)
    n_blocks = tl.cdiv(V, BLOCK_V)

    # ---- pass 1: online logsumexp, then the loss --------------------------------
    m, d = _row_stats(logits_row, 0, n_blocks, V, target == ignore_index, BLOCK_V, PRECISE_EXP)
    m, log_d, loss = _row_loss(logits_row, target, V, ignore_index, m, d)
    tl.store(LOSS + row, loss)

    # ---- pass 2: the gradient, while the row is still in L2 (design choice 1) ---
    if WRITE_GRAD:
        grad_row = GRAD + outer * grad_stride_outer + (row - outer * inner) * grad_stride_inner
        _row_grad(logits_row, grad_row, 0, n_blocks, V, target, ignore_index, m, log_d, N_VALID, UPSTREAM,
                  row * stride_up, MEAN, HAS_UPSTREAM, BLOCK_V, PRECISE_EXP)


# --------------------------------------------------------------------------------
# Backward kernel: apply the upstream gradient (design choice 2)
# --------------------------------------------------------------------------------
# Chain rule: d(out)/d(logits) = upstream * d(loss)/d(logits). The forward pass
# wrote the gradient for upstream == 1. This kernel reads the upstream value on
# the device; rows whose upstream gradient is exactly 1 (every row after
# loss.backward() on a mean or sum) return after one scalar load, so the common
# case costs a few microseconds instead of another pass over [N, V].
@fast_launch
@triton.jit(do_not_specialize=["inner"])  # a varying count: not specialized (rmsnorm_kernel.py)
def _cross_entropy_bwd_scale_kernel(
    GRAD,  # gradient written by the forward kernel (may alias the logits)
    GRAD_OUT,  # upstream gradient: a scalar (stride 0) or one value per row
    stride_go,
    inner,
    grad_stride_outer,
    grad_stride_inner,
    V,
    BLOCK_V: tl.constexpr,
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
            tl.store(grad_row + cols, cast_to(g * g_out, GRAD.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------
# Vocabulary chunk and warps per program on the GPU, from a sweep on an H200
# (tools/tune_kernels.py, NOTES.md): 8,192 bf16 values = 16 KB per iteration and 8
# warps (32 values per thread) was fastest at 8,192 rows; few rows (<= 2,048, too
# few programs to fill the GPU) prefer 16,384-wide chunks with 4 warps.
BLOCK_V_GPU = 8192
NUM_WARPS_GPU = 8
FEW_ROWS = 2048
BLOCK_V_FEW_ROWS, NUM_WARPS_FEW_ROWS = 16384, 4


def launch_config(v, n_rows, device):
    """(BLOCK_V, num_warps) for a vocabulary size and row count."""
    if device.type != "cuda":
        # The interpreter runs each block op as one NumPy call: bigger is faster.
        return min(32768, next_power_of_2(v)), 4
    if n_rows <= FEW_ROWS:
        return min(BLOCK_V_FEW_ROWS, next_power_of_2(v)), NUM_WARPS_FEW_ROWS
    return min(BLOCK_V_GPU, next_power_of_2(v)), NUM_WARPS_GPU


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


def check_targets_and_reduction(op, targets, ignore_index, reduction, rows_name, rows):
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
    check_targets_and_reduction("cross_entropy", targets, ignore_index, reduction, "logits", logits)
    check_kernel_device(logits, targets)


def _may_overlap(t):
    """Whether two elements of ``t`` may share memory (an expanded or overlapping view).

    Walk the dimensions from the smallest stride up: each stride must step over
    everything the smaller dimensions span.
    """
    span = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride < span:
            return True
        span = stride * size
    return False


def check_target_range(targets, v, ignore_index):
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
def launch_forward(rows, layout, tgt, loss, grad, grad_layout, n_valid, ignore_index, mean, upstream=None):
    """One launch of the forward kernel: loss per row and, if ``grad`` is given, the gradient."""
    inner, s_outer, s_inner = layout
    g_outer, g_inner = grad_layout
    v, n_rows = rows.shape[-1], tgt.numel()
    block_v, num_warps = launch_config(v, n_rows, rows.device)
    _cross_entropy_fwd_kernel[(n_rows,)](
        rows, tgt, loss, grad if grad is not None else loss, n_valid,  # GRAD is never written without WRITE_GRAD
        upstream if upstream is not None else loss, upstream.stride(0) if upstream is not None else 0,
        inner, s_outer, s_inner, g_outer, g_inner, v, ignore_index,
        MEAN=mean, WRITE_GRAD=grad is not None, HAS_UPSTREAM=upstream is not None,
        BLOCK_V=block_v,
        PRECISE_EXP=rows.dtype == torch.float32, num_warps=num_warps,
    )


def reduce_loss(loss, n_valid, reduction, lead_shape):
    """Per-row float32 losses -> the requested reduction (mean over the valid rows, 0 if none)."""
    if reduction == "mean":
        return loss.sum() / n_valid.clamp(min=1.0).squeeze(0)
    if reduction == "sum":
        return loss.sum()
    return loss.view(lead_shape)


def claim_backward(ctx, op):
    """The gradient was prepared once, in forward: a second backward must fail loudly."""
    if ctx.used:
        raise RuntimeError(
            f"{op}: backward called twice through the same graph; the gradient is prepared once "
            "(do not use retain_graph=True through it)"
        )
    ctx.used = True


def _recomputes(write_grad, reduction, dtype, inplace=False):
    """Whether backward recomputes the gradient from the saved logits.

    Two cases want the upstream gradient applied *before* the gradient is
    rounded to the logits' dtype, so backward rereads the logits instead of
    rescaling what forward wrote:
    * reduction="none": the upstream is a weight per token, rarely 1, and
      rescaling a rounded gradient would round twice;
    * float16 logits: fp16 training scales the loss (by 65536, say) so that
      small gradients survive fp16's narrow range; rounded before the scale is
      known, softmax values below ~6e-8 would already be zero.
    In-place mode has no logits left to reread and keeps the fused path.
    """
    return write_grad and (reduction == "none" or dtype == torch.float16) and not inplace


def _forward(logits, targets, ignore_index, reduction, write_grad, inplace, check):
    """The forward pass both entry points share.

    Returns (loss, grad, n_valid): the reduced float32 loss; the gradient that
    forward prepared (a fresh [..., V] buffer, the logits themselves in
    in-place mode, or None when not asked for or recomputed in backward); the
    number of valid targets as a [1] float32 device tensor.
    """
    v = logits.shape[-1]
    lead_shape = logits.shape[:-1]
    if check:
        check_target_range(targets, v, ignore_index)
    n_rows = targets.numel()
    rows, inner, s_outer, s_inner = _row_layout(logits)
    tgt = targets.reshape(-1).contiguous()  # the kernel reads target r at TARGETS + r
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    inplace = inplace and rows.data_ptr() == logits.data_ptr() and rows.shape[-1] == v
    recompute = _recomputes(write_grad, reduction, logits.dtype, inplace)

    # Where the gradient goes: a fresh [N, V] buffer, or (opt-in) the logits
    # themselves when they were not copied by _row_layout.
    grad = None
    g_outer, g_inner = 0, 0
    if write_grad and not recompute:
        if inplace:
            grad, g_outer, g_inner = rows, s_outer, s_inner
        else:
            grad = torch.empty(lead_shape + (v,), dtype=logits.dtype, device=logits.device)
            _, _, g_outer, g_inner = _row_layout(grad)

    # Count valid targets on the device: no .item(), so no host sync.
    n_valid = (tgt != ignore_index).sum(dtype=torch.float32).reshape(1)
    if n_rows > 0:
        launch_forward(rows, (inner, s_outer, s_inner), tgt, loss, grad, (g_outer, g_inner), n_valid, ignore_index,
                       mean=reduction == "mean")
    if grad is not None and grad is rows:
        # In-place mode: the logits now hold the gradient. Bump their version
        # counter so autograd rejects any other backward that saved them; hand
        # autograd the logits tensor itself.
        torch.autograd.graph.increment_version(logits)
        grad = logits.detach()
    return reduce_loss(loss, n_valid, reduction, lead_shape), grad, n_valid


def _cross_entropy_forward_fake(logits, targets, ignore_index, reduction, write_grad, check):
    loss = logits.new_empty(logits.shape[:-1] if reduction == "none" else (), dtype=torch.float32)
    grad = logits.new_empty(logits.shape) if write_grad and not _recomputes(write_grad, reduction, logits.dtype) \
        else nothing(logits)
    return loss, grad, logits.new_empty((1,), dtype=torch.float32)


@kernel_op("cross_entropy_forward", fake=_cross_entropy_forward_fake)
def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str,
                          write_grad: bool, check: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad, n_valid) as in ``_forward``, never in place; grad is empty when not prepared."""
    loss, grad, n_valid = _forward(logits, targets, ignore_index, reduction, write_grad, False, check)
    return loss, (grad if grad is not None else nothing(logits)), n_valid


def _cross_entropy_grad_fake(logits, targets, n_valid, upstream, ignore_index, mean):
    return logits.new_empty(logits.shape)


@kernel_op("cross_entropy_grad", fake=_cross_entropy_grad_fake)
def cross_entropy_grad(logits: torch.Tensor, targets: torch.Tensor, n_valid: torch.Tensor, upstream: torch.Tensor,
                       ignore_index: int, mean: bool) -> torch.Tensor:
    """The recomputed gradient: upstream (one value per row) applied before rounding."""
    rows, *layout = _row_layout(logits)
    tgt = targets.reshape(-1).contiguous()
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    n_rows = tgt.numel()
    if n_rows > 0:
        scratch = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        launch_forward(rows, layout, tgt, scratch, grad, _row_layout(grad)[2:], n_valid,
                       ignore_index, mean=mean, upstream=upstream)
    return grad


def _recomputed_grad(ctx, grad_output):
    logits, targets, n_valid = ctx.saved_tensors
    upstream = upstream_per_row(grad_output, ctx.reduction, targets.numel())
    return cross_entropy_grad(logits, targets, n_valid, upstream, ctx.ignore_index, ctx.reduction == "mean")


class TritonCrossEntropyFunction(torch.autograd.Function):
    """Eager autograd: the gradient is prepared in forward and scaled in place in backward."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction, write_grad, inplace_backward, check):
        loss, grad, n_valid = _forward(logits, targets, ignore_index, reduction, write_grad, inplace_backward, check)
        ctx.recompute = write_grad and grad is None
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        ctx.used = False
        ctx.grad = grad  # on ctx, not saved: backward hands it to autograd and drops it
        if ctx.recompute:
            ctx.save_for_backward(logits, targets, n_valid)
        return loss

    @staticmethod
    @first_order_only("cross_entropy")
    def backward(ctx, grad_output):
        claim_backward(ctx, "cross_entropy")
        if ctx.recompute:
            return _recomputed_grad(ctx, grad_output), None, None, None, None, None, None
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
            block_v, num_warps = launch_config(v, n_rows, grad.device)
            _cross_entropy_bwd_scale_kernel[(n_rows,)](
                rows, go, stride_go, inner, g_outer, g_inner, v,
                BLOCK_V=block_v, num_warps=num_warps,
            )
        return grad, None, None, None, None, None, None


# The operator's autograd, for torch.compile. Same forward, but a compiled graph
# owns its buffers: no in-place gradient, nothing kept on ctx, and the upstream
# scale is an ordinary multiplication that the compiler fuses into a kernel.
def _op_setup_context(ctx, inputs, output):
    logits, targets, ignore_index, reduction, write_grad, _ = inputs
    _, grad, n_valid = output
    ctx.mark_non_differentiable(grad, n_valid)
    ctx.ignore_index, ctx.reduction = ignore_index, reduction
    ctx.recompute = _recomputes(write_grad, reduction, logits.dtype)
    ctx.save_for_backward(*((logits, targets, n_valid) if ctx.recompute else (grad,)))


@first_order_only("cross_entropy")
def _op_backward(ctx, grad_output, _dgrad, _dn_valid):
    if ctx.recompute:
        grad = _recomputed_grad(ctx, grad_output)
    else:
        (grad,) = ctx.saved_tensors
        grad = grad * grad_output  # reduction "mean"/"sum": one scalar
    return grad, None, None, None, None, None


cross_entropy_forward.op.register_autograd(_op_backward, setup_context=_op_setup_context)


def upstream_per_row(grad_output, reduction, n_rows):
    """The upstream gradient as one value per row for launch_forward, without a copy:
    reduction="none" has one already; a scalar is expanded (stride 0)."""
    if reduction == "none":
        return grad_output.reshape(-1)
    return grad_output.reshape(1).expand(n_rows)


def scale_by_upstream(grad, grad_output):
    """grad *= grad_output (a device scalar), skipped on the device when it is 1."""
    rows = grad.reshape(-1, grad.shape[-1])
    if grad.device.type != "cuda" and grad.is_contiguous():
        # One scalar scales every value, so the rows can be any split of the values. The
        # interpreter pays a Python overhead per program: a [V, hidden] weight gradient
        # as one row is one program instead of V.
        rows = grad.view(1, -1)
    n_rows, width = rows.shape
    if n_rows == 0 or width == 0:
        return
    block_v, num_warps = launch_config(width, n_rows, grad.device)
    _cross_entropy_bwd_scale_kernel[(n_rows,)](
        rows, grad_output.reshape(1), 0, n_rows, 0, rows.stride(0), width,
        BLOCK_V=block_v, num_warps=num_warps,
    )


def cross_entropy(logits, targets, ignore_index=-100, reduction="mean", inplace_backward=False, check_targets=None):
    """Fused cross-entropy with the semantics of ``F.cross_entropy(logits.float(), targets)``.

    logits: [..., V] float32/float16/bfloat16 (may be non-contiguous, e.g. a slice).
    targets: [...] int64 or int32; ``ignore_index`` entries contribute nothing.
    reduction: "mean" (over non-ignored targets; 0 if there are none), "sum", "none".
    inplace_backward: write the gradient into the logits buffer (saves [N, V]
        memory; the logits' values are destroyed and their version is bumped).
    check_targets: raise on out-of-range targets. Default: on for CPU tensors, off
        on CUDA (checking needs a host sync; unchecked bad rows give a NaN loss).
        The check runs inside the operator, so it works under torch.compile too.
    """
    _check_inputs(logits, targets, ignore_index, reduction)
    if inplace_backward and _may_overlap(logits):
        # Each row's gradient would overwrite logits that other rows still read.
        raise ValueError(
            f"cross_entropy: inplace_backward=True needs logits whose elements do not share memory; "
            f"these have strides {tuple(logits.stride())} for shape {tuple(logits.shape)} (an expand() "
            f"or overlapping view): pass logits.contiguous(), or inplace_backward=False"
        )
    if check_targets is None:
        check_targets = logits.device.type == "cpu"
    write_grad = torch.is_grad_enabled() and logits.requires_grad
    if torch.compiler.is_compiling():
        # One node of the compiled graph. In-place mode is an eager memory saving
        # only: a graph owns its buffers, and the compiled path never writes into
        # the caller's logits (same values, one [N, V] buffer more).
        loss, _, _ = cross_entropy_forward.op(logits, targets, ignore_index, reduction, write_grad, check_targets)
        return loss
    return TritonCrossEntropyFunction.apply(logits, targets, ignore_index, reduction, write_grad, inplace_backward,
                                            check_targets)


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


# --------------------------------------------------------------------------------
# In a model: HF's causal-LM loss, computed by this kernel
# --------------------------------------------------------------------------------
# A Hugging Face causal LM computes its loss inside forward when it is given labels:
# ``self.loss_function(logits=..., labels=..., vocab_size=..., **kwargs)``, which is
# transformers' ForCausalLMLoss unless the model sets its own. That function's rules
# are the contract Trainer relies on, so ours keeps every one of them:
#
# * the labels are shifted: the logit at position t predicts the label at t + 1; the
#   last position predicts nothing (``shift_labels``, if given, is used as it is:
#   TRL and context parallelism shift the labels themselves);
# * ``ignore_index`` (-100) marks positions without a target (padding, prompts);
# * with ``num_items_in_batch`` (Trainer passes it under gradient accumulation: the
#   number of targets in all micro-batches of the step) the loss is the *sum* over
#   this micro-batch divided by it, so that the accumulated gradient is the mean
#   over the whole step; without it, the mean over this micro-batch's targets.
#
# HF first copies the logits to float32 ([N, V] x 4 bytes); the kernel reads them in
# their own dtype and computes in float32, so that copy and its gradient never exist.
def causal_lm_targets(labels, shift_labels=None, ignore_index=-100):
    """The target of each position: ``shift_labels`` as given, else the labels moved one
    position left with ``ignore_index`` at each row's end (HF's ForCausalLMLoss)."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def causal_lm_reduction(num_items_in_batch):
    """"sum" when the caller normalizes by ``num_items_in_batch`` itself, else "mean"."""
    return "mean" if num_items_in_batch is None else "sum"


def divide_by_items(loss, num_items_in_batch, targets, ignore_index):
    """HF's normalization: the summed loss over ``num_items_in_batch`` (an int or a tensor,
    possibly on another device); the mean loss as it is, except over no target at all:
    there transformers divides 0 by 0 (NaN, with zero gradients, as PyTorch's
    cross_entropy gives), where our kernels return 0 (an all-padding batch in a training
    loop of their own stays finite). A model's loss gives transformers' value."""
    if num_items_in_batch is None:
        # torch.where: the NaN is the value only; the gradient stays the kernel's zeros. No host sync.
        return torch.where((targets != ignore_index).any(), loss, torch.full_like(loss, float("nan")))
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):
    """transformers' ForCausalLMLoss (same signature, same result) with the fused kernel:
    no float32 copy of the [B, T, V] logits."""
    targets = causal_lm_targets(labels, shift_labels, ignore_index).to(logits.device)
    loss = cross_entropy(logits, targets, ignore_index=ignore_index, reduction=causal_lm_reduction(num_items_in_batch))
    return divide_by_items(loss, num_items_in_batch, targets, ignore_index)


def use_fused_loss(model):
    """Make ``model`` (a Hugging Face causal LM) compute its loss with ``causal_lm_loss``:
    HF's models call ``self.loss_function`` on their logits when given labels, and
    transformers lets a model set it. Returns 1 (the one loss), 0 if ``model`` has no
    ``loss_function`` to set (not a transformers model). Raises SwapMismatch where a probe
    shows its forward computing the loss some other way (check_loss_function)."""
    if not hasattr(type(model), "loss_function"):
        return 0
    check_loss_function(model)
    model.loss_function = causal_lm_loss
    return 1


@torch.no_grad()
def check_loss_function(model):
    """Raise SwapMismatch unless ``model``'s forward, given labels, computes its loss by
    calling ``self.loss_function``, and that is HF's causal LM loss: a family that builds
    its own criterion (CPM-Ant's ``CrossEntropyLoss`` without the shift), or whose
    loss_type is another, would never call ours or would change its rules."""
    weight = next(model.parameters(), None)
    if weight is None or weight.is_meta:
        return
    original, calls = model.loss_function, []

    def recorded(logits, labels, *args, **kwargs):
        theirs = original(logits, labels, *args, **kwargs)
        calls.append((theirs.float(), causal_lm_loss(logits.float(), labels, *args, **kwargs).float()))
        return theirs

    model.loss_function = recorded
    name = type(model).__name__
    try:
        with probing(model):
            ids = probe_ids(model, weight.device)
            model(input_ids=ids, labels=ids)
    except Exception as e:  # noqa: BLE001 - the model's own forward: nothing to check our loss against
        raise SwapMismatch(f"{name}'s own forward fails on a probe with labels ({error_line(e)})") from None
    finally:
        model.loss_function = original
    if not calls:
        raise SwapMismatch(f"{name}'s forward computes its loss without calling loss_function: it keeps its own")
    theirs, ours = calls[-1]
    if not torch.allclose(theirs, ours, rtol=1e-4, atol=0):
        raise SwapMismatch(f"{name}'s loss_function is not HF's causal LM loss ({theirs.item():.6g} against "
                           f"{ours.item():.6g} on a probe): it keeps its own")
