"""
Step 11a -- Fine-tune LLaMA with plain PyTorch / Hugging Face: the baseline.

Runs a full fine-tuning loop (forward, HF's loss, backward, AdamW) on instruction
data (the bundled data/instructions.jsonl unless --dataset names another, or
``synthetic`` for seeded random tokens) and reports time per step, tokens/sec
(all token slots, and real tokens without the padding) and peak memory.
finetune_optimized.py runs the very same loop (llama_common.run_training) with the
Triton kernels switched in, so the two reports compare like for like. What this
script trains with is ``plain_hf`` below: HF's own loss and PyTorch's AdamW.

Usage:
    python finetune_baseline.py                      # LLaMA-3.1-8B on a GPU; --tiny on a CPU
    python finetune_baseline.py --random-init        # 8B architecture, no download
    python finetune_baseline.py --tiny --steps 10 --seq-len 256
    python finetune_baseline.py --dataset my_data.jsonl --eval-every 50   # Dolly or Alpaca fields
    python finetune_baseline.py --dataset synthetic      # random tokens, every slot real
    python finetune_baseline.py --batch-size 1 --seq-len 4096 --json baseline.json
    python finetune_baseline.py --use-custom-rmsnorm     # the baseline plus one kernel
    python finetune_baseline.py --lora --output-dir runs/hf-lora --save-every 100

Each batch holds --batch-size examples padded to the longest of them, as HF's
collator does (finetune_optimized.py packs them instead: --packing / --no-packing
choose either way in both scripts).

Without a GPU the default is a short run of the tiny LLaMA (1 warm-up + 3 steps of
2 x at most 128 byte tokens of the bundled data, a few seconds of training).

Without weights (no network, gated model, wrong path) it says why in one line and
continues with random weights in the same architecture.
"""

import argparse

import llama_common as common

TITLE = "Fine-tuning: baseline (PyTorch / HF)"


def plain_hf(model, kernels):
    """What the baseline trains with: ``(loss_fn, make_optimizer)`` for run_training.

    HF's loss (the model shifts the labels, upcasts the logits to float32 and calls
    F.cross_entropy) and torch.optim.AdamW. A --use-custom-* flag adds that kernel,
    switched in exactly as finetune_optimized.py does it.
    """
    if any(kernels.values()):
        from finetune_optimized import apply_kernels  # imported only then: the plain run loads no kernel

        return apply_kernels(model, kernels)
    print("Kernels:       none (PyTorch / HF)")
    return common.hf_loss, common.pytorch_adamw


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="LLaMA fine-tuning loop with PyTorch / HF ops (the baseline).")
    common.add_model_args(parser, custom_kernels_default=False)
    common.add_finetune_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return common.run_finetune(args, TITLE, script="finetune_baseline.py", switch_in=plain_hf)


if __name__ == "__main__":
    main()
