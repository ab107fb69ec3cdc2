"""
Smoke test of benchmark_kernels.py (runs on CPU through the Triton interpreter).

Usage:
    python -m pytest benchmark_test.py
    python benchmark_test.py          # the same checks as a PASSED/FAILED report

It runs the benchmark's ``--quick`` mode end to end (tables, JSON, plot), checks
that every provider appears with a status, that failing peers (out of memory,
any other exception) are reported instead of stopping the run, and that the
byte formulas are the ones the tables print. On CPU nothing is timed; on a GPU
the same checks also require real latencies for our kernels.
"""

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path

import torch

# benchmark_kernels switches on the Triton interpreter before triton is imported.
import benchmark_kernels as bk

ON_GPU = torch.cuda.is_available()
ENV_KEYS = ("gpu", "python", "torch", "triton", "transformers", "cuda", "date", "liger_kernel", "copy_bandwidth_GBps")
RECORD_KEYS = (
    "provider", "shape", "label", "bytes", "fwd_status", "fwdbwd_status", "memory_status",
    "fwd_ms", "fwdbwd_ms", "fwd_GBps", "fwdbwd_GBps", "fwd_pct_copy", "fwdbwd_pct_copy",
    "speedup_fwd", "speedup_fwdbwd", "peak_extra_MB", "error", "messages",
)


def _run_main(argv):
    """Run the benchmark's main() and return (results dict, printed text)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        results = bk.main(argv)
    return results, out.getvalue()


def test_quick_run_writes_tables_json_and_plot(tmp_path):
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    _, text = _run_main(["--quick", "--kernel", "all", "--json", str(json_path), "--plot", str(png_path)])

    # The tables and their explanations were printed.
    assert "RMSNorm benchmark" in text and "Cross-entropy benchmark" in text
    for header in ("tokens", "provider", "fwd us", "fwd+bwd us", "%copy", "ours x", "peak MB", "loss |err|"):
        assert header in text, header
    assert "5*N*H*2" in text and "2*N*V*2" in text, "byte formulas missing under the tables"
    if not ON_GPU:
        assert "no performance claim" in text and bk.NA_CPU in text

    data = json.loads(json_path.read_text())
    for key in ENV_KEYS:
        assert key in data["environment"], key
    assert set(data["kernels"]) == set(bk.KERNELS)
    for name, kres in data["kernels"].items():
        bench = bk.KERNELS[name]
        shapes = bench.shapes(quick=True)
        assert kres["shapes"] == shapes
        assert len(kres["results"]) == len(shapes) * len(kres["providers"])
        for rec in kres["results"]:
            for key in RECORD_KEYS:
                assert key in rec, (name, key)
            assert rec["provider"] in kres["providers"]
            assert rec["fwd_status"] and rec["fwdbwd_status"] and rec["memory_status"]
            if rec["provider"] != "Liger-Kernel":  # a third-party failure is reported, not ours to fail on
                assert not any(s in ("ERR", "OOM") for s in (rec["fwd_status"], rec["fwdbwd_status"])), rec
        ours = [r for r in kres["results"] if r["provider"] == kres["ours"]]
        assert ours and all(r["error"] is not None and math.isfinite(r["error"]) for r in ours)
        if ON_GPU:
            assert all(r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["peak_extra_MB"] >= 0 for r in ours)
        else:
            # No timing claims on CPU: no latency, bandwidth or memory anywhere.
            assert all(r["fwd_ms"] is None and r["fwd_GBps"] is None and r["peak_extra_MB"] is None
                       for r in kres["results"])
            compiled = [r for r in kres["results"] if r["provider"].startswith("torch.compile")]
            assert compiled and all(r["fwd_status"] == bk.SKIPPED_CPU for r in compiled)
        liger = [r for r in kres["results"] if r["provider"] == "Liger-Kernel"]
        if bk._liger_version() is None:
            assert all(r["fwd_status"] == bk.NOT_INSTALLED for r in liger)

    # Our cross-entropy loss is as accurate as PyTorch's float32 path (about 1e-7 here).
    ce = data["kernels"]["cross_entropy"]["results"]
    err = {r["provider"]: r["error"] for r in ce if r["error"] is not None}
    assert err["ours (Triton)"] <= 2 * err["PyTorch eager (HF fp32)"] + 1e-5
    assert err["ours (in-place)"] <= 2 * err["PyTorch eager (HF fp32)"] + 1e-5
    # RMSNorm output error is bf16 rounding of the output, like the HF formula's.
    rms = {r["provider"]: r["error"] for r in data["kernels"]["rmsnorm"]["results"] if r["error"] is not None}
    assert rms["ours (Triton)"] <= 2 * rms["PyTorch eager (HF)"] + 1e-3

    assert png_path.stat().st_size > 10_000

    # --plot-from redraws the plot from the JSON alone, measuring nothing.
    replot = tmp_path / "replot.png"
    bk.main(["--plot-from", str(json_path), "--plot", str(replot)])
    assert replot.stat().st_size > 10_000


def _raise_oom(*args):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB (simulated)")


def _raise_value_error(*args):
    raise ValueError("simulated failure of a peer")


def test_failing_peers_are_reported_not_fatal(tmp_path):
    bench = bk.KERNELS["rmsnorm"]
    real_providers = bench.providers
    extra = [
        bk.Provider("simulated OOM", lambda shape: _raise_oom),
        bk.Provider("simulated ERR", lambda shape: _raise_value_error),
    ]
    bench.providers = lambda: real_providers() + extra
    try:
        results, text = _run_main(["--quick", "--kernel", "rmsnorm", "--json", str(tmp_path / "b.json")])
    finally:
        del bench.providers  # back to the class method
    recs = {r["provider"]: r for r in results["kernels"]["rmsnorm"]["results"]}
    assert recs["simulated OOM"]["fwd_status"] == "OOM" and recs["simulated OOM"]["fwdbwd_status"] == "OOM"
    assert recs["simulated ERR"]["fwd_status"] == "ERR" and recs["simulated ERR"]["fwdbwd_status"] == "ERR"
    # The other providers still ran.
    assert recs["ours (Triton)"]["error"] is not None
    # The message of the failing peer is printed once, under the table.
    assert text.count("simulated failure of a peer") == 1
    assert "ERR simulated ERR" in text
    assert "Tried to allocate" not in text  # OOM shows as OOM in its cells, no message


def test_byte_formulas():
    rms = bk.KERNELS["rmsnorm"].bytes_moved({"tokens": 16384, "hidden": 4096})
    assert rms["fwd"] == 2 * 16384 * 4096 * 2 + 4096 * 2
    assert rms["fwdbwd"] == 5 * 16384 * 4096 * 2 + 3 * 4096 * 2
    ce = bk.KERNELS["cross_entropy"].bytes_moved({"tokens": 8192, "vocab": 128256})
    assert ce["fwd"] == 8192 * 128256 * 2
    assert ce["fwdbwd"] == 2 * 8192 * 128256 * 2
    # Effective bandwidth, share of the copy bandwidth and speedup follow from them.
    recs = [
        {"provider": "ours", "bytes": rms, "fwd_ms": 0.1, "fwdbwd_ms": 0.4},
        {"provider": "peer", "bytes": rms, "fwd_ms": 0.3, "fwdbwd_ms": None},
    ]
    bk._derive(recs, copy_bw=3000.0, ours_name="ours")
    assert abs(recs[0]["fwd_GBps"] - rms["fwd"] / 1e-4 / 1e9) < 1e-6
    assert abs(recs[0]["fwd_pct_copy"] - 100 * recs[0]["fwd_GBps"] / 3000.0) < 1e-9
    assert abs(recs[1]["speedup_fwd"] - 3.0) < 1e-9
    assert "speedup_fwdbwd" not in recs[1] and "speedup_fwd" not in recs[0]


def test_plot_draws_bars(tmp_path):
    # The CPU run has no timings to draw, so feed the plot made-up numbers.
    rec = {"label": "4,096", "fwd_status": "ok", "fwdbwd_status": "ok", "fwd_GBps": 2500.0, "fwdbwd_GBps": 1500.0}
    results = {
        "environment": {"gpu": "made-up GPU", "torch": "x", "triton": "y", "date": "today",
                        "copy_bandwidth_GBps": 3000.0},
        "kernels": {
            "rmsnorm": {
                "title": "RMSNorm",
                "providers": ["ours (Triton)", "PyTorch eager (HF)"],
                "shapes": [{"tokens": 4096}],
                "results": [
                    dict(rec, provider="ours (Triton)"),
                    dict(rec, provider="PyTorch eager (HF)", fwd_GBps=None, fwd_status="OOM"),
                ],
            }
        },
    }
    path = tmp_path / "plot.png"
    bk.plot_results(results, str(path))
    assert path.stat().st_size > 10_000


if __name__ == "__main__":
    import sys

    from conftest import Report

    report = Report("Benchmark smoke tests (CPU: Triton interpreter, no timings)")
    with tempfile.TemporaryDirectory() as tmp:
        report.run("quick run: tables, JSON, plot", lambda: test_quick_run_writes_tables_json_and_plot(Path(tmp)))
        report.run("failing peers: OOM / ERR cells", lambda: test_failing_peers_are_reported_not_fatal(Path(tmp)))
        report.run("byte formulas and derived numbers", test_byte_formulas)
        report.run("plot with numbers", lambda: test_plot_draws_bars(Path(tmp)))
    sys.exit(report.finish("benchmark"))
