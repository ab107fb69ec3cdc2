"""
Step 15 -- A fused AdamW step in Triton.

What it computes
----------------
After every backward pass the optimizer moves each parameter p against its
gradient g. AdamW keeps two running averages per parameter, the first moment m
(``exp_avg``) and the second moment v (``exp_avg_sq``), and a step counter t
that starts at 1 for the first update. With learning rate lr, betas
(beta1, beta2), eps and weight decay wd, one step is::

    p <- p - lr * wd * p                        # decoupled weight decay
    m <- m + (1 - beta1) * (g - m)              # = beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g * g
    bc1 = 1 - beta1 ** t                        # bias corrections: m and v start
    bc2 = 1 - beta2 ** t                        # at 0 and would be too small early on
    p <- p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

"Decoupled" (the W in AdamW, Loshchilov & Hutter) means the decay shrinks the
parameter directly instead of being added to the gradient, where Adam's
per-element scaling would distort it. This is exactly ``torch.optim.AdamW`` with
``amsgrad=False, maximize=False``. The state m and v has the parameter's dtype
(bf16 parameters get bf16 state, as in PyTorch); we compute in float32 from the
loaded values and round each result once, when it is stored.

Why it is worth a kernel
------------------------
Per parameter the step reads p, g, m, v and writes p, m, v: seven accesses of
2 bytes in bf16, 14 B per parameter, for some 15 FLOPs. An H200 moves ~4.2 TB/s,
i.e. 300e9 parameters per second at 14 B each; their arithmetic, ~5 TFLOP/s, is
under a tenth of its ~60 TFLOP/s of float32. The step is bound by bandwidth,
and its floor is the time to stream 14 B per parameter once.

For LLaMA-3.1-8B (8.03e9 parameters) that is 112 GB per step, 27 ms at copy
bandwidth. PyTorch's ``AdamW(fused=True)`` (``aten::_fused_adamw_``) took
42-44 ms per step in our profiles (README, Steps 10 and 16), ~2.6 TB/s: at a batch of
2 x 2048 tokens on an H200 it is the single largest bandwidth-bound operation
of the training step. The unfused ``foreach`` implementation is worse: it runs
a dozen list-wide ops (mul, lerp, mul, addcmul, sqrt, div, add, addcdiv), each
a full pass over one or two state-sized tensors.

Triton concepts new in this step (see rmsnorm_kernel.py for the basics)
-----------------------------------------------------------------------
* A 1-D elementwise kernel over a flat tensor: a contiguous tensor of any shape
  is just ``numel`` consecutive elements, so program i takes elements
  [i * BLOCK, (i + 1) * BLOCK) and masks the tail. No rows, no strides.
* Offsets in 64 bits: the embedding and LM head of a large-vocabulary model, or
  any flattened tensor, can hold more than 2**31 elements.
* Scalars computed on the host and passed as kernel arguments: the bias
  corrections depend only on the step count, a Python int the optimizer keeps,
  so ``lr / bc1`` and ``sqrt(bc2)`` are computed once per tensor in Python
  (double precision) instead of once per element, and no tensor has to be
  read back from the GPU (no ``.item()``, no host synchronization).
* Updating three tensors in place: each program loads its slice of p, g, m, v,
  and stores p, m, v back to the same addresses. Every element is read and
  written by exactly one program, so no two programs race.
* A scalar read from GPU memory (``tl.load`` of a one-element tensor), for a
  value the host does not know without waiting: gradient clipping's scale
  (below).
* One launch per parameter tensor. PyTorch's fused optimizer packs many
  tensors into one launch through pointer tables; we do not need to. The
  tensors of a LLaMA model are large (a 4096 x 14336 MLP weight is 0.8 GB of
  traffic per step, ~0.2 ms of GPU time) while a launch costs the host tens of
  microseconds, and launches are asynchronous: the host queues the next kernels
  while the GPU is still busy, so the GPU never waits. The few tiny tensors
  (RMSNorm weights, 4096 elements) cost a launch each and hide behind the big
  ones. LLaMA-3.1-8B has 291 parameter tensors: 291 launches per step.

Measured
--------
In the full training step (``profile_baseline.py --random-init --batch-size 2
--seq-len 2048``, one NVIDIA H200, torch 2.11, triton 3.6, README Step 16) the
optimizer's GPU time per step fell from 43.2 ms (``aten::_fused_adamw_``) to
27.2 ms (this kernel, 291 launches): 112 GB in 27.2 ms, ~4.1 TB/s.

During development an ad-hoc timing (not kept in the repository) on the same
kind of GPU, over 81 bf16 tensors shaped like 9 LLaMA-3.1-8B layers (1.96e9
parameters, 14 B each, ``triton.testing.do_bench`` median, copy bandwidth
4.24 TB/s), gave 6.76 ms (4.06 TB/s) for TritonAdamW, 10.05 ms (2.73 TB/s) for
``AdamW(fused=True)`` and 25.5 ms (1.08 TB/s) for ``AdamW(foreach=True)``; the
host queued the 81 launches in 2.4 ms, a third of the GPU's time.

Gradient clipping folded into the step
--------------------------------------
``torch.nn.utils.clip_grad_norm_`` is two more passes over the gradients before
the step: one reads them all for the norm, one multiplies each in place by
min(1, max_norm / norm), reading and writing it (6 B per parameter in bf16). The
step reads every gradient anyway, so ``TritonAdamW.clip_grad_norm_`` computes the
same norm and coefficient (on the GPU, no host sync) and leaves the gradients
alone; the next ``step()`` passes the coefficient to the kernel as a pointer and
multiplies each gradient by it in registers. The norm's pass stays (the
coefficient needs every gradient first); the in-place multiplication goes: 4 B
per bf16 parameter, 32 GB per step for 8B parameters, about 8 ms at copy
bandwidth.

In a CUDA graph (Step 20)
-------------------------
A CUDA graph records kernel launches with their arguments and replays them
unchanged: the host scalars above (``lr * wd``, ``lr / bc1``, ``sqrt(bc2)``) would
be frozen at the captured step's values, while the learning rate and the bias
corrections change every step. So when ``step()`` runs while a graph is being
captured, each launch reads those three numbers from a small float32 tensor in
GPU memory instead (one per parameter tensor, 12 B: nothing next to its
gradient), and the host refreshes all of them with one copy before each replay
(``stage_graph_step``), from the same double-precision formulas rounded to
float32 as before: the replayed update is bit for bit the eager one. The step
counter stays a Python int on the host, counted at staging.

What it does not do: no AMSGrad, no ``maximize``, no sparse gradients.

Nothing runs on import. See adamw_test.py for the checks.
"""

import functools
import math

import torch

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import (INTERPRET, SUPPORTED_DTYPES, cast_to, cdiv, check_kernel_device, fast_launch,
                           interpreter_block, note_weight_amax, num_sms, weight_amax_slots)

import triton
import triton.language as tl


# --------------------------------------------------------------------------------
# The reference: the update written out op by op in plain PyTorch, like the
# single-tensor ``torch.optim.AdamW`` (which does the first moment as one lerp),
# rounding after every op at the tensors' dtype. With float64 inputs it is the
# truth the tests compare against.
# --------------------------------------------------------------------------------
def adamw_reference(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step (t = ``step``, counted from 1); returns new tensors (p, m, v)."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    denom = v.sqrt() / math.sqrt(bias_correction2) + eps
    p = p - (lr / bias_correction1) * m / denom
    return p, m, v


# --------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _adamw_kernel(
    P,  # [n] parameter, flat and contiguous; updated in place
    G,  # [n] gradient, P's dtype; read only
    M,  # [n] first moment exp_avg, P's dtype; updated in place
    V,  # [n] second moment exp_avg_sq, P's dtype; updated in place
    n_elements,
    lr_wd,  # lr * weight_decay
    one_minus_beta1,  # 1 - beta1, from the host in double precision, then rounded once
    beta2,
    one_minus_beta2,  # 1 - beta2
    step_size,  # lr / (1 - beta1**t)
    bc2_sqrt,  # sqrt(1 - beta2**t)
    eps,
    GRAD_SCALE,  # [1] float32 on the device: gradient clipping's coefficient (read when HAS_SCALE)
    SCALARS,  # [3] float32 on the device: lr * wd, lr / bc1, sqrt(bc2) (read when SCALARS_ON_DEVICE)
    AMAX,  # [AMAX_SLOTS] float32, zeroed: max |new P| folded in (AMAX_SLOTS > 0 only)
    BLOCK: tl.constexpr,  # elements per program (power of two)
    PRECISE: tl.constexpr,  # float32 parameters: IEEE-rounded sqrt and division
    HAS_SCALE: tl.constexpr,  # False: the pointer is not read (a constexpr: no branch in the compiled kernel)
    SCALARS_ON_DEVICE: tl.constexpr,  # True inside a CUDA graph: the per-step scalars come from SCALARS
    AMAX_SLOTS: tl.constexpr = 0,  # > 0: P is a per-tensor FP8 layer's weight (Step 22): fold max |P| into AMAX
):
    # 64-bit offsets: pid * BLOCK overflows int32 for tensors of more than 2**31
    # elements. The int64 arithmetic is a few instructions per program, and the
    # contiguity of the arange still lets Triton issue 16-byte vector accesses.
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements

    # Load in the storage dtype, compute in float32 (PyTorch's "opmath").
    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALARS_ON_DEVICE:
        # The three per-step numbers from memory, so that a replayed graph uses this
        # step's values (see "In a CUDA graph"); the arguments are ignored.
        lr_wd = tl.load(SCALARS)
        step_size = tl.load(SCALARS + 1)
        bc2_sqrt = tl.load(SCALARS + 2)
    if HAS_SCALE:
        # One float32 every program loads (it stays in cache): the clipped gradient
        # exists only in registers, never written back.
        g = g * tl.load(GRAD_SCALE)

    # Decoupled weight decay. p - (lr * wd) * p equals p * (1 - lr * wd), but rounds
    # better: the float32 rounding of the scalar lr * wd (up to 6e-8 relative) lands on
    # the small term, instead of scaling every parameter by a slightly wrong
    # factor close to 1.
    p = p - lr_wd * p

    # Moments. m + (1 - beta1) * (g - m) is the lerp PyTorch uses.
    m = m + one_minus_beta1 * (g - m)
    v = beta2 * v + one_minus_beta2 * (g * g)

    # The bias-corrected update, with m and v in float32 registers (not yet
    # rounded to the storage dtype, as in PyTorch's fused kernel).
    if PRECISE:
        # Float32 parameters: sqrt and divisions rounded as IEEE requires, like
        # PyTorch's kernels. Two divisions per element cost nothing visible here:
        # the step is bandwidth-bound.
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
    else:
        # bf16/fp16: the approximate float32 sqrt and division (~2 ulp of float32)
        # are invisible after rounding to 16 bits.
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p - step_size * (m / denom)

    p = cast_to(p, P.dtype.element_ty)
    tl.store(P + offs, p, mask=mask)
    if AMAX_SLOTS:
        # The weight's FP8 cast in the next forward then reads it once, not twice (Step 22,
        # kernel_common "FP8 producers"); masked lanes hold 0.
        tl.atomic_max(AMAX + pid % AMAX_SLOTS, tl.max(tl.abs(p.to(tl.float32)), axis=0), sem="relaxed")
    tl.store(M + offs, cast_to(m, M.dtype.element_ty), mask=mask)
    tl.store(V + offs, cast_to(v, V.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------
# Launch configuration and checks
# --------------------------------------------------------------------------------
# Elements per program and warps. 2048 elements with 4 warps is 16 elements per
# thread: two 16-byte loads per bf16 tensor (four per float32 tensor), enough
# bytes in flight to cover HBM latency. A sweep on an H200 (torch 2.11, triton
# 3.6; 81 LLaMA-shaped bf16 tensors, 1.96e9 parameters, copy bandwidth 4.24 TB/s)
# at 14 B per parameter:
#
#     BLOCK x warps   1024x4  2048x4  2048x8  4096x4  4096x8  8192x8  8192x16  16384x16
#     TB/s            4.07    4.06    4.05    3.48    3.97    3.85    3.13     3.53
#
# The three smallest tiles tie at 96% of copy bandwidth (6.76 ms); bigger tiles
# with too few warps, or 16 warps, fall behind.
BLOCK = 2048
NUM_WARPS = 4


def _shape(t):
    return tuple(t.shape)


def _check_tensors(param, grad, exp_avg=None, exp_avg_sq=None):
    """Clear errors for everything the kernel cannot handle (state is optional)."""
    if not isinstance(param, torch.Tensor) or not isinstance(grad, torch.Tensor):
        raise TypeError(
            f"adamw: expects tensors for the parameter and its gradient, got "
            f"{type(param).__name__} and {type(grad).__name__}"
        )
    shape = _shape(param)
    if grad.layout != torch.strided:
        raise RuntimeError(
            f"adamw: sparse gradients are not supported (parameter of shape {shape}, gradient layout "
            f"{grad.layout}); use a dense embedding (sparse=False) or torch.optim.SparseAdam"
        )
    if param.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"adamw: parameter of shape {shape} has unsupported dtype {param.dtype}; "
            "use float32, float16 or bfloat16"
        )
    if grad.dtype != param.dtype:
        raise TypeError(
            f"adamw: gradient dtype {grad.dtype} differs from the parameter's {param.dtype} "
            f"(parameter of shape {shape}); the kernel reads both in the parameter's dtype"
        )
    if grad.shape != param.shape:
        raise ValueError(f"adamw: gradient shape {_shape(grad)} does not match the parameter shape {shape}")
    if not param.is_contiguous():
        raise ValueError(
            f"adamw: parameter of shape {shape} (strides {param.stride()}) is not contiguous; "
            "the kernel updates it in place as one flat array. Make the parameter contiguous "
            "before creating the optimizer"
        )
    for name, s in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if s is None:
            continue
        if not isinstance(s, torch.Tensor) or s.dtype != param.dtype or s.shape != param.shape:
            what = f"{s.dtype} {_shape(s)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(
                f"adamw: state {name} must be a {param.dtype} tensor of shape {shape} like its parameter, got {what}"
            )
        if not s.is_contiguous():
            raise ValueError(f"adamw: state {name} of the parameter of shape {shape} is not contiguous")
    tensors = [t for t in (param, grad, exp_avg, exp_avg_sq) if t is not None]
    check_kernel_device(*tensors)


def step_scalars(step, lr, beta1, beta2, weight_decay):
    """The three numbers of update ``step`` that change from step to step: lr * wd,
    lr / (1 - beta1**step) and sqrt(1 - beta2**step), in double precision (the
    kernel gets them rounded to float32, as an argument or from memory)."""
    return (float(lr) * float(weight_decay), float(lr) / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step))


def adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_scale=None,
               scalars=None, amax=None):
    """One fused AdamW update of ``param``, ``exp_avg`` and ``exp_avg_sq`` in place.

    param, exp_avg, exp_avg_sq: contiguous tensors of one shape and dtype
    (float32, float16 or bfloat16); grad: the same shape and dtype (a
    non-contiguous gradient is copied, since it is only read). ``step`` is the
    Python int count of this update, 1 for the first. Hyperparameters are
    Python numbers. ``grad_scale``: None, or a one-element float32 tensor on the
    parameter's device that multiplies the gradient (clipping). ``scalars``: None,
    or a 3-element float32 tensor on that device holding step_scalars(...), read by
    the kernel instead of the values computed here from ``step`` and ``lr`` (a CUDA
    graph's launch). ``amax``: None, or zeroed float32 slots on that device that get
    max |updated param| (an FP8 weight's, kernel_common.weight_amax_slots). One kernel
    launch, no host synchronization.
    """
    _check_tensors(param, grad, exp_avg, exp_avg_sq)
    if grad_scale is not None and (not isinstance(grad_scale, torch.Tensor) or grad_scale.numel() != 1
                                   or grad_scale.dtype != torch.float32 or grad_scale.device != param.device):
        what = (f"{grad_scale.dtype} tensor of {grad_scale.numel()} elements on {grad_scale.device}"
                if isinstance(grad_scale, torch.Tensor) else type(grad_scale).__name__)
        raise ValueError(f"adamw: grad_scale must be a one-element float32 tensor on {param.device}, got {what}")
    if scalars is not None and (not isinstance(scalars, torch.Tensor) or scalars.shape != (3,)
                                or scalars.dtype != torch.float32 or scalars.device != param.device):
        raise ValueError(f"adamw: scalars must be a 3-element float32 tensor on {param.device}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"adamw: step must be a Python int >= 1 (the count of this update), got {step!r}")
    if not grad.is_contiguous():
        grad = grad.contiguous()
    n = param.numel()
    if n == 0:
        return
    # Host scalars, in double precision, from the Python step count. Triton passes
    # Python floats to the kernel as float32.
    lr_wd, step_size, bc2_sqrt = step_scalars(step, lr, beta1, beta2, weight_decay)
    block, num_warps = BLOCK, NUM_WARPS
    if INTERPRET:
        # The interpreter runs programs one after another, each with a fixed Python
        # cost: two big blocks per tensor up to 2M elements, more past it (at least
        # 4096 elements, so a 4097-element tensor still tests the masked tail of a
        # second program).
        block = interpreter_block(n, 2, 4096)
    _adamw_kernel[(cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, n,
        lr_wd, 1.0 - float(beta1), float(beta2), 1.0 - float(beta2), step_size, bc2_sqrt, float(eps),
        grad_scale if grad_scale is not None else param,  # any pointer; not read without HAS_SCALE
        scalars if scalars is not None else param,  # not read without SCALARS_ON_DEVICE
        param if amax is None else amax,  # not read without AMAX_SLOTS
        BLOCK=block, PRECISE=param.dtype == torch.float32, HAS_SCALE=grad_scale is not None,
        SCALARS_ON_DEVICE=scalars is not None, AMAX_SLOTS=0 if amax is None else amax.numel(), num_warps=num_warps,
    )


# --------------------------------------------------------------------------------
# The gradient norm for clipping
# --------------------------------------------------------------------------------
# Clipping needs ||g|| over every gradient: one read of 2 B per bf16 parameter,
# 16 GB for 8B parameters, ~3.8 ms at an H200's copy bandwidth. PyTorch's
# ``_foreach_norm`` took 7.0 ms in the 8B step's profile: it cuts the tensors into
# chunks of 64K elements and launches a kernel per few hundred of them (394
# launches), each too small to keep the memory system busy. Here a tensor is one
# launch of a few programs per SM, each walking the tensor with a stride.
#
# New Triton concept: a loop whose bounds are runtime values (``range(start,
# n_elements, step)``), and ``tl.num_programs``: program i sums the blocks i,
# i + P, i + 2P, ... of its tensor, P = the grid size. Each program writes its own
# float32 partial sum to its slot; the slots are added up afterwards by one
# PyTorch reduction. No atomics: float addition in a fixed order, so the norm is
# the same at every run (an atomic_add would add in whatever order programs end).
@fast_launch
@triton.jit
def _sum_squares_kernel(
    G,  # [n] a gradient, flat and contiguous; read only
    PARTIALS,  # [programs] float32: this program's sum of g * g
    n_elements,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid.to(tl.int64) * BLOCK, n_elements, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        g = tl.load(G + offs, mask=offs < n_elements, other=0.0).to(tl.float32)
        acc += g * g
    tl.store(PARTIALS + pid, tl.sum(acc))


# Blocks of 4096 elements, 8 warps, eight programs per SM per tensor. A sweep on an
# H200 (results/fp8/cast_order_gradnorm_h200.txt; 8B's 291 bf16 gradients, 16.1 GB):
#
#     block x warps, programs/SM   4096x8,4  4096x4,4  2048x4,8  8192x8,2  4096x8,8  16384x16,1
#     ms                           4.84      7.47      5.05      4.32      4.28      5.17
#
# 4.28 ms is 90% of copy bandwidth; torch.nn.utils.get_total_norm took 6.60 ms.
NORM_BLOCK, NORM_WARPS, NORM_PROGRAMS_PER_SM = (1024, 1, 1) if INTERPRET else (4096, 8, 8)


def _norm_block(n, programs):
    """The block of a tensor of ``n`` elements summed by ``programs`` programs: in the
    interpreter it grows with the tensor (a 1M-element embedding: 2 loop trips per program
    instead of 512)."""
    return interpreter_block(n, 2 * programs, NORM_BLOCK) if INTERPRET else NORM_BLOCK


def _norm_programs(device):
    """Programs per tensor at most: a few per SM on a GPU; in the interpreter, which runs
    them one after another at a fixed Python cost each, two (of two loop trips each: the
    strided loop and the per-program slots are still exercised)."""
    return 2 if INTERPRET else num_sms(device) * NORM_PROGRAMS_PER_SM


def sums_of_squares(grads):
    """Each tensor's sum of squares in float32 (this file's kernel): a tensor [len(grads)]."""
    check_kernel_device(*grads)
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    device = grads[0].device
    most = _norm_programs(device)
    grid = [max(1, min(most, cdiv(g.numel(), NORM_BLOCK))) for g in grads]
    # One row of slots per tensor; the slots a smaller grid leaves are zeros.
    partials = torch.zeros(len(grads), max(grid), dtype=torch.float32, device=device)
    for row, (g, programs) in enumerate(zip(grads, grid)):
        _sum_squares_kernel[(programs,)](g, partials[row], g.numel(), BLOCK=_norm_block(g.numel(), programs),
                                         num_warps=NORM_WARPS)
    return partials.sum(dim=1)


def gradient_norm(grads, add_up=None):
    """The L2 norm of all ``grads`` (tensors on one device), as
    ``torch.nn.utils.get_total_norm(grads)`` computes it: the norm of each tensor in
    float32, rounded to the tensor's dtype, then the norm of those norms. A tensor.
    The sums of squares are this file's kernel; the few ops after it are PyTorch's.
    ``add_up(sums)``: where some of ``grads`` are pieces of a tensor split over
    processes (--ddp-shard-optimizer), their sums added up over the processes."""
    if not grads:
        return torch.tensor(0.0)
    sums = sums_of_squares(grads)
    if add_up is not None:
        sums = add_up(sums)
    norms = sums.sqrt()
    # get_total_norm stacks the per-tensor norms in each gradient's dtype (promoted
    # where dtypes mix) before the outer norm: round them the same way.
    dtypes = [g.dtype for g in grads]
    if len(set(dtypes)) == 1:
        norms = norms.to(dtypes[0])
    else:
        norms = torch.stack([n.to(dt) for n, dt in zip(norms.unbind(), dtypes)])
    return torch.linalg.vector_norm(norms)


# --------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------
def _check_hyperparameters(lr, betas, eps, weight_decay):
    """The same conditions torch.optim.AdamW enforces, with clear messages."""
    if isinstance(lr, torch.Tensor):
        raise TypeError("TritonAdamW: lr must be a Python number (a tensor lr would need a host sync per step)")
    if not 0.0 <= lr:
        raise ValueError(f"TritonAdamW: invalid learning rate {lr}; it must be >= 0")
    if not 0.0 <= eps:
        raise ValueError(f"TritonAdamW: invalid eps {eps}; it must be >= 0")
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"TritonAdamW: betas must be a pair (beta1, beta2), got {betas!r}") from None
    for i, beta in enumerate((beta1, beta2)):
        if isinstance(beta, torch.Tensor) or not 0.0 <= beta < 1.0:
            raise ValueError(f"TritonAdamW: invalid beta{i + 1} {beta!r}; it must be a number in [0, 1)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"TritonAdamW: invalid weight_decay {weight_decay}; it must be >= 0")


# torch.optim.AdamW options this kernel does not implement. A group that turns one
# on is refused wherever it enters (constructor, add_param_group, load_state_dict,
# or an edit of optimizer.param_groups before a step): silently ignoring it would
# train something other than what was asked for.
# capturable=True (torch.optim.AdamW's option for CUDA graphs) is accepted: every
# TritonAdamW step can be captured (see "In a CUDA graph").
UNSUPPORTED_OPTIONS = ("amsgrad", "maximize", "differentiable")


def _check_supported(group):
    for option in UNSUPPORTED_OPTIONS:
        if group.get(option, False):
            raise ValueError(
                f"TritonAdamW: a param group asks for {option}=True, which this kernel does not implement; "
                f"use torch.optim.AdamW for it"
            )


def _local(t):
    """The part of ``t`` this process holds: itself, or a DTensor's local shard.

    FSDP2 (torch.distributed.fsdp.fully_shard) turns every parameter, its gradient
    and (see step) its AdamW state into DTensors sharded on dim 0: each process
    holds one shard of each, and a kernel cannot take a DTensor (it has no memory
    of its own). AdamW is elementwise, so each process updates its own shards, the
    local tensors of p, g, m and v, which line up element for element, and nothing
    else: no communication. A plain tensor (one process) is returned as it is.
    """
    return t.to_local() if hasattr(t, "to_local") else t


class TritonAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (amsgrad=False, maximize=False) with one fused Triton kernel per parameter.

    Parameters must be contiguous float32/float16/bfloat16 tensors on a CUDA device
    (or on the CPU with the Triton interpreter). Per parameter the state is
    ``step`` (a Python int), ``exp_avg`` and ``exp_avg_sq`` (the parameter's
    dtype), created on its first update; parameters whose ``.grad`` is None are
    skipped. Param groups, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` come from ``torch.optim.Optimizer``.
    ``clip_grad_norm_(max_norm)`` clips inside the next step (see the docstring).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, capturable=False,
                 fp8_weight_amax=False):
        # capturable: accepted for torch.optim.AdamW's signature; every step can be
        # captured in a CUDA graph (see "In a CUDA graph"), so it changes nothing.
        del capturable
        _check_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        # What it buys: a per-tensor FP8 layer's next forward casts its weight from one read,
        # not two (Step 22). Only for a loop where nothing else writes the weights between
        # step() and the next forward: a write through .data bumps no version counter, so a
        # cast could not tell its amax is stale (kernel_common, "Weights").
        self.fp8_weight_amax = bool(fp8_weight_amax)

    def add_param_group(self, param_group):
        # A group may override any default; check what it will actually use.
        if isinstance(param_group, dict):
            merged = {**self.defaults, **param_group}
            _check_hyperparameters(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
            _check_supported(merged)
        super().add_param_group(param_group)

    def __setstate__(self, state):
        # Runs inside load_state_dict. A state dict saved by torch.optim.AdamW keeps
        # its step as a tensor: turn it into our Python int once, here, rather than
        # synchronizing on every step. And refuse options this kernel does not have.
        for group in state.get("param_groups", []):
            _check_supported(group)
        for param_state in state.get("state", {}).values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = int(param_state["step"].item())
        super().__setstate__(state)

    @torch.no_grad()
    def total_norm(self):
        """The L2 norm of this optimizer's gradients, as ``torch.nn.utils.get_total_norm``
        computes it, a tensor; the norm over every process's pieces where the parameters
        are pieces of whole weights (``add_up_pieces``, set by --ddp-shard-optimizer)."""
        return self._norm_of(self._with_grads())

    def _with_grads(self):
        return [p for group in self.param_groups for p in group["params"] if p.grad is not None]

    def _norm_of(self, params):
        grads = [p.grad for p in params]
        if not grads:
            return torch.tensor(0.0)
        if any(hasattr(g, "full_tensor") for g in grads):
            # FSDP: DTensors; PyTorch's norm gives a DTensor of per-shard partial norms,
            # full_tensor() adds them up across processes: the global norm.
            return torch.nn.utils.get_total_norm(grads, 2.0).full_tensor()
        add_up = getattr(self, "add_up_pieces", None)
        return gradient_norm(grads, None if add_up is None else functools.partial(add_up, params))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's gradients, its
        multiplication deferred into the next ``step()`` (the kernel scales each
        gradient as it reads it). Returns the total L2 norm before clipping, a
        tensor, computed as PyTorch computes it (total_norm). Until that step the
        ``.grad`` tensors keep their unclipped values; the step consumes the coefficient.
        """
        params = self._with_grads()
        if not params:
            self._grad_scale = None
            return torch.tensor(0.0)
        norm = self._norm_of(params)
        # clip_grad_norm_'s coefficient, in the norm's dtype as PyTorch computes it.
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        self._grad_scale = coefficient.to(torch.float32).reshape(1)
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter that has a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, self._grad_scale = getattr(self, "_grad_scale", None), None  # consumed by this step
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self._capture_step(grad_scale)
            return loss
        for group in self.param_groups:
            _check_supported(group)  # a group edited after construction
            for p in group["params"]:
                if p.grad is not None:
                    self._update(group, p, grad_scale)
                    self._updated(p)
        return loss

    def _updated(self, p):
        """After the launch that updates p: ``after_update(p)``, where something must follow
        a parameter's update at once (--ddp-shard-optimizer gathers the first layers'
        pieces while the rest of the step runs)."""
        after = getattr(self, "after_update", None)
        if after is not None:
            after(p)

    def _update(self, group, p, grad_scale=None):
        """One parameter's AdamW update from its .grad (one kernel launch)."""
        grad = p.grad
        # Check before creating state, so a rejected parameter leaves none.
        _check_tensors(_local(p), _local(grad))
        state = self.state[p]
        if len(state) == 0:
            state["step"] = 0
            # Like the parameter: under FSDP a DTensor sharded as it is, so
            # that state_dict() and distributed checkpoints see it sharded.
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        step = state["step"] + 1
        beta1, beta2 = group["betas"]
        amax = self._weight_amax(p)
        adamw_step(
            _local(p), _local(grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), step,
            group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
            grad_scale=None if grad_scale is None else grad_scale.to(_local(p).device), amax=amax,
        )
        if amax is not None:
            note_weight_amax(p)
        # Counted only once the launch went through: a failed step changes nothing.
        state["step"] = step

    def _weight_amax(self, p):
        """Zeroed slots for max |p| when p is a per-tensor FP8 layer's weight and the
        optimizer was asked to measure it (fp8_weight_amax), else None."""
        return weight_amax_slots(p) if self.fp8_weight_amax else None

    # ---- Inside backward (--optimizer-in-backward) -------------------------------------
    # What it buys: without it every gradient exists at once between backward and
    # step() (2 bytes per bf16 parameter: 16 GB for 8B). Here each parameter is
    # updated as soon as backward has accumulated its gradient, and the gradient is
    # freed at once: only the gradients of the layer backward is in are alive. The
    # price: no clipping (the global norm needs every gradient before the first
    # update), no accumulation over micro-batches, and step() finds nothing to do.
    def update_in_backward(self):
        """From now on, update each parameter in backward, when its gradient is ready,
        then free the gradient (post-accumulate-grad hooks); step() finds no gradient.
        Returns the hooks' handles (``handle.remove()`` turns it off)."""

        @torch.no_grad()
        def hook(p):
            # The group is looked up now: load_state_dict replaces the groups.
            index = getattr(self, "_group_index", None)
            if index is None or index[0] is not self.param_groups or id(p) not in index[1]:
                index = self._group_index = (self.param_groups, {id(q): g for g in self.param_groups
                                                                 for q in g["params"]})
            group = index[1][id(p)]
            _check_supported(group)
            self._update(group, p)
            p.grad = None

        return [p.register_post_accumulate_grad_hook(hook) for group in self.param_groups for p in group["params"]]

    # ---- Inside a CUDA graph (see "In a CUDA graph" at the top) ----------------------
    def prepare_capture(self):
        """Before a CUDA graph captures step(): one row of scalars per parameter that has
        state (that an eager step has updated), in device memory and in pinned host
        memory for the copy before each replay. Allocated here, not during the capture."""
        updated = [(group, p) for group in self.param_groups for p in group["params"] if len(self.state[p])]
        if not updated:
            raise RuntimeError("TritonAdamW: a CUDA graph can capture only steps of parameters that already have "
                               "state: run one step eagerly first")
        self._graph_rows = {id(p): row for row, (_, p) in enumerate(updated)}
        self._graph_scalars = torch.zeros(len(updated), 3, dtype=torch.float32, device=_local(updated[0][1]).device)
        # Pinned: the copy before each replay is then asynchronous (a CPU tensor on a CPU run).
        self._graph_host = torch.zeros(len(updated), 3, dtype=torch.float32, pin_memory=self._graph_scalars.is_cuda)

    def _capture_step(self, grad_scale):
        """step() while a CUDA graph is captured: the same launches, each reading its
        per-step scalars from its row of the tensor that stage_graph_step fills
        before every replay. Nothing runs now and the host step counts do not move;
        stage_graph_step counts each replayed update."""
        rows = getattr(self, "_graph_rows", {})
        updated = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if any(id(p) not in rows for _, p in updated):
            raise RuntimeError("TritonAdamW: a CUDA graph can capture only steps of parameters that already have "
                               "state, after prepare_capture(): run one step eagerly first")
        self._graph_updates = [(group, p, rows[id(p)]) for group, p in updated]
        for group, p, row in self._graph_updates:
            state = self.state[p]
            amax = self._weight_amax(p)  # the slots outlive the graph: the replayed forward reads them
            adamw_step(
                _local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), state["step"] + 1,
                group["lr"], *group["betas"], group["eps"], group["weight_decay"],
                grad_scale=None if grad_scale is None else grad_scale.to(_local(p).device),
                scalars=self._graph_scalars[row], amax=amax,
            )
            if amax is not None:
                note_weight_amax(p)
            self._updated(p)

    def stage_graph_step(self):
        """Before each replay of a captured step: this step's scalars (the current
        lr of each group, the next step count of each parameter) into the tensor the
        captured launches read, one asynchronous copy; the step counts advance."""
        if not hasattr(self, "_graph_updates"):
            raise RuntimeError("TritonAdamW.stage_graph_step: no step was captured in a CUDA graph")
        host = self._graph_host.numpy()
        host_done = getattr(self, "_graph_copy_done", None)
        if host_done is not None:
            host_done.synchronize()  # the previous copy has read the pinned buffer: it may be rewritten
        for group, p, row in self._graph_updates:
            state = self.state[p]
            state["step"] += 1
            beta1, beta2 = group["betas"]
            host[row] = step_scalars(state["step"], group["lr"], beta1, beta2, group["weight_decay"])
        self._graph_scalars.copy_(self._graph_host, non_blocking=True)
        if self._graph_scalars.is_cuda:
            self._graph_copy_done = torch.cuda.Event()
            self._graph_copy_done.record()

