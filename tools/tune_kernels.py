"""Sweep the launch parameters of the RMSNorm, cross-entropy, attention and FP8 cast kernels (GPU only).

Not a tutorial step: it produces the evidence behind the constants chosen in
rmsnorm_kernel.py (warps, backward programs per SM), cross_entropy_kernel.py
(vocabulary chunk, warps), attention_kernel.py (tiles, warps, stages per
kernel) and fp8_kernel.py (the amax and cast kernels' tiles), recorded in
NOTES.md. It monkeypatches those module constants, times each setting with
triton.testing.do_bench (median; the FP8 casts replayed in a CUDA graph) and
prints effective bandwidth; `overhead` times the host cost of one call on a
tiny tensor, where the GPU work is negligible.

Usage (from the repository root, on a CUDA machine):
    python tools/tune_kernels.py                       # everything, ~5 min on an H100
    python tools/tune_kernels.py --only ce --quick     # fewer settings
    python tools/tune_kernels.py --only attention --json tiles.json
    python tools/tune_kernels.py --only fp8
"""

import argparse

import torch
import triton
from triton.testing import do_bench

import attention_kernel as ak
from kernel_ft.benchmark_specs import copy_bandwidth
import cross_entropy_kernel as ce
import fp8_kernel as fk
import rmsnorm_kernel as rk
from kernel_ft.files import check_output_path, write_json_atomic


def bench(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def rmsnorm_sweep(rows_list, results):
    h = 4096
    orig_config, orig_bwd = rk._launch_config, rk._bwd_launch_config
    for n in rows_list:
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (1 + 0.5 * torch.randn(h, device="cuda")).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
        nbytes = n * h * 2
        for fwd_warps in (4, 8, 16):
            rk._launch_config = lambda c, fw=fwd_warps: (triton.next_power_of_2(c), 1, fw)
            ms = bench(lambda: rk.rmsnorm(x.detach(), w.detach()))
            tbs = 2 * nbytes / ms / 1e9
            results.append(dict(kernel="rmsnorm_fwd", rows=n, warps=fwd_warps, ms=ms, tbs=tbs))
            print(f"rmsnorm fwd   rows={n:6d} warps={fwd_warps:2d}            {ms * 1e3:8.1f} us {tbs:5.2f} TB/s", flush=True)
        rk._launch_config = orig_config
        for step_rows in (1, 2, 4):  # the backward's rows per loop step
            for warps in (8, 16):
                for per_sm in (1, 2, 4):
                    rk._bwd_launch_config = lambda c, r=step_rows, fw=warps, p=per_sm: (triton.next_power_of_2(c), r, fw, p)
                    ms = bench(lambda: torch.autograd.grad(rk.rmsnorm(x, w), (x, w), dy))
                    tbs = 5 * nbytes / ms / 1e9
                    results.append(dict(kernel="rmsnorm_fwdbwd", rows=n, step_rows=step_rows, warps=warps,
                                        per_sm=per_sm, ms=ms, tbs=tbs))
                    print(f"rmsnorm f+b   rows={n:6d} step_rows={step_rows} warps={warps:2d} per_sm={per_sm}   "
                          f"{ms * 1e3:8.1f} us {tbs:5.2f} TB/s", flush=True)
        x = dy = None  # free before the next size (the timed lambdas above are done with them)
    rk._launch_config, rk._bwd_launch_config = orig_config, orig_bwd


def ce_sweep(rows_list, results, quick):
    v = 128256
    blocks = (4096, 8192, 16384) if quick else (2048, 4096, 8192, 16384, 32768)
    orig = ce.BLOCK_V_GPU, ce.NUM_WARPS_GPU, ce.FEW_ROWS
    ce.FEW_ROWS = 0  # every row count takes the swept (BLOCK_V_GPU, NUM_WARPS_GPU)
    for n in rows_list:
        logits = (torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_()
        targets = torch.randint(0, v, (n,), device="cuda")
        nbytes = n * v * 2
        for block in blocks:
            for warps in (4, 8, 16, 32):
                if block // (32 * warps) < 1:
                    continue
                ce.BLOCK_V_GPU, ce.NUM_WARPS_GPU = block, warps
                try:
                    ms = bench(lambda: torch.autograd.grad(ce.cross_entropy(logits, targets), logits))
                    ms_f = bench(lambda: ce.cross_entropy(logits.detach(), targets))
                except Exception as e:  # noqa: BLE001 - a config may not compile
                    print(f"ce block={block} warps={warps}: {type(e).__name__} {e}"[:200])
                    continue
                results.append(dict(kernel="ce", rows=n, block=block, warps=warps, ms_fwdbwd=ms, ms_fwd=ms_f))
                print(f"ce rows={n:6d} block={block:6d} warps={warps:2d}  fwd {ms_f:7.3f} ms ({nbytes / ms_f / 1e9:4.2f} TB/s)"
                      f"  fwd+bwd {ms:7.3f} ms ({2 * nbytes / ms / 1e9:4.2f} TB/s 1R+1W)", flush=True)
        logits = None  # free before the next size
    ce.BLOCK_V_GPU, ce.NUM_WARPS_GPU, ce.FEW_ROWS = orig


# Candidates per attention kernel: (BLOCK_M, BLOCK_N, warps, stages). The other two
# kernels keep attention_kernel.TILES while one is swept; the best of each is the
# one with the lowest summed time over the rows.
ATTENTION_CANDIDATES = {
    "fwd": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
            (128, 128, 8, 3), (128, 32, 4, 3), (64, 32, 4, 4)],
    "dkdv": [(64, 64, 4, 2), (64, 64, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 8, 3),
             (64, 128, 8, 2), (64, 128, 8, 3),
             (32, 128, 4, 4), (32, 128, 4, 5), (16, 64, 4, 4)],
    "dq": [(64, 64, 4, 2), (64, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2),
           (128, 32, 4, 4), (128, 64, 8, 3), (64, 32, 4, 4)],
}


def attention_call(kernel, inp, d):
    """One attention kernel on a benchmark row, as a call to check and to time: the
    forward (returning (out,)), or the backward after one forward (dQ, dK, dV)."""
    q, k, v, starts = (t.detach() if torch.is_tensor(t) else t for t in inp["args"])
    if kernel == "fwd":
        return lambda: ak.attention_forward(q, k, v, starts, d ** -0.5, 0, 0.0)[:1]
    out, lse = ak.attention_forward(q, k, v, starts, d ** -0.5, 0, 0.0)
    return lambda: ak.attention_backward(inp["upstream"][0], q, k, v, out, lse, starts, d ** -0.5, 0, 0.0)


def attention_sweep(head_dims, results, quick):
    """Each kernel's candidates on benchmark_specs' attention rows (one long document,
    short documents, long documents), bf16, 32 query and 8 key/value heads."""
    from kernel_ft.benchmark_specs import ATTENTION, attention_inputs

    rows = ATTENTION.shapes["quick" if quick else "full"]
    orig = dict(ak.TILES)
    for d in head_dims:
        dp = max(64, triton.next_power_of_2(d))
        inputs = [attention_inputs({**s, "head_dim": d}) for s in rows]
        for kernel, candidates in ATTENTION_CANDIDATES.items():
            totals = {}
            expected = [attention_call(kernel, inp, d)() for inp in inputs]  # at the tested tiles
            # Other head dims: the current tiles and the first three candidates, each once.
            for tiles in candidates if d == 128 else dict.fromkeys([orig[kernel, dp], *candidates[:3]]):
                ak.TILES[kernel, dp] = tiles
                times = []
                try:
                    for s, inp, want in zip(rows, inputs, expected):
                        # A tile shape the tests never ran must still compute the same thing.
                        call = attention_call(kernel, inp, d)
                        err = max(((g.float() - w.float()).norm() / w.float().norm()).item()
                                  for g, w in zip(call(), want))
                        if err > 1e-2:
                            raise RuntimeError(f"wrong result at these tiles: relative error {err:.2e}")
                        ms = bench(call)
                        times.append(ms)
                        results.append(dict(kernel=f"attention_{kernel}", head_dim=d, seq=s["seq"], docs=str(s["docs"]),
                                            tiles=tiles, ms=ms))
                except Exception as e:  # noqa: BLE001 - a config may not fit in shared memory
                    print(f"attention {kernel} d={d} tiles={tiles}: {type(e).__name__} {str(e)[:120]}")
                    continue
                totals[tiles] = sum(times)
                print(f"attention {kernel:5s} d={d:3d} tiles={tiles}  " + "  ".join(f"{t:7.3f}" for t in times)
                      + f"  ms (sum {totals[tiles]:.3f})", flush=True)
            ak.TILES[kernel, dp] = orig[kernel, dp]
            if totals:
                best = min(totals, key=totals.get)
                print(f"attention {kernel} d={d}: best {best} (now {orig[kernel, dp]})", flush=True)
                results.append(dict(kernel=f"attention_{kernel}_best", head_dim=d, tiles=best, now=orig[kernel, dp]))
        inputs = None
    ak.TILES.update(orig)


FP8_AMAX_CANDIDATES = [(64, 128, 8, 4), (64, 128, 8, 2), (64, 128, 8, 8), (32, 256, 8, 4), (64, 256, 8, 4),
                       (128, 128, 8, 4), (64, 128, 4, 8), (16, 512, 4, 4), (128, 64, 8, 4)]
FP8_CAST_CANDIDATES = [(64, 128, 8), (128, 128, 8), (64, 64, 4), (128, 64, 8), (32, 128, 4), (64, 256, 8),
                       (128, 128, 16), (32, 256, 8)]
# Kernel 3 (rowwise without x^T, one pass): elements per tile, elements per thread, programs per SM.
FP8_ROW_CANDIDATES = [(t, e, p) for t in (4096, 8192, 16384) for e in (8, 16, 32) for p in (1, 2, 4)]
# Kernel 1b (the flat per-tensor amax): elements per block, warps, programs per SM.
FP8_FLAT_CANDIDATES = [(b, w, p) for b in (4096, 8192, 16384) for w in (4, 8) for p in (1, 2, 4, 8)
                       if 8 <= b // (32 * w) <= 64]


def fp8_sweep(results, quick, copy_tbs):
    """quantize() replayed in a CUDA graph (GPU time), both recipes, with and without the
    transposed copy, on the 8B MLP's activations: the tiled amax kernel's candidates first
    (per row; the cast at its current tiles), then the cast's with the best amax, then the one-pass
    rowwise kernel's (rowwise without the transposed copy only), then the flat per-tensor
    amax's (tensorwise only)."""
    shapes = [(8192, 4096)] if quick else [(4096, 4096), (8192, 4096), (8192, 14336)]
    cases = [(r, t) for r in fk.RECIPES for t in (False, True)]
    inputs = {s: torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in shapes}

    def total(what, setting):
        ms_all = []
        for shape, x in inputs.items():
            for recipe, transpose in cases:
                # Each kernel on the cases it runs: the tiled amax per row (a dense x per tensor
                # takes the flat one), the one-pass kernel per row without x^T, the flat per tensor.
                if (what == "amax" and recipe != "rowwise" or what == "rows" and (recipe != "rowwise" or transpose)
                        or what == "flat" and recipe != "tensorwise"):
                    continue
                fk.quantize(x, recipe, transpose)
                ms = triton.testing.do_bench_cudagraph(lambda: fk.quantize(x, recipe, transpose), rep=100,
                                                       return_mode="median")
                tbs = x.numel() * fk.cast_traffic(x, recipe, transpose) / ms / 1e9
                ms_all.append(ms)
                results.append(dict(kernel=f"fp8_{what}", setting=setting, shape=shape, recipe=recipe,
                                    transpose=transpose, ms=ms, tbs=tbs))
                print(f"fp8 {what:4s} {str(setting):18s} {shape[0]:5d}x{shape[1]:<5d} {recipe:10s} "
                      f"{'x,x^T' if transpose else 'x':5s} {ms * 1e3:7.1f} us {tbs:5.2f} TB/s "
                      f"{tbs / copy_tbs:4.0%}", flush=True)
        return sum(ms_all)

    orig = dict(amax=fk.AMAX_TILES, cast=fk.CAST_TILES, rows=fk.ROW_CAST, flat=fk.AMAX_FLAT)
    for what, candidates, attr in (("amax", FP8_AMAX_CANDIDATES, "AMAX_TILES"),
                                   ("cast", FP8_CAST_CANDIDATES, "CAST_TILES"),
                                   ("rows", FP8_ROW_CANDIDATES, "ROW_CAST"),
                                   ("flat", FP8_FLAT_CANDIDATES, "AMAX_FLAT")):
        totals = {}
        for setting in candidates:
            setattr(fk, attr, setting)
            try:
                totals[setting] = total(what, setting)
            except Exception as e:  # noqa: BLE001 - a setting may not compile or fit
                print(f"fp8 {what} {setting}: {type(e).__name__} {str(e)[:120]}")
        best = min(totals, key=totals.get)
        setattr(fk, attr, best)  # the next sweeps run with the best so far
        print(f"fp8 {what}: best {best} (now {orig[what]}), sum {totals[best] * 1e3:.0f} us", flush=True)
        results.append(dict(kernel=f"fp8_{what}_best", setting=best, now=orig[what]))
    fk.AMAX_TILES, fk.CAST_TILES, fk.ROW_CAST, fk.AMAX_FLAT = orig["amax"], orig["cast"], orig["rows"], orig["flat"]


def cpu_overhead(results):
    """Per-call host time of each path on a tiny tensor (GPU work negligible): launch cost."""
    import time

    import torch.nn.functional as F

    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    y = torch.empty_like(x)
    rstd = torch.empty(1, device="cuda")
    logits = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tgt = torch.zeros(1, dtype=torch.long, device="cuda")
    cases = {
        "raw fwd kernel launch": lambda: rk._rmsnorm_fwd_kernel[(1,)](
            x, w, y, rstd, rstd, 4096, 1, 4096, 1e-6, BLOCK_N=4096, ROWS=1, num_warps=8),
        "ours rmsnorm fwd (no grad)": lambda: rk.rmsnorm(x.detach(), w.detach()),
        "F.rms_norm fwd": lambda: F.rms_norm(x.detach(), (4096,), w.detach(), 1e-6),
        "ours rmsnorm fwd+bwd": lambda: torch.autograd.grad(rk.rmsnorm(x, w), (x, w), dy),
        "F.rms_norm fwd+bwd": lambda: torch.autograd.grad(F.rms_norm(x, (4096,), w, 1e-6), (x, w), dy),
        "ours CE fwd+bwd": lambda: torch.autograd.grad(ce.cross_entropy(logits, tgt), logits),
        "F.cross_entropy fwd+bwd": lambda: torch.autograd.grad(F.cross_entropy(logits.float(), tgt), logits),
    }
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        us = (time.perf_counter() - t) / 300 * 1e6
        results.append(dict(kernel="cpu_overhead", case=name, us=us))
        print(f"host time per call  {name:<28} {us:7.1f} us", flush=True)


def main():
    p = argparse.ArgumentParser(
        description="Sweep launch parameters of the RMSNorm, CE, attention and FP8 cast kernels (GPU).")
    p.add_argument("--json", metavar="PATH", help="write every timing here")
    p.add_argument("--quick", action="store_true", help="fewer settings and sizes")
    p.add_argument("--only", choices=["rmsnorm", "ce", "overhead", "attention", "fp8"],
                   help="one sweep instead of all")
    args = p.parse_args()
    if args.json:
        args.json = check_output_path(args.json, "--json", suffix=".json")
    if not torch.cuda.is_available():
        raise SystemExit("error: tune_kernels.py times GPU kernels and needs a CUDA device")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    results = [dict(kernel="copy", tbs=copy_bandwidth((25, 100)) / 1e3)]  # TB/s, as benchmark_*.py measure it
    print(f"device copy bandwidth: {results[0]['tbs']:.2f} TB/s")
    if args.only in (None, "overhead"):
        cpu_overhead(results)
    if args.only in (None, "rmsnorm"):
        rmsnorm_sweep((4096, 16384, 65536), results)
    if args.only in (None, "ce"):
        ce_sweep((1024, 8192) if args.quick else (1024, 4096, 8192, 16384), results, args.quick)
    if args.only in (None, "attention"):
        attention_sweep((128,) if args.quick else (128, 64, 256), results, args.quick)
    if args.only in (None, "fp8"):
        supported, why = fk.fp8_supported(torch.device("cuda"))
        if supported:
            fp8_sweep(results, args.quick, results[0]["tbs"])
        else:
            print(f"fp8 sweep skipped: {why}")
    if args.json:
        write_json_atomic(args.json, {"device": torch.cuda.get_device_name(), "results": results})
        print(f"Wrote {args.json}")


if __name__ == "__main__":
    main()
