"""
--fsdp (FSDP2 under torchrun) on the CPU: two processes with the gloo backend.

* N processes x --batch-size B train exactly as one process with --batch-size
  N x B: the same losses (float32, within 1e-4), with every kernel on
  (RMSNorm, SwiGLU, RoPE, the fused linear cross-entropy, the Triton AdamW on the
  local shards) and with the plain baseline on packed real data.
* A sharded (DCP) checkpoint resumes with the losses of the uninterrupted run.
* A model built on the meta device is materialized shard by shard and trains.
* Bad input: --fsdp without torchrun, torchrun without --fsdp, resuming with
  another number of processes: one line each, before any work.

The Triton kernels run in the interpreter: tiny shapes, few steps.
"""

import json
import os
import subprocess
import sys

import pytest

import llama_common as common  # first: the Triton interpreter switch
import finetune_optimized

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ["--tiny", "--dataset", "synthetic", "--warmup-steps", "0", "--seq-len", "16"]


def run(script, args, ranks=None, tmp_path=None, name="run"):
    """Run ``script`` (under torchrun with ``ranks`` processes, with --fsdp) and
    return its --json document."""
    out = os.path.join(tmp_path, f"{name}.json")
    command = [sys.executable, os.path.join(HERE, script), *args, "--json", out]
    if ranks:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   os.path.join(HERE, script), "--fsdp", *args, "--json", out]
    env = {k: v for k, v in os.environ.items() if k not in common.TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def close(a, b, tol=1e-4):
    assert len(a) == len(b), (a, b)
    assert all(abs(x - y) <= tol for x, y in zip(a, b)), (a, b)


def test_two_ranks_match_one_process_every_kernel_and_resume(tmp_path):
    ckpt = tmp_path / "run"
    args = [*TINY, "--steps", "3", "--batch-size", "1"]
    sharded = run("finetune_optimized.py", [*args, "--output-dir", str(ckpt), "--save-every", "2"], 2, tmp_path, "fsdp")
    one = run("finetune_optimized.py", [*TINY, "--steps", "3", "--batch-size", "2"], None, tmp_path, "one")
    close(sharded["losses"], one["losses"])
    assert sharded["world_size"] == 2 and sharded["kernels"] == dict.fromkeys(common.KERNELS, True)
    assert sharded["tokens_per_sec_per_gpu"] == pytest.approx(sharded["tokens_per_sec"] / 2)
    assert sharded["tokens_per_step"] == one["tokens_per_step"] == 32  # the global batch
    assert sorted(os.listdir(ckpt / "checkpoint-2")) == ["rng_state_rank0.pt", "rng_state_rank1.pt",
                                                         "scheduler.pt", "sharded", common.TRAINER_STATE]

    resumed = run("finetune_optimized.py", [*args, "--resume", str(ckpt / "checkpoint-2"),
                                            "--output-dir", str(tmp_path / "again")], 2, tmp_path, "resumed")
    close(resumed["losses"], sharded["losses"][2:], tol=1e-6)

    # Another number of processes cannot use these shards (here: one, without --fsdp).
    with pytest.raises(SystemExit, match="written by --fsdp with 2 processes, this run is one process"):
        finetune_optimized.main([*args, "--resume", str(ckpt / "checkpoint-2"), "--output-dir", str(tmp_path / "x")])


def test_two_ranks_match_one_process_baseline_packed_data(tmp_path):
    args = ["--tiny", "--warmup-steps", "0", "--steps", "2", "--seq-len", "64", "--packing"]
    sharded = run("finetune_baseline.py", [*args, "--batch-size", "1"], 2, tmp_path, "fsdp")
    one = run("finetune_baseline.py", [*args, "--batch-size", "2"], None, tmp_path, "one")
    close(sharded["losses"], one["losses"])
    assert sharded["kernels"] == dict.fromkeys(common.KERNELS, False)


def test_meta_device_build_is_materialized_shard_by_shard(tmp_path):
    """A model that is not --tiny is built on the meta device under --fsdp: a small
    config given as a local --model stands in for LLaMA-3.1-8B."""
    common.tiny_config().save_pretrained(tmp_path / "model")
    doc = run("finetune_baseline.py", ["--no-tiny", "--random-init", "--model", str(tmp_path / "model"),
                                       "--dataset", "synthetic", "--warmup-steps", "0", "--steps", "2",
                                       "--seq-len", "16", "--batch-size", "1", "--lr", "1e-3"], 2, tmp_path)
    assert "meta device" in doc["model"]["source"]
    first = doc["losses"][0]  # HF's init: logits near 0, so the loss is near ln(vocab)
    assert abs(first - 9.01) < 0.5, doc["losses"]


def test_fsdp_without_torchrun_is_one_line(monkeypatch, capsys):
    for name in common.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="--fsdp runs under torchrun") as e:
        finetune_optimized.main(["--fsdp", *TINY, "--steps", "1"])
    assert "\n" not in str(e.value)
    assert "Model:" not in capsys.readouterr().out  # before any work


def test_torchrun_without_fsdp_is_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="2 processes but without --fsdp"):
        finetune_optimized.main([*TINY, "--steps", "1"])


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
