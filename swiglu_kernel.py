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
projection and the experts of MoE layers (sections below; the modules that put
them into a model are in swiglu_mlp.py).

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
``replace_swiglu`` (swiglu_mlp.py) finds gated MLPs by shape: a ``*MLP``
module with the projections of one layout and an activation we implement
(``module_activation`` knows SiLU and the tanh GELU, exactly; the erf GELU and
the hand-written tanh formulas round differently and are left alone). Shape proves nothing about the
math, so before the swap each MLP class runs next to its replacement on a
random input (``check_same_mlp``); a class that computes something else (a
clamped gate, a top-k sparse gate, a scaled output) raises
``kernel_common.SwapMismatch`` and the model is left as it was.

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

from typing import Optional

import torch
import torch.nn.functional as F

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import (
    SUPPORTED_DTYPES,
    as_rows,
    cast_to,
    cdiv,
    check_kernel_device,
    exp,
    fast_launch,
    first_order_only,
    kernel_op,
    names_defined_in,
    next_power_of_2,
    nothing,
)

import triton
import triton.language as tl


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


# --------------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _swiglu_fwd_kernel(
    G,  # [n_rows, n_cols] gate_proj output; rows stride_g elements apart, columns contiguous
    U,  # [n_rows, n_cols] up_proj output; rows stride_u apart (may differ from G's)
    Y,  # [n_rows, n_cols] output, contiguous (row stride n_cols), promoted dtype
    stride_g,
    stride_u,
    n_rows,
    n_cols,
    BLOCK_N: tl.constexpr,  # columns per tile (power of two)
    ROWS: tl.constexpr,  # rows per tile (> 1 only for short rows)
    ACT: tl.constexpr,  # the gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    PRECISE: tl.constexpr,  # float32 input: accurate exp and division
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
    y = a * u
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], cast_to(y, Y.dtype.element_ty), mask=mask)


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
@triton.jit
def _swiglu_bwd_kernel(
    DY,  # [n_rows, n_cols] upstream gradient, dtype of y; rows stride_dy apart, columns contiguous
    G,  # [n_rows, n_cols] saved gate; rows stride_g apart
    U,  # [n_rows, n_cols] saved up; rows stride_u apart
    DG,  # [n_rows, n_cols] output d_gate, gate's dtype; rows stride_dg apart
    DU,  # [n_rows, n_cols] output d_up, up's dtype; rows stride_du apart
    H,  # [n_rows, n_cols] output h = act(gate) * up as forward wrote it, contiguous (STORE_H only)
    stride_dy,
    stride_g,
    stride_u,
    stride_dg,
    stride_du,
    n_rows,
    n_cols,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    COMPUTE_DG: tl.constexpr,  # False when gate does not require grad: no read of u, no store
    COMPUTE_DU: tl.constexpr,  # False when up does not require grad: no store
    STORE_H: tl.constexpr,  # also write forward's output h (for down_proj's weight gradient)
    ACT: tl.constexpr,
    PRECISE: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_N, ROWS)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s, s_c, a = _sigmoid_and_act(g, ACT, PRECISE)  # s_c = 1 - s
    a_rounded = cast_to(a, G.dtype.element_ty).to(tl.float32)  # as forward rounded it
    if COMPUTE_DG or STORE_H:
        u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    if COMPUTE_DU:
        tl.store(DU + rows[:, None] * stride_du + cols[None, :], cast_to(dy * a_rounded, DU.dtype.element_ty),
                 mask=mask)

    if STORE_H:
        # The forward kernel's h, bit for bit (same a, same rounding), from the g and u
        # this program has loaded anyway: 2 B per element written here instead of a
        # separate forward launch that reads g and u again (6 B). See swiglu_mlp.py.
        tl.store(H + rows[:, None] * n_cols + cols[None, :], cast_to(a_rounded * u, H.dtype.element_ty), mask=mask)

    if COMPUTE_DG:
        if ACT == "gelu_tanh":
            dz = (1.0 + (g * g) * (3.0 * GELU_K)) * GELU_C * 2.0
            dg = dy * u * s * (1.0 + g * s_c * dz)
        else:
            dg = dy * u * s * (1.0 + g * s_c)
        tl.store(DG + rows[:, None] * stride_dg + cols[None, :], cast_to(dg, DG.dtype.element_ty), mask=mask)


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
    return gate.shape if up is not None else gate.shape[:-1] + (gate.shape[-1] // 2,)


def _out_dtype(gate, up):
    return gate.dtype if up is None else torch.promote_types(gate.dtype, up.dtype)


def _swiglu_forward_fake(gate, up, activation="silu"):
    return gate.new_empty(_out_shape(gate, up), dtype=_out_dtype(gate, up))


@kernel_op("swiglu_forward", fake=_swiglu_forward_fake)
def swiglu_forward(gate: torch.Tensor, up: Optional[torch.Tensor], activation: str = "silu") -> torch.Tensor:
    """Launch the forward kernel. Returns y = act(gate) * up, act = ``activation``
    ("silu" or "gelu_tanh"), with up's shape (up None: gate holds [gate | up])."""
    # Row-strided views (a slice of a wider tensor) pass through untouched. Only a
    # non-contiguous last dimension (a transposed tensor), or leading dimensions
    # that cannot be merged into one row stride, cost a copy.
    g2, u2, n_cols = _rows(gate, up)
    n_rows = g2.shape[0]
    y = torch.empty((n_rows, n_cols), dtype=_out_dtype(gate, up), device=gate.device)
    if n_rows > 0:
        block_n, rows, num_warps = _launch_config(n_cols)
        _swiglu_fwd_kernel[_grid(n_rows, n_cols, block_n, rows)](
            g2, u2, y, g2.stride(0), u2.stride(0), n_rows, n_cols,
            BLOCK_N=block_n, ROWS=rows, ACT=activation, PRECISE=gate.dtype == torch.float32,
            num_warps=num_warps,
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


def swiglu_backward_and_hidden(dy, gate, up, compute_dgate, compute_dup, activation="silu", store_h=True):
    """swiglu_backward's (d_gate, d_up), and with ``store_h`` also forward's output h
    (swiglu_forward's bits) from the same pass, else None. A plain launcher: callers
    inside an operator (swiglu_mlp.swiglu_down_proj_backward) use it."""
    g2, u2, n_cols = _rows(gate, up)
    dy2 = as_rows(dy, n_cols)
    n_rows = g2.shape[0]
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
    if n_rows > 0 and (compute_dgate or compute_dup or store_h):
        block_n, rows, num_warps = _launch_config(n_cols)
        # A switched-off output is never written: any tensor stands in for its pointer.
        dg_arg = next(t for t in (dg, du, h) if t is not None)
        du_arg = du if compute_dup else dg_arg
        _swiglu_bwd_kernel[_grid(n_rows, n_cols, block_n, rows)](
            dy2, g2, u2, dg_arg, du_arg, h if store_h else dg_arg,
            dy2.stride(0), g2.stride(0), u2.stride(0), dg_arg.stride(0), du_arg.stride(0), n_rows, n_cols,
            BLOCK_N=block_n, ROWS=rows, COMPUTE_DG=compute_dgate, COMPUTE_DU=compute_dup, STORE_H=store_h,
            ACT=activation, PRECISE=gate.dtype == torch.float32,
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
    return _wanted(swiglu_backward(dy, gate, up, *needs, ctx.activation), needs) + (None,)


class TritonSwiGLUFunction(torch.autograd.Function):
    """act(gate) * up for both activations (the name is the family's: GLU variants).

    apply(gate, up, activation="silu"); up None: gate holds [gate | up].
    """
    # The classic form (forward with ctx): in eager mode it costs less host time
    # per call than forward + setup_context; the operator registers the same pieces.
    @staticmethod
    def forward(ctx, gate, up, activation="silu"):
        y = swiglu_forward(gate, up, activation)
        _swiglu_save(ctx, (gate, up, activation), y)
        return y

    @staticmethod
    @first_order_only("swiglu/geglu")
    def backward(ctx, dy):
        return _swiglu_grads(ctx, dy)


swiglu_forward.op.register_autograd(first_order_only("swiglu/geglu")(_swiglu_grads), setup_context=_swiglu_save)

# The public name of each activation's function, for error messages.
FUNCTION_NAMES = {"silu": "swiglu", "gelu_tanh": "geglu"}


def gated_activation(gate, up, activation):
    """``act(gate) * up`` for ``activation`` in "silu" (swiglu) and "gelu_tanh" (geglu)."""
    if activation not in FUNCTION_NAMES:
        raise ValueError(f"gated_activation: activation must be one of {sorted(FUNCTION_NAMES)}, got {activation!r}")
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
# The modules and model patching: swiglu_mlp.py
# --------------------------------------------------------------------------------
# The MLP-level code (swiglu_down_proj, TritonLlamaMLP, TritonGateUpMLP, the check
# before the swap, replace_swiglu, the MoE experts' gate) lives in swiglu_mlp.py,
# which imports this file. Its public names are found there on first use, so
# ``from swiglu_kernel import TritonLlamaMLP, replace_swiglu`` works in either
# import order.
__getattr__ = names_defined_in("swiglu_mlp", (
    "CHECK_ROWS", "CONFIG_ACTIVATIONS", "MIN_TOLERANCE", "TritonGateUpMLP", "TritonLlamaMLP",
    "TritonSwiGLUDownProjFunction", "check_same_expert_gate", "check_same_mlp", "checked_expert_gates",
    "experts_activation", "fuse_expert_gates", "module_activation", "replace_swiglu", "rounding_excess",
    "swiglu_down_proj", "swiglu_down_proj_backward", "swiglu_down_proj_forward", "triton_mlp_class",
), __name__)
