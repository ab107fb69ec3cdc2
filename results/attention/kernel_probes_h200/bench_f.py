"""Probe: lookahead (next tile's scores issued before this tile's softmax) in the forward's
and the dQ kernel's unmasked runs, against the current kernels; tile sweeps."""
import json, os, sys, statistics
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import attention_kernel as ak
import attn_f as af
from kernel_ft.benchmark_specs import ATTENTION, attention_inputs
from torch.profiler import profile, ProfilerActivity

OUT = os.environ.get("OUT", "/tmp")
res = {}


def timed(fn, reps=15):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def kernel_ms(fn, reps=5):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.key.startswith("_attn"):
            out[e.key] = (getattr(e, "device_time_total", 0) or e.cuda_time_total) / reps / 1000
    return out


def args(inp):
    return tuple(t.detach() if torch.is_tensor(t) else t for t in inp["args"])


def say(*a):
    print(*a, flush=True)


if __name__ == "__main__":
    say(torch.cuda.get_device_name(), torch.__version__)
    for d in (128, 64, 256):
        specs = ATTENTION.shapes["full"] if d == 128 else ATTENTION.shapes["full"][:1]
        for s in specs:
            name = f"d={d} {s['seq']} {s['docs']}"
            inp = attention_inputs({**s, "head_dim": d})
            q, k, v, st = args(inp)
            sc = d ** -0.5
            want = ak.attention_forward(q, k, v, st, sc, 0, 0.0)
            got = af.attention_forward(q, k, v, st, sc, 0, 0.0)
            ef = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
            out, lse = want
            do = inp["upstream"][0]
            gw = ak.attention_backward(do, q, k, v, out, lse, st, sc, 0, 0.0)
            gg = af.attention_backward(do, q, k, v, out, lse, st, sc, 0, 0.0)
            eb = max(((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(gg, gw))
            f0 = lambda: ak.attention_forward(q, k, v, st, sc, 0, 0.0)
            f1 = lambda: af.attention_forward(q, k, v, st, sc, 0, 0.0)
            b0 = lambda: ak.attention_backward(do, q, k, v, out, lse, st, sc, 0, 0.0)
            b1 = lambda: af.attention_backward(do, q, k, v, out, lse, st, sc, 0, 0.0)
            tf = [timed(f0), timed(f1), timed(f0), timed(f1)]
            kb0, kb1 = kernel_ms(b0), kernel_ms(b1)
            say(f"{name:24s} fwd current {tf[0]:.3f}/{tf[2]:.3f} lookahead {tf[1]:.3f}/{tf[3]:.3f} (max|diff| {ef:.1e}); "
                f"dq kernel current {kb0.get('_attn_bwd_dq_kernel', 0):.3f} lookahead {kb1.get('_attn_bwd_dq_kernel', 0):.3f} "
                f"(rel diff {eb:.1e}); dkdv {kb0.get('_attn_bwd_dkdv_kernel', 0):.3f}")
            res[name] = dict(fwd_current=[tf[0], tf[2]], fwd_lookahead=[tf[1], tf[3]], dq=[kb0, kb1], err=[ef, eb])

    # Tile sweeps of the lookahead kernels, d = 128, the three rows: GPU time per kernel (profiler).
    rows = [attention_inputs({**s, "head_dim": 128}) for s in ATTENTION.shapes["full"]]
    for kernel, cands in (("fwd", [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2),
                                   (64, 128, 4, 2), (64, 32, 4, 4)]),
                          ("dq", [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 4, 3),
                                  (128, 64, 8, 3)])):
        orig = af.TILES[kernel, 128]
        for c in cands:
            af.TILES[kernel, 128] = c
            try:
                ts = []
                for inp in rows:
                    q, k, v, st = args(inp)
                    if kernel == "fwd":
                        fn = lambda: af.attention_forward(q, k, v, st, 128 ** -0.5, 0, 0.0)
                        key = "_attn_fwd_kernel"
                    else:
                        out, lse = ak.attention_forward(q, k, v, st, 128 ** -0.5, 0, 0.0)
                        do = inp["upstream"][0]
                        fn = lambda: af.attention_backward(do, q, k, v, out, lse, st, 128 ** -0.5, 0, 0.0)
                        key = "_attn_bwd_dq_kernel"
                    ts.append(kernel_ms(fn, 3)[key])
                say(f"lookahead {kernel} tiles {c}: {' '.join(f'{t:.3f}' for t in ts)} (sum {sum(ts):.3f})")
                res[f"sweep {kernel} {c}"] = ts
            except Exception as e:
                say(f"lookahead {kernel} tiles {c}: {type(e).__name__} {str(e)[:150]}")
        af.TILES[kernel, 128] = orig
    json.dump(res, open(os.path.join(OUT, "bench_f.json"), "w"), indent=1)
