"""
Step 11b (and 16) -- Fine-tune LLaMA with the custom Triton kernels.

The same loop as finetune_baseline.py (same seed, same data, same optimizer
settings: both run training.run_training), with every kernel of this
repository on by default. How each one is switched in is the code of this file,
``apply_kernels`` below, one short block per kernel; the run prints which ones
are active:

* ``--use-custom-rmsnorm``: every RMSNorm module becomes ``TritonRMSNorm``
  (rmsnorm_kernel.py), sharing the original weight Parameter.
* ``--use-custom-swiglu``: every gated MLP becomes ``TritonLlamaMLP``
  (swiglu_mlp.py, its kernels in swiglu_kernel.py): the same projections, the
  fused SwiGLU (GeGLU for Gemma) between them, and the MLP's hidden activation
  recomputed in backward instead of stored.
* ``--use-custom-rope``: the fused rotary embedding (rope_kernel.py), swapped in
  around each attention layer's forward (rope_patching.py).
* ``--use-custom-flce``: the LM head and the loss fused
  (linear_cross_entropy_kernel.py, step 13): the [B, T, V] logits are never
  built. It supersedes ``--use-custom-ce`` (the fused loss on the model's logits,
  cross_entropy_kernel.py), which is what runs with ``--no-use-custom-flce``.
* ``--use-custom-projections``: each attention's q/k/v and each MLP's gate/up
  projections become one autograd node (projections.py, Step 20): the gradient of
  their shared input is summed inside cuBLAS's products, with no add kernels.
* ``--use-custom-attention``: flash attention that reads each token's example from
  the position ids (attention_kernel.py, attention_patching.py, Step 21): packed
  batches carry no mask, and no work is done across examples. On by default with
  packed real data.
* ``--use-custom-adamw``: the fused Triton AdamW step (adamw_kernel.py) instead of
  PyTorch's fused AdamW, with the same hyperparameters.
* ``--fp8 {tensorwise,rowwise}`` (off by default): the decoder's linear layers
  multiply in FP8 with dynamic scales (fp8_kernel.py, Step 22); GPUs with FP8
  tensor cores only.

Usage:
    python finetune_optimized.py                        # every kernel, LLaMA-3.1-8B on a GPU
    python finetune_optimized.py --no-use-custom-flce   # the fused loss on the logits instead
    python finetune_optimized.py --tiny --steps 10 --seq-len 256 --json optimized.json
    python finetune_optimized.py --dataset databricks/databricks-dolly-15k --eval-every 100
    python finetune_optimized.py --lora --grad-accum 4 --eval-every 50 --output-dir runs/lora --save-every 100
    python finetune_optimized.py --lora --resume runs/lora/checkpoint-100   # same flags: same losses
    torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp --random-init --batch-size 2  # FSDP2
    torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp --lora --compile --output-dir runs/fsdp
    python tools/export_hf.py runs/fsdp/checkpoint-20 runs/fsdp-hf   # the shards as a save_pretrained folder

With --lora (PEFT) the kernels run on the wrapped model: the MLP keeps the LoRA
projections, the frozen LM head and norms get no weight gradient in the fused
loss and RMSNorm, and the optimizer holds the adapters only. On a bf16 model the
adapters stay in float32 but are computed in bf16 (``adapters_compute_in``).

With --fsdp (under torchrun) the model is sharded after the kernels are switched
in, --lora's adapters with their frozen weights, and --compile compiles each
layer's forward after sharding; checkpoints are shards (tools/export_hf.py
writes them as a normal Hugging Face folder). --lora-4bit runs on one GPU only.

The data is finetune_baseline.py's (the bundled data/instructions.jsonl unless
--dataset says otherwise), but packed by default: several examples end to end in
each --seq-len row, a block-diagonal attention mask and positions restarting at
every example, so almost no slot is padding (--no-packing pads like the baseline).

Without a GPU the default is a short run of the tiny LLaMA (1 warm-up + 3 steps of
2 x 128 byte tokens, about 80 s: the kernels run in Triton's interpreter); a
run that will take more than two minutes prints an estimate after its first step,
and Ctrl-C keeps the completed steps (--json marks them partial).

With the same flags and seed (packing included), its losses match
finetune_baseline.py's step by step (float32 on CPU: within 1e-4; bf16 on GPU:
within bf16 rounding).
"""

import argparse

import torch

import flags  # the workload (flags, model, data, loop) before the kernels: flags switches on the interpreter
import dataloader
import models
import training
from adamw_kernel import TritonAdamW
from attention_patching import use_packed_attention
from cross_entropy_kernel import cross_entropy
from fp8_kernel import replace_linears
from kernel_common import SwapMismatch
from linear_cross_entropy_kernel import fused_linear_cross_entropy
from lora_kernel import fuse_lora
from projections import group_projections
from rmsnorm_kernel import replace_rmsnorm
from rope_patching import fuse_rope
from swiglu_mlp import TritonLlamaMLP, replace_swiglu

TITLE = "Fine-tuning: optimized (Triton kernels)"


# --------------------------------------------------------------------------------
# The losses: HF's shifted, ignore-index mean loss, computed by our kernels
# --------------------------------------------------------------------------------
# Both take a batch dict (dataloader.py, "Data"): its positions and attention mask go
# to the model as they are; padding, prompts and each example's first token carry
# IGNORE_INDEX labels, which the kernels skip like F.cross_entropy does.
def triton_ce_loss(model, batch):
    """The fused Triton cross-entropy on the model's [B, T, V] logits."""
    logits = model(**dataloader.model_inputs(batch)).logits  # [B, T, V] in the model's dtype; not copied
    return cross_entropy(logits, dataloader.shift_labels(batch["labels"]), ignore_index=dataloader.IGNORE_INDEX)


def triton_flce_loss(model, batch):
    """The LM head fused into the loss: the decoder's hidden states go straight into
    the fused linear cross-entropy, so no [B, T, V] logits exist."""
    hidden = model.get_decoder()(**dataloader.model_inputs(batch)).last_hidden_state  # [B, T, H]
    scale = logit_multiplier(model.config)
    if scale != 1.0:
        hidden = hidden * scale  # (c h) @ W.T == c (h @ W.T): B x T x H values scaled, not B x T x V
    weight = model.get_output_embeddings().weight  # [V, H], possibly tied to the embedding
    targets = dataloader.shift_labels(batch["labels"])
    return fused_linear_cross_entropy(hidden, weight, targets, ignore_index=dataloader.IGNORE_INDEX,
                                      softcap=getattr(model.config, "final_logit_softcapping", None))


def logit_multiplier(config):
    """The constant some families multiply the logits by after the LM head: Granite
    divides them by ``logits_scaling``, Cohere multiplies them by ``logit_scale``."""
    return (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)


# This loss runs the decoder and reads the LM head's weight itself instead of calling
# model(...): under --fsdp those weights are gathered only inside a forward, so
# run_finetune makes it one (fsdp.loss_inside_forward says how and why).
triton_flce_loss.calls_model_parts = True


def lora_compute_dtype(model):
    """bf16/fp16 when ``model`` is a PEFT model whose adapters PEFT keeps in float32 on a
    bf16/fp16 base (its default); None otherwise (no LoRA, a float32 model, QLoRA)."""
    if not models.is_peft_model(model) or getattr(model, "is_loaded_in_4bit", False):
        return None
    base = model.get_input_embeddings().weight.dtype
    adapters = {p.dtype for p in models.trainable_parameters(model)}
    return base if base in (torch.bfloat16, torch.float16) and adapters == {torch.float32} else None


def adapters_compute_in(dtype, model, loss_fn):
    """LoRA's adapters computed in the base model's ``dtype``, kept in float32.

    PEFT stores the adapters in float32 on a bf16 model (small updates would vanish
    in bf16) and casts each adapted layer's input to float32 to match: per layer a
    float32 copy of its input, saved for backward, seven per decoder layer, so a
    float32 matrix product each and twice the activation memory of the bf16 ones.
    Instead: no input cast, and the forward under autocast, which casts each
    adapter's weights to ``dtype`` once per forward (tiny: r rows) and runs its
    products in ``dtype``. The gradients flow back through the cast into the float32
    weights, which the optimizer updates in float32, as mixed-precision training
    does (FSDP's MixedPrecisionPolicy does the same for --fsdp). Everything else in
    the model is already in ``dtype``: autocast leaves it alone.
    """
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):  # PEFT's adapted layers
            module.cast_input_dtype_enabled = False

    def loss_with_adapters_in_dtype(model, batch):
        with torch.autocast(batch["input_ids"].device.type, dtype=dtype):
            return loss_fn(model, batch)

    loss_with_adapters_in_dtype.calls_model_parts = getattr(loss_fn, "calls_model_parts", False)
    return loss_with_adapters_in_dtype


def check_flce_head(model):
    """The fused loss computes (c h) @ W.T (c: logit_multiplier), soft-capped where the
    config says so: refuse heads that do more than that, by what they are and by
    what they compute."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise SystemExit(
            f"error: --use-custom-flce needs an LM head that is a plain bias-free torch.nn.Linear "
            f"({type(model).__name__} has {type(head).__module__}.{type(head).__name__}); run with "
            f"--no-use-custom-flce"
        )
    # Any other transform of the logits (a config attribute this code does not know)
    # shows on a 3-token input: the model's own logits must be the fused loss's.
    if any(p.is_meta for p in model.parameters()):
        return
    was_training = model.training
    model.eval()  # no dropout: the two forwards differ only by what follows the LM head
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3]], device=head.weight.device) % model.config.vocab_size
        theirs = model(input_ids=ids).logits.float()
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state * logit_multiplier(model.config)
        ours = (hidden @ head.weight.T).float()
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:
            ours = cap * torch.tanh(ours / cap)
    model.train(was_training)
    rounding = 1e-4 if head.weight.dtype == torch.float32 else 2**-6  # one rounding of the logits, and margin
    if not torch.allclose(ours, theirs, rtol=rounding, atol=rounding * theirs.abs().max().item()):
        raise SystemExit(f"error: --use-custom-flce: {type(model).__name__} transforms its logits after the LM head "
                         f"in a way the fused loss does not implement; run with --no-use-custom-flce")


def refuse_mismatch(flag, swap, model):
    """``swap(model)``; a kernel that would compute something else than the module or
    function it replaces (kernel_common.SwapMismatch) is refused in one line."""
    try:
        return swap(model)
    except SwapMismatch as e:
        raise SystemExit(f"error: --use-custom-{flag}: {e}; run with --no-use-custom-{flag}") from None


def nothing_found(flag, what, model, looks_for):
    """A --use-custom-* flag that matched nothing is a mistake, not a silent no-op."""
    return SystemExit(
        f"error: --use-custom-{flag} found no {what} in {type(model).__name__} ({looks_for}); run without it"
    )


# --------------------------------------------------------------------------------
# Switching the kernels in
# --------------------------------------------------------------------------------
def apply_kernels(model, kernels):
    """Switch into ``model`` the kernels that ``kernels`` ({name: on/off}, see
    flags.KERNELS) turns on. Returns ``(loss_fn, make_optimizer)`` for
    training.run_training: the loss ``loss_fn(model, batch)`` and the
    optimizer factory ``make_optimizer(params, lr)``. Each kernel is one block
    that prints one line; with every kernel off (and no LoRA on a bf16 model) this is
    the plain HF baseline.
    """
    active = []

    # FP8 (Step 22, --fp8): the decoder's linear layers become FP8Linear, the same
    # weights multiplied in FP8 with scales computed at every step. First, so that
    # the MLP swap below finds them as its projections. The LM head (in the fused
    # loss), the norms and LoRA's adapters stay in the model's dtype.
    if kernels.get("fp8"):
        count, skipped = replace_linears(model, kernels["fp8"])
        if count == 0:
            raise SystemExit(f"error: --fp8 found no linear layers to cast in {type(model).__name__}; run without it")
        print(f"FP8 matmuls:   {count} linear layers in float8_e4m3fn, {kernels['fp8']} scales (Triton casts, "
              f"cuBLASLt products); the LM head and LoRA adapters as before")
        if skipped:
            print(f"               {len(skipped)} left as they were (sizes not multiples of 16), e.g. {skipped[0]}")

    # RMSNorm: a module swap. TritonRMSNorm reuses each module's weight Parameter,
    # so the optimizer and any weight tying see the same tensors.
    if kernels.get("rmsnorm"):
        count = refuse_mismatch("rmsnorm", replace_rmsnorm, model)
        if count == 0:
            raise nothing_found("rmsnorm", "RMSNorm modules to replace", model,
                                "it looks for modules named *RMSNorm with a weight and variance_epsilon (LLaMA) "
                                "or eps (Gemma)")
        print(f"Custom rmsnorm: replaced {count} RMSNorm modules with TritonRMSNorm")
        active.append("rmsnorm")

    # SwiGLU: a module swap too; the MLP keeps its three projections (cuBLAS).
    if kernels.get("swiglu"):
        count = refuse_mismatch("swiglu", replace_swiglu, model)
        if count == 0:
            raise nothing_found("swiglu", "gated MLPs to replace", model,
                                "it looks for modules named *MLP with gate_proj, up_proj and down_proj, or "
                                "gate_up_proj and down_proj, and MoE experts modules, gated by SiLU or tanh-GELU")
        print(f"Custom swiglu: replaced {count} gated MLPs with TritonLlamaMLP (fused SwiGLU / GeGLU)")
        # The projections are the MLP's own modules, LoRA layers included; only a
        # plain nn.Linear down_proj lets the MLP recompute h instead of storing it.
        wrapped = [m for m in model.modules() if isinstance(m, TritonLlamaMLP) and not m.recomputes_hidden()]
        if wrapped:
            print(f"               {len(wrapped)} of them keep h = silu(gate) * up for backward: their down_proj "
                  f"is a {type(wrapped[0].down_proj).__module__.split('.')[0]} {type(wrapped[0].down_proj).__name__} "
                  f"(LoRA or quantized), not a plain nn.Linear")
        active.append("swiglu")

    # The loss: a different loss function, nothing in the model changes.
    loss_fn = training.hf_loss
    if kernels.get("flce"):
        check_flce_head(model)
        loss_fn = triton_flce_loss
        note = " (supersedes --use-custom-ce)" if kernels.get("ce") else ""
        print(f"Custom loss:   fused linear cross-entropy, LM head + loss in chunks, no logits{note}")
        active.append("flce")
    elif kernels.get("ce"):
        loss_fn = triton_ce_loss
        print("Custom loss:   Triton cross-entropy on the model's [B, T, V] logits (not copied)")
        active.append("ce")

    # RoPE: HF's attention calls a function by name, not a module; fuse_rope wraps
    # each attention layer's forward so that the call finds ours (also when
    # gradient checkpointing reruns the layer during backward).
    if kernels.get("rope"):
        count = refuse_mismatch("rope", fuse_rope, model)
        if count == 0:
            raise nothing_found("rope", "attention modules using apply_rotary_pos_emb", model,
                                "it looks for *Attention modules whose python module defines it")
        print(f"Custom rope:   fused RoPE in {count} attention modules")
        active.append("rope")

    # Attention: HF's layers call their attention function by name (the config's
    # _attn_implementation); ours is registered under a name of its own. It reads
    # each token's example from the position ids, so packed batches need no mask.
    if kernels.get("attention"):
        count = refuse_mismatch("attention", use_packed_attention, model)
        print(f"Custom attn:   flash attention within each packed example in {count} attention layers (no mask)")
        active.append("attention")

    # AdamW: a different optimizer class with the same defaults and signature
    # (one launch per parameter tensor, the update fused into one pass over memory).
    make_optimizer = training.pytorch_adamw
    if kernels.get("adamw"):
        make_optimizer = TritonAdamW
        print("Custom optim:  fused Triton AdamW step (same hyperparameters as torch.optim.AdamW)")
        active.append("adamw")

    # LoRA: the adapters' products in the model's dtype (not a kernel: PEFT's float32
    # compute path switched off). The baseline keeps PEFT's default.
    dtype = lora_compute_dtype(model)
    if dtype is not None:
        loss_fn = adapters_compute_in(dtype, model, loss_fn)
        print(f"LoRA compute:  adapters kept in float32, their products in {str(dtype).replace('torch.', '')} "
              f"(autocast; no float32 copies of the layer inputs)")

    # LoRA in the base layer's GEMMs (Step 20): the adapter's scale and the sums of both
    # paths in cuBLAS epilogues, forward and backward; each layer falls back to PEFT's
    # forward where it does not apply (dropout, DoRA, QLoRA, FP8 base layers).
    lora_fused = False
    if kernels.get("lora") and models.is_peft_model(model):
        count = fuse_lora(model)
        print(f"Custom lora:   {count} LoRA layers: the adapter's scale and sum inside the base layer's matrix "
              f"products (cuBLAS epilogues), forward and backward")
        lora_fused = True

    # Projections that read one input (projections.py): q/k/v and gate/up become one
    # autograd node each, so their input gradients are summed by cuBLAS (beta = 1),
    # not by add kernels. After the LoRA block: its fused layers join the groups;
    # FP8 and quantized layers keep their own backward.
    if kernels.get("projections"):
        count = group_projections(model)
        if count:
            print(f"Shared inputs: {count} groups of projections (q/k/v, gate/up) with one input gradient, "
                  f"summed in cuBLAS's epilogues")
            active.append("projections")
        else:
            print(f"Shared inputs: nothing to group in {type(model).__name__} (its q/k/v and gate/up are fused "
                  f"already, or FP8, quantized or unrouted LoRA layers)")

    active = [name for name in flags.KERNELS if name in active]  # one order in every report
    if lora_fused:
        active.append("lora")
    if kernels.get("fp8"):
        active.append(f"fp8 ({kernels['fp8']})")
    print(f"Kernels:       {', '.join(active) if active else 'none (PyTorch / HF)'}")
    return loss_fn, make_optimizer


# --------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="LLaMA fine-tuning loop with the fused Triton kernels (all on by default)."
    )
    flags.add_model_args(parser, custom_kernels_default=True, packing_default=True)
    flags.add_finetune_args(parser, cuda_graphs_default=True)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return training.run_finetune(args, TITLE, script="finetune_optimized.py", switch_in=apply_kernels)


if __name__ == "__main__":
    main()
