"""
Eager latency of our kernels, this checkout against another one (an A/B of the launch path).

Each side runs in its own worker process (its own copies of the *_kernel modules);
the rounds alternate between the two, so a slow spell of the host hits both. One
call is forward + backward through autograd, as in training, on LLaMA-3.1-8B
shapes in bf16; the time per call is the wall time of ``--calls`` calls followed
by one synchronize. At few rows the GPU work is a few microseconds and the
figure is host time: the Python of the launch path. At many rows it is GPU time.

Usage (needs a CUDA GPU):
    git worktree add /tmp/before <commit>
    python tools/host_ab.py --other /tmp/before --json ab.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 128256, 32, 8, 128


def make_call(kernel, rows):
    """A function running one forward + backward of ``kernel`` on ``rows`` tokens."""
    import torch
    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=bf16, requires_grad=True)

    if kernel == "rmsnorm":
        from rmsnorm_kernel import rmsnorm
        x, w = leaf(rows, HIDDEN), leaf(HIDDEN)
        dy = torch.randn(rows, HIDDEN, device=dev, dtype=bf16)
        return lambda: torch.autograd.backward(rmsnorm(x, w), dy)
    if kernel == "swiglu":
        from swiglu_kernel import swiglu
        gate, up = leaf(rows, INTERMEDIATE), leaf(rows, INTERMEDIATE)
        dy = torch.randn(rows, INTERMEDIATE, device=dev, dtype=bf16)
        return lambda: torch.autograd.backward(swiglu(gate, up), dy)
    if kernel == "rope":
        from rope_kernel import rope
        q, k = leaf(1, HEADS, rows, HEAD_DIM), leaf(1, KV_HEADS, rows, HEAD_DIM)
        cos, sin = torch.randn(1, rows, HEAD_DIM, device=dev, dtype=bf16), torch.randn(1, rows, HEAD_DIM, device=dev, dtype=bf16)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        return lambda: torch.autograd.backward(rope(q, k, cos, sin), (dq, dk))
    if kernel == "cross_entropy":
        from cross_entropy_kernel import cross_entropy
        logits = leaf(rows, VOCAB)
        targets = torch.randint(0, VOCAB, (rows,), device=dev)
        return lambda: cross_entropy(logits, targets).backward()
    raise ValueError(f"unknown kernel {kernel!r}")


def worker():
    """Answer 'kernel rows calls' lines on stdin with microseconds per call on stdout."""
    import torch
    calls_of = {}
    for line in sys.stdin:
        kernel, rows, calls = line.split()
        rows, calls = int(rows), int(calls)
        if (kernel, rows) not in calls_of:
            calls_of[(kernel, rows)] = make_call(kernel, rows)
            for _ in range(20):  # compile and warm up, outside the timing
                calls_of[(kernel, rows)]()
        call = calls_of[(kernel, rows)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        print(f"{(time.perf_counter() - start) / calls * 1e6:.2f}", flush=True)


def start_worker(checkout):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], cwd=checkout, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def git_commit(checkout):
    """The checkout's commit, or its folder name when it is not the top of a git checkout."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, check=True).stdout.strip()
    try:
        if os.path.samefile(git("rev-parse", "--show-toplevel"), checkout):
            dirty = git("status", "--porcelain", "--untracked-files=no")
            return git("rev-parse", "--short", "HEAD") + (" + changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    return os.path.basename(os.path.normpath(checkout))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", help="another checkout of this project (e.g. a git worktree); required")
    parser.add_argument("--kernel", nargs="+", default=["rmsnorm", "swiglu", "rope", "cross_entropy"])
    parser.add_argument("--rows", nargs="+", type=int, default=[8, 4096, 16384])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker()
    if args.other is None:
        parser.error("--other is required: the checkout to compare this one with")
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("error: tools/host_ab.py times GPU launches; it needs a CUDA GPU")
    if not os.path.isfile(os.path.join(args.other, "rmsnorm_kernel.py")):
        raise SystemExit(f"error: {args.other} is not a checkout of this project (no rmsnorm_kernel.py)")
    sides = {f"other ({git_commit(args.other)})": start_worker(os.path.abspath(args.other)),
             f"this ({git_commit(HERE)})": start_worker(HERE)}
    print(f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | {args.rounds} alternating rounds of "
          f"{args.calls} forward + backward calls, bf16, LLaMA-3.1-8B shapes")
    print(f"{'kernel':14s} {'rows':>6s}  {'side':22s} {'median us/call':>14s} {'min':>8s} {'max':>8s}")
    records = []
    for kernel in args.kernel:
        for rows in args.rows:
            times = {side: [] for side in sides}
            for _ in range(args.rounds):
                for side, proc in sides.items():
                    proc.stdin.write(f"{kernel} {rows} {args.calls}\n")
                    proc.stdin.flush()
                    answer = proc.stdout.readline()
                    if not answer:
                        raise SystemExit(f"error: the worker for {side} stopped at {kernel} x {rows} rows")
                    times[side].append(float(answer))
            for side, t in times.items():
                med = statistics.median(t)
                print(f"{kernel:14s} {rows:6d}  {side:22s} {med:14.1f} {min(t):8.1f} {max(t):8.1f}")
                records.append({"kernel": kernel, "rows": rows, "side": side, "us_per_call": t, "median": med})
    for proc in sides.values():
        proc.stdin.close()
        proc.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
                       "calls": args.calls, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
