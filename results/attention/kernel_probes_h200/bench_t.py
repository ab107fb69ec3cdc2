"""Probe: the dK/dV kernel computed transposed (S^T = K Q^T) against the current one, on
benchmark_specs' attention rows; tile sweep of the transposed kernel; kernel breakdown."""
import json, os, sys, statistics
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.nn.functional as F
import attention_kernel as ak
import attn_t as at
from kernel_ft.benchmark_specs import ATTENTION, attention_inputs

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


def rows(d):
    return [(f"{s['seq']} {s['docs']}", attention_inputs({**s, "head_dim": d})) for s in ATTENTION.shapes["full"]]


def bwd_call(mod, inp, d):
    q, k, v, st = (t.detach() if torch.is_tensor(t) else t for t in inp["args"])
    out, lse = ak.attention_forward(q, k, v, st, d ** -0.5, 0, 0.0)
    do = inp["upstream"][0]
    return lambda: mod.attention_backward(do, q, k, v, out, lse, st, d ** -0.5, 0, 0.0)


def fwd_call(inp, d):
    q, k, v, st = (t.detach() if torch.is_tensor(t) else t for t in inp["args"])
    return lambda: ak.attention_forward(q, k, v, st, d ** -0.5, 0, 0.0)


def say(*a):
    print(*a, flush=True)


say(torch.cuda.get_device_name(), torch.__version__)
for d in (128, 64, 256):
    rs = rows(d) if d == 128 else rows(d)[:1]
    for name, inp in rs:
        ref = bwd_call(ak, inp, d)()
        got = bwd_call(at, inp, d)()
        errs = [((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, ref)]
        tf = timed(fwd_call(inp, d))
        t0 = timed(bwd_call(ak, inp, d))
        t1 = timed(bwd_call(at, inp, d))
        t0b = timed(bwd_call(ak, inp, d))
        t1b = timed(bwd_call(at, inp, d))
        say(f"d={d} {name:18s} fwd {tf:.3f}  bwd current {t0:.3f}/{t0b:.3f}  transposed {t1:.3f}/{t1b:.3f}  rel err {max(errs):.2e}")
        res[f"d{d} {name}"] = dict(fwd=tf, bwd_current=[t0, t0b], bwd_transposed=[t1, t1b], err=errs)
        if d == 128 and "one" in name:
            q, k, v, st = (t.detach() for t in inp["args"])
            do = inp["upstream"][0].transpose(1, 2)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
                o.backward(do)
            def cudnn_f():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                    F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
            tc, tcf = timed(cudnn), timed(cudnn_f)
            say(f"   cuDNN fwd {tcf:.3f} fwd+bwd {tc:.3f}")
            res["cudnn 8k"] = dict(fwd=tcf, fwdbwd=tc)

# Tile sweep of the transposed dK/dV kernel, d = 128, all three rows.
inputs = rows(128)
cands = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 4, 4), (64, 128, 8, 2),
         (64, 128, 8, 3), (32, 128, 8, 3), (128, 64, 8, 2), (16, 128, 4, 4), (64, 64, 8, 3), (128, 128, 8, 2)]
orig = at.TILES["dkdv", 128]
refs = [bwd_call(ak, inp, 128)() for _, inp in inputs]
for c in cands:
    at.TILES["dkdv", 128] = c
    try:
        ts, errs = [], []
        for (name, inp), ref in zip(inputs, refs):
            got = bwd_call(at, inp, 128)()
            errs.append(max(((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, ref)))
            ts.append(timed(bwd_call(at, inp, 128), reps=9))
        say(f"transposed dkdv tiles {c}: bwd {' '.join(f'{t:.3f}' for t in ts)}  (sum {sum(ts):.3f}) err {max(errs):.1e}")
        res[f"sweep {c}"] = ts
    except Exception as e:
        say(f"transposed dkdv tiles {c}: {type(e).__name__} {str(e)[:150]}")
at.TILES["dkdv", 128] = orig

# Kernel breakdown on the 8K row: current vs transposed.
from torch.profiler import profile, ProfilerActivity
name, inp = inputs[0]
for label, mod in (("current", ak), ("transposed", at)):
    fn = bwd_call(mod, inp, 128)
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    say(label)
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or "kernel" in e.key:
            t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
            if t:
                say(f"   {e.key[:60]:60s} {t / 5 / 1000:.3f} ms")
json.dump(res, open(os.path.join(OUT, "bench_t.json"), "w"), indent=1)
