"""
One process of tests/fsdp_test.py's check of --ddp-shard-optimizer (ddp.ShardedUpdate), started twice by torchrun
(gloo on the CPU, NCCL on two GPUs, the weights' gathers by the copy engines where NCCL can).

Each process builds the same tiny LLaMA with ddp.PACKED_BYTES lowered, so that every matrix of
the decoder layers and of both embeddings is split into pieces (the script's tiny model splits
only its embeddings) while the norms stay whole, and trains it three steps on its own row through
training.train_step: the Triton AdamW over the pieces, clipping on (the gradient norm adds the
pieces' sums up over the processes), the gathers 0 (all during the optimizer step) and 1 layer
ahead of the running one (and with it the input embedding's gradient averaged over its used rows only), LoRA adapters on a frozen model, and --ddp-shard-weights on 7 layers (LayerWeights), each in a run of its own. The same process trains a copy alone on both
processes' rows (one process at batch 2: what --ddp must equal), with plain backward,
clip_grad_norm_ and step. Between the steps it calls what the CUDA-graph runner calls (before a
capture, after a replay, after a failed capture), and after steps 2 and 3 a forward under no_grad
(an evaluation) must gather by itself what the step left stale; then gather_now. Writes
FOLDER/rankN_aheadA[_lora|_release].json: the losses, norms and evaluation losses of both; the largest difference
between the weights and the copy's, and between the two processes' weights; the moments' sizes. Then
train_uneven (one process leaves an MLP unused, against the same with its output times 0) writes
FOLDER/rankN_uneven.json.

Usage (the test does this): torchrun --nproc-per-node 2 tests/ddp_pieces_worker.py FOLDER
"""

import copy
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

import kernel_common  # noqa: F401 - first: the Triton interpreter switch

import torch
from transformers import LlamaForCausalLM

from adamw_kernel import TritonAdamW
from kernel_ft import ddp, fsdp, layer_weights, models, training

PACKED_BYTES = 4096  # under every matrix of the tiny model (>= 32 KB), over its norms (512 B)
SEQ = 16


def batch_of(ids, device):
    rows, seq = ids.shape
    ids = ids.to(device)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(seq, device=device).expand(rows, seq)}


def train(folder, rank, size, ahead, device, lora, release=False, checkpointing=False):
    torch.manual_seed(0)
    config = models.tiny_config()
    if release:  # --ddp-shard-weights: past the first ahead + 1 layers (kept whole), more than slots (ahead + 2)
        config.num_hidden_layers = 7
    model = LlamaForCausalLM(config).to(device)
    if release:  # layer 4's MLP takes part in no forward (an MoE expert no token chose): its weights get no
        model.model.layers[4].mlp.forward = lambda x: x * 0  # gradient, and their pieces' are zeros, averaged
    if lora:  # adapters on every projection, the model frozen: the adapters over 4 KB are split
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # not PEFT's zeros: the first step's gradients reach every adapter
                torch.nn.init.normal_(p, std=0.02)
    alone = copy.deepcopy(model)
    recomputed = []  # --gradient-checkpointing: the decoder layers whose forward ran again inside a backward
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for i, layer in enumerate(model.model.layers):
            # On its attention, not the layer: transformers >= 5.2x checkpoints the layer's forward
            # inside its __call__, so the layer's own hooks do not run again; its modules' do.
            layer.self_attn.register_forward_pre_hook(
                lambda m, a, i=i: recomputed.append(i) if layer_weights._in_backward() else None)
    g = torch.Generator().manual_seed(7)
    steps = [torch.randint(0, 8192, (size, SEQ), generator=g) for _ in range(3)]  # row r: process r's
    held_out = batch_of(torch.randint(0, 8192, (2, SEQ), generator=g), device)

    ddp.PACKED_BYTES = PACKED_BYTES
    layer_weights.IN_FLIGHT_LAYERS = 2  # under the 5 released layers: the stream waits for the oldest gradients
    windows = len(ddp.WINDOWS)
    ddp.replicate_model(model, fsdp.World(rank, size, rank, device), shard_optimizer=True, gather_ahead=ahead,
                         copy_engines=True, embedding_rows=True, shard_weights=release)
    # One layer ahead: the input embedding's gradient averaged over the rows of the step's
    # ids only, outside a CUDA graph too (every process's rows have one shape here).
    model._gradient_average.rows_in_eager = ahead == 1
    params = ddp.optimizer_parameters(model, [p for p in model.parameters() if p.requires_grad])
    optimizer = TritonAdamW(params, lr=1e-3)
    ddp.attach_optimizer(model, optimizer)
    reference = TritonAdamW([p for p in alone.parameters() if p.requires_grad], lr=1e-3)

    # Between the steps, what the CUDA-graph runner tells ShardedUpdate around a capture, a
    # replay and a failed capture: each must leave a record the eager steps agree with (the
    # graph itself needs a GPU; this checks the host's bookkeeping it relies on).
    sharded = model._sharded_update
    between = {0: sharded.before_capture, 1: sharded.replayed, 2: sharded.capture_failed}
    losses, norms, want_losses, want_norms, evaluated, want_evaluated = [], [], [], [], [], []
    released = sharded.released
    if released is not None:
        # The pool hands slots out last-in first-out, and then each layer's backward happens to
        # find the slot its forward used. Shuffled before each gather (the same on both
        # processes), a backward's slot is often another one: what the forward saved must be
        # found through the saved-tensor notes.
        gather, shuffle = released._gather, random.Random(0).shuffle

        def shuffled(i, pooled=True):
            for free in released.free.values():
                shuffle(free)
            gather(i, pooled)

        released._gather = shuffled
    whole_between_steps = []  # --ddp-shard-weights: the layers' weights with memory after each step (none)
    for step, ids in enumerate(steps):
        loss, norm = training.train_step(model, optimizer, training.hf_loss, [batch_of(ids[rank:rank + 1], device)],
                                         max_grad_norm=1.0)
        if released is not None:
            whole_between_steps.append(sum(p.numel() for p in released.shape))
        losses.append(loss.item())
        norms.append(norm.item())
        want = training.hf_loss(alone, batch_of(ids, device))
        want.backward()
        want_norms.append(reference.clip_grad_norm_(1.0).item())
        reference.step()
        reference.zero_grad(set_to_none=True)
        want_losses.append(want.item())
        between[step]()
        if step > 0:
            # Pieces updated by the step: with gathers ahead, only the first owners are
            # whole; the forward's hooks must gather the rest by themselves.
            with torch.no_grad():
                evaluated.append(training.hf_loss(model, held_out).item())
                want_evaluated.append(training.hf_loss(alone, held_out).item())
    ddp.gather_now(model)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    theirs = [torch.empty_like(weights) for _ in range(size)]
    torch.distributed.all_gather(theirs, weights)
    pieces = model._gradient_average.pieces
    report = {
        "rank": rank, "ahead": ahead, "losses": losses, "want_losses": want_losses, "norms": norms,
        "want_norms": want_norms, "evaluated": evaluated, "want_evaluated": want_evaluated,
        "split": len(pieces), "whole": sum(1 for p in model.parameters() if p.requires_grad and p not in pieces),
        "worst_vs_alone": max((p - q).abs().max().item() for p, q in zip(model.parameters(), alone.parameters())),
        "worst_between_processes": (theirs[0] - theirs[1]).abs().max().item(),
        "rows_averaged": model._gradient_average.rows_averaged,
        "windows": len(ddp.WINDOWS) - windows,  # NCCL windows this run registered (the copy engines' gathers)
        "moments_are_pieces": all(optimizer.state[piece]["exp_avg"].numel() * size == p.numel()
                                  for p, piece in pieces.items()),
    }
    if released is not None:
        report["released"] = len(released.shape)
        report["whole_between_steps"] = whole_between_steps
        report["slots"] = {str(k): len(v) for k, v in released.free.items()}
        report["recomputed"] = recomputed
    name = f"rank{rank}_ahead{ahead}{'_lora' if lora else ''}{'_release' if release else ''}" \
           f"{'_checkpointing' if checkpointing else ''}.json"
    with open(os.path.join(folder, name), "w") as f:
        json.dump(report, f)


def train_uneven(rank, size, device, unused):
    """--ddp-shard-weights where one process's backward does not make some gradients: layer 5's
    MLP on rank 1, as an MoE expert no token of its batch chose, in both micro-batches of the
    first step (no gradient at all) and in the second micro-batch of the next two (--grad-accum:
    the gradient the first one made is the sum). Rank 1 would hold its later averages back to
    the end of backward, and rank 0's stream, which waits for its reduce-scatters one layer back
    (IN_FLIGHT_LAYERS = 1), would wait for rank 1 while rank 1 waits for rank 0's gathers; rank 1
    makes those gradients two layers later instead (GradientAverage.made_by_now). ``unused``
    False: the MLP runs and its output is multiplied by 0, so its gradients exist and are zeros,
    the numbers made_by_now must give. Returns the losses, the weights after three steps and
    what the run held."""
    torch.manual_seed(0)
    config = models.tiny_config()
    config.num_hidden_layers = 7
    model = LlamaForCausalLM(config).to(device)
    skipped = iter([True, True, False, True, False, True])  # per micro-batch: does rank 1 skip the MLP?
    if rank == 1:
        mlp = model.model.layers[5].mlp
        forward = mlp.forward

        def sometimes(x):
            if next(skipped):
                return x * 0 if unused else forward(x) * 0
            return forward(x)

        mlp.forward = sometimes
    layer_weights.IN_FLIGHT_LAYERS = 1
    ddp.PACKED_BYTES = PACKED_BYTES
    ddp.replicate_model(model, fsdp.World(rank, size, rank, device), shard_optimizer=True, gather_ahead=1,
                         copy_engines=True, embedding_rows=False, shard_weights=True)
    average = model._gradient_average
    most, average_piece = [0], average._average_piece

    def counted(p):  # how many whole gradients wait for their reduce-scatters at once, eager steps included
        average_piece(p)
        most[0] = max(most[0], len(average.in_flight))

    average._average_piece = counted
    optimizer = TritonAdamW(ddp.optimizer_parameters(model, [p for p in model.parameters() if p.requires_grad]),
                            lr=1e-3)
    ddp.attach_optimizer(model, optimizer)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 8192, (2 * size, SEQ), generator=g)  # rows 2r and 2r + 1: process r's micro-batches
        micro_batches = [batch_of(ids[2 * rank + k:2 * rank + k + 1], device) for k in (0, 1)]
        loss, _ = training.train_step(model, optimizer, training.hf_loss, micro_batches, max_grad_norm=1.0)
        losses.append(loss.item())
    ddp.gather_now(model)
    weights = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
    return losses, weights, {"released": len(average.released.shape), "most_in_flight": most[0],
                             "in_flight_cap": average.released.in_flight}


def main(folder):
    # On GPUs, NCCL (in place, as the script runs it); else gloo on the CPU, the Triton AdamW
    # in the interpreter.
    on_gpu = torch.cuda.is_available()
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:  # the weights' gathers by the copy engines, as the script sets it up (fsdp.init_distributed)
        torch.cuda.set_device(device)
        os.environ.setdefault("NCCL_CTA_POLICY", ddp.NCCL_ZERO_CTA)
    torch.distributed.init_process_group("nccl" if on_gpu else "gloo")
    size = torch.distributed.get_world_size()
    for ahead, lora, release, checkpointing in ((0, False, False, False), (1, False, False, False),
                                                (1, True, False, False), (1, False, True, False),
                                                (1, False, True, True)):
        train(folder, rank, size, ahead, device, lora, release, checkpointing)
    losses, weights, held = train_uneven(rank, size, device, unused=True)
    zero_losses, zero_weights, _ = train_uneven(rank, size, device, unused=False)
    with open(os.path.join(folder, f"rank{rank}_uneven.json"), "w") as f:
        json.dump({"losses": losses, "zero_losses": zero_losses,
                   "worst_vs_zeros": (weights - zero_weights).abs().max().item(), **held}, f)
    fsdp.close_distributed()  # NCCL's windows deregistered before the group goes


if __name__ == "__main__":
    main(sys.argv[1])
