"""
Step 12 -- A fused SwiGLU in Triton, forward and backward.

What it computes
----------------
Every LLaMA decoder layer ends with a gated MLP. For a token's hidden vector x
(length H = 4096 in LLaMA-3.1-8B) Hugging Face's ``LlamaMLP`` computes::

    gate = gate_proj(x)                    # [N, I], I = 14336
    up   = up_proj(x)                      # [N, I]
    out  = down_proj(silu(gate) * up)      # [N, H]

    silu(g) = g * sigmoid(g) = g / (1 + exp(-g))

The three projections are matrix multiplications and stay on cuBLAS (plain
``nn.Linear``). This step fuses what sits between them, ``silu(gate) * up``,
the "SwiGLU" activation, into one kernel for the forward pass and one for the
backward pass. The same kernels serve Gemma's GeGLU, Phi-3's fused gate_up
projection and the experts of MoE layers (sections below), and the file ends with
the modules that put them into a model.

Dtype behaviour, reproduced exactly: for bf16/fp16 tensors PyTorch evaluates
silu in float32 and rounds the result to the input dtype; the multiply by ``up``
is then computed in float32 and rounded once more. So::

    y = round( round(silu(g)) * u )

and a model patched with this kernel computes the same numbers as the unpatched
one. The result has dtype ``torch.promote_types(gate.dtype, up.dtype)``.

Why a custom kernel
-------------------
SwiGLU does a handful of FLOPs per element on the largest activations of the
layer, so it is limited by memory, in two ways.

Bandwidth. Eager PyTorch runs silu as one kernel and the multiply as another,
and the intermediate silu(gate) makes a round trip through HBM. In bf16
(2 bytes per element)::

    forward    silu:  read g, write s              4 B
               mul:   read s, read u, write y      6 B     naive 10 B / element
    backward   d_up   = dy * s:   read 2, write 1  6 B
               d_s    = dy * u:   read 2, write 1  6 B
               d_gate = silu_backward(d_s, g)      6 B     naive 18 B / element

The fused forward reads g and u and writes y (6 B); the fused backward reads
dy, g and u and writes d_gate and d_up (10 B): 16 B instead of 28 B per element
for a training step, 1.75x less traffic.

Capacity. Autograd keeps, from forward to backward, gate (silu's input),
silu(gate) and up (the multiply's operands): three [N, I] tensors. The fused
version saves only gate and up and *recomputes* sigmoid(gate) in backward,
which costs a few FLOPs and no memory. For LLaMA-3.1-8B at a batch of
2 x 2048 tokens, each saved [N, I] bf16 tensor is 4096 x 14336 x 2 B = 117 MB per
layer, so dropping silu(gate) frees 3.8 GB across the 32 layers.

In time the gain is modest. Per step at that batch the 32 layers move 53 GB
naively and 30 GB fused. Measured during development (an ad-hoc sweep, not kept;
``benchmark_kernels.py --kernel swiglu`` makes the same comparison, README Step
7/10 has its H100 run) on one H200 (torch 2.11, triton 3.6, copy bandwidth
4.17 TB/s), 4096 x 14336 bf16, per layer: eager forward + backward
400 us; the fused kernels 87 us + 142 us = 229 us (~97% of copy bandwidth by
the byte counts above); ``torch.compile`` of the same formula 225 us. So about
13 ms against 7 ms per step, next to some 200 ms of MLP matrix multiplications.
The memory is the bigger win: it buys a larger batch or a longer sequence, in
plain eager mode, with no compilation.

GeGLU: the same kernel with another gate (Gemma)
------------------------------------------------
Gemma 1, 2 and 3 gate with GELU instead of SiLU, in its tanh approximation
(HF's ``gelu_pytorch_tanh``, which is ``F.gelu(g, approximate="tanh")``)::

    out     = down_proj(gelu(gate) * up)
    gelu(g) = 0.5 g (1 + tanh(c (g + k g^3))),     c = sqrt(2/pi), k = 0.044715

Since 1 + tanh(t) = 2 sigmoid(2t), GELU has SiLU's shape, g times a sigmoid;
only the sigmoid's argument differs::

    silu(g) = g * sigmoid(z),   z = g
    gelu(g) = g * sigmoid(z),   z = 2c (g + k g^3)

So it is not a new kernel but a compile-time switch in the same one
(``ACT``: "silu" or "gelu_tanh"), which picks z. The derivative follows the
same way (the backward kernel's comments derive it)::

    d act / dg = s + g s (1 - s) dz/dg,    s = sigmoid(z)
    dz/dg      = 1 (SiLU)   or   2c (1 + 3k g^2) (GELU)

The rounding is SwiGLU's: gelu(g) rounded to gate's dtype, times up in float32,
rounded once more. One difference in the numbers: PyTorch evaluates
0.5 g (1 + tanh(t)), in which 1 + tanh(t) cancels for negative g (in float32
it loses relative accuracy below g = -3 and is exactly 0 below about -5.06);
the sigmoid form keeps those values, all below 1e-2 in size. Elsewhere both are
within a few float32 ulps of the truth and round alike to bf16, bar rare
last-bit flips (about 1 element in 1000).

Bytes: exactly SwiGLU's. The same tensors are read and written (forward 6 B,
backward 10 B per element in bf16), and the naive PyTorch version moves the
same 10 B + 18 B and saves the same three [N, I] tensors. The math grows: g^3,
the argument z, both sigmoids of |z| (for accuracy, below) and the selects cost
some 10 more float32 instructions per element in forward, dz/dg some 5 more in
backward, next to the exp and the reciprocal that SiLU needs too. An H100
issues about 33 T float32 instructions per second (67 TFLOP/s counting an FMA
as two) against ~3 TB/s of memory traffic: some 10 per byte moved, of which
GeGLU uses 2 to 3. So it runs at SwiGLU's speed. Measured during development
(an ad-hoc run, not kept) on one H100 80GB HBM3 (torch 2.11, triton 3.6),
4096 x 14336 bf16, the kernels alone: forward 122 us for both, backward 198 us
for both, 2.9-3.0 TB/s effective by the byte counts above (copy: 3.0 TB/s).

The fused gate_up layout (Phi-3)
--------------------------------
Phi-3 (and GLM) compute gate and up with ONE Linear of 2I outputs and cut its
result in halves: ``gate, up = gate_up_proj(x).chunk(2, dim=-1)``. The two
halves are views of one [N, 2I] tensor with row stride 2I, and the kernels take
row strides, so ``swiglu(gate_up)`` reads them in place, no copy. In backward
the kernel writes d_gate and d_up into the two halves of one [N, 2I] gradient,
which is exactly what gate_up_proj's backward wants; two separate gradients
would have to be concatenated by autograd (chunk's backward), another read and
write of 2I elements per row (8 B per element in bf16, nearly as much as the
fused backward's own 10 B).

Swapping only what computes the same
------------------------------------
``replace_swiglu`` (at the end of this file) finds gated MLPs by shape: a ``*MLP``
module with the projections of one layout and an activation we implement
(``module_activation`` knows SiLU and the tanh GELU, exactly; the erf GELU and
the hand-written tanh formulas round differently and are left alone). Shape proves nothing about the
math, so before the swap each MLP class runs next to its replacement on a
random input (``check_same_mlp``); a class that computes something else (a
clamped gate, a top-k sparse gate, a scaled output) raises
``swap_common.SwapMismatch`` and the model is left as it was.

Triton concepts new in this step (see rmsnorm_kernel.py for the basics)
-----------------------------------------------------------------------
* An elementwise kernel over a 2-D tensor: the [rows, I] tensor is cut into
  tiles of ROWS x BLOCK_N, and a flat 1-D grid numbers the tiles. Each program
  turns its number into (row block, column block) with one scalar division, and
  addresses element (r, c) as ``base + r * row_stride + c``. The row stride
  lets the kernel read a slice of a wider tensor (``gate = x[:, :I]`` of a
  fused [N, 2I] projection) in place, without a copy.
* Sigmoid built from ``exp`` in registers, and *recomputing* an intermediate in
  backward instead of saving it: for a bandwidth-bound op, FLOPs are free and
  bytes are not.
* Two outputs from one backward program, each switched off at compile time
  (``tl.constexpr`` flags) when autograd does not need that gradient; each with
  its own row stride, so both can be halves of one wider gradient.
* A compile-time *string* (``ACT: tl.constexpr``) choosing the activation: one
  kernel source, one compiled kernel per activation, no branch at run time.

Nothing runs on import. See swiglu_test.py for the checks.
"""

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import (
    INTERPRET, SUPPORTED_DTYPES, amax_slots, as_rows, cast_to, cdiv, check_kernel_device, exp, fast_launch,
    first_order_only, kernel_op, next_power_of_2, note_amax, nothing, traced,
)
from swap_common import InstanceForward, SwapMismatch, called_plainly, swap_modules

import triton
import triton.language as tl

import fp8_kernel
import lora_kernel
from fp8_kernel import _cast_tile, _scale  # noqa: F401 - Triton functions the backward kernel calls (STORE_H8_T)


# --------------------------------------------------------------------------------
# The references: Hugging Face's eager formulas. Tests compare against them (and
# their float64 versions); the benchmark times them as "PyTorch eager".
# --------------------------------------------------------------------------------
def swiglu_reference(gate, up):
    """``act_fn(gate) * up`` as HF ``LlamaMLP.forward`` computes it (act_fn = SiLU)."""
    return F.silu(gate) * up


def geglu_reference(gate, up):
    """``act_fn(gate) * up`` as HF ``GemmaMLP.forward`` computes it (act_fn = ``gelu_pytorch_tanh``)."""
    return F.gelu(gate, approximate="tanh") * up


# The gate activations the kernels implement, by the name the launchers take.
REFERENCES = {"silu": swiglu_reference, "gelu_tanh": geglu_reference}

# GELU's tanh approximation, gelu(g) = 0.5 g (1 + tanh(c (g + k g^3))), with
# PyTorch's constants: c = sqrt(2 / pi), k = 0.044715.
GELU_C = tl.constexpr(0.7978845608028654)
GELU_K = tl.constexpr(0.044715)


# --------------------------------------------------------------------------------
# sigmoid and the gate activation of one float32 block
# --------------------------------------------------------------------------------
# Both activations are g * sigmoid(z) for some z (the docstring's GeGLU section):
#
#   silu:       z = g
#   gelu_tanh:  z = 2c (g + k g^3)     since 1 + tanh(t) = 2 sigmoid(2t)
#
# ACT (a compile-time string) picks the branch. Each returns s = sigmoid(z),
# 1 - s (backward needs both) and act(g).
#
# SiLU: PyTorch evaluates silu as g / (1 + exp(-g)); so do we, so that the
# forward output and the value d_up is built from (below) round the same way.
# For large negative g, exp(-g) overflows to inf and both results go to 0, as in
# PyTorch. PRECISE (float32 inputs): libdevice's exp and IEEE-rounded division,
# so float32 results carry PyTorch's own error (on an H200, 64 x 14336: relative
# error of y 4.9e-8 like PyTorch's, against 5.4e-8 with the fast pair). For
# bf16/fp16 the fast exp2 and approximate division are ~2 ulp of float32, far
# below the rounding to 16 bits.
#
# GELU: PyTorch computes 0.5 g (1 + tanh(t)), and 1 + tanh(t) cancels for
# negative g: its float32 result loses relative accuracy below g = -3 (1e-3 at
# -4) and is 0 below about -5.06, for values under 1e-2 in size. We take the
# sigmoid of |z| from e = exp(-|z|) in (0, 1], which never overflows:
#
#   sigmoid(|z|) = 1 / (1 + e),   sigmoid(-|z|) = e / (1 + e)
#
# so s and 1 - s both come out accurate (1 - s by subtraction would lose e to
# the rounding of 1 + e for large z, e.g. e = 1e-6 at g = 4.5 keeps 3 of its
# bits, and backward multiplies it by dz/dg, which grows like g^2). For z >= 0,
# act = g - g * sigmoid(-z): a small correction to g, rounded once. Float32
# results are within about one ulp of the truth everywhere, also in the tail.
@triton.jit
def _sigmoid_and_act(g, ACT: tl.constexpr, PRECISE: tl.constexpr):
    if ACT == "gelu_tanh":
        # Tensors on the left of the constants: in the interpreter, constexpr * tensor
        # would stay wrapped as a constexpr. The products are the same numbers.
        z = (g + (g * g * g) * GELU_K) * GELU_C * 2.0
        e = exp(-tl.abs(z), PRECISE)
        denom = 1.0 + e
        if PRECISE:
            big, small = tl.div_rn(1.0, denom), tl.div_rn(e, denom)
        else:
            big = 1.0 / denom
            small = e * big  # one approximate reciprocal for both
        positive = z >= 0.0
        s = tl.where(positive, big, small)
        return s, tl.where(positive, small, big), tl.where(positive, g - g * small, g * small)
    else:
        denom = 1.0 + exp(-g, PRECISE)
        if PRECISE:
            s, a = tl.div_rn(1.0, denom), tl.div_rn(g, denom)
        else:
            s, a = 1.0 / denom, g / denom
        return s, 1.0 - s, a


@triton.jit
def _tile(n_rows, n_cols, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    # Row indices (int64), column indices and mask of this program's tile.
    # Flat grid: tile t covers row block t // n_col_blocks and column block
    # t % n_col_blocks, so neighbouring programs stream neighbouring memory. One
    # scalar division per program, not per element.
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
    row_block = pid // n_col_blocks
    col_block = pid % n_col_blocks
    # Row indices in 64 bits: row * stride exceeds 2**31 once the tensor holds
    # more than 2**31 elements (150k tokens x 14336 in LLaMA-3.1-8B).
    rows = row_block.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows, cols, mask


@triton.jit
def _fold_amax(AMAX, y, AMAX_SLOTS: tl.constexpr):
    # max |y| of this tile (masked entries hold 0) into one of AMAX_SLOTS addresses: one
    # relaxed atomic per program (Step 22's producers, kernel_common "FP8 producers").
    tl.atomic_max(AMAX + tl.program_id(0) % AMAX_SLOTS, tl.max(tl.max(tl.abs(y.to(tl.float32)), axis=1), axis=0),
                  sem="relaxed")


# --------------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------------
@fast_launch
@triton.jit(do_not_specialize=["n_rows"])  # a varying count: not specialized (rmsnorm_kernel.py)
def _swiglu_fwd_kernel(
    G,  # [n_rows, n_cols] gate_proj output; rows stride_g elements apart, columns contiguous
    U,  # [n_rows, n_cols] up_proj output; rows stride_u apart (may differ from G's)
    Y,  # [n_rows, n_cols] output, contiguous (row stride n_cols), promoted dtype
    AMAX,  # [AMAX_SLOTS] float32, zeroed: max |Y| folded in (AMAX_SLOTS > 0 only)
    stride_g,
    stride_u,
    n_rows,
    n_cols,
    BLOCK_N: tl.constexpr,  # columns per tile (power of two)
    ROWS: tl.constexpr,  # rows per tile (> 1 only for short rows)
    ACT: tl.constexpr,  # the gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    PRECISE: tl.constexpr,  # float32 input: accurate exp and division
    AMAX_SLOTS: tl.constexpr = 0,  # > 0: also fold max |Y| into AMAX, for an FP8 cast of Y (Step 22)
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_N, ROWS)
    # Load in the input dtype, compute in float32 (PyTorch's "opmath" for 16-bit types).
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    _, _, a = _sigmoid_and_act(g, ACT, PRECISE)
    # HF semantics: the activation's result is rounded to gate's dtype (F.silu and
    # F.gelu return a bf16 tensor), then multiplied by up in float32 and rounded
    # once on store.
    a = cast_to(a, G.dtype.element_ty).to(tl.float32)
    y = cast_to(a * u, Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], y, mask=mask)
    if AMAX_SLOTS:  # an FP8 producer, as RMSNorm is: max |y| as stored, for down_proj's cast
        _fold_amax(AMAX, y, AMAX_SLOTS)


# --------------------------------------------------------------------------------
# Backward kernel
# --------------------------------------------------------------------------------
# Derivation (per element, float32), SiLU first:
#
#   s = sigmoid(g) = 1 / (1 + exp(-g)),       ds/dg = s * (1 - s)
#   a = silu(g)    = g * s
#   da/dg          = s + g * s * (1 - s) = s * (1 + g * (1 - s))
#   y              = a * u
#
#   d_up   = dy * dy/du = dy * a
#   d_gate = dy * dy/da * da/dg = dy * u * s * (1 + g * (1 - s))
#
# GELU (tanh) is a = g * s with s = sigmoid(z), z = 2c (g + k g^3). The chain
# rule adds dz/dg to the second term:
#
#   da/dg = s + g * s * (1 - s) * dz/dg = s * (1 + g * (1 - s) * dz/dg)
#   dz/dg = 2c (1 + 3k g^2)
#
# (the same as PyTorch's 0.5 (1 + tanh t) + 0.5 g (1 - tanh^2 t) c (1 + 3k g^2)
# with t = z / 2: 0.5 (1 + tanh t) = s and 1 - tanh^2 t = 4 s (1 - s)).
#
# Only g and u are needed, and s costs one exp: backward recomputes it instead
# of reading a saved act(g) (which would cost [N, I] of memory plus a read).
#
# The forward really computes y = round(a) * u. Its exact derivative with
# respect to u is round(a), which is also what PyTorch's multiply backward sees
# (it saved the rounded activation output), so d_up uses the rounded value. The
# rounding has no derivative; d_gate uses the float32 s and g, with no
# intermediate rounding of dy * u (PyTorch rounds that product to bf16 before
# the activation's backward, so ours is slightly more accurate).
#
# The outputs take row strides too: with the fused gate_up layout, d_gate and
# d_up are the two halves of one [n_rows, 2 * n_cols] gradient (row stride 2I).
@fast_launch
@triton.jit(do_not_specialize=["n_rows"])  # a varying count: not specialized (rmsnorm_kernel.py)
def _swiglu_bwd_kernel(
    DY,  # [n_rows, n_cols] upstream gradient, dtype of y; rows stride_dy apart, columns contiguous
    G,  # [n_rows, n_cols] saved gate; rows stride_g apart
    U,  # [n_rows, n_cols] saved up; rows stride_u apart
    DG,  # [n_rows, n_cols] output d_gate, gate's dtype; rows stride_dg apart
    DU,  # [n_rows, n_cols] output d_up, up's dtype; rows stride_du apart
    H,  # [n_rows, n_cols] output h = act(gate) * up as forward wrote it, contiguous (STORE_H only)
    AMAX_DG, AMAX_DU,  # [AMAX_SLOTS] float32, zeroed: max |DG|, max |DU| (the same slots when fused)
    H8_T,  # [n_cols, m_pad] uint8: the fp8 bits of h^T, rows m_pad apart (STORE_H8_T only)
    H_AMAX,  # [n_amax] float32: maxima whose maximum is the forward's max |h| (STORE_H8_T only)
    stride_dy,
    stride_g,
    stride_u,
    stride_dg,
    stride_du,
    n_rows,
    n_cols,
    m_pad,  # STORE_H8_T: h^T's row length, n_rows rounded up (the grid covers it; the padding gets zeros)
    n_amax,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    COMPUTE_DG: tl.constexpr,  # False when gate does not require grad: no read of u, no store
    COMPUTE_DU: tl.constexpr,  # False when up does not require grad: no store
    STORE_H: tl.constexpr,  # also write forward's output h (for down_proj's weight gradient)
    ACT: tl.constexpr,
    PRECISE: tl.constexpr,
    AMAX_SLOTS: tl.constexpr = 0,  # > 0: fold the gradients' max |.| into AMAX_DG / AMAX_DU
    STORE_H8_T: tl.constexpr = False,  # also write h^T in e4m3 with the forward's scale (FP8 down_proj)
    AMAX_BLOCK: tl.constexpr = 1,  # a power of two >= n_amax
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_N, ROWS)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s, s_c, a = _sigmoid_and_act(g, ACT, PRECISE)  # s_c = 1 - s
    a_rounded = cast_to(a, G.dtype.element_ty).to(tl.float32)  # as forward rounded it
    if COMPUTE_DG or STORE_H or STORE_H8_T:
        u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    if COMPUTE_DU:
        du = cast_to(dy * a_rounded, DU.dtype.element_ty)
        tl.store(DU + rows[:, None] * stride_du + cols[None, :], du, mask=mask)
        if AMAX_SLOTS:  # for up_proj's FP8 cast of its output gradient
            _fold_amax(AMAX_DU, du, AMAX_SLOTS)

    if STORE_H:
        # The forward kernel's h, bit for bit (same a, same rounding), from the g and u
        # this program has loaded anyway: 2 B per element written here instead of a
        # separate forward launch that reads g and u again (6 B). See swiglu_down_proj below.
        tl.store(H + rows[:, None] * n_cols + cols[None, :], cast_to(a_rounded * u, H.dtype.element_ty), mask=mask)

    if STORE_H8_T:
        # The fp8 h^T an FP8 down_proj's weight gradient reads, bit for bit what its forward
        # cast would have kept (fp8_kernel's cast of the same bf16 h with the same scale), 1 B
        # per element written here instead of kept from forward (swiglu_fp8_down_proj below).
        # Transposed through tl.trans: h^T's rows are h's columns, tokens contiguous; rows
        # n_rows..m_pad of this tile loaded as zeros, so the padding columns get zeros.
        h = cast_to(a_rounded * u, G.dtype.element_ty).to(tl.float32)
        offs_a = tl.arange(0, AMAX_BLOCK)
        scale = _scale(tl.max(tl.load(H_AMAX + offs_a, mask=offs_a < n_amax, other=0.0), axis=0), False)
        tl.store(H8_T + cols[:, None].to(tl.int64) * m_pad + rows[None, :], tl.trans(_cast_tile(h, scale, False)),
                 mask=(cols < n_cols)[:, None] & (rows < m_pad)[None, :])

    if COMPUTE_DG:
        if ACT == "gelu_tanh":
            dz = (1.0 + (g * g) * (3.0 * GELU_K)) * GELU_C * 2.0
            dg = dy * u * s * (1.0 + g * s_c * dz)
        else:
            dg = dy * u * s * (1.0 + g * s_c)
        dg = cast_to(dg, DG.dtype.element_ty)
        tl.store(DG + rows[:, None] * stride_dg + cols[None, :], dg, mask=mask)
        if AMAX_SLOTS:
            _fold_amax(AMAX_DG, dg, AMAX_SLOTS)


# --------------------------------------------------------------------------------
# Launch helpers: checks, tile sizes, grid
# --------------------------------------------------------------------------------
# Elements per tile: 2048 columns (or several short rows making up 2048) with 8
# warps is 8 elements per thread, one 16-byte load of bf16 per input. Tiles that
# divide LLaMA's I = 14336 (= 7 x 2048) leave no half-empty tile. A sweep on an
# H200 (tiles 1024-8192 x 4/8/16 warps; 4096 and 16384 rows of I = 14336, 4096
# of I = 11008) put 2048 x 8 warps in the fastest group everywhere (tied with
# 1024 x 4): forward 4.0-4.3 TB/s, backward 4.1-4.3 TB/s effective. Tiles of
# 8192 slowed the backward by ~30%, 16 warps with small tiles by ~50%.
TILE_ELEMENTS = 2048
NUM_WARPS = 8


# With h^T in fp8 (STORE_H8_T) the tile is square-ish instead: one row of 2048 columns
# would write 2048 single bytes, each into another row of h^T. 32 rows x 128 columns write
# 32 contiguous bytes (one memory sector) into each of 128 rows of h^T, and read and write
# 256 contiguous bytes of each bf16 row. A sweep on an H200 (results/fp8/h8t_backward/call2,
# LLaMA-8B's MLP at 4,096 tokens): 199 us against 166 without h8^T, which the forward's cast
# then does not write (18 us): +15 us per layer. Columns x rows x warps 64x32x4 +24 us,
# 32x64x4 +30, 128x16x4 +36, 8 warps +45 to +85; four tokens packed into 32-bit words first
# (as fp8_kernel's cast does) was never faster.
H8_T_TILE = (16, 16, 1) if INTERPRET else (128, 32, 4)  # (BLOCK_N, ROWS, num_warps)


def _launch_config(n_cols):
    """(BLOCK_N, ROWS, num_warps) for a row length: one tile is ROWS x BLOCK_N."""
    block_n = min(next_power_of_2(n_cols), TILE_ELEMENTS)
    # Short rows: stack several into one tile, so that each program still moves
    # a useful amount of data (I = 7 would otherwise give 7-element programs).
    rows = max(1, TILE_ELEMENTS // block_n)
    return block_n, rows, NUM_WARPS


def _grid(n_rows, n_cols, block_n, rows):
    return (cdiv(n_rows, rows) * cdiv(n_cols, block_n),)


def _check_inputs(gate, up, name):
    """Clear errors for bad input; ``name`` is the public function (swiglu, geglu, ...).
    ``up`` None: ``gate`` is a fused projection's output, [gate | up] on the last dim."""
    if not isinstance(gate, torch.Tensor) or not (up is None or isinstance(up, torch.Tensor)):
        raise TypeError(
            f"{name} expects tensors for gate and up, got {type(gate).__name__} and {type(up).__name__}"
        )
    for what, t in (("gate", gate), ("up", up)):
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: unsupported {what} dtype {t.dtype}; use float32, float16 or bfloat16")
    if up is None:
        if gate.dim() < 1 or gate.shape[-1] < 2 or gate.shape[-1] % 2:
            raise ValueError(
                f"{name}: a fused gate_up input must be [..., 2I] with I >= 1 (gate and up are its two halves), "
                f"got shape {tuple(gate.shape)}"
            )
        check_kernel_device(gate)
        return
    if gate.shape != up.shape:
        raise ValueError(
            f"{name}: gate shape {tuple(gate.shape)} does not match up shape {tuple(up.shape)} "
            "(both are [..., intermediate_size])"
        )
    if gate.dim() < 1 or gate.shape[-1] == 0:
        raise ValueError(f"{name}: inputs must be [..., I] with I >= 1, got shape {tuple(gate.shape)}")
    check_kernel_device(gate, up)


def _hidden_size(gate, up):
    """I, the width of h = act(gate) * up (up None: gate holds [gate | up])."""
    return gate.shape[-1] if up is not None else gate.shape[-1] // 2


def _rows(gate, up):
    """(gate, up, I): gate and up as [rows, I] views with contiguous columns.

    ``up`` None (the fused gate_up layout): gate and up are the two halves of
    ``gate``'s rows, two views with row stride 2I into the same memory, no copy.
    """
    if up is None:
        n_cols = gate.shape[-1] // 2
        both = as_rows(gate, 2 * n_cols)
        return both[:, :n_cols], both[:, n_cols:], n_cols
    n_cols = gate.shape[-1]
    return as_rows(gate, n_cols), as_rows(up, n_cols), n_cols


def _out_shape(gate, up):
    return gate.shape[:-1] + (_hidden_size(gate, up),)


def _out_dtype(gate, up):
    return gate.dtype if up is None else torch.promote_types(gate.dtype, up.dtype)


def _swiglu_forward_fake(gate, up, activation="silu"):
    return gate.new_empty(_out_shape(gate, up), dtype=_out_dtype(gate, up))


@kernel_op("swiglu_forward", fake=_swiglu_forward_fake)
def swiglu_forward(gate: torch.Tensor, up: Optional[torch.Tensor], activation: str = "silu") -> torch.Tensor:
    """Launch the forward kernel. Returns y = act(gate) * up, act = ``activation``
    ("silu" or "gelu_tanh"), with up's shape (up None: gate holds [gate | up])."""
    return _forward(gate, up, activation, None)


def _forward(gate, up, activation, amax):
    """swiglu_forward's launch; ``amax``: zeroed float32 slots that get max |y| (or None)."""
    # Row-strided views (a slice of a wider tensor) pass through untouched. Only a
    # non-contiguous last dimension (a transposed tensor), or leading dimensions
    # that cannot be merged into one row stride, cost a copy.
    g2, u2, n_cols = _rows(gate, up)
    n_rows = g2.shape[0]
    y = torch.empty((n_rows, n_cols), dtype=_out_dtype(gate, up), device=gate.device)
    if n_rows > 0:
        block_n, rows, num_warps = _launch_config(n_cols)
        _swiglu_fwd_kernel[_grid(n_rows, n_cols, block_n, rows)](
            g2, u2, y, y if amax is None else amax, g2.stride(0), u2.stride(0), n_rows, n_cols,
            BLOCK_N=block_n, ROWS=rows, ACT=activation, PRECISE=gate.dtype == torch.float32,
            AMAX_SLOTS=0 if amax is None else amax.numel(), num_warps=num_warps,
        )
    return y.view(_out_shape(gate, up))


def _swiglu_backward_fake(dy, gate, up, compute_dgate, compute_dup, activation="silu"):
    if up is None:
        return gate.new_empty(gate.shape) if compute_dgate else nothing(gate), nothing(gate)
    return (gate.new_empty(gate.shape) if compute_dgate else nothing(gate),
            up.new_empty(up.shape) if compute_dup else nothing(up))


@kernel_op("swiglu_backward", fake=_swiglu_backward_fake)
def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor],
                    compute_dgate: bool, compute_dup: bool, activation: str = "silu",
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel. Returns (d_gate, d_up); each is empty if not asked for.
    up None (fused layout): (d_gate_up, empty), the gradient of the whole [..., 2I] input."""
    return swiglu_backward_and_hidden(dy, gate, up, compute_dgate, compute_dup, activation, False)[:2]


def swiglu_backward_and_hidden(dy, gate, up, compute_dgate, compute_dup, activation="silu", store_h=True,
                               amax=None, h8_t=None):
    """swiglu_backward's (d_gate, d_up), and with ``store_h`` also forward's output h
    (swiglu_forward's bits) from the same pass, else None. A plain launcher: callers
    inside an operator (swiglu_down_proj_backward below) use it. ``amax``: zeroed float32
    slots [2, AMAX_SLOTS] that get max |d_gate| and max |d_up| (fused layout: both in row 0).
    ``h8_t``: (out, h_amax), out a uint8 [I, m_pad] (m_pad >= rows) that gets h^T cast to
    e4m3 with the scale of the maxima h_amax, as fp8_kernel.quantize casts (gate's dtype
    is h's: gate and up of one dtype)."""
    g2, u2, n_cols = _rows(gate, up)
    dy2 = as_rows(dy, n_cols)
    n_rows = g2.shape[0]
    if h8_t is not None and (u2.dtype != g2.dtype or h8_t[0].shape[0] != n_cols or h8_t[0].shape[1] < n_rows):
        raise ValueError(f"swiglu_backward_and_hidden: h^T's fp8 copy must be [{n_cols}, >= {n_rows}] for gate and "
                         f"up of one dtype, got {tuple(h8_t[0].shape)} ({g2.dtype}, {u2.dtype})")
    if up is None:
        # Optimization: gate_up_proj's backward wants ONE [N, 2I] gradient. The
        # kernel writes d_gate and d_up straight into its two halves; two separate
        # gradients would be concatenated by autograd (chunk's backward), one more
        # read and write of 2I elements per row.
        compute_dup = compute_dgate
        both = torch.empty((n_rows, 2 * n_cols), dtype=gate.dtype, device=gate.device) if compute_dgate else None
        dg, du = (both[:, :n_cols], both[:, n_cols:]) if compute_dgate else (None, None)
    else:
        dg = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device) if compute_dgate else None
        du = torch.empty((n_rows, n_cols), dtype=up.dtype, device=up.device) if compute_dup else None
    h = torch.empty((n_rows, n_cols), dtype=_out_dtype(gate, up), device=gate.device) if store_h else None
    out_t, h_amax = h8_t if h8_t is not None else (None, None)
    m_pad = n_rows if out_t is None else out_t.shape[1]
    if m_pad > 0 and (compute_dgate or compute_dup or store_h or out_t is not None):
        block_n, rows, num_warps = _launch_config(n_cols) if out_t is None else H8_T_TILE
        # A switched-off output is never written: any tensor stands in for its pointer.
        dg_arg = next(t for t in (dg, du, h, out_t) if t is not None)
        du_arg = du if compute_dup else dg_arg
        amax_dg, amax_du = (dg_arg, dg_arg) if amax is None else (amax[0], amax[0] if up is None else amax[1])
        _swiglu_bwd_kernel[_grid(m_pad, n_cols, block_n, rows)](
            dy2, g2, u2, dg_arg, du_arg, h if store_h else dg_arg, amax_dg, amax_du,
            dg_arg if out_t is None else out_t, dg_arg if h_amax is None else h_amax,
            dy2.stride(0), g2.stride(0), u2.stride(0), dg_arg.stride(0), du_arg.stride(0), n_rows, n_cols,
            m_pad, 1 if h_amax is None else h_amax.numel(),
            BLOCK_N=block_n, ROWS=rows, COMPUTE_DG=compute_dgate, COMPUTE_DU=compute_dup, STORE_H=store_h,
            ACT=activation, PRECISE=gate.dtype == torch.float32, AMAX_SLOTS=0 if amax is None else amax.shape[1],
            STORE_H8_T=out_t is not None, AMAX_BLOCK=1 if h_amax is None else next_power_of_2(h_amax.numel()),
            num_warps=num_warps,
        )
    h = h.view(_out_shape(gate, up)) if store_h else None
    if up is None:
        return (both.view(gate.shape) if compute_dgate else nothing(gate)), nothing(gate), h
    return (
        dg.view(gate.shape) if compute_dgate else nothing(gate),
        du.view(up.shape) if compute_dup else nothing(up),
        h,
    )


def _wanted(grads, needs):
    """Autograd's view of the gradients: None where an input needs none."""
    return tuple(g if need else None for g, need in zip(grads, needs))


# --------------------------------------------------------------------------------
# Autograd function (and the same formula on the custom operator)
# --------------------------------------------------------------------------------
def _swiglu_save(ctx, inputs, output):
    # Save the two inputs (already alive: gate_proj and up_proj produced them)
    # and nothing else; backward recomputes sigmoid(z).
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.activation = inputs[2] if len(inputs) > 2 else "silu"


def _swiglu_grads(ctx, dy):
    gate, up = ctx.saved_tensors
    needs = ctx.needs_input_grad[:2]
    slots = amax_slots(dy, 2)  # per-tensor FP8 gate/up layers take their gradients' amax from here
    if slots is None:
        return _wanted(swiglu_backward(dy, gate, up, *needs, ctx.activation), needs) + (None,)
    grads = swiglu_backward_and_hidden(dy, gate, up, *needs, ctx.activation, store_h=False, amax=slots)[:2]
    for grad, row in zip(grads, slots):
        note_amax(grad, row)
    return _wanted(grads, needs) + (None,)


class TritonSwiGLUFunction(torch.autograd.Function):
    """act(gate) * up for both activations (the name is the family's: GLU variants).

    apply(gate, up, activation="silu"); up None: gate holds [gate | up].
    """
    # The classic form (forward with ctx): in eager mode it costs less host time
    # per call than forward + setup_context; the operator registers the same pieces.
    @staticmethod
    def forward(ctx, gate, up, activation="silu"):
        slots = amax_slots(gate)  # a per-tensor FP8 down_proj may read y: its amax comes from here
        if slots is None:
            y = swiglu_forward(gate, up, activation)
        else:
            y = _forward(gate, up, activation, slots[0])
            note_amax(y, slots[0])
        _swiglu_save(ctx, (gate, up, activation), y)
        return y

    @staticmethod
    @first_order_only("swiglu/geglu")
    def backward(ctx, dy):
        return _swiglu_grads(ctx, dy)


swiglu_forward.op.register_autograd(first_order_only("swiglu/geglu")(_swiglu_grads), setup_context=_swiglu_save)

# The public name of each activation's function, for error messages.
FUNCTION_NAMES = {"silu": "swiglu", "gelu_tanh": "geglu"}


def _check_activation(activation, name):
    if activation not in FUNCTION_NAMES:
        raise ValueError(f"{name}: activation must be one of {sorted(FUNCTION_NAMES)}, got {activation!r}")


def gated_activation(gate, up, activation):
    """``act(gate) * up`` for ``activation`` in "silu" (swiglu) and "gelu_tanh" (geglu)."""
    _check_activation(activation, "gated_activation")
    _check_inputs(gate, up, FUNCTION_NAMES[activation])
    if torch.compiler.is_compiling():
        return swiglu_forward.op(gate, up, activation)  # one node of the compiled graph (kernel_common.kernel_op)
    return TritonSwiGLUFunction.apply(gate, up, activation)


def swiglu(gate, up=None):
    """Fused ``F.silu(gate) * up`` with PyTorch's dtype behaviour; differentiable in both.

    gate, up: [..., I] float32/float16/bfloat16 of the same shape, on one device.
    Rows may be strided (a slice of a wider tensor is read in place).
    ``swiglu(gate_up)``: the [..., 2I] output of a fused gate_up projection with
    gate in the first half and up in the second (Phi-3's ``chunk(2, dim=-1)``);
    read in place, and its gradient comes back as one [..., 2I] tensor.
    """
    return gated_activation(gate, up, "silu")


def geglu(gate, up=None):
    """Fused ``F.gelu(gate, approximate="tanh") * up`` (Gemma's MLP), as ``swiglu``."""
    return gated_activation(gate, up, "gelu_tanh")


# --------------------------------------------------------------------------------
# Optimization: recompute the MLP's hidden activation instead of saving it
# --------------------------------------------------------------------------------
# down_proj = F.linear(h, W) saves its input h = act(gate) * up for the weight
# gradient dW = dout^T @ h: a third [N, I] tensor per layer kept from forward to
# backward, next to gate and up. But h is a cheap function of gate and up, which
# are saved anyway. This Function runs the gated activation and the down
# projection together, saves only (gate, up, W), and recomputes h in backward:
# the SwiGLU backward kernel, which reads gate and up for their gradients, writes
# h as well (2 B per element more; ~0.03 ms per layer at 4096 x 14336 on an H200).
#
# What it buys: 117 MB per layer at 2 x 2048 tokens of LLaMA-3.1-8B, 3.8 GB over
# the 32 layers, at the moment of peak memory (the end of forward). The matmuls
# are the same cuBLAS calls autograd would make, so the results are identical.
# Under torch.compile it is one opaque operator too: the compiler cannot
# recompute through an operator it does not see into, so we keep doing it.
def _down_proj_fake(gate, up, weight, dtype, activation="silu"):
    return gate.new_empty(gate.shape[:-1] + (weight.shape[0],), dtype=dtype)


@kernel_op("swiglu_down_proj_forward", fake=_down_proj_fake)
def swiglu_down_proj_forward(gate: torch.Tensor, up: Optional[torch.Tensor], weight: torch.Tensor,
                             dtype: torch.dtype, activation: str = "silu") -> torch.Tensor:
    """F.linear(act(gate) * up, weight) computed in ``dtype``; h dies inside.

    ``dtype`` is what F.linear would compute in at the call: autocast's dtype
    when autocast is on, else the inputs'. It is an argument because a compiled
    graph has no autocast state when it runs: the tracer resolved it already.
    """
    h = swiglu_forward(gate, up, activation)
    return F.linear(h.to(dtype), weight.to(dtype))


def _down_proj_backward_fake(dout, gate, up, weight, need_gate, need_up, need_w, activation="silu"):
    return _swiglu_backward_fake(dout, gate, up, need_gate, need_up) + (
        weight.new_empty(weight.shape) if need_w else nothing(weight),)


@kernel_op("swiglu_down_proj_backward", fake=_down_proj_backward_fake)
def swiglu_down_proj_backward(dout: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor],
                              weight: torch.Tensor, need_gate: bool, need_up: bool, need_w: bool,
                              activation: str = "silu",
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_gate, d_up, d_weight) of F.linear(act(gate) * up, weight); the matmuls run in dout's dtype."""
    dg, du, h = nothing(gate), nothing(gate if up is None else up), None
    if need_gate or need_up:
        dh = dout @ weight.to(dout.dtype)  # [..., I]
        # Optimization: the backward kernel reads gate and up anyway; it writes h for
        # dW too (2 B per element) instead of a forward launch that reads them again
        # (6 B). 8B, 2 x 2,048 tokens: SwiGLU 9.8 -> 8.0 ms per step (H200, NOTES.md).
        dg, du, h = swiglu_backward_and_hidden(dh, gate, up, need_gate, need_up, activation, store_h=need_w)
        del dh
    dw = nothing(weight)
    if need_w:
        if h is None:  # gate and up are frozen: the recomputation on its own, same kernel, same bits
            h = swiglu_forward(gate, up, activation)
        h = h.to(dout.dtype)
        dw = (dout.reshape(-1, dout.shape[-1]).t() @ h.reshape(-1, h.shape[-1])).to(weight.dtype)
    return dg, du, dw


def _down_proj_save(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    # Under torch.autocast, F.linear ran in the autocast dtype (weight cast to
    # bf16, say), but backward runs outside autocast: it redoes that cast
    # itself, as autograd would have through autocast's own cast op.
    ctx.compute_dtype = output.dtype
    ctx.activation = inputs[4] if len(inputs) > 4 else "silu"


def _down_proj_grads(ctx, dout):
    gate, up, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    dout = dout.to(ctx.compute_dtype)  # no-op without autocast
    grads = swiglu_down_proj_backward(dout, gate, up, weight, *needs, ctx.activation)
    return _wanted(grads, needs) + (None, None)


class TritonSwiGLUDownProjFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight, dtype, activation="silu"):
        out = swiglu_down_proj_forward(gate, up, weight, dtype, activation)
        _down_proj_save(ctx, (gate, up, weight, dtype, activation), out)
        return out

    @staticmethod
    @first_order_only("swiglu_down_proj")
    def backward(ctx, dout):
        return _down_proj_grads(ctx, dout)


swiglu_down_proj_forward.op.register_autograd(
    first_order_only("swiglu_down_proj")(_down_proj_grads), setup_context=_down_proj_save
)


def swiglu_down_proj(gate, up, weight, activation="silu"):
    """``F.linear(act(gate) * up, weight)`` that saves gate and up only (h is recomputed).

    ``activation``: "silu" (SwiGLU) or "gelu_tanh" (GeGLU); up None: gate holds [gate | up].
    """
    _check_inputs(gate, up, "swiglu_down_proj")
    n_cols = _hidden_size(gate, up)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != n_cols:
        raise ValueError(
            f"swiglu_down_proj: weight must be [H, {n_cols}], got "
            f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}"
        )
    _check_activation(activation, "swiglu_down_proj")
    # The dtype F.linear computes in: autocast's when it is on, else the inputs'.
    if torch.is_autocast_enabled(gate.device.type):
        dtype = torch.get_autocast_dtype(gate.device.type)
    else:
        dtype = torch.promote_types(_out_dtype(gate, up), weight.dtype)
    if torch.compiler.is_compiling():
        return swiglu_down_proj_forward.op(gate, up, weight, dtype, activation)
    return TritonSwiGLUDownProjFunction.apply(gate, up, weight, dtype, activation)


# --------------------------------------------------------------------------------
# The same under an FP8 down_proj: h^T cast in backward (Step 22)
# --------------------------------------------------------------------------------
# An FP8 down_proj (fp8_kernel.FP8Linear) casts h to e4m3 for its forward product and keeps
# the transposed copy h8^T for its weight gradient dW = dy^T h: 1 B per element from
# forward to backward, 56 MB per layer at 8B and 2 x 2,048 tokens, 1.75 GiB over the 32
# layers, all of it alive at FP8's peak (the start of backward). Per tensor, h's scale is
# one number fixed in forward (from the max |h| the forward kernel measured as it wrote h),
# so the SwiGLU backward kernel, which reads gate and up anyway, can write h8^T itself with
# that scale: the bytes the forward's cast would have kept, bit for bit. The forward's cast
# writes h8 only; the backward writes h8^T: the same traffic, the copy gone from the peak.
# Backward runs dh = dy W (dy cast to fp8 once, for this product and for dW), then the
# SwiGLU backward (d_gate, d_up and h8^T), then dW = dy8^T h8^T.
# Where: per tensor (per row, h^T's scales are per column of h, known only once all of h
# is), a plain FP8Linear (FP8Linear.runs_inside), gate and up of one dtype that need
# gradients, no autocast; elsewhere the layer is called on h as before.
FP8_DOWN_IN_BACKWARD = True  # False: the FP8 down_proj keeps h8^T from forward (A/B: NOTES.md Step 22)


class TritonSwiGLUFP8DownFunction(torch.autograd.Function):
    """down(act(gate) * up) for an FP8Linear ``down`` per tensor, h8^T cast in backward.
    apply(gate, up, weight, activation, grads, fast_accum); up None: gate holds [gate | up]."""

    @staticmethod
    def forward(ctx, gate, up, weight, activation, grads, fast_accum=False):
        slots = amax_slots(gate)
        h = _forward(gate, up, activation, None if slots is None else slots[0])
        h2 = h.view(-1, h.shape[-1])
        h_amax = slots[0] if slots is not None else fp8_kernel.tensor_maxima(h2)
        hq = fp8_kernel.quantize(h2, "tensorwise", align=16, amax=h_amax)  # h8 only, no h8^T
        wq = fp8_kernel._weight_fp8(weight, "tensorwise", transpose=True)
        y = fp8_kernel._forward_mm(hq, wq.data, wq.inv_scale, h.dtype)
        ctx.save_for_backward(gate, up, wq.data_t, wq.inv_scale_t, h_amax, hq.inv_scale)
        ctx.activation, ctx.grads, ctx.fast_accum, ctx.w_dtype = activation, grads, fast_accum, weight.dtype
        return y.view(*h.shape[:-1], weight.shape[0])

    @staticmethod
    @first_order_only("swiglu_fp8_down_proj")
    def backward(ctx, dy):
        gate, up, w_t, w_inv_t, h_amax, h_inv = ctx.saved_tensors
        w_t, w_inv_t = fp8_kernel._weight_t(w_t, w_inv_t, None)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dyq = fp8_kernel._output_grad_fp8(dy2, "tensorwise", ctx.grads, True)
        dh = fp8_kernel.scaled_mm(dyq.data, dyq.inv_scale, w_t, w_inv_t, dy.dtype, fast_accum=ctx.fast_accum)
        n_cols = w_t.shape[0]
        h8_t = torch.empty(n_cols, cdiv(dy2.shape[0], 16) * 16, dtype=fp8_kernel.FP8_DTYPE, device=dy.device)
        slots = amax_slots(dh, 2)  # the FP8 gate/up layers take their gradients' amax from here
        dg, du, _ = swiglu_backward_and_hidden(dh, gate, up, True, up is not None, ctx.activation, store_h=False,
                                               amax=slots, h8_t=(h8_t.view(torch.uint8), h_amax))
        del dh
        if slots is not None:
            for grad, row in zip((dg, du), slots):
                note_amax(grad, row)
        dw = fp8_kernel.scaled_mm(dyq.data_t, dyq.inv_scale_t, h8_t, h_inv, ctx.w_dtype, fast_accum=ctx.fast_accum)
        return dg, (du if up is not None else None), dw, None, None, None


def fp8_down_in_backward(down, gate=None):
    """Whether ``down`` is an FP8 down_proj whose h8^T may be cast in backward (above); with
    ``gate``, whether its call on this input may (FP8Linear.runs_inside: gradients on, no tracer)."""
    return (FP8_DOWN_IN_BACKWARD and isinstance(down, fp8_kernel.FP8Linear) and down.recipe == "tensorwise"
            and (down._plain() if gate is None else down.runs_inside(gate)))


def swiglu_fp8_down_proj(gate, up, down, activation="silu"):
    """``down(act(gate) * up)`` with h8^T cast in backward (above), or None where that does
    not apply (then the caller calls ``down`` on the activation itself)."""
    if (not fp8_down_in_backward(down, gate) or torch.is_autocast_enabled(gate.device.type)
            or not gate.requires_grad or (up is not None and (not up.requires_grad or up.dtype != gate.dtype))):
        return None
    _check_activation(activation, "swiglu_fp8_down_proj")
    _check_inputs(gate, up, FUNCTION_NAMES[activation])
    n_cols = _hidden_size(gate, up)
    if gate.dim() < 2 or down.weight.dim() != 2 or down.weight.shape[1] != n_cols:
        return None  # the layer's own call says what is wrong
    # h's shape, dtype and device, as a view of gate (h does not exist yet).
    fp8_kernel._check_linear(gate[..., :n_cols], down.weight, None, down.recipe, down.grads, down.emulate)
    return TritonSwiGLUFP8DownFunction.apply(gate, up, down.weight, activation, down.grads, down.fast_accum)


# --------------------------------------------------------------------------------
# The same under a LoRA down_proj: h recomputed for the adapter's gradient
# --------------------------------------------------------------------------------
# A LoRA down_proj (PEFT's layer, its products lora_kernel.py's) keeps its input h from
# forward to backward: the frozen base weight needs no dW, but the adapter's dA = g^T h
# (g = s dy B) does. That is the [tokens, I] tensor the recomputation above removes for
# full fine-tuning: 235 MB per layer at LLaMA-8B and 8,192 tokens, 7.0 GiB over the 32
# layers, alive at the peak (the end of forward). Here too the SwiGLU backward kernel,
# which reads gate and up anyway, writes h for dA (2 B per element more).
#   forward   h = act(gate) * up (dies inside); y = h W^T + b; xa = h A^T; y += s xa B^T
#   backward  g = s dy B; dh = dy W; dh += g A; (d_gate, d_up, h) from the SwiGLU backward;
#             dA = g^T h; dB = dy^T (s xa)
# The products are lora_kernel's own calls in the same order, so every gradient is the
# bits of the layer called on h (swiglu_test.py compares them). Where: the layer's one
# adapter would run lora_kernel's path on this call with no dropout (dropout's output,
# which the adapter reads, would be kept instead of h) over a plain bf16/fp16/float32 base
# layer (lora_kernel.plain_adapter), nothing hooked on the layers (swap_common.called_plainly),
# gate or up trained (else h alone is less to keep than both), eagerly (under torch.compile
# the layer's own call runs).
class TritonSwiGLULoRADownFunction(torch.autograd.Function):
    """down(act(gate) * up) for a LoRA down_proj, h recomputed in backward.
    apply(gate, up, weight, bias, lora_a, lora_b, scaling, dtype, activation)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, lora_a, lora_b, scaling, dtype, activation):
        with torch.autocast(gate.device.type, enabled=False):  # every cast explicit, as lora_kernel's
            h = swiglu_forward(gate, up, activation)
            h2 = h.to(dtype).reshape(-1, h.shape[-1])
            a, b = lora_a.to(dtype), lora_b.to(dtype)
            xa = torch.mm(h2, a.t())
            y, y2 = lora_kernel.base_product(h2, weight, bias, dtype, h.shape[:-1])
            y2.addmm_(xa, b.t(), alpha=scaling)  # lora_kernel's epilogue
        ctx.save_for_backward(gate, up, weight, a, b, xa if ctx.needs_input_grad[5] else None)
        ctx.scaling, ctx.dtype, ctx.activation, ctx.h_dtype = scaling, dtype, activation, h.dtype
        ctx.a_dtype, ctx.b_dtype = lora_a.dtype, lora_b.dtype
        return y

    @staticmethod
    @first_order_only("swiglu_lora_down_proj")
    def backward(ctx, dy):
        gate, up, weight, a, b, xa = ctx.saved_tensors
        need_gate, need_up, _, _, need_a, need_b = ctx.needs_input_grad[:6]
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1]).to(ctx.dtype)
            g, db = lora_kernel.adapter_output_grads(dy2, b, xa, ctx.scaling, need_b, ctx.b_dtype)
            # gate or up needs its gradient (swiglu_lora_down_proj's condition): dh always.
            dh = torch.mm(dy2, weight.to(ctx.dtype))
            dh.addmm_(g, a)
            dh = dh.view(*dy.shape[:-1], -1).to(ctx.h_dtype)
            dg, du, h = swiglu_backward_and_hidden(dh, gate, up, need_gate, need_up, ctx.activation,
                                                   store_h=need_a)
            dg, du = _wanted((dg, du), (need_gate, need_up))
            del dh
            da = torch.mm(g.t(), h.to(ctx.dtype).reshape(-1, h.shape[-1])).to(ctx.a_dtype) if need_a else None
        return dg, du, None, None, da, db, None, None, None


def swiglu_lora_down_proj(gate, up, down, activation="silu"):
    """``down(act(gate) * up)`` for a LoRA ``down`` with h recomputed in backward (above), or
    None where that does not apply (then the caller calls ``down`` on the activation)."""
    # Gate and up are kept for their own gradients anyway only when one of them needs one;
    # otherwise keeping h (one tensor) is cheaper than keeping both.
    trained = gate.requires_grad or (up is not None and up.requires_grad)
    if (not lora_kernel.lora_layer(down) or not torch.is_grad_enabled() or not trained
            or torch.compiler.is_compiling() or traced(gate) or (up is not None and up.dtype != gate.dtype)):
        return None
    adapter = lora_kernel.plain_adapter(down, gate)
    if adapter is None:
        return None
    weight, bias, lora_a, lora_b, scaling = adapter
    if not called_plainly(ours=(down,)):  # its base layer and adapters: plain_adapter asked already
        return None
    if gate.dim() < 2 or weight.dim() != 2 or weight.shape[1] != _hidden_size(gate, up):
        return None  # the layer's own call says what is wrong
    _check_activation(activation, "swiglu_lora_down_proj")
    _check_inputs(gate, up, FUNCTION_NAMES[activation])
    dtype = lora_kernel.compute_dtype(gate, (weight, bias))
    return TritonSwiGLULoRADownFunction.apply(gate, up, weight, bias, lora_a, lora_b, scaling, dtype, activation)


# --------------------------------------------------------------------------------
# Drop-in modules and model patching
# --------------------------------------------------------------------------------
# HF's names of the activations we implement (config.hidden_act, or Gemma 2/3's
# config.hidden_activation) -> the kernels' name.
CONFIG_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def module_activation(mlp):
    """The kernels' name ("silu" or "gelu_tanh") for the activation module of a gated
    MLP (``act_fn``, Phi-3's ``activation_fn``) when it is exactly one we implement, else None."""
    act = getattr(mlp, "act_fn", None)
    if act is None:
        act = getattr(mlp, "activation_fn", None)
    # nn.SiLU (ACT2FN["swish"]) or HF's own SiLUActivation (ACT2FN["silu"]).
    if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else None  # "none" is the erf GELU
    # HF's GELUTanh (alias PytorchGELUTanh, ACT2FN["gelu_pytorch_tanh"]) calls
    # F.gelu(approximate="tanh"), unless built with use_gelu_tanh_python: then a
    # formula of five ops, each rounded to bf16, which is not what we compute.
    # gelu_new and gelu_fast are such formulas too, and "gelu" is the erf GELU.
    if type(act).__name__ in ("GELUTanh", "PytorchGELUTanh"):
        fn = getattr(act, "act", None)  # older versions: no attribute, forward is F.gelu(approximate="tanh")
        if fn is None or (isinstance(fn, functools.partial) and fn.func is F.gelu
                          and not fn.args and fn.keywords == {"approximate": "tanh"}):
            return "gelu_tanh"
    return None


class TritonLlamaMLP(nn.Module):
    """Drop-in replacement for HF's gated MLPs with gate_proj, up_proj and down_proj
    (``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``, ``GemmaMLP``, ...): the same
    projections, the fused SwiGLU or GeGLU between them.

    The three projections stay ``nn.Linear`` (cuBLAS); only ``act(gate) * up``
    runs in Triton. ``activation`` is "silu" or "gelu_tanh". Parameter names
    match the HF module's, so state dicts load either way.
    """

    def __init__(self, config):
        super().__init__()
        name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if name not in CONFIG_ACTIVATIONS:
            raise ValueError(f"{type(self).__name__} implements SiLU and tanh-GELU gating only "
                             f"(hidden_act 'silu' or 'gelu_pytorch_tanh'), the config has {name!r}")
        self.activation = CONFIG_ACTIVATIONS[name]
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self._make_projections(getattr(config, "mlp_bias", False))

    def _make_projections(self, bias):
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)

    @classmethod
    def from_mlp(cls, mlp):
        """Wrap an existing gated MLP, reusing its projection modules (same Parameters).

        Sharing the modules keeps optimizer state, LoRA adapters or quantized
        layers attached to the projections working after the swap.
        """
        activation = module_activation(mlp)
        if activation is None:
            raise ValueError(f"{cls.__name__}: the activation of {type(mlp).__name__} is neither SiLU nor "
                             "GELU with the tanh approximation")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        if hasattr(mlp, "config"):
            new.config = mlp.config
        new.activation = activation
        new._take_projections(mlp)
        return new

    from_llama_mlp = from_mlp  # the older name

    def _take_projections(self, mlp):
        self.hidden_size = getattr(mlp, "hidden_size", getattr(mlp.gate_proj, "in_features", None))
        self.intermediate_size = getattr(mlp, "intermediate_size", getattr(mlp.gate_proj, "out_features", None))
        self.gate_proj = mlp.gate_proj
        self.up_proj = mlp.up_proj
        self.down_proj = mlp.down_proj

    # Recompute h = act(gate) * up in backward instead of keeping it: for a plain
    # bias-free nn.Linear down_proj (TritonSwiGLUDownProjFunction), a per-tensor FP8
    # one (TritonSwiGLUFP8DownFunction) and a LoRA one without dropout
    # (TritonSwiGLULoRADownFunction). Any other wrapper (QLoRA's 4-bit layers, a
    # LoRA variant) is called on h, and keeps it as it would.
    recompute_hidden = True

    def recomputes_hidden(self):
        """True when forward runs swiglu_down_proj (h recomputed in backward)."""
        down = self.down_proj
        return self.recompute_hidden and type(down) is nn.Linear and down.bias is None and called_plainly(down)

    def casts_fp8_hidden_in_backward(self):
        """True when a training forward runs swiglu_fp8_down_proj (h8^T cast in backward)."""
        return self.recompute_hidden and fp8_down_in_backward(self.down_proj)

    # FP8 gate_proj and up_proj (fp8_kernel.FP8Linear, Step 22) may run as one product whose
    # output [gate | up] is the fused layout below (TritonGateUpMLP), read in place.
    stack_projections = True

    def _gate_and_up(self, x):
        """(gate, up), or ([gate | up], None) where the two layers stack into one product."""
        # Looked up on the class: PEFT's LoRA layer forwards unknown attributes to its base layer, whose
        # method would multiply without the adapter.
        stacked = getattr(type(self.gate_proj), "stacked_with", None) if self.stack_projections else None
        gate_up = stacked(self.gate_proj, x, self.up_proj) if stacked is not None else None
        return (gate_up, None) if gate_up is not None else (self.gate_proj(x), self.up_proj(x))

    def forward(self, x):
        gate, up = self._gate_and_up(x)
        return self._down(gate, up)

    def _down(self, gate, up):
        """down_proj(act(gate) * up), h recomputed in backward where the layer allows it."""
        if self.recomputes_hidden():
            return swiglu_down_proj(gate, up, self.down_proj.weight, self.activation)
        y = None
        if self.recompute_hidden:
            y = swiglu_fp8_down_proj(gate, up, self.down_proj, self.activation)
            if y is None:
                y = swiglu_lora_down_proj(gate, up, self.down_proj, self.activation)
        return y if y is not None else self.down_proj(gated_activation(gate, up, self.activation))

    def extra_repr(self):
        act = {"silu": "SwiGLU", "gelu_tanh": "GeGLU (tanh)"}[self.activation]
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, act=fused {act}, "
                f"recompute_hidden={self.recompute_hidden}")


class TritonGateUpMLP(TritonLlamaMLP):
    """The fused layout (HF ``Phi3MLP``, ``GlmMLP``): one ``gate_up_proj`` Linear
    of 2I outputs, [gate | up] on the last dimension, then ``down_proj``.

    The kernels read gate and up in place as the two halves of gate_up_proj's
    output and write their gradients into the halves of one [..., 2I] tensor
    (see swiglu). Parameter names match Phi3MLP's.
    """

    def _make_projections(self, bias):
        self.gate_up_proj = nn.Linear(self.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)

    def _take_projections(self, mlp):
        config = getattr(mlp, "config", None)
        self.hidden_size = getattr(mlp.gate_up_proj, "in_features", getattr(config, "hidden_size", None))
        self.intermediate_size = getattr(mlp.down_proj, "in_features", getattr(config, "intermediate_size", None))
        self.gate_up_proj = mlp.gate_up_proj
        self.down_proj = mlp.down_proj

    def forward(self, x):
        return self._down(self.gate_up_proj(x), None)  # [..., 2I]: gate | up, never split into copies


def triton_mlp_class(module):
    """TritonLlamaMLP or TritonGateUpMLP for a gated MLP we can stand in for, else None.

    Found by type name (``*MLP``), projection modules (nn.Linear, a LoRA or
    quantized wrapper: ours just calls them) and an activation we implement; a
    gated MLP with the erf GELU or any other activation is left alone.
    """
    if not type(module).__name__.endswith("MLP") or isinstance(module, TritonLlamaMLP):
        return None
    if module_activation(module) is None:
        return None

    def has(*names):
        return all(isinstance(getattr(module, name, None), nn.Module) for name in names)
    if has("gate_proj", "up_proj", "down_proj"):
        return TritonLlamaMLP
    if has("gate_up_proj", "down_proj"):
        return TritonGateUpMLP
    return None


# --------------------------------------------------------------------------------
# The check before the swap: does our module compute what the model's does?
# --------------------------------------------------------------------------------
# Names and attributes do not prove the math: a family may clamp the gate, keep
# only its top-k entries (Gemma-3n), order the fused halves [up | gate], or scale
# the output, with the same attribute names. So before swapping, each MLP class
# is run next to its replacement on the same random input, and the swap is
# refused when they differ by more than rounding.
#
# How much rounding: in bf16/fp16 both round h = act(gate) * up to the same
# 16-bit values (bar a rare last-bit flip) and down_proj is the same matmul, so
# the outputs differ by about one rounding of the output dtype at most: eps x
# the largest output. In float32 the activation itself is evaluated with different
# float32 exp or tanh code on either side (each a few ulp from the truth), and
# down_proj sums I such differences with random signs: measured up to 3 float32
# ulps at the size of the largest output (LLaMA and Gemma MLPs, 64 x 128 to
# 3072 x 24576, CPU). So the tolerance is one rounding of the output dtype, and
# never below 8 float32 ulps. A change in the math (another activation, a clamp,
# a scale) moves the output by percents. GELU's erf and tanh forms differ by up
# to 5e-4 (1e-4 relative for small gates): hundreds of float32 ulps, but less
# than one bf16 rounding, so in bf16 only module_activation tells them apart.
CHECK_ROWS = 4
MIN_TOLERANCE = 8 * torch.finfo(torch.float32).eps


def rounding_excess(ours, theirs):
    """None when ``ours`` is ``theirs`` to one rounding of the output dtype at the size
    of the largest element (at least 8 float32 ulps, above); else the max difference
    (NaN never passes)."""
    difference = (ours.double() - theirs.double()).abs().max().item()
    tolerance = max(torch.finfo(ours.dtype).eps, MIN_TOLERANCE) * theirs.double().abs().max().item()
    return None if difference <= tolerance else difference


def _reference_output(mlp, x):
    """What ``mlp`` (ours) computes, with PyTorch's formula in place of the kernel
    (for a device the kernels cannot run on, as CPU tensors on a GPU machine: the
    module is swapped there and moved to the GPU afterwards)."""
    if isinstance(mlp, TritonGateUpMLP):
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    else:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    return mlp.down_proj(REFERENCES[mlp.activation](gate, up))


def check_same_mlp(original, new):
    """Raise SwapMismatch unless ``new`` computes what ``original`` does.

    Both run on CHECK_ROWS random rows of the hidden size, in the module's
    dtype and on its device, under no_grad, each from the same random-number
    state (a dropout inside a shared projection, as LoRA's, draws the same mask
    for both; the global state is left as it was). Allowed difference: one
    rounding of the output dtype at the size of the largest output element,
    at least 8 float32 ulps (above).
    Modules on the meta device (no data) are not checked.
    """
    params = list(original.parameters())
    if any(p.is_meta for p in params):
        return
    floats = [p for p in params if p.is_floating_point()]
    dtype = floats[0].dtype if floats else torch.get_default_dtype()  # none: a quantized layer
    device = params[0].device if params else torch.device("cpu")
    theirs_name, ours_name = type(original).__name__, type(new).__name__
    if not isinstance(new.hidden_size, int):
        raise SwapMismatch(f"{theirs_name} cannot be checked against {ours_name}: its hidden size is unknown")
    x = torch.randn(CHECK_ROWS, new.hidden_size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    rng_devices = [device] if device.type == "cuda" else []
    with torch.no_grad():
        try:
            with torch.random.fork_rng(devices=rng_devices):
                theirs = original(x)
        except Exception as e:  # noqa: BLE001 - any failure: not a module we can stand in for
            first_line = str(e).splitlines()[0] if str(e) else ""
            raise SwapMismatch(f"{theirs_name} cannot be checked against {ours_name}: its forward failed on a "
                               f"[{CHECK_ROWS}, {new.hidden_size}] input ({type(e).__name__}: {first_line})") from None
        with torch.random.fork_rng(devices=rng_devices):
            kernels_run_here = device.type == "cuda" or (device.type == "cpu" and INTERPRET)
            # The kernels against the model's own layers: FP8 gate and up one by one, as it calls them.
            new.stack_projections = False
            try:
                ours = new(x) if kernels_run_here else _reference_output(new, x)
            finally:
                del new.stack_projections
    if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape or theirs.dtype != ours.dtype:
        what = (f"{tuple(theirs.shape)} {theirs.dtype}" if isinstance(theirs, torch.Tensor)
                else type(theirs).__name__)
        raise SwapMismatch(f"{theirs_name} returns {what}, {ours_name} {tuple(ours.shape)} {ours.dtype}")
    difference = rounding_excess(ours, theirs)
    if difference is not None:
        raise SwapMismatch(f"{theirs_name} computes something else than {ours_name} "
                           f"(max difference {difference:.2g} on a random input)")


def replace_swiglu(model):
    """Replace every SiLU- or tanh-GELU-gated MLP in ``model`` with ours; return the count.

    MLPs with gate_proj/up_proj/down_proj become ``TritonLlamaMLP``, Phi-3's
    gate_up_proj/down_proj ``TritonGateUpMLP`` (see triton_mlp_class for how they
    are found). Each MLP class is first checked against its replacement
    (check_same_mlp): one that computes something else raises SwapMismatch and
    the model is left unchanged. swap_common.swap_modules does the swapping.
    The experts of MoE layers keep their module, with the kernel as its gate
    (fuse_expert_gates); each counts as one.
    """
    experts = checked_expert_gates(model)  # all checks before any change
    count = swap_modules(model, lambda m: triton_mlp_class(m) is not None,
                         lambda m: triton_mlp_class(m).from_mlp(m), check=check_same_mlp)
    return count + fuse_expert_gates(experts)


# --------------------------------------------------------------------------------
# Mixture-of-experts layers (Mixtral, Qwen3-MoE, ... in transformers 5)
# --------------------------------------------------------------------------------
# The experts of an MoE layer are one module with 3-D weights: gate_up_proj
# [E, 2I, H] (each expert's gate and up rows, concatenated) and down_proj [E, H, I].
# Its forward gathers the tokens routed to each expert, multiplies them by that
# expert's slice of gate_up_proj (transformers' grouped or batched matrix products,
# its default "experts implementation"), and calls ``self._apply_gate`` on the
# [S, 2I] result: act(gate) * up, the gated activation of a dense MLP, over all
# routed tokens at once. So the fused kernel goes in there, reading the two halves
# in place (the fused gate_up layout, swiglu_kernel.py), and the products stay
# transformers'.
# transformers' "eager" experts implementation writes act(gate) * up inline instead
# of calling _apply_gate: with it nothing could be fused, and the swap is refused.
def experts_activation(experts):
    """The kernels' activation of a transformers experts module whose gate can be
    fused ("silu" or "gelu_tanh"), or None for any other module."""
    if not (hasattr(experts, "_apply_gate") and getattr(experts, "has_gate", False)
            and getattr(experts, "is_concatenated", False)):
        return None
    gate_up = getattr(experts, "gate_up_proj", None)
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 3:
        return None
    return module_activation(experts)


def _fused_expert_gate(experts, gate_up_out):
    """``_apply_gate`` of a patched experts module: act(gate) * up of [S, 2I], fused."""
    return gated_activation(gate_up_out, None, experts.fused_activation)


def check_same_expert_gate(experts, activation):
    """Raise SwapMismatch unless the fused gate computes the module's own _apply_gate
    (a family may clamp or reorder the halves under the same names), on random rows
    of [CHECK_ROWS, 2I] in the module's dtype, to check_same_mlp's tolerance; and
    unless the module's forward calls _apply_gate at all."""
    name = type(experts).__name__
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if implementation in (None, "eager"):
        raise SwapMismatch(f"{name} runs transformers' eager experts implementation, which computes act(gate) * up "
                           f"inline; load the model with experts_implementation='grouped_mm' (the default)")
    weight = experts.gate_up_proj
    if weight.is_meta:
        return
    x = torch.randn(CHECK_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device,
                                                                                             weight.dtype)
    with torch.no_grad():
        theirs = type(experts)._apply_gate(experts, x)
        kernels_run_here = x.device.type == "cuda" or (x.device.type == "cpu" and INTERPRET)
        gate, up = x.chunk(2, dim=-1)
        ours = gated_activation(x, None, activation) if kernels_run_here else REFERENCES[activation](gate, up)
    if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
        raise SwapMismatch(f"{name}._apply_gate does not return act(gate) * up of its [S, 2I] input")
    difference = rounding_excess(ours, theirs)
    if difference is not None:
        raise SwapMismatch(f"{name}._apply_gate computes something else than the fused gate "
                           f"(max difference {difference:.2g} on a random input)")


def checked_expert_gates(model):
    """[(experts module, activation)] of ``model``, each checked (check_same_expert_gate)."""
    found = [(m, experts_activation(m)) for m in model.modules() if experts_activation(m) is not None]
    for experts, activation in found:
        check_same_expert_gate(experts, activation)
    return found


def fuse_expert_gates(found):
    """Fuse the gated activation of each checked experts module (checked_expert_gates):
    it keeps its weights and forward, its ``_apply_gate`` becomes the kernel."""
    for experts, activation in found:
        experts.fused_activation = activation
        experts._apply_gate = InstanceForward(_fused_expert_gate, experts)
    return len(found)
