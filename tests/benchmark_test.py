"""
Tests of benchmark_kernels.py, kernel_ft/benchmark_specs.py and kernel_ft/benchmark_plot.py (CPU: Triton interpreter).

Usage:
    python -m pytest tests/benchmark_test.py
    python tests/benchmark_test.py          # the same, verbose

The benchmark's ``--quick --kernel all`` run happens once (a module fixture) and the
checks read its table and its JSON: every provider has a row with a status, our
kernels match the float64 truth as well as PyTorch does, nothing is timed on CPU.
Other checks: bad paths (wrong suffix, a file this project did not write), seeds out
of range and bad --kernel names fail in one line before anything is measured; failing
peers (out of memory, any exception) become OOM / ERR rows; the playbook-design peers
(benchmark_peers.py) compute the same losses and gradients as PyTorch; the byte formulas
and derived numbers; the plot tool redraws from a JSON, this run's or the committed
results/bench_h100.json; a second run may replace the JSON and figure of the first.
"""

if __name__ == "__main__":
    # `python tests/benchmark_test.py`: pytest runs this file. Its imports below need the
    # repository root on the path, which the root's conftest.py gives pytest.
    import sys

    import pytest

    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))


import contextlib
import gc
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch

# benchmark_kernels imports the kernel modules first (the Triton interpreter switch).
import benchmark_kernels as bk
from kernel_ft import benchmark_peers as bp
from kernel_ft import benchmark_specs as specs
from kernel_ft import files
from rmsnorm_kernel import rmsnorm_reference
from kernel_ft import benchmark_plot as plot_benchmark

ON_GPU = torch.cuda.is_available()
RESULTS = Path(__file__).resolve().parent.parent / "results"
ENV_KEYS = ("gpu", "python", "torch", "triton", "transformers", "cuda", "date", "liger_kernel",
            "cut_cross_entropy", "copy_bandwidth_GBps")
RECORD_KEYS = (
    "provider", "shape", "label", "bytes", "flops", "fwd_status", "fwdbwd_status", "graph_status", "memory_status",
    "fwd_ms", "fwdbwd_ms", "graph_ms", "fwd_GBps", "fwdbwd_GBps", "graph_GBps", "fwd_pct_copy", "fwdbwd_pct_copy",
    "graph_pct_copy", "fwd_TFLOPs", "fwdbwd_TFLOPs", "graph_TFLOPs", "speedup_fwd", "speedup_fwdbwd",
    "speedup_graph", "peak_extra_MB", "error", "messages",
)
# How close to the float64 truth ours must be, per kernel: no worse than twice the
# PyTorch eager (HF) error plus an absolute floor (bf16 outputs round at ~4e-3 relative).
EAGER = {"rmsnorm": "PyTorch eager (HF)", "cross_entropy": "PyTorch eager (HF fp32)", "swiglu": "PyTorch eager (HF)",
         "rope": "PyTorch eager (HF)", "flce": "PyTorch eager (HF)", "attention": "PyTorch SDPA"}
FLOOR = {"rmsnorm": 1e-3, "cross_entropy": 1e-5, "swiglu": 1e-3, "rope": 1e-3, "flce": 1e-4, "attention": 1e-3}


def run_main(argv):
    """benchmark_kernels.main(argv): (results, printed text)."""
    # The benchmark runs gc.collect() (free_memory) around every provider, some 80 times for
    # --kernel all, and each full collection walks every object the process holds: torch's,
    # transformers' and pytest's, 0.2 s apiece on CPU, half of such a run. gc.freeze() sets
    # aside the objects alive now (after one collection, so no garbage among them; they outlive
    # the run anyway): each collection walks only what the run makes, and frees what it did.
    gc.collect()
    gc.freeze()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            results = bk.main(argv)
    finally:
        gc.unfreeze()
    return results, out.getvalue()


def strict_load(path):
    """json.load that rejects NaN / Infinity, as strict JSON readers do."""
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(Path(path).read_text(), parse_constant=reject)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    json_path = tmp_path_factory.mktemp("bench") / "bench.json"
    results, text = run_main(["--quick", "--kernel", "all", "--json", str(json_path)])
    return results, text, json_path


def test_quick_run_prints_tables_and_writes_strict_json(quick_run):
    _, text, json_path = quick_run
    for title in ("RMSNorm benchmark", "Cross-entropy benchmark", "SwiGLU benchmark", "RoPE benchmark",
                  "Linear + cross-entropy benchmark"):
        assert title in text, title
    for header in ("tokens", "provider", "fwd us", "fwd+bwd us", "%copy", "ours x", "peak MB", "max |err|",
                   "loss |err|", "TFLOP/s"):
        assert header in text, header
    # The byte formulas are printed under the tables, with their value at each shape.
    assert "5*N*H*2 + 3*H*2" in text and "2*N*V*2" in text and "8*N*I*2" in text
    assert re.search(r"N = +[0-9,]+: fwd [0-9.,]+ MB", text), "per-shape byte values missing"
    if not ON_GPU:
        assert "no performance claim" in text and specs.NA_CPU in text

    data = strict_load(json_path)
    for key in ENV_KEYS:
        assert key in data["environment"], key
    assert data["settings"]["quick"] is True
    assert list(data["kernels"]) == list(specs.KERNELS)
    for name, kres in data["kernels"].items():
        spec = specs.KERNELS[name]
        shapes = spec.shapes["quick"] if ON_GPU else spec.shapes["cpu"]
        assert kres["shapes"] == shapes and kres["providers"] == list(spec.providers)
        assert len(kres["results"]) == len(shapes) * len(kres["providers"])
        assert kres["footnotes"][: len(spec.formula)] == spec.formula
        for rec in kres["results"]:
            for key in RECORD_KEYS:
                assert key in rec, (name, key)
            assert rec["fwd_status"] and rec["fwdbwd_status"] and rec["memory_status"], rec
            if rec["provider"] in specs.SDPA_PINNED:  # one backend: GPU rows of one document only
                one = rec["shape"]["docs"] == "one"
                want = ("ok", "ERR") if ON_GPU and one else (specs.NA_MASK if ON_GPU else specs.NA_CPU,)
                assert rec["fwd_status"] in want and rec["fwdbwd_status"] in want, rec
                continue
            if rec["provider"] in bp.NEEDS or rec["provider"] in bp.CUDA_ONLY:  # optional or GPU-only peers
                assert rec["fwd_status"] in ("ok", specs.NA_CPU, bp.NOT_INSTALLED, bp.SKIPPED_CPU, "OOM", "ERR")
                continue
            # Every other provider ran (torch.compile too: aot_eager on CPU) and has an error.
            assert rec["fwd_status"] not in ("ERR", "OOM") and rec["fwdbwd_status"] not in ("ERR", "OOM"), rec
            assert rec["error"] is not None and math.isfinite(rec["error"]), rec
            if ON_GPU:
                assert rec["fwd_ms"] > 0 and rec["fwdbwd_ms"] > 0 and rec["peak_extra_MB"] is not None
                if rec["provider"] == kres["ours"]:  # our kernels capture in a CUDA graph
                    assert rec["graph_status"] == "ok" and rec["graph_ms"] > 0, rec
            else:  # no timing claims on CPU: no latency, rate, memory or compile time anywhere
                assert rec["fwd_status"] == rec["fwdbwd_status"] == rec["graph_status"] == rec["memory_status"] \
                    == specs.NA_CPU
                assert all(rec[k] is None for k in ("fwd_ms", "fwdbwd_ms", "graph_ms", "fwd_GBps", "fwd_TFLOPs",
                                                    "peak_extra_MB", "first_fwd_s", "speedup_fwd"))


def test_ours_matches_the_float64_truth(quick_run):
    results, _, _ = quick_run
    for name, kres in results["kernels"].items():
        err = {r["provider"]: r["error"] for r in kres["results"]}
        ours = [p for p in kres["providers"] if p.startswith("ours")]
        assert ours and ours[0] == kres["ours"]
        for provider in ours:
            assert err[provider] <= 2 * err[EAGER[name]] + FLOOR[name], (name, provider, err)
    # The losses are computed in float32: far closer than bf16 rounding.
    ce = {r["provider"]: r["error"] for r in results["kernels"]["cross_entropy"]["results"]}
    assert ce["ours (Triton)"] < 1e-5 and ce["ours (in-place)"] < 1e-5


def test_playbook_design_peers_are_right():
    # A peer with a wrong gradient would look fast for nothing: check both against PyTorch.
    torch.manual_seed(0)
    x = torch.randn(6, 96, device=specs.DEVICE, requires_grad=True)
    w = (1 + 0.1 * torch.randn(96, device=specs.DEVICE)).requires_grad_()
    dy = torch.randn(6, 96, device=specs.DEVICE)
    ref = rmsnorm_reference(x, w, specs.EPS)
    got = bp.PlaybookRMSNorm.apply(x, w, specs.EPS)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(torch.autograd.grad(got, (x, w), dy), torch.autograd.grad(ref, (x, w), dy))

    logits = torch.randn(5, 9000, device=specs.DEVICE, requires_grad=True)  # more than one vocabulary chunk
    targets = torch.tensor([3, -100, 8999, 0, 4096], device=specs.DEVICE)
    ref = torch.nn.functional.cross_entropy(logits, targets)
    got = bp.PlaybookCrossEntropy.apply(logits, targets)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(torch.autograd.grad(2 * got, logits), torch.autograd.grad(2 * ref, logits))


def test_compiled_peers_are_built_static_and_afresh_for_each_shape(monkeypatch):
    """Every compiled peer, FlexAttention too, is compiled afresh (dynamo reset) and with static
    shapes each time a shape's row builds it (benchmark_peers.compiled). Without that, torch.compile
    compiles the second shape it meets again with dynamic shapes: slower code than a training run of
    fixed shapes gets (FlexAttention's 16K rows ~25% slower on an H100, results/attention/flex_static/)."""
    builds, resets = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: builds.append(options) or fn)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(True))
    compiled_peers = [(name, make) for spec in specs.KERNELS.values() for name, make in spec.providers.items()
                      if "compile" in name]
    assert "FlexAttention (compiled)" in dict(compiled_peers) and len(compiled_peers) >= 6
    for _, make in compiled_peers:
        make()
    assert len(builds) == len(compiled_peers) == len(resets)
    assert all(options.get("dynamic") is False for options in builds), builds


def test_error_measures_against_the_truth():
    # error() itself: a wrong output must show a large error (the checks above rely on it).
    truth = torch.randn(4, 8, dtype=torch.float64)
    assert bk.error(truth.to(torch.bfloat16), truth) < 2e-2
    assert bk.error((truth + 1).to(torch.bfloat16), truth) > 0.9
    assert bk.error((truth.float(), truth.float() * 2), (truth, truth)) >= truth.abs().max().item() - 1e-6
    assert abs(bk.error(torch.tensor(2.5), 2.0) - 0.5) < 1e-12


def test_bad_paths_fail_in_one_line_before_measuring(tmp_path, monkeypatch, capsys):
    def must_not_run(*args, **kwargs):
        raise AssertionError("measured before checking the output paths")

    monkeypatch.setattr(bk, "run_kernel", must_not_run)
    monkeypatch.setattr(bk, "environment_info", must_not_run)
    users_json, users_png = tmp_path / "users.json", tmp_path / "users.png"
    users_json.write_text('{"kernels": {}}')  # valid JSON, but without this project's mark
    users_png.write_bytes(b"\x89PNG\r\n\x1a\n not ours")
    cases = [
        (["--json", str(tmp_path / "missing" / "b.json")], "error: --json"),
        (["--json", str(tmp_path)], "is a directory"),
        (["--quick", "--plot", str(tmp_path / "missing" / "b.png")], "error: --plot"),
        (["--json", str(tmp_path / "b.txt")], "expected a .json file"),
        (["--quick", "--plot", str(tmp_path / "b.jpg")], "expected a .png file"),
        (["--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.pdf")], "expected a .png file"),
        (["--json", str(users_json)], "exists and was not written by this project"),
        (["--plot", str(users_png)], "exists and was not written by this project"),
    ]
    for argv, expected in cases:
        with pytest.raises(SystemExit) as exc:
            bk.main(argv)
        message = str(exc.value.code)
        assert expected in message and "\n" not in message, message
    assert capsys.readouterr().out == ""  # not even the banner
    assert users_json.read_text() == '{"kernels": {}}' and users_png.read_bytes().endswith(b"not ours")


@pytest.mark.parametrize("value", [str(2**64), str(2**63), "-1"])
def test_out_of_range_seeds_fail_in_one_line_before_measuring(value, monkeypatch, capsys):
    def must_not_run(*args, **kwargs):
        raise AssertionError("measured before checking --seed")

    monkeypatch.setattr(bk, "run_kernel", must_not_run)
    monkeypatch.setattr(bk, "environment_info", must_not_run)
    with pytest.raises(SystemExit) as exc:
        bk.main(["--quick", "--seed", value])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # not even the banner
    assert err.strip().splitlines()[-1].endswith(f"argument --seed: must be from 0 to 2**63 - 1, got {value}"), err


def test_kernel_names_are_validated(capsys):
    with pytest.raises(SystemExit) as exc:
        bk.main(["--kernel", "layernorm"])
    assert exc.value.code == 2
    assert "invalid choice: 'layernorm'" in capsys.readouterr().err


def _raise_oom(*args):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB (simulated)")


def _raise_value_error(*args):
    raise ValueError("simulated failure of a peer")


def test_failing_peers_are_reported_not_fatal(monkeypatch):
    providers = dict(specs.RMSNORM.providers)
    providers["simulated OOM"] = lambda: _raise_oom
    providers["simulated ERR"] = lambda: _raise_value_error
    providers["simulated ERR at build"] = lambda: _raise_value_error()
    monkeypatch.setattr(specs.RMSNORM, "providers", providers)
    results, text = run_main(["--quick", "--kernel", "rmsnorm"])
    recs = {r["provider"]: r for r in results["kernels"]["rmsnorm"]["results"]}
    assert recs["simulated OOM"]["fwd_status"] == recs["simulated OOM"]["fwdbwd_status"] == "OOM"
    assert recs["simulated OOM"]["memory_status"] == "OOM"
    assert recs["simulated ERR"]["fwd_status"] == recs["simulated ERR"]["fwdbwd_status"] == "ERR"
    assert recs["simulated ERR at build"]["fwd_status"] == "ERR"
    assert recs["ours (Triton)"]["error"] is not None  # the others still ran
    # Each distinct message printed once under the table (fwd and fwd+bwd both failed).
    assert text.count("ERR simulated ERR (") == 1 and "simulated failure of a peer" in text
    assert "Tried to allocate" not in text  # OOM shows in its cells, without a message
    table = text[text.index("RMSNorm benchmark"):]
    assert any(line.split()[:3] == ["simulated", "OOM", "OOM"] for line in table.splitlines())


def _syncing_peer():
    """A peer that reads a value back to the host inside its call: it runs eagerly,
    but its CUDA-graph capture fails (as Liger-Kernel's cross-entropy does)."""
    real = specs.RMSNORM.providers["ours (Triton)"]()

    def op(x, w):
        y = real(x, w)
        torch.rand(1, device=x.device).item()  # a random op and a host sync, in the capture
        return y

    return op


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_a_failed_capture_leaves_the_run_usable(monkeypatch):
    """The failed capture is reported, that peer is not captured again, and the
    providers and kernels after it still run and are captured."""
    providers = {"ours (Triton)": specs.RMSNORM.providers["ours (Triton)"], "syncing peer": _syncing_peer,
                 "PyTorch eager (HF)": specs.RMSNORM.providers["PyTorch eager (HF)"]}
    monkeypatch.setattr(specs.RMSNORM, "providers", providers)
    results, text = run_main(["--quick", "--kernel", "rmsnorm", "rope"])
    recs = results["kernels"]["rmsnorm"]["results"]
    peer = [r for r in recs if r["provider"] == "syncing peer"]
    assert peer[0]["graph_status"] == "ERR" and all(r["graph_status"] == "skipped" for r in peer[1:])
    assert all(r["graph_status"] == "ok" for r in recs if r["provider"] != "syncing peer")
    assert all(r["fwdbwd_status"] == "ok" and r["graph_status"] == "ok"
               for r in results["kernels"]["rope"]["results"] if r["provider"].startswith("ours"))
    assert "graph skipped: a CUDA-graph capture failed (syncing peer at" in text
    torch.rand(4, device="cuda")  # ordinary random work in this process still runs


def test_byte_formulas_and_derived_numbers():
    rms = specs.RMSNORM.bytes({"tokens": 16384, "hidden": 4096})
    assert rms == {"fwd": 2 * 16384 * 4096 * 2 + 4096 * 2, "fwdbwd": 5 * 16384 * 4096 * 2 + 3 * 4096 * 2}
    assert specs.CROSS_ENTROPY.bytes({"tokens": 8192, "vocab": 128256}) == {
        "fwd": 8192 * 128256 * 2, "fwdbwd": 2 * 8192 * 128256 * 2}
    assert specs.SWIGLU.bytes({"tokens": 4096, "intermediate": 14336})["fwdbwd"] == 8 * 4096 * 14336 * 2
    rope = specs.ROPE.bytes({"tokens": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128})
    assert rope == {"fwd": 85983232, "fwdbwd": 171966464}  # as in results/bench_h100.json
    assert specs.FLCE.flops({"tokens": 4096, "hidden": 4096, "vocab": 128256}) == {
        "fwd": 4303557230592, "fwdbwd": 12910671691776}
    recs = [
        {"provider": "ours", "bytes": rms, "flops": None, "fwd_ms": 0.1, "fwdbwd_ms": 0.4},
        {"provider": "peer", "bytes": rms, "flops": None, "fwd_ms": 0.3, "fwdbwd_ms": None},
    ]
    bk.derive(recs, copy_bw=3000.0, ours="ours")
    assert abs(recs[0]["fwd_GBps"] - rms["fwd"] / 1e-4 / 1e9) < 1e-6
    assert abs(recs[0]["fwd_pct_copy"] - 100 * recs[0]["fwd_GBps"] / 3000.0) < 1e-9
    assert abs(recs[1]["speedup_fwd"] - 3.0) < 1e-9
    assert "speedup_fwdbwd" not in recs[1] and "speedup_fwd" not in recs[0]


def test_plot_tool_redraws_from_json(quick_run, tmp_path, capsys):
    _, _, json_path = quick_run
    sources = [json_path, RESULTS / "bench_h100.json"]
    for i, source in enumerate(sources):
        out = tmp_path / f"plot{i}.png"
        plot_benchmark.main([str(source), "--out", str(out)])
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000, source
    assert "Wrote" in capsys.readouterr().out
    # Bad input and output paths: one line each, nothing drawn.
    bad = tmp_path / "bad.json"
    bad.write_text('{"kernels": {}}')
    for argv, expected in (([str(tmp_path / "none.json"), "--out", str(tmp_path / "x.png")], "no such file"),
                           ([str(bad), "--out", str(tmp_path / "x.png")], "not a benchmark_kernels.py JSON"),
                           ([str(sources[1]), "--out", str(tmp_path / "no" / "x.png")], "error: --out")):
        with pytest.raises(SystemExit) as exc:
            plot_benchmark.main(argv)
        assert expected in str(exc.value.code) and "\n" not in str(exc.value.code)
    assert not (tmp_path / "x.png").exists()


def test_plot_option_draws_after_measuring(tmp_path):
    png, out = tmp_path / "swiglu.png", tmp_path / "swiglu.json"
    run_main(["--quick", "--kernel", "swiglu", "--plot", str(png)])
    assert png.stat().st_size > 10_000
    # The figure and the JSON carry this project's mark, so a later run may replace them.
    assert files.written_here(str(png))
    for _ in range(2):
        _, text = run_main(["--quick", "--kernel", "swiglu", "--json", str(out), "--plot", str(png)])
        assert f"Wrote {out}" in text and f"Wrote {png}" in text
        assert files.written_here(str(out)) and files.written_here(str(png))
    assert strict_load(out)["kernels"]["swiglu"]["title"] == "SwiGLU"

