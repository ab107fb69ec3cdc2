"""
Step 5 -- A fused RMSNorm in Triton, forward and backward.

What it computes
----------------
LLaMA normalizes every token's hidden vector x (length H) before attention, before
the MLP and once more before the LM head: 2 x 32 + 1 = 65 RMSNorms per forward pass
of LLaMA-3.1-8B. Hugging Face's ``LlamaRMSNorm`` does, for each row::

    h = x.float()
    h = h * rsqrt(mean(h ** 2) + eps)        # statistics in float32
    y = weight * h.to(x.dtype)               # cast back first, then scale

Note the order: the normalized value is rounded to the input dtype *before* the
weight multiplies it. We reproduce exactly that, so a model patched with this
kernel computes the same numbers as the unpatched one.

The Gemma variant
-----------------
Gemma (``GemmaRMSNorm``, ``Gemma2RMSNorm``, ``Gemma3RMSNorm``) names the same
operation differently and computes two things differently::

    h = x.float()
    h = h * rsqrt(mean(h ** 2) + eps)        # the same statistics
    y = (h * (1.0 + weight.float())).to(x.dtype)   # offset weight, float32 product, cast last

* The weight is stored as an *offset from 1* (initialized to zeros): the scale
  is ``1 + w``. A checkpoint's Gemma weights near 0 mean "scale near 1"; feeding
  them to LLaMA's formula would multiply every activation by almost nothing.
* The product is taken in float32 and rounded once, to x's dtype, at the very
  end (LLaMA rounds x_hat first and then again after the multiply). Keeping the
  float32 product is what makes our output round exactly where HF's does.

Both are compile-time flags of the same kernels (``W_OFFSET`` 1.0 vs 0.0 and
``CAST_FIRST``): an ``if`` on a constexpr decides which code is generated, so
neither variant pays for the other. (Gemma-3n and Gemma-4 keep the float32
product but store the weight as is: offset 0.0, cast last.) The byte accounting
below is unchanged: the offset is one add per weight element, in registers,
once per program; x is read once and y written once, as for LLaMA. Backward
uses the scale ``1 + w`` for dx; dw's formula does not contain w at all.

Before a module is swapped, ``replace_rmsnorm`` runs the HF module and ours on
the same random input and refuses (``swap_common.SwapMismatch``) a module that
computes anything else: families reuse the name ``*RMSNorm`` for other formulas.

Why a custom kernel
-------------------
RMSNorm does almost no arithmetic (a few FLOPs per element) but touches every
element of a large tensor, so its speed is set by memory bandwidth alone. PyTorch
eager runs the formula above as separate kernels (cast, pow, mean, add, rsqrt,
mul, cast, mul), and each reads and writes a full [rows, H] tensor from HBM. For
bf16 input the naive forward moves roughly::

    cast to fp32: read 2 B + write 4 B   pow: 4 + 4    mean: 4      rsqrt*x: 4 + 4
    cast back:    read 4 B + write 2 B   * weight: 2 + 2             ~ 36 B / element

while the fused kernel reads x once and writes y once: 4 B / element, about 9x
less traffic. The backward is similar: autograd replays the chain in reverse and
keeps the float32 intermediates alive from forward to backward.

The fused backward reads x and dy and writes dx (6 B / element in bf16). The weight
gradient dw = sum over rows of dy * x_hat is a reduction *across* rows; the playbook
writes a [rows, H] float32 buffer and sums it with a second kernel, which adds
8 B / element of traffic and rows x H x 4 bytes of memory. Here each program keeps
its own float32 partial sum in registers while it walks over many rows, and only
[programs, H] partial sums (a few MB) are reduced at the end.

Triton concepts new in this step
--------------------------------
* ``@triton.jit`` compiles a Python function into a GPU kernel.
* A *program* is one instance of the kernel (like a CUDA thread block);
  ``tl.program_id(0)`` says which one we are. The launch *grid* says how many run.
* ``tl.arange`` builds a vector of offsets; ``tl.load``/``tl.store`` with a
  ``mask`` read or write a whole block of elements at once, skipping the
  out-of-range tail (so any H works, not only powers of two).
* ``tl.constexpr`` arguments are compile-time constants: Triton builds one
  specialized kernel per value (block sizes, flags).
* Reductions (``tl.sum``) across a block run inside the program, in registers.
* ``@triton.jit`` helpers called from a kernel are inlined into it; the ones every
  kernel shares (``cast_to``: rounding to the output dtype) live in
  kernel_common.py, with the switch that runs all of this on a CPU.
* ``@fast_launch`` above ``@triton.jit`` (kernel_common.py) keeps the
  ``kernel[grid](...)`` syntax and halves its host time: at 4,096 rows the GPU
  needs ~30 us per kernel, and Triton's own launch path costs ~22 us of Python.

Nothing runs on import. See rmsnorm_test.py for the checks and
benchmark_kernels.py for the measurements.
"""

import collections
import functools
import math
import weakref

import torch
import torch.nn as nn

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import (
    INTERPRET, SUPPORTED_DTYPES, amax_slots, as_rows, cast_to, cdiv, check_kernel_device, fast_launch, first_order_only,
    interpreter_block, kernel_op, extent_key, next_power_of_2, note_amax, nothing, num_sms, traced,
)
from swap_common import SwapMismatch, swap_modules

import triton
import triton.language as tl
from torch.func import functional_call

# The largest hidden size one program handles with the whole row in registers.
# LLaMA models use 2,048 - 16,384; beyond this limit we refuse clearly instead of
# spilling registers into slow local memory.
MAX_HIDDEN_SIZE = 65536


# --------------------------------------------------------------------------------
# The reference: Hugging Face's LlamaRMSNorm formula in plain PyTorch ops.
# Tests compare against it (and against its float64 version), the benchmark times
# it as "PyTorch eager" and compiles it for the torch.compile peer.
# --------------------------------------------------------------------------------
def rmsnorm_reference(x, weight, eps=1e-6, compute_dtype=torch.float32, weight_offset=0.0, cast_first=True):
    """HF ``LlamaRMSNorm.forward``; ``compute_dtype=torch.float64`` gives the truth.

    ``weight_offset=1.0, cast_first=False`` is HF ``GemmaRMSNorm.forward``: the
    scale is ``1 + weight``, multiplied in float32, the result cast to x's dtype.
    """
    input_dtype = x.dtype
    h = x.to(compute_dtype)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if compute_dtype == torch.float64:
        return (weight.to(torch.float64) + weight_offset) * h
    if not cast_first:  # Gemma
        return (h * (weight_offset + weight.float())).to(input_dtype)
    if weight_offset:  # no HF module does this; the kernel's order: scale in float32, one rounding
        out_dtype = torch.promote_types(input_dtype, weight.dtype)
        return ((weight.float() + weight_offset) * h.to(input_dtype)).to(out_dtype)
    return weight * h.to(input_dtype)


# --------------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------------
# Optimization: no recompilation when the number of rows changes. Triton compiles one
# variant of a kernel per combination of its int arguments being 1, or a multiple of 16
# (alignment it can exploit for pointers and strides). A row count that changes with
# every batch (padding-free rows, padded batches of varying length) would compile new
# variants mid-run the first time it is a multiple of 16: several seconds of every
# kernel that takes such a count (in a Trainer run on an H100 the attention kernels'
# sequence length made one step take 4-8 s). Row counts only bound the grid and the
# masks, so they lose nothing by not being specialized.
@fast_launch
@triton.jit(do_not_specialize=["n_rows"])  # a row count: see above
def _rmsnorm_fwd_kernel(
    X,  # [n_rows, n_cols] input; rows are stride_x elements apart, columns contiguous
    W,  # [n_cols] weight
    Y,  # [n_rows, n_cols] output, contiguous (row stride n_cols)
    RSTD,  # [n_rows] float32 output: 1 / rms of each row, the only thing backward needs
    AMAX,  # [AMAX_SLOTS] float32, zeroed: max |Y| folded in (AMAX_SLOTS > 0 only)
    stride_x,
    n_rows,
    n_cols,
    eps,
    BLOCK_N: tl.constexpr,  # power of two >= n_cols: one row fits in one block
    ROWS: tl.constexpr,  # rows per program (> 1 only for short rows)
    W_OFFSET: tl.constexpr = 0.0,  # the scale is W + W_OFFSET: 0.0 for LLaMA, 1.0 for Gemma
    CAST_FIRST: tl.constexpr = True,  # LLaMA: round x_hat to X's dtype before scaling; Gemma: no
    AMAX_SLOTS: tl.constexpr = 0,  # > 0: also fold max |Y| into AMAX, for an FP8 cast of Y (Step 22)
    DELTA=None,  # residual_kernel.py: [n_rows, n_cols] added to X first (rows stride_d apart)
    SUM=None,  # residual_kernel.py: [n_rows, n_cols] contiguous output, X + DELTA as stored
    stride_d=0,
    ADD: tl.constexpr = False,  # True: normalize X + DELTA and store that sum in SUM
):
    # Each program normalizes ROWS consecutive rows. For LLaMA (H = 4096) ROWS is 1:
    # one row is 8 KB of bf16, enough work for 8 warps. For short rows we give one
    # program several of them so each launch still moves a useful amount of data.
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    # Row offsets in 64 bits: rows * stride overflows int32 once a tensor holds
    # more than 2**31 elements (e.g. 600k tokens x 4096).
    rows64 = rows.to(tl.int64)
    x_ptrs = X + rows64[:, None] * stride_x + cols[None, :]
    # Load in the input dtype, compute in float32 (as HF does with x.float()).
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        # The decoder layer's residual add (residual_kernel.py): the sum rounded to SUM's
        # dtype, as PyTorch's add stores it, is both what we store and what we normalize.
        d = tl.load(DELTA + rows64[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x_sum = cast_to(x + d, SUM.dtype.element_ty)
        tl.store(SUM + rows64[:, None] * n_cols + cols[None, :], x_sum, mask=mask)
        x = x_sum.to(tl.float32)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if W_OFFSET != 0.0:
        w = w + W_OFFSET  # Gemma: 1.0 + weight.float(), in float32 as HF adds it

    # mean(x^2) over the real columns: masked entries were loaded as 0 and add
    # nothing, so we divide by n_cols, not BLOCK_N.
    mean_sq = tl.sum(x * x, axis=1) / n_cols
    # IEEE-rounded sqrt and division (sqrt_rn, div_rn) instead of the fast
    # approximate ones: once per row, so free, and float32 outputs stay within
    # PyTorch's own error (the approximate pair costs up to ~3 ulp).
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))

    # LLaMA semantics: round the normalized value to the input dtype, then multiply
    # by the weight. The product is computed in float32 and rounded once when it
    # is stored, exactly what PyTorch's bf16 * bf16 multiply does.
    # Gemma semantics: no rounding of x_hat; the float32 product is rounded once,
    # to X's dtype (Y has it), when it is stored.
    x_hat = x * rstd[:, None]
    if CAST_FIRST:
        x_hat = cast_to(x_hat, X.dtype.element_ty).to(tl.float32)
    y = cast_to(x_hat * w[None, :], Y.dtype.element_ty)
    tl.store(Y + rows64[:, None] * n_cols + cols[None, :], y, mask=mask)
    tl.store(RSTD + rows64, rstd, mask=row_mask)
    if AMAX_SLOTS:
        # Step 22's producer (kernel_common, "FP8 producers"): the largest |y| as stored
        # (masked entries are 0), one atomic per program into one of a few slots, so that a
        # per-tensor FP8 cast of Y reads it once instead of twice. Free here: y is in registers.
        tl.atomic_max(AMAX + pid % AMAX_SLOTS, tl.max(tl.max(tl.abs(y.to(tl.float32)), axis=1), axis=0),
                      sem="relaxed")


# --------------------------------------------------------------------------------
# Backward kernel
# --------------------------------------------------------------------------------
# Derivation (one row, float32, ignoring the rounding of x_hat to the input dtype,
# which has no derivative):
#
#   r     = rstd = (mean(x^2) + eps)^(-1/2)
#   s     = w + o                               (o = W_OFFSET: 0 for LLaMA, 1 for Gemma)
#   x_hat = x * r,     y = s * x_hat
#   g     = dy * s                              (gradient reaching x_hat)
#   dr/dx_j = -r^3 * x_j / H
#   dx_i  = g_i * r + sum_j g_j * x_j * dr/dx_i
#         = r * (g_i - x_hat_i * mean_j(g_j * x_hat_j))
#   dw    = sum over rows of dy * x_hat         (ds/dw = 1: the offset drops out)
#
# So the offset changes only the scale that dx sees, (1 + w) for Gemma, and the
# order of the casts (which have no derivative) changes nothing. Backward needs
# x, dy, w and the saved rstd: no float32 copy of x_hat is kept between forward
# and backward.
@fast_launch
@triton.jit(do_not_specialize=["n_rows"])  # a varying count: not specialized (rmsnorm_kernel.py)
def _rmsnorm_bwd_kernel(
    DY,  # [n_rows, n_cols] upstream gradient; rows stride_dy apart, columns contiguous
    X,  # [n_rows, n_cols] forward input; rows stride_x apart
    W,  # [n_cols] weight
    RSTD,  # [n_rows] float32, saved by the forward kernel
    DX,  # [n_rows, n_cols] output, contiguous
    DW_PARTIAL,  # [num_programs, n_cols] float32 output: this program's share of dw
    stride_dy,
    stride_x,
    n_rows,
    n_cols,
    num_programs,  # size of the launch grid
    blocks_per_program,  # cdiv(cdiv(n_rows, ROWS), num_programs)
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    W_OFFSET: tl.constexpr = 0.0,  # as in the forward: the scale is W + W_OFFSET
    DRES=None,  # residual_kernel.py: [n_rows, n_cols] another gradient of X (rows stride_dres apart), added to DX
    stride_dres=0,
    DX_AMAX=None,  # residual_kernel.py: [DX_AMAX_SLOTS] float32, zeroed: max |DX| as stored folded in
    HAS_DRES: tl.constexpr = False,
    DX_AMAX_SLOTS: tl.constexpr = 0,
):
    # A *persistent* grid: a fixed number of programs (a few per SM) each walk over
    # many row blocks, pid, pid + num_programs, ... Keeping the program alive lets
    # it accumulate its part of dw in registers across all its rows, so dw costs
    # one small [num_programs, H] write instead of a [rows, H] float32 buffer.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if W_OFFSET != 0.0:
        w = w + W_OFFSET  # dx sees the scale 1 + w; dw's formula has no w in it
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    # Row blocks pid, pid + num_programs, ... The trip count is the same for every
    # program; a program whose last block lies past the end masks it out (no
    # memory traffic for masked lanes).
    for i in range(0, blocks_per_program):
        block = pid + i * num_programs
        rows = block * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)

        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)

        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        # mean_j(g_j * x_hat_j) per row; masked columns are 0 on both sides.
        c = tl.sum(g * x_hat, axis=1) / n_cols
        dx = (g - x_hat * c[:, None]) * rstd[:, None]
        if HAS_DRES:  # the residual's gradient: autograd's sum of X's two gradients, done here
            dx += tl.load(DRES + rows64[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = cast_to(dx, DX.dtype.element_ty)
        tl.store(DX + rows64[:, None] * n_cols + cols[None, :], dx, mask=mask)
        if DX_AMAX_SLOTS:  # for the FP8 cast of this gradient (residual_kernel.py), as the forward's AMAX
            tl.atomic_max(DX_AMAX + pid % DX_AMAX_SLOTS, tl.max(tl.max(tl.abs(dx.to(tl.float32)), axis=1), axis=0),
                          sem="relaxed")

        if COMPUTE_DW:
            dw_acc += tl.sum(dy * x_hat, axis=0)

    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)


@fast_launch
@triton.jit
def _rmsnorm_dw_reduce_kernel(
    DW_PARTIAL,  # [n_partial, n_cols] float32, one row per backward program
    DW,  # [n_cols] output in the weight's dtype
    n_partial,
    n_cols,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Sum the partial weight gradients column-wise, in float32, and round once.
    # One launch instead of partial.sum(0) followed by .to(dtype).
    pid = tl.program_id(0)
    cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, n_partial, BLOCK_P):
        prow = start + tl.arange(0, BLOCK_P)
        mask = (prow < n_partial)[:, None] & col_mask[None, :]
        part = tl.load(DW_PARTIAL + prow[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(part, axis=0)
    tl.store(DW + cols, cast_to(acc, DW.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------
# Launch helpers: checks, block sizes, grid
# --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)  # once per hidden size: host time counts (Step 17)
def _launch_config(n_cols):
    """Block width, rows per program and warps for a row length."""
    block_n = next_power_of_2(n_cols)
    # Short rows: several rows per program so each program holds ~4K elements.
    rows = max(1, min(64, 4096 // block_n))
    # Wide rows: more warps so each thread holds a modest slice. For H = 4096, 8
    # warps (16 values per thread) beat 4 and 16 in a sweep on an H200 (NOTES.md).
    if block_n >= 32768:
        num_warps = 32
    elif block_n >= 16384:
        num_warps = 16
    elif block_n >= 2048:
        num_warps = 8
    else:
        num_warps = 4
    return block_n, rows, num_warps


# Persistent backward grid: programs per SM. Enough programs in flight per SM to
# hide memory latency; each extra program costs one [H] float32 partial row. Two
# (the most that stay resident at H = 4096, 8 warps) measured best (NOTES.md).
BWD_PROGRAMS_PER_SM = 2


@functools.lru_cache(maxsize=None)
def _bwd_launch_config(n_cols):
    """Block width, rows per loop step, warps and programs per SM of the backward.

    Optimization: at LLaMA's widths, 4,096 and 8,192, one row per loop step leaves
    too few bytes in flight (a step's loads wait for the previous step's sums). Rows
    of 16,384 elements per step, one program per SM: 34.0 against 37.3 us at 4,096 x
    4,096, 109.7 against 120.9 at 16,384 x 4,096, 243.6 against 259.6 at 16,384 x
    8,192 (H200, results/graphs/rms_micro_h200.txt). Other widths keep the forward's
    shape, untested beyond it."""
    block_n, rows, num_warps = _launch_config(n_cols)
    if block_n in (4096, 8192):
        return block_n, 16384 // block_n, 8 if block_n == 4096 else 16, 1
    return block_n, rows, num_warps, BWD_PROGRAMS_PER_SM


def _check_inputs(x, weight, eps, weight_offset=0.0):
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("rmsnorm expects tensors for x and weight")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rmsnorm: unsupported input dtype {x.dtype}; use float32, float16 or bfloat16")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rmsnorm: unsupported weight dtype {weight.dtype}; use float32, float16 or bfloat16")
    if x.dim() < 1:
        raise ValueError("rmsnorm: x must have at least one dimension (the hidden size)")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rmsnorm: weight shape {tuple(weight.shape)} does not match the hidden size "
            f"{x.shape[-1]} of x (expected ({x.shape[-1]},))"
        )
    if x.shape[-1] > MAX_HIDDEN_SIZE:
        raise ValueError(f"rmsnorm: hidden size {x.shape[-1]} exceeds the supported maximum {MAX_HIDDEN_SIZE}")
    if x.shape[-1] == 0:
        raise ValueError("rmsnorm: hidden size must be at least 1")
    if not eps >= 0:
        raise ValueError(f"rmsnorm: eps must be >= 0, got {eps}")
    if not math.isfinite(weight_offset):
        raise ValueError(f"rmsnorm: weight_offset must be a finite number (1.0 for Gemma), got {weight_offset}")
    check_kernel_device(x, weight)


def _output_dtype(x, weight, cast_first):
    """LLaMA: ``weight * h.to(input_dtype)`` follows PyTorch type promotion; Gemma
    casts its float32 product to x's dtype (``type_as(x)``)."""
    if not cast_first or weight.dtype == x.dtype:
        return x.dtype
    return torch.promote_types(x.dtype, weight.dtype)


def _rmsnorm_forward_fake(x, weight, eps, weight_offset=0.0, cast_first=True):
    n_rows = x.numel() // x.shape[-1]
    return (x.new_empty(x.shape, dtype=_output_dtype(x, weight, cast_first)),
            x.new_empty((n_rows,), dtype=torch.float32))


@kernel_op("rmsnorm_forward", fake=_rmsnorm_forward_fake)
def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
                    cast_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Returns (y, rstd); y has x's shape.

    ``weight_offset=1.0, cast_first=False``: Gemma's formula (see the docstring).
    """
    return _forward(x, weight, eps, weight_offset, cast_first, None)


def _forward(x, weight, eps, weight_offset, cast_first, amax, delta=None):
    """rmsnorm_forward's launch; ``amax``: zeroed float32 slots that get max |y| (or None).
    With ``delta`` (residual_kernel.py) it normalizes s = x + delta and returns (y, rstd, s)."""
    n_cols = x.shape[-1]
    x2 = as_rows(x, n_cols)
    # The kernels index the weight as a contiguous [H] vector. A view such as
    # big[:, 0] or an expand()ed scalar is not one; copying [H] values costs
    # nothing next to [rows, H], and is a no-op for the usual Parameter.
    weight = weight.contiguous()
    n_rows = x2.shape[0]
    out_dtype = _output_dtype(x, weight, cast_first)
    # y is contiguous in x's shape, i.e. rows n_cols apart, as the kernel writes it.
    # (empty_like costs a third of the host time of torch.empty(shape, ...).)
    y = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    rstd = x2.new_empty(n_rows, dtype=torch.float32)
    added = {}
    if delta is not None:  # the sum is stored in x's dtype, as ``x + delta`` of one dtype is
        d2 = as_rows(delta, n_cols)
        s = torch.empty_like(x, memory_format=torch.contiguous_format)
        added = {"DELTA": d2, "SUM": s, "stride_d": d2.stride(0), "ADD": True}
    if n_rows > 0:
        block_n, rows, num_warps = _launch_config(n_cols)
        _rmsnorm_fwd_kernel[(cdiv(n_rows, rows),)](
            x2, weight, y, rstd, rstd if amax is None else amax, x2.stride(0), n_rows, n_cols, eps,
            BLOCK_N=block_n, ROWS=rows, W_OFFSET=weight_offset, CAST_FIRST=cast_first,
            AMAX_SLOTS=0 if amax is None else amax.numel(), num_warps=num_warps, **added,
        )
    return (y, rstd) if delta is None else (y, rstd, s)


def _rmsnorm_backward_fake(dy, x, weight, rstd, compute_dw, weight_offset=0.0):
    return x.new_empty(x.shape), (weight.new_empty(weight.shape[0]) if compute_dw else nothing(weight))


@kernel_op("rmsnorm_backward", fake=_rmsnorm_backward_fake)
def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                     compute_dw: bool, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernels. Returns (dx, dw); dw is empty if not asked for."""
    return _backward_launch(dy, x, weight, rstd, compute_dw, weight_offset)


def _backward_launch(dy, x, weight, rstd, compute_dw, weight_offset, dres=None, amax=None):
    """rmsnorm_backward's launches; with ``dres`` (residual_kernel.py) dx is the norm's gradient
    plus ``dres``; ``amax``: zeroed float32 slots that get max |dx| (or None)."""
    n_cols = x.shape[-1]
    x2 = as_rows(x, n_cols)
    dy2 = as_rows(dy, n_cols)
    weight = weight.contiguous()
    n_rows = x2.shape[0]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)  # rows n_cols apart
    block_n, rows, num_warps, per_sm = _bwd_launch_config(n_cols)
    n_blocks = cdiv(n_rows, rows)
    n_programs = max(1, min(n_blocks, num_sms(x.device) * per_sm))
    if compute_dw:
        dw_partial = x2.new_empty((n_programs, n_cols), dtype=torch.float32)
        dw = torch.empty_like(weight)
    else:
        dw_partial = dx  # never written: COMPUTE_DW=False removes the store
        dw = nothing(weight)
    added = {}
    if dres is not None:
        dres2 = as_rows(dres, n_cols)
        added = {"DRES": dres2, "stride_dres": dres2.stride(0), "HAS_DRES": True}
    if amax is not None:
        added.update(DX_AMAX=amax, DX_AMAX_SLOTS=amax.numel())
    if n_rows > 0:
        _rmsnorm_bwd_kernel[(n_programs,)](
            dy2, x2, weight, rstd, dx, dw_partial,
            dy2.stride(0), x2.stride(0), n_rows, n_cols, n_programs, cdiv(n_blocks, n_programs),
            BLOCK_N=block_n, ROWS=rows, COMPUTE_DW=compute_dw, W_OFFSET=weight_offset,
            num_warps=num_warps, **added,
        )
    if compute_dw:
        if n_rows == 0:
            dw.zero_()
        else:
            # Narrow column strips, one warp each: more programs in flight for a
            # tiny reduction (264 x 4,096 floats at 8B: 3.7 us against 9.0 us with
            # 256-column strips and 4 warps; H200 sweep, results/graphs/step_micro_h200.txt).
            # The interpreter pays per program: two strips (at least 32 columns each).
            block_c = interpreter_block(n_cols, 2, 32) if INTERPRET else 32
            _rmsnorm_dw_reduce_kernel[(cdiv(n_cols, block_c),)](
                dw_partial, dw, n_programs, n_cols, BLOCK_P=64, BLOCK_C=block_c,
                num_warps=1,
            )
    return dx, dw


# --------------------------------------------------------------------------------
# Autograd function: connects the kernels to PyTorch's automatic differentiation
# --------------------------------------------------------------------------------
def _save_for_backward(ctx, inputs, output):
    x, weight, _, weight_offset, _ = inputs
    _, rstd = output
    # Save the inputs (already alive in the autograd graph) and 4 bytes per row.
    ctx.save_for_backward(x, weight, rstd)
    ctx.weight_offset = weight_offset  # the cast order has no derivative: not needed


def _backward(ctx, dy, *_):
    x, weight, rstd = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[1]
    # LLaMA's call is the 5-argument one it always was; only Gemma passes its offset.
    offset = (ctx.weight_offset,) if ctx.weight_offset != 0.0 else ()
    dx, dw = rmsnorm_backward(dy, x, weight, rstd, need_dw, *offset)
    return dx, (dw if need_dw else None), None, None, None


class TritonRMSNormFunction(torch.autograd.Function):
    # The classic form (forward with ctx, one output): in eager mode it costs less
    # host time per call than forward + setup_context with rstd as an output.
    @staticmethod
    def forward(ctx, x, weight, eps, weight_offset, cast_first):
        slots = amax_slots(x)  # a per-tensor FP8 layer may read y: its amax comes from here
        if slots is None:
            y, rstd = rmsnorm_forward(x, weight, eps, weight_offset, cast_first)
        else:
            y, rstd = _forward(x, weight, eps, weight_offset, cast_first, slots[0])
            note_amax(y, slots[0])
        _save_for_backward(ctx, (x, weight, eps, weight_offset, cast_first), (y, rstd))
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:  # x is kept for backward: y can be remade from it
            _note_made(y, x, weight, (eps, weight_offset, cast_first))
        return y

    @staticmethod
    @first_order_only("rmsnorm")
    def backward(ctx, dy):
        return _backward(ctx, dy)


# The same formula on the operator: torch.ops.llama_kernels.rmsnorm_forward is
# differentiable, and torch.compile differentiates it without tracing our Python.
rmsnorm_forward.op.register_autograd(first_order_only("rmsnorm")(_backward), setup_context=_save_for_backward)


# --------------------------------------------------------------------------------
# Optimization: the output made again in backward instead of kept (Step 20's projections)
# --------------------------------------------------------------------------------
# A norm's output y is the input of the projections after it (q/k/v, gate/up), which keep
# it for their weight or adapter gradients (dW = dy^T y, dA = g^T y), while the norm keeps
# its own input x for its backward: two [tokens, H] tensors per norm from forward to
# backward, where x and the weight alone make y. So the projections (lora_kernel's
# LoRALinearFunction, which every group of projections_kernel.py runs through) ask
# ``remade_later(y)``: for an output of this Function as it was written (same elements,
# no in-place change since) whose x this Function keeps, it returns the recipe, (x,
# weight) and the formula, to keep instead of y; ``remake`` runs the forward kernel again
# in backward, which gives y's bits (the kernel is deterministic). What it buys: one
# [tokens, H] tensor per norm, 64 MB at LLaMA-8B's H = 4,096 and 8,192 tokens, 4 GiB over
# its 64 norms; it costs one forward pass per norm in backward (read x, write y: 4 bytes
# per element of [tokens, H]). Eager code and CUDA-graph captures only, keyed as the FP8
# producers are (kernel_common.extent_key: a changed or other tensor misses); never under
# a tracer, and never for an FP8 group (its casts keep their own copies).
_MADE = collections.OrderedDict()  # extent key of y -> (weak x, weak weight, (eps, weight_offset, cast_first))
_MADE_KEEP = 8  # the norms of the last few layers: a norm's projections ask right after it


def _note_made(y, x, weight, formula):
    if torch.compiler.is_compiling() or traced(y) or (key := extent_key(y)) is None:
        return
    _MADE[key] = (weakref.ref(x), weakref.ref(weight), formula)
    while len(_MADE) > _MADE_KEEP:
        _MADE.popitem(last=False)


def remade_later(y):
    """((x, weight), formula) from which ``remake`` makes exactly ``y`` again, where ``y``
    (or a reshape of it) is an output of TritonRMSNormFunction unchanged since and its x
    is kept for the norm's backward; else None."""
    if torch.compiler.is_compiling() or not _MADE or traced(y):  # first: a tracer must not read _MADE
        return None
    if (key := extent_key(y)) is None or (entry := _MADE.get(key)) is None:
        return None
    x, weight = entry[0](), entry[1]()
    return None if x is None or weight is None else ((x, weight), entry[2])


def remake(x, weight, formula):
    """The output a recipe of ``remade_later`` describes: the forward kernel again."""
    return rmsnorm_forward(x, weight, *formula)[0]


def rmsnorm(x, weight, eps=1e-6, weight_offset=0.0, cast_first=True):
    """Fused RMSNorm with HF ``LlamaRMSNorm`` semantics; differentiable in x and weight.

    ``weight_offset=1.0, cast_first=False`` gives HF ``GemmaRMSNorm``'s instead:
    the scale is ``1 + weight``, the product float32, cast to x's dtype last.
    """
    _check_inputs(x, weight, eps, weight_offset)
    args = (x, weight, float(eps), float(weight_offset), bool(cast_first))
    if torch.compiler.is_compiling():
        return rmsnorm_forward.op(*args)[0]  # one node of the compiled graph
    return TritonRMSNormFunction.apply(*args)  # eager: no dispatcher


# --------------------------------------------------------------------------------
# Drop-in module and model patching
# --------------------------------------------------------------------------------
# The formulas of HF's RMSNorm modules, as (weight_offset, cast_first):
LLAMA = (0.0, True)  # LlamaRMSNorm and its copies: weight * h.to(x.dtype)
GEMMA = (1.0, False)  # GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm: (h * (1 + weight)).to(x.dtype)
SCALE_LAST = (0.0, False)  # Gemma3nRMSNorm, Gemma4RMSNorm: (h * weight).to(x.dtype), weight stored as is


class TritonRMSNorm(nn.Module):
    """Drop-in replacement for HF ``LlamaRMSNorm`` (same ``weight``, ``variance_epsilon``)
    and, with ``weight_offset=1.0, cast_first=False``, for ``GemmaRMSNorm`` (whose
    epsilon is called ``eps``: here both names read and set the same value)."""

    def __init__(self, hidden_size, eps=1e-6, weight_offset=0.0, cast_first=True):
        super().__init__()
        # The identity scale: ones for LLaMA, zeros for Gemma (1 + 0), as HF initializes them.
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - weight_offset))
        self.variance_epsilon = eps
        self.weight_offset = float(weight_offset)
        self.cast_first = bool(cast_first)

    @classmethod
    def from_hf_rmsnorm(cls, module, weight_offset=None, cast_first=None):
        """Wrap an existing HF RMSNorm, sharing its Parameter object and epsilon.

        Sharing (not copying) the Parameter keeps optimizer state, weight tying and
        anything else that holds a reference to it pointing at the live weight.
        The formula is the one ``rmsnorm_formula(module)`` reads from the module's
        attributes, unless given.
        """
        if weight_offset is None or cast_first is None:
            formula = rmsnorm_formula(module)
            if formula is None:
                raise TypeError(f"{type(module).__name__} is not an RMSNorm module this kernel knows")
            weight_offset, cast_first = formula
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = module.weight
        new.variance_epsilon = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
        new.weight_offset = float(weight_offset)
        new.cast_first = bool(cast_first)
        return new

    @classmethod
    def from_llama_rmsnorm(cls, module):
        """Wrap an HF ``LlamaRMSNorm`` (or a copy of it), sharing its Parameter."""
        return cls.from_hf_rmsnorm(module, *LLAMA)

    @classmethod
    def from_gemma_rmsnorm(cls, module):
        """Wrap an HF ``GemmaRMSNorm`` (Gemma2, Gemma3, ...), sharing its Parameter."""
        return cls.from_hf_rmsnorm(module, *GEMMA)

    @property
    def eps(self):  # Gemma's name for it
        return self.variance_epsilon

    @eps.setter
    def eps(self, value):
        self.variance_epsilon = value

    def forward(self, hidden_states):
        return rmsnorm(hidden_states, self.weight, self.variance_epsilon, self.weight_offset, self.cast_first)

    def extra_repr(self):
        formula = "" if (self.weight_offset, self.cast_first) == LLAMA else (
            f", weight_offset={self.weight_offset}, cast_first={self.cast_first}")
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}{formula}"


def rmsnorm_formula(module):
    """The formula an HF RMSNorm module computes, told by its class name and
    attributes, or None when it is not one we swap.

    ``variance_epsilon``: LLaMA's (LlamaRMSNorm and the families that copy it);
    ``eps``: Gemma's (GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm, Qwen3NextRMSNorm,
    ...), or with ``with_scale`` Gemma3n's and Gemma4's, whose weight is not an
    offset. A name and attributes are a guess: check_same_rmsnorm proves it
    before anything is swapped.
    """
    if (not type(module).__name__.endswith("RMSNorm") or isinstance(module, TritonRMSNorm)
            or not isinstance(getattr(module, "weight", None), torch.Tensor)):
        return None
    if hasattr(module, "variance_epsilon"):
        return LLAMA
    if hasattr(module, "eps"):
        return SCALE_LAST if hasattr(module, "with_scale") else GEMMA
    return None


def _is_rmsnorm(module):
    return rmsnorm_formula(module) is not None


# --------------------------------------------------------------------------------
# Checking the swap: the HF module and ours must compute the same numbers
# --------------------------------------------------------------------------------
# Families reuse the name *RMSNorm for different formulas (an offset weight,
# another cast order, the epsilon inside or outside the root), and a tiny random
# model trains almost alike either way. So before the swap, once per module
# class, the HF module and ours run on the same random input with the same
# random weight (a copy handed to both through functional_call: the model's
# weight is neither read nor changed), in float32 and in the module's dtype.
# Rows of very different sizes: in the smallest, mean(x^2) is about eps, so the
# way eps enters shows.
#
# Tolerances. float32: a few units in the last place apart (rsqrt and the mean
# are rounded differently), so 1e-5 relative is tight. bf16/fp16: the same
# float32 values, rounded at the same places, land on the same output except
# where a last-bit difference straddles a rounding boundary: rare, and then one
# unit of the output dtype apart (two where LLaMA rounds twice). Another order of the roundings (LLaMA's cast
# first vs a float32 product cast last) also stays within one unit, but changes
# about a quarter of the values: that is what the "rarely" catches.
_CHECK_ROW_SCALES = (1e-3, 0.5, 2.0, 8.0)
_CHECK_MIN_VALUES = 256  # rows enough to see a rounding that differs in a few percent of values
_CHECK_DIFFERING_AT_MOST = 1 / 32  # of the values, in bf16/fp16


@torch.no_grad()
def check_same_rmsnorm(original, new):
    """Raise swap_common.SwapMismatch unless module ``new`` computes what ``original`` does.

    ``replace_rmsnorm`` hands it to ``swap_modules``, which calls it once per module
    class before anything is swapped. A module on the meta device (a model built
    for --fsdp before its weights exist) cannot be run: it is not checked.
    """
    name = type(original).__name__
    weight = original.weight
    if any(t.is_meta for t in (*original.parameters(), *original.buffers())):
        return
    width = weight.shape[-1]
    rows = max(len(_CHECK_ROW_SCALES), cdiv(_CHECK_MIN_VALUES, width))
    gen = torch.Generator().manual_seed(0)  # its own generator: the global RNG stream is left as it was
    scales = torch.tensor(_CHECK_ROW_SCALES).repeat(cdiv(rows, len(_CHECK_ROW_SCALES)))[:rows, None]
    x = torch.randn(rows, width, generator=gen) * scales
    w = 0.2 + 0.5 * torch.randn(width, generator=gen)  # not ones, not zeros: every column scaled differently
    for dtype in dict.fromkeys((torch.float32, weight.dtype)):
        params = {"weight": w.to(weight.device, dtype)}
        xd = x.to(weight.device, dtype)
        where = f"a random {str(dtype).removeprefix('torch.')} input"
        try:
            theirs = functional_call(original, params, (xd,))
        except Exception as e:  # noqa: BLE001 - any failure: not a module we can stand in for
            raise SwapMismatch(f"{name} does not run as an RMSNorm on {where} of shape {tuple(xd.shape)} "
                               f"({type(e).__name__})") from None
        try:
            ours = functional_call(new, params, (xd,))
        except (TypeError, ValueError, RuntimeError) as e:  # what the launcher's input checks raise
            raise SwapMismatch(f"{type(new).__name__} cannot stand in for {name}: {e}") from None
        if not isinstance(theirs, torch.Tensor) or theirs.dtype != ours.dtype or theirs.shape != ours.shape:
            got = f"{theirs.dtype} {tuple(theirs.shape)}" if isinstance(theirs, torch.Tensor) else type(theirs).__name__
            raise SwapMismatch(f"{name} returns {got} on {where} where {type(new).__name__} returns "
                               f"{ours.dtype} {tuple(ours.shape)}")
        a, b = ours.double(), theirs.double()
        diff = (a - b).abs()
        if dtype == torch.float32:
            same = bool((diff <= 1e-5 * b.abs() + 1e-6).all())
            differing = ""
        else:
            unit = torch.finfo(dtype).eps  # one unit in the last place, relative
            fraction = (a != b).double().mean().item()
            same = bool((diff <= 2 * unit * b.abs() + torch.finfo(dtype).tiny).all()) \
                and fraction <= _CHECK_DIFFERING_AT_MOST
            differing = f" in {fraction:.0%} of the values"
        if not same:
            raise SwapMismatch(f"{name} computes something else than {type(new).__name__} "
                               f"(max difference {diff.max().item():.2g}{differing} on {where})")


def replace_rmsnorm(model):
    """Replace every HF RMSNorm in ``model`` with ``TritonRMSNorm``; return the count.

    Modules are found by type name (``LlamaRMSNorm``, ``MistralRMSNorm``,
    ``GemmaRMSNorm``, ...) with a ``weight`` and a ``variance_epsilon`` (LLaMA's
    formula) or an ``eps`` (Gemma's), see rmsnorm_formula. Each module class is
    run against ours first (check_same_rmsnorm): one that computes anything else
    raises swap_common.SwapMismatch, and then nothing in the model is swapped.
    """
    return swap_modules(model, _is_rmsnorm, TritonRMSNorm.from_hf_rmsnorm, check=check_same_rmsnorm)
