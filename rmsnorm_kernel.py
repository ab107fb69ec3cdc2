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

import functools

import torch
import torch.nn as nn

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import (
    SUPPORTED_DTYPES,
    as_rows,
    cast_to,
    cdiv,
    check_kernel_device,
    fast_launch,
    first_order_only,
    kernel_op,
    next_power_of_2,
    nothing,
    num_sms,
    swap_modules,
)

import triton
import triton.language as tl

# The largest hidden size one program handles with the whole row in registers.
# LLaMA models use 2,048 - 16,384; beyond this limit we refuse clearly instead of
# spilling registers into slow local memory.
MAX_HIDDEN_SIZE = 65536


# --------------------------------------------------------------------------------
# The reference: Hugging Face's LlamaRMSNorm formula in plain PyTorch ops.
# Tests compare against it (and against its float64 version), the benchmark times
# it as "PyTorch eager" and compiles it for the torch.compile peer.
# --------------------------------------------------------------------------------
def rmsnorm_reference(x, weight, eps=1e-6, compute_dtype=torch.float32):
    """HF ``LlamaRMSNorm.forward``; ``compute_dtype=torch.float64`` gives the truth."""
    input_dtype = x.dtype
    h = x.to(compute_dtype)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if compute_dtype == torch.float64:
        return weight.to(torch.float64) * h
    return weight * h.to(input_dtype)


# --------------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _rmsnorm_fwd_kernel(
    X,  # [n_rows, n_cols] input; rows are stride_x elements apart, columns contiguous
    W,  # [n_cols] weight
    Y,  # [n_rows, n_cols] output, contiguous (row stride n_cols)
    RSTD,  # [n_rows] float32 output: 1 / rms of each row, the only thing backward needs
    stride_x,
    n_rows,
    n_cols,
    eps,
    BLOCK_N: tl.constexpr,  # power of two >= n_cols: one row fits in one block
    ROWS: tl.constexpr,  # rows per program (> 1 only for short rows)
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
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)

    # mean(x^2) over the real columns: masked entries were loaded as 0 and add
    # nothing, so we divide by n_cols, not BLOCK_N.
    mean_sq = tl.sum(x * x, axis=1) / n_cols
    # IEEE-rounded sqrt and division (sqrt_rn, div_rn) instead of the fast
    # approximate ones: once per row, so free, and float32 outputs stay within
    # PyTorch's own error (the approximate pair costs up to ~3 ulp).
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))

    # HF semantics: round the normalized value to the input dtype, then multiply
    # by the weight. The product is computed in float32 and rounded once when it
    # is stored, exactly what PyTorch's bf16 * bf16 multiply does.
    x_hat = cast_to(x * rstd[:, None], X.dtype.element_ty).to(tl.float32)
    y = x_hat * w[None, :]
    tl.store(Y + rows64[:, None] * n_cols + cols[None, :], cast_to(y, Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows64, rstd, mask=row_mask)


# --------------------------------------------------------------------------------
# Backward kernel
# --------------------------------------------------------------------------------
# Derivation (one row, float32, ignoring the rounding of x_hat to the input dtype,
# which has no derivative):
#
#   r     = rstd = (mean(x^2) + eps)^(-1/2)
#   x_hat = x * r,     y = w * x_hat
#   g     = dy * w                              (gradient reaching x_hat)
#   dr/dx_j = -r^3 * x_j / H
#   dx_i  = g_i * r + sum_j g_j * x_j * dr/dx_i
#         = r * (g_i - x_hat_i * mean_j(g_j * x_hat_j))
#   dw    = sum over rows of dy * x_hat
#
# So backward needs x, dy, w and the saved rstd: no float32 copy of x_hat is kept
# between forward and backward.
@fast_launch
@triton.jit
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
):
    # A *persistent* grid: a fixed number of programs (a few per SM) each walk over
    # many row blocks, pid, pid + num_programs, ... Keeping the program alive lets
    # it accumulate its part of dw in registers across all its rows, so dw costs
    # one small [num_programs, H] write instead of a [rows, H] float32 buffer.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
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
        tl.store(DX + rows64[:, None] * n_cols + cols[None, :], cast_to(dx, DX.dtype.element_ty), mask=mask)

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


def _check_inputs(x, weight, eps):
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
    check_kernel_device(x, weight)


def _rmsnorm_forward_fake(x, weight, eps):
    n_rows = x.numel() // x.shape[-1]
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty((n_rows,), dtype=torch.float32))


@kernel_op("rmsnorm_forward", fake=_rmsnorm_forward_fake)
def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Returns (y, rstd); y has x's shape."""
    n_cols = x.shape[-1]
    x2 = as_rows(x, n_cols)
    # The kernels index the weight as a contiguous [H] vector. A view such as
    # big[:, 0] or an expand()ed scalar is not one; copying [H] values costs
    # nothing next to [rows, H], and is a no-op for the usual Parameter.
    weight = weight.contiguous()
    n_rows = x2.shape[0]
    # HF: weight * h.to(input_dtype) follows PyTorch type promotion.
    out_dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(x.dtype, weight.dtype)
    # y is contiguous in x's shape, i.e. rows n_cols apart, as the kernel writes it.
    # (empty_like costs a third of the host time of torch.empty(shape, ...).)
    y = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    rstd = x2.new_empty(n_rows, dtype=torch.float32)
    if n_rows > 0:
        block_n, rows, num_warps = _launch_config(n_cols)
        _rmsnorm_fwd_kernel[(cdiv(n_rows, rows),)](
            x2, weight, y, rstd, x2.stride(0), n_rows, n_cols, eps,
            BLOCK_N=block_n, ROWS=rows, num_warps=num_warps,
        )
    return y, rstd


def _rmsnorm_backward_fake(dy, x, weight, rstd, compute_dw):
    return x.new_empty(x.shape), (weight.new_empty(weight.shape[0]) if compute_dw else nothing(weight))


@kernel_op("rmsnorm_backward", fake=_rmsnorm_backward_fake)
def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                     compute_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernels. Returns (dx, dw); dw is empty if not asked for."""
    n_cols = x.shape[-1]
    x2 = as_rows(x, n_cols)
    dy2 = as_rows(dy, n_cols)
    weight = weight.contiguous()
    n_rows = x2.shape[0]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)  # rows n_cols apart
    block_n, rows, num_warps = _launch_config(n_cols)
    n_blocks = cdiv(n_rows, rows)
    n_programs = max(1, min(n_blocks, num_sms(x.device) * BWD_PROGRAMS_PER_SM))
    if compute_dw:
        dw_partial = x2.new_empty((n_programs, n_cols), dtype=torch.float32)
        dw = torch.empty_like(weight)
    else:
        dw_partial = dx  # never written: COMPUTE_DW=False removes the store
        dw = nothing(weight)
    if n_rows > 0:
        _rmsnorm_bwd_kernel[(n_programs,)](
            dy2, x2, weight, rstd, dx, dw_partial,
            dy2.stride(0), x2.stride(0), n_rows, n_cols, n_programs, cdiv(n_blocks, n_programs),
            BLOCK_N=block_n, ROWS=rows, COMPUTE_DW=compute_dw,
            num_warps=num_warps,
        )
    if compute_dw:
        if n_rows == 0:
            dw.zero_()
        else:
            block_c = 256
            _rmsnorm_dw_reduce_kernel[(cdiv(n_cols, block_c),)](
                dw_partial, dw, n_programs, n_cols, BLOCK_P=32, BLOCK_C=block_c,
                num_warps=4,
            )
    return dx, dw


# --------------------------------------------------------------------------------
# Autograd function: connects the kernels to PyTorch's automatic differentiation
# --------------------------------------------------------------------------------
def _save_for_backward(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    # Save the inputs (already alive in the autograd graph) and 4 bytes per row.
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, dy, *_):
    x, weight, rstd = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[1]
    dx, dw = rmsnorm_backward(dy, x, weight, rstd, need_dw)
    return dx, (dw if need_dw else None), None


class TritonRMSNormFunction(torch.autograd.Function):
    # The classic form (forward with ctx, one output): in eager mode it costs less
    # host time per call than forward + setup_context with rstd as an output.
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rmsnorm_forward(x, weight, eps)
        _save_for_backward(ctx, (x, weight, eps), (y, rstd))
        return y

    @staticmethod
    @first_order_only("rmsnorm")
    def backward(ctx, dy):
        return _backward(ctx, dy)


# The same formula on the operator: torch.ops.llama_kernels.rmsnorm_forward is
# differentiable, and torch.compile differentiates it without tracing our Python.
rmsnorm_forward.op.register_autograd(first_order_only("rmsnorm")(_backward), setup_context=_save_for_backward)


def rmsnorm(x, weight, eps=1e-6):
    """Fused RMSNorm with HF ``LlamaRMSNorm`` semantics; differentiable in x and weight."""
    _check_inputs(x, weight, eps)
    if torch.compiler.is_compiling():
        return rmsnorm_forward.op(x, weight, float(eps))[0]  # one node of the compiled graph
    return TritonRMSNormFunction.apply(x, weight, float(eps))  # eager: no dispatcher


# --------------------------------------------------------------------------------
# Drop-in module and model patching
# --------------------------------------------------------------------------------
class TritonRMSNorm(nn.Module):
    """Drop-in replacement for HF ``LlamaRMSNorm`` (same ``weight``, ``variance_epsilon``)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    @classmethod
    def from_llama_rmsnorm(cls, module):
        """Wrap an existing RMSNorm, sharing its Parameter object and epsilon.

        Sharing (not copying) the Parameter keeps optimizer state, weight tying and
        anything else that holds a reference to it pointing at the live weight.
        """
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = module.weight
        new.variance_epsilon = module.variance_epsilon
        return new

    def forward(self, hidden_states):
        return rmsnorm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _is_rmsnorm(module):
    return (
        type(module).__name__.endswith("RMSNorm")
        and not isinstance(module, TritonRMSNorm)
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and hasattr(module, "variance_epsilon")
    )


def replace_rmsnorm(model):
    """Replace every HF RMSNorm in ``model`` with ``TritonRMSNorm``; return the count.

    Modules are found by type name (``LlamaRMSNorm``, ``MistralRMSNorm``, ...) with a
    ``weight`` and a ``variance_epsilon``.
    """
    return swap_modules(model, _is_rmsnorm, TritonRMSNorm.from_llama_rmsnorm)
