"""Developer tool (GPU): host cost of one Triton launch through the JIT vs a cached CompiledKernel."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

import rmsnorm_kernel as rk  # noqa: E402


def host_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
r = torch.empty(1, device="cuda")
kw = dict(BLOCK_N=4096, ROWS=1, SOFT_BF16=False, num_warps=8)
args = (x, w, y, r, 4096, 1, 4096, 1e-6)
k = rk._rmsnorm_fwd_kernel[(1,)](*args, **kw)
print("CompiledKernel:", type(k), flush=True)
print(f"jit launch                 {host_us(lambda: rk._rmsnorm_fwd_kernel[(1,)](*args, **kw)):7.2f} us", flush=True)
runner = k[(1, 1, 1)]
full = args + (4096, 1, False)
for name, a in (("runner, non-constexpr args", args), ("runner, all args", full)):
    try:
        runner(*a)
        torch.cuda.synchronize()
        print(f"{name:<26} {host_us(lambda a=a: runner(*a)):7.2f} us", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{name:<26} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
print(f"torch.empty_like           {host_us(lambda: torch.empty_like(x)):7.2f} us")
print(f"torch.empty((1,),...)      {host_us(lambda: torch.empty((1,), device=x.device, dtype=torch.float32)):7.2f} us")
print(f"rmsnorm_forward            {host_us(lambda: rk.rmsnorm_forward(x, w, 1e-6)):7.2f} us")
print(f"rk._check_inputs           {host_us(lambda: rk._check_inputs(x, w, 1e-6)):7.2f} us")
