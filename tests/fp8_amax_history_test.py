"""tools/fp8_amax_history.py: the record of every per-tensor FP8 cast's scale (each kind
where it is made, in the interpreter on the CPU), the replay of delayed scaling over a
record, its refusals; on a GPU with FP8 tensor cores, a whole run of the fine-tune script."""

import gzip
import json

import pytest
import torch

from conftest import DEVICE, ON_GPU
from fp8_kernel import fp8_supported
from tools import fp8_amax_history as tool

import fp8_kernel


def site(kind, maxima, shape=(4, 8)):
    """One cast site's entries across steps, as Recorder.maxima gives them."""
    return [(kind, list(shape), m) for m in maxima]


def record(*sites):
    """Steps of a record from per-site series: step t holds every site's t-th maximum."""
    return [list(step) for step in zip(*sites)]


def test_delayed_scaling_is_replayed_over_each_site():
    steps = record(site("weight", [2.0, 2.0, 2.0, 2.0, 2.0]),
                   site("input", [1.0, 2.0, 4.0, 8.0, 16.0]),  # doubles every step
                   site("gradient", [1.0, 1.0, 4.0, 1.0, 1.0]))  # one spike
    s = tool.summarize(steps, [1, 3])
    assert list(s) == ["weight", "input", "gradient"]
    w, x, g = s["weight"], s["input"], s["gradient"]
    assert (w["sites"], w["steps"], w["change_bits_median"], w["largest_growth"]) == (1, 4, 0.0, 1.0)
    assert w["delayed"][1] == {"casts": 4, "clipped": 0, "clipped_fraction": 0.0, "clipped_past_rounding": 0,
                               "worst_clip": 1.0, "unused_bits_median": 0.0, "unused_bits_p99": 0.0}
    # A maximum that grows every step clips at every step after the first, whatever the history.
    assert x["change_bits_median"] == 1.0 and x["largest_growth"] == 2.0
    for history in (1, 3):
        d = x["delayed"][history]
        assert (d["clipped"], d["clipped_past_rounding"], d["worst_clip"]) == (4, 4, 2.0)
    # The spike clips once (x4); afterwards a history that still holds it leaves 2 bits unused.
    one, three = g["delayed"][1], g["delayed"][3]
    assert (one["clipped"], one["worst_clip"], three["clipped"], three["worst_clip"]) == (1, 4.0, 1, 4.0)
    assert one["unused_bits_p99"] == 2.0 and one["unused_bits_median"] == 0.0  # steps 1, 3, 4: 0, 2, 0
    assert three["unused_bits_median"] == 2.0  # steps 1, 3, 4: 0, 2, 2
    assert tool.delayed([1.0, 3.0, 2.0], 2) == [(3.0, 1.0), (2.0, 3.0)]
    assert tool.delayed([1.0, 3.0, 2.0], 2, start=2) == [(2.0, 3.0)]


def test_skipped_steps_stay_history_zero_maxima_and_small_clips_are_told_apart():
    # --skip: the spike at step 1 is not counted, but steps 2 and 3 still see it in their history.
    s = tool.summarize(record(site("gradient", [1.0, 4.0, 1.0, 1.0])), [3], skip=2)["gradient"]
    assert (s["steps"], s["delayed"][3]["casts"], s["delayed"][3]["clipped"]) == (2, 2, 0)
    assert s["delayed"][3]["unused_bits_median"] == 2.0 and s["largest_growth"] == 1.0
    # An all-zero tensor's cast stores the floor 1e-12 as its maximum: no ratio is taken with it.
    z = tool.summarize(record(site("input", [1e-12, 1.0, 1.0])), [1])["input"]
    assert (z["largest_growth"], z["change_bits_p99"], z["delayed"][1]["casts"]) == (1.0, 0.0, 1)
    # A growth within the rounding of e4m3's top value clips, but not past that rounding.
    c = tool.summarize(record(site("input", [1.0, 1.02, 1.2])), [1])["input"]["delayed"][1]
    assert (c["clipped"], c["clipped_past_rounding"]) == (2, 1)


def test_a_record_of_other_casts_per_step_is_refused():
    steps = record(site("weight", [1.0, 1.0]), site("input", [1.0, 1.0]))
    steps[1][1] = ("input", [8, 8], 1.0)
    with pytest.raises(ValueError, match="step 2 made other casts than step 1"):
        tool.summarize(steps, [1])
    with pytest.raises(ValueError, match="at least 2 steps"):
        tool.summarize(steps[:1], [1])


def test_refusals_are_one_line_and_graphs_are_turned_off():
    run = ["finetune_optimized.py", "--random-init", "--fp8", "tensorwise"]
    assert tool.parse_args(["--", *run]).command == [*run, "--no-cuda-graphs"]
    assert tool.parse_args(["--history", "2", "--", "finetune_optimized.py", "--fp8=tensorwise"]).history == [2]
    assert tool.parse_args(["--replay", "a.json"]).command is None
    for argv, message in ((run, "^error: name the script to run after --"),
                          (["--", "--steps", "4"], "^error: after -- comes a script"),
                          (["--", "finetune_optimized.py", "--fp8", "rowwise"],
                           "^error: the script must run --fp8 tensorwise"),
                          (["--", *run, "--cuda-graphs"], "^error: leave out --cuda-graphs: a replayed CUDA graph"),
                          (["--", *run, "--compile"], "^error: leave out --compile: under --compile"),
                          (["--history", "0", "--", *run], "^error: --history lengths"),
                          (["--skip", "-1", "--", *run], "^error: --skip is a number of steps"),
                          (["--", *run, "--gradient-checkpointing"], "^error: leave out --gradient-checkpointing"),
                          (["--", *run, "--fsdp-fp8-gather"], "^error: leave out --fsdp-fp8-gather: FSDP casts"),
                          (["--replay", "a.json", "--", *run], "^error: --replay reads a record")):
        with pytest.raises(SystemExit, match=message):
            tool.parse_args(argv)


def test_each_kind_of_cast_is_recorded_where_it_is_made():
    """The weights' casts, a layer input's, an output gradient's (e5m2 here) and gradients
    side by side: each recorded with its kind, shape and max |x| (from the cast's own
    scale); the wrapped functions are the originals again after uninstall."""
    originals = {name: getattr(fp8_kernel, name) for name in ("_quantize_parts", "quantize_side_by_side",
                                                               "_weight_fp8", "quantize_stacked", "_output_grad_fp8")}
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 32, generator=g).to(DEVICE))
    x = (torch.randn(16, 32, generator=g) * 3).to(DEVICE)
    dy = (torch.randn(16, 48, generator=g) / 7).to(DEVICE)
    parts = [torch.randn(16, 8, generator=g).to(DEVICE), (torch.randn(16, 24, generator=g) * 5).to(DEVICE)]
    recorder = tool.Recorder().install()
    try:
        fp8_kernel.quantize(x, "tensorwise")  # before any step: not recorded
        recorder.steps.append([])
        recorder._in_step = True  # what train_step's wrapper sets
        fp8_kernel._weight_fp8(w, "tensorwise", transpose=True)
        fp8_kernel._weight_fp8(w.detach(), "tensorwise", transpose=True)  # frozen: cast once and kept, not recorded
        fp8_kernel.quantize(x, "tensorwise", transpose=True, align=16)
        fp8_kernel.quantize(x, "rowwise")  # per row: no one maximum, not recorded
        fp8_kernel._output_grad_fp8(dy, "tensorwise", "e5m2", True)
        fp8_kernel.quantize_side_by_side(parts, "tensorwise")
        fp8_kernel.quantize_stacked([w.detach(), w.detach()[:16]], "tensorwise", transpose=True)
    finally:
        recorder.uninstall()
    assert {name: getattr(fp8_kernel, name) for name in originals} == originals
    (step,) = recorder.maxima()
    assert [(kind, shape) for kind, shape, _ in step] == [
        ("weight", [48, 32]), ("input", [16, 32]), ("gradient", [16, 48]), ("gradient", [16, 32]),
        ("weight", [64, 32])]
    weight_max = w.detach().abs().max()
    truth = [weight_max, x.abs().max(), dy.abs().max(), torch.cat(parts, 1).abs().max(), weight_max]
    for (_, _, got), want in zip(step, truth):
        assert got == pytest.approx(float(want), rel=1e-6)


def test_a_step_is_what_train_step_runs_and_a_saved_record_replays(tmp_path, monkeypatch):
    """Casts inside training.train_step open and fill a step; one outside it (an evaluation)
    is not recorded; uninstall gives train_step back. A record saved by --json (plain or
    gzipped) counts the same through --replay."""
    from kernel_ft import training

    x = torch.randn(16, 32).to(DEVICE)
    calls = []

    def stub_step(scale):
        calls.append(scale)
        fp8_kernel.quantize(x * scale, "tensorwise")

    monkeypatch.setattr(training, "train_step", stub_step)
    recorder = tool.Recorder().install()
    try:
        for scale in (1.0, 2.0, 1.0):
            training.train_step(scale)
        fp8_kernel.quantize(x, "tensorwise")  # between steps: not recorded
    finally:
        recorder.uninstall()
    assert training.train_step is stub_step and calls == [1.0, 2.0, 1.0]
    steps = recorder.maxima()
    assert [len(step) for step in steps] == [1, 1, 1]
    top = float(x.abs().max())
    assert [step[0][2] for step in steps] == pytest.approx([top, 2 * top, top], rel=1e-6)
    want = tool.summarize(steps, [1, 2], 1)
    for name, opener in (("record.json", open), ("record.json.gz", gzip.open)):
        with opener(tmp_path / name, "wt") as f:
            json.dump({"command": ["finetune_optimized.py"], "steps": steps}, f)
        assert tool.main(["--replay", str(tmp_path / name), "--history", "1", "2", "--skip", "1"]) == want
    assert [want["input"]["delayed"][h]["clipped"] for h in (1, 2)] == [1, 1]  # step 1 has step 0 alone behind it
    (tmp_path / "other.json").write_text('{"losses": [1.0]}')
    for path in (tmp_path / "missing.json", tmp_path / "other.json"):
        with pytest.raises(SystemExit, match=f"^error: --replay {path}: not a record this tool wrote"):
            tool.main(["--replay", str(path)])


def test_gpu_a_fine_tune_run_is_recorded_and_replayed(tmp_path):
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    ok, why = fp8_supported(DEVICE)
    if not ok:
        pytest.skip(why)
    out = tmp_path / "amax.json"
    summary = tool.main(["--history", "1", "4", "--skip", "1", "--json", str(out), "--", "finetune_optimized.py",
                         "--tiny", "--random-init", "--dataset", "synthetic", "--fp8", "tensorwise", "--steps", "4",
                         "--warmup-steps", "1"])
    assert set(summary) == {"weight", "input", "gradient"}
    for entry in summary.values():
        assert entry["sites"] > 0 and entry["steps"] == 4  # steps 1-4 of 0-4: step 0 is history only
        assert entry["delayed"][1]["casts"] <= entry["sites"] * 4  # steps 1-4 (zero maxima left out)
    saved = json.loads(out.read_text())
    assert len(saved["steps"]) == 5 and saved["histories"] == [1, 4] and saved["skip"] == 1
