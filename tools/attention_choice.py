"""What rows of one document run on this GPU: ours or the model's own SDPA, measured (GPU only).

A call without position ids holds one document per row, which SDPA runs through its
own causal kernels (cuDNN's on Hopper). The attention kernel's routing times both on
the first call of each shape and keeps the faster (attention_routing.plain_rows_to_theirs).
This tool makes that same measurement (attention_routing.time_plain_rows: fwd+bwd, the
median of 5 of each in turn) on the attention layers of several families' configs, at
several lengths with the same tokens per call, and prints which one each shape gets.

Usage:
    python tools/attention_choice.py [--tokens 16384] [--lengths 1024 4096 16384] [--json choice.json]
"""

import argparse
import json

import torch

import attention_routing
from swap_common import plain_causal_attention
from kernel_ft import models

# (label, config): the bundled configs, and LLaMA-3.2-1B's and Gemma-3's head layouts
# (64 and 256 wide) built from LLaMA's config.
FAMILIES = {
    "LLaMA-3.1-8B, 32/8 heads of 128": lambda: models.bundled_config(models.flags.DEFAULT_MODEL)(),
    "Qwen2.5-1.5B, 12/2 heads of 128": lambda: models.bundled_config("Qwen/Qwen2.5-1.5B")(),
    "Phi-3-mini, 32/32 heads of 96": lambda: models.bundled_config("microsoft/Phi-3-mini-4k-instruct")(),
    "LLaMA shape, 32/8 heads of 64": lambda: models.llama31_8b_config(hidden_size=2048, head_dim=64,
                                                                       num_hidden_layers=1),
    "LLaMA shape, 8/4 heads of 256": lambda: models.llama31_8b_config(hidden_size=2048, head_dim=256,
                                                                       num_attention_heads=8, num_key_value_heads=4,
                                                                       num_hidden_layers=1),
}


def attention_layer(config):
    """The first attention layer of ``config``'s model, under SDPA, its weights empty on the GPU."""
    config._attn_implementation = "sdpa"
    config.num_hidden_layers = 1
    model = models.meta_model(config)
    layer = next(attention_routing._attention_layers(model))
    return layer.to_empty(device="cuda").to(torch.bfloat16)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per call (batch = tokens // length)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: tools/attention_choice.py measures GPU kernels; no CUDA device here")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16, fwd+bwd per layer, median of "
          f"{attention_routing.MEASURE_REPEATS}")
    print(f"{'family':34s} {'rows':>12s} {'ours ms':>9s} {'SDPA ms':>9s} {'ours/SDPA':>9s}  runs")
    rows = []
    for label, make in FAMILIES.items():
        layer = attention_layer(make())
        config = layer.config
        for length in args.lengths:
            batch = max(1, args.tokens // length)
            if not plain_causal_attention(config, length):  # a window shorter than the row: ours, not measured
                print(f"{label:34s} {f'{batch} x {length}':>12s} {'':9s} {'':9s} {'':9s}  ours (window "
                      f"{config.sliding_window})")
                continue
            key = (str(torch.device("cuda", torch.cuda.current_device())), torch.bfloat16, batch, length,
                   config.num_attention_heads, config.num_key_value_heads, layer.head_dim, "sdpa")
            ours, theirs = attention_routing.time_plain_rows(layer, key)
            runs = "SDPA" if theirs < ours else "ours"
            rows.append(dict(family=label, batch=batch, length=length, ours_ms=ours, sdpa_ms=theirs, runs=runs))
            print(f"{label:34s} {f'{batch} x {length}':>12s} {ours:9.3f} {theirs:9.3f} {ours / theirs:9.2f}  {runs}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
