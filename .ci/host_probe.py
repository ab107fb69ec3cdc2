"""Developer tool (GPU): where does the host time of our autograd wrappers go?"""
import cProfile
import pstats
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

import cross_entropy_kernel as ce  # noqa: E402
import rmsnorm_kernel as rk  # noqa: E402


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
y, rstd = rk.rmsnorm_forward(x.detach(), w.detach(), 1e-6)
cases = {
    "rmsnorm_forward direct": lambda: rk.rmsnorm_forward(x.detach(), w.detach(), 1e-6),
    "rmsnorm_backward direct": lambda: rk.rmsnorm_backward(dy, x.detach(), w.detach(), rstd),
    "rmsnorm_backward no dw": lambda: rk.rmsnorm_backward(dy, x.detach(), w.detach(), rstd, compute_dw=False),
    "autograd fwd+bwd": lambda: torch.autograd.grad(rk.rmsnorm(x, w), (x, w), dy),
}
for name, fn in cases.items():
    print(f"{name:<28} {host_us(fn):8.1f} us", flush=True)


def in_thread():
    print(f"{'backward direct, other thread':<28} {host_us(cases['rmsnorm_backward direct']):8.1f} us", flush=True)


t = threading.Thread(target=in_thread)
t.start()
t.join()

prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    rk.rmsnorm_backward(dy, x.detach(), w.detach(), rstd)
torch.cuda.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)

print(f"{'rmsnorm fwd, grad enabled':<28} {host_us(lambda: rk.rmsnorm(x, w)):8.1f} us", flush=True)
yy = rk.rmsnorm(x, w)
print(f"{'autograd.grad only':<28} {host_us(lambda: torch.autograd.grad(rk.rmsnorm(x, w), (x, w), dy)) :8.1f} us", flush=True)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU]) as p:
    for _ in range(50):
        torch.autograd.grad(rk.rmsnorm(x, w), (x, w), dy)
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
