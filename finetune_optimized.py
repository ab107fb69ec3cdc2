"""
Step 11b -- Fine-tune LLaMA with the custom Triton kernels.

The same loop as finetune_baseline.py (same seed, same data, same optimizer), with
two changes, both on by default:

* ``--use-custom-rmsnorm``: every RMSNorm module is replaced by ``TritonRMSNorm``
  (rmsnorm_kernel.py), which shares the original weight Parameter.
* ``--use-custom-ce``: the loss is the Triton cross-entropy (cross_entropy_kernel.py)
  on the model's [B, T, V] logits, with the labels shifted left and the last
  position ignored: the same value HF computes, without HF's float32 copy of the
  logits or the log-softmax tensor.

Usage:
    python finetune_optimized.py                     # both kernels, LLaMA-3.1-8B on a GPU
    python finetune_optimized.py --no-use-custom-ce  # RMSNorm kernel only
    python finetune_optimized.py --tiny --steps 10 --seq-len 64 --json optimized.json

With the same flags and seed, its losses match finetune_baseline.py's step by step
(float32 on CPU: within 1e-4; bf16 on GPU: within bf16 rounding).
"""

import argparse

import llama_common as common

TITLE = "Fine-tuning: optimized (Triton kernels)"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="LLaMA fine-tuning loop with the Triton RMSNorm and cross-entropy kernels."
    )
    common.add_model_args(parser, custom_kernels_default=True)
    common.add_finetune_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return common.run_finetune(args, TITLE, script="finetune_optimized.py")


if __name__ == "__main__":
    main()
