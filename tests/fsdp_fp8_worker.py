"""
One process of tests/fsdp_test.py's FP8-gather check, started twice by torchrun (gloo).

For trained and then frozen weights, each process builds the same tiny model (conftest's narrow one) with
per-tensor FP8 layers (emulated FP8 on the CPU), keeps an unsharded copy, shards the
other (FSDP2, every decoder layer and the root) and switches its FP8 weights to gathers
in FP8 (kernel_ft/fp8_gather.py). Then two steps (forward, backward, the script's AdamW)
on the same batch in both: the losses and every gradient (whole) must be equal, bit for
bit; the layers' forwards must see the gathered FP8 weights; frozen weights (those of
the attention) are cast once, not at every gather, and a trained weight's cast is never
kept. Then a sharded checkpoint (DCP) of it loads into another model.
Writes one JSON report per mode and process, FOLDER/MODE-rankN.json: what the test checks
(files, not stdout: two processes' lines can interleave on one pipe).

Usage (the test does this): torchrun --nproc-per-node 2 tests/fsdp_fp8_worker.py FOLDER
"""

import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

import kernel_common  # noqa: F401 - first: the Triton interpreter switch

import torch
from torch.distributed.fsdp import fully_shard

from adamw_kernel import TritonAdamW
from conftest import narrow_tiny_config
from fp8_kernel import FP8Linear, replace_linears
from kernel_ft import checkpoints, fp8_gather, models


def build(mode, seed):
    """The tiny model with FP8 layers, and an unsharded copy of it."""
    torch.manual_seed(seed)
    model = models.build_random(narrow_tiny_config(), torch.device("cpu"), torch.float32)
    if mode == "frozen":  # as under --lora, the attention's weights frozen, the MLPs' and the embedding trained:
        for name, p in model.named_parameters():  # one FSDP unit holds both kinds
            p.requires_grad_(".self_attn." not in name)
    replace_linears(model, "tensorwise", emulate=True)
    return model, copy.deepcopy(model)


def shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return fp8_gather.attach(model)


def same_addresses():
    """Each weight's maximum at the same address at every gather, as the GPU's caching
    allocator places them (CPU malloc moves them, which would hide a cast kept by address)."""
    measure, slots = fp8_gather._Group.measure, {}

    def measure_in_place(group, mesh):
        measure(group, mesh)
        for m, amax in group.amax.items():
            group.amax[m] = slots.setdefault(m, torch.empty_like(amax)).copy_(amax)
    fp8_gather._Group.measure = measure_in_place


def check(mode, folder):
    """Two steps of ``mode`` (trained or frozen FP8 weights), a checkpoint, a load: the report."""
    model, unsharded = build(mode, 0)
    attached = shard(model)

    seen = set()
    for m in model.modules():
        if isinstance(m, FP8Linear):
            m.register_forward_pre_hook(lambda module, args: seen.add(type(module.weight).__name__))
    casts = []
    quantize = fp8_gather.quantize
    fp8_gather.quantize = lambda *a, **k: casts.append(1) or quantize(*a, **k)

    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    # The script's optimizer: its kernel writes the weights without moving their version
    # counters (a cast cached by version would go stale; torch's SGD would hide that).
    optimizers = [TritonAdamW([p for p in m.parameters() if p.requires_grad], lr=0.05)
                  for m in (model, unsharded)]
    steps = []
    for _ in range(2):
        casts.clear()
        losses = []
        for m in (model, unsharded):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        truth = dict(unsharded.named_parameters())
        differ = [name for name, p in model.named_parameters()
                  if (p.grad is None) != (truth[name].grad is None)
                  or (p.grad is not None and not torch.equal(p.grad.full_tensor(), truth[name].grad))]
        steps.append({"losses": losses, "differ": differ, "casts": len(casts)})
        for o in optimizers:
            o.step()
            o.zero_grad()
    fp8_gather.quantize = quantize
    # A trained weight's cast must never be kept: its shard changes in place at every step,
    # and on a GPU the new maxima may land at the old ones' address (the caching allocator).
    kept = sum(m._fp8_shard_cache is not None for m in model.modules()
               if isinstance(m, FP8Linear) and m.weight.requires_grad)

    # A sharded checkpoint (DCP) of the FP8 shards loads into another model's FP8 shards.
    checkpoints.save_sharded(folder, model, optimizers[0])
    other = build(mode, 1)[0]
    shard(other)
    if mode == "frozen":  # gathered before the load: its cached casts must not outlive it
        other(input_ids=ids, labels=ids).loss.backward()
    checkpoints.load_sharded(folder, other, TritonAdamW([p for p in other.parameters() if p.requires_grad]))
    with torch.no_grad():
        loaded = [m(input_ids=ids, labels=ids).loss.item() for m in (model, other)]
    rank = torch.distributed.get_rank()
    with open(f"{folder}-rank{rank}.json", "w") as f:
        json.dump({"mode": mode, "rank": rank, "attached": attached, "seen": sorted(seen), "steps": steps,
                   "trained_casts_kept": kept, "loaded": loaded}, f)


if __name__ == "__main__":
    torch.distributed.init_process_group("gloo")
    same_addresses()
    for mode in ("trained", "frozen"):
        check(mode, os.path.join(sys.argv[1], mode))
    torch.distributed.destroy_process_group()
