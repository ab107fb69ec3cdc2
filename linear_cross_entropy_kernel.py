"""
Step 13 -- Fused linear cross-entropy: the logits are never materialized

The LM head turns hidden states [N, H] into logits [N, V] = hidden @ weight.T,
and the loss reads nothing else. For LLaMA-3.1-8B (H = 4096, V = 128256) the
sizes follow from the shapes (benchmark_kernels.py --kernel flce measures peaks):

  tokens   logits [N, V] bf16   their float32 copy (HF)   this step: one bf16 chunk
   4,096        1.05 GB               2.1 GB               263 MB (4 chunks of 1,024 rows)
  16,384        4.2  GB               8.4 GB               525 MB (8 chunks of 2,048 rows)

HF holds the bf16 logits, a float32 copy, a float32 log-softmax and, in
backward, a float32 and a bf16 gradient; the fused cross-entropy of step 8
still needs the logits and their gradient. This step holds one chunk.

The idea: cut the N rows into chunks. For each chunk of C rows

  z   = h_c @ W.T                 [C, V]  cuBLAS, into one reused buffer
  z   <- softmax(z) - onehot      Step 8's cross-entropy kernel, in place (and the loss per row)
  dh_c = z @ W                    [C, H]  cuBLAS, straight into the hidden gradient
  dW  += z.T @ h_c                [V, H]  cuBLAS, accumulated over chunks

so the largest live tensor is one [C, V] chunk. Nothing is computed twice: the
three matmuls are the ones the plain path runs (forward, and two in backward);
they simply run during forward, chunk by chunk, while the chunk is at hand.
Backward is left with rescaling the two gradients by the upstream gradient, and
only when it is not 1 (the device-side check of cross_entropy_kernel.scale_by_upstream).

What it costs:
* The gradients ([N, H] and [V, H]) exist from forward on, not from backward on;
  training holds them anyway a moment later.
* dW is accumulated in the weight's dtype: cuBLAS adds each chunk's product in
  float32 and rounds once per chunk, so k chunks add k bf16 roundings. A float32
  accumulator would cost V x H x 4 = 2.1 GB, four times the chunk buffer. The
  rounding drift grows like sqrt(k): measured on CPU on a CE gradient (N = 4096,
  H = 256, V = 2048), the relative error of dW vs float64 is 1.2x the
  single-matmul path's at k = 2, 1.5x at k = 4, 2.0x at k = 8 (2.8x at 16, 3.8x
  at 32). So the chunk count stays small: it grows only as the square root of
  the logits' size (_flce_chunk_rows), and so does the chunk. Liger-Kernel 0.8.5
  cuts N into ceil(V / H) = 32 chunks for LLaMA-3 at any N: at 4,096 tokens that
  is 128-row matmuls, too small to keep the tensor cores busy.
* reduction="none" (an upstream gradient per token) cannot fold the upstream
  into a gradient computed in forward without rounding twice; that path saves
  hidden and weight and recomputes chunk by chunk in backward (one more matmul).

The logits' gradient is rounded to the logits' dtype before the two gradient
matmuls, exactly as the plain path's bf16 gradient is, so dh and dW match what
`cross_entropy(hidden @ weight.T, targets)` gives.

The weight gradient has no bias term: LLaMA's LM head has none.

Soft-capped logits (Gemma-2 and Gemma-3's ``final_logit_softcapping``, c = 30):
the loss reads c * tanh(z / c) instead of z, which bends very large logits
towards +-c. Per chunk that is three more elementwise passes after the matmul
(divide, tanh, multiply: HF's three ops, in its order and dtype, so the capped
logits are HF's to the bit) and, for the gradient, the chain rule back through
them: dz = (g * c) * (1 - tanh^2) / c, with the tanh kept from the forward in a
second [C, V] buffer. The chunk's memory doubles (still one chunk, not the
logits); the traffic is 6 more passes over [C, V] in bf16, small next to the
matmuls that read [C, H] x [H, V]. A kernel could do the tanh in registers
inside Step 8's pass; the gain is a few percent of this step's time.

Triton concepts: none new. The work is three cuBLAS matmuls per chunk around
Step 8's kernel; what this step teaches is the memory plan.

Nothing runs on import. See linear_cross_entropy_test.py for the checks.
"""

import inspect
import math

import torch
import torch.nn as nn

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import SUPPORTED_DTYPES, cdiv, check_kernel_device, first_order_only, kernel_op, nothing
from swap_common import (
    CACHE_NAMES, SwapMismatch, decoder_of, error_line, evaluating, losses_only, probe_ids, probe_rounding, text_config,
    wrap_forward,
)

# Step 8's building blocks: the loss kernel's launcher (it writes the loss per row
# and, in place, the gradient of a chunk of logits) and the checks and
# reduction rules that both losses share.
from cross_entropy_kernel import (
    REDUCTIONS,
    causal_lm_reduction,
    causal_lm_targets,
    check_target_range,
    check_targets_and_reduction,
    claim_backward,
    cross_entropy_reference,
    divide_by_items,
    launch_forward,
    reduce_loss,
    scale_by_upstream,
    upstream_per_row,
)


def linear_cross_entropy_reference(hidden, weight, targets, ignore_index=-100, reduction="mean", softcap=None):
    """The plain path: the LM head matmul (soft-capped as Gemma-2 does it when
    ``softcap``), then HF's loss on the [..., V] logits."""
    logits = hidden @ weight.t()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return cross_entropy_reference(logits, targets, ignore_index, reduction)


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
    rows = cdiv(n_rows, n_chunks)
    return max(1, min(n_rows, cdiv(rows, FLCE_ROW_ALIGN) * FLCE_ROW_ALIGN))


def _flce_chunks(h2, weight, tgt, loss, n_valid, ignore_index, mean, grad_h, grad_w, chunk_rows, upstream=None,
                 softcap=0.0):
    """The chunk loop: loss per row into ``loss``; gradients into ``grad_h`` / ``grad_w`` if given.

    h2: [N, H] contiguous; weight: [V, H]; tgt: [N]; upstream: [N] per-row upstream
    gradient (backward of reduction="none") or None (upstream 1). ``softcap`` > 0:
    the logits are capped to softcap * tanh(z / softcap) first (see "Soft-capped logits").
    """
    n, v = h2.shape[0], weight.shape[0]
    write_grad = grad_h is not None or grad_w is not None
    # One [C, V] buffer for every chunk: the only logits-sized memory of the step
    # (two with soft-capping: the tanh is kept for the derivative).
    z_buf = torch.empty((min(chunk_rows, n), v), dtype=h2.dtype, device=h2.device)
    tanh_buf = torch.empty_like(z_buf) if softcap and write_grad else None
    for start in range(0, n, chunk_rows):
        end = min(start + chunk_rows, n)
        h_c, z = h2[start:end], z_buf[: end - start]
        torch.mm(h_c, weight.t(), out=z)  # logits of the chunk, on cuBLAS
        if softcap:
            tanh = tanh_buf[: end - start] if tanh_buf is not None else z
            torch.tanh(z.div_(softcap), out=tanh)  # HF's order, each op rounded to the logits' dtype
            torch.mul(tanh, softcap, out=z)
        # Loss per row; when training, the gradient overwrites the logits in place
        # (row stride v in both roles).
        launch_forward(z, (end - start, 0, v), tgt[start:end], loss[start:end], z if write_grad else None, (0, v),
                        n_valid, ignore_index, mean, upstream[start:end] if upstream is not None else None)
        if softcap and write_grad:
            # The chain rule through x * c, tanh and / c, as autograd runs it on HF's
            # three ops (the same kernels, so the same roundings).
            z.copy_(torch.ops.aten.tanh_backward(z.mul_(softcap), tanh)).div_(softcap)
        if grad_h is not None:
            torch.mm(z, weight, out=grad_h[start:end])  # rows are independent: no accumulation
        if grad_w is not None:
            if start == 0:
                torch.mm(z.t(), h_c, out=grad_w)
            else:
                grad_w.addmm_(z.t(), h_c)  # float32 inside cuBLAS, one rounding per chunk


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
    check_targets_and_reduction("fused_linear_cross_entropy", targets, ignore_index, reduction, "hidden", hidden)
    check_kernel_device(hidden, weight, targets)


def _recomputes(need_grad_h, need_grad_w, reduction, dtype):
    """Recompute in backward, with the upstream gradient applied before the logits'
    gradient is rounded, for reduction="none" (a weight per token) and for
    float16 (loss scaling): as in cross_entropy_kernel.py, at the cost of the
    LM-head matmul once more."""
    return (reduction == "none" or dtype == torch.float16) and (need_grad_h or need_grad_w)


def _forward(hidden, weight, targets, ignore_index, reduction, need_grad_h, need_grad_w, chunk_rows, check, softcap):
    """The forward pass both entry points share: (loss, grad_h, grad_w, n_valid).

    The gradients are prepared here unless not asked for or recomputed in
    backward (then None); grad_h is [N, H]; n_valid is a [1] float32 tensor.
    """
    if check:
        check_target_range(targets, weight.shape[0], ignore_index)
    lead_shape, h = hidden.shape[:-1], hidden.shape[-1]
    h2 = hidden.reshape(-1, h).contiguous()  # a view for the usual [B, T, H] activations
    tgt = targets.reshape(-1).contiguous()  # the kernel reads target r at TARGETS + r
    n = tgt.numel()
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    n_valid = (tgt != ignore_index).sum(dtype=torch.float32).reshape(1)
    fused = (need_grad_h or need_grad_w) and not _recomputes(need_grad_h, need_grad_w, reduction, hidden.dtype)
    grad_h = torch.empty_like(h2) if fused and need_grad_h else None
    grad_w = torch.empty_like(weight) if fused and need_grad_w else None
    if n > 0:
        _flce_chunks(h2, weight, tgt, loss, n_valid, ignore_index, reduction == "mean", grad_h, grad_w, chunk_rows,
                     softcap=softcap)
    elif grad_w is not None:
        grad_w.zero_()
    return reduce_loss(loss, n_valid, reduction, lead_shape), grad_h, grad_w, n_valid


def _flce_forward_fake(hidden, weight, targets, ignore_index, reduction, need_grad_h, need_grad_w, chunk_rows, check,
                       softcap):
    fused = (need_grad_h or need_grad_w) and not _recomputes(need_grad_h, need_grad_w, reduction, hidden.dtype)
    n, h = hidden.numel() // hidden.shape[-1], hidden.shape[-1]
    return (
        hidden.new_empty(hidden.shape[:-1] if reduction == "none" else (), dtype=torch.float32),
        hidden.new_empty((n, h)) if fused and need_grad_h else nothing(hidden),
        weight.new_empty(weight.shape) if fused and need_grad_w else nothing(weight),
        hidden.new_empty((1,), dtype=torch.float32),
    )


@kernel_op("linear_cross_entropy_forward", fake=_flce_forward_fake)
def linear_cross_entropy_forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 ignore_index: int, reduction: str, need_grad_h: bool, need_grad_w: bool,
                                 chunk_rows: int, check: bool, softcap: float,
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_h, grad_w, n_valid) as in ``_forward``; a gradient not prepared is empty."""
    loss, grad_h, grad_w, n_valid = _forward(hidden, weight, targets, ignore_index, reduction,
                                             need_grad_h, need_grad_w, chunk_rows, check, softcap)
    return (loss, grad_h if grad_h is not None else nothing(hidden),
            grad_w if grad_w is not None else nothing(weight), n_valid)


def _flce_grad_fake(hidden, weight, targets, n_valid, upstream, ignore_index, mean, need_grad_h, need_grad_w,
                    chunk_rows, softcap):
    return (hidden.new_empty(hidden.shape) if need_grad_h else nothing(hidden),
            weight.new_empty(weight.shape) if need_grad_w else nothing(weight))


@kernel_op("linear_cross_entropy_grad", fake=_flce_grad_fake)
def linear_cross_entropy_grad(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                              n_valid: torch.Tensor, upstream: torch.Tensor, ignore_index: int, mean: bool,
                              need_grad_h: bool, need_grad_w: bool, chunk_rows: int, softcap: float,
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The recomputed gradients (upstream: one value per row, applied before rounding)."""
    h2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    tgt = targets.reshape(-1).contiguous()
    grad_h = torch.empty_like(h2) if need_grad_h else None
    grad_w = torch.empty_like(weight) if need_grad_w else None
    n = tgt.numel()
    if n > 0:
        scratch = torch.empty(n, dtype=torch.float32, device=h2.device)
        _flce_chunks(h2, weight, tgt, scratch, n_valid, ignore_index, mean, grad_h, grad_w, chunk_rows,
                     upstream=upstream, softcap=softcap)
    elif grad_w is not None:
        grad_w.zero_()
    return (grad_h.view(hidden.shape) if need_grad_h else nothing(hidden),
            grad_w if need_grad_w else nothing(weight))


def _recomputed_grads(ctx, grad_output):
    hidden, weight, targets, n_valid = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[:2]
    upstream = upstream_per_row(grad_output, ctx.reduction, targets.numel())
    grad_h, grad_w = linear_cross_entropy_grad(hidden, weight, targets, n_valid, upstream, ctx.ignore_index,
                                               ctx.reduction == "mean", need_h, need_w, ctx.chunk_rows, ctx.softcap)
    return (grad_h if need_h else None), (grad_w if need_w else None)


class TritonFusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Eager autograd: the gradients are prepared in forward and scaled in place in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, need_grad_h, need_grad_w, chunk_rows, check,
                softcap):
        loss, grad_h, grad_w, n_valid = _forward(hidden, weight, targets, ignore_index, reduction,
                                                 need_grad_h, need_grad_w, chunk_rows, check, softcap)
        ctx.hidden_shape = hidden.shape
        ctx.ignore_index, ctx.chunk_rows, ctx.reduction, ctx.softcap = ignore_index, chunk_rows, reduction, softcap
        ctx.recompute = _recomputes(need_grad_h, need_grad_w, reduction, hidden.dtype)
        ctx.grads = (grad_h, grad_w)  # on ctx, not saved: backward hands them to autograd
        ctx.used = False
        if ctx.recompute:
            ctx.save_for_backward(hidden, weight, targets, n_valid)
        return loss

    @staticmethod
    @first_order_only("fused_linear_cross_entropy")
    def backward(ctx, grad_output):
        claim_backward(ctx, "fused_linear_cross_entropy")
        if ctx.recompute:
            grad_h, grad_w = _recomputed_grads(ctx, grad_output)
        else:
            grad_h, grad_w = ctx.grads
            ctx.grads = None  # autograd owns them from here
            for g in (grad_h, grad_w):
                if g is not None:
                    scale_by_upstream(g, grad_output)
            if grad_h is not None:
                grad_h = grad_h.view(ctx.hidden_shape)
        return grad_h, grad_w, None, None, None, None, None, None, None, None


# The operator's autograd, for torch.compile: same forward; nothing kept on ctx
# and no in-place scaling (see cross_entropy_kernel.py).
def _op_setup_context(ctx, inputs, output):
    hidden, weight, targets, ignore_index, reduction, need_grad_h, need_grad_w, chunk_rows, _, softcap = inputs
    _, grad_h, grad_w, n_valid = output
    ctx.mark_non_differentiable(grad_h, grad_w, n_valid)
    ctx.ignore_index, ctx.chunk_rows, ctx.reduction, ctx.softcap = ignore_index, chunk_rows, reduction, softcap
    ctx.recompute = _recomputes(need_grad_h, need_grad_w, reduction, hidden.dtype)
    ctx.hidden_shape = hidden.shape
    ctx.save_for_backward(*((hidden, weight, targets, n_valid) if ctx.recompute else (grad_h, grad_w)))


@first_order_only("fused_linear_cross_entropy")
def _op_backward(ctx, grad_output, _dh, _dw, _dn):
    if ctx.recompute:
        grad_h, grad_w = _recomputed_grads(ctx, grad_output)
    else:
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h, grad_w = ctx.saved_tensors
        grad_h = (grad_h * grad_output).view(ctx.hidden_shape) if need_h else None
        grad_w = grad_w * grad_output if need_w else None
    return grad_h, grad_w, None, None, None, None, None, None, None, None


linear_cross_entropy_forward.op.register_autograd(_op_backward, setup_context=_op_setup_context)


def fused_linear_cross_entropy(hidden, weight, targets, ignore_index=-100, reduction="mean", chunk_rows=None,
                               check_targets=None, softcap=None):
    """``cross_entropy(hidden @ weight.T, targets)`` without ever holding the [N, V] logits.

    hidden: [N, H] or [B, T, H]; weight: [V, H] (same dtype); targets: hidden.shape[:-1].
    Returns the loss (float32) with gradients to hidden and weight; same reductions,
    ignore_index and all-ignored rule (loss 0, zero gradients) as ``cross_entropy``.
    chunk_rows: rows per chunk (default: the square-root rule of _flce_chunk_rows).
    check_targets: as in ``cross_entropy`` (default on for CPU tensors only).
    softcap: Gemma-2/3's final_logit_softcapping: the loss of softcap * tanh(logits / softcap).
    """
    _check_flce_inputs(hidden, weight, targets, ignore_index, reduction)
    # bool is an int to Python (True == 1); as a row count it is a mistake.
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"fused_linear_cross_entropy: chunk_rows must be a positive int, got {chunk_rows!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"fused_linear_cross_entropy: softcap must be a finite number > 0 or None, got {softcap!r}")
    if check_targets is None:
        check_targets = hidden.device.type == "cpu"
    chunk_rows = chunk_rows or _flce_chunk_rows(targets.numel(), weight.shape[0], hidden.element_size())
    grad_on = torch.is_grad_enabled()
    args = (hidden, weight, targets, ignore_index, reduction,
            grad_on and hidden.requires_grad, grad_on and weight.requires_grad, chunk_rows, check_targets,
            float(softcap or 0.0))
    if torch.compiler.is_compiling():
        return linear_cross_entropy_forward.op(*args)[0]  # one node of the compiled graph
    return TritonFusedLinearCrossEntropyFunction.apply(*args)


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


# --------------------------------------------------------------------------------
# In a model: the LM head and HF's loss inside the model's own forward
# --------------------------------------------------------------------------------
# A Hugging Face causal LM given labels runs its decoder, the LM head over every
# position ([B, T, V] logits), then its loss function on those logits. To never
# build the logits, the model's forward itself must change: with labels, ours runs
# the same decoder and hands its last hidden states and the head's weight to the
# fused kernel, with HF's loss rules (cross_entropy_kernel.causal_lm_loss: shifted
# labels, ignore_index, num_items_in_batch). Without labels (evaluation of logits,
# generate()) the model's own forward runs, untouched. What is returned is HF's
# output class with ``loss`` set and ``logits`` None: the logits were never made.
#
# The head may do more than ``h @ W.T``: Granite divides the logits by a constant,
# Cohere multiplies them, Gemma-2 soft-caps them. The first two are a scale on h
# (``logit_multiplier``; B x T x H values instead of B x T x V), the soft-cap is
# the kernel's ``softcap``. Anything else must not pass unseen, so before the swap
# ``check_flce_head`` compares the model's own logits with what the fused loss
# computes, on a 3-token input, and refuses a head that differs. The loss rule is
# checked there too: the model's own loss must be HF's causal one on its logits (the
# next token's cross-entropy, averaged); a family that scores each position against
# its own label (CPM-Ant), smooths labels or adds a term keeps its own loss.
def model_body(model):
    """The module a causal LM's forward runs under its LM head: its base model
    (``model.base_model``), else its decoder. A multimodal model's base model (LLaVA's,
    Qwen2-VL's) merges the image features into the text before its decoder runs: called
    alone, the decoder would take the image tokens for text and drop ``pixel_values``.
    A multimodal model without a base model (Llama-4's) merges them in its own forward:
    refused, as nothing under its head sees the images."""
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model:
        return base
    if text_config(model) is not model.config:
        raise SwapMismatch(f"{type(model).__name__}'s own forward merges the images into the text before its language "
                           f"model, and no module under its LM head does: the fused loss would not see them")
    return decoder_of(model)


def logit_multiplier(config):
    """The constant some families multiply the logits by after the LM head: Granite
    divides them by ``logits_scaling``, Cohere multiplies them by ``logit_scale``."""
    return (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)


def _peft_copies(head):
    """The Linear layers of PEFT's ModulesToSaveWrapper (``modules_to_save=["lm_head"]``:
    the head trained as a copy per adapter), or None for any other module. The wrapper's
    ``.weight`` is the weight its forward multiplies by: the active adapter's copy, the
    original with adapters off."""
    copies, original = getattr(head, "modules_to_save", None), getattr(head, "original_module", None)
    if isinstance(copies, nn.ModuleDict) and isinstance(original, nn.Module):
        return [original, *copies.values()]
    return None


def _plain_head(head):
    """Whether the LM head computes x @ head.weight.T and nothing else: a bias-free
    nn.Linear, or PEFT's wrapper of copies of one."""
    layers = _peft_copies(head) or [head]
    return all(isinstance(m, nn.Linear) and m.bias is None for m in layers)


def check_flce_head(model):
    """Raise SwapMismatch unless the fused loss computes ``model``'s own logits: a plain
    bias-free nn.Linear head (PEFT's copies of one, trained with modules_to_save, too),
    then only the transforms this file implements."""
    head = model.get_output_embeddings()
    if head is None or not _plain_head(head):
        raise SwapMismatch(f"needs an LM head that is a plain bias-free torch.nn.Linear ({type(model).__name__} has "
                           f"{type(head).__module__}.{type(head).__name__})")
    if any(getattr(c, "output_router_logits", False) for c in (model.config, text_config(model))):
        raise SwapMismatch(f"{type(model).__name__} adds its router's auxiliary loss to the loss "
                           f"(output_router_logits), which the fused loss does not compute")
    body = model_body(model)
    if any(p.is_meta for p in model.parameters()):
        return
    # eval: no dropout, the two forwards differ only by what follows the LM head
    with evaluating(model), torch.no_grad():
        ids = probe_ids(model, head.weight.device)
        try:
            out = model(input_ids=ids, labels=ids)
        except Exception as e:  # noqa: BLE001 - the model's own forward: nothing to check the fused loss against
            raise SwapMismatch(f"{type(model).__name__}'s own forward fails on a probe with labels "
                               f"({error_line(e)})") from None
        theirs = out.logits.float()
        their_loss = float("nan") if out.loss is None else out.loss.float().item()
        hf_rule = nn.functional.cross_entropy(theirs[0, :-1], ids[0, 1:]).item()
        config = text_config(model)  # a multimodal model's head and its transforms are its text decoder's
        hidden = body(input_ids=ids).last_hidden_state * logit_multiplier(config)
        ours = (hidden @ head.weight.T).float()
        cap = getattr(config, "final_logit_softcapping", None)
        if cap:
            ours = cap * torch.tanh(ours / cap)
    rounding = probe_rounding(head.weight.dtype)
    if not torch.allclose(ours, theirs, rtol=rounding, atol=rounding * theirs.abs().max().item()):
        raise SwapMismatch(f"{type(model).__name__} transforms its logits after the LM head in a way the fused "
                           f"loss does not implement")
    if not abs(their_loss - hf_rule) <= rounding * abs(hf_rule):  # NaN: no loss at all
        raise SwapMismatch(f"{type(model).__name__}'s own loss is not HF's causal LM loss (the next token's "
                           f"cross-entropy, averaged): {their_loss:.6g} against {hf_rule:.6g} on a probe")


# The arguments of a causal LM's forward that belong to the head and the loss, not
# to the decoder.
HEAD_ARGUMENTS = ("labels", "logits_to_keep", "return_dict")


# Which calls with labels skip the logits. Training (gradients on, or the model in train
# mode) never needs them: only the loss. An evaluation under no_grad in eval mode is
# where Trainer's compute_metrics, predict() and a user's own accuracy read them, so
# there the model's own forward runs, logits and all, as Liger's fused loss does too.
# A call passes ``skip_logits=True`` (or False) to choose; swap_common.loss_only()
# chooses True for every call within it (our own held-out loss: no [B, T, V] tensor).
def _skips_logits(model, skip_logits):
    if skip_logits is not None:
        return bool(skip_logits)
    return model.training or torch.is_grad_enabled() or losses_only()


def _router_loss(model, arguments, extra):
    """Whether this call adds an MoE router's auxiliary loss: asked in the call, else by
    the config (HF's forwards read it there when the call says nothing)."""
    asked = extra.get("output_router_logits", arguments.get("output_router_logits"))
    return bool(getattr(text_config(model), "output_router_logits", False) if asked is None else asked)


def causal_lm_forward_with_fused_loss(model, *args, **kwargs):
    """``model``'s forward; with labels in training (or ``skip_logits=True``), the loss by
    the fused kernel and no logits."""
    skip_logits = kwargs.pop("skip_logits", None)
    arguments = model._kernel_ft_signature.bind(*args, **kwargs).arguments
    extra = arguments.pop(model._kernel_ft_var_keyword, {})  # what came in through **kwargs
    labels = arguments.get("labels")
    if skip_logits and labels is None:
        raise ValueError("skip_logits=True needs labels: without them the logits are all the forward computes")
    head = model.get_output_embeddings()
    keep = arguments.get("logits_to_keep", extra.get("logits_to_keep"))
    some_logits = keep is not None and not (isinstance(keep, int) and keep == 0)
    if labels is None or not _skips_logits(model, skip_logits) or _router_loss(model, arguments, extra) \
            or extra.get("fused_lm_head") or (_peft_copies(head) and head._forward_pre_hooks) \
            or any(m.weight.is_meta for m in _peft_copies(head) or [head]) or some_logits:
        # No loss to compute, an evaluation that wants the logits, an MoE call that adds its router's
        # auxiliary loss, TRL's call of the log-probabilities its own fused head computes (fused_lm_head:
        # its trainers wrap the forward, before or after apply), a call of a PEFT model with an adapter
        # per row (adapter_names: PEFT gives the head's copies a hook that picks each row's), a head whose
        # weight its call brings in (accelerate's offloading keeps it on the meta device), or labels with
        # the logits of some positions only (logits_to_keep; transformers refuses the pair): the model's
        # own forward. (Other hooks on the head, a spy's, a compiled forward's, see no call in training:
        # the point of the fused loss is not to run it.)
        return model._kernel_ft_forward(*args, **kwargs)
    num_items = extra.pop("num_items_in_batch", None)
    shift_labels = extra.pop("shift_labels", None)
    ignore_index = extra.pop("ignore_index", -100)
    call = {**arguments, **extra}
    decoder_args = {k: v for k, v in call.items() if k not in HEAD_ARGUMENTS}
    outputs = model_body(model)(**decoder_args)
    hidden = outputs.last_hidden_state  # [B, T, H]
    config = text_config(model)
    scale = logit_multiplier(config)
    if scale != 1.0:
        hidden = hidden * scale  # (c h) @ W.T == c (h @ W.T)
    weight = head.weight  # [V, H], possibly tied to the embedding
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # as autocast runs the head: its product in the autocast dtype
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)  # as nn.Linear would refuse otherwise; HF's heads get their own dtype
    targets = causal_lm_targets(labels, shift_labels, ignore_index).to(hidden.device)
    loss = fused_linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index,
                                      reduction=causal_lm_reduction(num_items),
                                      softcap=getattr(config, "final_logit_softcapping", None))
    loss = divide_by_items(loss, num_items, targets, ignore_index)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # The KV cache, read by key (a ModelOutput is a dict; 5.24's properties for the old name warn). A decoder
    # without one (GPT-1, Mamba, RWKV: no past_key_values in their outputs) returns None there.
    cache = next((outputs[k] for k in CACHE_NAMES if isinstance(outputs, dict) and outputs.get(k) is not None), None)
    result = CausalLMOutputWithPast(loss=loss, logits=None, **{output_cache_field(): cache},
                                    hidden_states=getattr(outputs, "hidden_states", None),
                                    attentions=getattr(outputs, "attentions", None))
    # return_dict=False: HF's tuple, with None where the logits would be, so that whatever reads the outputs by
    # position finds each in its place (the loss first, the cache third).
    if call.get("return_dict") is False:
        return (loss, None, *result.to_tuple()[1:])
    return result


_CACHE_FIELD = []


def output_cache_field():
    """The name transformers gives the KV cache in a causal LM's output: ``past_key_values``,
    ``cache`` from 5.24 on (the old name still reads, with a warning). Looked up once (the
    first call is apply's probe, in eager), then a plain read under torch.compile."""
    if not _CACHE_FIELD:
        import dataclasses

        from transformers.modeling_outputs import CausalLMOutputWithPast

        fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
        _CACHE_FIELD.append("cache" if "cache" in fields else "past_key_values")
    return _CACHE_FIELD[0]


def fuse_linear_cross_entropy(model):
    """Give ``model`` (a Hugging Face causal LM, not wrapped by PEFT: its ``base_model.model``)
    a forward that, with labels, computes the loss by the fused kernel and never builds
    the logits; after ``check_flce_head``. Only this instance changes; calling it again
    changes nothing. Returns 1 (the one LM head)."""
    if "_kernel_ft_forward" in model.__dict__:
        return 1
    check_flce_head(model)
    signature = inspect.signature(model.forward)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD), None)
    if "labels" not in signature.parameters or var_keyword is None:
        raise SwapMismatch(f"{type(model).__name__}.forward does not take labels and **kwargs as HF's causal LMs do")
    model._kernel_ft_signature, model._kernel_ft_var_keyword = signature, var_keyword
    wrap_forward(model, "_kernel_ft_forward", causal_lm_forward_with_fused_loss)
    return 1
