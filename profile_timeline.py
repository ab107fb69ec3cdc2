"""
Step 20 (with Step 3) -- Where a training step waits: the GPU's timeline, the
host's time, the model FLOPs utilization, and a one-line verdict.

profile_baseline.py's tables say which operations take the GPU's time. They do
not say whether the GPU was busy at all: if the host needs longer to queue a
step's kernels than the GPU needs to run them, the step takes the host's time and
faster kernels change nothing. This file reads the profile's Chrome trace and the
step's timings and answers that question:

* **GPU busy**: the union of every kernel, copy and memset on the GPU per step,
  over the step's wall time measured without the profiler (the profiler's own
  per-operation cost would otherwise make every step look host-bound).
* **Host time**: how long the host took to queue one step, from its start until
  the step function returned, before waiting for the GPU. When it is about the
  wall time, the GPU was waiting on the host.
* **Idle gaps**: the longest stretches without GPU work in the profiled steps,
  with what the host was doing then: the innermost operator running at the gap's
  middle, inside which phase (forward, backward, optimizer).
* **Launches**: kernel launches (and CUDA graph launches) the host made per step,
  from the CUDA runtime calls in the trace.
* **MFU**: the model's matrix FLOPs per step over the wall time, as a share of
  the matrix-unit peak measured on this GPU in the same run (a large bf16 matrix
  product). The FLOP count is written out in ``step_flops``.
* **Allocation, synchronization, communication**: host time in cudaMalloc /
  cudaFree, blocking synchronizations inside the step, NCCL kernel time and the part
  of it no compute kernel overlaps (exposed).

The verdict is the first of these that holds:

=================  ==========================================================
waiting on ...     the test
=================  ==========================================================
communication      exposed NCCL time is more than 15% of the wall time
memory allocation  cudaMalloc/cudaFree take more than 10% of the wall time
host-bound         GPU busy under 85% and queueing took 85% of the wall time
host syncs         GPU busy under 85% with synchronizations inside the step
GPU-bound          otherwise: the GPU's own time is the step's time
=================  ==========================================================

Usage (also: profile_baseline.py prints all of it at the end of a GPU profile):
    python profile_timeline.py traces/<name>/trace.json   # gaps of any saved trace
"""

import argparse
import json

import torch

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
ALLOCATIONS = ("cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cuMemAlloc", "cuMemFree")
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
PHASES = ("forward", "backward", "optimizer")  # training.phase ranges
BUSY_ENOUGH = 0.85


# --------------------------------------------------------------------------------
# The trace: GPU intervals, gaps, what the host did
# --------------------------------------------------------------------------------
def gpu_events(trace):
    """The GPU's complete events ('X': kernels, copies, memsets), in start order."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    return sorted(events, key=lambda e: e["ts"])


def idle_gaps(events):
    """(busy us, span us, gaps): busy time of the union of ``events`` (overlapping
    ones, on several streams, count once), the span from the first start to the last
    end, and every gap as (start us, length us, event before, event after)."""
    if not events:
        return 0.0, 0.0, []
    start = events[0]["ts"]
    cursor, busy, gaps, prev = start, 0.0, [], None
    for e in events:
        end = e["ts"] + e["dur"]
        if e["ts"] > cursor:
            gaps.append((cursor, e["ts"] - cursor, prev["name"] if prev else "-", e["name"]))
        if end > cursor:
            busy += end - max(cursor, e["ts"])
            cursor, prev = end, e
    return busy, cursor - start, gaps


def host_activity(trace, at_us):
    """What the host was doing at ``at_us``: 'phase > innermost operator', from the
    CPU events (operators, our ranges) running then."""
    running = [e for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")
               and e["ts"] <= at_us <= e["ts"] + e.get("dur", 0)]
    phase = next((e["name"] for e in running if e["name"] in PHASES), None)
    ops = [e for e in running if e["name"] not in PHASES and not e["name"].startswith("ProfilerStep")]
    inner = min(ops, key=lambda e: e.get("dur", 0))["name"] if ops else "Python between operators"
    return f"{phase} > {inner}" if phase else inner


def runtime_calls(trace):
    """{CUDA runtime call name: [count, host us]} over the whole trace."""
    calls = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime":
            c = calls.setdefault(e["name"], [0, 0.0])
            c[0] += 1
            c[1] += e.get("dur", 0)
    return calls


def nccl_us(events):
    """(NCCL kernel time, the part of it exposed) in us: exposed where no other kernel
    runs beside it. Communication that overlaps compute costs the step nothing; only
    the exposed part waits (FSDP's prefetch exists to shrink it). With ``events`` in
    start order: exposed = busy(NCCL and compute) - busy(compute), unions as idle_gaps
    counts them."""
    comm, compute, both = [], [], []
    for e in events:
        nccl = "nccl" in e["name"].lower()
        if nccl or e.get("cat") == "kernel":
            (comm if nccl else compute).append(e)
            both.append(e)
    return idle_gaps(comm)[0], idle_gaps(both)[0] - idle_gaps(compute)[0]


# --------------------------------------------------------------------------------
# Model FLOPs and the measured peak
# --------------------------------------------------------------------------------
def step_flops(model, micro_batches):
    """The matrix FLOPs of one training step (forward and backward) of ``model``.

    Every linear layer (the projections, LoRA's adapters, the LM head; nn.Linear, or
    a module standing in for one with ``in_features``, ``out_features`` and a
    ``weight``, as fp8_kernel.FP8Linear does: the model's FLOPs do not depend on the
    precision they run in), per token that is not padding, with a weight of
    ``n_in x n_out``:

    * forward ``2 n_in n_out`` (a multiply and an add per weight);
    * backward, the input's gradient, ``2 n_in n_out``;
    * backward, the weight's gradient, ``2 n_in n_out`` when the weight is trained
      (not for LoRA's frozen base weights).

    Attention, per layer and per token that attends to ``c`` positions (its own
    and the earlier ones of its example: ``position + 1``), with ``h`` heads of
    size ``d``: ``4 h d c`` forward (Q K^T and P V), twice that backward. The
    elementwise work (norms, activations, softmax, the optimizer) is not counted:
    it is not what the matrix units are for. Embedding lookups are not products.

    A module is counted when the weight is its own parameter: PEFT's LoRA layer shows
    its base layer's ``weight``, ``in_features`` and ``out_features`` too, and would
    count the base product twice.
    """
    linear = 0
    for module in model.modules():
        weight = module._parameters.get("weight")  # its own, not a wrapped module's
        if isinstance(module, torch.nn.Linear) or (
                isinstance(weight, torch.nn.Parameter) and weight.dim() == 2
                and isinstance(getattr(module, "in_features", None), int)
                and isinstance(getattr(module, "out_features", None), int)):
            per_token = 2 * module.in_features * module.out_features
            linear += per_token * (3 if weight.requires_grad else 2)
    config = model.config
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    flops = 0
    for batch in micro_batches:
        tokens = int(batch["num_real_tokens"])
        positions = batch.get("position_ids")
        if positions is None:
            ids = batch["input_ids"]
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        real = torch.ones_like(batch["input_ids"], dtype=torch.bool)
        if isinstance(batch.get("attention_mask"), torch.Tensor) and batch["attention_mask"].dim() == 2:
            real = batch["attention_mask"].bool()  # padded rows: padding is not counted
        context = int(((positions + 1) * real).sum())
        flops += linear * tokens + 12 * layers * heads * head_dim * context
    return flops


def matmul_peak_flops(dtype, n=8192, repeats=20):
    """FLOP/s of one n x n x n matrix product in ``dtype`` on this GPU: the matrix
    units' practical peak, measured (the datasheet's figure is not reached)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3)


# --------------------------------------------------------------------------------
# The analysis and the verdict
# --------------------------------------------------------------------------------
def analyze(trace, steps, wall_s, host_s, flops=None, peak=None, top=5):
    """The timeline summary of ``steps`` profiled steps (``trace``: the profile's
    Chrome trace as a dict); ``wall_s`` and ``host_s``: a step's wall time and the
    host's time to queue it, measured without the profiler."""
    events = gpu_events(trace)
    busy, span, gaps = idle_gaps(events)
    calls = runtime_calls(trace)
    nccl = nccl_us(events)

    def per_step(names, index):
        return sum(calls[n][index] for n in names if n in calls) / steps

    wall_us = wall_s * 1e6
    summary = {
        "wall_ms": wall_s * 1e3,
        "host_ms": host_s * 1e3,
        "gpu_busy_ms": busy / steps / 1e3,
        "gpu_busy_fraction": min(1.0, busy / steps / wall_us) if wall_us else None,
        "kernels_per_step": sum(1 for e in events if e.get("cat") == "kernel") / steps,
        "kernel_launches_per_step": per_step(LAUNCHES, 0),
        "graph_launches_per_step": per_step(GRAPH_LAUNCHES, 0),
        "allocation_ms": per_step(ALLOCATIONS, 1) / 1e3,
        "syncs_per_step": max(0.0, per_step(SYNCS, 0) - 1),  # the profiler loop's own sync ends each step
        "nccl_ms": nccl[0] / steps / 1e3,
        "nccl_exposed_ms": nccl[1] / steps / 1e3,
        "gaps": [{"us": length, "after": before, "before": after, "host": host_activity(trace, start + length / 2)}
                 for start, length, before, after in sorted(gaps, key=lambda g: -g[1])[:top]],
        "model_flops_per_step": flops,
        "matmul_peak_flops": peak,
        "mfu": flops / wall_s / peak if flops and peak and wall_s else None,
    }
    summary["verdict"] = verdict(summary)
    return summary


def verdict(s):
    """One line: what the step waits on, and what to try."""
    wall = s["wall_ms"]
    busy = s["gpu_busy_fraction"]
    mfu = f", MFU {s['mfu']:.0%}" if s["mfu"] is not None else ""
    if s["nccl_exposed_ms"] > 0.15 * wall:
        return (f"waiting on communication: {s['nccl_exposed_ms']:.1f} of {wall:.1f} ms per step are NCCL with no "
                f"compute beside it ({s['nccl_ms']:.1f} ms of NCCL in all); overlap it (FSDP prefetch) or move "
                f"fewer bytes")
    if s["allocation_ms"] > 0.10 * wall:
        return (f"waiting on memory allocation: cudaMalloc/cudaFree take {s['allocation_ms']:.1f} of {wall:.1f} ms "
                f"per step (shapes that change defeat PyTorch's cache); keep shapes fixed (--packing)")
    if busy is not None and busy < BUSY_ENOUGH and s["host_ms"] >= BUSY_ENOUGH * wall:
        return (f"host-bound: the GPU is busy {busy:.0%} of the step while Python queues "
                f"{s['kernel_launches_per_step']:,.0f} launches in {s['host_ms']:.1f} ms{mfu}; try --cuda-graphs")
    if busy is not None and busy < BUSY_ENOUGH and s["syncs_per_step"] >= 1:
        return (f"waiting on host synchronizations: {s['syncs_per_step']:.0f} per step, GPU busy {busy:.0%}{mfu}; "
                f"remove the .item() / nonzero calls inside the step")
    if busy is None:
        return "no GPU: nothing to say about waiting"
    return (f"GPU-bound: the GPU is busy {busy:.0%} of the step{mfu}; the time is in the kernels themselves: "
            f"look at the tables above")


def print_timeline(s):
    print()
    print("=" * 96)
    print("Where the step waits")
    print("=" * 96)
    busy = s["gpu_busy_fraction"]
    print(f"Wall time per step    {s['wall_ms']:9.2f} ms   (measured without the profiler)")
    print(f"Host time to queue it {s['host_ms']:9.2f} ms")
    print(f"GPU busy              {s['gpu_busy_ms']:9.2f} ms   ({busy:.0%} of the wall time)")
    graphs = f", {s['graph_launches_per_step']:.0f} CUDA graph launches" if s["graph_launches_per_step"] else ""
    print(f"Launches per step     {s['kernel_launches_per_step']:9.0f}      ({s['kernels_per_step']:,.0f} kernels ran"
          f"{graphs})")
    print(f"Allocation            {s['allocation_ms']:9.2f} ms   (cudaMalloc/cudaFree on the host)")
    print(f"Syncs inside the step {s['syncs_per_step']:9.0f}")
    if s["nccl_ms"]:
        print(f"NCCL                  {s['nccl_ms']:9.2f} ms   ({s['nccl_exposed_ms']:.2f} ms exposed: no compute "
              f"kernel beside it)")
    if s["mfu"] is not None:
        print(f"MFU                   {s['mfu'] * 100:9.1f} %    ({s['model_flops_per_step'] / 1e12:.2f} TFLOP per "
              f"step over the wall time; measured matmul peak {s['matmul_peak_flops'] / 1e12:.0f} TFLOP/s)")
    if s["gaps"]:
        print("Longest GPU idle gaps (profiled steps; the profiler's own overhead widens them):")
        for g in s["gaps"]:
            print(f"  {g['us']:9.1f} us  host: {g['host'][:60]}")
    print(f"Verdict: {s['verdict']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description="GPU busy time and idle gaps of a saved profile trace.")
    parser.add_argument("trace", help="Chrome trace JSON written by profile_baseline.py")
    parser.add_argument("--top", type=int, default=12, help="longest gaps to list (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        with open(args.trace) as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {args.trace}: cannot read a JSON trace ({e})") from None
    events = gpu_events(trace)
    if not events:
        raise SystemExit(f"error: {args.trace}: no GPU events (a CPU-only trace has none)")
    busy, span, gaps = idle_gaps(events)
    print(f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms ({busy / span:.0%}), idle {(span - busy) / 1e3:.1f} "
          f"ms in {len(gaps)} gaps")
    for start, length, before, after in sorted(gaps, key=lambda g: -g[1])[:args.top]:
        print(f"  {length:9.1f} us  host: {host_activity(trace, start + length / 2)[:50]:<50}  "
              f"after {before[:40]}")


if __name__ == "__main__":
    main()
