"""
Every causal LM transformers knows, through kernel_ft.apply: the same numbers, or a refusal.

tools/family_matrix.py measures the families the kernels are written for. This sweep
asks the wider question a user's model raises: for each model type in transformers'
causal-LM mapping, a tiny random model (family_matrix's TINY shapes, float32, in eval
mode: nothing random) computes its loss and gradients with the model's own code, then again after
``kernel_ft.apply(model)`` with every kernel on, once without a mask and once with a
left-padding mask. A kernel either went in and the numbers are the model's (to float32
rounding), or it was left to PyTorch with a one-line reason. Anything else is a bug:
``DIFFERS`` (other numbers) or ``APPLY-ERROR`` (apply raised instead of refusing).
Model types that cannot build or run at these shapes by themselves are listed as such; one
that TINY's widths refuse because of another head count (an indexer's, a decoder's own) is
tried once more with those counts cut to TINY's key-value heads, named on its row.

``--image-text`` sweeps the image-text-to-text mapping instead (LLaVA, Qwen2-VL, ...): the text
sub-config at TINY's shapes, the other towers at VISION_TINY's, the same text-only rows (what
the vision towers do with an image is tests/apply_test.py's section 7b).

Gradients are compared per tensor by relative norm, against at least 1% of the largest
gradient's norm (analytically zero ones, such as the key bias under softmax, come out
as rounding noise either way).

Usage:
    python tools/family_sweep.py                       # every model type (CPU: about an hour)
    python tools/family_sweep.py --only llama bert     # some
    python tools/family_sweep.py --json sweep.json
    python tools/family_sweep.py --image-text          # the image-text models, text only
"""

import argparse
import contextlib
import copy
import io
import json
import multiprocessing
import os
import queue as queue_module
import resource
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: tools.family_matrix

from kernel_ft import flags  # noqa: F401 - first: the Triton interpreter switch, then transformers
import kernel_ft
import swap_common
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

from tools.family_matrix import TINY

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # float32: the kernels round differently, never by more
MAX_PARAMETERS = 150_000_000  # a tiny model has ~0.2 M; more means tables or experts TINY does not shrink
MEMORY_LIMIT = 8 * 2**30  # bytes of address space per model type
# An image-text model's other towers (vision, audio), as small as their configs take (keys a config
# does not have are ignored by it): one layer, 2 x 2 patches of 14 pixels.
VISION_TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   image_size=28, patch_size=14, depth=1, embed_dim=32, num_heads=2)


def _one_line(e, width=140):
    return f"{type(e).__name__}: {' '.join(str(e).split())[:width]}"


def loss_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(ours, theirs):
    """(relative loss difference, worst relative gradient difference, same parameters got gradients)."""
    (loss, grads), (ref_loss, ref_grads) = ours, theirs
    top = max((g.norm().item() for g in ref_grads.values()), default=0.0)
    # Relative to each tensor's own norm, floored at 1% of the largest: a gradient near zero
    # (a key bias under softmax, DiffLlama's lambdas) is float32 noise either way.
    worst = max(((grads[n] - g).norm().item() / max(g.norm().item(), 1e-2 * top) for n, g in ref_grads.items()
                 if n in grads), default=0.0)
    return abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12), worst, grads.keys() == ref_grads.keys()


def tiny_image_text_config(model_type):
    """The type's config: its text sub-config at TINY's shapes, its other sub-configs at VISION_TINY's."""
    default = transformers.AutoConfig.for_model(model_type)
    text = default.get_text_config()
    subs = {key: dict(TINY if getattr(default, key, None) is text else VISION_TINY) for key in default.sub_configs
            if getattr(default, key, None) is not None}
    return transformers.AutoConfig.for_model(model_type, **subs)


def other_head_counts(model_type):
    """The type's head counts that TINY does not set (an indexer's, a linear-attention or Mamba
    mixer's, an encoder-decoder's decoder heads), cut to TINY's key-value heads, which divide every
    TINY width; {} when it has none above that. Keys an attribute_map points TINY's names to are
    TINY's own (GPT-2's n_head is num_attention_heads)."""
    default = transformers.AutoConfig.for_model(model_type)
    aliases = set(getattr(default, "attribute_map", {}).values())
    few = TINY["num_key_value_heads"]
    return {key: few for key, value in default.to_dict().items()
            if key.endswith("heads") and key not in TINY and key not in aliases and type(value) is int and value > few}


def settable(model_type, shapes):
    """``shapes`` without the keys the type's config computes itself (a property with no
    setter: Falcon's head_dim, hidden_size // num_attention_heads, which is TINY's anyway)."""
    config_class = CONFIG_MAPPING[model_type]
    return {key: value for key, value in shapes.items()
            if not (isinstance(getattr(config_class, key, None), property) and getattr(config_class, key).fset is None)}


def build(model_type, image_text, auto, fewer_heads):
    """(model at the tiny shapes, float32, eval mode, or None when over MAX_PARAMETERS; its size)."""
    if image_text:
        config = tiny_image_text_config(model_type)
    else:
        config = transformers.AutoConfig.for_model(model_type, **settable(model_type, TINY), **fewer_heads)
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        if (getattr(part, "pad_token_id", None) or 0) >= TINY["vocab_size"]:
            part.pad_token_id = 0  # the family's own id is outside the tiny vocabulary
    for part in [config, *(getattr(config, key) for key in config.sub_configs if getattr(config, key, None))]:
        for key, value in part.to_dict().items():
            if "dropout" in key and isinstance(value, float):
                setattr(part, key, 0.0)
    with torch.device("meta"):  # count first: some types keep huge tables at any hidden size
        size = sum(p.numel() for p in auto.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        return None, size
    torch.manual_seed(0)
    # Eval mode: no dropout by any name, no router jitter (PhiMoE); gradients flow as in training.
    return auto.from_config(config).float().eval(), size


def sweep_one(model_type, image_text=False):
    """One model type's row: {"type", "status", "applied", "refused", "detail"}."""
    row = {"type": model_type, "applied": [], "refused": {}, "detail": ""}
    auto = transformers.AutoModelForImageTextToText if image_text else transformers.AutoModelForCausalLM
    fewer = {}
    try:
        model, size = build(model_type, image_text, auto, fewer)
    except Exception as e:  # noqa: BLE001 - the type itself does not build at these shapes
        refusal = {**row, "status": "does not build", "detail": _one_line(e)}
        # Its other head counts may be what TINY's widths refuse (Kolibri's 12 indexer heads over 4
        # query heads, Whisper's 6 decoder heads over a width of 64): once more with them cut.
        if image_text:
            return refusal
        try:
            fewer = other_head_counts(model_type)
            if not fewer:
                return refusal
            model, size = build(model_type, image_text, auto, fewer)
        except Exception:  # noqa: BLE001 - not the heads, then: the first reason stands
            return refusal
    if model is None:
        return {**row, "status": "too large", "detail": f"{size / 1e6:.0f} M parameters at the tiny shapes"}
    result = check(row, model)
    if fewer:  # said on the row: these are not TINY's shapes alone
        result["detail"] = f"{', '.join(f'{k}={v}' for k, v in fewer.items())}; {result['detail']}"
    return result


def check(row, model):
    """The model's own loss and gradients against those after kernel_ft.apply, with and without a padding mask."""
    vocab = min(swap_common.vocabulary_size(model) or TINY["vocab_size"], TINY["vocab_size"])
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    theirs = copy.deepcopy(model)
    try:
        refs = [loss_and_grads(theirs, ids, m) for m in (None, mask)]
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "does not run", "detail": _one_line(e)}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            report = kernel_ft.apply(model)
    except Exception as e:  # noqa: BLE001 - a bug: apply must refuse in its report, not raise
        return {**row, "status": "APPLY-ERROR", "detail": _one_line(e)}
    row["applied"], row["refused"] = report.applied, report.left_out
    checks = []
    for name, m, ref in (("no mask", None, refs[0]), ("padding", mask, refs[1])):
        try:
            dl, dg, same = compare(loss_and_grads(model, ids, m), ref)
        except Exception as e:  # noqa: BLE001 - a bug too: the model ran before the kernels
            return {**row, "status": "APPLY-ERROR", "detail": f"{name}: {_one_line(e)}"}
        checks.append(f"{name}: loss {dl:.0e}, grads {dg:.0e}" + ("" if same else ", other parameters"))
        if dl > LOSS_TOL or dg > GRAD_TOL or not same:
            return {**row, "status": "DIFFERS", "detail": "; ".join(checks)}
    return {**row, "status": "same", "detail": "; ".join(checks)}


def _child(model_type, image_text, queue):
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))  # a MemoryError here, not the OOM killer
    queue.put(sweep_one(model_type, image_text))


def in_a_child(model_type, timeout, image_text=False):
    """sweep_one in a process of its own: a model type that hangs or takes the machine's
    memory (Falcon-H1's tiny config does) costs its own row, not the sweep."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(model_type, image_text, queue))
    child.start()
    try:
        return queue.get(timeout=timeout)
    except queue_module.Empty:
        status = "timed out" if child.is_alive() else f"crashed (exit {child.exitcode})"
        return {"type": model_type, "status": status, "applied": [], "refused": {}, "detail": ""}
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="these model types (default: every one)")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per model type (default 180)")
    parser.add_argument("--image-text", action="store_true",
                        help="the image-text-to-text mapping instead (text-only rows; the other towers at VISION_TINY)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    types = args.only or sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if args.image_text
                                else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {len(types)} model types")
    print(f"{'model type':<28} {'result':<15} kernels in / detail")
    rows = []
    for model_type in types:
        row = in_a_child(model_type, args.timeout, args.image_text)
        rows.append(row)
        what = ",".join(row["applied"]) if row["status"] == "same" else row["detail"]
        print(f"{model_type:<28} {row['status']:<15} {what}", flush=True)
    counts = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    print("\n" + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transformers": transformers.__version__, "rows": rows}, f, indent=1)
    return 1 if counts.get("DIFFERS") or counts.get("APPLY-ERROR") else 0


if __name__ == "__main__":
    raise SystemExit(main())
