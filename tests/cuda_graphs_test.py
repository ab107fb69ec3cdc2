"""
Tests of the CUDA-graph step (cuda_graphs.py, Step 20) and the timeline of a
profiled step (profile_timeline.py).

On the CPU (no capture is possible there):
* the flags: on by default in finetune_optimized.py, off in the baseline, and
  three untimed warm-up steps on a GPU when on;
* every reason a run stays eager is found, and said in one line;
* the step logic around the graph, with a stand-in graph that records the step
  and re-runs it on replay: warm-up steps, inputs copied into the captured
  buffers, a batch of another shape run eagerly, a failed capture falling back
  to eager with a note; the parameters end as in an eager run;
* TritonAdamW's launch with its per-step scalars read from memory gives the
  same bits as with them as arguments;
* the timeline's gaps, busy time, launch counts, FLOP count and verdicts.

On a GPU: --cuda-graphs gives the losses of the eager run (every kernel, PyTorch's
AdamW, LoRA, gradient accumulation, clipping), and a step that cannot be captured
(a host sync) falls back to eager with a note and the same losses.

Usage:
    python -m pytest tests/cuda_graphs_test.py -v
    python tests/cuda_graphs_test.py
"""

if __name__ == "__main__":
    # `python tests/cuda_graphs_test.py`: pytest runs this file. Its imports below need the
    # repository root on the path, which the root's conftest.py gives pytest.
    import sys

    import pytest

    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))


import argparse
import contextlib
import sys

import pytest
import torch

from kernel_ft import cuda_graphs
import finetune_baseline
import finetune_optimized
from kernel_ft import flags, models
import profile_timeline
from kernel_ft import training
import adamw_kernel
import fp8_kernel
from adamw_kernel import TritonAdamW, adamw_step, step_scalars
from conftest import DEVICE, need_gpu

TINY = ["--tiny", "--batch-size", "2", "--seq-len", "64", "--steps", "4", "--log-every", "1"]


# --------------------------------------------------------------------------------
# Flags and reasons
# --------------------------------------------------------------------------------
def test_flag_defaults(monkeypatch):
    assert finetune_optimized.parse_args([]).cuda_graphs is True
    assert finetune_optimized.parse_args(["--no-cuda-graphs"]).cuda_graphs is False
    assert finetune_baseline.parse_args([]).cuda_graphs is False
    monkeypatch.setattr(flags.torch.cuda, "is_available", lambda: True)
    # On a GPU the warm-up covers the eager steps and the capture, so every timed step is a
    # replay; and it is the same without graphs: the learning-rate schedule does not change.
    for argv, warmup in (([], cuda_graphs.EAGER_STEPS + 1), (["--no-cuda-graphs"], cuda_graphs.EAGER_STEPS + 1),
                         (["--warmup-steps", "1"], 1)):
        args = flags.settle(finetune_optimized.parse_args(["--tiny"] + argv))
        assert args.warmup_steps == warmup, argv
    assert flags.settle(finetune_baseline.parse_args(["--tiny"])).warmup_steps == cuda_graphs.EAGER_STEPS + 1
    # --ddp, --fsdp and a torchrun run that leaves the choice to the run: the same warm-up.
    monkeypatch.setenv("WORLD_SIZE", "2")
    for argv in (["--ddp"], ["--fsdp"], []):
        assert flags.settle(finetune_optimized.parse_args(["--tiny", *argv])).warmup_steps == flags.GPU_WARMUP_STEPS


def _args(**changes):
    args = dict(fsdp=False, skip_nonfinite_steps=False, compile=False, compile_mode="default", packing=True,
                lora_4bit=False, cuda_graphs=True, seq_len=2048)
    return argparse.Namespace(**{**args, **changes})


class _Model:
    def __init__(self, **config):
        self.config = argparse.Namespace(model_type="llama", **config)


@pytest.mark.parametrize("changes, config, words", [
    ({"fsdp": True}, {}, "--fsdp"),
    ({"skip_nonfinite_steps": True}, {}, "--skip-nonfinite-steps"),
    ({"optimizer_in_backward": True}, {}, "--optimizer-in-backward"),
    ({"compile": True, "compile_mode": "reduce-overhead"}, {}, "torch.compile's own CUDA graphs"),
    ({"packing": False}, {}, "padded batches change shape"),
    ({"lora_4bit": True}, {}, "--lora-4bit"),
    ({}, {"num_local_experts": 8}, "experts"),
    ({}, {"num_experts": 4}, "experts"),
    ({}, {"_attn_implementation": "eager"}, "eager attention"),
])
def test_reasons_to_stay_eager(monkeypatch, changes, config, words):
    monkeypatch.setattr(cuda_graphs.torch.cuda, "is_available", lambda: True)
    data = object()  # real data (synthetic is None)
    assert words in cuda_graphs.reason_to_stay_eager(_args(**changes), _Model(**config), data)


def test_capturable_runs(monkeypatch):
    monkeypatch.setattr(cuda_graphs.torch.cuda, "is_available", lambda: True)
    assert cuda_graphs.reason_to_stay_eager(_args(), _Model(), object()) is None  # packed data
    assert cuda_graphs.reason_to_stay_eager(_args(packing=False), _Model(), None) is None  # synthetic: one shape
    assert cuda_graphs.reason_to_stay_eager(_args(compile=True), _Model(), None) is None  # Inductor's kernels
    assert cuda_graphs.reason_to_stay_eager(_args(ddp=True), _Model(), None) is None  # NCCL's all-reduces inside


def test_the_choice_is_said_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cuda_graphs.torch.cuda, "is_available", lambda: False)
    assert training.use_cuda_graphs(_args(), _Model(), None) is False
    assert capsys.readouterr().out == "CUDA graphs:   off (no GPU)\n"
    assert training.use_cuda_graphs(_args(cuda_graphs=False), _Model(), None) is False
    assert capsys.readouterr().out.startswith("CUDA graphs:   off: every step is queued by Python")
    monkeypatch.setattr(cuda_graphs.torch.cuda, "is_available", lambda: True)
    assert training.use_cuda_graphs(_args(fsdp=True), _Model(), None) is False
    out = capsys.readouterr().out
    assert out.startswith("Note:") and "--fsdp" in out and out.count("\n") == 1
    assert training.use_cuda_graphs(_args(), _Model(), None) is True
    assert "CUDA graphs:   on" in capsys.readouterr().out


# --------------------------------------------------------------------------------
# The attention inside a capture: SDPA's causal flag, as in the eager step
# --------------------------------------------------------------------------------
def _sdpa_calls(monkeypatch):
    """Record what each SDPA call gets as its mask and causal flag."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def _tiny(model_type, **changes):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **changes)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("model_type, changes", [("llama", {}), ("mistral", {"sliding_window": 64})])
def test_capture_keeps_the_eager_attention(monkeypatch, model_type, changes):
    model = _tiny(model_type, **changes)
    ids = torch.randint(0, 64, (2, 12))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :3] = 0
    calls = _sdpa_calls(monkeypatch)
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits  # as in training: no cache
        eager_padded = model(ids, attention_mask=padding, use_cache=False).logits
        assert calls[0] == (None, True)  # unpadded rows: no mask, SDPA's causal flag
        # transformers while a graph is captured: a [B, 1, T, T] mask, no causal flag.
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        calls.clear()
        model(ids, use_cache=False)
        assert calls and all(mask is not None and not causal for mask, causal in calls)
        # Switched: in a capture, what the eager step does.
        assert cuda_graphs.keep_sdpa_causal(model, seq_len=12) is True
        assert model.config._attn_implementation == cuda_graphs.SDPA_CAUSAL
        calls.clear()
        captured = model(ids, use_cache=False).logits
        assert calls and all(call == (None, True) for call in calls)
        with pytest.raises(ValueError, match="a padding mask reached a step captured for rows without padding"):
            model(ids, attention_mask=padding, use_cache=False)
        # Outside a capture: transformers' own decisions, padding included.
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        padded = model(ids, attention_mask=padding, use_cache=False).logits
    assert torch.equal(captured, eager)
    assert torch.equal(padded, eager_padded)


def test_keep_sdpa_causal_only_where_every_layer_is_plainly_causal():
    model = _tiny("mistral", sliding_window=4)  # a window shorter than the row: a mask is needed
    assert cuda_graphs.keep_sdpa_causal(model, seq_len=12) is False
    assert cuda_graphs.keep_sdpa_causal(model, seq_len=4) is True  # rows no longer than the window
    model = _Model(_attn_implementation="eager")
    assert cuda_graphs.keep_sdpa_causal(model, seq_len=12) is False
    assert model.config._attn_implementation == "eager"


# --------------------------------------------------------------------------------
# The step around the graph, with a stand-in for the capture
# --------------------------------------------------------------------------------
class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: "capturing" records the
    function, which runs for real at each replay, on the captured buffers."""
    def replay(self):
        self.replayed += 1
        self.rerun()


@contextlib.contextmanager
def fake_capture(graph, capture_error_mode):
    graph.replayed = 0
    yield


def _toy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _batches(steps, rows=4):
    g = torch.Generator().manual_seed(1)
    return [[{"x": torch.randn(rows if i != 5 else rows + 1, 8, generator=g), "n": i}] for i in range(steps)]


def _loss(model, batch):
    return model(batch["x"]).square().mean()


def _graphed(monkeypatch, model, optimizer, scheduler, fail=False, notes=None, times=(100.0, 50.0), **options):
    """A GraphedStep on the CPU; ``times``: the clock's (eager warm-up, timed replay) in ms;
    ``options``: GraphedStep's eager_steps and agree."""
    monkeypatch.setattr(cuda_graphs.torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "current_stream", lambda: "the step's stream")
    released = []  # no CUDA stream or generator on the CPU: the calls are recorded
    monkeypatch.setattr(cuda_graphs, "recover_from_failed_capture", released.append)

    def eager_here(self, micro_batches):  # no side stream on the CPU
        self.eager_calls += 1
        if self.eager_calls == self.eager_steps:
            self.eager_ms = times[0]
        return self.eager(micro_batches)
    monkeypatch.setattr(cuda_graphs.GraphedStep, "_eager_on_side_stream", eager_here)
    clocked = []  # how many replays had run when the clock was read

    def clock(self, run):
        clocked.append(self.replays)
        return run(), times[1]
    monkeypatch.setattr(cuda_graphs.GraphedStep, "_clock", clock)
    monkeypatch.setattr(flags, "note", lambda text: notes.append(text) if notes is not None else None)

    def captured(micro_batches):
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

        def run():
            # A replayed backward overwrites the gradients it allocated at capture.
            optimizer.zero_grad(set_to_none=True)
            loss = _loss(model, micro_batches[0])
            loss.backward()
            optimizer.step()
            outputs[0] = loss.detach()
        outputs = [None]
        step.graph_to_be = run
        return outputs

    def eager(micro_batches):
        loss = _loss(model, micro_batches[0])
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return [loss.detach()]

    step = cuda_graphs.GraphedStep(captured, eager, after_replay=scheduler.step,
                                   clear_gradients=lambda: optimizer.zero_grad(set_to_none=True),
                                   say=lambda text: None, **options)
    real_capture = step._capture

    def capture_then_wire(micro_batches):
        ok = real_capture(micro_batches)
        if ok:
            step.graph.rerun = step.graph_to_be  # what the stand-in "recorded"
        return ok
    step._capture = capture_then_wire
    step.clocked = clocked
    step.released = released
    return step


def _train(step, batches):
    return [float(step(b)[0]) for b in batches]


def test_graphed_step_logic_matches_eager(monkeypatch):
    batches = _batches(8)
    model, optimizer, scheduler = _toy()
    eager_losses = []
    for b in batches:
        loss = _loss(model, b[0])
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        eager_losses.append(float(loss.detach()))
    eager_params = [p.detach().clone() for p in model.parameters()]

    model, optimizer, scheduler = _toy()
    notes = []
    step = _graphed(monkeypatch, model, optimizer, scheduler, notes=notes)
    losses = []
    for i, b in enumerate(batches):
        losses.append(float(step(b)[0]))
        if i == cuda_graphs.EAGER_STEPS:
            assert step.graph is not None and step.graph.replayed == 1  # captured, then replayed for this step
    assert losses == pytest.approx(eager_losses, rel=1e-6, abs=0)
    for p, q in zip(model.parameters(), eager_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)
    assert step.eager_calls == cuda_graphs.EAGER_STEPS
    assert step.graph.replayed == len(batches) - cuda_graphs.EAGER_STEPS - 1  # batch 5 had another shape
    assert len(notes) == 1 and "another shape" in notes[0]


def _eager_losses(monkeypatch, batches):
    """The losses of the toy run with every step eager: what a graphed run must match."""
    model, optimizer, scheduler = _toy()
    reference = _graphed(monkeypatch, model, optimizer, scheduler)
    reference.disabled = "off"
    return _train(reference, batches)


def test_failed_capture_trains_eagerly_with_a_note(monkeypatch):
    batches = [b for i, b in enumerate(_batches(6)) if i != 5]
    expected = _eager_losses(monkeypatch, batches)
    model, optimizer, scheduler = _toy()
    notes = []
    step = _graphed(monkeypatch, model, optimizer, scheduler, fail=True, notes=notes)
    assert _train(step, batches) == pytest.approx(expected, rel=1e-6, abs=0)
    assert step.graph is None and step.disabled.startswith("RuntimeError: operation not permitted")
    assert len(notes) == 1 and "could not be captured" in notes[0] and "\n" not in notes[0]
    assert step.released == ["the step's stream"]  # back on it, the random generator out of capture mode


@pytest.mark.parametrize("replay_ms, stays", [(104.0, True), (106.0, False)])
def test_a_replay_slower_than_eager_keeps_the_run_eager(monkeypatch, replay_ms, stays):
    """The second replay is timed against the last eager step: up to 5% slower it stays,
    beyond that the rest of the run is eager (one note), with the same losses."""
    batches = [b for i, b in enumerate(_batches(7)) if i != 5]
    expected = _eager_losses(monkeypatch, batches)
    model, optimizer, scheduler = _toy()
    notes = []
    step = _graphed(monkeypatch, model, optimizer, scheduler, notes=notes, times=(100.0, replay_ms))
    assert _train(step, batches) == pytest.approx(expected, rel=1e-6, abs=0)
    assert step.clocked == [1]  # the second replay: the first also uploads the graph
    if stays:
        assert step.graph is not None and step.replays == len(batches) - cuda_graphs.EAGER_STEPS and not notes
    else:
        assert step.graph is None and step.replays == cuda_graphs.TIMED_REPLAY + 1
        assert len(notes) == 1 and "a replay took 106 ms, an eager step 100 ms; training eagerly" in notes[0]
        assert all(p.grad is None for p in model.parameters())


class _Others:
    """agree() of several processes, the others' flags given: every call records this
    process's flag and returns whether all are True."""

    def __init__(self, *others):
        self.others, self.asked = list(others), []

    def __call__(self, flag):
        self.asked.append(flag)
        return flag and self.others.pop(0)


def test_several_processes_capture_after_their_eager_steps_and_replay_together(monkeypatch):
    """Several processes (--ddp): the capture comes after the eager steps asked for; every
    process agrees that it captured and that its replay is fast enough; the losses are the
    eager run's."""
    batches = [b for i, b in enumerate(_batches(14)) if i != 5]
    expected = _eager_losses(monkeypatch, batches)
    model, optimizer, scheduler = _toy()
    agree = _Others(True, True)
    step = _graphed(monkeypatch, model, optimizer, scheduler, eager_steps=11, agree=agree)
    assert _train(step, batches) == pytest.approx(expected, rel=1e-6, abs=0)
    assert step.eager_calls == 11 and step.graph is not None and step.replays == len(batches) - 11
    assert agree.asked == [True, True]  # captured; the timed replay was fast enough


@pytest.mark.parametrize("others, words", [
    ((False,), "another process could not capture its step"),
    ((True, False), "another process's replay was slower than its eager step"),
])
def test_when_another_process_falls_back_all_do(monkeypatch, others, words):
    """This process captured and replays fast, another did not: all train eagerly, the
    same losses, one note."""
    batches = [b for i, b in enumerate(_batches(7)) if i != 5]
    expected = _eager_losses(monkeypatch, batches)
    model, optimizer, scheduler = _toy()
    notes = []
    step = _graphed(monkeypatch, model, optimizer, scheduler, notes=notes, agree=_Others(*others))
    assert _train(step, batches) == pytest.approx(expected, rel=1e-6, abs=0)
    assert step.graph is None and step.disabled == words
    assert len(notes) == 1 and words in notes[0]


def test_several_processes_refuse_a_batch_of_another_shape(monkeypatch):
    """The others replay the captured step: a batch that does not fit stops this process
    in one line instead of stepping eagerly alone (its all-reduces would wait for ever)."""
    model, optimizer, scheduler = _toy()
    step = _graphed(monkeypatch, model, optimizer, scheduler, agree=_Others(True, True))
    with pytest.raises(RuntimeError, match="every process must replay the graph together; rerun with "
                                           "--no-cuda-graphs"):
        _train(step, _batches(6))  # batch 5 has another shape


def test_static_inputs():
    a = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": None, "num_tokens": 8}
    inputs = cuda_graphs.StaticInputs([a])
    assert inputs.fits([{**a, "num_tokens": 7}])
    assert not inputs.fits([{**a, "input_ids": torch.zeros(2, 5, dtype=torch.long)}])
    assert not inputs.fits([{**a, "input_ids": torch.zeros(2, 4, dtype=torch.int)}])
    assert not inputs.fits([{**a, "attention_mask": torch.ones(2, 4)}])
    assert not inputs.fits([a, a])
    buffer = inputs.batches[0]["input_ids"]
    inputs.fill([{**a, "input_ids": torch.full((2, 4), 7)}])
    assert inputs.batches[0]["input_ids"] is buffer and int(buffer.sum()) == 56  # copied in place


# --------------------------------------------------------------------------------
# TritonAdamW: the per-step scalars from memory
# --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_scalars_from_memory_are_the_arguments(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5000, generator=g).to(dtype) for _ in range(4)]
    tensors[3] = tensors[3].abs()
    a = [t.clone().to(DEVICE) for t in tensors]
    b = [t.clone().to(DEVICE) for t in tensors]
    hp = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    adamw_step(a[0], a[1], a[2], a[3], 7, 3e-4, **hp)
    scalars = torch.tensor(step_scalars(7, 3e-4, 0.9, 0.999, 0.01), dtype=torch.float32, device=DEVICE)
    adamw_step(b[0], b[1], b[2], b[3], 1, 99.0, **hp, scalars=scalars)  # step and lr ignored: memory wins
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="scalars must be a 3-element float32 tensor"):
        adamw_step(b[0], b[1], b[2], b[3], 1, 1e-3, **hp, scalars=scalars[:2])


def test_triton_adamw_staged_steps_are_eager_steps(monkeypatch):
    """The captured step's launches (run directly here: the CPU has no graphs),
    each after stage_graph_step, give the eager optimizer's parameters and step
    counts, with a learning rate that changes every step."""
    g = torch.Generator().manual_seed(0)
    shapes = [(33, 7), (4097,), (5,)]
    values = [torch.randn(s, generator=g).to(DEVICE) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(DEVICE) for s in shapes] for _ in range(4)]
    runs = []
    for staged in (False, True):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        opt = TritonAdamW(params, lr=1e-2, weight_decay=0.1)
        for step, step_grads in enumerate(grads):
            opt.param_groups[0]["lr"] = 1e-2 / (step + 1)  # what the schedule does
            for p, grad in zip(params, step_grads):
                p.grad = grad.clone()
            if not staged or step == 0:
                opt.step()  # eager (the warm-up step creates the state)
                continue
            if step == 1:
                opt.prepare_capture()
                with monkeypatch.context() as m:
                    m.setattr(adamw_kernel, "adamw_step", lambda *args, **kwargs: None)  # a capture runs nothing
                    opt._capture_step(None)
            opt.stage_graph_step()
            opt._capture_step(None)  # what each replay runs
        runs.append(([p.detach().clone() for p in params], [opt.state[p]["step"] for p in params]))
    (eager, eager_steps), (staged, staged_steps) = runs
    for a, b in zip(eager, staged):
        assert torch.equal(a, b)
    assert eager_steps == staged_steps == [4, 4, 4]


def test_resumed_optimizer_stays_capturable():
    """An eager run's checkpoint loaded into a run with CUDA graphs: its float lr and
    capturable=False come back with the param groups, and are put right."""
    p = torch.nn.Parameter(torch.ones(3))
    eager = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(3)
    eager.step()
    graphed = torch.optim.AdamW([p], lr=torch.tensor(1e-3), capturable=True)
    graphed.load_state_dict(eager.state_dict())
    assert graphed.param_groups[0]["capturable"] is False and not torch.is_tensor(graphed.param_groups[0]["lr"])
    training.keep_capturable(graphed)
    group = graphed.param_groups[0]
    assert group["capturable"] is True and torch.is_tensor(group["lr"]) and float(group["lr"]) == pytest.approx(1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(graphed, lambda step: 0.5)
    lr = group["lr"]
    scheduler.step()
    assert group["lr"] is lr and float(lr) == pytest.approx(5e-4)  # written into the same tensor a graph reads


def test_triton_adamw_accepts_capturable():
    p = torch.nn.Parameter(torch.ones(3, device=DEVICE))
    TritonAdamW([p], lr=1e-3, capturable=True)
    with pytest.raises(RuntimeError, match="no step was captured"):
        TritonAdamW([p], lr=1e-3).stage_graph_step()


# --------------------------------------------------------------------------------
# The timeline of a profiled step
# --------------------------------------------------------------------------------
def _trace():
    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    return {"traceEvents": [
        x("user_annotation", "forward", 0, 500),
        x("cpu_op", "aten::linear", 100, 80),
        x("cpu_op", "aten::mm", 110, 60),
        x("cuda_runtime", "cudaLaunchKernel", 120, 10),
        x("cuda_runtime", "cudaLaunchKernel", 300, 10),
        x("cuda_runtime", "cudaMalloc", 320, 40),
        x("cuda_runtime", "cudaDeviceSynchronize", 400, 100),
        x("kernel", "gemm", 130, 20),
        x("kernel", "gemm2", 140, 20),  # overlaps the first: counted once
        x("kernel", "rmsnorm", 310, 30),
        x("gpu_memcpy", "Memcpy HtoD", 380, 10),
    ]}


def test_timeline_gaps_busy_and_launches():
    busy, span, gaps = profile_timeline.idle_gaps(profile_timeline.gpu_events(_trace()))
    assert (busy, span) == (70, 260)
    assert [(g[0], g[1]) for g in gaps] == [(160, 150), (340, 40)]
    assert profile_timeline.host_activity(_trace(), 150) == "forward > aten::mm"
    assert profile_timeline.host_activity(_trace(), 250) == "forward > Python between operators"
    s = profile_timeline.analyze(_trace(), steps=1, wall_s=500e-6, host_s=480e-6, flops=1e9, peak=1e12)
    assert s["kernel_launches_per_step"] == 2 and s["kernels_per_step"] == 3
    assert s["allocation_ms"] == pytest.approx(0.04) and s["syncs_per_step"] == 0
    assert s["gpu_busy_fraction"] == pytest.approx(70 / 500)
    assert s["mfu"] == pytest.approx(1e9 / 500e-6 / 1e12)
    assert s["verdict"].startswith("host-bound")
    assert s["gaps"][0]["us"] == 150


@pytest.mark.parametrize("change, start", [
    ({}, "host-bound"),
    ({"host_ms": 0.1, "syncs_per_step": 2}, "waiting on host synchronizations"),
    ({"gpu_busy_fraction": 0.95}, "GPU-bound"),
    ({"allocation_ms": 0.2}, "waiting on memory allocation"),
    ({"nccl_ms": 0.3, "nccl_exposed_ms": 0.3}, "waiting on communication"),
    ({"nccl_ms": 0.3, "nccl_exposed_ms": 0.1, "gpu_busy_fraction": 0.95}, "GPU-bound"),  # mostly hidden
])
def test_verdicts(change, start):
    s = {"wall_ms": 1.0, "host_ms": 0.95, "gpu_busy_fraction": 0.5, "kernel_launches_per_step": 100,
         "allocation_ms": 0.0, "syncs_per_step": 0, "nccl_ms": 0.0, "nccl_exposed_ms": 0.0, "mfu": 0.3}
    assert profile_timeline.verdict({**s, **change}).startswith(start)


def test_exposed_communication_is_what_no_kernel_overlaps():
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    events = profile_timeline.gpu_events({"traceEvents": [
        kernel("ncclDevKernel_AllGather", 0, 100),  # 0-100: compute covers 20-50 and 40-70 -> 50 hidden
        kernel("gemm", 20, 30), kernel("gemm", 40, 30),
        kernel("ncclDevKernel_ReduceScatter", 90, 40),  # 90-130 merges with the first: 100-130 exposed
        kernel("rmsnorm", 200, 10),  # no communication beside it
        kernel("ncclDevKernel_AllGather", 300, 20),  # alone: exposed
    ]})
    total, exposed = profile_timeline.nccl_us(events)
    assert (total, exposed) == (150, 100)


def test_step_flops_counts_products():
    config = models.tiny_config()
    model = models.build_random(config, torch.device("cpu"), torch.float32)
    ids = torch.zeros(2, 8, dtype=torch.long)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]])
    batch = {"input_ids": ids, "position_ids": positions, "attention_mask": None, "num_real_tokens": 16}
    h, i, v, layers = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i  # q, k, v, o; gate, up, down
    weights = layers * per_layer + h * v  # and the LM head
    context = (1 + 2 + 3 + 4) * 2 + sum(range(1, 9))
    expected = 6 * weights * 16 + 12 * layers * h * context
    assert profile_timeline.step_flops(model, [batch]) == expected
    # The same model with FP8 linear layers (not nn.Linear subclasses): the same FLOPs.
    fp8 = models.build_random(config, torch.device("cpu"), torch.float32)
    assert fp8_kernel.replace_linears(fp8, "tensorwise", emulate=True)[0] == layers * 7
    assert profile_timeline.step_flops(fp8, [batch]) == expected
    frozen = 4 * weights * 16 + 12 * layers * h * context
    # LoRA r4 on every projection: the frozen base products once each (PEFT's layer shows
    # its base layer's weight too, not a product of its own), and the adapters trained.
    args = argparse.Namespace(tiny=True, lora_r=4, lora_alpha=8.0, lora_dropout=0.0, lora_4bit=False,
                              lora_targets=list(flags.LORA_TARGETS))
    lora = models.apply_lora(models.build_random(config, torch.device("cpu"), torch.float32), args)
    adapters = 4 * layers * ((h + h) + (h + kv) * 2 + (h + h) + (h + i) * 2 + (i + h))  # r x (in + out) each
    assert profile_timeline.step_flops(lora, [batch]) == frozen + 6 * adapters * 16
    for p in model.parameters():
        p.requires_grad_(False)  # frozen (LoRA's base): no weight gradients
    assert profile_timeline.step_flops(model, [batch]) == frozen


# --------------------------------------------------------------------------------
# GPU: the real capture
# --------------------------------------------------------------------------------
GPU_CASES = {
    "every kernel": [],
    "PyTorch AdamW": ["--no-use-custom-adamw"],
    "LoRA": ["--lora"],
    "accumulation, bundled data": ["--grad-accum", "2", "--dataset", "data/instructions.jsonl"],
    "no clipping, baseline kernels": ["--max-grad-norm", "0", "--no-use-custom-rmsnorm", "--no-use-custom-swiglu",
                                      "--no-use-custom-rope", "--no-use-custom-flce", "--no-use-custom-adamw"],
}


@pytest.mark.parametrize("case", list(GPU_CASES))
def test_graphed_run_matches_eager_on_gpu(case, tmp_path, capsys):
    need_gpu()
    argv = TINY + GPU_CASES[case]
    eager = finetune_optimized.main(argv + ["--no-cuda-graphs"])
    out = capsys.readouterr().out
    graphed = finetune_optimized.main(argv + ["--cuda-graphs"])
    out = capsys.readouterr().out
    assert "step captured" in out, out
    assert len(graphed["losses"]) == len(eager["losses"]) == 4 + flags.GPU_WARMUP_STEPS
    # The same kernels in the same order: equal to float32 rounding (the tiny model is float32).
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=1e-5, abs=1e-6)


def test_uncapturable_step_falls_back_on_gpu(monkeypatch, capsys):
    """The eager steps after a failed capture draw random numbers (adapter dropout):
    the same ones as a run that never tried, and the process can still draw after it."""
    need_gpu()
    real = training.accumulate_gradients

    def with_host_sync(model, loss_fn, micro_batches):
        loss = real(model, loss_fn, micro_batches)
        loss.item()  # a host sync: not allowed while capturing
        return loss
    dropout = ["--lora", "--lora-dropout", "0.2", "--seed", "3"]
    eager = finetune_optimized.main(TINY + dropout + ["--no-cuda-graphs"])
    capsys.readouterr()
    monkeypatch.setattr(training, "accumulate_gradients", with_host_sync)
    graphed = finetune_optimized.main(TINY + dropout + ["--cuda-graphs"])
    out = capsys.readouterr().out
    assert "could not be captured" in out and "training eagerly" in out
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=1e-5, abs=1e-6)
    assert torch.rand(8, device="cuda").isfinite().all()  # the next user of the generator
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # not the capture's side stream

