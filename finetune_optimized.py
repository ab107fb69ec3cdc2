"""
Step 11b (and 16) -- Fine-tune LLaMA with the custom Triton kernels.

The same loop as finetune_baseline.py (same seed, same data, same optimizer
settings: both run training.run_training, set up by run.run_finetune), with
every kernel of this repository on by default. Each --use-custom-* flag is a switch
of ``kernel_ft.apply`` (kernel_ft/patching.py), the same call a user's own training
script makes (Step 23), through run.apply_kernels. A kernel left at its default goes
in where it computes the model's own function, else stays PyTorch's (a GPT-2 trains
with the fused loss alone); one asked for with its flag that cannot ends the run in
one line. The run prints what went in, and why the rest did not:

* ``--use-custom-rmsnorm``: every RMSNorm module becomes ``TritonRMSNorm``
  (rmsnorm_kernel.py), sharing the original weight Parameter.
* ``--use-custom-swiglu``: every gated MLP becomes ``TritonLlamaMLP``
  (swiglu_kernel.py): the same projections, the
  fused SwiGLU (GeGLU for Gemma) between them, and the MLP's hidden activation
  recomputed in backward instead of stored.
* ``--use-custom-rope``: the fused rotary embedding (rope_kernel.py), swapped in
  around each attention layer's forward.
* ``--use-custom-flce``: the LM head and the loss fused inside the model's forward
  (linear_cross_entropy_kernel.py, step 13): the [B, T, V] logits are never
  built. It supersedes ``--use-custom-ce`` (the fused loss on the model's logits,
  cross_entropy_kernel.py), which is what runs with ``--no-use-custom-flce``.
* ``--use-custom-projections``: each attention's q/k/v and each MLP's gate/up
  projections become one autograd node (projections_kernel.py, Step 20): the gradient of
  their shared input is summed inside cuBLAS's products, with no add kernels.
* ``--use-custom-attention``: flash attention that reads each token's example from
  the position ids (attention_kernel.py, Step 21): packed
  batches carry no mask, and no work is done across examples; a padding mask runs
  the model's own attention. On by default with packed real data.
* ``--use-custom-adamw``: the fused Triton AdamW step (adamw_kernel.py) instead of
  PyTorch's fused AdamW, with the same hyperparameters.
* ``--fp8 {tensorwise,rowwise}`` (off by default): the decoder's linear layers
  multiply in FP8 with dynamic scales (fp8_kernel.py, Step 22); GPUs with FP8
  tensor cores only; with ``--fsdp`` or ``--ddp`` too. ``--fp8-grads e5m2``: the
  output gradients in e5m2 instead of e4m3; ``--fp8-fast-accum``: the backward
  products accumulate at the tensor cores' own precision too (~3% faster at 8B).

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
adapters stay in float32 but are computed in bf16 (models.adapters_compute_in).

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
from kernel_ft import run

TITLE = "Fine-tuning: optimized (Triton kernels)"


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
    return run.run_finetune(args, TITLE, script="finetune_optimized.py", switch_in=run.apply_kernels)


if __name__ == "__main__":
    main()
