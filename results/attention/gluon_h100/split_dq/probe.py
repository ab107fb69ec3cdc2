"""The Gluon backward without its dQ product, dQ from attention_kernel.py's dQ kernel (GPU only).

On packed rows of short documents the Gluon backward's dQ costs a zero-filled float32 buffer, float32
reductions from two or three key tiles into every query tile, and a cast (NOTES, Step 21). The split
(attention_kernel.SPLIT_DQ_PACKED) lets the Gluon kernel make dK and dV only and the Triton dQ kernel walk
the keys of each query tile, writing dQ once in q's dtype. This times, on benchmark_kernels.py's attention
rows, in one process: the backward as it is (Gluon), the split, and the Triton backward; fwd+bwd eager and
replayed from a CUDA graph, the kernels of one fwd+bwd under torch.profiler, and the gradients of each
against the Gluon backward's. FlexAttention on the packed rows, for the ratio the benchmark reports.

    git apply results/attention/gluon_h100/split_dq/split.patch   # the trial's code (not kept)
    python results/attention/gluon_h100/split_dq/probe.py [--json PATH]
"""
import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))  # checkout
import attention_kernel  # noqa: E402  (first: kernel_common's import rule)
from benchmark_kernels import BENCH_MS, make_calls  # noqa: E402
from kernel_ft.benchmark_specs import ATTENTION, bench  # noqa: E402

MODES = {"gluon": {}, "split": {"SPLIT_DQ_PACKED": True},
         "triton": {"USE_HOPPER_BACKWARD_PACKED": False, "USE_HOPPER_BACKWARD": False}}
DEFAULTS = {name: getattr(attention_kernel, name) for mode in MODES.values() for name in mode}


def set_mode(mode):
    for name, value in DEFAULTS.items():
        setattr(attention_kernel, name, MODES[mode].get(name, value))


def kernel_table(call, n=5):
    """GPU us per call of each kernel of `call` (torch.profiler, n calls after one warm-up)."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            times[e.key[:70]] += e.device_time_total / n
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}")
    record = []
    for spec in ATTENTION.shapes["full"]:
        row = f"{spec['seq']:,} tokens, documents {spec['docs']}"
        modes = ["gluon", "triton"] + (["split"] if spec["docs"] != "one" else [])
        grads = {}
        for mode in modes:
            set_mode(mode)
            _, call = make_calls(ATTENTION, "ours (Triton)", spec, seed=0)
            grads[mode] = [g.float() for g in call()]
            r = {"row": row, "mode": mode, "eager_us": 1e3 * bench(call, BENCH_MS["full"]),
                 "graph_us": 1e3 * bench(call, BENCH_MS["full"], graph=True), "kernels_us": kernel_table(call)}
            r["grad_diff"] = [float((g - w).abs().max() / w.abs().max()) for g, w in zip(grads[mode], grads["gluon"])]
            record.append(r)
            print(f"\n{row} | {mode}: eager {r['eager_us']:,.1f} us, graph {r['graph_us']:,.1f} us; "
                  f"dq/dk/dv max diff vs gluon (of max) {', '.join(f'{d:.1e}' for d in r['grad_diff'])}")
            for name, us in list(r["kernels_us"].items())[:12]:
                print(f"    {us:9.1f} us  {name}")
        set_mode("gluon")
        if spec["docs"] != "one":
            _, call = make_calls(ATTENTION, "FlexAttention (compiled)", spec, seed=0)
            call()
            r = {"row": row, "mode": "flex", "eager_us": 1e3 * bench(call, BENCH_MS["full"]),
                 "graph_us": 1e3 * bench(call, BENCH_MS["full"], graph=True)}
            record.append(r)
            print(f"\n{row} | FlexAttention: eager {r['eager_us']:,.1f} us, graph {r['graph_us']:,.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
