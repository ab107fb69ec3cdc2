"""
Which fused kernels each decoder family gets: the support matrix, measured.

For every family below, a tiny random model is built from transformers' own config
class (no download) and each kernel is switched in alone by finetune_optimized.py's
``apply_kernels``, the code a run uses. A kernel either goes in, or is refused with
the one-line reason a run would print: the swaps are checked against the module or
function they replace (swap_common.SwapMismatch, the RoPE check, the LM-head
probe), so "on" means the family's own computation was reproduced, not that a name
matched. The table is generated, never written by hand: README's matrix is this
tool's output. Losses against the baseline are tested in tests/families_test.py.

Usage:
    python tools/family_matrix.py                       # markdown table
    python tools/family_matrix.py --json matrix.json
    python tools/family_matrix.py --readme              # its summary into README.md (tests/families_test.py checks it)
"""

import argparse
import contextlib
import copy
import io
import os

from kernel_ft import flags  # first: the Triton interpreter switch, then transformers
from kernel_ft import files, models, reporting
import torch
import transformers
from kernel_ft.run import apply_kernels

# The swaps' checks run the kernels: on the GPU there is one, else through the interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    return transformers.AutoConfig.for_model(model_type, **{**TINY, **extra})  # extra may override TINY


# The kernels whose modules variants() reads; the rest of it reads the config. kernel_ft.apply
# switches these two in first, and the later kernels change neither their modules nor the
# config fields read, so these alone give the variants that all the kernels together give.
VARIANT_KERNELS = ("rmsnorm", "swiglu")


def variants(model):
    """What each kernel computes for this family, read from the model after the kernels
    of VARIANT_KERNELS that go in were switched in, and from its config: the RMSNorm's
    weight and casting order, the gated activation and its layout, how much of each head
    RoPE turns, the fused loss's logit transform."""
    from linear_cross_entropy_kernel import logit_multiplier
    from rmsnorm_kernel import TritonRMSNorm
    from swiglu_kernel import TritonGateUpMLP, TritonLlamaMLP

    found = []
    norms = {(m.weight_offset, m.cast_first) for m in model.modules() if isinstance(m, TritonRMSNorm)}
    for offset, cast_first in sorted(norms):
        weight = "1 + w" if offset == 1.0 else "w"
        found.append(f"RMSNorm {weight} ({'cast, then weight' if cast_first else 'float32, cast last'})")
    names = {"silu": "SwiGLU", "gelu_tanh": "GeGLU"}
    mlps = {(names[m.activation], "one gate_up_proj" if isinstance(m, TritonGateUpMLP) else "")
            for m in model.modules() if isinstance(m, TritonLlamaMLP)}
    mlps |= {(names[m.fused_activation], "MoE experts") for m in model.modules() if hasattr(m, "fused_activation")}
    found += [f"{act} ({layout})" if layout else act for act, layout in sorted(mlps)]
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = getattr(config, "partial_rotary_factor", None)
    if partial and partial < 1.0:
        found.append(f"RoPE on {int(head_dim * partial)} of {head_dim} dims")
    scale = logit_multiplier(config)
    if scale != 1.0:
        found.append(f"logits x {scale:g}")
    if getattr(config, "final_logit_softcapping", None):
        found.append(f"logits soft-capped at {config.final_logit_softcapping:g}")
    return "; ".join(found)


def matrix():
    """{label: {"model_type", "attn_implementation", kernel: None (on) or the refusal, "variants"}},
    every kernel alone, then those of VARIANT_KERNELS that went in together for the variants."""
    rows = {}
    for label, model_type, extra in FAMILIES:
        torch.manual_seed(0)
        model = models.build_random(family_config(model_type, extra), DEVICE, torch.float32)
        row = {"model_type": model_type, "attn_implementation": model.config._attn_implementation}
        for kernel in flags.KERNELS:
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    apply_kernels(copy.deepcopy(model), {kernel: True})
                row[kernel] = None
            except SystemExit as e:
                row[kernel] = str(e.code).removeprefix("error: ")
        # Not every kernel that went in: the checks of attention, flce, ce and rope run the
        # model again, through the interpreter and the RMSNorm / MLP kernels already in, which
        # was most of this function's time, for nothing variants() reads. That all of them go
        # in together and give the baseline's loss is tested in tests/families_test.py.
        with contextlib.redirect_stdout(io.StringIO()):
            apply_kernels(model, {k: True for k in VARIANT_KERNELS if row[k] is None})
        row["variants"] = variants(model)
        rows[label] = row
    return rows


def markdown(rows):
    """The matrix as a markdown table; each refusal once, numbered, under it."""
    reasons = []
    lines = ["| family (`model_type`) | HF attention | " + " | ".join(flags.KERNELS) + " | variants |",
             "|---|---|" + "---|" * (len(flags.KERNELS) + 1)]
    for label, row in rows.items():
        cells = []
        for kernel in flags.KERNELS:
            if row[kernel] is None:
                cells.append("on")
            else:
                if row[kernel] not in reasons:
                    reasons.append(row[kernel])
                cells.append(f"refused ({reasons.index(row[kernel]) + 1})")
        lines.append(f"| {label} (`{row['model_type']}`) | {row['attn_implementation']} | " + " | ".join(cells)
                     + f" | {row['variants'] or '-'} |")
    lines.append("")
    lines += [f"({i}) {reason}" for i, reason in enumerate(reasons, start=1)]
    return "\n".join(lines)


def summary(rows):
    """The matrix in fewer lines for README: families with the same kernels, variants
    and attention in one row, then the reasons of the refusals."""
    reasons, groups = [], {}
    for label, row in rows.items():
        refused = []
        for kernel in flags.KERNELS:
            if row[kernel] is not None:
                if row[kernel] not in reasons:
                    reasons.append(row[kernel])
                refused.append(f"{kernel} ({reasons.index(row[kernel]) + 1})")
        kernels = "all but " + ", ".join(refused) if refused else f"all {len(flags.KERNELS)}"
        variants = row["variants"] + ("; eager attention" if row["attn_implementation"] != "sdpa" else "")
        groups.setdefault((kernels, variants), []).append(label)
    lines = ["| families | kernels | variants |", "|---|---|---|"]
    lines += [f"| {', '.join(labels)} | {kernels} | {variants or '-'} |" for (kernels, variants), labels in groups.items()]
    lines.append("")
    lines += [f"({i}) {reason}" for i, reason in enumerate(reasons, start=1)]
    return "\n".join(lines)


README_START = "<!-- tools/family_matrix.py: start -->"
README_END = "<!-- tools/family_matrix.py: end -->"


def readme_matrix(text):
    """The matrix as README holds it, between the two markers."""
    return text.split(README_START, 1)[1].split(README_END, 1)[0].strip()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the matrix here")
    parser.add_argument("--readme", action="store_true",
                        help="write its summary (summary()) into README.md, between the markers")
    args = parser.parse_args(argv)
    if args.json:
        args.json = files.check_output_path(args.json, "--json", suffix=".json")
    env = reporting.environment_info()
    rows = matrix()
    print(f"transformers {env['transformers']}, torch {env['torch']}, {env['date']}\n")
    print(markdown(rows))
    if args.json:
        files.write_json_atomic(args.json, {"environment": env, "kernels": list(flags.KERNELS), "families": rows})
        print(f"\nWrote {args.json}")
    if args.readme:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
        with open(path) as f:
            text = f.read()
        text = text.replace(readme_matrix(text), summary(rows))
        with open(path, "w") as f:
            f.write(text)
        print(f"Wrote the table into {path}")
    return rows


if __name__ == "__main__":
    main()
