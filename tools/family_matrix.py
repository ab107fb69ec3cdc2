"""
Which fused kernels each decoder family gets: the support matrix, measured.

For every family below, a tiny random model is built from transformers' own config
class (no download) and each kernel is switched in alone by finetune_optimized.py's
``apply_kernels``, the code a run uses. A kernel either goes in, or is refused with
the one-line reason a run would print: the swaps are checked against the module or
function they replace (kernel_common.SwapMismatch, the RoPE check, the LM-head
probe), so "on" means the family's own computation was reproduced, not that a name
matched. The table is generated, never written by hand: README's matrix is this
tool's output. Losses against the baseline are tested in families_test.py.

Usage:
    python tools/family_matrix.py                       # markdown table
    python tools/family_matrix.py --json matrix.json
"""

import argparse
import contextlib
import copy
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the scripts live one level up

import flags  # noqa: E402 - first: the Triton interpreter switch, then transformers
import models  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from finetune_optimized import apply_kernels  # noqa: E402

# Tiny shapes every family accepts: hidden 64, 2 layers, 4 heads (2 for keys and values).
TINY = dict(vocab_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
            intermediate_size=128, head_dim=16)
# (label, model_type, what the family sets beyond TINY)
FAMILIES = [
    ("Llama", "llama", {}),
    ("Mistral", "mistral", {}),
    ("Qwen2", "qwen2", {}),
    ("Qwen3", "qwen3", {}),
    ("Granite", "granite", {"logits_scaling": 4.0}),
    ("Cohere", "cohere", {"logit_scale": 0.5}),
    ("Gemma", "gemma", {}),
    ("Gemma-2", "gemma2", {"final_logit_softcapping": 30.0}),
    ("Gemma-3", "gemma3_text", {"final_logit_softcapping": 30.0}),
    ("Phi-3", "phi3", {"pad_token_id": 0}),
    ("Phi-3, partial rotary", "phi3", {"pad_token_id": 0, "partial_rotary_factor": 0.5}),
    ("Mixtral", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("Qwen3-MoE", "qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}),
]


def family_config(model_type, extra):
    return transformers.AutoConfig.for_model(model_type, **TINY, **extra)


def matrix():
    """{label: {"model_type", "attention", kernel: None (on) or the refusal}}, every kernel alone."""
    rows = {}
    for label, model_type, extra in FAMILIES:
        torch.manual_seed(0)
        model = models.build_random(family_config(model_type, extra), torch.device("cpu"), torch.float32)
        row = {"model_type": model_type, "attention": model.config._attn_implementation}
        for kernel in flags.KERNELS:
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    apply_kernels(copy.deepcopy(model), {kernel: True})
                row[kernel] = None
            except SystemExit as e:
                row[kernel] = str(e.code).removeprefix("error: ")
        rows[label] = row
    return rows


def markdown(rows):
    """The matrix as a markdown table; each refusal once, numbered, under it."""
    reasons = []
    lines = ["| family (`model_type`) | attention | " + " | ".join(flags.KERNELS) + " |",
             "|---|---|" + "---|" * len(flags.KERNELS)]
    for label, row in rows.items():
        cells = []
        for kernel in flags.KERNELS:
            if row[kernel] is None:
                cells.append("on")
            else:
                if row[kernel] not in reasons:
                    reasons.append(row[kernel])
                cells.append(f"refused ({reasons.index(row[kernel]) + 1})")
        lines.append(f"| {label} (`{row['model_type']}`) | {row['attention']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"({i}) {reason}" for i, reason in enumerate(reasons, start=1)]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the matrix here")
    args = parser.parse_args(argv)
    if args.json:
        args.json = flags.check_output_path(args.json, "--json", suffix=".json")
    env = flags.environment_info()
    rows = matrix()
    print(f"transformers {env['transformers']}, torch {env['torch']}, {env['date']}\n")
    print(markdown(rows))
    if args.json:
        flags.write_json_atomic(args.json, {"environment": env, "kernels": list(flags.KERNELS), "families": rows})
        print(f"\nWrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
