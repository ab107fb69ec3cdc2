"""
Step 11a -- Fine-tune LLaMA with plain PyTorch / Hugging Face: the baseline.

Runs a full fine-tuning loop (forward, HF's loss, backward, AdamW) on instruction
data (the bundled data/instructions.jsonl unless --dataset names another, or
``synthetic`` for seeded random tokens) and reports time per step, tokens/sec
(all token slots, and real tokens without the padding) and peak memory.
finetune_optimized.py runs the very same loop (training.run_training) with the
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
    python finetune_baseline.py --liger --lora      # the production peer: Liger-Kernel (+ PEFT)
    python finetune_baseline.py --torchao-fp8 tensorwise --use-custom-rmsnorm ...   # the peer of --fp8

Each batch holds --batch-size examples padded to the longest of them, as HF's
collator does (finetune_optimized.py packs them instead: --packing / --no-packing
choose either way in both scripts).

Without a GPU the default is a short run of the tiny LLaMA (1 warm-up + 3 steps of
2 x at most 128 byte tokens of the bundled data, a few seconds of training).

Without weights (no network, gated model, wrong path) it says why in one line and
continues with random weights in the same architecture.
"""

import argparse
import functools

import torch

from kernel_ft import flags, models, run, training

TITLE = "Fine-tuning: baseline (PyTorch / HF)"


def plain_hf(model, kernels, liger=False, torchao_fp8=None):
    """What the baseline trains with: ``(loss_fn, make_optimizer)`` for run_training.

    HF's loss (the model shifts the labels, upcasts the logits to float32 and calls
    F.cross_entropy) and torch.optim.AdamW. A --use-custom-* flag adds that kernel,
    switched in exactly as finetune_optimized.py does it; --liger switches in
    Liger-Kernel's instead (with_liger); --torchao-fp8 first casts the linear layers
    with torchao (with_torchao_fp8).
    """
    if torchao_fp8:
        with_torchao_fp8(model, torchao_fp8)
    if liger:
        return with_liger(model)
    if any(kernels.values()):
        from kernel_ft.run import apply_kernels  # imported only then: the plain run loads no kernel

        return apply_kernels(model, kernels)
    print("Kernels:       none (PyTorch / HF)")
    return training.hf_loss, training.pytorch_adamw


def with_liger(model):
    """The production peer, for a side-by-side on the same data and loop: Liger-Kernel's
    own patch for the model's family (its RMSNorm, gated MLP, RoPE and fused linear
    cross-entropy, each where the family has it), switched in by Liger's per-family
    entry point on the model instance, and PyTorch's AdamW. Liger's fused loss
    replaces the model's forward, so HF's loss call (model(..., labels=...)) runs it.
    With --lora it patches the model inside PEFT's wrapper."""
    import inspect

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    base = model.get_base_model() if models.is_peft_model(model) else model
    family = base.config.model_type
    patch = MODEL_TYPE_TO_APPLY_LIGER_FN.get(family)
    if patch is None:
        raise SystemExit(f"error: --liger: Liger-Kernel has no patch for {family} models")
    wanted = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True, "fused_linear_cross_entropy": True,
              "cross_entropy": False}
    options = {k: v for k, v in wanted.items() if k in inspect.signature(patch).parameters}
    patch(model=base, **options)
    kernels = [name for name, key in (("RMSNorm", "rms_norm"), ("SwiGLU", "swiglu"), ("GeGLU", "geglu"),
                                      ("RoPE", "rope"), ("fused linear cross-entropy", "fused_linear_cross_entropy"))
               if options.get(key)]
    print(f"Kernels:       Liger-Kernel's {family} patch ({', '.join(kernels)}), torch.optim.AdamW")
    return training.hf_loss, training.pytorch_adamw


def with_torchao_fp8(model, recipe):
    """The peer of finetune_optimized.py --fp8 (Step 22): torchao's float8 training
    (``convert_to_float8_training``, its recipe of the same name) on the same layers
    ours takes (swap_common.linears_to_cast: not the LM head, not LoRA's adapters)."""
    import importlib.metadata

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from swap_common import linears_to_cast

    names = {name for name, _ in linears_to_cast(model)[0]}
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda module, name: name in names)
    count = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    print(f"FP8 matmuls:   {count} linear layers in torchao {importlib.metadata.version('torchao')}'s float8 training "
          f"({recipe})")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="LLaMA fine-tuning loop with PyTorch / HF ops (the baseline).")
    flags.add_model_args(parser, custom_kernels_default=False)
    flags.add_finetune_args(parser)
    parser.add_argument("--liger", action="store_true",
                        help="the baseline with Liger-Kernel's Triton kernels (pip install liger-kernel): the "
                             "production peer, on the same data and loop")
    parser.add_argument("--torchao-fp8", choices=flags.FP8_RECIPES,
                        help="the peer of finetune_optimized.py --fp8: torchao's float8 training with this recipe on "
                             "the decoder's linear layers (pip install torchao; a GPU with FP8 tensor cores); with "
                             "the --use-custom-* flags, the same run as --fp8 with torchao's casts and products")
    args = parser.parse_args(argv)
    if args.torchao_fp8 and not flags.installed("torchao"):  # checked before anything is loaded
        raise SystemExit("error: --torchao-fp8 needs the torchao package (pip install torchao)")
    if args.liger:  # checked before anything is loaded
        custom = [f"--use-custom-{name}" for name, on in flags.kernels_from_args(args).items() if on]
        if custom:
            parser.error(f"--liger replaces the same operations as {', '.join(custom)}; choose one of them")
        if not flags.installed("liger_kernel"):
            raise SystemExit("error: --liger needs the liger-kernel package (pip install liger-kernel)")
        if not torch.cuda.is_available():
            raise SystemExit("error: --liger needs a GPU: Liger-Kernel's kernels do not run in Triton's CPU "
                             "interpreter")
    return args


def main(argv=None):
    args = parse_args(argv)
    return run.run_finetune(args, TITLE, script="finetune_baseline.py",
                                 switch_in=functools.partial(plain_hf, liger=args.liger,
                                                             torchao_fp8=args.torchao_fp8))


if __name__ == "__main__":
    main()
