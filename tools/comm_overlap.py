"""How much a collective beside a matmul costs the matmul, per kind of memory.

    torchrun --standalone --nproc-per-node 2 tools/comm_overlap.py [--memory plain|window] [--json F]

Under --ddp-shard-optimizer every large weight is all-gathered in place while the
forward's matmuls run, and every large gradient reduce-scattered in place beside the
backward's. NCCL's kernels take SMs from the matmuls. This measures, on the GPUs of one
host, three things for each collective: a train of bf16 matmuls alone, the collective
alone (the 8B decoder layer's seven weights, in place), and both at once (the collective
on a side stream), so that the matmuls' slowdown and the collective's own time can be
read off. ``--memory window``: the tensors are allocated from NCCL's own allocator and
registered as symmetric windows (torch's ProcessGroupNCCL.register_mem_pool), where
NCCL 2.27+ runs its symmetric kernels and, with NCCL_CTA_POLICY=2 (zero CTAs) set
before the communicator is made, moves all-gathers with the copy engines instead of SMs.
A copy engine cannot add, so a reduce-scatter stays on SMs. In ordinary memory a third
row measures its movement as an all-to-all (process j receives every process's piece j
into a scratch tensor) followed by one local sum of the N pieces (their mean): slower than NCCL's
reduce-scatter on 2 x H200, alone and beside the matmuls (results/ddp/exchange/); in
windows with the zero-CTA policy that row did not finish there, so it is left out.
Rank 0 prints one table and writes the JSON.
"""
import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist

# One LLaMA-3.1-8B decoder layer's weights (q, k, v, o, gate, up, down), in elements.
LAYER = [4096 * 4096, 1024 * 4096, 1024 * 4096, 4096 * 4096, 14336 * 4096, 14336 * 4096, 4096 * 14336]


def timed(fn, stream):
    """Milliseconds of ``fn()`` queued on ``stream`` (events on that stream)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        fn()
        end.record()
    return start, end


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory", choices=("plain", "window"), default="plain")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers' weights per collective train")
    parser.add_argument("--matmuls", type=int, default=60, help="8192^3 bf16 matmuls in the train")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, size = dist.get_rank(), dist.get_world_size()
    pool = None
    if args.memory == "window":
        backend = dist.group.WORLD._get_backend(device)
        if not hasattr(backend, "mem_allocator") or not hasattr(backend, "register_mem_pool"):
            raise SystemExit(f"error: torch {torch.__version__} has no ProcessGroupNCCL.mem_allocator / "
                             f"register_mem_pool")
        pool = torch.cuda.MemPool(backend.mem_allocator)
    sizes = [n for _ in range(args.layers) for n in LAYER]
    with torch.cuda.use_mem_pool(pool) if pool is not None else contextlib.nullcontext():
        tensors = [torch.randn(n, device=device, dtype=torch.bfloat16) for n in sizes]
    # the all-to-all's output (ordinary memory only: below)
    scratch = torch.empty(max(sizes), device=device, dtype=torch.bfloat16) if pool is None else None
    if pool is not None:
        try:
            dist.group.WORLD._get_backend(device).register_mem_pool(pool, symm=True)
        except TypeError as error:  # a torch whose register_mem_pool has no symm argument
            raise SystemExit(f"error: torch {torch.__version__} cannot register symmetric windows: {error}")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    compute, side = torch.cuda.current_stream(), torch.cuda.Stream()

    def matmuls():
        for _ in range(args.matmuls):
            torch.mm(a, b, out=out)

    def gathers():
        for t in tensors:
            n = t.numel() // size
            dist.all_gather_into_tensor(t, t.narrow(0, rank * n, n))

    def scatters():
        for t in tensors:
            n = t.numel() // size
            dist.reduce_scatter_tensor(t.narrow(0, rank * n, n), t, op=dist.ReduceOp.AVG)

    def exchanges():
        for t in tensors:
            n = t.numel() // size
            received = scratch.narrow(0, 0, t.numel())
            dist.all_to_all_single(received, t)  # received[j n:(j+1) n] = process j's piece `rank`
            torch.mean(received.view(size, n), 0, out=t.narrow(0, rank * n, n))

    collectives = [("all-gather", gathers), ("reduce-scatter", scatters)]
    if pool is None:
        collectives.append(("all-to-all + sum", exchanges))

    moved = sum(sizes) * 2  # bytes of the whole tensors
    rows = {}
    for name, collective in collectives:
        best = {}
        for _ in range(args.repeats + 1):  # the first round warms NCCL and the matmul up
            dist.barrier()
            torch.cuda.synchronize()
            alone_mm = timed(matmuls, compute)
            torch.cuda.synchronize()
            dist.barrier()
            alone_c = timed(collective, side)
            torch.cuda.synchronize()
            dist.barrier()
            side.wait_stream(compute)
            both_c = timed(collective, side)
            both_mm = timed(matmuls, compute)
            torch.cuda.synchronize()
            times = {"matmuls alone": alone_mm, "collective alone": alone_c,
                     "collective beside": both_c, "matmuls beside": both_mm}
            for key, (s, e) in times.items():
                best[key] = min(best.get(key, float("inf")), s.elapsed_time(e))
        rows[name] = best
    result = {"memory": args.memory, "nccl_cta_policy": os.environ.get("NCCL_CTA_POLICY", "(unset)"),
              "processes": size, "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "bytes": moved, "rows": rows}
    if rank == 0:
        print(f"{result['gpu']} x {size}, torch {result['torch']}, NCCL {result['nccl']}; memory {args.memory}, "
              f"NCCL_CTA_POLICY {result['nccl_cta_policy']}; {moved / 2**30:.2f} GiB of tensors, "
              f"{args.matmuls} matmuls 8192^3 bf16; best of {args.repeats}, ms")
        print(f"{'collective':<24}{'matmuls alone':>15}{'coll. alone':>13}{'matmuls beside':>16}"
              f"{'coll. beside':>14}{'slowdown':>10}{'busbw alone GB/s':>18}")
        for name, best in rows.items():
            slow = best["matmuls beside"] / best["matmuls alone"]
            busbw = moved * (size - 1) / size / best["collective alone"] / 1e6
            print(f"{name:<24}{best['matmuls alone']:>15.2f}{best['collective alone']:>13.2f}"
                  f"{best['matmuls beside']:>16.2f}{best['collective beside']:>14.2f}{slow:>10.3f}{busbw:>18.0f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    tensors.clear()
    if pool is not None:
        dist.group.WORLD._get_backend(device).deregister_mem_pool(pool)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
