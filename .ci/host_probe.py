"""Developer tool (GPU): where does the host time of our autograd wrappers go?

Times (perf_counter, tiny tensors so the GPU work is negligible) the same RMSNorm
work called directly, through Function.apply, through autograd with the engine's
worker thread and with multithreading off, and a do-nothing Python Function as the
floor; then cProfiles the backward inside the autograd worker thread.
"""
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import rmsnorm_kernel as rk  # noqa: E402


def host_us(fn, n=400):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


class EmptyLike(torch.autograd.Function):
    """Allocates like ours but launches nothing: isolates allocation + engine cost."""

    @staticmethod
    def forward(ctx, x, w):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return torch.empty_like(dy), torch.empty(dy.shape[-1], device=dy.device, dtype=dy.dtype)


PROFILE = {"on": False, "prof": cProfile.Profile(), "timed": False, "t": 0.0, "n": 0}
_orig_backward = rk.rmsnorm_backward


def profiled_backward(*a, **k):
    if PROFILE["timed"]:
        t = time.perf_counter()
        out = _orig_backward(*a, **k)
        PROFILE["t"] += time.perf_counter() - t
        PROFILE["n"] += 1
        return out
    if not PROFILE["on"]:
        return _orig_backward(*a, **k)
    PROFILE["prof"].enable()
    try:
        return _orig_backward(*a, **k)
    finally:
        PROFILE["prof"].disable()


rk.rmsnorm_backward = profiled_backward

for rows in (1, 4096):
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    y, rstd = rk.rmsnorm_forward(x.detach(), w.detach(), 1e-6)
    cases = {
        "F.rms_norm autograd fwd+bwd": lambda: torch.autograd.grad(F.rms_norm(x, (4096,), w, 1e-6), (x, w), dy),
        "Identity Function fwd+bwd": lambda: torch.autograd.grad(Identity.apply(x), (x,), dy),
        "EmptyLike Function fwd+bwd": lambda: torch.autograd.grad(EmptyLike.apply(x, w), (x, w), dy),
        "rmsnorm_forward direct": lambda: rk.rmsnorm_forward(x.detach(), w.detach(), 1e-6),
        "rmsnorm_backward direct": lambda: _orig_backward(dy, x.detach(), w.detach(), rstd),
        "rmsnorm fwd (apply, grad on)": lambda: rk.rmsnorm(x, w),
        "rmsnorm autograd fwd+bwd": lambda: torch.autograd.grad(rk.rmsnorm(x, w), (x, w), dy),
    }
    print(f"--- {rows} x 4096 bf16", flush=True)
    for name, fn in cases.items():
        print(f"{name:<36} {host_us(fn):8.1f} us", flush=True)
    torch.autograd.set_multithreading_enabled(False)
    for name in ("Identity Function fwd+bwd", "EmptyLike Function fwd+bwd", "rmsnorm autograd fwd+bwd"):
        print(f"{name + ' (no MT)':<36} {host_us(cases[name]):8.1f} us", flush=True)
    torch.autograd.set_multithreading_enabled(True)

def body_time(label):
    PROFILE.update(timed=True, t=0.0, n=0)
    total = host_us(cases["rmsnorm autograd fwd+bwd"])
    body = PROFILE["t"] / PROFILE["n"] * 1e6
    PROFILE["timed"] = False
    print(f"{label:<36} fwd+bwd {total:8.1f} us, of which rmsnorm_backward body {body:6.1f} us", flush=True)


body_time("worker thread (default)")
torch.autograd.set_multithreading_enabled(False)
body_time("calling thread (no MT)")
torch.autograd.set_multithreading_enabled(True)
PROFILE.update(timed=True, t=0.0, n=0)
direct = host_us(lambda: rk.rmsnorm_backward(dy, x.detach(), w.detach(), rstd))
PROFILE["timed"] = False
print(f"{'direct call':<36} backward {direct:8.1f} us, body {PROFILE['t'] / PROFILE['n'] * 1e6:6.1f} us", flush=True)
import os  # noqa: E402

cpus = sorted(os.sched_getaffinity(0))
def pin_all(cores):
    # sched_setaffinity(0) only moves the calling thread; move every thread (the
    # autograd worker exists already).
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cores)


pin_all({cpus[2]})
body_time("whole process pinned to one core")
for name in ("Identity Function fwd+bwd", "F.rms_norm autograd fwd+bwd"):
    print(f"{name + ' (pinned)':<36} {host_us(cases[name]):8.1f} us", flush=True)
pin_all(set(cpus))

PROFILE["on"] = True
for _ in range(300):
    torch.autograd.grad(rk.rmsnorm(x, w), (x, w), dy)
torch.cuda.synchronize()
PROFILE["on"] = False
s = io.StringIO()
pstats.Stats(PROFILE["prof"], stream=s).sort_stats("tottime").print_stats(25)
print("cProfile of rmsnorm_backward inside the autograd worker thread (300 calls):")
print(s.getvalue())

prof = cProfile.Profile()
prof.enable()
for _ in range(300):
    rk.rmsnorm(x, w)
torch.cuda.synchronize()
prof.disable()
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
print("cProfile of rmsnorm forward through Function.apply (300 calls):")
print(s.getvalue())
