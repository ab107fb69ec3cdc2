"""Developer tool (GPU): FLCE fwd+bwd time against its chunk size, and the plain path."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import triton.testing  # noqa: E402

import cross_entropy_kernel as ce  # noqa: E402

for n in (4096, 16384):
    h = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(128256, 4096, device="cuda") * 0.03).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 128256, (n,), device="cuda")
    for rows in (512, 1024, 2048, 4096, None):
        if rows and rows > n:
            continue
        ms = triton.testing.do_bench(lambda: torch.autograd.grad(ce.fused_linear_cross_entropy(h, w, t, chunk_rows=rows), (h, w)), rep=300)
        print(f"N={n} chunk_rows={rows or 'auto'}: {ms:.2f} ms", flush=True)
    ms = triton.testing.do_bench(lambda: torch.autograd.grad(ce.cross_entropy(h @ w.t(), t), (h, w)), rep=300)
    print(f"N={n} plain mm + our CE: {ms:.2f} ms", flush=True)
    ms = triton.testing.do_bench(lambda: (h @ w.t()), rep=300)
    print(f"N={n} one mm [N,H]x[H,V]: {ms:.2f} ms", flush=True)
