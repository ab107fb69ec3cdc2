"""
Step 22 -- Past the bf16 matmul roofline: FP8 training with Triton scaling kernels.

What it computes
----------------
Once the fused kernels of the earlier steps have removed most of the memory-bound
work, a training step is its matmuls, already near the bf16 peak of the tensor
cores. FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell) multiply
at twice that rate. A linear layer ``y = x W^T (+ b)`` runs its three GEMMs in FP8
when each operand is cast to ``float8_e4m3fn`` (4 exponent bits, 3 mantissa bits,
largest value 448) with a *dynamic* scale, from this step's absolute maximum::

    scale = 448 / amax        fp8 = e4m3(clamp(x * scale, -448, 448))
    y = (fp8_x @ fp8_w^T) * (1 / scale_x) * (1 / scale_w)      (float32 accumulation)

The largest value lands on 448: nothing overflows. ``torch._scaled_mm`` (cuBLASLt)
multiplies and applies the inverse scales to its float32 accumulator.

Two recipes: "tensorwise" (one scale per tensor: one outlier pushes every other
value toward e4m3's subnormals) and "rowwise" (one scale per row *along the GEMM's
reduction dim*: an outlier costs precision to its own row only). In the three GEMMs
of a linear layer each operand is scaled along its own reduction axis::

    forward  Y[M,N]  = X[M,K]    @ W^T    X per row (over K),    W per row (over K)
    grad_in  dX[M,K] = dY[M,N]   @ W      dY per row (over N),   W^T[K,N] per row (over N)
    grad_w   dW[N,K] = dY^T[N,M] @ X      dY^T per row (over M), X^T[K,M] per row (over M)

cuBLASLt wants both FP8 operands "K-major" (the reduction dim contiguous), so X, dY
and W each need a row-major copy *and* a transposed one ([K, M] row-major), scaled
along the other axis in the rowwise recipe. Both copies come out of one pass.

The kernels and their memory traffic
------------------------------------
``quantize`` runs two kernels over [BLOCK_M, BLOCK_K] tiles of x: the amax (|x|
maximum per tile, folded into float32 buffers with ``tl.atomic_max``: per row, per
column, or one scalar), then the cast (reads the amaxes from device memory, computes
the scales exactly as the reference does, writes the fp8 tile and the transposed one).

Per element of a bf16 input: 2 B read for the amax, 2 B read again for the cast, 1 B
written per fp8 copy: 5 B, or 6 B with the transposed copy (the scales are negligible);
x and then x^T separately would cost 10 B. Why not one pass? A dynamic scale depends on
every element and must be known before the first is cast: one pass would hold the whole
tensor (or row) on chip. A row does fit: per row without the transposed copy, a third
kernel casts whole rows from registers, 3 B per element. Per tensor the amax can come
from the kernel that *produces* x: "Producers" below.

Measured (benchmark_fp8.py, H200; results/fp8/bench_fp8_h200.txt), x 8192 x 4096, W 4096
x 4096, bf16: the bf16 GEMM 381 us, torch._scaled_mm 217-232 us; quantize(x) 43 us per
tensor, 27 us per row (one pass), 56-69 us with the transposed copy. Four LLaMA-8B MLPs,
forward and backward: 1.47-1.52x bf16, not 2x: the casts around each GEMM take their share.

What backward keeps, and LoRA's frozen weights
----------------------------------------------
The weight gradient needs X^T: we save its fp8 copy (1 B per element, not x's 2), one
for the layers that read the same x (q, k and v; gate and up: ``_input_fp8``). W^T for
grad_in comes out of the forward's cast pass and is saved too (re-quantizing W in
backward would read it twice more). A frozen weight (LoRA's base layers) never changes:
its fp8 copies are cached, keyed on its storage and version counter (an in-place update
invalidates them): quantized once, not every step, for 2 B per frozen element.

Gradients: e4m3 or e5m2
-----------------------
e5m2 (2 mantissa bits, ~2^32 of range) for gradients comes from delayed scaling, where
a scale from past steps could lag behind a growing gradient; torchao keeps it in its
tensorwise recipe and uses e4m3 for everything in its rowwise one. With a dynamic scale
the largest value maps to the format's largest by construction: no range is needed
above it, and below it e4m3 spans ~2^17 (subnormals included) with half e5m2's rounding
error. The cost of e4m3 falls on tensorwise gradients whose rows differ by more than
~2^17: their small rows flush to zero. Both are here (``grads="e5m2"``: the same
kernels with another constexpr, ``--fp8-grads``); e4m3 is the default because over 500
steps of 8B full fine-tuning e5m2 learned no better (NOTES.md, Step 22).

Producers: the amax where x is made
-----------------------------------
A per-tensor cast reads x twice only because nobody measured max |x| before. The kernel
that writes x holds every element in registers: RMSNorm (the input of q/k/v and of
gate/up), SwiGLU (down_proj's input), SwiGLU's backward (the output gradients of gate and
up) and the AdamW step (next forward's weight) fold max |what they store| into a few
float32 slots (one relaxed atomic per program), and note (tensor, slots) on the host;
the cast handed that exact, unchanged tensor skips its amax pass: 3 B per element
instead of 5, 4 instead of 6 with x^T (kernel_common, "FP8 producers", has the rules
that keep it safe). The maximum is of the values as stored, so scales and fp8 bits are
the two-pass cast's: no accuracy is traded (fp8_test.py compares every bit, and a
fine-tuning run's losses are the same to the last printed digit).

Why not let the producer write the fp8 copy itself, one pass and no cast at all? Its
scale must be known before the first element is written. Delayed scaling (the first
FP8 recipes; Transformer Engine's default) takes it from the amaxes of earlier steps: a
tensor that grows past that history is clamped at 448 for a step, and every scale lags.
Current scaling, this step's own amax, is what torchao and we use; the producers move
where it is measured, which costs the cast one read of x, never a result. Measured over
200 steps of 8B fine-tuning (tools/fp8_amax_history.py, NOTES.md Step 22): the weights'
amaxes never moved, but a history of 16 steps would have clipped ~5% of the casts of
layer inputs and output gradients, gradients by up to 2.4x.
Not covered: per row (x^T's scales are column maxima over all rows, which a row-by-row
producer cannot finish), tensors other code writes (SDPA's attention output, q, k and
v's output gradients from RoPE and SDPA, those autograd sums into o and down: 6 maxima
of a LLaMA layer), and
torch.compile (nothing is noted under a tracer). The weights' share needs
``TritonAdamW(fp8_weight_amax=True)`` (the fine-tune script sets it for ``--fp8
tensorwise``): a loop that writes a weight through ``.data`` between ``step()`` and the
next forward would leave a stale amax no version counter reveals, so it is not the
default.

Measured on an H100 (benchmark_fp8.py, 2026-11-26; NOTES.md, Step 22): per-tensor casts
with the amax handed over, 8,192 x 4,096 57.7 -> 36.8 us (x^T too: 73.6 -> 49.7), 8,192 x
14,336 202 -> 125 us (250 -> 170), 90-94% of copy bandwidth over one read; the producers
pay 1.4 us (RMSNorm) or nothing measurable (SwiGLU). The 8B step: amax passes 13.3 -> 2.2
ms, 14,575 -> 14,982 tokens/s.

Triton concepts new in this step
--------------------------------
* ``tl.atomic_max`` combines per-tile reductions across programs (on non-negative
  floats the order does not change the result: deterministic). ``sem="relaxed"``: by
  default an atomic also orders this program's other memory accesses around it
  (acquire-release: fences); only the final maxima matter here, and the next kernel
  reads them after this one has ended, so none is needed (the row and column amax pass
  at 8,192 x 4,096: 35.2 -> 29.0 us on an H100).
* ``tl.trans`` before a store into a transposed tensor: the compiler reshuffles the tile
  through shared memory so that load and store are both contiguous. For 1-byte elements
  ``tl.reshape`` first packs four bytes of a column into a 32-bit word (shifts, ``tl.sum``):
  a quarter as many elements to move (per tensor: +5 to +7 points of copy bandwidth).
* ``tl.math.div_rn``: a correctly rounded float32 division (Triton's ``/`` may be
  approximate on the GPU), to match PyTorch's scale to the last bit.
The lesson's second half, ``fp8_gemm_kernel.py``, writes the FP8 GEMM itself in Triton
(``tl.dot`` on float8e4nv tiles) to compare with cuBLASLt.

Nothing runs on import. See fp8_test.py for the checks.
"""

import collections
from typing import Optional

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import (
    IN_INTERPRETER, INTERPRET, SUPPORTED_DTYPES, cdiv, check_kernel_device, fast_launch, first_order_only,
    interpreter_block, kernel_op, next_power_of_2, nothing, num_sms, register_fp8_weight, take_amax, take_weight_amax,
    traced,
)
# fp8_supported: part of this file's API (the tests import it from here).
from swap_common import called_plainly, fp8_supported, linears_to_cast, swap_modules  # noqa: F401

import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
RECIPES = ("tensorwise", "rowwise")
# The gradients' format (below, "Gradients: e4m3 or e5m2"): each name -> (dtype, largest value).
GRAD_FORMATS = {"e4m3": (FP8_DTYPE, FP8_MAX), "e5m2": (torch.float8_e5m2, 57344.0)}
AMAX_FLOOR = 1e-12  # an all-zero row gets a finite scale (and casts to zeros), never inf or NaN
# The same two numbers inside @triton.jit code (a global there must be a constexpr).
_FP8_MAX = tl.constexpr(FP8_MAX)
_E5M2_MAX = tl.constexpr(GRAD_FORMATS["e5m2"][1])
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)

# One tensor in fp8: data [M, K] row-major; inv_scale float32, [] (tensorwise) or [M, 1]
# (rowwise): data * inv_scale ~ x. With transpose, data_t [K, M'] (x^T, its M columns
# padded with zeros to M' when asked) and inv_scale_t [] or [K, 1]; else both None.
Fp8Tensor = collections.namedtuple("Fp8Tensor", "data inv_scale data_t inv_scale_t")


# --------------------------------------------------------------------------------
# The reference: the scaling recipe in plain PyTorch
# --------------------------------------------------------------------------------
def _cast_reference(x, amax, fmt):
    # A tensor over a tensor: one correctly rounded division. (``448 / t`` would be
    # t.reciprocal() * 448 in PyTorch: two roundings, a different last bit in ~1 of 4.)
    dtype, top = GRAD_FORMATS[fmt]
    scale = torch.full_like(amax, top) / amax.clamp(min=AMAX_FLOOR)
    data = (x.float() * scale).clamp(-top, top).to(dtype)
    return data, scale.reciprocal()  # 1 / scale, rounded once


def quantize_reference(x, recipe, transpose=False, align=1, fmt="e4m3"):
    """The truth: x [M, K] -> Fp8Tensor. ``align``: data_t's columns padded to a multiple;
    ``fmt``: "e4m3" or "e5m2" (GRAD_FORMATS)."""
    _check_recipe(recipe, "quantize_reference")
    _check_format(fmt, "quantize_reference")
    xf = x.float()
    if recipe == "tensorwise":
        amax = amax_t = xf.abs().amax()
    else:
        amax, amax_t = xf.abs().amax(dim=1, keepdim=True), xf.abs().amax(dim=0).unsqueeze(1)
    data, inv = _cast_reference(x, amax, fmt)
    if not transpose:
        return Fp8Tensor(data, inv, None, None)
    data_t, inv_t = _cast_reference(x.t(), amax_t, fmt)
    pad = -x.shape[0] % align
    if pad:
        data_t = torch.cat([data_t, torch.zeros(data_t.shape[0], pad, dtype=data.dtype, device=x.device)], dim=1)
    return Fp8Tensor(data, inv, data_t, inv_t)


def scaled_mm_reference(a8, inv_a, b8, inv_b, out_dtype, bias=None):
    """The truth of a scaled GEMM: dequantize in float32 and multiply. a8 [M, K], b8 [N, K]."""
    y = (a8.float() * inv_a) @ (b8.float() * inv_b).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# --------------------------------------------------------------------------------
# Kernel 1: the amax
# --------------------------------------------------------------------------------
@triton.jit
def _load_tile(X, offs_m, offs_k, M, K, sx_m, sx_k):
    # Any strides (a transposed view is read in place); rows and columns past the end read 0.
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    ptrs = X + offs_m[:, None].to(tl.int64) * sx_m + offs_k[None, :].to(tl.int64) * sx_k
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@fast_launch
@triton.jit
def _amax_kernel(
    X,  # [M, K] bf16/fp16/fp32, any strides
    AMAX,  # float32, zeros: [M] (rowwise) or [1] (tensorwise)
    AMAX_T,  # float32 [K], zeros (rowwise with transpose; unused otherwise)
    M, K, sx_m, sx_k,
    ROWWISE: tl.constexpr, TRANSPOSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    STEPS: tl.constexpr,
):
    # A program walks STEPS tiles down one column strip: [STEPS * BLOCK_M, BLOCK_K]. The
    # column (tensor) maxima are a running elementwise maximum in registers, reduced once at
    # the end (a reduction down the columns crosses warps: per tile it would cost more than
    # the load), then one atomic per column (or one) per program, not per tile: with one tile
    # per program, 128 programs of an 8192-row strip queue on the same 128 addresses in L2.
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    run = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for step in range(STEPS):
        offs_m = (tl.program_id(0) * STEPS + step) * BLOCK_M + tl.arange(0, BLOCK_M)
        a = tl.abs(_load_tile(X, offs_m, offs_k, M, K, sx_m, sx_k))
        run = tl.maximum(run, a)
        if ROWWISE:
            # A row's pieces are in programs of other strips: atomic_max folds them
            # together (within a warp: cheap). |x| >= 0, so the float max is
            # order-independent: deterministic.
            tl.atomic_max(AMAX + offs_m, tl.max(a, axis=1), mask=offs_m < M, sem="relaxed")
    if ROWWISE:
        if TRANSPOSE:
            tl.atomic_max(AMAX_T + offs_k, tl.max(run, axis=0), mask=offs_k < K, sem="relaxed")
    else:
        tl.atomic_max(AMAX, tl.max(run), sem="relaxed")


# Kernel 1b, per tensor: one scale needs the largest |x| of all elements in any order,
# so x whose elements fill one block of memory (contiguous, or a transposed view of a
# contiguous tensor) is read as a flat array: long contiguous runs, no tiles. A
# persistent grid of G programs strides over it, each keeping an elementwise running
# maximum, and program p writes its maximum to PARTIAL[p]: no zeroed buffer (one launch
# less) and no atomics; the cast kernel reduces the G partials itself (a few KB from L2).
@fast_launch
@triton.jit
def _amax_flat_kernel(X, PARTIAL, N, iters, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    run = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(iters):
        # Block i * G + p: the programs' last blocks are x's last, the ones still in L2
        # when the cast kernel starts from the end (as with kernel 1's strips).
        offs = (i * tl.num_programs(0) + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        run = tl.maximum(run, tl.abs(tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32)))
    tl.store(PARTIAL + pid, tl.max(run, axis=0))


# --------------------------------------------------------------------------------
# Kernel 2: the cast
# --------------------------------------------------------------------------------
@triton.jit
def _scale(amax, E5M2: tl.constexpr):
    # The format's largest value (448 for e4m3, 57344 for e5m2) / max(amax, 1e-12),
    # correctly rounded like PyTorch's division.
    if E5M2:
        top = tl.full(amax.shape, _E5M2_MAX, tl.float32)
    else:
        top = tl.full(amax.shape, _FP8_MAX, tl.float32)
    return tl.math.div_rn(top, tl.maximum(amax, _AMAX_FLOOR))


@triton.jit
def _inverse(scale):
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _fp8_bits(v, E5M2: tl.constexpr):
    # float32 v within the format's range -> the uint8 bits of e4m3fn (or e5m2), rounded to
    # nearest even. The GPU converts in hardware; Triton 3.6's interpreter has a bug (a
    # mantissa rounding up into the next power of two gives half the value: 31.6 -> 16), so
    # there we build the bits from float32's. Either way the kernel stores into a uint8 view.
    if IN_INTERPRETER:
        # MANT mantissa bits, exponent BIAS: e4m3 3 and 7, e5m2 2 and 15.
        MANT: tl.constexpr = 2 if E5M2 else 3
        BIAS: tl.constexpr = 15 if E5M2 else 7
        bits = v.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        # Normal values (|v| >= 2^(1-BIAS)): keep MANT of float32's 23 mantissa bits,
        # rounding to nearest even (a carry moves into the exponent by itself), and rebias
        # the exponent from float32's 127 to the format's BIAS.
        drop: tl.constexpr = 23 - MANT
        normal = ((mag + ((1 << (drop - 1)) - 1) + ((mag >> drop) & 1)) >> drop) - ((127 - BIAS) << MANT)
        # Subnormals: multiples of 2^(1-BIAS-MANT). Adding and subtracting 2^23 rounds |v|
        # scaled to those units to the nearest even integer in float32; the smallest
        # normal's code is 2^MANT.
        t = tl.abs(v) * (2.0 ** (BIAS - 1 + MANT))
        sub = ((t + 8388608.0) - 8388608.0).to(tl.uint32)
        return (tl.where(mag < ((128 - BIAS) << 23), sub, normal) | sign).to(tl.uint8)  # float32 bits of 2^(1-BIAS)
    elif E5M2:
        return v.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@triton.jit
def _cast_tile(x, scale, E5M2: tl.constexpr):
    if E5M2:
        y = tl.clamp(x * scale, -_E5M2_MAX, _E5M2_MAX)
    else:
        y = tl.clamp(x * scale, -_FP8_MAX, _FP8_MAX)
    return _fp8_bits(y, E5M2)


@fast_launch
@triton.jit
def _cast_kernel(
    X,  # [M, K] bf16/fp16/fp32, any strides
    OUT,  # [M, K] uint8 (a view of the fp8 data), rows ST_O apart (K, or a column slice of a wider copy:
          # quantize_side_by_side)
    OUT_T,  # [K, M_PAD] uint8 (a view of the fp8 data_t), rows ST_T apart, or [K, M_PAD / 4] int32 with
            # PACK (ST_T in words); unused without TRANSPOSE. A column slice of a wider x^T: quantize_stacked
    AMAX, AMAX_T,  # float32 [M] / [K] (rowwise), or tensorwise [n_amax] maxima whose maximum is x's
    INV, INV_T,  # float32 [M] / [K] or [1]: the inverse scales this kernel writes
    M, K, M_PAD, ST_O, ST_T, sx_m, sx_k, n_amax,
    ROWWISE: tl.constexpr, TRANSPOSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PACK: tl.constexpr,  # OUT_T written as 32-bit words (M_PAD a multiple of 4)
    AMAX_BLOCK: tl.constexpr,  # a power of two >= n_amax
    E5M2: tl.constexpr,  # cast to e5m2 instead of e4m3
):
    # What it buys: part of x read from L2 instead of HBM. Programs start in order of id,
    # so the amax kernel's last tiles are still in L2 (50 MB on an H100/H200) when this one
    # starts; walking the tiles last first reads those before its own traffic evicts them
    # (in the amax's order it would read the evicted ones first and evict the cached ones).
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_k = tl.num_programs(1) - 1 - tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    in_m = offs_m < M
    in_k = offs_k < K
    x = _load_tile(X, offs_m, offs_k, M, K, sx_m, sx_k)
    # The scales come from memory, never through the host: no sync, CUDA-graph capturable.
    # Every program recomputes the scales of its rows: one division per row, cheaper than
    # a third kernel. The first program of a row (column, tensor) also writes the inverse.
    if ROWWISE:
        scale = _scale(tl.load(AMAX + offs_m, mask=in_m, other=0.0), E5M2)
        bits = _cast_tile(x, scale[:, None], E5M2)
        if pid_k == 0:
            tl.store(INV + offs_m, _inverse(scale), mask=in_m)
    else:
        offs_a = tl.arange(0, AMAX_BLOCK)
        scale = _scale(tl.max(tl.load(AMAX + offs_a, mask=offs_a < n_amax, other=0.0), axis=0), E5M2)
        bits = _cast_tile(x, scale, E5M2)
        if (pid_m == 0) & (pid_k == 0):
            tl.store(INV, _inverse(scale))
    tl.store(OUT + offs_m[:, None].to(tl.int64) * ST_O + offs_k[None, :], bits, mask=in_m[:, None] & in_k[None, :])
    if TRANSPOSE:
        if ROWWISE:  # the transposed copy's rows are x's columns: their own scales
            scale_t = _scale(tl.load(AMAX_T + offs_k, mask=in_k, other=0.0), E5M2)
            bits_t = _cast_tile(x, scale_t[None, :], E5M2)
            if pid_m == 0:
                tl.store(INV_T + offs_k, _inverse(scale_t), mask=in_k)
        else:  # one scale: the same bytes, transposed
            bits_t = bits
        # tl.trans makes M the tile's contiguous dim, as in OUT_T (both load and store
        # coalesce). Rows M..M_PAD of x read as 0: OUT_T's padding columns get zeros.
        if PACK:
            # What it buys: a quarter of the elements to transpose and to store. Four
            # bytes of a column of x (rows 4j..4j+3) are one 32-bit word of OUT_T's row,
            # the first in the low byte (little-endian), built before the transpose, so
            # the shuffle through shared memory moves words, not single bytes.
            quads = tl.reshape(bits_t, (BLOCK_M // 4, 4, BLOCK_K)).to(tl.uint32)
            shift = (tl.arange(0, 4) * 8).to(tl.uint32)
            words = tl.sum(quads << shift[None, :, None], axis=1)  # disjoint bytes: the sum is their OR
            offs_w = pid_m * (BLOCK_M // 4) + tl.arange(0, BLOCK_M // 4)
            tl.store(OUT_T + offs_k[:, None].to(tl.int64) * ST_T + offs_w[None, :],
                     tl.trans(words).to(tl.int32, bitcast=True), mask=in_k[:, None] & (offs_w < M_PAD // 4)[None, :])
        else:
            tl.store(OUT_T + offs_k[:, None].to(tl.int64) * ST_T + offs_m[None, :], tl.trans(bits_t),
                     mask=in_k[:, None] & (offs_m < M_PAD)[None, :])


# --------------------------------------------------------------------------------
# Kernel 3: per row without the transposed copy, one pass
# --------------------------------------------------------------------------------
# A row's scale depends on that row only. A row that fits in registers (K <=
# ROW_CAST_MAX_K) is loaded once, its maximum taken, cast and stored: 2 B read + 1 B
# written per bf16 element, not 2 + 2 + 1, no zero fill, no atomics (H200, 8,192 x 4,096:
# 26.5 us against 45.5). x^T's per-column scales need every row first: there the two
# kernels stay (a one-pass variant was no faster: NOTES.md, "FP8 casts").
@fast_launch
@triton.jit
def _row_cast_kernel(
    X,  # [M, K] bf16/fp16/fp32, any strides
    OUT,  # [M, K] uint8 (a view of the fp8 data), row-major
    INV,  # float32 [M]: the rows' inverse scales
    M, K, sx_m, sx_k,
    blocks_per_program,  # consecutive blocks of ROWS rows per program (a persistent grid)
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, E5M2: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)  # the whole row: BLOCK_K >= K
    for i in range(blocks_per_program):
        offs_m = (pid * blocks_per_program + i) * ROWS + tl.arange(0, ROWS)
        in_m = offs_m < M
        x = _load_tile(X, offs_m, offs_k, M, K, sx_m, sx_k)  # rows past M read as 0
        scale = _scale(tl.max(tl.abs(x), axis=1), E5M2)
        tl.store(OUT + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], _cast_tile(x, scale[:, None], E5M2),
                 mask=in_m[:, None] & (offs_k < K)[None, :])
        tl.store(INV + offs_m, _inverse(scale), mask=in_m)


# Launch parameters, from `tools/tune_kernels.py --only fp8` on an H100 (NOTES.md).
# CAST_TILES: the cast kernel's [BLOCK_M, BLOCK_K] and warps. AMAX_TILES: the amax's tile,
# warps and programs per SM it aims for (STEPS tiles per strip keep the grid that size; a
# power of two <= 16: five compiled versions at most). The interpreter gets small tiles and
# one "SM": small test tensors still cross several tiles and walk several per program.
CAST_TILES = (32, 32, 1) if INTERPRET else (32, 128, 4)
AMAX_TILES = (16, 32, 1, 4) if INTERPRET else (64, 128, 4, 8)
# ROW_CAST: kernel 3's elements per tile (ROWS = that over the row's power of two, >= 1),
# per thread (the warps follow) and programs per SM (H200: 89-94% of copy bandwidth).
# ROW_CAST_MAX_K: the widest row in registers (small in the interpreter: both paths run).
ROW_CAST = (64, 16, 2) if INTERPRET else (8192, 32, 4)
ROW_CAST_MAX_K = 64 if INTERPRET else 16384
# AMAX_FLAT: kernel 1b's elements per block, warps and programs per SM.
AMAX_FLAT = (64, 1, 4) if INTERPRET else (8192, 8, 4)


def _amax_steps(m_tiles, k_tiles, device):
    target = AMAX_TILES[3] * (1 if INTERPRET else num_sms(device))
    steps = 1
    while steps < 16 and cdiv(m_tiles, 2 * steps) * k_tiles >= target:
        steps *= 2
    return steps


def quantize(x, recipe, transpose=False, align=1, fmt="e4m3", amax=None):
    """x [M, K] (bf16/fp16/fp32, any strides) -> Fp8Tensor, bit for bit quantize_reference's.
    ``amax`` (per tensor only): float32 maxima whose maximum is max |x|, from the kernel that
    produced x (kernel_common.take_amax); then x is read once, by the cast."""
    _check_quantize([x], recipe, fmt, [amax], "quantize")
    if _one_pass(recipe, transpose, x.shape[1]):
        data = torch.empty(x.shape, dtype=GRAD_FORMATS[fmt][0], device=x.device)
        inv = x.new_empty(x.shape[0], dtype=torch.float32)
        _cast_rows(x, data, inv, fmt == "e5m2")
        return Fp8Tensor(data, inv.view(-1, 1), None, None)
    return _quantize_parts([x], recipe, transpose, align, fmt, [amax])


def quantize_stacked(parts, recipe, transpose=False, amaxes=None):
    """``quantize(torch.cat(parts))`` bit for bit, without the concatenation: parts [N_i, K]
    (weights of layers that read one x), one Fp8Tensor of [sum N_i, K] whose scale (per
    tensor), or x^T's per-row scales, cover every part. ``amaxes``: per part, the maxima its
    producer noted (per tensor), or None."""
    amaxes = list(amaxes) if amaxes is not None else [None] * len(parts)
    _check_quantize(parts, recipe, "e4m3", amaxes, "quantize_stacked")
    return _quantize_parts(parts, recipe, transpose, 1, "e4m3", amaxes)


def quantize_side_by_side(parts, recipe, fmt="e4m3", amaxes=None):
    """``quantize(torch.cat(parts, 1), recipe, transpose=True, fmt=fmt)`` bit for bit, without
    the concatenation: parts [M, N_i] (the output gradients of layers that read one x), one
    Fp8Tensor of [M, sum N_i] and its transposed copy [sum N_i, M]; M a multiple of 16 (the
    dW product's reduction dim, which quantize would pad). Each part's cast writes its
    columns of the copy and its rows of the transposed copy; per row, the rows' scales run
    over every part and each column keeps its own."""
    amaxes = list(amaxes) if amaxes is not None else [None] * len(parts)
    parts_t = [p.t() for p in parts]  # stacked along the rows: the checks of quantize_stacked
    _check_quantize(parts_t, recipe, fmt, amaxes, "quantize_side_by_side")
    M, N, device = parts[0].shape[0], sum(p.shape[1] for p in parts), parts[0].device
    if M % 16:
        raise ValueError(f"quantize_side_by_side: the rows must be a multiple of 16, got {M}")
    rowwise = recipe == "rowwise"
    dtype, e5m2 = GRAD_FORMATS[fmt][0], fmt == "e5m2"
    data = torch.empty(M, N, dtype=dtype, device=device)
    data_t = torch.empty(N, M, dtype=dtype, device=device)
    most = _most_partials(device)
    if rowwise:  # the rows' maxima run over every part (atomics fold them), each part has its columns'
        amax, amax_t = (torch.zeros(n, dtype=torch.float32, device=device) for n in (M, N))
        inv, inv_t = torch.empty_like(amax), torch.empty_like(amax_t)
        first = 0
        for x in parts:
            _launch_amax(x, amax, amax_t[first:first + x.shape[1]], True, True)
            first += x.shape[1]
    else:
        amax = amax_t = _tensor_maxima(parts, amaxes, most)
        inv = inv_t = torch.empty(1, dtype=torch.float32, device=device)
    n_amax = 1 if rowwise else amax.numel()
    cm, ck, cw = CAST_TILES
    pack = not rowwise and M % 4 == 0
    word = 4 if pack else 1
    out_t = data_t.view(torch.int32) if pack else data_t.view(torch.uint8)
    first = 0
    for x in parts:
        n, cols = x.shape[1], slice(first, first + x.shape[1])
        _cast_kernel[(max(1, cdiv(M, cm)), max(1, cdiv(n, ck)))](
            x, data[:, cols].view(torch.uint8), out_t[cols], amax, amax_t[cols] if rowwise else amax_t,
            inv, inv_t[cols] if rowwise else inv_t, M, n, M, N, M // word, x.stride(0), x.stride(1), n_amax,
            ROWWISE=rowwise, TRANSPOSE=True, BLOCK_M=cm, BLOCK_K=ck, PACK=pack,
            AMAX_BLOCK=next_power_of_2(max(most, n_amax)), E5M2=e5m2, num_warps=cw)
        first += n
    shape = (-1, 1) if rowwise else ()
    return Fp8Tensor(data, inv.view(shape), data_t, inv_t.view(shape))


def _check_quantize(parts, recipe, fmt, amaxes, name):
    _check_recipe(recipe, name)
    _check_format(fmt, name)
    if not parts or len(amaxes) != len(parts):
        raise ValueError(f"{name}: one amax (or None) per tensor, got {len(parts)} tensors and {len(amaxes)}")
    if any(a is not None for a in amaxes) and recipe != "tensorwise":
        raise ValueError(f"{name}: a produced amax is one maximum per tensor, not per row (recipe {recipe!r})")
    first = parts[0]
    for x in parts:
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: unsupported dtype {x.dtype}; use float32, float16 or bfloat16")
        if x.dim() != 2:
            raise ValueError(f"{name}: x must be 2-D [M, K], got {tuple(x.shape)}")
        if x.shape[1] != first.shape[1] or x.dtype != first.dtype or x.device != first.device:
            raise ValueError(f"{name}: stacked tensors need one width, dtype and device, got "
                             f"{[(tuple(p.shape), p.dtype, str(p.device)) for p in parts]}")
    check_kernel_device(*parts)


def _quantize_parts(parts, recipe, transpose, align, fmt, amaxes):
    """The amax and cast kernels over parts [N_i, K] stacked along the rows (one part: quantize's x)."""
    K, device = parts[0].shape[1], parts[0].device
    sizes = [x.shape[0] for x in parts]
    M = sum(sizes)
    m_pad = cdiv(M, align) * align
    rowwise = recipe == "rowwise"
    dtype, e5m2 = GRAD_FORMATS[fmt][0], fmt == "e5m2"
    data = torch.empty(M, K, dtype=dtype, device=device)
    data_t = torch.empty(K, m_pad, dtype=dtype, device=device) if transpose else data
    most = _most_partials(device)
    if rowwise:
        amax, amax_t, inv, inv_t = _row_maxima(parts, transpose)
    else:
        amax = amax_t = _tensor_maxima(parts, amaxes, most)
        inv = inv_t = torch.empty(1, dtype=torch.float32, device=device)
    n_amax = 1 if rowwise else amax.numel()  # per tensor: the cast reduces the maxima itself
    cm, ck, cw = CAST_TILES
    # x^T's padding columns (zeros) are written by the last part's programs.
    widths = [n + (m_pad - M) * (i == len(parts) - 1) for i, n in enumerate(sizes)]
    # x^T as 32-bit words (PACK) per tensor: +5 to +7 points of copy bandwidth (H200). Per
    # row the tile is cast twice, and packing on top measured 2-5 points slower (NOTES.md).
    pack = transpose and not rowwise and all(w % 4 == 0 for w in widths)
    word = 4 if pack else 1
    out_t = data_t.view(torch.int32) if pack else data_t.view(torch.uint8)
    first = 0
    for x, n, width in zip(parts, sizes, widths):
        rows = slice(first, first + n)
        _cast_kernel[(max(1, cdiv(width, cm)), max(1, cdiv(K, ck)))](
            x, data[rows].view(torch.uint8), out_t[:, first // word:] if transpose else out_t,
            amax[rows] if rowwise else amax, amax_t, inv[rows] if rowwise else inv, inv_t,
            n, K, width, K, m_pad // word, x.stride(0), x.stride(1), n_amax, ROWWISE=rowwise,
            TRANSPOSE=transpose, BLOCK_M=cm, BLOCK_K=ck, PACK=pack,
            AMAX_BLOCK=next_power_of_2(max(most, n_amax)), E5M2=e5m2, num_warps=cw)
        first += n
    shape = (-1, 1) if rowwise else ()
    if not transpose:
        return Fp8Tensor(data, inv.view(shape), None, None)
    return Fp8Tensor(data, inv.view(shape), data_t, inv_t.view(shape))


def _launch_amax(x, amax, amax_t, rowwise, transpose):
    """Kernel 1 over x, folding into amax (and amax_t): zeroed buffers."""
    M, K = x.shape
    # At least one program each way: an empty x still gets its (column) scales written.
    am, ak, aw, _ = AMAX_TILES
    m_tiles, k_tiles = max(1, cdiv(M, am)), max(1, cdiv(K, ak))
    steps = _amax_steps(m_tiles, k_tiles, x.device)
    _amax_kernel[(cdiv(m_tiles, steps), k_tiles)](
        x, amax, amax_t, M, K, x.stride(0), x.stride(1),
        ROWWISE=rowwise, TRANSPOSE=transpose, BLOCK_M=am, BLOCK_K=ak, STEPS=steps, num_warps=aw)


def _row_maxima(parts, transpose):
    """Per row: (row maxima [M], column maxima [K] over every part (or the row maxima again
    without x^T), their inverse scales' buffers). Two allocations, not four (host time); the
    columns start 256 B in: cuBLASLt aligns scales."""
    M, K = sum(x.shape[0] for x in parts), parts[0].shape[1]
    cols = K if transpose else 0
    start = cdiv(M, 64) * 64 if cols else M
    amax_all = torch.zeros(start + cols, dtype=torch.float32, device=parts[0].device)
    inv_all = torch.empty_like(amax_all)
    amax, inv = amax_all[:M], inv_all[:M]
    amax_t, inv_t = (amax_all[start:], inv_all[start:]) if cols else (amax, inv)
    first = 0
    for x in parts:
        _launch_amax(x, amax[first:first + x.shape[0]], amax_t, True, transpose)
        first += x.shape[0]
    return amax, amax_t, inv, inv_t


def _tensor_maxima(parts, amaxes, most):
    """Per tensor: float32 maxima whose maximum is max |x| over every part: those handed
    over (a producer's), else kernel 1b's partials (x in one block of memory: contiguous, or
    a transposed view of contiguous), else kernel 1's one maximum."""
    maxima = []
    most = max(1, most // len(parts))  # the parts' partials together: no more than one tensor's
    for x, given in zip(parts, amaxes):
        if given is None and (x.is_contiguous() or x.t().is_contiguous()):
            flat_block, flat_warps, _ = AMAX_FLAT
            if INTERPRET:  # larger blocks for larger tensors (kernel_common.interpreter_block)
                flat_block = interpreter_block(x.numel(), 4 * most, flat_block)
            blocks = cdiv(x.numel(), flat_block)
            given = torch.empty(max(1, min(blocks, most)), dtype=torch.float32, device=x.device)  # empty x: one 0
            _amax_flat_kernel[(given.numel(),)](x, given, x.numel(), cdiv(blocks, given.numel()), BLOCK=flat_block,
                                                num_warps=flat_warps)
        elif given is None:
            given = torch.zeros(1, dtype=torch.float32, device=x.device)
            _launch_amax(x, given, given, False, False)
        maxima.append(given.reshape(-1))
    return maxima[0] if len(maxima) == 1 else torch.cat(maxima)


def tensor_maxima(x):
    """float32 maxima whose maximum is max |x| (what a per-tensor cast measures when no
    producer handed them over): for a cast with the same scale later (quantize's amax)."""
    return _tensor_maxima([x], [None], _most_partials(x.device))


def _most_partials(device):
    """How many partial maxima a per-tensor amax pass writes at most (kernel 1b's grid)."""
    return AMAX_FLAT[2] * (1 if INTERPRET else num_sms(device))


def _one_pass(recipe, transpose, K):
    """Does quantize take kernel 3 (per row, no transposed copy, rows that fit)?"""
    return recipe == "rowwise" and not transpose and 0 < K <= ROW_CAST_MAX_K


def _cast_rows(x, data, inv, e5m2):
    """Kernel 3's launch: whole rows, a persistent grid of consecutive row blocks."""
    M, K = x.shape
    block_k = next_power_of_2(K)
    tile, per_thread, per_sm = ROW_CAST
    rows = max(1, tile // block_k)
    warps = max(1, min(32, rows * block_k // (32 * per_thread)))
    n_blocks = cdiv(M, rows)
    programs = max(1, min(n_blocks, (1 if INTERPRET else num_sms(x.device)) * per_sm))
    _row_cast_kernel[(programs,)](x, data.view(torch.uint8), inv, M, K, x.stride(0), x.stride(1),
                                  cdiv(n_blocks, programs), ROWS=rows, BLOCK_K=block_k, E5M2=e5m2, num_warps=warps)


def cast_traffic(x, recipe, transpose, produced=False):
    """Bytes per element of x that quantize moves through memory on the path it takes:
    reads of x and the fp8 copies written (the scales are negligible). ``produced``: the
    amax came from x's producer (per tensor)."""
    e = x.element_size()
    if _one_pass(recipe, transpose, x.shape[-1]):
        return e + 1  # kernel 3: one read, one write
    reads = 1 if produced and recipe == "tensorwise" else 2  # the amax's read, unless produced
    return reads * e + 1 + int(transpose)  # + the cast's read, the copies


# --------------------------------------------------------------------------------
# The scaled GEMM: cuBLASLt through torch._scaled_mm
# --------------------------------------------------------------------------------
# Fast accumulation. Hopper's FP8 tensor cores add products into an accumulator that keeps
# fewer bits than float32 (about 14 of mantissa); with use_fast_accum=False cuBLASLt moves the
# partial sums into float32 every few K-tiles, with True it lets the tensor cores run the
# whole K loop. The forward product always runs fast (torchao's and Transformer Engine's
# default too); the two backward products, dX = dY W (K = out_features) and dW = dY^T X
# (K = the tokens of the micro-batch), are precise unless a layer is built with fast_accum
# (``--fp8-fast-accum``, ``kernel_ft.apply(fp8_fast_accum=True)``). What it buys and costs,
# measured (H100, LLaMA-3.1-8B full fine-tuning, 2 x 2,048 tokens, NOTES.md Step 22): +2.7%
# tokens/s on synthetic rows, +3.1% on the bundled data, and over its 500 steps the same loss
# (last 50 steps: 1.825 against 1.824). The error of a fast sum grows with K, so a batch of many more tokens per
# micro-batch (dW's K) may lose more than this run shows: an option to check against a
# precise run, like FP8 itself, not the default.
def scaled_mm(a8, inv_a, b8, inv_b, out_dtype, bias=None, fast_accum=False):
    """(a8 * inv_a) @ (b8 * inv_b)^T in out_dtype: a8 [M, K], b8 [N, K] fp8 row-major (K
    last; K and N multiples of 16 on the GPU), inverse scales [] or [M, 1] / [N, 1].
    ``fast_accum``: let the tensor cores accumulate K-tiles at their own, lower precision."""
    # _scaled_mm's second operand is [K, N] column-major, i.e. b8.t(); a rowwise scale of
    # it is a row vector [1, N].
    scale_b = inv_b.reshape(1, -1) if inv_b.dim() == 2 else inv_b
    y = torch._scaled_mm(a8, b8.t(), scale_a=inv_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)
    if bias is not None:
        # A separate pass over y (cuBLASLt can fuse a bias for some dtypes; LLaMA has none).
        y.add_(bias)
    return y


# --------------------------------------------------------------------------------
# Casts kept: frozen weights, and one x for the layers that read it
# --------------------------------------------------------------------------------
# Frozen weights keyed on the tensor object (its id; the entry dies with the weight): a
# WeakKeyDictionary would compare tensors with ``==``, elementwise.
_FROZEN_FP8 = WeakIdKeyDictionary()


def _cast_once(cache, slot, key, x, recipe, transpose, align=1, produced=False):
    """quantize(x), or the copy cache[slot] holds while its key is the same. ``produced``:
    per tensor, take the amax x's producer noted (kernel_common.take_amax), if any."""
    hit = cache.get(slot)
    if hit is not None and hit[0] == key:
        return hit[1]
    q = quantize(x, recipe, transpose, align, amax=_produced_amax(x, recipe) if produced else None)
    cache[slot] = (key, q)
    return q


def _produced_amax(x, recipe):
    """The maxima x's producer noted, per tensor; None: quantize measures them."""
    return take_amax(x) if recipe == "tensorwise" else None


def _weight_fp8(weight, recipe, transpose):
    gathered = getattr(weight, "fp8_copy", None)
    if gathered is not None:  # FSDP gathered it in FP8 (kernel_ft/fp8_gather.py): its bytes, as they are;
        data, inv, _ = gathered()  # W8^T is made in backward, from the weight saved (_linear_save)
        return Fp8Tensor(data, inv, None, None)
    if weight.requires_grad:  # trained: it changes every step, quantize it every call
        # Per tensor, the amax its last AdamW update measured (kernel_common), if any.
        amax = take_weight_amax(weight) if recipe == "tensorwise" else None
        return quantize(weight.detach(), recipe, transpose, amax=amax)
    key = (weight.data_ptr(), weight._version, recipe, transpose)
    return _cast_once(_FROZEN_FP8, weight, key, weight, recipe, transpose)


# What it buys: q, k and v (gate and up) read one x: one cast, one saved x^T (8B, 2 x 2,048
# tokens: 48 MB less per layer). The last input's entry holds while its storage lives (a
# weak reference) unwritten (its version). Eager only: an operator's outputs are its own.
_LAST_INPUT = {}


def _input_fp8(x, recipe, transpose):
    if x.is_inference() or x.numel() == 0:  # no version counter / no storage to tell apart
        return quantize(x, recipe, transpose, align=16)
    key = (StorageWeakRef(x.untyped_storage()), x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x._version,
           recipe, transpose)
    return _cast_once(_LAST_INPUT, "x", key, x, recipe, transpose, align=16, produced=True)


# --------------------------------------------------------------------------------
# The linear layer's launchers, registered as operators (kernel_common.kernel_op)
# --------------------------------------------------------------------------------
def _scale_shape(recipe, rows):
    return (rows, 1) if recipe == "rowwise" else ()


def _linear_forward_fake(x, weight, bias, recipe, grads, fast_accum, need_dx, need_dw):
    (M, K), N = x.shape, weight.shape[0]
    f32 = torch.float32
    return (x.new_empty(M, N),
            x.new_empty(K, cdiv(M, 16) * 16, dtype=FP8_DTYPE) if need_dw else nothing(x),
            x.new_empty(_scale_shape(recipe, K), dtype=f32) if need_dw else nothing(x),
            x.new_empty(K, N, dtype=FP8_DTYPE) if need_dx else nothing(x),
            x.new_empty(_scale_shape(recipe, K), dtype=f32) if need_dx else nothing(x))


@kernel_op("fp8_linear_forward", fake=_linear_forward_fake)
def fp8_linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: str,
                       grads: str, fast_accum: bool, need_dx: bool, need_dw: bool,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [M, N] in x's dtype, x_t, x_t's inverse scale, w_t, w_t's inverse scale) of x [M, K]:
    the fp8 transposed copies backward needs (empty placeholders where it needs none).
    ``grads``: the format backward casts dy to; ``fast_accum``: backward's products accumulate
    at the tensor cores' own precision (both kept for the backward registered below)."""
    # X^T for dW only when the weight gets a gradient; its M columns padded to a multiple
    # of 16, the reduction dim of the dW GEMM (zero columns add nothing).
    return _linear_forward(x, weight, bias, recipe, need_dx, quantize(x, recipe, transpose=need_dw, align=16))


def _linear_forward(x, weight, bias, recipe, need_dx, xq):
    # W^T for dX only when x gets one.
    return _forward_product(x, xq, _weight_fp8(weight, recipe, transpose=need_dx), bias)


def _forward_product(x, xq, wq, bias=None):
    """(y, x_t, x_t's inverse scale, w_t, w_t's inverse scale): y = x W^T from the fp8 copies
    xq and wq, and the transposed copies backward keeps (empty placeholders where none)."""
    return (_forward_mm(xq, wq.data, wq.inv_scale, x.dtype, bias), *_kept_copies(x, xq, wq))


def _forward_mm(xq, w8, w_inv, out_dtype, bias=None):
    """x W^T from the fp8 copy xq and W's fp8 rows w8 (all of them, or a stacked weight's slice)."""
    # torchao's default: fast accumulation in the forward GEMM only.
    return scaled_mm(xq.data, xq.inv_scale, w8, w_inv, out_dtype, bias, fast_accum=True)


def _kept_copies(x, xq, wq):
    """x_t, its inverse scale, w_t, its inverse scale: empty placeholders where there are none."""
    return [t if t is not None else nothing(x) for t in (xq.data_t, xq.inv_scale_t, wq.data_t, wq.inv_scale_t)]


def _output_grad_fp8(dy, recipe, grads, transpose):
    """dy [M, N] cast to the ``grads`` format (and its transposed copy for dW); per tensor
    with the amax its producer noted, if any."""
    return quantize(dy, recipe, transpose=transpose, align=16, fmt=grads, amax=_produced_amax(dy, recipe))


def _linear_backward_fake(dy, x_t, x_inv_t, w_t, w_inv_t, recipe, grads, fast_accum, x_dtype, w_dtype, need_dx,
                          need_dw):
    M, N = dy.shape
    return (dy.new_empty(M, w_t.shape[0], dtype=x_dtype) if need_dx else nothing(dy),
            dy.new_empty(N, x_t.shape[0], dtype=w_dtype) if need_dw else nothing(dy))


@kernel_op("fp8_linear_backward", fake=_linear_backward_fake)
def fp8_linear_backward(dy: torch.Tensor, x_t: torch.Tensor, x_inv_t: torch.Tensor, w_t: torch.Tensor,
                        w_inv_t: torch.Tensor, recipe: str, grads: str, fast_accum: bool, x_dtype: torch.dtype,
                        w_dtype: torch.dtype, need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, K] in x_dtype, dw [N, K] in w_dtype) from dy [M, N] and the saved fp8 copies;
    dy cast to the ``grads`` format, the products with ``fast_accum`` ("Fast accumulation", above scaled_mm)."""
    dyq = _output_grad_fp8(dy, recipe, grads, need_dw)
    dx = scaled_mm(dyq.data, dyq.inv_scale, w_t, w_inv_t, x_dtype, fast_accum=fast_accum) if need_dx else nothing(dy)
    dw = (scaled_mm(dyq.data_t, dyq.inv_scale_t, x_t, x_inv_t, w_dtype, fast_accum=fast_accum) if need_dw
          else nothing(dy))
    return dx, dw


# --------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------
def _linear_save(ctx, inputs, output):
    x, weight, bias, recipe, grads, fast_accum, need_dx, need_dw = inputs
    # The fp8 copies only, never x or a bf16 W. A weight FSDP gathered in FP8 is saved itself
    # (what it buys: no whole W8^T kept on every GPU from forward to backward, 6.5 GiB at 8B;
    # FSDP has the weight whole again for backward, as for nn.Linear) and W8^T made from it there.
    gathered = [weight] if need_dx and hasattr(weight, "fp8_copy") else []
    ctx.save_for_backward(*output[1:], *gathered)
    ctx.recipe, ctx.grads, ctx.fast_accum, ctx.need_dx, ctx.need_dw = recipe, grads, fast_accum, need_dx, need_dw
    ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _linear_op_save(ctx, inputs, output):
    _linear_save(ctx, inputs, output)
    ctx.mark_non_differentiable(*output[1:])


def _weight_t(w_t, w_inv_t, gathered):
    """W8^T and its inverse scale for dx, as backward begins: kept from forward, or made now
    from the weight FSDP gathered in FP8 (kernel_ft/fp8_gather.py), if ``gathered`` is it."""
    _LAST_INPUT.clear()  # the forward is over: its last input's fp8 copy need not outlive it
    if gathered is not None:
        _, w_inv_t, w_t = gathered.fp8_copy(transpose=True)
    return w_t, w_inv_t


def _linear_grads(ctx, dy, *_):
    x_t, x_inv_t, w_t, w_inv_t, *gathered = ctx.saved_tensors
    w_t, w_inv_t = _weight_t(w_t, w_inv_t, gathered[0] if gathered else None)
    dx, dw = fp8_linear_backward(dy, x_t, x_inv_t, w_t, w_inv_t, ctx.recipe, ctx.grads, ctx.fast_accum, ctx.x_dtype,
                                 ctx.w_dtype, ctx.need_dx, ctx.need_dw)
    db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
    return (dx if ctx.need_dx else None), (dw if ctx.need_dw else None), db, None, None, None, None, None


class FP8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with all three GEMMs in FP8: x [..., K], weight [N, K], bias [N] or None."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, grads, fast_accum=False):
        x2d = x.reshape(-1, x.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[:2]
        inputs = (x2d, weight, bias, recipe, grads, fast_accum, need_dx, need_dw)
        if traced(x2d):
            output = fp8_linear_forward(*inputs)
        else:  # eager: the cast of x shared with the layers before that read the same x
            output = _linear_forward(x2d, weight, bias, recipe, need_dx, _input_fp8(x2d, recipe, need_dw))
        _linear_save(ctx, inputs, output)
        ctx.x_shape = x.shape
        return output[0].view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @first_order_only("fp8_linear")
    def backward(ctx, dy):
        dx, dw, db = _linear_grads(ctx, dy.reshape(-1, dy.shape[-1]))[:3]
        return (None if dx is None else dx.view(ctx.x_shape)), dw, db, None, None, None


fp8_linear_forward.op.register_autograd(first_order_only("fp8_linear")(_linear_grads),
                                        setup_context=_linear_op_save)


# --------------------------------------------------------------------------------
# Layers that read one x, stacked: gate_proj and up_proj as one product (q, k and v: split)
# --------------------------------------------------------------------------------
# A gated MLP's gate_proj and up_proj read the same x. As two FP8 layers they run two
# forward products and, in backward, two products for dx whose sum autograd adds in a
# separate pass: cuBLASLt's FP8 product cannot add into its output (projections_kernel sums
# bf16 layers in the epilogue instead), so the add reads two [M, K] tensors and writes one,
# and the next cast measures the sum's amax. Stacked, [Wg; Wu] is one [2I, K] weight: one
# product writes [gate | up] side by side (the fused layout swiglu_kernel reads in place,
# as Phi-3's gate_up_proj), and dx = [dg | du] @ [Wg; Wu] is one product whose reduction
# runs over both, the sum inside the tensor cores' float32 accumulator. SwiGLU's backward
# already writes [dg | du] as one tensor for that layout, with its amax (a producer).
# The price: the stacked weight is cast as one tensor, so per tensor both weights share one
# scale (the larger amax), and per row W^T's scales run over both: exactly what one
# gate_up_proj layer of those weights computes (fp8_test.py checks it against that layer).
# What it buys (H100, NOTES.md Step 22): per MLP one add of [M, K] and one amax pass less,
# two products fewer. Trained, bias-free layers of one recipe only; frozen weights (cached
# casts), FSDP's FP8 gathers, a tracer, no gradients and hooked layers keep one product per
# layer (FP8Linear.stacked_with lists them).
# q, k and v (projections_kernel's groups) stack with ``split``: the attention reads them
# apart, so each keeps its own forward product (on its rows of the stacked fp8 weight) and
# output tensor; their output gradients arrive apart too, and quantize_side_by_side casts
# each into its columns of one [dq | dk | dv]: dx is one product, not three and two adds
# (H100: +0.8-0.9% tokens/s at 8B per tensor, +1.1-1.3% per row; NOTES.md Step 22).
STACK_PROJECTIONS = True  # False: each layer its own products (A/B: benchmark_fp8.py)


class FP8StackedFunction(torch.autograd.Function):
    """y = x [W_1; W_2; ...]^T with all GEMMs in FP8 and the stacked weight's scales
    (FP8Linear.stacked_with): the layers' outputs side by side in one [..., sum N_i] tensor,
    or with ``split`` one tensor per layer (q, k and v, which the attention reads apart)."""

    @staticmethod
    def forward(ctx, x, recipe, grads, fast_accum, split, *weights):
        x2d = x.reshape(-1, x.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[5:])
        xq = _input_fp8(x2d, recipe, need_dw)  # shared with any other layer reading x
        amaxes = [take_weight_amax(w) for w in weights] if recipe == "tensorwise" else None
        wq = quantize_stacked([w.detach() for w in weights], recipe, need_dx, amaxes)
        ctx.rows = _row_slices(weights)
        if split:
            # One product per layer, on its rows of the stacked fp8 weight: each output its own
            # contiguous tensor, in the layout the layer alone would give the attention.
            ys = [_forward_mm(xq, wq.data[rows], _rows_of(wq.inv_scale, rows, recipe), x.dtype).view(*x.shape[:-1], -1)
                  for rows, _ in ctx.rows]
            keep = _kept_copies(x2d, xq, wq)
        else:
            y, *keep = _forward_product(x2d, xq, wq)
        ctx.save_for_backward(*keep)
        ctx.recipe, ctx.grads, ctx.fast_accum = recipe, grads, fast_accum
        ctx.x_shape, ctx.x_dtype, ctx.split = x.shape, x.dtype, split
        return tuple(ys) if split else y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @first_order_only("fp8_linear")
    def backward(ctx, *dys):
        x_t, x_inv_t, w_t, w_inv_t = ctx.saved_tensors
        _LAST_INPUT.clear()  # the forward is over (as in _weight_t)
        need_dx, need_dws = ctx.needs_input_grad[0], ctx.needs_input_grad[5:]
        dyq = (_side_by_side_grads(dys, ctx) if ctx.split else
               _output_grad_fp8(dys[0].reshape(-1, dys[0].shape[-1]), ctx.recipe, ctx.grads, any(need_dws)))
        # What split buys: dx = [dq | dk | dv] [Wq; Wk; Wv] is one product; as three layers, three
        # products and two adds of [M, K] tensors autograd runs apart (96 MB each at 8B, 4,096 tokens).
        fast = ctx.fast_accum
        dx = (scaled_mm(dyq.data, dyq.inv_scale, w_t, w_inv_t, ctx.x_dtype, fast_accum=fast).view(ctx.x_shape)
              if need_dx else None)
        dws = [scaled_mm(dyq.data_t[rows], _rows_of(dyq.inv_scale_t, rows, ctx.recipe), x_t, x_inv_t, dtype,
                         fast_accum=fast)
               if need else None for (rows, dtype), need in zip(ctx.rows, need_dws)]  # dW_i: its rows of dy^T
        return (dx, None, None, None, None, *dws)


def _row_slices(weights):
    """(rows of the stacked weight, dtype) of each weight, in order."""
    slices, first = [], 0
    for w in weights:
        slices.append((slice(first, first + w.shape[0]), w.dtype))
        first += w.shape[0]
    return slices


def _rows_of(inv_scale, rows, recipe):
    """The inverse scales of some rows: per row those rows', per tensor the one."""
    return inv_scale[rows] if recipe == "rowwise" else inv_scale


def _side_by_side_grads(dys, ctx):
    """The split outputs' gradients as one fp8 [dy_1 | dy_2 | ...] and its transposed copy,
    each cast into its columns (quantize_side_by_side), no concatenation; an unused output's
    gradient is zeros; rows not a multiple of 16: concatenated, then cast as one tensor."""
    x_rows = ctx.x_shape.numel() // ctx.x_shape[-1]
    device = next(dy.device for dy in dys if dy is not None)
    parts = [torch.zeros(x_rows, rows.stop - rows.start, dtype=ctx.x_dtype, device=device) if dy is None
             else dy.reshape(-1, dy.shape[-1]) for dy, (rows, _) in zip(dys, ctx.rows)]
    if x_rows % 16:
        return _output_grad_fp8(torch.cat(parts, 1), ctx.recipe, ctx.grads, True)
    amaxes = [_produced_amax(p, ctx.recipe) for p in parts] if ctx.recipe == "tensorwise" else None
    return quantize_side_by_side(parts, ctx.recipe, ctx.grads, amaxes)


# --------------------------------------------------------------------------------
# A frozen FP8 layer's two products, for an autograd node of someone else's
# --------------------------------------------------------------------------------
# lora_kernel.LoRALinearFunction puts a LoRA adapter inside its base layer's products
# (the scale and the sums in cuBLAS epilogues). Over an FP8Linear base layer, whose weight
# LoRA freezes, it runs the layer's forward product and its input gradient's product
# through these two: the casts and products FP8Linear's own forward and backward run, on
# the same cached fp8 copies of the weight.
def frozen_linear_forward(layer, x2, need_dx):
    """(y [M, N] in x2's dtype, saved) of an FP8Linear ``layer`` with a frozen weight on
    x2 [M, K]; ``saved`` (a tuple of tensors and None) is what frozen_linear_input_grad needs.
    Eager only (a tracer sees FP8Linear's operators instead)."""
    weight, bias = layer.weight, layer.bias
    _check_linear(x2, weight, bias, layer.recipe, layer.grads, layer.emulate)
    y, _, _, w_t, w_inv_t = _linear_forward(x2, weight, bias, layer.recipe, need_dx,
                                            _input_fp8(x2, layer.recipe, False))
    if need_dx and hasattr(weight, "fp8_copy"):  # gathered by FSDP in FP8: W8^T in backward (_linear_save)
        return y, (None, None, weight)
    return y, (w_t if need_dx else None, w_inv_t if need_dx else None, None)


def frozen_linear_input_grad(layer, dy, saved, out_dtype):
    """dx [M, K] = dy W in ``out_dtype`` for dy [M, N], from frozen_linear_forward's ``saved``:
    dy cast to the layer's gradient format, the product on the weight's fp8 copy."""
    w_t, w_inv_t = _weight_t(*saved)
    return fp8_linear_backward(dy, nothing(dy), nothing(dy), w_t, w_inv_t, layer.recipe, layer.grads,
                               layer.fast_accum, out_dtype, out_dtype, True, False)[0]


# --------------------------------------------------------------------------------
# The entry point and its checks
# --------------------------------------------------------------------------------
def _check_recipe(recipe, name):
    if recipe not in RECIPES:
        raise ValueError(f"{name}: recipe must be one of {RECIPES}, got {recipe!r}")


def _check_format(fmt, name):
    if fmt not in GRAD_FORMATS:
        raise ValueError(f"{name}: the fp8 format must be one of {tuple(GRAD_FORMATS)}, got {fmt!r}")


def _check_linear(x, weight, bias, recipe, grads, emulate):
    _check_recipe(recipe, "fp8_linear")
    _check_format(grads, "fp8_linear")
    for what, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"fp8_linear: unsupported {what} dtype {t.dtype}; use float32, float16 or bfloat16")
    if x.dim() < 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x must be [..., K] (2-D or more) and weight [N, K], got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    N, K = weight.shape
    if K % 16 or N % 16:
        raise ValueError(f"fp8_linear: FP8 GEMMs need in_features and out_features that are multiples of 16, "
                         f"got weight [{N}, {K}]")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"fp8_linear: bias must be [{N}], got {tuple(bias.shape)}")
    supported, why = fp8_supported(x.device)
    if not supported and not emulate:
        raise RuntimeError(f"fp8_linear: {why}")
    check_kernel_device(*(t for t in (x, weight, bias) if t is not None))


def fp8_linear(x, weight, bias=None, recipe="tensorwise", emulate=False, grads="e4m3", fast_accum=False):
    """``F.linear(x, weight, bias)`` with its three GEMMs in FP8 (dynamic scales; x and W in
    e4m3, the output's gradient in ``grads``: "e4m3" or "e5m2"). ``fast_accum``: the two
    backward products accumulate at the tensor cores' own precision too ("Fast accumulation", above scaled_mm).

    x [..., K], weight [N, K], bias [N] (bf16/fp16/fp32; K and N multiples of 16).
    Returns y [..., N] in x's dtype; differentiable in all three. ``emulate=True`` runs
    where there are no FP8 tensor cores (CPU: torch's _scaled_mm computes in float32,
    the kernels in the Triton interpreter): for tests, not for speed.
    """
    _check_linear(x, weight, bias, recipe, grads, emulate)
    grad = torch.is_grad_enabled()
    need_dx, need_dw = grad and x.requires_grad, grad and weight.requires_grad
    x2d = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling() or traced(x2d):  # one operator in the graph
        y = fp8_linear_forward(x2d, weight, bias, recipe, grads, fast_accum, need_dx, need_dw)[0]
    elif not (need_dx or need_dw or (grad and bias is not None and bias.requires_grad)):
        # Nothing to differentiate: no transposed copies; x's amax from its producer, if noted.
        y = _linear_forward(x2d, weight, bias, recipe, False,
                            quantize(x2d, recipe, align=16, amax=_produced_amax(x2d, recipe)))[0]
    else:
        return FP8LinearFunction.apply(x, weight, bias, recipe, grads, fast_accum)
    return y.view(*x.shape[:-1], weight.shape[0])


# --------------------------------------------------------------------------------
# In a model
# --------------------------------------------------------------------------------
class FP8Linear(nn.Module):
    """An nn.Linear whose forward runs fp8_linear. It holds the *same* weight and bias
    Parameters as the layer it replaces: optimizers, weight tying and checkpoints see
    no difference."""

    def __init__(self, linear, recipe="tensorwise", emulate=False, grads="e4m3", fast_accum=False):
        super().__init__()
        _check_recipe(recipe, "FP8Linear")
        _check_format(grads, "FP8Linear")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.recipe, self.emulate, self.grads, self.fast_accum = recipe, emulate, grads, bool(fast_accum)
        if recipe == "tensorwise":
            # The kernels that produce its input note their amax (kernel_common), and so may
            # the optimizer for its weight.
            register_fp8_weight(self.weight)

    def forward(self, x):
        return fp8_linear(x, self.weight, self.bias, self.recipe, self.emulate, self.grads, self.fast_accum)

    def stacked_with(self, x, *others, split=False):
        """``torch.cat([self(x), *(m(x) for m in others)], -1)`` as one FP8 product whose weight
        is the layers' stacked (FP8StackedFunction: one scale over all of them), with ``split``
        the tuple ``(self(x), *(m(x) for m in others))`` whose dx is one product, or None where
        they do not stack (then the caller calls each): another recipe, a bias, a frozen
        weight, a weight FSDP gathered in FP8, a layer with forward hooks or its own forward
        (offloading, parameter gathers: they run only when the layer is called), no gradients
        (evaluation: each layer's product then skips the transposed copies), torch.compile,
        STACK_PROJECTIONS off."""
        layers = (self, *others)
        if not STACK_PROJECTIONS or not self.runs_inside(x) or not all(self.same_kind(m) for m in others):
            return None
        for m in layers:
            _check_linear(x, m.weight, None, m.recipe, m.grads, m.emulate)
        return FP8StackedFunction.apply(x, self.recipe, self.grads, self.fast_accum, split,
                                        *(m.weight for m in layers))

    def runs_inside(self, x):
        """Whether this layer's products may run inside another autograd Function on input
        ``x`` (stacked with others above, or after SwiGLU: swiglu_kernel.swiglu_fp8_down_proj):
        gradients on, no tracer, and the layer plain (_plain)."""
        return torch.is_grad_enabled() and not torch.compiler.is_compiling() and not traced(x) and self._plain()

    def same_kind(self, other):
        """``other`` is a plain FP8Linear like this one: recipe, gradient format, accumulation, weight dtype."""
        return (isinstance(other, FP8Linear) and other._plain() and self._kind() == other._kind())

    def _kind(self):
        return self.recipe, self.grads, self.fast_accum, self.emulate, self.weight.dtype

    def _plain(self):
        """Its forward would be this class's as it stands: a trained, bias-free weight not
        gathered by FSDP in FP8, no hooks of its own or global ones (they run only when the
        layer is called), no forward of its own (offloading, parameter gathers)."""
        return (self.bias is None and self.weight.requires_grad and not hasattr(self.weight, "fp8_copy")
                and called_plainly(self))

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe}, grads={self.grads}"
                + (", fast_accum=True" if self.fast_accum else ""))


def replace_linears(model, recipe="tensorwise", skip=("lm_head",), emulate=False, grads="e4m3", fast_accum=False):
    """Swap the layers swap_common.linears_to_cast picks (not the LM head, not LoRA's
    adapters, sizes FP8 can run) for FP8Linear; returns (count, names of the layers left
    alone for their sizes). Under peft, apply this after get_peft_model: a LoRA layer's
    ``base_layer`` is swapped. ``grads``: the gradients' format, "e4m3" or "e5m2";
    ``fast_accum``: fast accumulation in the backward products too ("Fast accumulation", above scaled_mm)."""
    _check_recipe(recipe, "replace_linears")
    _check_format(grads, "replace_linears")
    targets, skipped = linears_to_cast(model, skip)
    chosen = {id(module) for _, module in targets}
    count = swap_modules(model, lambda module: id(module) in chosen,
                         lambda module: FP8Linear(module, recipe, emulate, grads, fast_accum))
    return count, skipped
