"""
Step 11b (and 16) -- Fine-tune LLaMA with the custom Triton kernels.

The same loop as finetune_baseline.py (same seed, same data, same optimizer
settings), with every kernel of this repository on by default; the run prints
which ones are active:

* ``--use-custom-rmsnorm``: every RMSNorm module becomes ``TritonRMSNorm``
  (rmsnorm_kernel.py), sharing the original weight Parameter.
* ``--use-custom-swiglu``: every LLaMA MLP becomes ``TritonLlamaMLP``
  (swiglu_kernel.py): the same projections, the fused SwiGLU between them, and
  the MLP's hidden activation recomputed in backward instead of stored.
* ``--use-custom-rope``: the fused rotary embedding (rope_kernel.py), swapped in
  while the model's forward runs.
* ``--use-custom-flce``: the LM head and the loss fused (cross_entropy_kernel.py,
  step 13): the [B, T, V] logits are never built. It supersedes
  ``--use-custom-ce`` (the fused loss on the model's logits), which is what runs
  with ``--no-use-custom-flce``.
* ``--use-custom-adamw``: the fused Triton AdamW step (adamw_kernel.py) instead of
  PyTorch's fused AdamW, with the same hyperparameters.

Usage:
    python finetune_optimized.py                        # every kernel, LLaMA-3.1-8B on a GPU
    python finetune_optimized.py --no-use-custom-flce   # the fused loss on the logits instead
    python finetune_optimized.py --tiny --steps 10 --seq-len 64 --json optimized.json

With the same flags and seed, its losses match finetune_baseline.py's step by step
(float32 on CPU: within 1e-4; bf16 on GPU: within bf16 rounding).
"""

import argparse

import llama_common as common

TITLE = "Fine-tuning: optimized (Triton kernels)"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="LLaMA fine-tuning loop with the fused Triton kernels (all on by default)."
    )
    common.add_model_args(parser, custom_kernels_default=True)
    common.add_finetune_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return common.run_finetune(args, TITLE, script="finetune_optimized.py")


if __name__ == "__main__":
    main()
