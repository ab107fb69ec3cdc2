"""
One process of tests/fsdp_test.py's check of --ddp's gradient averages, started twice by torchrun (gloo).

Each process builds the same small model (one weight over the packing size, averaged alone
and in place; small ones packed into groups; one weight process 1 never uses, one process 0
never uses, one only the first micro-batch uses; one frozen) and runs, on its own data,
what the training step runs under --ddp (ddp.averaged_backward): two micro-batches, the
first without averaging, in two steps (the first learns the order). It also computes both
processes' gradients itself, without communication, and checks that every averaged
gradient is their mean, bit for bit (float32; a half of each plus the other is the
rounding of the mean of two), and how many collectives a step took. Then a weight that
gets a gradient twice in one averaged backward must be refused in one line.
Writes FOLDER/rankN.json: what the test checks.

Usage (the test does this): torchrun --nproc-per-node 2 tests/ddp_average_worker.py FOLDER
"""

import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

import kernel_common  # noqa: F401 - first: the Triton interpreter switch

import torch
import torch.nn as nn

from kernel_ft import ddp, fsdp

PACKED_BYTES = 8192  # under `big`'s weight (64 x 64 x 4 bytes): that one is a group alone
GROUP_BYTES = 1024  # `small.0.weight` (2 KB) fills a group of its own; the others share


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(64, 64)
        self.small = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 1))
        self.extra = nn.Parameter(torch.randn(64))  # process 1 never uses it
        self.late = nn.Parameter(torch.randn(64))  # process 0 never uses it: the end of the learned order
        self.early = nn.Parameter(torch.randn(64))  # the first micro-batch only: made, but not in the last backward
        self.frozen = nn.Parameter(torch.randn(64), requires_grad=False)

    def forward(self, x, rank, first):
        h = torch.tanh(self.big(x)) + self.frozen
        if rank == 0:
            h = h * self.extra
        else:
            h = h + self.late
        if first:
            h = h - self.early
        return self.small(h).square().mean()


def micro_batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(5, 64, generator=g) for _ in range(2)]


def main(folder):
    torch.distributed.init_process_group("gloo")
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)  # both processes' gradients, computed here alone
    want = {}
    for r in range(size):
        reference.zero_grad(set_to_none=True)
        for i, x in enumerate(micro_batches(r)):
            reference(x, r, i == 0).backward()
        for name, p in reference.named_parameters():
            if p.requires_grad:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                want[name] = want.get(name, 0) + g / size

    ddp.PACKED_BYTES = PACKED_BYTES
    ddp.replicate_model(model, fsdp.World(rank, size, rank, torch.device("cpu")), bucket_mb=GROUP_BYTES / 2**20)
    all_reduce = torch.distributed.all_reduce
    steps = []
    for _ in range(2):  # the first averaged backward learns the order, the second uses it
        calls = []

        def counted(tensor, *args, **kwargs):
            calls.append(tensor.numel())
            return all_reduce(tensor, *args, **kwargs)

        torch.distributed.all_reduce = counted
        model.zero_grad(set_to_none=True)
        batches = micro_batches(rank)
        for i, x in enumerate(batches):
            with ddp.averaged_backward(model, last=i == len(batches) - 1):
                model(x, rank, i == 0).backward()
            if i == 0:
                after_first = len(calls)
        torch.distributed.all_reduce = all_reduce
        steps.append({"collectives": calls, "after_first_micro_batch": after_first,
                      "differ": [name for name, p in model.named_parameters()
                                 if p.requires_grad and not torch.equal(p.grad, want[name])]})
    groups = model._gradient_average.groups

    refused = None
    model.zero_grad(set_to_none=True)
    try:
        with ddp.averaged_backward(model):
            model(batches[0], 0, False).backward()  # the same weights on both: the same groups averaged
            model(batches[0], 0, False).backward()  # the same weights again, after they were averaged
    except RuntimeError as e:
        refused = str(e)
    report = {"rank": rank, "steps": steps, "groups": [[model._gradient_average.names[p] for p in g] for g in groups],
              "frozen_grad": model.frozen.grad is not None, "refused": refused}
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
