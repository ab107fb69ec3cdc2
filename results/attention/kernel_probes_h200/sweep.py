"""Probe: tile shapes the tuner never tried for the current kernels (64 queries x 128 keys
and friends); GPU time per kernel from the profiler on benchmark_specs' three rows, d = 128."""
import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import attention_kernel as ak
from kernel_ft.benchmark_specs import ATTENTION, attention_inputs
from bench_f import kernel_ms, args, say

res = {}
rows = [attention_inputs({**s, "head_dim": 128}) for s in ATTENTION.shapes["full"]]
KEY = {"fwd": "_attn_fwd_kernel", "dkdv": "_attn_bwd_dkdv_kernel", "dq": "_attn_bwd_dq_kernel"}
CANDS = {
    "fwd": [(64, 64, 4, 3), (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (128, 64, 8, 3),
            (128, 128, 8, 3), (64, 64, 4, 3)],
    "dq": [(64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 4, 2), (32, 128, 4, 2), (32, 64, 4, 3), (32, 128, 4, 3),
           (64, 64, 4, 2)],
    "dkdv": [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2)],
}
for kernel, cands in CANDS.items():
    orig = ak.TILES[kernel, 128]
    want = []
    for inp in rows:
        q, k, v, st = args(inp)
        o = ak.attention_forward(q, k, v, st, 128 ** -0.5, 0, 0.0)
        want.append(o if kernel == "fwd" else ak.attention_backward(inp["upstream"][0], q, k, v, *o, st, 128 ** -0.5, 0, 0.0))
    for c in cands:
        ak.TILES[kernel, 128] = c
        try:
            ts, errs = [], []
            for inp, w in zip(rows, want):
                q, k, v, st = args(inp)
                if kernel == "fwd":
                    fn = lambda: ak.attention_forward(q, k, v, st, 128 ** -0.5, 0, 0.0)
                else:
                    ak.TILES[kernel, 128] = orig
                    out, lse = ak.attention_forward(q, k, v, st, 128 ** -0.5, 0, 0.0)
                    ak.TILES[kernel, 128] = c
                    do = inp["upstream"][0]
                    fn = lambda: ak.attention_backward(do, q, k, v, out, lse, st, 128 ** -0.5, 0, 0.0)
                errs.append(max(((g.float() - x.float()).norm() / x.float().norm()).item() for g, x in zip(fn(), w)))
                ts.append(kernel_ms(fn, 3)[KEY[kernel]])
            say(f"{kernel} tiles {c}: {' '.join(f'{t:.3f}' for t in ts)} (sum {sum(ts):.3f}) rel diff {max(errs):.1e}")
            res[f"{kernel} {c}"] = ts
        except Exception as e:
            say(f"{kernel} tiles {c}: {type(e).__name__} {str(e)[:150]}")
    ak.TILES[kernel, 128] = orig
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep.json"), "w"), indent=1)
