"""
Tests of a real training run (CPU, --tiny, batch 1 x 16 synthetic tokens, a few
steps each):

* LoRA with every Triton kernel: the optimizer holds the adapters only, frozen
  weights get no gradient, the losses are those of HF's path with LoRA;
* the kernels skip work for frozen weights: no dw for a frozen RMSNorm weight, no
  weight gradient for a frozen LM head in the fused linear cross-entropy;
* gradient accumulation: 2 micro-batches of 1 give the loss and gradients of one
  batch of 2 (padded or packed too: the loss is token-weighted);
* the learning-rate schedule's shape, gradient clipping, held-out evaluation;
* checkpoints: a resumed run has exactly the losses of an uninterrupted one
  (HF path, every kernel, LoRA with dropout, real packed data with held-out
  evaluation; after Ctrl-C too);
* bad input ends in one line before any training, and nothing is overwritten;
* on the synthetic data the tiny model's loss falls by more than 20% in 40 steps.

Usage:
    python -m pytest tests/train_test.py -v
    python tests/train_test.py
"""

if __name__ == "__main__":
    # `python tests/train_test.py`: pytest runs this file. Its imports below need the
    # repository root on the path, which the root's conftest.py gives pytest.
    import sys

    import pytest

    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))


import copy
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import DEVICE  # first: the Triton interpreter switch

import finetune_baseline
import finetune_optimized
import kernel_ft
import linear_cross_entropy_kernel
import rmsnorm_kernel
from kernel_ft import checkpoints, dataloader, flags, models, reporting, training
from linear_cross_entropy_kernel import fused_linear_cross_entropy
from rmsnorm_kernel import rmsnorm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# Synthetic tokens (the loop is under test here; the data path has its own tests
# below and in tests/data_test.py).
SMALL = ["--tiny", "--dataset", "synthetic", "--batch-size", "1", "--seq-len", "16", "--warmup-steps", "0"]


def steps(n):
    return ["--steps", str(n)]


def close(a, b, tol=1e-6):
    assert len(a) == len(b), (a, b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= tol, f"step {i + 1}: {x:.8f} vs {y:.8f}"


def watch(monkeypatch):
    """Spies: the model and optimizer a run trains, and which parameters had a
    gradient at each optimizer update (before zero_grad)."""
    seen = {"grads": []}
    real_run, real_update = training.run_training, training.optimizer_update

    def run(args, model, loss_fn, optimizer, *rest):
        seen.update(model=model, optimizer=optimizer, loss_fn=loss_fn)
        return real_run(args, model, loss_fn, optimizer, *rest)

    def update(optimizer, *rest):
        seen["grads"].append({n: p.grad is not None for n, p in seen["model"].named_parameters()})
        return real_update(optimizer, *rest)

    monkeypatch.setattr(training, "run_training", run)
    monkeypatch.setattr(training, "optimizer_update", update)
    return seen


# --------------------------------------------------------------------------------
# LoRA with every kernel (one 8-step run, saving at step 4, shared by several tests)
# --------------------------------------------------------------------------------
LORA = SMALL + ["--lora", "--lora-dropout", "0.1", "--eval-every", "4", "--eval-batches", "1"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    with pytest.MonkeyPatch.context() as mp:
        seen = watch(mp)
        chunks, norms = [], []
        real_chunks, real_norm_bwd = linear_cross_entropy_kernel._flce_chunks, rmsnorm_kernel.rmsnorm_backward

        def chunks_spy(h2, weight, tgt, loss, n_valid, ignore_index, mean, grad_h, grad_w, *rest, **kw):
            chunks.append(grad_w is None)
            return real_chunks(h2, weight, tgt, loss, n_valid, ignore_index, mean, grad_h, grad_w, *rest, **kw)

        def norm_spy(dy, x, weight, rstd, compute_dw):  # positional: the launcher is a custom operator
            norms.append(compute_dw)
            return real_norm_bwd(dy, x, weight, rstd, compute_dw)

        mp.setattr(linear_cross_entropy_kernel, "_flce_chunks", chunks_spy)
        mp.setattr(rmsnorm_kernel, "rmsnorm_backward", norm_spy)
        results = finetune_optimized.main(LORA + steps(8) + ["--output-dir", str(out), "--save-every", "4"])
    return {"results": results, "seen": seen, "dir": out, "flce_no_grad_w": chunks, "norm_dw": norms}


def test_lora_optimizer_holds_the_adapters_only(lora_run):
    model, optimizer = lora_run["seen"]["model"], lora_run["seen"]["optimizer"]
    names = {id(p): n for n, p in model.named_parameters()}
    in_optimizer = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    assert in_optimizer and all(".lora_A." in n or ".lora_B." in n for n in in_optimizer)
    # 2 layers x 7 projections x (A, B)
    assert len(in_optimizer) == 2 * 7 * 2
    assert type(optimizer).__name__ == "TritonAdamW"
    # At every update the adapters had a gradient and nothing else did.
    for grads in lora_run["seen"]["grads"]:
        assert {n for n, has in grads.items() if has} == set(in_optimizer)


def test_lora_runs_every_kernel(lora_run):
    from rmsnorm_kernel import TritonRMSNorm
    from swiglu_kernel import TritonLlamaMLP

    model = lora_run["seen"]["model"]
    assert type(model).__name__ == "PeftModelForCausalLM"
    assert sum(isinstance(m, TritonRMSNorm) for m in model.modules()) == 5
    mlps = [m for m in model.modules() if isinstance(m, TritonLlamaMLP)]
    assert len(mlps) == 2 and all(type(m.gate_proj).__module__.startswith("peft") for m in mlps)
    assert not any(m.recomputes_hidden() for m in mlps)  # a LoRA down_proj needs h itself
    # The loss is HF's call; the model's forward computes it with the fused linear cross-entropy.
    assert lora_run["seen"]["loss_fn"] is training.hf_loss
    assert "_kernel_ft_forward" in model.get_base_model().__dict__


def test_frozen_weights_skip_their_gradients_in_the_kernels(lora_run):
    # The LM head and the norms are frozen under LoRA: the fused loss never built a
    # weight gradient, the RMSNorm backward never reduced a dw.
    assert lora_run["flce_no_grad_w"] and all(lora_run["flce_no_grad_w"])
    assert lora_run["norm_dw"] and not any(lora_run["norm_dw"])


def test_lora_kernels_match_hf(lora_run):
    hf = finetune_baseline.main(LORA + steps(8))
    close(lora_run["results"]["losses"], hf["losses"], tol=1e-4)


def bf16_lora_model(args_list=("--lora",)):
    """The tiny LLaMA in bf16 with PEFT's adapters (float32, PEFT's default)."""
    args = finetune_optimized.parse_args([*SMALL, *args_list])
    torch.manual_seed(0)
    model = models.build_random(models.tiny_config(), torch.device(DEVICE), torch.bfloat16)
    return models.apply_lora(model, args)


def test_lora_adapters_compute_in_the_model_dtype():
    """On a bf16 model the optimized script keeps PEFT's float32 adapters but runs
    their products in bf16: no float32 activation is saved for backward (PEFT's
    own path saves a float32 copy of every adapted layer's input), the loss and the
    adapters' gradients are PEFT's to bf16 rounding, and the gradients stay float32."""
    batch = dataloader.lm_batch(torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(1)).to(DEVICE))

    def run(model, loss_fn):
        saved = []

        def pack(t):
            saved.append((t.dtype, tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model, batch)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return loss.item(), grads, saved

    peft_model = bf16_lora_model()
    assert models.lora_compute_dtype(peft_model) == torch.bfloat16
    ref_loss, ref_grads, ref_saved = run(peft_model, training.hf_loss)
    model = bf16_lora_model()
    ours = models.adapters_compute_in(torch.bfloat16, model, training.hf_loss)
    loss, grads, saved = run(model, ours)

    # Activations saved in float32. PEFT's path: for each of the 7 adapted layers of
    # each of the 2 decoder layers, the float32 copy of its input ([64 tokens, in])
    # and of A's output ([64, r = 16]). Either path: HF's RMSNorm and loss keep some.
    def float32_activations(saved):
        return [shape for dtype, shape in saved if dtype == torch.float32 and (shape[:1] == (64,) or shape[:2] == (2, 32))]

    adapter_inputs = [(64, 128), (64, 352), (64, 16)]
    peft_copies = [shape for shape in float32_activations(ref_saved) if shape in adapter_inputs]
    assert len(peft_copies) == 2 * 7 * 2
    assert not [shape for shape in float32_activations(saved) if shape in adapter_inputs]
    assert len(float32_activations(saved)) == len(float32_activations(ref_saved)) - len(peft_copies)
    assert abs(loss - ref_loss) <= 2e-2 * abs(ref_loss)
    assert set(grads) == set(ref_grads) and all(g.dtype == torch.float32 for g in grads.values())
    for name, g in grads.items():
        ref = ref_grads[name]
        err = ((g - ref).norm() / ref.norm().clamp(min=1e-12)).item()
        assert err <= 5e-2 or ref.norm() == 0, f"{name}: relative error {err:.3f}"
    assert any(g.norm() > 0 for g in grads.values())


def test_lora_compute_dtype_only_for_low_precision_models(lora_run):
    assert models.lora_compute_dtype(lora_run["seen"]["model"]) is None  # float32 tiny: nothing to do
    torch.manual_seed(0)
    plain = models.build_random(models.tiny_config(), torch.device(DEVICE), torch.bfloat16)
    assert models.lora_compute_dtype(plain) is None  # no LoRA


def test_lora_resume_is_exact(lora_run, tmp_path):
    ckpt = lora_run["dir"] / "checkpoint-4"
    assert sorted(os.listdir(ckpt)) == ["README.md", "adapter_config.json", "adapter_model.safetensors",  # peft's
                                        "manifest.json", "optimizer.pt", "rng_state.pt", "scheduler.pt",
                                        "trainer_state.json"]
    resumed = finetune_optimized.main(LORA + steps(8) + ["--resume", str(ckpt), "--output-dir", str(tmp_path)])
    assert resumed["start_step"] == 4 and [s["step"] for s in resumed["steps"]] == [5, 6, 7, 8]
    close(resumed["losses"], lora_run["results"]["losses"][4:])  # dropout 0.1: the random state was restored
    assert resumed["eval"] == lora_run["results"]["eval"][1:]
    with open(tmp_path / flags.LOSS_CURVE, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------
# Resume: HF path (also after Ctrl-C) and every kernel with full fine-tuning
# --------------------------------------------------------------------------------
def test_resume_after_ctrl_c_is_exact(tmp_path, monkeypatch, capsys):
    argv = SMALL + steps(8)
    whole = finetune_baseline.main(argv)

    real_step = training.train_step
    calls = []

    def interrupt_on_step_5(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(training, "train_step", interrupt_on_step_5)
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(argv + ["--output-dir", str(tmp_path)])
    assert e.value.code == 130
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", flags.LOSS_CURVE]
    assert f"Saved         {tmp_path / 'checkpoint-4'}" in capsys.readouterr().out
    monkeypatch.setattr(training, "train_step", real_step)

    resumed = finetune_baseline.main(argv + ["--resume", str(tmp_path / "checkpoint-4")])
    close(resumed["losses"], whole["losses"][4:])
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-8", flags.LOSS_CURVE]
    assert {"model.safetensors", "config.json"} <= set(os.listdir(tmp_path / "checkpoint-8"))


# Real signals to a running script, as a scheduler sends them before it kills a job.
def run_and_signal(argv, signals, after="step    3/"):
    """Start finetune_baseline.py; once it prints ``after``, send ``signals`` (10 ms
    apart). Returns (exit code, everything it printed)."""
    # As many CPU threads as this process uses (one under pytest-xdist, conftest.py): the
    # resume in this process must add in the same order as the run it continues.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen([sys.executable, "finetune_baseline.py", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    printed = []
    for line in proc.stdout:
        printed.append(line)
        if after in line:
            for signum in signals:
                proc.send_signal(signum)
                time.sleep(0.01)
            break
    rest, _ = proc.communicate(timeout=300)
    return proc.returncode, "".join(printed) + rest


@pytest.mark.parametrize("signals, code", [
    ([signal.SIGTERM], 143),
    ([signal.SIGINT], 130),
    # A second signal abandons the step in progress; the rest land in the wrap-up.
    ([signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGINT], 143),
], ids=["sigterm", "sigint", "burst"])
def test_a_signal_saves_the_run_and_the_resume_is_exact(tmp_path, signals, code):
    argv = SMALL + steps(30)
    code_seen, out = run_and_signal(argv + ["--output-dir", str(tmp_path / "run"), "--json", str(tmp_path / "a.json")],
                                    signals)
    assert code_seen == code, out
    assert "Traceback" not in out and "Fatal Python error" not in out, out
    doc = json.loads((tmp_path / "a.json").read_text())
    done = len(doc["losses"])
    assert doc["partial"] is True and doc["stop_reason"] == signals[0].name and 3 <= done < 30
    assert sorted(os.listdir(tmp_path / "run")) == [f"checkpoint-{done}", flags.LOSS_CURVE]  # whole, no .tmp
    whole = finetune_baseline.main(argv)
    close(doc["losses"], whole["losses"][:done])
    resumed = finetune_baseline.main(argv + ["--resume", str(tmp_path / "run" / f"checkpoint-{done}")])
    close(resumed["losses"], whole["losses"][done:])


def test_resume_with_every_kernel_is_exact(tmp_path):
    # Full fine-tuning, every kernel (TritonAdamW's state included); 4 steps, as
    # the interpreter takes seconds per step.
    argv = SMALL + steps(4)
    whole = finetune_optimized.main(argv + ["--output-dir", str(tmp_path / "a"), "--save-every", "2"])
    resumed = finetune_optimized.main(argv + ["--resume", str(tmp_path / "a" / "checkpoint-2"),
                                               "--output-dir", str(tmp_path / "b")])
    close(resumed["losses"], whole["losses"][2:])


def test_resume_with_grad_accum_is_exact(tmp_path):
    argv = SMALL + steps(6) + ["--grad-accum", "2"]
    whole = finetune_baseline.main(argv + ["--output-dir", str(tmp_path), "--save-every", "3"])
    assert whole["tokens_per_step"] == 2 * 16  # both micro-batches count
    resumed = finetune_baseline.main(argv + ["--resume", str(tmp_path / "checkpoint-3"),
                                              "--output-dir", str(tmp_path / "b")])
    close(resumed["losses"], whole["losses"][3:])


def test_resume_with_real_data_is_exact(tmp_path):
    # The bundled records, packed, 2 micro-batches per step, held-out evaluation:
    # the batches of step K+1 on are built from (seed, step) alone, so the resumed
    # run trains and evaluates on exactly what the uninterrupted one did.
    argv = ["--tiny", "--batch-size", "1", "--seq-len", "128", "--warmup-steps", "0", "--packing",
             "--grad-accum", "2", "--eval-every", "3", "--eval-batches", "2"] + steps(6)
    whole = finetune_baseline.main(argv + ["--output-dir", str(tmp_path / "a"), "--save-every", "3"])
    assert whole["padding_fraction"] < 0.1 and whole["tokens_per_step"] == 2 * 128
    resumed = finetune_baseline.main(argv + ["--resume", str(tmp_path / "a" / "checkpoint-3"),
                                              "--output-dir", str(tmp_path / "b")])
    close(resumed["losses"], whole["losses"][3:])
    assert len(whole["eval"]) == 2 and resumed["eval"] == whole["eval"][1:]
    # Other data is another run: refused.
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(argv + ["--no-packing", "--resume", str(tmp_path / "a" / "checkpoint-3"),
                                        "--output-dir", str(tmp_path / "c")])
    assert "--packing True there, False here" in str(e.value.code)


# --------------------------------------------------------------------------------
# Gradient accumulation, schedule, clipping, evaluation
# --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    # The tiny LLaMA with a 512-token vocabulary: the interpreter scales the fused
    # loss's [V, H] weight gradient row by row, and 8,192 rows take seconds.
    config = models.tiny_config()
    config.vocab_size = 512
    torch.manual_seed(0)
    return models.build_random(config, DEVICE, torch.float32)


def gradients(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rows(batch, start, stop):
    """Rows start ... stop - 1 of a batch dict, as a batch of its own (a micro-batch)."""
    part = {k: v[start:stop] if torch.is_tensor(v) else v for k, v in batch.items()}
    part["num_tokens"] = part["input_ids"].numel()
    part["num_real_tokens"] = None  # not needed by the loss
    return part


def toy_batch(kind, vocab_size):
    """Two rows of 16 tokens: full rows, padded rows (5 and 15 targets), or packed
    rows (several examples each: block-diagonal mask, positions restarting)."""
    gen = torch.Generator().manual_seed(1)
    if kind == "packed":
        examples = []
        for length in (5, 7, 4, 9, 6):
            ids = torch.randint(3, vocab_size, (length,), generator=gen).tolist()
            examples.append((ids, [dataloader.IGNORE_INDEX] * 2 + ids[2:]))  # a 2-token prompt
        batch = dataloader.StepBatches(examples, 2, 16, packing=True, seed=0, pad_id=0).collate([[0, 1, 2], [3, 4]])
        return dataloader.batch_to(batch, DEVICE)
    ids = torch.randint(0, vocab_size, (2, 16), generator=gen)
    labels = ids.clone()
    if kind == "padded":  # the rows have different numbers of targets: 5 and 15
        labels[0, 6:] = dataloader.IGNORE_INDEX
    return dataloader.batch_to(dataloader.lm_batch(ids, labels), DEVICE)


def loss_model(tiny_model, fused):
    """The tiny model with HF's loss, or with HF's loss call computed inside the model's
    forward by the fused linear cross-entropy."""
    if not fused:
        return tiny_model
    model = copy.deepcopy(tiny_model)
    kernel_ft.apply(model, rmsnorm=False, swiglu=False, ce=False, rope=False, attention=False, lora=False,
                    projections=False, strict=True)
    return model


def assert_big_equals_small(model, batch):
    """One micro-batch of both rows, and two of one row each: the same loss and gradients."""
    model.zero_grad(set_to_none=True)
    big = training.accumulate_gradients(model, training.hf_loss, [batch])
    g_big = gradients(model)
    model.zero_grad(set_to_none=True)
    small = training.accumulate_gradients(model, training.hf_loss, [rows(batch, 0, 1), rows(batch, 1, 2)])
    g_small = gradients(model)
    model.zero_grad(set_to_none=True)
    assert torch.isfinite(small) and abs(big.item() - small.item()) <= 1e-6 * abs(big.item()), (big, small)
    assert g_big.keys() == g_small.keys()
    for name in g_big:
        torch.testing.assert_close(g_small[name], g_big[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("fused", [False, True], ids=["hf", "flce"])
@pytest.mark.parametrize("kind", ["full", "padded", "packed"])
def test_grad_accum_equals_one_big_batch(tiny_model, fused, kind):
    model = loss_model(tiny_model, fused)
    batch = toy_batch(kind, model.config.vocab_size)
    if kind == "packed":  # the rows hold 10 and 11 targets: the weights are not 1/2 each
        assert [training.target_count(rows(batch, r, r + 1)).item() for r in (0, 1)] == [10, 11]
    assert_big_equals_small(model, batch)


@pytest.mark.parametrize("fused", [False, True], ids=["hf", "flce"])
def test_a_micro_batch_without_targets_adds_nothing(tiny_model, fused):
    """transformers' loss of a batch with no target is 0 / 0 (NaN), and so is the fused
    loss's inside the model; weighted by 0 it must still add nothing to the step."""
    model = loss_model(tiny_model, fused)
    batch = toy_batch("full", model.config.vocab_size)
    batch["labels"][0] = dataloader.IGNORE_INDEX
    assert torch.isnan(training.hf_loss(model, rows(batch, 0, 1)))
    assert_big_equals_small(model, batch)
    # The held-out loss too: a batch without targets weighs nothing there either.
    alone = training.evaluate(model, training.hf_loss, [rows(batch, 1, 2)])
    assert math.isfinite(alone) and training.evaluate(model, training.hf_loss, [rows(batch, 0, 1), rows(batch, 1, 2)]) \
        == pytest.approx(alone, rel=1e-6)


def test_schedule_shape():
    total, warmup = 20, 4
    f = [training.lr_factor(s, warmup, total) for s in range(total)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warm-up, no step at lr 0
    assert all(a > b for a, b in zip(f[4:], f[5:]))  # then strictly falling
    assert abs(f[4 + 8] - 0.5) < 1e-12 and 0 < f[-1] < 0.05  # half-way at 0.5, small but not 0 at the end
    assert training.lr_factor(0, 0, 10) == 1.0


@pytest.mark.parametrize("optimizer", ["torch", "triton"])
def test_scheduler_drives_both_optimizers(optimizer):
    from adamw_kernel import TritonAdamW

    args = finetune_baseline.parse_args(["--steps", "10", "--warmup-steps", "0", "--lr-warmup-steps", "2"])
    p = torch.nn.Parameter(torch.ones(3, device=DEVICE))
    opt = TritonAdamW([p], lr=0.1) if optimizer == "triton" else torch.optim.AdamW([p], lr=0.1)
    sched = training.make_scheduler(opt, args)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(3, device=DEVICE)
        training.optimizer_update(opt, sched, 0.0)
    assert lrs == pytest.approx([0.1 * training.lr_factor(s, 2, 10) for s in range(10)])


def test_clipping():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([6.0, 8.0, 0.0, 0.0])  # norm 10
    norm = training.optimizer_update(opt, None, 1.0)
    assert norm.item() == pytest.approx(10.0)
    assert p.detach().norm().item() == pytest.approx(1.0)  # the update used the clipped gradient
    assert p.grad is None
    p.grad = torch.tensor([6.0, 8.0, 0.0, 0.0])
    assert training.optimizer_update(opt, None, 0.0) is None  # 0: clipping off
    assert p.detach().tolist() == pytest.approx([-6.6, -8.8, 0.0, 0.0])


def test_evaluate_is_the_token_weighted_mean_and_changes_nothing(tiny_model):
    model = tiny_model
    gen = torch.Generator().manual_seed(2)
    batches = [dataloader.batch_to(dataloader.lm_batch(ids), DEVICE)
               for ids in torch.randint(0, model.config.vocab_size, (3, 1, 16), generator=gen)]
    losses = [training.hf_loss(model, batch).item() for batch in batches]
    model.train()
    assert training.evaluate(model, training.hf_loss, batches) == pytest.approx(sum(losses) / 3, rel=1e-6)
    assert model.training and all(p.grad is None for p in model.parameters())


def test_ctrl_c_during_the_update_is_held():
    # Python's own Ctrl-C handler, whatever this process inherited (a shell's background job ignores SIGINT).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_held()
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_held():
    with training.hold_interrupts():
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt inside the block
    with pytest.raises(KeyboardInterrupt):
        training.interrupt_if_held()
    training.interrupt_if_held()  # delivered once


def test_sigterm_during_an_update_outside_a_run_ends_the_process_after_it():
    # No run loop to deliver it (the profile script): the default action, once the update is whole.
    code = ("import os, signal\nfrom kernel_ft import training\n"
            "with training.hold_interrupts():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    print('update complete', flush=True)\n"
            "print('not reached', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM and proc.stdout == "update complete\n", (proc.returncode, proc.stdout)


def test_a_second_signal_inside_a_finalizer_is_one_line_not_a_traceback():
    # On a GPU the step closes profiler ranges in generator finalizers; a second signal's
    # KeyboardInterrupt landing there cannot propagate, and Python would print a traceback.
    code = ("import gc, os, signal\nfrom kernel_ft import training\n"
            "class Closes:\n"
            "    def __del__(self):\n"
            "        os.kill(os.getpid(), signal.SIGTERM)  # the second signal, inside a finalizer\n"
            "with training.stop_on_signals() as stop:\n"
            "    os.kill(os.getpid(), signal.SIGTERM)  # the first: stop after this step\n"
            "    Closes()\n"
            "    gc.collect()\n"
            "    print('step completes', stop.signum == signal.SIGTERM, flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "step completes True\n", (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "second signal came while a clean-up ran" in proc.stderr, proc.stderr


def test_progress_bar_only_on_a_terminal(monkeypatch):
    args = finetune_baseline.parse_args([])
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    bar = reporting.progress_bar(args, 10, 0)
    assert type(bar).__name__ == "tqdm"
    bar.close()
    args = finetune_baseline.parse_args(["--log-every", "5"])  # asked for lines
    assert reporting.progress_bar(args, 10, 0) is None


# --------------------------------------------------------------------------------
# The kernels skip frozen weights (direct calls)
# --------------------------------------------------------------------------------
def test_frozen_rmsnorm_weight_gets_no_dw(monkeypatch):
    calls = []
    real = rmsnorm_kernel.rmsnorm_backward

    def spy(dy, x, weight, rstd, compute_dw):
        calls.append(compute_dw)
        return real(dy, x, weight, rstd, compute_dw)

    monkeypatch.setattr(rmsnorm_kernel, "rmsnorm_backward", spy)
    x = torch.randn(3, 41, device=DEVICE, requires_grad=True)
    w = torch.randn(41, device=DEVICE)
    for trainable in (False, True):
        w.requires_grad_(trainable)
        rmsnorm(x, w).square().sum().backward()
        assert (w.grad is not None) == trainable
    assert calls == [False, True]


def test_frozen_lm_head_gets_no_weight_gradient(monkeypatch):
    seen = []
    real = linear_cross_entropy_kernel._flce_chunks

    def spy(h2, weight, tgt, loss, n_valid, ignore_index, mean, grad_h, grad_w, *rest, **kw):
        seen.append(grad_w is None)
        return real(h2, weight, tgt, loss, n_valid, ignore_index, mean, grad_h, grad_w, *rest, **kw)

    monkeypatch.setattr(linear_cross_entropy_kernel, "_flce_chunks", spy)
    hidden = torch.randn(7, 16, device=DEVICE, requires_grad=True)
    weight = torch.randn(123, 16, device=DEVICE)
    targets = torch.randint(0, 123, (7,), device=DEVICE)
    fused_linear_cross_entropy(hidden, weight, targets).backward()
    frozen_grad = hidden.grad.clone()
    hidden.grad = None
    weight.requires_grad_(True)
    fused_linear_cross_entropy(hidden, weight, targets).backward()
    assert seen == [True, False] and weight.grad is not None
    torch.testing.assert_close(frozen_grad, hidden.grad)  # the hidden gradient does not depend on it


# --------------------------------------------------------------------------------
# Bad input: one line, before any training, nothing overwritten
# --------------------------------------------------------------------------------
def no_training(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("training started before the check")

    monkeypatch.setattr(training, "train_step", forbidden)


def one_line_error(main, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def test_lora_without_peft(monkeypatch):
    no_training(monkeypatch)
    monkeypatch.setattr(models, "load_model", lambda *a: pytest.fail("built a model before the check"))
    monkeypatch.setattr(flags, "installed", lambda package: package != "peft")
    msg = one_line_error(finetune_baseline.main, SMALL + ["--lora"])
    assert "--lora needs the peft package: pip install peft" in msg


def test_lora_4bit_without_bitsandbytes(monkeypatch):
    no_training(monkeypatch)
    monkeypatch.setattr(flags, "installed", lambda package: package != "bitsandbytes")
    msg = one_line_error(finetune_optimized.main, SMALL + ["--lora-4bit"])
    assert "--lora-4bit needs bitsandbytes" in msg and "pip install bitsandbytes" in msg


def test_unknown_lora_target(monkeypatch):
    no_training(monkeypatch)
    msg = one_line_error(finetune_baseline.main, SMALL + ["--lora", "--lora-targets", "q_proj,qkv_proj"])
    assert "has no linear layer named qkv_proj" in msg


def test_resume_of_a_missing_or_foreign_directory(tmp_path, monkeypatch):
    no_training(monkeypatch)
    msg = one_line_error(finetune_baseline.main, SMALL + ["--resume", str(tmp_path / "checkpoint-4")])
    assert "no such checkpoint directory" in msg
    msg = one_line_error(finetune_baseline.main, SMALL + ["--resume", str(tmp_path)])
    assert "not a checkpoint (no trainer_state.json)" in msg


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A 2-step HF run of the tiny model with a checkpoint at step 1."""
    out = tmp_path_factory.mktemp("hf")
    finetune_baseline.main(SMALL + steps(2) + ["--output-dir", str(out), "--save-every", "1"])
    return out


def snapshot(path):
    return {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs}


def test_checkpoint_of_other_settings(hf_checkpoint, monkeypatch):
    no_training(monkeypatch)
    before = snapshot(hf_checkpoint)
    ckpt = str(hf_checkpoint / "checkpoint-1")
    msg = one_line_error(finetune_baseline.main, SMALL + steps(2) + ["--seq-len", "8", "--resume", ckpt])
    assert "made with other settings: --seq-len 16 there, 8 here" in msg
    msg = one_line_error(finetune_baseline.main, SMALL + steps(2) + ["--lora", "--resume", ckpt])
    assert "--lora False there, True here" in msg
    assert snapshot(hf_checkpoint) == before


def test_checkpoint_of_another_model(hf_checkpoint, tmp_path, monkeypatch):
    import json
    import shutil

    no_training(monkeypatch)
    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(hf_checkpoint / "checkpoint-1", ckpt)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["model_config"]["hidden_size"] = 256
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    checkpoints.write_manifest(str(ckpt))  # a whole checkpoint, of another model
    msg = one_line_error(finetune_baseline.main, SMALL + steps(2) + ["--resume", str(ckpt)])
    assert "the checkpoint is of another model: hidden_size 256 there, 128 here" in msg


@pytest.mark.parametrize("damage, problem", [
    (lambda c: (c / "optimizer.pt").write_bytes((c / "optimizer.pt").read_bytes()[:100]),
     r"optimizer.pt is damaged \(100 bytes, [\d,]+ were written\)"),
    (lambda c: (c / "model.safetensors").write_bytes((c / "model.safetensors").read_bytes()[:-1] + b"x"),
     r"model.safetensors is damaged \(its bytes differ from those written: CRC-32 mismatch\)"),
    (lambda c: (c / "rng_state.pt").unlink(), r"rng_state.pt is missing"),
    (lambda c: (c / "manifest.json").unlink(), r"no manifest.json: its save never completed"),
], ids=["truncated", "flipped", "missing", "unfinished"])
def test_a_damaged_checkpoint_is_refused(hf_checkpoint, tmp_path, monkeypatch, damage, problem):
    import shutil

    no_training(monkeypatch)
    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(hf_checkpoint / "checkpoint-1", ckpt)
    damage(ckpt)
    msg = one_line_error(finetune_baseline.main, SMALL + steps(2) + ["--resume", str(ckpt)])
    assert re.match(rf"error: --resume {re.escape(str(ckpt))}: {problem}; resume from another checkpoint", msg), msg


def test_resume_from_the_run_folder_takes_the_latest_complete_checkpoint(tmp_path, capsys):
    argv = SMALL + steps(4)
    whole = finetune_baseline.main(argv + ["--output-dir", str(tmp_path / "run"), "--save-every", "1"])
    shutil.rmtree(tmp_path / "run" / "checkpoint-4")
    (tmp_path / "run" / "checkpoint-3" / "optimizer.pt").write_bytes(b"")  # a disk that filled up
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # checkpoint-3 is damaged and may not be overwritten either
        finetune_baseline.main(argv + ["--resume", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert (f"--resume {tmp_path / 'run'}: taking its latest complete checkpoint, "
            f"{tmp_path / 'run' / 'checkpoint-2'} (checkpoint-3 skipped: optimizer.pt is damaged") in out
    msg = str(e.value.code)  # the damaged one is named as such; the advice names a complete checkpoint only
    assert "already holds checkpoint-3 (not complete: optimizer.pt is damaged" in msg
    assert "which a run resumed from step 2 would overwrite; move it away" in msg and "--resume" not in msg
    shutil.rmtree(tmp_path / "run" / "checkpoint-3")
    resumed = finetune_baseline.main(argv + ["--resume", str(tmp_path / "run")])
    close(resumed["losses"], whole["losses"][2:])


def test_a_folder_the_run_did_not_write_is_never_deleted(tmp_path, monkeypatch):
    """A checkpoint-K.tmp of someone else's in --output-dir: refused before training, kept.
    One that an interrupted save of ours left (marked) is replaced by the next save."""
    no_training(monkeypatch)
    theirs = tmp_path / "run" / "checkpoint-2.tmp"
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    msg = one_line_error(finetune_baseline.main, SMALL + steps(2) + ["--output-dir", str(tmp_path / "run")])
    assert f"{theirs} was not written by this project's checkpoint save" in msg
    assert (theirs / "notes.txt").read_text() == "mine"
    (theirs / "notes.txt").unlink()
    (theirs / checkpoints.WRITING_MARK).write_text("")  # as an interrupted save of ours leaves it
    checkpoints.fresh_tmp(str(theirs))
    assert sorted(p.name for p in theirs.iterdir()) == [checkpoints.WRITING_MARK]


@pytest.mark.parametrize("files, problem", [
    (["model.safetensors"], "no list of files"),
    ({"model.safetensors": {"bytes": "12", "crc32": "0badf00d"}}, "the entry of 'model.safetensors' has no byte count"),
    ({"../../../etc/hostname": {"bytes": 1, "crc32": "0badf00d"}}, "'../../../etc/hostname' is not a file of the"),
])
def test_a_forged_manifest_ends_in_one_line(hf_checkpoint, tmp_path, monkeypatch, files, problem):
    no_training(monkeypatch)
    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(hf_checkpoint / "checkpoint-1", ckpt)
    (ckpt / checkpoints.MANIFEST).write_text(json.dumps({"files": files}))
    msg = one_line_error(finetune_baseline.main, SMALL + steps(2) + ["--resume", str(ckpt)])
    assert msg.startswith(f"error: --resume {ckpt}: {checkpoints.MANIFEST} is not one this code wrote ({problem}"), msg


def test_output_dir_is_never_overwritten(hf_checkpoint, monkeypatch):
    no_training(monkeypatch)
    before = snapshot(hf_checkpoint)
    msg = one_line_error(finetune_baseline.main, SMALL + steps(2) + ["--output-dir", str(hf_checkpoint)])
    assert "already holds checkpoint-1, which a run starting from step 0 would overwrite" in msg
    assert f"--resume {hf_checkpoint / 'checkpoint-2'}" in msg
    # Resuming from step 1 would write checkpoint-2 again: refused too.
    msg = one_line_error(finetune_baseline.main, SMALL + steps(2) + ["--resume", str(hf_checkpoint / "checkpoint-1")])
    assert "already holds checkpoint-2, which a run resumed from step 1 would overwrite" in msg
    msg = one_line_error(finetune_baseline.main, SMALL + ["--save-every", "2"])
    assert "--save-every needs --output-dir" in msg
    assert snapshot(hf_checkpoint) == before


# --------------------------------------------------------------------------------
# Learning: the tiny model on the synthetic data
# --------------------------------------------------------------------------------
def test_loss_falls_in_40_steps():
    # Default --tiny lr (3e-3, cosine), 2 x 32 synthetic tokens. The loss falls from
    # ln(8192) = 9.0 towards the entropy of the Zipf token frequencies (~7); the
    # repeated phrases (copying) take longer to learn than 40 steps.
    argv = ["--tiny", "--dataset", "synthetic", "--seq-len", "32", "--steps", "40", "--warmup-steps", "0"]
    losses = finetune_baseline.main(argv)["losses"]
    first, last = losses[0], sum(losses[-5:]) / 5
    assert abs(first - math.log(8192)) < 0.5
    assert last < 0.8 * first, f"{first:.3f} -> {last:.3f}"

