"""On a Hopper GPU: the Gluon backward (attention_hopper_kernel.attention_backward_hopper) with the options given,
each variant checked against float64 on six rows and timed on the 8K document, two packed rows (documents of
512-4,096 and of 40-200 tokens) and the 16K document beside the Triton backward and cuDNN's. Prints a table; --json
PATH writes it.
--quick: three rows checked, the 8K document timed once; --timings-only: no checks and no Triton backward, the 8K
and 16K documents timed; --rounds N: timings repeated N times (default 2, 1 with --quick).
python sweep.py [--quick] [--timings-only] [--rounds N] [--json PATH] NAME=opt:value,opt:value ...
  e.g.  default=  atomics=dq_tma:0  interleaved=kv_group:1024  inplace=dq_in_place:1
(The variants measured on 2026-12-07 -- the probe's dq_mode and heavy_first, the kernel's dq_writer, prefetch, dq_first
and from_end -- are in git history; the last four's timings in ../gluon_h100/backward_options/.)"""
import json, os, sys
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
import attention_kernel as ak  # first: kernel_common's import rule
ak.USE_HOPPER_BACKWARD = False  # ak.attention_backward: the Triton backward, the peer here
from attention_hopper_kernel import attention_backward_hopper
import triton
from kernel_ft import benchmark_specs as bs

args = sys.argv[1:]
quick = "--quick" in args  # three rows checked; the 8K document timed, one round
if quick:
    args.remove("--quick")
timings_only = "--timings-only" in args  # no checks and no Triton backward: the 8K timings in the least time
if timings_only:
    args.remove("--timings-only")
rounds = 1 if quick else 2
if "--rounds" in args:
    i = args.index("--rounds")
    rounds = int(args[i + 1])
    del args[i:i + 2]
out_json = None
if "--json" in args:
    i = args.index("--json")
    out_json = args[i + 1]
    del args[i:i + 2]
variants = {}
for a in args:
    name, _, opts = a.partition("=")
    variants[name] = {k: int(v) for k, v in (o.split(":") for o in opts.split(",") if o)}

dev = "cuda"
print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
          "checks": [], "timings": []}
failures = 0
# Layouts of GQA, lengths that end inside a tile, one document or packed ones of random lengths in docs.
rows = [(1, 4, 1, 256, 128, None), (2, 8, 2, 1000, 128, None), (1, 4, 4, 333, 128, None),
        (2, 4, 2, 1500, 128, (1, 300)), (1, 2, 1, 700, 128, (1, 5)), (1, 8, 2, 2048, 128, (200, 900))]
for B, Hq, Hkv, T, D, docs in [] if timings_only else rows[1:4] if quick else rows:
    torch.manual_seed(0)
    q = torch.randn(B, T, Hq, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    dout = torch.randn(B, T, Hq, D, device=dev, dtype=torch.bfloat16)
    ds = bs.row_document_starts({"batch": B, "seq": T, "docs": docs or "one"})
    scale = D ** -0.5
    out, lse = ak.attention_forward(q, k, v, ds, scale, 0, 0.0)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    truth = torch.autograd.grad(ak.attention_reference(q64, k64, v64, ds, scale).transpose(1, 2),
                                (q64, k64, v64), dout.double())
    ref = [(a.double() - t).norm().item() / t.norm().item()
           for a, t in zip(ak.attention_backward(dout, q, k, v, out, lse, ds.contiguous(), scale, 0, 0.0), truth)]
    delta, doc_end = ak.backward_delta(out, dout), None if docs is None else ak.document_ends(ds)
    for name, opts in variants.items():
        try:
            got = attention_backward_hopper(dout, q, k, v, lse, delta, doc_end, scale, **opts)
            errs = [(a.double() - t).norm().item() / t.norm().item() for a, t in zip(got, truth)]
        except Exception as e:
            print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            errs = [float("nan")] * 3
        ok = all(e <= 2 * r + 1e-4 for e, r in zip(errs, ref))
        failures += not ok
        line = (f"{name:<12} B={B} Hq={Hq} Hkv={Hkv} T={T} docs={docs}: dq/dk/dv {errs[0]:.2e} {errs[1]:.2e} "
                f"{errs[2]:.2e} (Triton {ref[0]:.2e} {ref[1]:.2e} {ref[2]:.2e}) {'ok' if ok else 'FAIL'}")
        print(line, flush=True)
        record["checks"].append(line)

for spec in [{"tokens": 8192, "batch": 1, "seq": 8192, "heads": 32, "kv_heads": 8, "head_dim": 128, "docs": "one"},
             {"tokens": 16384, "batch": 1, "seq": 16384, "heads": 32, "kv_heads": 8, "head_dim": 128,
              "docs": [512, 4096]},
             {"tokens": 16384, "batch": 1, "seq": 16384, "heads": 32, "kv_heads": 8, "head_dim": 128,
              "docs": [40, 200]},
             {"tokens": 16384, "batch": 1, "seq": 16384, "heads": 32, "kv_heads": 8, "head_dim": 128, "docs": "one"}
             ][::3 if timings_only else 1][:1 if quick and not timings_only else 4]:
    inputs = bs.attention_inputs(spec)
    q, k, v, ds = (t.detach() for t in inputs["args"])
    dout = inputs["upstream"][0]
    scale = 128 ** -0.5
    out, lse = ak.attention_forward(q, k, v, ds, scale, 0, 0.0)
    flop = 2.5 * 4 * 32 * 128 * bs.visible_pairs(spec)
    runs = {} if timings_only else {"Triton (7 products)":
                                    lambda: ak.attention_backward(dout, q, k, v, out, lse, ds.contiguous(), scale, 0, 0.0)}
    doc_end = None if spec["docs"] == "one" else ak.document_ends(ds)

    def gluon(o):  # as attention_kernel.attention_backward calls it: delta computed in the call
        return lambda: attention_backward_hopper(dout, q, k, v, lse, ak.backward_delta(out, dout), doc_end, scale, **o)

    for name, opts in variants.items():
        runs[name] = gluon(opts)
    if spec["docs"] == "one":
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        runs["SDPA (cuDNN)"] = lambda: torch.autograd.grad(o, (qq, kk, vv), dout.transpose(1, 2), retain_graph=True)
    print(f"\nT={spec['seq']} documents {spec['docs']}, backward", flush=True)
    for rep in range(rounds):
        for name, fn in runs.items():
            try:
                ms = triton.testing.do_bench(fn, warmup=10, rep=80)
                print(f"  {name:<24} {ms * 1e3:8.1f} us {flop / ms / 1e9:6.0f} TFLOP/s", flush=True)
                record["timings"].append({"docs": str(spec["docs"]), "run": name, "opts": variants.get(name),
                                          "us": ms * 1e3})
            except Exception as e:
                print(f"  {name:<24} {type(e).__name__}: {str(e)[:200]}", flush=True)
if out_json:
    json.dump(record, open(out_json, "w"), indent=1)
sys.exit(1 if failures else 0)
