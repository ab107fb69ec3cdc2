# W8^T: the tile transpose against PyTorch's transposed copy (GPU time per call, GB/s of bytes read + written).
import torch
from kernel_ft.fp8_gather import transpose_fp8
print(torch.cuda.get_device_name())
for n, k in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)):
    x = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    assert torch.equal(transpose_fp8(x).view(torch.uint8), x.view(torch.uint8).t().contiguous())
    for name, fn in (("torch .t().contiguous()", lambda: x.t().contiguous()), ("transpose_fp8", lambda: transpose_fp8(x))):
        for _ in range(5): fn()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); s.record()
        for _ in range(50): fn()
        e.record(); torch.cuda.synchronize()
        us = s.elapsed_time(e) / 50 * 1e3
        print(f"{n:6d} x {k:6d}  {name:26s} {us:8.1f} us  {2 * n * k / us / 1e3:7.0f} GB/s")
