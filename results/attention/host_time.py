"""Where an eager fwd+bwd of the attention kernel spends its host time (GPU only).

benchmark_kernels.py --kernel attention times the 16,384-token row of 133 short documents at 1.28-1.52 ms
eager against 1.06 ms replayed from a CUDA graph (H100, results/attention/gluon_h100/dq_in_place/), which
looked like the GPU waiting for Python (its run, results/attention/gluon_h100/bounds_once/, found the document
ends instead). This measures, on each row of benchmark_kernels' attention rows, in one process:
  * GPU time: the fwd+bwd replayed from a CUDA graph (what the GPU needs), as benchmark_kernels times it;
  * eager time: the same call from Python, as benchmark_kernels times it;
  * host time: the time Python takes to queue one call (perf_counter, the GPU kept busy beforehand);
  * the Python functions that host time goes to (cProfile over 50 calls, the top 25 by own time);
and the same for two trials done here only: the document ends made by every call's backward (as
before the decoder made them once for all its layers: attention_routing.DOCUMENTS), and the Gluon
backward launched through kernel_common.fast_launch (Triton's binder, the compiled kernel's launcher
called directly) instead of Triton's full launch path.

Usage (from the checkout, on an H100 / H200 with Triton 3.8+ for the Gluon backward):
    python results/attention/host_time.py [--json PATH]
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout
import attention_kernel  # noqa: E402  (first: kernel_common's import rule)
from benchmark_kernels import BENCH_MS, make_calls  # noqa: E402
from kernel_common import fast_launch  # noqa: E402
from kernel_ft.benchmark_specs import ATTENTION, bench  # noqa: E402

CALLS = 50


def host_ms(call):
    # Python's time to queue one call, with the GPU busy on a long sleep so no launch ever waits for it.
    times = []
    for _ in range(20):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def top_functions(call, n=25):
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        call()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(n)
    return text.getvalue()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args(argv)
    hopper = attention_kernel.attention_hopper_kernel
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"triton {__import__('triton').__version__}")
    plain_launch = hopper._attn_bwd_hopper if hopper else None
    ours = ATTENTION.providers["ours (Triton)"]

    def trial(name):
        ATTENTION.providers["ours (Triton)"] = ((lambda: attention_kernel.packed_attention)
                                               if name == "ends each call" else ours)
        if hopper:
            hopper._attn_bwd_hopper = fast_launch(plain_launch) if name == "fast_launch" else plain_launch

    record = []
    for name in ("as it is", "ends each call") + (("fast_launch", ) if hopper else ()):
        trial(name)
        for spec in ATTENTION.shapes["full"]:  # the rows benchmark_kernels.py times
            _, call = make_calls(ATTENTION, "ours (Triton)", spec, seed=0)
            call()  # compiled, outside every timing
            row = {"row": f"{spec['seq']:,} tokens, documents {spec['docs']}", "trial": name,
                   "gpu_ms": bench(call, BENCH_MS["full"], graph=True), "eager_ms": bench(call, BENCH_MS["full"]),
                   "host_ms": host_ms(call)}
            record.append(row)
            print(f"{row['row']:<40} {name:<15} GPU (graph) {row['gpu_ms']:.3f} ms  eager {row['eager_ms']:.3f} "
                  f"ms  host {row['host_ms']:.3f} ms", flush=True)
            if spec["docs"] == [40, 200] and name == "as it is":
                print(top_functions(call))
    trial("as it is")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
