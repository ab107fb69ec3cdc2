"""On a Hopper GPU: attention_hopper_kernel.py's forward checked against float64 attention (and against
attention_kernel.attention_forward's own error on the same rows), then timed against ours and SDPA's
choice (cuDNN) on one causal document of 8,192 and 16,384 tokens; the grid of one program per query tile against
the persistent one (persistent=True). Prints a table; --json PATH writes it."""
import json, math, os, sys, time
import torch, triton
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import attention_hopper_kernel as ag
import attention_kernel as ak
from kernel_ft import benchmark_specs as bs

torch.manual_seed(0)
dev = "cuda"
print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
          "checks": [], "timings": []}


def rows(B, Hq, Hkv, T, D, hf_layout, dtype=torch.bfloat16):
    if hf_layout:  # HF's [B, T, H, D] seen as [B, H, T, D]
        mk = lambda h: torch.randn(B, T, h, D, device=dev, dtype=dtype).transpose(1, 2)
    else:
        mk = lambda h: torch.randn(B, h, T, D, device=dev, dtype=dtype)
    return mk(Hq), mk(Hkv), mk(Hkv)


def truth(q, k, v, scale, ds):
    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q64 @ k64.transpose(-1, -2)) * scale
    T = q.shape[2]
    n = torch.arange(T, device=dev)
    visible = (n[None, :] <= n[:, None]) & (n[None, None, :] >= ds[:, :, None].long())  # [B, T, T]
    s = s.masked_fill(~visible[:, None], float("-inf"))
    lse2 = torch.logsumexp(s, -1) / math.log(2)
    return (torch.softmax(s, -1) @ v64).transpose(1, 2), lse2


# --------------------------------------------------------------------------------------------
# Correctness: layouts, GQA, lengths that are not multiples of a tile, batches, both head dims.
# --------------------------------------------------------------------------------------------
cases = [(1, 4, 1, 128, 128, True, None), (2, 8, 2, 1000, 128, True, None), (2, 4, 4, 333, 64, False, None),
         (1, 8, 8, 2048, 64, True, None), (3, 6, 2, 517, 128, False, None), (1, 2, 1, 1, 128, True, None),
         (2, 4, 2, 4099, 128, True, None), (2, 4, 2, 1500, 128, True, (1, 300)), (1, 4, 1, 3000, 64, True, (200, 900)),
         (2, 2, 2, 700, 128, False, (1, 5))]
failures = 0
for B, Hq, Hkv, T, D, hf, docs in cases:
    q, k, v = rows(B, Hq, Hkv, T, D, hf)
    scale = D ** -0.5
    ds = bs.row_document_starts({"batch": B, "seq": T, "docs": docs or "one"})  # random lengths in docs
    ref, ref_lse = truth(q, k, v, scale, ds)
    for cfg in ((128, 2, False), (128, 3, False), (64, 2, False), (128, 3, True)):  # (BLOCK_N, STAGES, persistent)
        try:
            out, lse = ag.attention_forward_hopper(q, k, v, scale, None if docs is None else ds,
                                                   block_n=cfg[0], stages=cfg[1], persistent=cfg[2])
            torch.cuda.synchronize()
            err = (out.double() - ref).abs().max().item()
            lse_err = (lse.double() - ref_lse).abs().max().item()
        except Exception as e:
            err = lse_err = float("nan")
            print(f"  {type(e).__name__}: {str(e)[:300]}")
        ours, ours_lse = ak.attention_forward(q, k, v, ds.contiguous(), scale, 0, 0.0)  # the Triton forward
        ours_err = (ours.double() - ref).abs().max().item()
        ok = err <= 2 * ours_err + 1e-3 and lse_err <= 1e-3
        failures += not ok
        line = (f"B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} {'HF' if hf else 'BHTD'} docs={docs} tiles={cfg}: max|out-truth| "
                f"{err:.2e} (attention_kernel {ours_err:.2e}), lse {lse_err:.2e} {'ok' if ok else 'FAIL'}")
        print(line, flush=True)
        record["checks"].append(line)
print(f"correctness: {len(record['checks']) - failures} ok, {failures} failed", flush=True)

# --------------------------------------------------------------------------------------------
# Timing: one causal document per row, 32 query / 8 key-value heads, forward only.
# --------------------------------------------------------------------------------------------
def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


for T, D in ((8192, 128), (16384, 128), (8192, 64)):
    Hq, Hkv = (32, 8) if D == 128 else (32, 8)
    q, k, v = rows(1, Hq, Hkv, T, D, True)
    scale = D ** -0.5
    ds = torch.zeros(1, T, dtype=torch.int32, device=dev)
    flop = 4 * Hq * D * T * (T + 1) // 2
    runs = {"attention_kernel (Triton)": lambda: ak.attention_forward(q, k, v, ds, scale, 0, 0.0),
            "SDPA (PyTorch's choice)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
    for bn, st in ((128, 2), (128, 3), (64, 2), (64, 3)):
        runs[f"gluon BLOCK_N={bn} STAGES={st}"] = (
            lambda bn=bn, st=st: ag.attention_forward_hopper(q, k, v, scale, block_n=bn, stages=st))
    for st in (2, 3):
        runs[f"gluon persistent BLOCK_N=128 STAGES={st}"] = (
            lambda st=st: ag.attention_forward_hopper(q, k, v, scale, stages=st, persistent=True))
    runs["gluon, doc_start given"] = lambda: ag.attention_forward_hopper(q, k, v, scale, ds)
    print(f"\none causal document, T={T}, {Hq}/{Hkv} heads of {D}, bf16, forward", flush=True)
    for name, fn in runs.items():
        try:
            ms = bench(fn)
            print(f"  {name:<42} {ms * 1e3:8.1f} us {flop / ms / 1e9:6.0f} TFLOP/s", flush=True)
            record["timings"].append({"T": T, "D": D, "run": name, "us": ms * 1e3, "tflops": flop / ms / 1e9})
        except Exception as e:
            print(f"  {name:<42} {type(e).__name__}: {str(e)[:200]}", flush=True)
    # Alternate the best two once more, so that a drift of the clock does not pick the winner.
    best = sorted((r for r in record["timings"] if r.get("T") == T and r.get("D") == D and r["run"].startswith("gluon")),
                  key=lambda r: r["us"])[0]["run"]
    again = list(dict.fromkeys([best, "gluon BLOCK_N=128 STAGES=3", "gluon persistent BLOCK_N=128 STAGES=3",
                                "SDPA (PyTorch's choice)", "attention_kernel (Triton)"]))
    for rep in range(2):
        for name in again:
            ms = bench(runs[name])
            print(f"  again {name:<36} {ms * 1e3:8.1f} us {flop / ms / 1e9:6.0f} TFLOP/s", flush=True)
            record["timings"].append({"T": T, "D": D, "run": "again " + name, "us": ms * 1e3, "tflops": flop / ms / 1e9})

# Packed rows (the benchmark's): ours against the Gluon forward, forward only.
for docs in ([40, 200], [512, 4096]):
    spec = {"tokens": 16384, "batch": 1, "seq": 16384, "heads": 32, "kv_heads": 8, "head_dim": 128, "docs": docs}
    q, k, v, ds = (t.detach() for t in bs.attention_inputs(spec)["args"])
    flop = 4 * 32 * 128 * bs.visible_pairs(spec)
    print(f"\n16,384 tokens, documents of {docs[0]}-{docs[1]}, forward", flush=True)
    for name, fn in (("attention_kernel (Triton)", lambda: ak.attention_forward(q, k, v, ds, 128 ** -0.5, 0, 0.0)),
                     ("gluon (its tiles)", lambda: ag.attention_forward_hopper(q, k, v, 128 ** -0.5, ds)),
                     ("gluon BLOCK_N=64", lambda: ag.attention_forward_hopper(q, k, v, 128 ** -0.5, ds, 64, 2)),
                     ("gluon persistent", lambda: ag.attention_forward_hopper(q, k, v, 128 ** -0.5, ds, persistent=True))):
        for rep in range(2):
            ms = bench(fn)
            print(f"  {name:<42} {ms * 1e3:8.1f} us {flop / ms / 1e9:6.0f} TFLOP/s", flush=True)
            record["timings"].append({"docs": docs, "run": name, "us": ms * 1e3, "tflops": flop / ms / 1e9})

if "--json" in sys.argv:
    json.dump(record, open(sys.argv[sys.argv.index("--json") + 1], "w"), indent=1)
sys.exit(1 if failures else 0)
