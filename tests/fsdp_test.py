"""
--fsdp (FSDP2 under torchrun) on the CPU: two processes with the gloo backend.

* N processes x --batch-size B train exactly as one process with --batch-size
  N x B: the same losses (float32, within 1e-4), with every kernel on
  (RMSNorm, SwiGLU, RoPE, the fused linear cross-entropy, the Triton AdamW on the
  local shards), with LoRA adapters (--lora: frozen weights and adapters sharded
  together, the optimizer on the adapters' shards), with each decoder layer
  compiled (--compile, aot_eager), with LoRA + checkpointing + compile at once,
  and with the plain baseline on packed real data.
* A sharded (DCP) checkpoint resumes with the losses of the uninterrupted run,
  also with --lora (whose shards hold the adapters only).
* tools/export_hf.py turns the shards into a save_pretrained folder in one
  process: the model (or with --lora the adapters) that the single-process run
  saved at the same step; its bad input is one line each.
* A model built on the meta device is materialized shard by shard and trains;
  with --lora its adapters get PEFT's initialization back (B zeros: the model
  starts as the base model), checked in this process on a one-process group.
* profile_baseline.py --fsdp profiles rank 0 (communication has its category).
* --fsdp-reduce-dtype auto picks bfloat16 over 2 processes of bf16 weights only; on
  2 GPUs (NCCL) the bfloat16 and float32 reductions give the same gradient bits.
* --ddp (a copy per process, each gradient averaged in place as backward makes it):
  every gradient the mean of the processes' own, bit for bit, one collective per
  group per step, --grad-accum communicating once; the same losses as one process,
  with LoRA and --compile; its checkpoints resume exactly. torchrun without --fsdp or
  --ddp picks one from memory.
* --ddp --ddp-shard-weights (the layers' weights whole only around their use): the same
  losses, evaluations and checkpoints as --ddp; it resumes exactly; its limits are one line.
* Bad input: --fsdp without torchrun, WORLD_SIZE without torchrun, --fsdp with
  --lora-4bit, resuming with another number of processes or mode: one line each,
  before any work.

The Triton kernels run in the interpreter: tiny shapes, few steps.
"""

if __name__ == "__main__":
    # `python tests/fsdp_test.py`: pytest runs this file. Its imports below need the
    # repository root on the path, which the root's conftest.py gives pytest.
    import sys

    import pytest

    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))


import argparse
import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from kernel_ft import flags  # first: the Triton interpreter switch
from conftest import narrow_tiny_config
import kernel_common
from kernel_ft import checkpoints, ddp, fsdp, models
from kernel_ft import run as run_module
import finetune_baseline
import finetune_optimized
from tools import export_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
TINY = ["--tiny", "--dataset", "synthetic", "--warmup-steps", "0", "--seq-len", "16"]
# What finetune_optimized.py's kernels come to on synthetic rows: every one but attention, which is
# on by default with packed real data only (a synthetic row is one document: SDPA's own causal
# case), and the cross-entropy on logits, which the fused loss supersedes.
EVERY_KERNEL = {**dict.fromkeys(flags.KERNELS, True), "attention": False, "ce": False}


def run(script, args, ranks=None, tmp_path=None, name="run", mode="--fsdp"):
    """Run ``script`` (under torchrun with ``ranks`` processes, with ``mode``: --fsdp,
    --ddp or None, the run's own choice) and return its --json document."""
    if ranks and torch.cuda.is_available() and torch.cuda.device_count() < ranks:
        pytest.skip(f"--fsdp on GPUs runs one process per GPU: {ranks} needed, {torch.cuda.device_count()} visible")
    out = os.path.join(tmp_path, f"{name}.json")
    command = [sys.executable, os.path.join(ROOT, script), *args, "--json", out]
    if ranks:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   os.path.join(ROOT, script), *([mode] if mode else []), *args, "--json", out]
    env = {k: v for k, v in os.environ.items() if k not in fsdp.TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def run_worker(worker, folder):
    """tests/WORKER FOLDER under torchrun, 2 processes (gloo on the CPU); it writes its reports there."""
    env = {k: v for k, v in os.environ.items() if k not in fsdp.TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.join(ROOT, "tests", worker), str(folder)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def close(a, b, tol=1e-4):
    assert len(a) == len(b), (a, b)
    assert all(abs(x - y) <= tol for x, y in zip(a, b)), (a, b)


def train_twice(tmp, extra):
    """One run, every kernel, 3 steps, twice: 2 processes x batch 1 (--fsdp) and one
    process x batch 2, each saving its checkpoints (step 2 and the end, step 3)."""
    args = [*TINY, "--steps", "3", *extra]
    sharded = run("finetune_optimized.py", [*args, "--batch-size", "1", "--output-dir", str(tmp / "fsdp"),
                                            "--save-every", "2"], 2, tmp, "fsdp")
    one = run("finetune_optimized.py", [*args, "--batch-size", "2", "--output-dir", str(tmp / "one")], None, tmp, "one")
    return sharded, one, tmp


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return train_twice(tmp_path_factory.mktemp("full"), [])


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return train_twice(tmp_path_factory.mktemp("lora"), ["--lora", "--lora-r", "4"])


def test_two_ranks_match_one_process_every_kernel_and_resume(full, tmp_path):
    sharded, one, tmp = full
    close(sharded["losses"], one["losses"])
    assert sharded["world_size"] == 2 and sharded["kernels"] == EVERY_KERNEL
    assert sharded["tokens_per_sec_per_gpu"] == pytest.approx(sharded["tokens_per_sec"] / 2)
    assert sharded["tokens_per_step"] == one["tokens_per_step"] == 32  # the global batch
    ckpt = tmp / "fsdp"
    assert sorted(os.listdir(ckpt / "checkpoint-2")) == [checkpoints.MANIFEST, "rng_state_rank0.pt",
                                                         "rng_state_rank1.pt", "scheduler.pt", "sharded",
                                                         checkpoints.TRAINER_STATE]

    args = [*TINY, "--steps", "3", "--batch-size", "1"]
    resumed = run("finetune_optimized.py", [*args, "--resume", str(ckpt / "checkpoint-2"),
                                            "--output-dir", str(tmp_path / "again")], 2, tmp_path, "resumed")
    close(resumed["losses"], sharded["losses"][2:], tol=1e-6)

    # Another number of processes cannot use these shards (here: one, without --fsdp).
    with pytest.raises(SystemExit, match="written by --fsdp with 2 processes, this run is one process"):
        finetune_optimized.main([*args, "--resume", str(ckpt / "checkpoint-2"), "--output-dir", str(tmp_path / "x")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="two 'hosts' on one machine would share its first GPU")
def test_two_nodes_through_a_rendezvous_match_one_process(full, tmp_path):
    """README Step 19's command for several hosts, with two "hosts" of one process each
    on this machine: torchrun's c10d rendezvous at one address gives each its rank; the
    run is the one of two processes on one host (and of one process at batch 2)."""
    import socket

    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "nodes.json"
    env = {k: v for k, v in os.environ.items() if k not in fsdp.TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-id", "two-nodes", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               os.path.join(ROOT, "finetune_optimized.py"), "--fsdp", *TINY, "--steps", "3", "--batch-size", "1",
               "--json", str(out)]
    nodes = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    doc = json.loads(out.read_text())
    _, one, _ = full
    assert doc["world_size"] == 2
    close(doc["losses"], one["losses"])


def test_ddp_two_ranks_match_one_process(full, lora, tmp_path):
    """--ddp: a whole copy of the model per process, the gradients averaged over the
    processes (ddp.GradientAverage); 2 x batch 1 gives the losses of one process at batch 2,
    every kernel, and with LoRA adapters. Rank 0 saves the model as one process does
    (with every process's random generators); the run resumes from it to the same
    losses, and only as --ddp with 2 processes. (Every gradient all-reduced: the pieces,
    --ddp-shard-optimizer, on by default, are tested below.)"""
    args = [*TINY, "--steps", "3", "--batch-size", "1", "--no-ddp-shard-optimizer"]
    saves = ["--output-dir", str(tmp_path / "ddp_ckpt"), "--save-every", "2"]
    replicated = run("finetune_optimized.py", [*args, *saves], 2, tmp_path, "ddp", mode="--ddp")
    _, one, _ = full
    close(replicated["losses"], one["losses"])
    assert replicated["world_size"] == 2 and replicated["kernels"] == EVERY_KERNEL
    assert replicated["tokens_per_step"] == one["tokens_per_step"] == 32  # the global batch
    ckpt = tmp_path / "ddp_ckpt" / "checkpoint-2"
    assert sorted(os.listdir(ckpt)) == sorted([checkpoints.MANIFEST, "config.json", "generation_config.json",
                                               "model.safetensors", "optimizer.pt", "rng_state_rank0.pt",
                                               "rng_state_rank1.pt", "scheduler.pt", checkpoints.TRAINER_STATE])
    resumed = run("finetune_optimized.py", [*args, "--resume", str(ckpt), "--output-dir", str(tmp_path / "again")],
                  2, tmp_path, "ddp_resumed", mode="--ddp")
    close(resumed["losses"], replicated["losses"][2:], tol=1e-6)
    with pytest.raises(SystemExit, match="written by --ddp with 2 processes, this run is one process"):
        finetune_optimized.main([*args, "--resume", str(ckpt), "--output-dir", str(tmp_path / "x")])
    # Without --ddp or --fsdp the run chooses: the tiny model fits many times, so --ddp.
    adapters = run("finetune_optimized.py", [*args[:-1], "--lora", "--lora-r", "4"], 2, tmp_path, "ddp_lora",
                   mode=None)
    _, one_lora, _ = lora
    close(adapters["losses"], one_lora["losses"])
    assert adapters["config"]["ddp"] and not adapters["config"]["fsdp"]
    assert adapters["config"]["parallel_choice"].startswith("torchrun started 2 processes without --fsdp or --ddp, "
                                                            "so --ddp: a whole copy per process (its frozen weights")


def test_ddp_averages_each_gradient_in_place_in_one_order(tmp_path):
    """--ddp's averages (ddp.GradientAverage, 2 gloo processes, tests/ddp_average_worker.py):
    every gradient is the mean of the two processes' own, bit for bit, with two
    micro-batches of which only the last backward communicates; a weight one process
    never used is averaged with its zero (also one rank 0 never made, last in the order),
    one only the first micro-batch made is averaged too; the large weight is a group
    alone, the small ones packed in the order rank 0's first backward made them, the same
    on both; a second gradient in one averaged backward is refused in one line."""
    run_worker("ddp_average_worker.py", tmp_path)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert reports[0]["groups"] == reports[1]["groups"]
    groups = reports[0]["groups"]
    assert ["big.weight"] in groups and ["small.0.weight"] in groups and sorted(sum(groups, [])) == sorted(
        ["big.weight", "big.bias", "small.0.weight", "small.0.bias", "small.2.weight", "small.2.bias", "extra",
         "late", "early"])
    assert any(len(g) > 1 for g in groups)  # small ones packed
    assert "late" in groups[-1]  # rank 0 never made it: the end of the order
    for r in reports:
        for step in r["steps"]:
            assert step["differ"] == [] and step["after_first_micro_batch"] == 0
            assert len(step["collectives"]) == len(groups)
        assert not r["frozen_grad"]
        assert r["refused"].startswith("--ddp: ")
        assert "received a second gradient in one averaged backward" in r["refused"]
        assert "\n" not in r["refused"]


def test_ddp_pieces_equal_one_process_alone(tmp_path):
    """--ddp-shard-optimizer (ddp.ShardedUpdate, 2 gloo processes, tests/ddp_pieces_worker.py):
    a tiny LLaMA whose matrices are all split into pieces (its norms whole) trains three steps
    as one process does at batch 2, gathering all during the optimizer step or one layer
    ahead (with the input embedding's gradient averaged over the rows of the step's ids
    only, --ddp-embedding-rows), and LoRA adapters split the same way (the model frozen): the same losses and
    gradient norms (each norm adds up both processes' pieces), and with --ddp-shard-weights
    (5 of 7 layers whose weights are whole only in use, through 3 slots handed out in shuffled
    order: a backward finds its weights in another slot than its forward did; leaving the
    saved-tensor notes out changes the clipped norms by up to 32%; one layer's MLP unused, so
    its weights get no gradient; again with checkpointing, each layer's forward run again in
    its backward from the weights gathered again; and runs where one process alone leaves an
    MLP unused, also in one micro-batch of two, which must not hang and must give the numbers
    of that MLP's output times 0), the same weights, the same on
    both processes; AdamW's moments hold a piece each; evaluations between the steps, after
    the CUDA-graph runner's calls, gather the stale pieces by themselves; on GPUs the weights
    live in NCCL's windows and are gathered by the copy engines. Adam moves every element by
    about its learning rate (1e-3) per step whatever its gradient, so a piece not gathered after an update is off by ~1e-3; the float32
    rounding of two averages against one backward moved the weights by 4.9e-5 here."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("on GPUs the worker runs one process per GPU (NCCL): 2 needed")
    run_worker("ddp_pieces_worker.py", tmp_path)
    for rank in (0, 1):  # the uneven run finished its three steps (a hang fails run_worker's timeout)
        uneven = json.loads((tmp_path / f"rank{rank}_uneven.json").read_text())
        assert len(uneven["losses"]) == 3 and uneven["released"] == 35
        # The gradients it did not make (none in a step, or only an earlier micro-batch's) are
        # the numbers the same MLP gives with its output times 0: the same losses and weights.
        assert uneven["losses"] == uneven["zero_losses"] and uneven["worst_vs_zeros"] == 0.0
        # Eager steps too: at most one layer's whole gradients (7) wait for their reduce-scatters
        assert uneven["in_flight_cap"] == 7 and 0 < uneven["most_in_flight"] <= 7
    runs = (("ahead0", 16, 5), ("ahead1", 16, 5), ("ahead1_lora", 24, 4), ("ahead1_release", 51, 15),
            ("ahead1_release_checkpointing", 51, 15))
    for run_name, split, whole in runs:
        for rank in (0, 1):
            r = json.loads((tmp_path / f"rank{rank}_{run_name}.json").read_text())
            # 2 x 7 projections + 2 embeddings, 5 norms whole; LoRA: every adapter but k's and v's 2 KB B;
            # --ddp-shard-weights: 7 layers (7 x 7 + 2 split, 15 norms)
            assert r["split"] == split and r["whole"] == whole
            close(r["losses"], r["want_losses"], tol=1e-5)
            assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["norms"], r["want_norms"]))
            assert min(r["want_norms"]) > 1.0  # clipping was on: the norm decided the updates
            assert len(r["evaluated"]) == 2
            close(r["evaluated"], r["want_evaluated"], tol=1e-5)
            assert r["worst_vs_alone"] < 2e-4
            assert r["worst_between_processes"] == 0.0
            assert r["moments_are_pieces"]
            # The embedding's rows in all three steps (the first backward checks, before its
            # averages, that no other row is used); LoRA: the embedding does not train.
            assert r["rows_averaged"] == (3 if run_name.startswith("ahead1") and "lora" not in run_name else 0)
            if "release" in run_name:  # between the steps no layer's weights have memory; every slot is back
                assert r["released"] == 35 and r["whole_between_steps"] == [0, 0, 0]
                assert list(r["slots"].values()) == [3]
                # Checkpointing: every layer's forward ran again in each of the 3 backward passes (the
                # saved-tensor notes stayed out of its way), from the weights gathered again.
                assert r["recomputed"] == ([6, 5, 4, 3, 2, 1, 0] * 3 if "checkpointing" in run_name else [])
            if not torch.cuda.is_available():
                assert r["windows"] == 0
            elif torch.cuda.nccl.version() >= (2, 28):  # the weights lived in NCCL's windows: copy engines
                # --ddp-shard-weights: the embeddings', the layers' pieces', the layers' slots
                assert r["windows"] == (3 if "release" in run_name else 1)


def test_ddp_shard_weights_matches_the_pieces_and_resumes(tmp_path, monkeypatch):
    """The script with --ddp --ddp-shard-weights on a LLaMA of 5 layers wide enough (hidden
    512) that the weights of its last 3 layers are released between uses (the MLP's in bf16
    on GPUs, also q and o in float32 on the CPU; the first 2 layers stay whole), its
    vocabulary 2,048 (the embeddings still split into pieces, 2 MiB in bf16; with the tiny
    model's 8,192 they were 42% of the weights, whose AdamW and norm kernels took most of the
    interpreter's time): 4 steps, a held-out evaluation after each, checkpoints at steps 2
    and 4, against --ddp alone (the pieces kept whole): the same losses, evaluations and saved
    weights (the checkpoint gathers every layer); resumed from step 2 (the loaded weights cut
    into pieces again) it goes on with the same losses; with --gradient-checkpointing (each
    backward recomputes its layer's forward from the weights gathered again) the same losses
    and evaluations. With --lora it is refused in one line."""
    from transformers import LlamaConfig

    config = models.tiny_config().to_dict()
    config.update(hidden_size=512, intermediate_size=1024, head_dim=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=5, vocab_size=2048)
    LlamaConfig(**config).save_pretrained(tmp_path / "wide")
    # 1 layer ahead (2 by default with the flag): layers 2-4 released, layer 2 between its forward and backward too
    args = ["--model", str(tmp_path / "wide"), "--random-init", *TINY[1:], "--steps", "4", "--batch-size", "1",
            "--eval-every", "1", "--eval-batches", "1", "--save-every", "2", "--ddp-gather-ahead", "1"]
    sharded = run("finetune_optimized.py", [*args, "--ddp-shard-weights", "--output-dir", str(tmp_path / "s")], 2,
                  tmp_path, "sharded", mode="--ddp")
    pieces = run("finetune_optimized.py", [*args, "--output-dir", str(tmp_path / "p")], 2, tmp_path, "pieces",
                 mode="--ddp")
    # Layers 2-4: q, o, gate, up, down each (float32 on the CPU), the MLP's (bf16 on GPUs)
    assert sharded["ddp_released_weights"] == (9 if torch.cuda.is_available() else 15)
    assert pieces["ddp_released_weights"] == 0
    close(sharded["losses"], pieces["losses"])
    close([e["loss"] for e in sharded["eval"]], [e["loss"] for e in pieces["eval"]])
    from safetensors.torch import load_file

    for step in (2, 4):
        ours = load_file(tmp_path / "s" / f"checkpoint-{step}" / "model.safetensors")
        theirs = load_file(tmp_path / "p" / f"checkpoint-{step}" / "model.safetensors")
        assert ours.keys() == theirs.keys()
        assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 2e-4
    resumed = run("finetune_optimized.py", [*args, "--ddp-shard-weights", "--resume",
                                            str(tmp_path / "s" / "checkpoint-2"), "--output-dir", str(tmp_path / "r")],
                  2, tmp_path, "resumed", mode="--ddp")
    close(resumed["losses"], sharded["losses"][2:], tol=1e-6)
    # With --gradient-checkpointing each released layer's backward recomputes its forward from
    # the weights gathered again: the same losses and evaluations as the pieces without it.
    recomputed = run("finetune_optimized.py", [*args, "--ddp-shard-weights", "--gradient-checkpointing", "--output-dir",
                                               str(tmp_path / "c")], 2,
                     tmp_path, "recomputed", mode="--ddp")
    assert recomputed["config"]["gradient_checkpointing"] and recomputed["ddp_released_weights"] == \
        sharded["ddp_released_weights"]
    close(recomputed["losses"], pieces["losses"])
    close([e["loss"] for e in recomputed["eval"]], [e["loss"] for e in pieces["eval"]])
    # With --lora the script stops before it starts the process group (the refusal's text is
    # test_ddp_shard_optimizer_flags'): run here as one torchrun worker would be, in-process.
    with monkeypatch.context() as m:
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
            m.setenv(name, value)
        with pytest.raises(SystemExit, match="--ddp-shard-weights with --lora is not implemented"):
            finetune_optimized.main([*args, "--ddp", "--ddp-shard-weights", "--lora"])


def test_ddp_shard_optimizer_matches_the_all_reduce_and_resumes(tmp_path):
    """The script with --ddp --ddp-shard-optimizer (the tiny model: its two embeddings are
    split into pieces), 5 steps, a held-out evaluation after each and checkpoints at steps 2
    and 4, against --ddp --no-ddp-shard-optimizer (which equals one process, above): the same losses,
    evaluations and final weights. On GPUs the step is a CUDA graph from step 3 on, so the
    evaluations and the checkpoint between replays read weights the replays left in pieces
    (ShardedUpdate.replayed). Each process writes its own optimizer state, rank 0 the whole
    model; the run resumes from step 4 to the same loss, and a resume without the flag is
    refused in one line."""
    args = [*TINY, "--steps", "5", "--batch-size", "1", "--eval-every", "1", "--eval-batches", "1", "--save-every", "2"]
    out = tmp_path / "pieces"
    pieces = run("finetune_optimized.py", [*args, "--ddp-shard-optimizer", "--output-dir", str(out)], 2, tmp_path,
                 "pieces", mode="--ddp")
    whole = run("finetune_optimized.py", [*args, "--no-ddp-shard-optimizer", "--output-dir", str(tmp_path / "whole")],
                2, tmp_path, "whole", mode="--ddp")
    close(pieces["losses"], whole["losses"])
    assert [e["step"] for e in pieces["eval"]] == [1, 2, 3, 4, 5]
    close([e["loss"] for e in pieces["eval"]], [e["loss"] for e in whole["eval"]])
    ckpt = out / "checkpoint-4"
    assert sorted(os.listdir(ckpt)) == sorted([checkpoints.MANIFEST, "config.json", "generation_config.json",
                                               "model.safetensors", "optimizer_rank0.pt", "optimizer_rank1.pt",
                                               "rng_state_rank0.pt", "rng_state_rank1.pt", "scheduler.pt",
                                               checkpoints.TRAINER_STATE])
    from safetensors.torch import load_file

    for step in (4, 5):
        ours = load_file(out / f"checkpoint-{step}" / "model.safetensors")
        theirs = load_file(tmp_path / "whole" / f"checkpoint-{step}" / "model.safetensors")
        assert ours.keys() == theirs.keys()
        assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 2e-4  # see the test above
    resumed = run("finetune_optimized.py", [*args, "--ddp-shard-optimizer", "--resume", str(ckpt), "--output-dir",
                                            str(tmp_path / "again")], 2, tmp_path, "pieces_resumed", mode="--ddp")
    close(resumed["losses"], pieces["losses"][4:], tol=1e-6)
    with pytest.raises(AssertionError, match="its optimizer state was written with --ddp-shard-optimizer"):
        run("finetune_optimized.py", [*args, "--no-ddp-shard-optimizer", "--resume", str(ckpt), "--output-dir",
                                      str(tmp_path / "x")], 2, tmp_path, "refused", mode="--ddp")


def test_embedding_rows_apply_to_an_untied_trained_embedding_only():
    """--ddp-embedding-rows (ddp.averages_rows): the tiny LLaMA's input embedding (untied,
    trained, over PACKED_BYTES) qualifies; tied to the LM head, frozen, or as small as the
    packed gradients, it does not."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(models.tiny_config())
    embedding = model.get_input_embeddings()
    params = [p for p in model.parameters() if p.requires_grad]
    assert ddp.averages_rows(model, embedding, params)
    assert not ddp.averages_rows(model, embedding, [p for p in params if p is not embedding.weight])
    model.get_output_embeddings().weight = embedding.weight
    assert not ddp.averages_rows(model, embedding, params)
    small = torch.nn.Embedding(16, 8)
    assert not ddp.averages_rows(torch.nn.Module(), small, [small.weight])


def test_ddp_shard_optimizer_flags(monkeypatch):
    """On by default where it applies (the Triton AdamW, no --compile), its limits in one
    line each when asked for; the gathers by the copy engines ask NCCL for its zero-CTA
    policy before the communicator is made (on GPUs); flags that change nothing get a note."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    parse = finetune_optimized.parse_args
    with pytest.raises(SystemExit, match="^error: --ddp-shard-optimizer with --compile is not supported"):
        fsdp.check_fsdp_flags(parse(["--tiny", "--ddp", "--ddp-shard-optimizer", "--compile"]))
    with pytest.raises(SystemExit, match="add --use-custom-adamw$"):
        fsdp.check_fsdp_flags(parse(["--tiny", "--ddp", "--ddp-shard-optimizer", "--no-use-custom-adamw"]))
    fsdp.check_fsdp_flags(parse(["--tiny", "--ddp", "--compile"]))  # the default steps aside
    assert flags.shards_optimizer(parse(["--tiny", "--ddp"]))
    assert not flags.shards_optimizer(parse(["--tiny", "--ddp", "--compile"]))
    assert not flags.shards_optimizer(parse(["--tiny", "--ddp", "--no-use-custom-adamw"]))
    assert not flags.shards_optimizer(parse(["--tiny", "--ddp", "--no-ddp-shard-optimizer"]))
    notes = flags.settle(parse(["--tiny", "--ddp", "--no-ddp-shard-optimizer", "--ddp-gather-ahead", "2",
                                "--no-ddp-copy-engines"]))._notes
    assert "--ddp-gather-ahead, --no-ddp-copy-engines without --ddp-shard-optimizer (off: asked) changes nothing" in notes
    notes = flags.settle(parse(["--tiny", "--ddp", "--compile", "--ddp-gather-ahead", "2"]))._notes
    assert ("--ddp-gather-ahead without --ddp-shard-optimizer (off: it needs the Triton AdamW, not with --compile) "
            "changes nothing") in notes
    assert not flags.settle(parse(["--tiny", "--ddp", "--ddp-gather-ahead", "2", "--no-ddp-copy-engines"]))._notes
    # --ddp-shard-weights: 2 layers ahead unless told; its limits, one line each
    assert flags.gather_ahead(parse(["--tiny", "--ddp"])) == 1
    assert flags.gather_ahead(parse(["--tiny", "--ddp", "--ddp-shard-weights"])) == 2
    assert flags.gather_ahead(parse(["--tiny", "--ddp", "--ddp-shard-weights", "--ddp-gather-ahead", "1"])) == 1
    flags.check_shard_weights(parse(["--tiny", "--ddp", "--ddp-shard-weights"]))
    flags.check_shard_weights(parse(["--tiny", "--ddp", "--ddp-shard-weights", "--gradient-checkpointing"]))
    for extra, why in ((["--no-ddp-shard-optimizer"], "which is off"), (["--fp8", "tensorwise"], "with --fp8"),
                       (["--lora"], "with --lora")):
        with pytest.raises(SystemExit, match=f"^error: --ddp-shard-weights.*{why}[^\n]*$"):
            flags.check_shard_weights(parse(["--tiny", "--ddp", "--ddp-shard-weights", *extra]))
    monkeypatch.setenv("WORLD_SIZE", "1")
    notes = flags.settle(parse(["--tiny", "--ddp-shard-optimizer", "--ddp-gather-ahead", "2"]))._notes
    assert "--ddp-shard-optimizer, --ddp-gather-ahead without --ddp changes nothing" in notes
    assert "--no-ddp-embedding-rows without --ddp changes nothing" in flags.settle(
        parse(["--tiny", "--no-ddp-embedding-rows"]))._notes
    # init_distributed: NCCL's zero-CTA policy where the gathers may go by the copy engines, a
    # value set by hand kept; nothing without a GPU (gloo).
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    # --fsdp: where its all-gathers may go by the copy engines (fsdp.window_gathers_refused):
    # NCCL 2.28, one host, a torch whose FSDP2 was read for it (or the flag asked by name).
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    zero = ddp.NCCL_ZERO_CTA
    for cuda, argv, policy in ((True, ["--ddp"], zero), (True, ["--ddp", "--no-ddp-copy-engines"], None),
                               (True, ["--ddp", "--no-ddp-shard-optimizer"], None), (False, ["--ddp"], None),
                               (True, ["--fsdp"], zero), (True, ["--fsdp", "--fsdp-comm", "pytorch"], None),
                               (False, ["--fsdp"], None),
                               (True, ["--ddp", "--no-ddp-copy-engines", "--fsdp-comm", "copy-engines"], None)):
        monkeypatch.delenv("NCCL_CTA_POLICY", raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        fsdp.init_distributed(parse(["--tiny", *argv]))
        assert os.environ.get("NCCL_CTA_POLICY") == policy, argv
    for why, change in (("NCCL 2.27.7 (2.28 or later",
                         lambda m: m.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 7))),
                        ("processes on several hosts", lambda m: m.setenv("LOCAL_WORLD_SIZE", "1")),
                        ("torch 2.99.0: its FSDP2's order", lambda m: m.setattr(torch, "__version__", "2.99.0"))):
        with monkeypatch.context() as m:
            change(m)
            m.delenv("NCCL_CTA_POLICY", raising=False)
            fsdp.init_distributed(parse(["--tiny", "--fsdp"]))
            assert "NCCL_CTA_POLICY" not in os.environ, why
            assert fsdp.window_gathers_refused(asked=False).startswith(why)
            if "FSDP2's order" in why:  # asked for by name, a torch not read for it is the user's call
                assert fsdp.window_gathers_refused(asked=True) is None
            else:
                with pytest.raises(SystemExit, match=f"^error: --fsdp-comm copy-engines: {re.escape(why)}"):
                    fsdp.check_fsdp_comm(parse(["--tiny", "--fsdp", "--fsdp-comm", "copy-engines"]))
    monkeypatch.setenv("NCCL_CTA_POLICY", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fsdp.init_distributed(parse(["--tiny", "--ddp"]))
    assert os.environ["NCCL_CTA_POLICY"] == "1"


def test_ddp_refusals_are_one_line(monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        fsdp.check_fsdp_flags(finetune_optimized.parse_args(["--tiny", "--ddp", "--fsdp"]))
    assert str(e.value) == "error: --fsdp and --ddp: choose one (--fsdp shards the model, --ddp copies it whole)"
    monkeypatch.delenv("WORLD_SIZE")
    assert "--ddp-bucket-mb without --ddp changes nothing" in flags.settle(
        finetune_optimized.parse_args(["--tiny", "--ddp-bucket-mb", "100"]))._notes
    with pytest.raises(SystemExit, match="--ddp runs under torchrun"):
        fsdp.check_fsdp_flags(finetune_optimized.parse_args(["--tiny", "--ddp"]))


def test_torchrun_without_fsdp_or_ddp_chooses_from_memory(monkeypatch):
    """Several processes and neither flag: --ddp where the model's state fits the share of
    the memory per process, --fsdp where it does not; said in one line, with the flags
    the other mode would have used noted as idle, and the chosen mode's refusals."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    choose = lambda *argv: run_module.settle(finetune_optimized.parse_args(["--tiny", *argv]))[0]  # noqa: E731
    tiny = models.build_random(models.tiny_config(), torch.device("cpu"), torch.float32)
    weights = 4 * sum(p.numel() for p in tiny.parameters())  # float32
    chosen = choose("--fsdp-prefetch", "1")
    assert chosen.ddp and not chosen.fsdp
    # The pieces by default (the Triton AdamW): each process keeps half of AdamW's two moments.
    assert chosen.parallel_choice.startswith("torchrun started 2 processes without --fsdp or --ddp, so --ddp: a "
                                             "whole copy per process (its weights, gradients and 1/2 of AdamW "
                                             "state, ~")
    assert "--fsdp-prefetch without --fsdp changes nothing" in chosen._notes
    # Counted weight by weight: the tiny model's embeddings (4 MB each) are split into pieces, 2 + 2/N
    # copies; its layers' matrices are under ddp.PACKED_BYTES, 4 copies as on one GPU.
    split = 4 * sum(p.numel() for p in tiny.parameters() if p.numel() * 4 >= ddp.PACKED_BYTES)
    assert split == 2 * 4 * tiny.config.vocab_size * tiny.config.hidden_size
    assert fsdp.replica_memory(chosen)[0] == 3 * split + 4 * (weights - split)
    whole = choose("--no-ddp-shard-optimizer")  # weights, gradients, both moments whole
    assert whole.ddp and "(its weights, gradients and AdamW state, ~" in whole.parallel_choice
    assert fsdp.replica_memory(whole)[0] == fsdp.REPLICA_STATE_COPIES * weights
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert fsdp.replica_memory(choose())[0] == int(2.5 * split + 4 * (weights - split))
    monkeypatch.setenv("WORLD_SIZE", "2")
    # What the counts are asked for: the processes, float32 on the CPU, the layers gathered ahead in each mode,
    # the whole gradients of --grad-accum and of a resume's first step, the whole weights of a checkpoint.
    from kernel_ft import layer_weights

    asked, count = [], layer_weights.state_bytes
    monkeypatch.setattr(layer_weights, "state_bytes", lambda *a, **k: asked.append((a[1:], k)) or count(*a, **k))
    assert fsdp.shard_weights_memory(chosen) is None  # the tiny model's layers release no weight
    assert asked[-1] == ((2, 4, 2), dict(accumulate=False, release=True, checkpoints=False))
    fsdp.replica_memory(chosen)
    assert asked[-1] == ((2, 4, 1), dict(accumulate=False, release=False, checkpoints=False))
    fsdp.shard_weights_memory(choose("--grad-accum", "2", "--ddp-gather-ahead", "3"))
    assert asked[-1] == ((2, 4, 3), dict(accumulate=True, release=True, checkpoints=False))
    fsdp.shard_weights_memory(chosen.but(output_dir="runs/x"))
    assert asked[-1][1]["checkpoints"] and not asked[-1][1]["accumulate"]
    fsdp.shard_weights_memory(chosen.but(resume="runs/x/checkpoint-2", output_dir="runs/x"))
    assert asked[-1][1]["checkpoints"] and asked[-1][1]["accumulate"]
    monkeypatch.setattr(layer_weights, "state_bytes", count)
    monkeypatch.setattr(fsdp, "replica_memory", lambda args: (10 * 2**30, 12 * 2**30, "here"))
    # A whole copy does not fit: --ddp-shard-weights where its state does (and it applies) ...
    monkeypatch.setattr(fsdp, "shard_weights_memory", lambda args: 9 * 2**30)
    chosen = choose()
    assert chosen.ddp and chosen.ddp_shard_weights and not chosen.fsdp
    assert ("so --ddp --ddp-shard-weights: each process keeps 1/2 of the decoder layers' weights, whole only around "
            "their use (at most ~9.00 GiB per process before activations, which fits in 80% of the 12.0 GiB here; "
            "a whole copy's weights, gradients and 1/2 of AdamW state, ~10.00 GiB, exceed); pass --fsdp"
            ) in chosen.parallel_choice
    for where_it_does_not_apply in (["--lora"], ["--no-ddp-shard-optimizer"]):  # (--fp8: no CPU runs it)
        assert choose(*where_it_does_not_apply).fsdp
    # ... else --fsdp, the line giving both.
    monkeypatch.setattr(fsdp, "shard_weights_memory", lambda args: 10 * 2**30)
    chosen = choose("--ddp-bucket-mb", "50")
    assert chosen.fsdp and not chosen.ddp and "--ddp-bucket-mb without --ddp changes nothing" in chosen._notes
    assert ("so --fsdp: the model sharded over them (its weights, gradients and 1/2 of AdamW state, ~10.00 GiB, and "
            "--ddp-shard-weights' ~10.00 GiB, exceed 80% of the 12.0 GiB here); pass --ddp") in chosen.parallel_choice
    # --ddp-shard-weights given without a mode: taken over a whole copy that would fit.
    monkeypatch.setattr(fsdp, "replica_memory", lambda args: (1 * 2**30, 12 * 2**30, "here"))
    monkeypatch.setattr(fsdp, "shard_weights_memory", lambda args: 2**29)
    asked = choose("--ddp-shard-weights")
    assert asked.ddp and asked.ddp_shard_weights and "--ddp-shard-weights was given" in asked.parallel_choice
    assert choose().ddp and not choose().ddp_shard_weights
    monkeypatch.setattr(fsdp, "shard_weights_memory", lambda args: 11 * 2**30)  # given, fits only whole: --fsdp
    asked = choose("--ddp-shard-weights")
    assert asked.fsdp and ("(--ddp-shard-weights' ~11.00 GiB, exceed 80% of the 12.0 GiB here; --ddp-shard-weights "
                           "was given, so no whole copy)") in asked.parallel_choice
    with pytest.raises(SystemExit, match="^error: --ddp-shard-weights with --lora is not implemented"):
        choose("--ddp-shard-weights", "--lora")  # asked for where it cannot run: its own refusal
    monkeypatch.setattr(fsdp, "replica_memory", lambda args: (10 * 2**30, 12 * 2**30, "here"))
    monkeypatch.setattr(fsdp, "shard_weights_memory", lambda args: 10 * 2**30)
    with pytest.raises(SystemExit, match="^error: --optimizer-in-backward.*with --fsdp that is not implemented"):
        choose("--optimizer-in-backward", "--max-grad-norm", "0")
    # LLaMA-3.1-8B on an 80 GB H100 (81,559 MiB): 4 x 8.03e9 bf16 values, 59.8 GiB, run whole as on one GPU.
    monkeypatch.setattr(fsdp, "replica_memory", lambda args: (4 * 2 * 8_030_261_248, 81_559 * 2**20, "here"))
    assert choose().ddp
    monkeypatch.delenv("WORLD_SIZE")  # one process: nothing to choose
    alone = choose()
    assert not alone.fsdp and not alone.ddp and alone.parallel_choice is None


def test_shard_weights_memory_counts_what_each_process_holds():
    """layer_weights.state_bytes, which the choice above reads, against the arithmetic of
    LLaMA-3.1-8B's shapes (its bundled config, built on the meta device): 2 layers ahead,
    so layers 0-2 and the embeddings stay whole with 1/N of their moments, layers 3-31
    keep 4/N of their matrices, the norms 4 copies, and 2 + 2 slots plus 8 layers'
    gradients in flight, or every released layer's with --grad-accum; what holds more for a
    while (loading, checkpoints); without --ddp-shard-weights; where nothing is released."""
    from kernel_ft import layer_weights

    config = models.config_for("meta-llama/Llama-3.1-8B")
    hidden, mlp, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp  # q, o; k, v; gate, up, down
    embeddings = 2 * config.vocab_size * hidden  # input and output, not tied
    norms = (2 * config.num_hidden_layers + 1) * hidden
    model = models.meta_model(config)
    for n in (2, 4):
        kept, released = embeddings + 3 * layer, (config.num_hidden_layers - 3) * layer
        expected = 2 * (kept * (2 + 2 / n) + released * 4 / n + norms * 4 + (4 + 8) * layer)
        assert layer_weights.state_bytes(model, n, 2, 2) == int(expected)
        accumulated = expected - 2 * 8 * layer + 2 * released
        assert layer_weights.state_bytes(model, n, 2, 2, accumulate=True) == int(accumulated)
        # Without --ddp-shard-weights: every split weight whole, 2 + 2/N copies.
        assert layer_weights.state_bytes(model, n, 2, release=False) == int(
            2 * ((embeddings + config.num_hidden_layers * layer) * (2 + 2 / n) + norms * 4))
    # 1 layer ahead keeps 2 whole.
    assert layer_weights.state_bytes(model, 2, 2, 1) == int(
        2 * ((embeddings + 2 * layer) * 3 + (config.num_hidden_layers - 2) * layer * 2 + norms * 4 + (3 + 8) * layer))
    # A checkpoint (written or resumed) gathers every released weight whole beside the rest.
    released = (config.num_hidden_layers - 3) * layer
    assert layer_weights.state_bytes(model, 2, 2, 2, checkpoints=True) == int(
        2 * ((embeddings + 3 * layer) * 3 + released * 2 + norms * 4 + (4 + 8) * layer + released))
    # Over 3 processes no decoder matrix splits (4,096 x 4,096, 4,096 x 1,024 and 4,096 x 14,336 are not
    # divisible by 3): nothing to release; the embeddings (128,256 x 4,096) still split without it.
    assert layer_weights.state_bytes(model, 3, 2, 2) is None
    assert layer_weights.state_bytes(model, 3, 2, release=False) == int(
        2 * (embeddings * (2 + 2 / 3) + config.num_hidden_layers * layer * 4 + norms * 4))
    # LLaMA-70B over 8: each process would hold 1/8 of it in pieces, but loads it whole first (131.4 GiB of
    # bf16 weights) and then copies its pieces out: more than 80% of an H200's 139.8 GiB, so --fsdp.
    big = models.meta_model(models.config_for("meta-llama/Llama-3.1-70B"))
    weights70 = 2 * sum(p.numel() for p in big.parameters())
    assert weights70 < layer_weights.state_bytes(big, 8, 2, 2) < 1.125 * weights70
    assert layer_weights.state_bytes(big, 8, 2, 2) > 0.8 * 139.8 * 2**30


def test_ddp_compiled_matches_one_process(full, tmp_path):
    """--ddp --compile: each decoder layer compiled (aot_eager on the CPU) inside the
    replicated model; the averages' hooks see the compiled layers' gradients."""
    _, one, _ = full
    doc = run("finetune_optimized.py", [*TINY, "--steps", "3", "--batch-size", "1", "--compile"], 2, tmp_path,
              mode="--ddp")
    close(doc["losses"], one["losses"])
    assert doc["config"]["compile"] and doc["config"]["ddp"]


def test_prefetch_and_kept_weights_change_no_loss(full, tmp_path, capsys):
    """--fsdp-prefetch 2 (two layers gathered ahead; the tiny model has two) with
    --fsdp-keep-gathered (no second all-gather in backward) trains the same steps; the
    flags say so when --fsdp is missing."""
    _, one, _ = full
    ahead = run("finetune_optimized.py", [*TINY, "--steps", "3", "--batch-size", "1", "--fsdp-prefetch", "2",
                                          "--fsdp-keep-gathered"], 2, tmp_path, "ahead")
    close(ahead["losses"], one["losses"])
    assert ahead["config"]["fsdp_prefetch"] == 2 and ahead["config"]["fsdp_reduce_dtype"] == "auto"
    assert ahead["config"]["fsdp_keep_gathered"] == "on" and ahead["fsdp_keep_gathered_auto"] is None  # nothing decided
    idle = flags.settle(finetune_optimized.parse_args(["--fsdp-reduce-dtype", "bfloat16", "--fsdp-prefetch", "1",
                                                       "--fsdp-keep-gathered"]))
    assert "--fsdp-prefetch, --fsdp-keep-gathered, --fsdp-reduce-dtype without --fsdp changes nothing" in idle._notes


def saved_names(checkpoint):
    """The model tensors in a checkpoint's DCP shards."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint / checkpoints.SHARDED_DIR)).read_metadata()
    return [k[len("model."):] for k in metadata.state_dict_metadata if k.startswith("model.")]


def test_lora_two_ranks_match_one_process_and_resume(lora, tmp_path):
    """--fsdp --lora: frozen weights and adapters sharded together, the optimizer on the
    adapters' shards; the shards of a checkpoint hold the adapters only."""
    sharded, one, tmp = lora
    close(sharded["losses"], one["losses"])
    assert sharded["kernels"] == {**EVERY_KERNEL, "lora": True}  # the fused LoRA layer too, on the shards
    assert sharded["model"]["trainable_parameters"] == one["model"]["trainable_parameters"] == 18688
    names = saved_names(tmp / "fsdp" / "checkpoint-2")
    assert len(names) == 28 and all(".lora_A." in n or ".lora_B." in n for n in names), names  # 2 x 7 x (A, B)

    args = [*TINY, "--steps", "3", "--batch-size", "1", "--lora", "--lora-r", "4"]
    resumed = run("finetune_optimized.py", [*args, "--resume", str(tmp / "fsdp" / "checkpoint-2"),
                                            "--output-dir", str(tmp_path / "again")], 2, tmp_path, "resumed")
    close(resumed["losses"], sharded["losses"][2:], tol=1e-6)


def test_two_ranks_compiled_match_one_process(full, tmp_path):
    """--fsdp --compile: each decoder layer's forward compiled (aot_eager on CPU), FSDP's
    gathering around it; the losses of the eager single process."""
    doc = run("finetune_optimized.py", [*TINY, "--steps", "3", "--batch-size", "1", "--compile"], 2, tmp_path)
    close(doc["losses"], full[1]["losses"])
    # --compile turns the projections' groups off (compiled layers plan their own sums).
    assert doc["config"]["compile"] and doc["kernels"] == {**EVERY_KERNEL, "projections": False}


def test_two_ranks_lora_checkpointing_compiled_match_one_process(tmp_path):
    """--lora, --gradient-checkpointing and --compile together under --fsdp: the losses
    of one process with the same flags and the global batch."""
    args = [*TINY, "--steps", "2", "--lora", "--lora-r", "4", "--gradient-checkpointing"]
    sharded = run("finetune_optimized.py", [*args, "--batch-size", "1", "--compile"], 2, tmp_path, "fsdp")
    one = run("finetune_optimized.py", [*args, "--batch-size", "2"], None, tmp_path, "one")
    close(sharded["losses"], one["losses"])
    assert sharded["config"]["gradient_checkpointing"] and sharded["config"]["compile"]


# --------------------------------------------------------------------------------
# tools/export_hf.py: the shards as a save_pretrained folder
# --------------------------------------------------------------------------------
def same_tensors(exported, expected):
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, atol=1e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def check_against_the_shards(exported, checkpoint, tmp_path):
    """The exported tensors are exactly the shards' (PyTorch's own converter,
    dcp_to_torch_save, puts the pieces together as the reference); names as
    save_pretrained writes them (PEFT drops the adapter name "default")."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint / checkpoints.SHARDED_DIR), str(tmp_path / "reference.pt"))
    reference = torch.load(tmp_path / "reference.pt")["model"]
    reference = {name.replace(".default.", ".").removeprefix("base_model.model."): t for name, t in reference.items()}
    exported = {name.removeprefix("base_model.model."): t for name, t in exported.items()}
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name


# The run's own shards are the exact reference; the one-process run's saved model
# is a second one on the CPU, where both runs are deterministic float32 and agree
# to ~1e-6. On a GPU the two runs' matrix products (batch 1 on each of two GPUs,
# batch 2 on one) take different cuBLAS kernels that round differently, and AdamW
# magnifies that for weights whose gradients are near its eps: their losses agree
# (test above), their weights need not agree to 1e-5.
ACROSS_RUNS = not torch.cuda.is_available()


def test_export_gives_the_model_of_the_run(full, tmp_path):
    """The exported model loads with from_pretrained and is the model the one-process
    run saved at the same step (its checkpoint is save_pretrained's output)."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    _, _, tmp = full
    out = export_hf.main([str(tmp / "fsdp" / "checkpoint-3"), str(tmp_path / "hf")])
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    exported = LlamaForCausalLM.from_pretrained(out).state_dict()
    check_against_the_shards(exported, tmp / "fsdp" / "checkpoint-3", tmp_path)
    if ACROSS_RUNS:
        expected = load_file(str(tmp / "one" / "checkpoint-3" / "model.safetensors"))
        # Almost every weight agrees within 1e-6; a few, whose gradients are near AdamW's
        # eps, move by up to ~5e-6: the update divides by sqrt(v), which magnifies the
        # rounding of a different reduction order (two processes' sum vs one batch).
        same_tensors(exported, expected)


def test_export_lora_gives_the_adapters_of_the_run(lora, tmp_path):
    """--lora: the PEFT adapter folder, the one-process run's adapters, and
    PeftModel.from_pretrained puts them on the base model."""
    from peft import PeftModel
    from safetensors.torch import load_file

    _, _, tmp = lora
    out = export_hf.main([str(tmp / "fsdp" / "checkpoint-3"), str(tmp_path / "adapters")])
    exported = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert len(exported) == 28
    check_against_the_shards(exported, tmp / "fsdp" / "checkpoint-3", tmp_path)
    if ACROSS_RUNS:
        same_tensors(exported, load_file(str(tmp / "one" / "checkpoint-3" / "adapter_model.safetensors")))
    torch.manual_seed(0)  # the tiny base, as load_model builds it
    base = models.build_random(models.tiny_config(), torch.device("cpu"), torch.float32)
    model = PeftModel.from_pretrained(base, out)
    loaded = {name.replace(".default.", "."): p.detach() for name, p in model.named_parameters() if ".lora_" in name}
    same_tensors(loaded, exported)  # in the model, PEFT names each adapter ("default")


def test_export_errors_are_one_line(full, tmp_path):
    _, _, tmp = full
    with pytest.raises(SystemExit, match=r"error: CHECKPOINT_DIR .*: not a checkpoint \(no trainer_state.json\)"):
        export_hf.main([str(tmp), str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="without --fsdp, so it already is save_pretrained's output "
                                         r"\(config.json and model.safetensors\)"):
        export_hf.main([str(tmp / "one" / "checkpoint-3"), str(tmp_path / "b")])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="OUT_DIR .*: exists and is not empty") as e:
        export_hf.main([str(tmp / "fsdp" / "checkpoint-3"), str(tmp_path / "c")])
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------
# A model built on the meta device (not --tiny)
# --------------------------------------------------------------------------------
@pytest.fixture
def one_process_group(tmp_path):
    """A process group of this process alone (gloo): fully_shard and DTensors as under
    torchrun, in the test's own process."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield fsdp.World(0, 1, 0, torch.device("cpu"))
    torch.distributed.destroy_process_group()


def test_meta_device_lora_starts_as_the_base_model(one_process_group):
    """materialize fills the shards with HF's initialization, which draws LoRA's B at
    random like any Linear weight; PEFT's own initialization must follow: B zeros, so
    the model's output is the base model's. The optimizer gets the adapters' shards."""
    from torch.distributed.tensor import DTensor

    args = argparse.Namespace(tiny=False, lora_r=4, lora_alpha=8.0, lora_dropout=0.0, lora_4bit=False,
                              lora_targets=list(flags.LORA_TARGETS))
    torch.manual_seed(0)
    model = models.apply_lora(models.build_random(models.tiny_config(), torch.device("meta"), torch.float32), args)
    fsdp.shard_model(model, args, one_process_group)
    assert all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters())
    adapters = {name: p for name, p in model.named_parameters() if ".lora_" in name}
    assert {id(p) for p in models.trainable_parameters(model)} == {id(p) for p in adapters.values()}
    for name, p in adapters.items():
        full = p.full_tensor()
        if ".lora_B." in name:
            assert torch.count_nonzero(full) == 0, name
        else:  # PEFT's kaiming-uniform A: |a| < 1/sqrt(fan_in), std 1/sqrt(3 fan_in); HF's would be std 0.02
            bound = full.shape[1] ** -0.5
            assert full.abs().max() <= bound and abs(full.std().item() / (bound / 3**0.5) - 1) < 0.25, name
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        out = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert torch.equal(out, base)


# Emulated FP8 on CPU tensors: the kernels run in the Triton interpreter, on where there is no GPU.
NEEDS_INTERPRETER = pytest.mark.skipif(not kernel_common.INTERPRET, reason="CPU tensors need the Triton interpreter")


@NEEDS_INTERPRETER
def test_fp8_layers_under_fully_shard_give_the_unsharded_model(one_process_group, monkeypatch):
    """--fp8 with --fsdp: FP8Linear holds the layer's own Parameters, so fully_shard shards
    them like any Linear's and hands the forward the whole weights, which grouped q/k/v and
    gate/up stack; the loss and every gradient equal those of the same FP8 model unsharded
    (emulated FP8 on the CPU). Per
    row nothing can be gathered in FP8 (its scales span shards): attach takes no weight."""
    import copy

    import fp8_kernel
    from fp8_kernel import FP8Linear, replace_linears
    from kernel_ft import fp8_gather
    from projections_kernel import group_projections

    torch.manual_seed(0)
    rowwise = models.build_random(narrow_tiny_config(), torch.device("cpu"), torch.float32)
    replace_linears(rowwise, "rowwise", emulate=True)
    fsdp.shard_model(rowwise, argparse.Namespace(tiny=True), one_process_group)
    assert fp8_gather.attach(rowwise) == 0
    torch.manual_seed(0)
    model = models.build_random(narrow_tiny_config(), torch.device("cpu"), torch.float32)
    assert replace_linears(model, "tensorwise", emulate=True)[0] == 14
    assert group_projections(model) == 4  # q/k/v and gate/up stacked (the script groups before sharding)
    unsharded = copy.deepcopy(model)
    fsdp.shard_model(model, argparse.Namespace(tiny=True), one_process_group)
    assert sum(isinstance(m, FP8Linear) for m in model.modules()) == 14
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    casts = []
    real = fp8_kernel.quantize_side_by_side
    monkeypatch.setattr(fp8_kernel, "quantize_side_by_side",
                        lambda parts, *a: casts.append(len(parts)) or real(parts, *a))
    losses = []
    for m in (model, unsharded):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1] and casts == [2, 3] * 4  # each group stacked, sharded and not
    grads = {n: p.grad for n, p in unsharded.named_parameters()}
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    assert got.keys() == grads.keys()
    for name, g in grads.items():
        assert torch.equal(got[name], g), name


@NEEDS_INTERPRETER
def test_fused_lora_over_weights_gathered_in_fp8_gives_the_unsharded_model(one_process_group, monkeypatch):
    """--fsdp --lora --fp8 tensorwise: LoRA's fused products (lora_kernel, grouped by
    projections_kernel) over FP8 base layers whose weights FSDP gathers in FP8
    (fp8_gather): the forward reads the gathered FP8 weight as it is, backward makes its
    W8^T then; the loss and the adapters' gradients equal the same fused model unsharded
    bit for bit (one process: its shard is the whole weight, cast with the same scale)."""
    import copy

    import fp8_kernel
    import lora_kernel
    from kernel_ft import fp8_gather
    from lora_kernel import fuse_lora
    from projections_kernel import group_projections

    args = argparse.Namespace(tiny=True, lora_r=4, lora_alpha=8.0, lora_dropout=0.0, lora_4bit=False,
                              lora_targets=list(flags.LORA_TARGETS))
    torch.manual_seed(0)
    model = models.apply_lora(models.build_random(narrow_tiny_config(), torch.device("cpu"), torch.float32), args)
    with torch.no_grad():  # B random: PEFT starts it at zero, where its gradient path would go untested
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    assert fp8_kernel.replace_linears(model, "tensorwise", emulate=True)[0] == 14
    unsharded = copy.deepcopy(model)
    fsdp.shard_model(model, args, one_process_group)
    assert fp8_gather.attach(model) == 14
    gathered = []
    real = fp8_kernel.frozen_linear_forward
    monkeypatch.setattr(lora_kernel, "frozen_linear_forward",
                        lambda layer, x2, need_dx: gathered.append(hasattr(layer.weight, "fp8_copy"))
                        or real(layer, x2, need_dx))
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (model, unsharded):
        assert fuse_lora(m) == 14 and group_projections(m) == 4
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert gathered == [True] * 14 + [False] * 14  # sharded: every base weight read as gathered in FP8
    assert losses[0] == losses[1]
    grads = {n: p.grad for n, p in unsharded.named_parameters() if p.grad is not None}
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == grads.keys() and len(grads) == 28
    for name, g in grads.items():
        assert torch.equal(got[name], g), name


@NEEDS_INTERPRETER
def test_fp8_gather_over_two_processes_matches_one_and_resumes(tmp_path):
    """2 gloo processes (tests/fsdp_fp8_worker.py), trained then partly frozen FP8 weights: with
    the weights gathered in FP8 (fp8_gather.attach) the forward sees the gathered FP8
    weight, and the losses and whole gradients of two steps equal the unsharded model's bit
    for bit (the script's AdamW); trained weights are cast at every gather (forward and
    backward), their casts never kept, frozen ones once; a DCP checkpoint loads into
    another model, whose frozen casts made before the load are not reused."""
    run_worker("fsdp_fp8_worker.py", tmp_path)
    reports = [json.loads((tmp_path / f"{mode}-rank{rank}.json").read_text())
               for mode in ("trained", "frozen") for rank in (0, 1)]
    assert sorted((r["mode"], r["rank"]) for r in reports) == [("frozen", 0), ("frozen", 1), ("trained", 0),
                                                               ("trained", 1)]
    for r in reports:
        assert r["attached"] == 14 and r["seen"] == ["FP8Weight"] and r["trained_casts_kept"] == 0
        for step in r["steps"]:
            assert step["losses"][0] == step["losses"][1] and step["differ"] == []
        # Frozen: the 8 attention weights cast at the first gather only, the 6 MLP ones at every gather.
        assert [step["casts"] for step in r["steps"]] == ([28, 28] if r["mode"] == "trained" else [20, 12])
        assert r["loaded"][0] == r["loaded"][1]


def test_gathered_fp8_weight_reads_dequantized_and_refuses_writes():
    """A read of the gathered weight by anything but the FP8 layer computes on its
    dequantized values; a write into it would be lost (its shards are the weight): refused."""
    from fp8_kernel import FP8_DTYPE
    from kernel_ft.fp8_gather import FP8Weight

    data = torch.tensor([[1.0, -2.0], [0.5, 448.0]]).to(FP8_DTYPE)
    w = FP8Weight(data, torch.tensor(0.25), torch.float32)
    assert w.dtype == torch.float32 and w.shape == (2, 2)
    assert torch.equal(w + 0, torch.tensor([[0.25, -0.5], [0.125, 112.0]]))
    assert torch.equal(w.fp8_copy()[0].view(torch.uint8), data.view(torch.uint8)) and w.fp8_copy()[2] is None
    with pytest.raises(RuntimeError, match="read-only"):
        w.mul_(2)


def test_fp8_transpose_kernel_equals_pytorch_transpose():
    """fp8_gather.transpose_fp8 (the layer's W8^T from the gathered W8): PyTorch's
    transposed copy, byte for byte, for shapes whole tiles and partial ones, a row view
    of a larger buffer (FSDP's gather output) and an empty weight."""
    from fp8_kernel import FP8_DTYPE
    from kernel_ft.fp8_gather import FP8Weight, transpose_fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    for n, k in ((0, 32), (256, 128), (130, 200), (16, 48)):
        rows = torch.randint(0, 256, (n + 3, k), generator=g, dtype=torch.uint8).to(device)[1:n + 1]
        for data in (rows.view(FP8_DTYPE), rows.t().view(FP8_DTYPE)):  # a transposed view: copied first
            got = transpose_fp8(data)
            assert got.dtype == FP8_DTYPE and got.shape == data.shape[::-1] and got.is_contiguous()
            assert torch.equal(got.view(torch.uint8), data.view(torch.uint8).t().contiguous()), (n, k)
    data = rows.view(FP8_DTYPE)  # the last shape's, [16, 48]
    w = FP8Weight(data, torch.tensor(1.0), torch.bfloat16)
    assert torch.equal(w.fp8_copy(transpose=True)[2].view(torch.uint8), data.view(torch.uint8).t())


def test_fsdp_comm_sets_every_sharded_module(one_process_group, monkeypatch, capsys):
    """--fsdp-comm pg-memory / symm-mem: the FSDPModule setter runs on every decoder layer
    and the root, and the FSDP line names it (the setters themselves need NCCL)."""
    from torch.distributed.fsdp import FSDPModule

    for comm, (method, value) in fsdp.COMM_SETTERS.items():
        calls = []
        monkeypatch.setattr(FSDPModule, method, lambda self, v: calls.append((type(self).__name__, v)), raising=False)
        args = argparse.Namespace(tiny=True, fsdp_comm=comm)
        model = models.build_random(models.tiny_config(), torch.device("cpu"), torch.float32)
        fsdp.shard_model(model, args, one_process_group)
        assert calls == [("FSDPLlamaDecoderLayer", value)] * 2 + [("FSDPLlamaForCausalLM", value)], comm
        assert f"communication buffers: {comm}" in capsys.readouterr().out


def test_fsdp_comm_copy_engines_wiring(one_process_group, monkeypatch, capsys):
    """--fsdp-comm copy-engines (and auto where NCCL, torch and the GPUs allow it): one
    WindowGathers for all decoder layers, its ring the prefetch + 2 buffers FSDP2's order
    needs, and one of a single buffer for the root; said in the FSDP line. auto falls back
    to FSDP2's own buffers where the copy engines cannot move them (gloo here), and asked
    for by name there it is refused in one line."""
    from torch.distributed.fsdp import FSDPModule

    calls = []
    monkeypatch.setattr(FSDPModule, fsdp.WINDOW_GATHERS, lambda self, comm: calls.append((type(self).__name__, comm)),
                        raising=False)
    model = models.build_random(models.tiny_config(), torch.device("cpu"), torch.float32)
    fsdp.shard_model(model, argparse.Namespace(tiny=True, fsdp_comm="auto"), one_process_group)
    assert calls == [] and "all-gathers by" not in capsys.readouterr().out
    model = models.build_random(models.tiny_config(), torch.device("cpu"), torch.float32)
    with pytest.raises(SystemExit, match=r"^error: --fsdp-comm copy-engines: NCCL on GPUs only; leave it out$"):
        fsdp.shard_model(model, argparse.Namespace(tiny=True, fsdp_comm="copy-engines"), one_process_group)
    assert calls == []
    monkeypatch.setattr(fsdp, "window_gathers_unavailable", lambda device, asked=False: None)
    config = models.tiny_config()
    config.num_hidden_layers = 5
    for prefetch, ring in ((0, 2), (1, 2), (2, 3), (8, 5)):  # max(2, prefetch + 1), at most one per layer
        calls.clear()
        model = models.build_random(config, torch.device("cpu"), torch.float32)
        fsdp.shard_model(model, argparse.Namespace(tiny=True, fsdp_comm="auto", fsdp_prefetch=prefetch),
                         one_process_group)
        assert [name for name, _ in calls] == ["FSDPLlamaDecoderLayer"] * 5 + ["FSDPLlamaForCausalLM"]
        layers, root = calls[0][1], calls[5][1]
        assert all(comm is layers for _, comm in calls[:5]) and root is not layers
        assert (layers.ring, root.ring) == (ring, 1), prefetch
        assert "all-gathers by the copy engines (NCCL windows)" in capsys.readouterr().out


def test_window_gathers_hand_out_a_ring_of_registered_buffers(one_process_group, monkeypatch):
    """WindowGathers.allocate: per size and dtype, ``ring`` buffers made in one pool of NCCL's
    allocator, registered once as symmetric windows (deregistered by close_distributed),
    then handed out in turn, shaped as asked; the call is an all-gather. NCCL's allocator
    and registration are stood in for here (they need NCCL)."""
    registered, pools = [], []

    class Backend:
        mem_allocator = "nccl's allocator"

        def register_mem_pool(self, pool, symm=False):
            registered.append((pool, symm))

    class Pool:
        def __init__(self, allocator):
            assert allocator == "nccl's allocator"
            pools.append(self)

    monkeypatch.setattr(torch.cuda, "MemPool", Pool)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda pool: contextlib.nullcontext())
    monkeypatch.setattr(ddp, "WINDOWS", [])
    cpu = torch.device("cpu")
    gathers = fsdp.WindowGathers(cpu, ring=3)
    gathers.backend = Backend()
    handed = [gathers.allocate([2, 6], dtype=torch.float32, device=cpu) for _ in range(7)]
    assert [len(pools), len(registered), len(ddp.WINDOWS)] == [1, 1, 1] and registered[0] == (pools[0], True)
    assert all(t.shape == (2, 6) and t.dtype == torch.float32 for t in handed)
    bases = [t.data_ptr() for t in handed]
    assert len(set(bases[:3])) == 3 and bases[3:] == bases[:3] + bases[:1]  # in turn, again and again
    fp8_sized = gathers.allocate([12], dtype=torch.uint8, device=cpu)  # another dtype: a ring of its own
    assert len(pools) == 2 and fp8_sized.data_ptr() not in bases
    out, mine = torch.zeros(4), torch.arange(4.0)
    gathers(out, mine, torch.distributed.group.WORLD)  # one process: the gather is a copy
    assert torch.equal(out, mine)


def test_fsdp_comm_refusals_are_one_line(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    for name, value in zip(fsdp.TORCHRUN_ENV, ("0", "2", "0")):
        monkeypatch.setenv(name, value)
    args = finetune_optimized.parse_args(["--tiny", "--fsdp", "--fsdp-comm", "symm-mem"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    with pytest.raises(SystemExit, match=r"^error: --fsdp-comm symm-mem places NCCL's buffers on GPUs; without a GPU "
                                         r"\(gloo\) leave it out$"):
        fsdp.check_fsdp_flags(args)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delattr(FSDPModule, "set_symm_mem_for_comm", raising=False)
    with pytest.raises(SystemExit, match=r"^error: --fsdp-comm symm-mem needs FSDPModule.set_symm_mem_for_comm, "
                                         r"which torch .* lacks; leave it out or upgrade torch$"):
        fsdp.check_fsdp_flags(args)
    monkeypatch.delenv("WORLD_SIZE")
    notes = flags.settle(finetune_optimized.parse_args(["--tiny", "--fsdp-comm", "pg-memory"]))._notes
    assert "--fsdp-comm without --fsdp changes nothing" in notes


def test_two_ranks_match_one_process_baseline_packed_data(tmp_path):
    args = ["--tiny", "--warmup-steps", "0", "--steps", "2", "--seq-len", "64", "--packing"]
    sharded = run("finetune_baseline.py", [*args, "--batch-size", "1"], 2, tmp_path, "fsdp")
    one = run("finetune_baseline.py", [*args, "--batch-size", "2"], None, tmp_path, "one")
    close(sharded["losses"], one["losses"])
    assert sharded["kernels"] == dict.fromkeys(flags.KERNELS, False)


@pytest.mark.parametrize("lora", [[], ["--lora"]], ids=["full", "lora"])
def test_meta_device_build_is_materialized_shard_by_shard(tmp_path, lora):
    """A model that is not --tiny is built on the meta device under --fsdp: a small
    config given as a local --model stands in for LLaMA-3.1-8B."""
    models.tiny_config().save_pretrained(tmp_path / "model")
    doc = run("finetune_baseline.py", ["--no-tiny", "--random-init", "--model", str(tmp_path / "model"),
                                       "--dataset", "synthetic", "--warmup-steps", "0", "--steps", "2",
                                       "--seq-len", "16", "--batch-size", "1", "--lr", "1e-3", *lora], 2, tmp_path)
    assert "meta device" in doc["model"]["source"]
    first = doc["losses"][0]  # HF's init: logits near 0, so the loss is near ln(vocab)
    assert abs(first - 9.01) < 0.5, doc["losses"]


def test_profile_under_torchrun(tmp_path):
    """profile_baseline.py --fsdp: both processes train, rank 0 alone profiles and
    writes; the gradient reduction and weight gathering show as communication."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("--fsdp on GPUs runs one process per GPU: 2 needed")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(ROOT, "profile_baseline.py"), "--fsdp", "--tiny", "--dataset", "synthetic",
               "--seq-len", "16", "--batch-size", "1",
               "--use-custom-rmsnorm", "--use-custom-flce", "--trace-dir", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in fsdp.TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["custom-rmsnorm-flce-fsdp"]  # one profile: rank 0's
    summary = json.loads((tmp_path / "custom-rmsnorm-flce-fsdp" / "summary.json").read_text())
    assert summary["setup"]["world_size"] == 2
    assert summary["categories"]["communication"]["ms_per_step"] > 0
    assert proc.stdout.count("Summary by category") == 1  # printed once


def test_reduce_dtype_auto_is_bfloat16_over_two_processes_of_bf16_weights():
    bf16 = torch.nn.Linear(4, 4).to(torch.bfloat16)
    auto = argparse.Namespace(fsdp_reduce_dtype="auto")
    assert fsdp.reduce_dtype_for(auto, bf16, 2) == "bfloat16"
    assert fsdp.reduce_dtype_for(auto, bf16, 4) == "float32"  # a ring would round at every hop
    assert fsdp.reduce_dtype_for(auto, torch.nn.Linear(4, 4), 2) == "float32"  # float32 weights keep their digits
    frozen_bf16 = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 4))
    frozen_bf16[0].requires_grad_(False)  # LoRA: frozen bf16 base, float32 adapters
    assert fsdp.reduce_dtype_for(auto, frozen_bf16, 2) == "float32"
    frozen_bf16[1].to(torch.bfloat16)
    assert fsdp.reduce_dtype_for(auto, frozen_bf16, 2) == "bfloat16"
    assert fsdp.reduce_dtype_for(argparse.Namespace(fsdp_reduce_dtype="float32"), bf16, 2) == "float32"


def test_keep_gathered_flag_values():
    parse = finetune_optimized.parse_args
    assert parse([]).fsdp_keep_gathered == "auto"
    assert parse(["--fsdp-keep-gathered"]).fsdp_keep_gathered == "on"
    assert parse(["--fsdp-keep-gathered", "off"]).fsdp_keep_gathered == "off"
    with pytest.raises(SystemExit):
        parse(["--fsdp-keep-gathered", "maybe"])


def test_keep_gathered_auto_decides_from_the_measured_peak(monkeypatch):
    """--fsdp-keep-gathered auto keeps the layers' weights when the peak so far plus all of
    them whole (bf16; FP8 where gathered so) fits in 90% of the GPU; at the limit and one
    byte past it. The GPU's numbers are stood in for (one process: the reduction over
    processes returns them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    layers = model.get_decoder().layers
    switched = []
    for layer in layers:  # FSDP's method on a sharded layer; recorded here
        layer.set_reshard_after_forward = (
            lambda flag, recurse=True, _layer=layer: switched.append((_layer, flag, recurse)))
    kept = 2 * sum(p.numel() for layer in layers for p in layer.parameters())
    capacity, peak = 1000 * kept, [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: argparse.Namespace(total_memory=capacity))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *device: peak[0])
    auto = argparse.Namespace(fsdp=True, fsdp_keep_gathered="auto", tiny=False)

    peak[0] = 899 * kept + 1  # one byte past 90%
    decision = fsdp.decide_keep_gathered(auto, model)
    assert decision == {"kept": False, "peak_bytes": peak[0], "weights_bytes": kept, "capacity_bytes": capacity}
    assert "gathered again in backward" in fsdp.keep_gathered_line(decision) and not switched
    peak[0] = 899 * kept  # exactly 90%
    decision = fsdp.decide_keep_gathered(auto, model)
    assert decision["kept"] and decision["peak_bytes"] == peak[0]
    line = fsdp.keep_gathered_line(decision)
    assert "kept from forward to backward from now on" in line and f"{kept / 2**30:.1f} GiB of whole weights" in line
    assert switched == [(layer, False, False) for layer in layers]
    for args in (argparse.Namespace(fsdp=True, fsdp_keep_gathered="on", tiny=False),
                 argparse.Namespace(fsdp=False, fsdp_keep_gathered="auto", tiny=False)):
        assert fsdp.decide_keep_gathered(args, model) is None  # nothing to decide
    assert len(switched) == len(layers)
    # A weight gathered in FP8 (its local tensor gathers itself, as fp8_gather.FP8Shard) is 1 byte, not 2.
    w = layers[0].mlp.down_proj.weight
    w._local_tensor = argparse.Namespace(fsdp_pre_all_gather=None)
    assert fsdp.decide_keep_gathered(auto, model)["weights_bytes"] == kept - w.numel()


def test_the_loop_reports_the_keep_decision(monkeypatch, tmp_path, capsys):
    """The training loop asks once, after KEEP_DECIDED_AFTER steps, prints the line and
    keeps the numbers in its JSON report (the decision stood in for: it needs GPUs)."""
    decision = {"kept": True, "peak_bytes": 2**30, "weights_bytes": 2**29, "capacity_bytes": 2**34}
    asked = []
    monkeypatch.setattr(fsdp, "decide_keep_gathered", lambda args, model: asked.append(1) or dict(decision))
    out = tmp_path / "run.json"
    finetune_baseline.main([*TINY, "--steps", "3", "--json", str(out)])  # the same loop, no kernels: quick
    with open(out) as f:
        doc = json.load(f)
    assert doc["fsdp_keep_gathered_auto"] == {**decision, "after_step": fsdp.KEEP_DECIDED_AFTER} and len(asked) == 1
    assert "after 2 steps the layers' weights are kept from forward to backward from now on" in capsys.readouterr().out


# Run by torchrun on 2 GPUs: a small LLaMA in bf16, sharded by fsdp.shard_model, one forward and
# backward on each process's own tokens; the local gradient shards after a float32 and a
# bfloat16 reduction, compared bit for bit.
REDUCE_CHECK = """
import argparse, sys, torch
sys.path.insert(0, {here!r})
from kernel_ft import fsdp
from transformers import LlamaConfig, LlamaForCausalLM
torch.use_deterministic_algorithms(True)
torch.distributed.init_process_group("nccl")
rank = torch.distributed.get_rank()
torch.cuda.set_device(rank)

def shards(reduce_dtype):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    args = argparse.Namespace(tiny=False, fsdp_reduce_dtype=reduce_dtype)
    assert fsdp.reduce_dtype_for(argparse.Namespace(), model, 2) == "bfloat16"
    fsdp.shard_model(model, args, fsdp.World(rank, 2, rank, torch.device("cuda", rank)))
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(rank)).cuda()
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.to_local().clone() for p in model.parameters()]

f32, bf16 = shards("float32"), shards("bfloat16")
same = sum(torch.equal(a, b) for a, b in zip(f32, bf16))
nonzero = sum(bool(a.abs().sum() > 0) for a in f32)
print(f"rank {{rank}}: {{same}} of {{len(f32)}} equal, {{nonzero}} nonzero", flush=True)
torch.distributed.destroy_process_group()
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_bfloat16_reduction_over_two_gpus_gives_the_float32_gradients(tmp_path):
    script = tmp_path / "reduce_check.py"
    script.write_text(REDUCE_CHECK.format(here=ROOT))
    env = {k: v for k, v in os.environ.items() if k not in fsdp.TORCHRUN_ENV}
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic matmuls: the two backwards are the same
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = sorted(re.findall(r"rank (\d): (\d+) of (\d+) equal, (\d+) nonzero", proc.stdout))
    assert [rank for rank, *_ in found] == ["0", "1"], proc.stdout
    for _, equal, total, nonzero in found:  # every weight's shard: reduced (not zero), the same bits
        assert int(total) > 0 and equal == total == nonzero, proc.stdout


def test_fsdp_without_torchrun_is_one_line(monkeypatch, capsys):
    for name in fsdp.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="--fsdp runs under torchrun") as e:
        finetune_optimized.main(["--fsdp", *TINY, "--steps", "1"])
    assert "\n" not in str(e.value)
    assert "Model:" not in capsys.readouterr().out  # before any work


def test_a_world_size_without_torchrun_is_one_line(monkeypatch, capsys):
    """WORLD_SIZE set by hand (not by torchrun): nothing to choose from, the variables
    torchrun would have set are named, before any work."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="^error: WORLD_SIZE is 2 but RANK, LOCAL_RANK not set: start the processes "
                                         "with torchrun --nproc-per-node 2 "):
        finetune_optimized.main([*TINY, "--steps", "1"])
    assert "Model:" not in capsys.readouterr().out


def test_fsdp_with_lora_4bit_is_one_line(monkeypatch):
    """QLoRA's packed 4-bit weights are not sharded (--lora is)."""
    for name, value in zip(fsdp.TORCHRUN_ENV, ("0", "2", "0")):
        monkeypatch.setenv(name, value)
    args = argparse.Namespace(fsdp=True, lora=True, lora_4bit=True, compile=True)
    with pytest.raises(SystemExit, match="--fsdp with --lora-4bit is not supported"):
        fsdp.check_fsdp_flags(args)
    args.lora_4bit = False
    fsdp.check_fsdp_flags(args)  # --lora and --compile are
