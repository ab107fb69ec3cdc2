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
  (swiglu_kernel.py, its kernels in swiglu_kernel.py): the same projections, the
  fused SwiGLU (GeGLU for Gemma) between them, and the MLP's hidden activation
  recomputed in backward instead of stored.
* ``--use-custom-rope``: the fused rotary embedding (rope_kernel.py), swapped in
  around each attention layer's forward (rope_kernel.py).
* ``--use-custom-flce``: the LM head and the loss fused
  (linear_cross_entropy_kernel.py, step 13): the [B, T, V] logits are never
  built. It supersedes ``--use-custom-ce`` (the fused loss on the model's logits,
  cross_entropy_kernel.py), which is what runs with ``--no-use-custom-flce``.
* ``--use-custom-projections``: each attention's q/k/v and each MLP's gate/up
  projections become one autograd node (projections_kernel.py, Step 20): the gradient of
  their shared input is summed inside cuBLAS's products, with no add kernels.
* ``--use-custom-attention``: flash attention that reads each token's example from
  the position ids (attention_kernel.py, Step 21): packed
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

from kernel_ft import flags  # the workload (flags, model, data, loop) before the kernels: flags switches on the interpreter
from kernel_ft import models, training
import kernel_ft

TITLE = "Fine-tuning: optimized (Triton kernels)"

# How each report entry is labelled in the run's output (kernel_ft.apply says what happened).
LABELS = {"fp8": "FP8 matmuls:", "rmsnorm": "Custom rmsnorm:", "swiglu": "Custom swiglu:", "flce": "Custom loss:",
          "ce": "Custom loss:", "rope": "Custom rope:", "attention": "Custom attn:", "lora": "Custom lora:",
          "projections": "Shared inputs:"}


# --------------------------------------------------------------------------------
# Switching the kernels in
# --------------------------------------------------------------------------------
def apply_kernels(model, kernels):
    """Switch into ``model`` the kernels that ``kernels`` ({name: on/off}, see
    flags.KERNELS) turns on, through ``kernel_ft.apply`` (the call a user's own script
    makes), strictly: a kernel that cannot compute the model's function ends the run
    in one line. Returns ``(loss_fn, make_optimizer)`` for training.run_training. With
    every kernel off (and no LoRA on a bf16 model) this is the plain HF baseline.
    """
    switches = {name: bool(kernels.get(name)) for name in kernel_ft.KERNELS if name != "fp8"}
    try:
        report = kernel_ft.apply(model, fp8=kernels.get("fp8"), strict=True, **switches)
    except kernel_ft.KernelNotApplied as e:
        flag = "--fp8" if e.kernel == "fp8" else f"--use-custom-{e.kernel}"
        undo = "run without it" if e.kernel == "fp8" else f"run with --no-use-custom-{e.kernel}"
        raise SystemExit(f"error: {flag}: {e.reason}; {undo}") from None
    for name, entry in report.items():
        if entry["status"] == "applied" or (name == "projections" and switches["projections"]):
            print(f"{LABELS[name]:<14} {entry['detail']}")
    active = [name for name in flags.KERNELS if name in report.applied or (name == "adamw" and kernels.get(name))]
    if "lora" in report.applied:
        active.append("lora")
    if "fp8" in report.applied:
        active.append(f"fp8 ({kernels['fp8']})")

    # The loss: HF's own call; with flce or ce the model computes it with our kernels.
    loss_fn = training.hf_loss
    # AdamW: a different optimizer class with the same defaults and signature.
    make_optimizer = training.pytorch_adamw
    if kernels.get("adamw"):
        make_optimizer = kernel_ft.AdamW
        print("Custom optim:  fused Triton AdamW step (same hyperparameters as torch.optim.AdamW)")
    # LoRA: the adapters' products in the model's dtype (not a kernel: PEFT's float32
    # compute path switched off). The baseline keeps PEFT's default.
    dtype = models.lora_compute_dtype(model)
    if dtype is not None:
        loss_fn = models.adapters_compute_in(dtype, model, loss_fn)
        print(f"LoRA compute:  adapters kept in float32, their products in {str(dtype).replace('torch.', '')} "
              f"(autocast; no float32 copies of the layer inputs)")
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
