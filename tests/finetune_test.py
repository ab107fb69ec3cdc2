"""
Tests of the fine-tune scripts and their shared loader (CPU, --tiny, seconds each).

* the baseline and the optimized script give the same losses, step by step;
* the optimized run really swapped the RMSNorm and MLP modules and used the fused
  linear cross-entropy, without ever running the LM head (no logits);
* the workload modules (flags, models, fsdp, dataloader, checkpoints, cuda_graphs,
  reporting, training) import no kernel: the optimized script switches them in itself;
* --json writes the documented fields, as strict JSON (NaN as null), atomically;
* outputs are checked before the work; Ctrl-C keeps the completed steps (partial,
  exit 130); GPU and CPU out-of-memory errors end in the same one-line advice;
* bad input ends with a one-line message and a non-zero exit, never a traceback;
* flags that another flag overrides are reported;
* the default model falls back to its bundled config quickly when the hub
  cannot serve the weights;
* tools/max_seq_len.py refuses to run without a GPU, in one line;
* --liger (the Liger-Kernel peer) refuses what it cannot do in one line, and on a
  GPU with liger-kernel installed trains with the baseline's losses.

Usage:
    python -m pytest tests/finetune_test.py -v
    python tests/finetune_test.py
"""

if __name__ == "__main__":
    # `python tests/finetune_test.py`: pytest runs this file. Its imports below need the
    # repository root on the path, which the root's conftest.py gives pytest.
    import sys

    import pytest

    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))


import argparse
import ast
import copy
import errno
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import transformers

import finetune_baseline
import finetune_optimized
import kernel_ft
import linear_cross_entropy_kernel
from kernel_ft import checkpoints, dataloader, files, flags, models, reporting, run, training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# Synthetic tokens: these tests are about the loop and the kernels (tests/data_test.py tests the data).
# On a GPU the attention kernel goes in by default, for the measured choice on rows of
# one document (run.kernels_default_attention); in the interpreter it does not.
DEFAULT_ATTENTION = torch.cuda.is_available()

TINY = ["--tiny", "--dataset", "synthetic", "--batch-size", "2", "--seq-len", "32", "--steps", "3", "--warmup-steps",
        "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One baseline and one optimized run, with spies on the kernels (shared by tests)."""
    out = tmp_path_factory.mktemp("runs")
    import adamw_kernel
    import rope_kernel

    spy = {"ce_calls": 0, "flce_calls": 0, "lm_head_calls": 0, "rope_calls": 0, "adamw_calls": 0, "models": []}
    real_adamw = adamw_kernel.adamw_step

    def adamw_spy(*args, **kwargs):
        spy["adamw_calls"] += 1
        return real_adamw(*args, **kwargs)

    real_rope = rope_kernel.rope_forward

    def rope_spy(*args, **kwargs):
        spy["rope_calls"] += 1
        return real_rope(*args, **kwargs)

    import cross_entropy_kernel
    import kernel_ft.patching

    # Each spy replaces the name where it is called: the loss kernels in their files'
    # model patching, the RMSNorm swap in kernel_ft.apply.
    ce, flce, patching = cross_entropy_kernel, linear_cross_entropy_kernel, kernel_ft.patching
    real_ce, real_flce, real_replace = ce.cross_entropy, flce.fused_linear_cross_entropy, patching.replace_rmsnorm

    def ce_spy(*args, **kwargs):
        spy["ce_calls"] += 1
        return real_ce(*args, **kwargs)

    def flce_spy(*args, **kwargs):
        spy["flce_calls"] += 1
        return real_flce(*args, **kwargs)

    def count_lm_head(*_):
        spy["lm_head_calls"] += 1

    real_loop = training.run_training

    def loop_spy(*args, **kwargs):  # the counts when the loop begins: what the probes before it called
        spy["before_training"] = {k: v for k, v in spy.items() if k.endswith("_calls")}
        return real_loop(*args, **kwargs)

    def replace_spy(model):
        spy["models"].append(model)
        model.lm_head.register_forward_hook(count_lm_head)  # logits computed = LM head called
        return real_replace(model)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ce, "cross_entropy", ce_spy)
        mp.setattr(flce, "fused_linear_cross_entropy", flce_spy)
        mp.setattr(patching, "replace_rmsnorm", replace_spy)
        mp.setattr(rope_kernel, "rope_forward", rope_spy)
        mp.setattr(adamw_kernel, "adamw_step", adamw_spy)
        mp.setattr(training, "run_training", loop_spy)
        base = finetune_baseline.main(TINY + ["--json", str(out / "baseline.json")])
        base_spy = dict(spy, models=list(spy["models"]))
        # Eager on a GPU too: the spies count Python calls, which a CUDA graph's replays
        # do not make (tests/cuda_graphs_test.py tests the graphs).
        opt = finetune_optimized.main(TINY + ["--no-cuda-graphs", "--json", str(out / "optimized.json")])
    return {"base": base, "opt": opt, "base_spy": base_spy, "spy": spy, "dir": out}


def assert_same_losses(base, ours):
    """The baseline's and the optimized run's losses agree step by step, to 1e-4."""
    for step, (b, o) in enumerate(zip(base, ours), start=1):
        assert abs(b - o) <= 1e-4, f"step {step}: baseline {b:.6f} vs optimized {o:.6f}"


def test_same_losses(runs):
    base, opt = runs["base"]["losses"], runs["opt"]["losses"]
    assert len(base) == len(opt) == 4
    assert_same_losses(base, opt)


def test_gradient_checkpointing_keeps_the_losses(runs):
    # Every kernel with each decoder layer recomputed in backward (the fused RoPE
    # included): the same losses as the plain baseline without checkpointing.
    ckpt = finetune_optimized.main(TINY + ["--gradient-checkpointing", "--steps", "1"])
    for step, (b, c) in enumerate(zip(runs["base"]["losses"], ckpt["losses"]), start=1):
        assert abs(b - c) <= 1e-4, f"step {step}: baseline {b:.6f} vs checkpointed {c:.6f}"
    assert len(ckpt["losses"]) >= 2

def test_optimized_used_the_kernels(runs):
    from rmsnorm_kernel import TritonRMSNorm

    from swiglu_kernel import TritonLlamaMLP

    # The baseline touched no kernel.
    base = runs["base_spy"]
    assert base["ce_calls"] == base["flce_calls"] == 0 and base["models"] == []
    # The optimized run computed every step's loss with the fused linear cross-entropy
    # (which supersedes the plain one) and never ran the LM head: no logits at all ...
    assert runs["spy"]["flce_calls"] == 4 and runs["spy"]["ce_calls"] == 0
    # Before training only: check_flce_head's 3-token probe, and on a GPU (the attention
    # kernel in by default there) the attention's probes, which run RoPE too.
    before = runs["spy"]["before_training"]
    assert runs["spy"]["lm_head_calls"] == before["lm_head_calls"] >= 1
    assert before["lm_head_calls"] == 1 if not DEFAULT_ATTENTION else before["lm_head_calls"] > 1
    # The fused RoPE ran in both attention layers of every step, and only there.
    assert base["rope_calls"] == 0 and runs["spy"]["rope_calls"] - before["rope_calls"] == 2 * 4
    # The Triton AdamW updated every parameter at every step (the baseline: PyTorch's).
    n_params = len(list(runs["spy"]["models"][0].parameters()))
    assert base["adamw_calls"] == 0 and runs["spy"]["adamw_calls"] == n_params * 4
    # ... and no HF RMSNorm is left in its model: 2 layers x 2 + the final norm;
    # both MLPs run the fused SwiGLU.
    (model,) = runs["spy"]["models"]
    kinds = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert kinds == ["TritonRMSNorm"] * 5
    assert all(isinstance(m, TritonRMSNorm) for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
    mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    assert len(mlps) == 2 and all(isinstance(m, TritonLlamaMLP) for m in mlps)


def kernels_line(*names):
    """The run's "Kernels:" line for these kernels, with attention where it goes in by default."""
    if DEFAULT_ATTENTION:
        order = list(flags.KERNELS)
        names = sorted((*names, "attention"), key=lambda n: order.index(n) if n in order else len(order))
    return f"Kernels:       {', '.join(names)}\n"


def test_optimized_prints_active_kernels(capsys):
    finetune_optimized.main(TINY[:-4] + ["--steps", "1", "--warmup-steps", "0", "--no-use-custom-flce",
                                         "--no-use-custom-swiglu", "--no-use-custom-rope", "--no-use-custom-adamw"])
    out = capsys.readouterr().out
    assert "replaced 5 RMSNorm modules with TritonRMSNorm" in out
    assert kernels_line("rmsnorm", "residual", "ce", "projections") in out
    finetune_optimized.main(TINY[:-4] + ["--steps", "1", "--warmup-steps", "0", "--no-use-custom-rmsnorm"])
    out = capsys.readouterr().out
    assert "replaced 2 gated MLPs with TritonLlamaMLP" in out and "fused linear cross-entropy inside the model's" in out
    assert "fused RoPE in 2 attention modules" in out
    assert kernels_line("residual", "swiglu", "rope", "flce", "adamw", "projections") in out


def test_json_fields(runs):
    with open(runs["dir"] / "optimized.json") as f:
        doc = json.load(f)
    for key in ("script", "config", "environment", "model", "kernels", "steps", "losses", "step_times_s",
                "tokens_per_sec", "time_per_step_s", "peak_memory_bytes", "peak_memory_kind", "warmup_steps"):
        assert key in doc, key
    assert doc["script"] == "finetune_optimized.py"
    # What each kernel came to. Synthetic rows are one document each: the attention kernel stays
    # off by default in the interpreter (packed real data only); on a GPU it goes in for the
    # measured choice. The cross-entropy on logits is left out where the fused loss went in.
    assert doc["kernels"] == {"rmsnorm": True, "residual": True, "swiglu": True, "rope": True, "attention": DEFAULT_ATTENTION,
                              "ce": False, "flce": True, "adamw": True, "projections": True}
    assert doc["config"]["seq_len"] == 32 and doc["config"]["batch_size"] == 2 and doc["config"]["tiny"] is True
    for key in ("device", "gpu", "python", "torch", "triton", "transformers", "cuda", "date"):
        assert key in doc["environment"], key
    assert doc["model"]["parameters"] > 0 and doc["model"]["dtype"] == "float32"
    assert [s["warmup"] for s in doc["steps"]] == [True, False, False, False]
    assert len(doc["losses"]) == len(doc["step_times_s"]) == 4
    assert doc["tokens_per_sec"] > 0 and doc["peak_memory_bytes"] > 0


@pytest.mark.parametrize("flag, config, seq_len, on", [
    (None, dict(_attn_implementation="eager"), 64, True),  # Gemma-2: soft-capped scores, no SDPA
    (None, dict(sliding_window=16), 64, True),  # every layer slides a window shorter than the row
    (None, dict(sliding_window=16, layer_types=["full_attention", "sliding_attention"]), 64, True),
    (None, dict(sliding_window=16, layer_types=["full_attention", "full_attention"]), 64, False),
    (None, dict(sliding_window=128), 64, False),  # the window holds the whole row: SDPA's causal kernels
    (None, dict(), 64, False),
    (False, dict(sliding_window=16), 64, False),  # asked off
])
def test_attention_kernel_by_default_where_sdpa_needs_a_mask(flag, config, seq_len, on, monkeypatch):
    monkeypatch.setattr(run.attention_routing, "MEASURED_DEVICES", ())  # no measured choice, on a GPU too
    model = argparse.Namespace(config=argparse.Namespace(
        **{"_attn_implementation": "sdpa", "sliding_window": None, "num_hidden_layers": 2, **config}))
    args = argparse.Namespace(use_custom_attention=flag, seq_len=seq_len)
    assert run.kernels_default_attention(args, model) is on


@pytest.mark.parametrize("flag, on", [(None, True), (False, False)])
def test_attention_kernel_by_default_on_a_measured_device(flag, on, monkeypatch):
    """On a device where rows of one document are measured (a GPU; on a CPU run the CPU
    made one), the kernel goes in by default for them, unless asked off."""
    monkeypatch.setattr(run.attention_routing, "MEASURED_DEVICES", ("cuda" if torch.cuda.is_available() else "cpu",))
    model = argparse.Namespace(config=argparse.Namespace(_attn_implementation="sdpa", sliding_window=None,
                                                         num_hidden_layers=2))
    assert run.kernels_default_attention(argparse.Namespace(use_custom_attention=flag, seq_len=64), model) is on


def test_loss_functions_agree_on_padding():
    """HF's loss and ours agree with ignored labels in the middle and at the end."""
    torch.manual_seed(0)
    args = flags.settle(finetune_baseline.parse_args(["--tiny", "--seq-len", "16"]))
    model, _ = models.load_model(args)
    ids = torch.randint(0, model.config.vocab_size, (2, 16)).to(model.device)
    labels = ids.clone()
    labels[0, 5:9] = dataloader.IGNORE_INDEX
    labels[1, -3:] = dataloader.IGNORE_INDEX
    batch = dataloader.lm_batch(ids, labels)
    hf = training.hf_loss(model, batch)
    ce_model, flce_model = copy.deepcopy(model), copy.deepcopy(model)
    kernel_ft.apply(ce_model, flce=False, strict=True)
    kernel_ft.apply(flce_model, strict=True)
    ours = training.hf_loss(ce_model, batch)
    fused = training.hf_loss(flce_model, batch)
    assert abs(hf.item() - ours.item()) < 1e-5 and abs(hf.item() - fused.item()) < 1e-5


# --------------------------------------------------------------------------------
# Bad input: one line, non-zero exit
# --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
        (["--seq-len", "-5"], "argument --seq-len: must be at least 1, got -5"),
        (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["--lr", "nan"], "argument --lr: must be a finite number >= 0, got nan"),
        (["--lr", "-1"], "argument --lr: must be a finite number >= 0, got -1"),
        (["--lr", "0"], "argument --lr: must be a finite number > 0, got 0"),
        (["--seed", str(2**64)], f"argument --seed: must be from 0 to 2**63 - 1, got {2**64}"),
        (["--seed", "-1"], "argument --seed: must be from 0 to 2**63 - 1, got -1"),
        (["--lora", "--lora-alpha", "0"], "argument --lora-alpha: must be a finite number > 0, got 0"),
        (["--lora", "--lora-r", "0"], "argument --lora-r: must be at least 1, got 0"),
        (["--max-grad-norm", "inf"], "argument --max-grad-norm: must be a finite number >= 0, got inf"),
    ],
)
def test_bad_numbers(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(["--tiny"] + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_liger_refusals(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        finetune_baseline.parse_args(["--liger", "--use-custom-rmsnorm"])
    assert e.value.code == 2 and "--liger replaces the same operations as --use-custom-rmsnorm" in capsys.readouterr().err
    monkeypatch.setattr(flags, "installed", lambda package: package != "liger_kernel")
    with pytest.raises(SystemExit, match=r"^error: --liger needs the liger-kernel package"):
        finetune_baseline.parse_args(["--liger"])
    monkeypatch.setattr(flags, "installed", lambda package: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"^error: --liger needs a GPU"):
        finetune_baseline.parse_args(["--liger"])


@pytest.mark.skipif(not torch.cuda.is_available() or not flags.installed("liger_kernel"),
                    reason="Liger-Kernel runs on a GPU, with liger-kernel installed")
@pytest.mark.parametrize("family", [None, "qwen2", "gemma2"])
def test_liger_trains_like_the_baseline(tmp_path, family):
    """Its own process: Liger patches HF's module of the family for every model built after it."""
    argv = TINY
    if family:  # Liger's own patch for that family, on a tiny random model of it
        transformers.AutoConfig.for_model(family, vocab_size=512, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                                          head_dim=16).save_pretrained(tmp_path / "model")
        argv = [a for a in TINY if a != "--tiny"] + ["--model", str(tmp_path / "model"), "--random-init"]
    out = tmp_path / "liger.json"
    proc = subprocess.run([sys.executable, "finetune_baseline.py", *argv, "--liger", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"Kernels:       Liger-Kernel's {family or 'llama'} patch" in proc.stdout
    base = finetune_baseline.main(argv + ["--json", str(tmp_path / "base.json")])
    liger = json.loads(out.read_text())["losses"]
    assert len(liger) == len(base["losses"])
    # bf16 on a GPU (the tiny LLaMA: float32): the two loss paths round differently.
    assert all(abs(a - b) <= 2e-2 * (1 if family else 0.05) for a, b in zip(liger, base["losses"])), (
        liger, base["losses"])


def test_seq_len_beyond_max_positions():
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(["--tiny", "--seq-len", "4096", "--steps", "1"])
    assert "--seq-len 4096 is longer than the model's maximum of 2048 positions" in str(e.value.code)


@pytest.mark.parametrize(
    "error, where",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB"), "GPU"),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                      "you tried to allocate 4194304000 bytes. Error code 12 (Cannot allocate memory)"), "CPU"),
    ],
)
def test_out_of_memory(monkeypatch, error, where):
    def oom(*args, **kwargs):
        raise error

    monkeypatch.setattr(training, "train_step", oom)
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(TINY)
    msg = str(e.value.code)
    assert f"out of {where} memory while training the tiny LLaMA with batch 2 x seq 32" in msg
    assert "AdamW state alone take 0.0 GiB" in msg
    assert "reduce --batch-size or --seq-len" in msg and "--use-custom-flce" in msg
    assert "\n" not in msg


def test_out_of_memory_under_ddp_suggests_fsdp():
    """A whole copy per process that runs out of memory: the line names --fsdp as well."""
    args = argparse.Namespace(tiny=True, model=None, batch_size=2, seq_len=32, use_custom_flce=True, ddp=True)
    with pytest.raises(SystemExit) as e, training.exit_on_oom(args, "training", torch.nn.Linear(4, 4)):
        raise torch.OutOfMemoryError("CUDA out of memory")
    msg = str(e.value.code)
    assert msg.endswith("reduce --batch-size or --seq-len, or shard the model with --fsdp instead of --ddp (a whole "
                        "copy on every GPU)") and "\n" not in msg


def test_out_of_memory_under_lora_counts_the_frozen_weights_apart(monkeypatch):
    """LoRA's frozen base has no gradient and no AdamW state: the message says what the run holds."""
    monkeypatch.setattr(training, "train_step", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("OOM")))
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main([*TINY, "--lora"])
    msg = str(e.value.code)
    assert "the frozen weights alone take 0.0 GiB, the trained ones with their gradients and AdamW state 0.0" in msg
    assert "weights, gradients and AdamW state alone" not in msg


def test_a_model_that_cannot_fit_in_host_memory_is_refused_before_loading(monkeypatch):
    """On a CPU, the 8B architecture (random init, no download) needs more than this machine
    has: refused with the estimate before a parameter is allocated."""
    if torch.cuda.is_available():
        pytest.skip("the host-memory check is for CPU runs")
    monkeypatch.setattr(models, "available_ram", lambda: 8 * 2**30)  # an 8 GiB laptop
    monkeypatch.setattr(models, "build_random", lambda *a: pytest.fail("the model was built"))
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(["--no-tiny", "--random-init", "--dataset", "synthetic", "--seq-len", "64"])
    msg = str(e.value.code)
    assert re.match(r"error: this run needs at least 1\d\d\.\d GiB of host memory \(weights 29\.9 GiB, gradients "
                    r"and AdamW state 89\.\d GiB, .*\) and 8\.0 GiB is available on this CPU; use --tiny", msg), msg


def test_other_runtime_errors_are_not_called_out_of_memory(monkeypatch):
    def bug(*args, **kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(training, "train_step", bug)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        finetune_baseline.main(TINY)


@pytest.fixture
def gpt2_dir(tmp_path):
    """A local model directory with a config only (GPT-2: LayerNorm, no RMSNorm)."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512, n_positions=64, bos_token_id=0,
               eos_token_id=0).save_pretrained(tmp_path)
    return str(tmp_path)


def test_no_rmsnorm_modules(gpt2_dir, capsys):
    # Asked for on the command line: a kernel that cannot go in ends the run in one line.
    with pytest.raises(SystemExit) as e:
        finetune_optimized.main(["--model", gpt2_dir, "--dataset", "synthetic", "--seq-len", "16", "--steps", "1",
                                 "--use-custom-rmsnorm"])
    assert e.value.code == ("error: --use-custom-rmsnorm: found no RMSNorm modules to replace in GPT2LMHeadModel (it "
                            "looks for modules named *RMSNorm with a weight and variance_epsilon (LLaMA) or eps "
                            "(Gemma)); run with --no-use-custom-rmsnorm")
    # On the way it said, in one line, why the weights were not loaded.
    assert f"Could not load weights for {gpt2_dir}: OSError" in capsys.readouterr().out


def test_kernels_left_at_their_defaults_go_in_where_they_apply(gpt2_dir, capsys):
    """GPT-2 has no RMSNorm, gated MLP, RoPE or decoder layers of the residual kernel's form,
    and drops attention probabilities: with no --use-custom-* flag those stay PyTorch's, each
    said in one line, and the run trains with the rest, as the baseline does."""
    argv = ["--model", gpt2_dir, "--random-init", "--dataset", "synthetic", "--batch-size", "2", "--seq-len", "16",
            "--steps", "2", "--warmup-steps", "0"]
    ours = finetune_optimized.main(argv)
    out = capsys.readouterr().out
    for kernel in ("rmsnorm", "residual", "swiglu", "rope"):
        assert f"{run.LABELS[kernel]:<14} left to PyTorch: " in out, kernel
        assert ours["kernels"][kernel] is False, kernel
    assert ours["kernels"]["flce"] is True and "Kernels:       flce, adamw\n" in out
    base = finetune_baseline.main(argv)
    assert_same_losses(base["losses"], ours["losses"])


def test_packed_rows_keep_their_documents_apart_where_the_attention_kernel_cannot_go_in(gpt2_dir, capsys,
                                                                                          monkeypatch):
    """Packed real data plans rows for the attention kernel (no mask: it reads the documents
    from the position ids). GPT-2's attention drops probabilities, which the kernel refuses,
    so the rows must carry the dense [B, 1, T, T] mask after all (transformers 5 also splits
    rows by their position ids where a model builds its mask with its masking utilities; a
    model of its own code, Bloom, would not): every batch has it, and the losses are the
    baseline's packed ones."""
    masks = []
    real = dataloader.block_causal_mask
    monkeypatch.setattr(dataloader, "block_causal_mask", lambda *a: masks.append(1) or real(*a))
    argv = ["--model", gpt2_dir, "--random-init", "--batch-size", "2", "--seq-len", "64", "--steps", "2",
            "--warmup-steps", "0", "--packing", "--num-workers", "0"]  # batches built here, where the spy is
    ours = finetune_optimized.main(argv)
    assert "Custom attn:   left to PyTorch: GPT2LMHeadModel's attention drops" in capsys.readouterr().out
    assert ours["kernels"]["attention"] is False and ours["kernels"]["flce"] is True
    assert len(masks) >= 3, "the batches carry no dense mask"  # the check of the model's forward, 2 batches
    base = finetune_baseline.main(argv)
    assert_same_losses(base["losses"], ours["losses"])


def test_missing_path_and_unknown_id():
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(["--model", "/no/such/dir/model", "--steps", "1"])
    assert "no such file or directory" in str(e.value.code)
    start = time.time()
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(["--model", "nobody-xyz/no-such-model-xyz", "--steps", "1"])
    assert "its architecture is unknown" in str(e.value.code)
    # The cache is asked first without the network, then the hub once with a short timeout
    # (models.HUB_TIMEOUT_S): not transformers' retries (~23 s when the hub is unreachable).
    assert time.time() - start < 15, "a failing hub lookup must not hang"


def test_no_traceback_from_the_command_line():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "finetune_baseline.py"), "--tiny", "--seq-len", "99999"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "error: --seq-len 99999 is longer than the model's maximum of 2048 positions" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------
# The default model without the hub: bundled config, quickly
# --------------------------------------------------------------------------------
def test_bundled_config_is_llama31_8b():
    config = models.llama31_8b_config()
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (4096, 14336, 32)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (32, 8, 128256)
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["rope_theta"] == 500000.0
    assert config.max_position_embeddings == 131072 and config.tie_word_embeddings is False


def test_bundled_config_of_llama31_70b(tmp_path):
    """The 70B architecture (the FSDP step's large model), by hub id or a local folder's name."""
    config = models.config_for("meta-llama/Llama-3.1-70B")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (8192, 28672, 80)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (64, 8, 128)
    assert config.rope_parameters == models.llama31_8b_config().rope_parameters
    with torch.device("meta"):
        n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert abs(n / 1e9 - 70.55) < 0.01, n  # Llama-3.1-70B: 70.55 B parameters
    assert models.bundled_config(str(tmp_path / "Meta-Llama-3.1-70B")) is models.llama31_70b_config
    assert models.bundled_config("someone/Llama-3.1-70B-Instruct-fork") is None


def test_default_model_falls_back_to_random_weights(monkeypatch, capsys):
    """Weights unavailable -> one line with the reason, then the 8B architecture.

    Built on the meta device (no memory) and with downloads blocked, so the test
    never fetches 16 GB even on a machine with hub access.
    """
    real_build = models.build_random

    def no_download(model_id, device, dtype, **kwargs):
        if not kwargs.get("local_files_only"):
            raise OSError("download blocked by the test")
        raise OSError("not in the local cache")

    monkeypatch.setattr(models, "_from_pretrained", no_download)
    def build_on_meta(config, device, dtype):
        return real_build(config, torch.device("meta"), dtype)  # shapes only, no memory

    monkeypatch.setattr(models, "build_random", build_on_meta)
    monkeypatch.setattr(models, "check_fits_in_ram", lambda *a: None)  # built on the meta device: no RAM needed
    args = flags.settle(finetune_baseline.parse_args(["--no-tiny", "--seq-len", "16"]))
    start = time.time()
    model, info = models.load_model(args)
    assert time.time() - start < 30
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("Could not load weights")]
    assert len(lines) == 1 and "Continuing with random weights in the same architecture" in lines[0]
    assert info["parameters"] == 8_030_261_248
    assert info["source"] == "random init (weights unavailable)"


def test_tiny_is_the_default_without_gpu():
    args = flags.settle(finetune_baseline.parse_args([]))
    on_gpu = torch.cuda.is_available()
    assert args.tiny is (not on_gpu)
    # Without a GPU the default run is short: it ends within a minute on a laptop.
    assert args.seq_len == (2048 if on_gpu else flags.CPU_TINY_SEQ_LEN)
    assert (args.steps, args.warmup_steps) == ((20, flags.GPU_WARMUP_STEPS) if on_gpu
                                               else (flags.CPU_STEPS, flags.CPU_WARMUP_STEPS))
    explicit = flags.settle(finetune_baseline.parse_args(["--tiny", "--steps", "3", "--seq-len", "8"]))
    assert (explicit.steps, explicit.seq_len) == (3, 8)


def test_random_init_from_a_local_config(tmp_path, capsys):
    models.tiny_config().save_pretrained(tmp_path)
    finetune_baseline.main(["--model", str(tmp_path), "--random-init", "--dataset", "synthetic", "--seq-len", "16",
                            "--steps", "1", "--warmup-steps", "0"])
    assert f"Model:         {tmp_path} [LlamaForCausalLM], random init (--random-init)" in capsys.readouterr().out


def test_hub_check_is_quick():
    start = time.time()
    problem = models.hub_problem(flags.DEFAULT_MODEL)
    assert problem is None or isinstance(problem, str)
    assert time.time() - start < 30


# --------------------------------------------------------------------------------
# Layers: the workload modules import no kernel
# --------------------------------------------------------------------------------
# The shared workload, one concern per file; the scripts compose it.
WORKLOAD = ("files", "flags", "models", "ddp", "fsdp", "dataloader", "checkpoints", "cuda_graphs", "reporting", "training")


def imported_modules(path):
    """Every module name an ``import`` or ``from ... import`` statement of ``path`` names."""
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "kernel_ft":  # from kernel_ft import flags: the module kernel_ft.flags
                names.update(f"kernel_ft.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", WORKLOAD)
def test_workload_imports_no_kernel(module):
    names = imported_modules(os.path.join(ROOT, "kernel_ft", f"{module}.py"))
    kernels = sorted(n for n in names if n.split(".")[0].endswith("_kernel") or n == "kernel_ft.patching")
    assert kernels == [], f"{module} imports {kernels}; kernels are switched in by finetune_optimized.py"
    if "torch" in names:
        assert "kernel_common" in names  # the interpreter switch (not a kernel) comes before torch and triton
    assert "finetune_optimized" not in names and "finetune_baseline" not in names  # no arrow points up
    # Arrows point one way: a module imports only those listed before it.
    later = {f"kernel_ft.{m}" for m in WORKLOAD[WORKLOAD.index(module):]}
    assert not names & later, f"{module} imports {sorted(names & later)}, which come after it in {WORKLOAD}"


def test_baseline_imports_no_kernel():
    # The plain baseline shows the HF loop; it reaches the kernels only through a flag.
    top_level = {n for n in imported_modules(os.path.join(ROOT, "finetune_baseline.py"))}
    assert not any(n.endswith("_kernel") for n in top_level)


# --------------------------------------------------------------------------------
# Outputs: checked before the work, written whole and strict; Ctrl-C keeps the steps
# --------------------------------------------------------------------------------
def no_training(monkeypatch):
    """Make any training step fail the test: a check must stop the run before it."""
    def forbidden(*args, **kwargs):
        raise AssertionError("training started before the output path was checked")

    monkeypatch.setattr(models, "load_model", forbidden)
    monkeypatch.setattr(training, "train_step", forbidden)


@pytest.mark.parametrize("where, message", [
    ("missing/out.json", "directory {parent} does not exist"),
    (".", "is a directory, expected a file path"),
])
def test_bad_json_path_fails_before_training(tmp_path, monkeypatch, capsys, where, message):
    no_training(monkeypatch)
    path = tmp_path / where
    with pytest.raises(SystemExit) as e:
        finetune_optimized.main(TINY + ["--json", str(path)])
    msg = str(e.value.code)
    assert msg.startswith("error: --json ") and "\n" not in msg
    assert message.format(parent=tmp_path / "missing") in msg
    assert "Model:" not in capsys.readouterr().out  # nothing was built


def test_outputs_never_touch_inputs(tmp_path, monkeypatch):
    no_training(monkeypatch)
    data = tmp_path / "my.jsonl"
    data.write_text('{"instruction": "Say yes.", "response": "yes"}\n')
    before = data.read_bytes()
    model_dir = tmp_path / "model"
    models.tiny_config().save_pretrained(model_dir)
    user_file = tmp_path / "notes.json"
    user_file.write_text('{"mine": true}')
    checkpoint = tmp_path / "run" / "checkpoint-1"  # its files carry the mark, and still are no output's
    checkpoint.mkdir(parents=True)
    files.write_json_atomic(str(checkpoint / "manifest.json"), {"files": {}})
    files.write_json_atomic(str(checkpoint / "trainer_state.json"), {"step": 1})
    cases = [
        (["--dataset", str(data), "--json", str(data)], f"--json {data}: is the --dataset input {data}"),
        (["--dataset", str(data), "--json", str(tmp_path / "out.txt")], "expected a .json file"),
        (["--json", str(user_file)], f"--json {user_file}: exists and was not written by this project"),
        (["--model", str(model_dir), "--no-tiny", "--json", str(model_dir / "r.json")],
         f"is inside the --model input {model_dir}"),
        (["--model", str(model_dir), "--no-tiny", "--output-dir", str(model_dir)],
         f"--output-dir {model_dir}: is the --model input {model_dir}"),
        (["--json", str(checkpoint / "trainer_state.json")], f"is inside the checkpoint {checkpoint}"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            finetune_baseline.main(TINY + argv)
        assert message in str(e.value.code) and "\n" not in str(e.value.code), (argv, e.value.code)
    assert data.read_bytes() == before and user_file.read_text() == '{"mine": true}'
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json"]
    # A file this project wrote is replaced by the next run.
    files.write_json_atomic(str(tmp_path / "ours.json"), {"losses": []})
    assert files.written_here(str(tmp_path / "ours.json")) and not files.written_here(str(user_file))


@pytest.mark.parametrize("config, message", [
    ("bert", "not a causal decoder (the output at a position depends on the tokens after it)"),
    ("t5", "a t5 model is not a causal decoder (transformers has no causal-LM class for it)"),
])
@pytest.mark.parametrize("script", [finetune_baseline, finetune_optimized])
def test_only_causal_decoders_are_trained(script, config, message, tmp_path, monkeypatch):
    monkeypatch.setattr(training, "train_step", lambda *a, **k: pytest.fail("trained a model that is no decoder"))
    small = dict(vocab_size=512, num_layers=2, num_heads=4, d_model=64, d_ff=128, d_kv=16) if config == "t5" else \
        dict(vocab_size=512, num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128)
    transformers.AutoConfig.for_model(config, **small).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as e:
        script.main(["--model", str(tmp_path), "--random-init", "--dataset", "synthetic", "--seq-len", "16"])
    assert e.value.code == f"error: --model {tmp_path}: {message}; only decoder language models are fine-tuned here"


SMALL_DECODER = dict(vocab_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                     intermediate_size=128)


@pytest.mark.parametrize("family, scaling, off", [
    ("granite", {"logits_scaling": 4.0}, []),  # logits / 4
    # logits * 0.5; its norm is a LayerNorm and its RoPE turns interleaved pairs (both refused, see below)
    ("cohere", {"logit_scale": 0.5}, ["--no-use-custom-rmsnorm", "--no-use-custom-rope"]),
])
def test_families_that_scale_their_logits_train_like_the_baseline(family, scaling, off, tmp_path):
    transformers.AutoConfig.for_model(family, **SMALL_DECODER, **scaling).save_pretrained(tmp_path / "model")
    argv = ["--model", str(tmp_path / "model"), "--random-init", "--dataset", "synthetic", "--batch-size", "2",
            "--seq-len", "32", "--steps", "3", "--warmup-steps", "0"]
    base = finetune_baseline.main(argv)
    ours = finetune_optimized.main(argv + off)
    assert ours["kernels"]["flce"] and len(ours["losses"]) == len(base["losses"]) == 3
    assert_same_losses(base["losses"], ours["losses"])


def test_a_family_without_sdpa_trains_and_packing_it_cannot_take_is_refused_in_one_line(tmp_path):
    """Bloom has no SDPA attention (transformers refuses to build it with "sdpa" asked by
    name: the scripts let transformers choose) and builds ALiBi from a [B, T] mask, so the
    dense [B, 1, T, T] mask of packed rows fails inside its forward: refused in one line
    before training. Padded rows train, with the baseline's losses."""
    transformers.AutoConfig.for_model("bloom", vocab_size=512, n_layer=2, n_head=4,
                                      hidden_size=64).save_pretrained(tmp_path / "model")
    argv = ["--model", str(tmp_path / "model"), "--random-init", "--batch-size", "2", "--seq-len", "64", "--steps",
            "2", "--warmup-steps", "0"]
    for script in (finetune_baseline, finetune_optimized):
        with pytest.raises(SystemExit) as e:
            script.main(argv + ["--packing"])
        message = str(e.value.code)  # the error inside Bloom's code is transformers' own
        assert message.startswith("error: --packing: BloomForCausalLM does not take the packed rows' [B, 1, T, T] "
                                  "mask (") and message.endswith("); use --no-packing") and "\n" not in message
    base, ours = finetune_baseline.main(argv + ["--no-packing"]), finetune_optimized.main(argv + ["--no-packing"])
    assert ours["kernels"]["flce"] is True
    assert_same_losses(base["losses"], ours["losses"])


def test_a_rope_that_turns_other_pairs_is_refused(tmp_path, monkeypatch):
    # Cohere's apply_rotary_pos_emb rotates (x0, x1), (x2, x3), ...: swapping in ours
    # would change the model, though a tiny random one trains almost alike.
    transformers.AutoConfig.for_model("cohere", **SMALL_DECODER).save_pretrained(tmp_path)
    monkeypatch.setattr(training, "train_step", lambda *a, **k: pytest.fail("trained with another RoPE"))
    with pytest.raises(SystemExit) as e:
        finetune_optimized.main(["--model", str(tmp_path), "--random-init", "--dataset", "synthetic", "--seq-len", "16",
                                 "--use-custom-rope"])
    assert e.value.code == ("error: --use-custom-rope: transformers.models.cohere.modeling_cohere.apply_rotary_pos_emb "
                            "computes another rotation than the fused RoPE (x * cos + rotate_half(x) * sin on the "
                            "first 16 of 16 dims); run with --no-use-custom-rope")


@pytest.mark.parametrize("script", [finetune_baseline, finetune_optimized])
@pytest.mark.parametrize("host_memory", ["known", "unknown"])
def test_a_config_whose_pad_token_is_past_its_vocabulary_is_refused_in_one_line(script, host_memory, tmp_path,
                                                                                 monkeypatch):
    # Phi3Config's own default pad_token_id (32000) with a small vocabulary: the embedding
    # cannot be built (torch asserts), so the run ends in one line, not a traceback. With
    # the host's memory unknown no memory check builds the model on the meta device
    # first: the path of every GPU run.
    if host_memory == "unknown":
        monkeypatch.setattr(models, "available_ram", lambda field="MemAvailable": None)
    transformers.AutoConfig.for_model("phi3", **SMALL_DECODER).save_pretrained(tmp_path)
    monkeypatch.setattr(training, "train_step", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(SystemExit) as e:
        script.main(["--model", str(tmp_path), "--random-init", "--dataset", "synthetic", "--seq-len", "16"])
    vocab = SMALL_DECODER["vocab_size"]
    assert e.value.code == (f"error: the model's config has pad_token_id 32000, outside its vocabulary of {vocab} "
                            f"tokens; set pad_token_id in its config.json to a token id below {vocab}, or to null")


def test_partial_rotary_trains_like_the_baseline(tmp_path):
    # Phi-3 with partial_rotary_factor 0.5: the first half of each head turns. Its
    # MLP is one fused gate_up_proj, which the SwiGLU swap does not take.
    config = transformers.AutoConfig.for_model("phi3", **SMALL_DECODER, partial_rotary_factor=0.5, pad_token_id=0)
    config.save_pretrained(tmp_path / "model")
    argv = ["--model", str(tmp_path / "model"), "--random-init", "--dataset", "synthetic", "--batch-size", "2",
            "--seq-len", "32", "--steps", "2", "--warmup-steps", "0"]
    base = finetune_baseline.main(argv)
    ours = finetune_optimized.main(argv + ["--no-use-custom-swiglu"])
    assert ours["kernels"]["rope"] and ours["kernels"]["rmsnorm"] and ours["kernels"]["flce"]
    assert_same_losses(base["losses"], ours["losses"])


def test_a_logit_transform_the_fused_loss_does_not_know_is_refused(tmp_path, monkeypatch):
    transformers.AutoConfig.for_model("granite", **SMALL_DECODER, logits_scaling=4.0).save_pretrained(tmp_path)
    monkeypatch.setattr(linear_cross_entropy_kernel, "logit_multiplier", lambda config: 1.0)  # as if unknown
    monkeypatch.setattr(training, "train_step", lambda *a, **k: pytest.fail("trained with the wrong loss"))
    with pytest.raises(SystemExit) as e:
        finetune_optimized.main(["--model", str(tmp_path), "--random-init", "--dataset", "synthetic", "--seq-len", "16",
                                 "--use-custom-flce"])
    assert e.value.code == ("error: --use-custom-flce: GraniteForCausalLM transforms its logits after the LM head in "
                            "a way the fused loss does not implement; run with --no-use-custom-flce")


def test_unwritable_json_directory(tmp_path, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    no_training(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(SystemExit) as e:
            finetune_baseline.main(TINY + ["--json", str(locked / "out.json")])
    finally:
        locked.chmod(0o700)
    assert "cannot write in" in str(e.value.code)


def strict_loads(text):
    """json.loads that rejects NaN / Infinity, as most JSON readers do."""
    def reject(constant):
        raise ValueError(f"bare {constant} in the JSON")

    return json.loads(text, parse_constant=reject)


def nan_on_step(monkeypatch, bad_step):
    """Make step ``bad_step``'s loss (and so its gradients) NaN, as a diverging run's."""
    real_step = training.train_step
    calls = []

    def step(model, optimizer, loss_fn, *args, **kwargs):
        calls.append(1)
        nan = float("nan") if len(calls) == bad_step else 1.0
        return real_step(model, optimizer, lambda m, batch: loss_fn(m, batch) * nan, *args, **kwargs)

    monkeypatch.setattr(training, "train_step", step)


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    nan_on_step(monkeypatch, 3)
    path = tmp_path / "nan.json"
    files.write_json_atomic(str(path), {"old": True})  # an earlier run's file: replaced whole
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(TINY + ["--json", str(path), "--output-dir", str(tmp_path / "out"), "--save-every", "1"])
    msg = str(e.value.code)
    assert msg.startswith("error: step 3: loss nan, gradient norm nan: training diverged and stopped (3 of 4 steps "
                          "completed") and "\n" not in msg
    assert f"the last checkpoint, {tmp_path / 'out' / 'checkpoint-2'}, stays" in msg
    doc = strict_loads(path.read_text())  # NaN written as null
    assert doc["losses"][2] is None and doc["steps"][2]["loss"] is None
    assert all(isinstance(x, float) for x in doc["losses"][:2])
    assert doc["partial"] is True and doc["diverged_at_step"] == 3
    assert doc["stop_reason"] == "non-finite loss or gradient"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-1", "checkpoint-2", flags.LOSS_CURVE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.json", "out"]  # no temporary file left


def test_a_checkpoint_that_cannot_be_written_ends_in_one_line(tmp_path, monkeypatch):
    """A full disk while checkpoint-4 is written (the optimizer's file fails half-way, as
    torch.save does on ENOSPC): one line naming the checkpoint, the cause, the room left
    and the last whole checkpoint; the half-written folder is removed, checkpoint-2 stays
    whole and resumable. A bug inside the save is not hidden behind that line."""
    real_save, out = torch.save, tmp_path / "out"

    def full_disk_at_step_4(obj, path, *args, **kwargs):
        if "checkpoint-4.tmp" in str(path):
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoints.torch, "save", full_disk_at_step_4)
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(TINY + ["--output-dir", str(out), "--save-every", "2"])
    msg = str(e.value.code)
    assert msg.startswith(f"error: checkpoint-4 could not be written into --output-dir {out} (OSError: [Errno 28] No "
                          f"space left on device: ") and "\n" not in msg
    assert (f"GB are free on its disk once the half-written folder is removed; the last checkpoint, "
            f"{out / 'checkpoint-2'} (") in msg
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]
    assert checkpoints.damage(str(out / "checkpoint-2")) is None

    def a_bug(obj, path, *args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(checkpoints.torch, "save", a_bug)
    with pytest.raises(ValueError, match="a bug"):
        finetune_baseline.main(TINY + ["--output-dir", str(tmp_path / "bug"), "--save-every", "2"])


def test_a_learning_rate_that_diverges_stops_the_run():
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(TINY + ["--lr", "1e30", "--steps", "6", "--warmup-steps", "0"])
    # The gradient norm overflows first (step 2 here), the loss after it.
    assert re.match(r"^error: step \d: loss \S+, gradient norm (nan|inf): training diverged and stopped", e.value.code)


def test_skip_nonfinite_steps_updates_nothing_and_goes_on(tmp_path, monkeypatch):
    nan_on_step(monkeypatch, 3)
    path = tmp_path / "skip.json"
    finetune_baseline.main(TINY + ["--json", str(path), "--skip-nonfinite-steps"])
    skipped = strict_loads(path.read_text())
    assert skipped["partial"] is False and skipped["skipped_steps"] == [3] and skipped["steps"][2]["skipped"]
    assert skipped["losses"][2] is None and skipped["steps"][2]["grad_norm"] is None
    assert all(math.isfinite(x) for x in skipped["losses"][3:])


def test_a_skipped_step_changes_nothing():
    torch.manual_seed(0)
    model = models.build_random(models.tiny_config(), torch.device("cpu"), torch.float32)
    optimizer = training.pytorch_adamw(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    batch = dataloader.lm_batch(torch.randint(0, model.config.vocab_size, (2, 16)))
    training.train_step(model, optimizer, training.hf_loss, [batch], scheduler, 1.0, skip_nonfinite=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    lr = optimizer.param_groups[0]["lr"]

    def nan_loss(m, b):
        return training.hf_loss(m, b) * float("nan")

    loss, norm = training.train_step(model, optimizer, nan_loss, [batch], scheduler, 1.0, skip_nonfinite=True)
    assert math.isnan(loss.item()) and not training.step_is_finite(loss.item(), norm.item())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(state[k], v) for k, v in optimizer.state_dict()["state"][0].items())
    assert optimizer.param_groups[0]["lr"] == lr  # the schedule did not advance
    assert all(p.grad is None for p in model.parameters())
    # Without the flag the same step is made, with NaN gradients: the weights are lost.
    training.train_step(model, optimizer, nan_loss, [batch], scheduler, 1.0)
    assert any(v.isnan().any() for v in model.state_dict().values())


def test_strict_json_helpers(tmp_path):
    doc = {"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": {"d": (2, float("nan"))}}
    assert files.strict_json(doc) == {"a": None, "b": [None, None, 1.5], "c": {"d": [2, None]}}
    path = tmp_path / "x.json"
    files.write_json_atomic(str(path), doc)
    assert strict_loads(path.read_text())["b"] == [None, None, 1.5]
    # A document that cannot be written leaves the old file and no temporary file.
    path.write_text('{"old": true}')
    with pytest.raises(TypeError):
        files.write_json_atomic(str(path), {"bad": object()})
    assert json.loads(path.read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_ctrl_c_writes_the_completed_steps(tmp_path, monkeypatch, capsys):
    real_step = training.train_step
    calls = []

    def interrupt_on_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(training, "train_step", interrupt_on_step_3)
    path = tmp_path / "partial.json"
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(TINY + ["--json", str(path)])
    assert e.value.code == 130
    doc = strict_loads(path.read_text())
    assert doc["partial"] is True and doc["planned_steps"] == 4
    assert len(doc["losses"]) == len(doc["steps"]) == 2 and doc["timed_steps"] == 1
    assert doc["tokens_per_sec"] > 0 and doc["peak_memory_bytes"] > 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("Interrupted")]
    assert lines == [f"Interrupted (SIGINT): 2 of 4 steps completed, wrote them to {path} (marked partial)"]
    assert "Average throughput" not in out  # no results block for a partial run


def test_ctrl_c_before_any_timed_step(monkeypatch, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "train_step", interrupt)
    with pytest.raises(SystemExit) as e:
        finetune_baseline.main(TINY)
    assert e.value.code == 130
    assert "Interrupted (SIGINT): 0 of 4 steps completed, not written (no --json)" in capsys.readouterr().out


def test_estimate_printed_for_a_long_run(monkeypatch, capsys):
    monkeypatch.setattr(reporting, "LONG_RUN_S", 0.0)  # every run is "long"
    finetune_baseline.main(TINY)
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("Estimate:")]
    assert "for the remaining 3 steps" in line
    assert out.index("step    1/4") < out.index("Estimate:") < out.index("step    2/4")
    monkeypatch.setattr(reporting, "LONG_RUN_S", 120.0)
    reporting.print_estimate(1.0, 10)  # 10 s left: nothing to say
    assert capsys.readouterr().out == ""
    reporting.print_estimate(30.0, 20)
    assert "up to 10 min for the remaining 20 steps" in capsys.readouterr().out


# --------------------------------------------------------------------------------
# Conflicting flags: what was overridden is printed
# --------------------------------------------------------------------------------
def test_tiny_overrides_model(capsys, monkeypatch):
    monkeypatch.setattr(models, "try_pretrained", lambda *a: pytest.fail("--tiny must not load weights"))
    parsed = finetune_baseline.parse_args(["--tiny", "--model", "some/model"])
    args = flags.settle(parsed)
    assert args.tiny is True and parsed.seq_len is None  # the parsed flags stay as parsed
    assert capsys.readouterr().out == ""  # the notes wait for the banner
    flags.print_notes(args)
    assert "Note:          --tiny overrides --model some/model" in capsys.readouterr().out
    assert flags.settle(args) is args  # settled once
    with pytest.raises(AttributeError, match=r"settings.seq_len: a run's flags are fixed .* \.but\(seq_len=...\)"):
        args.seq_len = 64
    shorter = args.but(seq_len=64)
    assert (shorter.seq_len, args.seq_len, shorter._notes) == (64, flags.CPU_TINY_SEQ_LEN, args._notes)
    assert "_notes" not in flags.public_config(args)
    with pytest.raises(TypeError, match="models.load_model reads the flags flags.settle"):
        models.load_model(parsed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the override happens without a GPU")
def test_random_init_on_cpu_is_reported(capsys):
    args = flags.settle(finetune_baseline.parse_args(["--random-init"]))
    assert args.tiny is True
    flags.print_notes(args)
    out = capsys.readouterr().out
    assert "no GPU, so --tiny is on and --random-init changes nothing" in out
    assert "--no-tiny --random-init" in out
    assert flags.settle(finetune_baseline.parse_args(["--tiny", "--random-init"]))._notes == ()  # asked for --tiny: nothing was overridden


# --------------------------------------------------------------------------------
# tools/max_seq_len.py
# --------------------------------------------------------------------------------
def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_max_seq_len_needs_a_gpu(capsys):
    tool = load_tool("max_seq_len")
    assert tool.__doc__ and "Usage:" in tool.__doc__
    with pytest.raises(SystemExit) as e:
        tool.main(["--random-init", "--all-kernels"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err


def test_max_seq_len_checks_its_output_first(tmp_path, monkeypatch):
    tool = load_tool("max_seq_len")
    monkeypatch.setattr(tool.torch.cuda, "is_available", lambda: True)  # get past the GPU check
    monkeypatch.setattr(tool.run.models, "load_model", lambda *a: pytest.fail("built a model before the check"))
    with pytest.raises(SystemExit) as e:
        tool.main(["--json", str(tmp_path / "missing" / "maxseq.json")])
    assert str(e.value.code).startswith("error: --json ") and "does not exist" in str(e.value.code)


@pytest.mark.parametrize("extra", [[], ["--lora", "--lora-r", "8"], ["--no-use-custom-attention"]],
                         ids=["full", "lora", "sdpa"])
def test_max_seq_len_settles_its_flags_and_loads_the_model(monkeypatch, extra):
    """Its flags pass the fine-tune scripts' checks (LoRA's included) up to the model's load;
    --all-kernels switches on every kernel not switched off by name."""
    tool = load_tool("max_seq_len")
    env = tool.reporting.environment_info()  # this machine's, before it claims a GPU below
    monkeypatch.setattr(tool.reporting, "environment_info", lambda: env)
    monkeypatch.setattr(tool.torch.cuda, "is_available", lambda: True)  # get past the GPU check
    loaded = []

    def load_model(args, world=None):
        loaded.append(args)
        raise SystemExit("loaded")

    monkeypatch.setattr(tool.run.models, "load_model", load_model)
    with pytest.raises(SystemExit, match="loaded"):
        tool.main(["--random-init", "--all-kernels", *extra])
    args = loaded[0]
    assert args.batch_size == 1 and args.lora == ("--lora" in extra) and args.use_custom_rmsnorm
    assert args.use_custom_attention == ("--no-use-custom-attention" not in extra) and args.use_custom_lora

