"""Tiles for SwiGLU's backward kernel when it also writes h8^T (swiglu_kernel.H8_T_TILE; H8_T_PACK, four tokens
per 32-bit word, existed when it ran and was removed after), H200.

For LLaMA-8B's MLP at 4,096 tokens ([gate | up] of 2 x 14,336): the backward with h8^T against the backward
without it plus what the forward's cast saves by not writing h8^T (quantize with and without the transposed copy),
triton.testing.do_bench medians. Prints a table and writes the best (tile, pack) to --best as JSON."""
import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import triton.testing  # noqa: E402

import fp8_kernel  # noqa: E402
import swiglu_kernel  # noqa: E402
from kernel_common import AMAX_SLOTS  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--best", required=True)
args = parser.parse_args()
M, I = 4096, 14336
torch.manual_seed(0)
gu = torch.randn(M, 2 * I, device="cuda", dtype=torch.bfloat16)
dh = torch.randn(M, I, device="cuda", dtype=torch.bfloat16)
h = swiglu_kernel.swiglu_forward(gu, None, "silu")
maxima = fp8_kernel.tensor_maxima(h)
out = torch.empty(I, M, dtype=torch.uint8, device="cuda")


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def slots():
    return torch.zeros(2, AMAX_SLOTS, dtype=torch.float32, device="cuda")


base = ms(lambda: swiglu_kernel.swiglu_backward_and_hidden(dh, gu, None, True, True, "silu", store_h=False,
                                                           amax=slots()))
cast_t = ms(lambda: fp8_kernel.quantize(h, "tensorwise", transpose=True, align=16, amax=maxima))
cast = ms(lambda: fp8_kernel.quantize(h, "tensorwise", align=16, amax=maxima))
saved = cast_t - cast
print(f"backward without h8^T {base * 1e3:.1f} us; forward cast with h8^T {cast_t * 1e3:.1f} us, without "
      f"{cast * 1e3:.1f} us (saves {saved * 1e3:.1f} us)")
want = fp8_kernel.quantize(h, "tensorwise", transpose=True, align=16, amax=maxima).data_t.view(torch.uint8)
rows = []
for tile, pack in itertools.product([(64, 32, 4), (64, 32, 8), (128, 32, 4), (128, 32, 8), (64, 64, 8), (32, 64, 4),
                                     (128, 16, 4), (256, 16, 8), (256, 32, 8), (64, 16, 4)], [True, False]):
    swiglu_kernel.H8_T_TILE, swiglu_kernel.H8_T_PACK = tile, pack
    out.zero_()
    swiglu_kernel.swiglu_backward_and_hidden(dh, gu, None, True, True, "silu", store_h=False, amax=slots(),
                                             h8_t=(out, maxima))
    same = torch.equal(out, want)
    t = ms(lambda: swiglu_kernel.swiglu_backward_and_hidden(dh, gu, None, True, True, "silu", store_h=False,
                                                            amax=slots(), h8_t=(out, maxima)))
    rows.append(dict(tile=tile, pack=pack, us=t * 1e3, net_us=(t - base - saved) * 1e3, same=same))
    print(f"tile {tile} pack {pack!s:5}: {t * 1e3:7.1f} us, net per layer {(t - base - saved) * 1e3:+6.1f} us, "
          f"h8^T {'same bytes' if same else 'DIFFERENT'}", flush=True)
best = min((r for r in rows if r["same"]), key=lambda r: r["us"])
print(f"best: {best}")
with open(args.best, "w") as f:
    json.dump(dict(base_us=base * 1e3, cast_t_us=cast_t * 1e3, cast_us=cast * 1e3, rows=rows, best=best), f)
