"""Developer tool (GPU): cross-entropy with few rows, split rows vs one program per row,
timed with do_bench (host included) and do_bench_cudagraph (GPU time only)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import triton.testing as tt  # noqa: E402

import cross_entropy_kernel as ce  # noqa: E402

for n in (512, 1024, 2048):
    x = torch.randn(n, 128256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 128256, (n,), device="cuda")
    for force in (False, True):
        ce.FORCE_SPLIT = force
        fwd = lambda: ce.cross_entropy(x.detach(), t)  # noqa: E731
        fb = lambda: torch.autograd.grad(ce.cross_entropy(x, t), x)  # noqa: E731
        r = [tt.do_bench(fwd), tt.do_bench(fb)]
        with torch.cuda.stream(torch.cuda.Stream()):
            r += [tt.do_bench_cudagraph(fwd), tt.do_bench_cudagraph(fb)]
        print(f"N={n} split={force}: do_bench fwd {r[0]*1e3:6.1f} us fwd+bwd {r[1]*1e3:6.1f} us | "
              f"cudagraph fwd {r[2]*1e3:6.1f} us fwd+bwd {r[3]*1e3:6.1f} us", flush=True)
