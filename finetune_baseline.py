"""
Step 11a -- Fine-tune LLaMA with plain PyTorch / Hugging Face: the baseline.

Runs a full fine-tuning loop (forward, HF's loss, backward, AdamW) on seeded
synthetic token batches and reports time per step, tokens/sec and peak memory.
finetune_optimized.py runs the very same loop (both import llama_common) with the
Triton kernels switched on, so the two reports compare like for like.

Usage:
    python finetune_baseline.py                      # LLaMA-3.1-8B on a GPU; --tiny on a CPU
    python finetune_baseline.py --random-init        # 8B architecture, no download
    python finetune_baseline.py --tiny --steps 10 --seq-len 64
    python finetune_baseline.py --batch-size 1 --seq-len 4096 --json baseline.json

Without weights (no network, gated model, wrong path) it says why in one line and
continues with random weights in the same architecture.
"""

import argparse

import llama_common as common

TITLE = "Fine-tuning: baseline (PyTorch / HF)"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="LLaMA fine-tuning loop with PyTorch / HF ops (the baseline).")
    common.add_model_args(parser, custom_kernels_default=False)
    common.add_finetune_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return common.run_finetune(args, TITLE, script="finetune_baseline.py")


if __name__ == "__main__":
    main()
