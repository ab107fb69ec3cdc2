"""Ours vs SDPA (PyTorch's choice: cuDNN on Hopper) on the benchmark's three attention rows, fwd and fwd+bwd,
under whichever Triton is imported; then a tile sweep of the forward and the backward kernels on the 8K row."""
import sys, torch, triton
import attention_kernel as ak
from kernel_ft import benchmark_specs as bs

def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100)

rows = [{"tokens": 8192, "batch": 1, "seq": 8192, "heads": 32, "kv_heads": 8, "head_dim": 128, "docs": "one"},
        {"tokens": 16384, "batch": 1, "seq": 16384, "heads": 32, "kv_heads": 8, "head_dim": 128, "docs": [40, 200]},
        {"tokens": 16384, "batch": 1, "seq": 16384, "heads": 32, "kv_heads": 8, "head_dim": 128, "docs": [512, 4096]}]
print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)

def time_row(s, label):
    inp = bs.attention_inputs(s)
    q, k, v, ds = inp["args"]
    g = inp["upstream"][0]
    flop = 4 * s["heads"] * s["head_dim"] * bs.visible_pairs(s)
    res = {}
    for name, op in (("ours", lambda: ak.packed_attention(q, k, v, ds)), ("sdpa", None)):
        if name == "sdpa":
            if s["docs"] != "one":
                continue
            f = bs.sdpa_documents()
            op = lambda: f(q, k, v, ds)
        with torch.no_grad():
            t_f = ms(op)
        def fb():
            out = op()
            torch.autograd.grad(out, (q, k, v), g)
        t_fb = ms(fb)
        res[name] = (t_f, t_fb)
        print(f"  {label:<22} {name:<5} fwd {t_f*1e3:8.1f} us {flop/t_f/1e9:5.0f} TFLOP/s   fwd+bwd {t_fb*1e3:8.1f} us "
              f"{3*flop/t_fb/1e9:5.0f} TFLOP/s", flush=True)
    return res

for s in (rows[:1] if "--one" in sys.argv else rows):
    time_row(s, f"{s['seq']} docs={s['docs']}")

if "--sweep" in sys.argv:
    s = rows[0]
    base = dict(ak.TILES)
    for kern, cfgs in (("fwd", [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 2), (64, 128, 4, 3)]),
                       ("dkdv", [(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3), (32, 128, 4, 2)]),
                       ("dq", [(64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2), (128, 128, 8, 2), (64, 64, 4, 3)])):
        for cfg in cfgs:
            ak.TILES.clear(); ak.TILES.update(base); ak.TILES[kern, 128] = cfg
            try:
                time_row(s, f"8K {kern} {cfg}")
            except Exception as e:
                print(f"  8K {kern} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
    ak.TILES.clear(); ak.TILES.update(base)
