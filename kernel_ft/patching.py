"""
The one call that puts every kernel into a Hugging Face model: ``kernel_ft.apply``.

Each kernel file ends with its own model patching (``replace_rmsnorm``,
``replace_swiglu``, ``fuse_rope``, ...): the check that the kernel computes what the
model's module or function computes, then the swap. This file only calls them, in
one order, and says what happened:

    fp8          the decoder's linear layers multiply in FP8 (off unless asked: fp8="rowwise")
    rmsnorm      every RMSNorm module becomes TritonRMSNorm
    residual     pre-norm decoder layers add their residual stream inside the norms' kernels
    swiglu       every gated MLP computes act(gate) * up with the fused kernel
    flce         with labels, the model's forward computes HF's loss without logits
    ce           (where flce cannot apply) HF's loss on the logits by the fused kernel
    rope         the attention layers rotate q and k with the fused kernel
    attention    flash attention over the documents of each row (padding masks and
                 KV caches go to the model's own attention)
    lora         PEFT's LoRA layers (dropout included) in the base layer's matrix products
    projections  q/k/v and gate/up as one autograd node each

A kernel that cannot compute the model's own function is left out, never forced
in: by default with one warning for the call, with ``strict=True`` as an error
(``KernelNotApplied``). The report says what went in, what did not and why.

The optimizer is not part of the model: ``kernel_ft.AdamW`` (adamw_kernel.py) is
the fused AdamW, to pass to Trainer as ``optimizers=(kernel_ft.AdamW(...), None)``.
"""

import warnings

import torch

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)
from swap_common import SwapMismatch
from attention_routing import use_packed_attention
from cross_entropy_kernel import use_fused_loss
from fp8_kernel import GRAD_FORMATS, FP8Linear, replace_linears
from linear_cross_entropy_kernel import fuse_linear_cross_entropy
from lora_kernel import fuse_lora, unfused_layers
from projections_kernel import group_projections, groups_in, ungroup_under_adapters
from residual_kernel import fuse_residuals, fused_layers
from rmsnorm_kernel import TritonRMSNorm, replace_rmsnorm
from rope_kernel import fuse_rope
from swiglu_kernel import TritonLlamaMLP, replace_swiglu

# The switches of apply, in the order the kernels go in and are reported.
KERNELS = ("fp8", "rmsnorm", "residual", "swiglu", "flce", "ce", "rope", "attention", "lora", "projections")

APPLIED, LEFT_OUT, NOT_USED = "applied", "left to PyTorch", "not used"


class KernelNotApplied(ValueError):
    """``apply(strict=True)``: a kernel that was asked for cannot compute the model's function."""

    def __init__(self, kernel, reason):
        super().__init__(f"kernel_ft.apply: {kernel}: {reason}")
        self.kernel, self.reason = kernel, reason


class Report(dict):
    """What ``apply`` did, one entry per kernel: {"status": "applied" | "left to PyTorch"
    | "not used", "count": how many modules, "detail": one line}. A dict (``dict(report)``,
    JSON-ready); printed, one line per kernel."""

    def add(self, kernel, status, count=0, detail=""):
        self[kernel] = {"status": status, "count": count, "detail": detail}

    @property
    def applied(self):
        return [k for k, v in self.items() if v["status"] == APPLIED]

    @property
    def left_out(self):
        return {k: v["detail"] for k, v in self.items() if v["status"] == LEFT_OUT}

    def __str__(self):
        width = max(len(k) for k in self) if self else 0
        return "\n".join(f"{k:<{width}}  {v['status']:<15}  {v['detail']}" for k, v in self.items())


def _unwrapped(model):
    """The Hugging Face causal LM inside ``model`` (itself, or a PEFT model's), refusing
    the wrappers of a training framework: the kernels go in before those are made."""
    wrapper = type(model).__name__
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or wrapper in (
            "FullyShardedDataParallel", "OptimizedModule", "DataParallel", "DeepSpeedEngine"):
        raise TypeError(f"kernel_ft.apply: got a {wrapper}; call apply on the model before Trainer, accelerate or "
                        f"torch.compile wrap it (after get_peft_model is fine)")
    if type(model).__name__.startswith("FSDP") or getattr(model, "_is_fsdp_managed_module", False):
        raise TypeError("kernel_ft.apply: the model is sharded already; call apply before fully_shard")
    inner = model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model
    if not hasattr(inner, "get_decoder") or not hasattr(inner, "config"):
        raise TypeError(f"kernel_ft.apply: expects a Hugging Face causal LM (a PreTrainedModel such as "
                        f"LlamaForCausalLM) or a PEFT model around one, got {wrapper}")
    return inner


# The modules an earlier apply left in a model, by kernel: a second call finds nothing
# left to swap, and the report must say what the model runs, not "found nothing".
OURS = {"fp8": FP8Linear, "rmsnorm": TritonRMSNorm, "swiglu": TritonLlamaMLP}


def _ours_in(kernel, model):
    """The modules of ``kernel`` that ``model`` holds already ([]: none, or not a module swap)."""
    if kernel == "residual":
        return fused_layers(model)
    kind = OURS.get(kernel)
    return [] if kind is None else [m for m in model.modules() if isinstance(m, kind)]


def _already_in(kernel, model):
    """How many of ``kernel``'s modules ``model`` holds already (0: none, or not a module swap)."""
    return len(_ours_in(kernel, model))


def _swap(report, kernel, swap, model, found_nothing, line):
    """Run one kernel's patching; record it as applied, or as left to PyTorch with why."""
    try:
        count = swap(model)
    except SwapMismatch as e:
        report.add(kernel, LEFT_OUT, 0, str(e))
        return 0
    already = _already_in(kernel, model) if count == 0 else 0
    if already:
        report.add(kernel, APPLIED, already, f"{already} modules in since an earlier kernel_ft.apply")
    elif count == 0:
        report.add(kernel, LEFT_OUT, 0, found_nothing.format(model=type(model).__name__))
    else:
        report.add(kernel, APPLIED, count, line.format(count=count))
    return count


def apply(model, *, fp8=None, rmsnorm=True, residual=True, swiglu=True, flce=True, ce=True, rope=True, attention=True,
          lora=True, projections=True, strict=False, fp8_grads="e4m3", fp8_fast_accum=False):
    """Switch the kernels into ``model`` (a Hugging Face causal LM, or a PEFT model around
    one); return a ``Report``. Every kernel is on unless its switch is False; ``fp8`` is
    off unless "tensorwise" or "rowwise" (a GPU with FP8 tensor cores), its gradients in
    ``fp8_grads`` ("e4m3" or "e5m2"), with ``fp8_fast_accum`` its backward products at the
    tensor cores' own precision too (fp8_kernel.py, "Fast accumulation"). Call it once,
    before the model goes to Trainer / accelerate; with LoRA after ``get_peft_model``.

    After it, ``model(input_ids, labels=...)`` in training returns HF's loss (shifted
    labels, ignore_index -100, ``num_items_in_batch``) without building the logits (flce;
    the output's ``logits`` is None); an evaluation (eval mode, no gradients) and calls
    without labels return logits as before (``loss_only()``: none in evaluation either),
    and a padding ``attention_mask``, a KV cache (generate) or ``output_attentions`` runs
    the model's own attention.
    """
    lm = _unwrapped(model)
    name = type(lm).__name__
    report = Report()

    # First: the MLP swap below finds FP8 layers as its projections.
    _apply_fp8(report, model, fp8, fp8_grads, fp8_fast_accum, name)

    def switch(kernel, on, swap, found_nothing, line):
        if not on:
            report.add(kernel, NOT_USED, 0, "switched off")
            return 0
        return _swap(report, kernel, swap, lm, found_nothing, line)

    switch("rmsnorm", rmsnorm, replace_rmsnorm,
           "found no RMSNorm modules to replace in {model} (it looks for modules named *RMSNorm with a weight and "
           "variance_epsilon (LLaMA) or eps (Gemma))",
           "replaced {count} RMSNorm modules with TritonRMSNorm")
    switch("residual", residual, fuse_residuals, "found no decoder layers in {model}",
           "the adds of {count} decoder layers inside their RMSNorm kernels (forward and backward)")
    if switch("swiglu", swiglu, replace_swiglu,
              "found no gated MLPs to replace in {model} (it looks for modules named *MLP with gate_proj, up_proj "
              "and down_proj, or gate_up_proj and down_proj, and MoE experts modules, gated by SiLU or tanh-GELU)",
              "replaced {count} gated MLPs with TritonLlamaMLP (fused SwiGLU / GeGLU)"):
        # Only a plain nn.Linear down_proj lets the MLP recompute h instead of storing it; under a plain
        # per-tensor FP8 one, SwiGLU's backward makes h8^T (nothing of h is kept but gate and up).
        mlps = [m for m in lm.modules() if isinstance(m, TritonLlamaMLP)]
        cast_later = [m for m in mlps if m.casts_fp8_hidden_in_backward()]
        if cast_later:
            report["swiglu"]["detail"] += (f"; {len(cast_later)} of them cast h^T for their FP8 down_proj in backward "
                                           f"instead of keeping it")
        kept = [m for m in mlps if not m.recomputes_hidden() and m not in cast_later]
        if kept:
            report["swiglu"]["detail"] += (
                f"; {len(kept)} of them keep h = silu(gate) * up for backward: their down_proj is a "
                f"{type(kept[0].down_proj).__module__.split('.')[0]} {type(kept[0].down_proj).__name__} "
                f"(LoRA or quantized), not a plain nn.Linear")

    # The loss: inside the model's forward, without logits (flce), else on the logits (ce).
    other_loss = _other_loss(lm)
    if other_loss:
        report.add("flce", NOT_USED, 0, other_loss)
        report.add("ce", NOT_USED, 0, other_loss)
    elif switch("flce", flce, fuse_linear_cross_entropy, "",
              "fused linear cross-entropy inside the model's forward: LM head + loss in chunks, no logits"):
        report.add("ce", NOT_USED, 0, "superseded by flce" if ce else "switched off")
    else:
        switch("ce", ce, use_fused_loss, "{model} has no loss_function to set (not a transformers model)",
               "HF's loss on the model's [B, T, V] logits by the Triton cross-entropy (no float32 copy)")

    switch("rope", rope, fuse_rope,
           "found no attention modules using apply_rotary_pos_emb in {model} (it looks for *Attention modules "
           "whose python module defines it)",
           "fused RoPE in {count} attention modules")
    switch("attention", attention, use_packed_attention, "found no attention layers in {model}",
           "flash attention within each document of a row in {count} attention layers; padding masks and KV "
           "caches run the model's own attention")

    _apply_lora_and_groups(report, model, lora, projections, name)
    asked = {"fp8": bool(fp8), "rmsnorm": rmsnorm, "residual": residual, "swiglu": swiglu, "flce": flce, "ce": ce,
             "rope": rope, "attention": attention, "lora": lora, "projections": projections}
    left = {k: v for k, v in report.left_out.items() if asked[k]}
    if left and strict:
        kernel = next(iter(left))
        raise KernelNotApplied(kernel, left[kernel])
    if left:
        warnings.warn("kernel_ft.apply: left to PyTorch: " + "; ".join(f"{k} ({v})" for k, v in left.items()),
                      stacklevel=2)
    return report


def _other_loss(lm):
    """Why ``lm``'s loss is not a language model's next-token cross-entropy, which is
    all flce and ce compute (a sequence classifier's loss over its pooled logits), or
    None. transformers names each model's loss by its class (``loss_type``)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    kind = getattr(lm, "loss_type", None)
    if kind is None or LOSS_MAPPING.get(kind) is LOSS_MAPPING["ForCausalLM"]:
        return None
    return f"{type(lm).__name__}'s loss is its own ({kind}), not a language model's next-token cross-entropy"


def _apply_fp8(report, model, fp8, grads, fast_accum, name):
    """FP8 linear layers (fp8_kernel.replace_linears), when asked for."""
    if grads not in GRAD_FORMATS:
        raise ValueError(f"kernel_ft.apply: fp8_grads must be one of {tuple(GRAD_FORMATS)}, got {grads!r}")
    if not isinstance(fast_accum, bool):
        raise TypeError(f"kernel_ft.apply: fp8_fast_accum must be True or False, got {fast_accum!r}")
    if not fp8:
        idle = [f"{k}={v!r}" for k, v, default in (("fp8_grads", grads, "e4m3"), ("fp8_fast_accum", fast_accum, False))
                if v != default]
        report.add("fp8", NOT_USED, 0, "off (fp8='tensorwise' or 'rowwise' to use it)"
                   + (f"; {', '.join(idle)} change nothing without it" if idle else ""))
        return
    count, skipped = replace_linears(model, fp8, grads=grads, fast_accum=fast_accum)
    if not count:  # FP8 layers from an earlier apply, or none to cast
        layers = _ours_in("fp8", model)
        earlier = {(m.recipe, m.grads, m.fast_accum) for m in layers}
        if earlier and earlier != {(fp8, grads, fast_accum)}:
            report.add("fp8", LEFT_OUT, 0, f"the linear layers are FP8 from an earlier kernel_ft.apply with other "
                       f"settings ({'; '.join(_fp8_settings(*k) for k in sorted(earlier))}), left as they are: the "
                       f"first apply's settings hold")
            return
        count = len(layers)
        if not count:
            report.add("fp8", LEFT_OUT, 0, f"found no linear layers to cast in {name}")
            return
    accumulation = ", fast accumulation in backward too" if fast_accum else ""
    detail = (f"{count} linear layers in float8_e4m3fn ({grads} gradients{accumulation}), {fp8} scales (Triton casts, "
              f"cuBLASLt products); the LM head and LoRA adapters as before")
    if skipped:
        detail += f"; {len(skipped)} left as they were (sizes not multiples of 16), e.g. {skipped[0]}"
    report.add("fp8", APPLIED, count, detail)


def _fp8_settings(recipe, grads, fast_accum):
    return f"{recipe}, {grads} gradients" + (", fast accumulation" if fast_accum else "")


def _apply_lora_and_groups(report, model, lora, projections, name):
    """LoRA in the base layers' products, then the projection groups (LoRA's fused layers
    join them, FP8 layers stack; quantized layers keep their own). Only PEFT models have
    adapters; each layer is checked at every call (DoRA, QLoRA keep PEFT's forward;
    dropout and FP8 base layers run fused). Groups made by an apply before get_peft_model
    are undone first where PEFT wrapped their members, and made again with the adapters."""
    regrouped = 0
    if lora and hasattr(model, "peft_config"):
        regrouped = ungroup_under_adapters(model)
    if not lora:
        report.add("lora", NOT_USED, 0, "switched off")
    elif not hasattr(model, "peft_config"):
        report.add("lora", NOT_USED, 0, "no LoRA layers (a PEFT model: call apply after get_peft_model)")
    elif "LORA" not in (kinds := sorted({str(getattr(c, "peft_type", "?")).split(".")[-1]
                                          for c in model.peft_config.values()})):
        report.add("lora", NOT_USED, 0, f"no LoRA adapters in this PEFT model ({', '.join(kinds)}: PEFT's forward)")
    elif _swap(report, "lora", fuse_lora, model, "found no PEFT LoRA layers over linear layers in {model} "
               "(LoRA over quantized layers keeps PEFT's forward)",
               "{count} LoRA layers: the adapter's scale and sum inside the base layer's matrix products "
               "(cuBLAS epilogues), forward and backward"):
        unfused = unfused_layers(model)
        why = "; ".join(f"{n} with {reason}" for reason, n in unfused.items())
        if sum(unfused.values()) == report["lora"]["count"]:
            report.add("lora", LEFT_OUT, 0, f"every LoRA layer keeps PEFT's forward: {why}")
        elif unfused:
            report["lora"]["detail"] += f"; {sum(unfused.values())} of them keep PEFT's forward: {why}"
    if not projections:
        report.add("projections", NOT_USED, 0, "switched off")
    else:
        group_projections(model)
        count = groups_in(model)  # those made now and any an earlier apply made
        if count:
            report.add("projections", APPLIED, count, f"{count} groups of projections (q/k/v, gate/up) with one "
                       f"input gradient, summed in cuBLAS's epilogues (FP8: one product of the stacked weights)")
            if regrouped:
                report["projections"]["detail"] += (f"; {regrouped} made again with the LoRA adapters added since "
                                                    f"an earlier apply")
        else:
            report.add("projections", NOT_USED, 0, f"nothing to group in {name} (its q/k/v and gate/up are fused "
                       f"already, or quantized or unrouted LoRA layers)")
