"""On a Hopper GPU: attention_hopper_kernel.py's backward against float64 (and against attention_kernel's own
backward on the same rows), then timed against it and cuDNN's backward on one causal document of 8,192
tokens and on the two packed benchmark rows. Prints a table; --json PATH writes it."""
import json, math, os, sys
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
import attention_kernel as ak  # first: kernel_common's import rule
from attention_hopper_kernel import attention_backward_hopper
import triton
from kernel_ft import benchmark_specs as bs

torch.manual_seed(0)
dev = "cuda"
print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
          "checks": [], "timings": []}


def grads_truth(q, k, v, dout, ds, scale):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = ak.attention_reference(q64, k64, v64, ds, scale).transpose(1, 2)
    return torch.autograd.grad(out, (q64, k64, v64), dout.double())


failures = 0
cases = [(1, 4, 1, 256, 128, None), (2, 8, 2, 1000, 128, None), (1, 4, 4, 333, 128, None),
         (2, 4, 2, 1500, 128, (1, 300)), (1, 2, 1, 700, 128, (1, 5)), (1, 8, 2, 2048, 128, (200, 900))]
for B, Hq, Hkv, T, D, docs in cases:
    q = torch.randn(B, T, Hq, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    dout = torch.randn(B, T, Hq, D, device=dev, dtype=torch.bfloat16)
    ds = bs.row_document_starts({"batch": B, "seq": T, "docs": docs or "one"})  # random lengths in docs
    scale = D ** -0.5
    out, lse = ak.attention_forward(q, k, v, ds, scale, 0, 0.0)
    truth = grads_truth(q, k, v, dout, ds, scale)
    theirs = ak.attention_backward(dout, q, k, v, out, lse, ds.contiguous(), scale, 0, 0.0)  # the Triton one
    try:
        ours = attention_backward_hopper(dout, q, k, v, lse, ak.backward_delta(out, dout),
                                         None if docs is None else ak.document_ends(ds), scale)
        torch.cuda.synchronize()
    except Exception as e:
        print(f"  {type(e).__name__}: {str(e)[:400]}", flush=True)
        ours = [torch.full_like(t, float("nan")) for t in theirs]
    errs = [(a.double() - t).norm().item() / t.norm().item() for a, t in zip(ours, truth)]
    ref = [(a.double() - t).norm().item() / t.norm().item() for a, t in zip(theirs, truth)]
    ok = all(e <= 2 * r + 1e-4 for e, r in zip(errs, ref))
    failures += not ok
    line = (f"B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} docs={docs}: relative error dq/dk/dv "
            f"{errs[0]:.2e} {errs[1]:.2e} {errs[2]:.2e} (attention_kernel {ref[0]:.2e} {ref[1]:.2e} {ref[2]:.2e}) "
            f"{'ok' if ok else 'FAIL'}")
    print(line, flush=True)
    record["checks"].append(line)

rows = [{"tokens": 8192, "batch": 1, "seq": 8192, "heads": 32, "kv_heads": 8, "head_dim": 128, "docs": "one"},
        {"tokens": 16384, "batch": 1, "seq": 16384, "heads": 32, "kv_heads": 8, "head_dim": 128, "docs": [40, 200]},
        {"tokens": 16384, "batch": 1, "seq": 16384, "heads": 32, "kv_heads": 8, "head_dim": 128, "docs": [512, 4096]}]
for spec in rows:
    q, k, v, ds = (t.detach() for t in bs.attention_inputs(spec)["args"])
    dout = bs.attention_inputs(spec)["upstream"][0]
    scale = 128 ** -0.5
    out, lse = ak.attention_forward(q, k, v, ds, scale, 0, 0.0)
    flop = 2.5 * 4 * 32 * 128 * bs.visible_pairs(spec)  # five products of 2 x pairs x D each
    runs = {"attention_kernel backward (Triton, 7 products)":
                lambda: ak.attention_backward(dout, q, k, v, out, lse, ds.contiguous(), scale, 0, 0.0),
            "gluon backward (5 products)":
                lambda: attention_backward_hopper(dout, q, k, v, lse, ak.backward_delta(out, dout),
                                                  None if spec["docs"] == "one" else ak.document_ends(ds), scale)}
    if spec["docs"] == "one":
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        runs["SDPA backward (PyTorch's choice)"] = lambda: torch.autograd.grad(o, (qq, kk, vv), dout.transpose(1, 2),
                                                                               retain_graph=True)
    print(f"\nT={spec['seq']} documents {spec['docs']}, backward", flush=True)
    for rep in range(2):
        for name, fn in runs.items():
            try:
                ms = triton.testing.do_bench(fn, warmup=10, rep=100)
                print(f"  {name:<48} {ms * 1e3:8.1f} us {flop / ms / 1e9:6.0f} TFLOP/s (5-product work)", flush=True)
                record["timings"].append({"docs": str(spec["docs"]), "run": name, "us": ms * 1e3})
            except Exception as e:
                print(f"  {name:<48} {type(e).__name__}: {str(e)[:200]}", flush=True)

if "--json" in sys.argv:
    json.dump(record, open(sys.argv[sys.argv.index("--json") + 1], "w"), indent=1)
sys.exit(1 if failures else 0)
