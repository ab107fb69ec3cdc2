"""
Checkpoints: save a run, resume it exactly, export it.

README Step 18 (``--output-dir``, ``--save-every``, ``--resume``) and Step 19 (sharded
checkpoints under ``--fsdp``; tools/export_hf.py turns them into a HF model folder).
What it teaches:

* What "exact" needs. The batches are a pure function of the seed and the step
  (dataloader.training_batches), so a checkpoint that holds the weights (or only the
  LoRA adapters), AdamW's state, the schedule's position and every random
  generator's state resumes to the very losses of the run that never stopped.
* Nothing half-written: a checkpoint is written as checkpoint-K.tmp and renamed
  when complete, so a crash or Ctrl-C during a save never leaves a damaged
  checkpoint under the real name.
* Refusing the wrong resume: the flags that decide a run's numbers and a
  fingerprint of the model are stored with the checkpoint, and ``--resume`` with
  other ones stops in one line that lists the differences.
* Under ``--fsdp`` every process writes its own shards with torch.distributed.checkpoint
  (no process ever holds the whole model). Under ``--ddp`` every process holds the
  same whole model: rank 0 writes it as one process would, every process its own
  random generators.

Nothing runs on import.
"""

import glob
import json
import os
import random
import re
import shutil
import warnings
import zlib

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)

import torch

from kernel_ft import files, flags, models, ddp, fsdp, dataloader

# --------------------------------------------------------------------------------
# Checkpoints: DIR/checkpoint-K holds everything step K+1 needs
# --------------------------------------------------------------------------------
# Layout of DIR/checkpoint-K:
#   model.safetensors + config.json          the model (save_pretrained), or with LoRA
#   adapter_model.safetensors + adapter_config.json     the adapters only
#   optimizer.pt, scheduler.pt               their state_dict()s (torch.save; --ddp-shard-optimizer:
#                                            optimizer_rankR.pt, each process's pieces)
#   rng_state.pt                             python, torch CPU and CUDA generators
#                                            (--ddp: rng_state_rankR.pt, one per process)
#   trainer_state.json                       step K, the flags and model config it was
#                                            made with, the loss history
#   manifest.json                            written last: every other file with its
#                                            size and CRC-32
# It is written as checkpoint-K.tmp and renamed when complete: a crash or Ctrl-C
# during the save never leaves a half checkpoint under the real name. A disk that
# fills up, a copy cut short or a bit flipped later is what the manifest catches:
# --resume reads every file back and compares (CRC-32 runs at several GB/s, about
# the speed the files are read, so the check costs a second per few GB).
CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"
MANIFEST = files.CHECKPOINT_MANIFEST  # files.check_output_path keeps every other output out of the folder
CHECKPOINT_FORMAT = 2  # 2: with a manifest

# The flags that decide a run's numbers: a resumed run must have the same ones.
# The kernels other than AdamW may differ (same results to rounding); the
# optimizer may not (TritonAdamW and torch's AdamW keep their step count differently).
RUN_FLAGS = ("tiny", "seed", "dataset", "packing", "batch_size", "seq_len", "grad_accum", "lr", "steps",
             "warmup_steps", "lr_warmup_steps", "max_grad_norm", "lora", "lora_r", "lora_alpha", "lora_dropout",
             "lora_targets", "lora_4bit", "use_custom_adamw")


def checkpoint_path(output_dir, step):
    return os.path.join(output_dir, f"{CHECKPOINT_PREFIX}{step}")


def existing_checkpoints(output_dir):
    """{step: path} of the checkpoint-K folders in ``output_dir``."""
    found = {}
    for path in glob.glob(os.path.join(output_dir, CHECKPOINT_PREFIX + "*")):
        suffix = os.path.basename(path)[len(CHECKPOINT_PREFIX):]
        if suffix.isdigit() and os.path.isdir(path):
            found[int(suffix)] = path
    return found


def check_no_later_checkpoints(output_dir, start_step):
    """The overwrite rule: a run writes checkpoints after its start step only, so the
    output directory must hold none past it (they would belong to another run, or
    to this run's earlier future)."""
    for path in glob.glob(os.path.join(output_dir, CHECKPOINT_PREFIX + "*")):
        suffix = os.path.basename(path)[len(CHECKPOINT_PREFIX):]
        if suffix.isdigit() and not os.path.isdir(path):
            raise SystemExit(f"error: --output-dir {output_dir}: {path} is not a checkpoint folder, and a run would "
                             f"need that name; move it away or choose another --output-dir")
    for tmp in glob.glob(os.path.join(output_dir, CHECKPOINT_PREFIX + "*.tmp")):
        if not marked_by_a_save(tmp):  # a save of this run would need that name
            raise SystemExit(f"error: --output-dir {output_dir}: {tmp} was not written by this project's checkpoint "
                             f"save, and a save would need that name; move it away or choose another --output-dir")
    later = sorted(k for k in existing_checkpoints(output_dir) if k > start_step)
    if later:
        how = f"resumed from step {start_step}" if start_step else "starting from step 0"
        # The advice names a checkpoint that can be resumed: the latest complete one. Each
        # checkpoint is read once (damage reads every file of it).
        problems = {k: damage(checkpoint_path(output_dir, k)) for k in later}
        complete = [k for k in later if problems[k] is None]
        first = f"{CHECKPOINT_PREFIX}{later[0]}"
        if problems[later[0]]:
            first += f" (not complete: {problems[later[0]]})"
        advice = (f"continue it with --resume {checkpoint_path(output_dir, complete[-1])}, or choose another "
                  f"--output-dir" if complete else "move it away or choose another --output-dir")
        raise SystemExit(f"error: --output-dir {output_dir} already holds {first}, which a run {how} would "
                         f"overwrite; {advice}")


def run_flags(args):
    values = {name: getattr(args, name) for name in RUN_FLAGS}
    values["dataset"] = dataloader.dataset_name(args.dataset)  # the bundled set wherever the repository is
    if args.dataset and os.path.isfile(args.dataset):
        # A local file: what counts is its bytes (the same name with other records
        # is other data), not how its path was spelled.
        values["dataset"] = dataloader.dataset_name(os.path.realpath(args.dataset))
        values["dataset_crc32"] = crc32_of(args.dataset)
    return values


def model_fingerprint(model):
    """The model's config as plain JSON values, less what does not change the numbers."""
    config = model.config.to_dict()
    for key in ("transformers_version", "_name_or_path", "use_cache", "architectures"):
        config.pop(key, None)
    return json.loads(json.dumps(config, default=str, sort_keys=True))


def lora_fingerprint(model):
    if not models.is_peft_model(model):
        return None
    config = model.peft_config["default"].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def rng_states():
    """Every random generator training draws from (dropout): python's, torch's CPU
    generator, each GPU's. The data has its own seeded generator (training_batches)."""
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_states(states):
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# The first file of every checkpoint-K.tmp a run makes: a later run removes such a folder
# (left by a save that was interrupted) only when it holds this mark, never a folder of
# the same name that someone else put there.
WRITING_MARK = ".written_by_kernel_ft"


def marked_by_a_save(tmp):
    """Whether the folder ``tmp`` holds WRITING_MARK: a save of this project made it."""
    return os.path.isfile(os.path.join(tmp, WRITING_MARK))


def fresh_tmp(tmp):
    """Make the folder ``tmp`` a save writes into, marked as this project's. A leftover
    of an interrupted save (marked) is removed; anything else there ends the run in one line."""
    if os.path.lexists(tmp):
        if not os.path.isdir(tmp) or os.path.islink(tmp) or not marked_by_a_save(tmp):
            raise SystemExit(f"error: --output-dir: {tmp} exists and was not written by this project's checkpoint "
                             f"save; move it away (nothing was deleted)")
        shutil.rmtree(tmp)  # left by a save of ours that was interrupted
    os.makedirs(tmp)
    with open(os.path.join(tmp, WRITING_MARK), "w") as f:
        f.write("a checkpoint being written; removed by the next save if the save stopped half-way\n")


def save_checkpoint(args, model, optimizer, scheduler, step, history, rng):
    """Write DIR/checkpoint-``step`` (layout above); return its path. A write that fails
    (a full disk, most often) ends the run in one line that says so, the half-written
    folder removed; the checkpoints before it stay whole."""
    path = checkpoint_path(args.output_dir, step)
    tmp = path + ".tmp"
    if fsdp.is_main_process():
        fresh_tmp(tmp)
    fsdp.barrier()  # --fsdp, --ddp: every process writes into the folder rank 0 made
    try:
        _write_checkpoint(args, model, optimizer, scheduler, step, history, rng, tmp, path)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        # What writing files raises: OSError (ENOSPC), torch.save's RuntimeError from its
        # writer, DCP's CheckpointException with every process's error (a full disk on 2 x H200
        # at 20B: "unexpected pos 704 vs 598"). Anything else (a bug, Ctrl-C) goes on as it is.
        if not (isinstance(e, (OSError, RuntimeError)) or type(e).__name__ == "CheckpointException"):
            raise
        raise SystemExit(_write_failed(args.output_dir, tmp, step, e)) from None
    return path


def _write_failed(output_dir, tmp, step, error):
    """The one line for a checkpoint that could not be written: why, and how much room its
    disk has once the half-written folder is gone (each process removes what it can), next
    to the size of the last checkpoint, which stays whole."""
    shutil.rmtree(tmp, ignore_errors=True)
    free = shutil.disk_usage(output_dir).free
    found = existing_checkpoints(output_dir)
    earlier = found[max(found)] if found else None
    kept = (f"the last checkpoint, {earlier} ({folder_bytes(earlier) / 1e9:.1f} GB), stays whole" if earlier
            else "no earlier checkpoint exists")
    return (f"error: checkpoint-{step} could not be written into --output-dir {output_dir} ({files.one_line(error)}); "
            f"{free / 1e9:.1f} GB are free on its disk once the half-written folder is removed; {kept}")


def folder_bytes(folder):
    """The bytes of the files under ``folder``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(folder) for f in names)


def _write_checkpoint(args, model, optimizer, scheduler, step, history, rng, tmp, path):
    """save_checkpoint's writes, into ``tmp``, renamed ``path`` when whole."""
    rank, ranks = fsdp.rank_and_size()
    mode = parallel_mode(args)
    pieces = ddp.optimizer_in_pieces(model)  # --ddp-shard-optimizer: each process's AdamW state is its own
    if mode == "fsdp":
        save_sharded(tmp, model, optimizer)
    else:
        ddp.gather_now(model)  # --ddp-shard-optimizer: the weights whole again (every process takes part)
        if rank == 0:  # one process, or --ddp's rank 0: every rank holds the same model (and AdamW state)
            model.save_pretrained(tmp)  # safetensors; a PeftModel writes its adapters only
        if rank == 0 or pieces:
            torch.save(optimizer.state_dict(), os.path.join(tmp, optimizer_file(pieces, rank)))
    torch.save(rng, os.path.join(tmp, rng_file(mode, rank)))  # each process's own generators
    fsdp.barrier()
    if rank != 0:
        fsdp.barrier()  # until rank 0 has renamed the folder
        return
    torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
    files.write_json_atomic(os.path.join(tmp, TRAINER_STATE), {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "total_steps": args.warmup_steps + args.steps,
        "model_name": "tiny" if args.tiny else args.model,
        "flags": run_flags(args),
        "model_config": model_fingerprint(model),
        "lora_config": lora_fingerprint(model),
        "history": history,
        "world_size": ranks,  # --fsdp: the shards fit this many processes only; --ddp: the data order
        "sharded": mode == "fsdp",
        "replicated": mode == "ddp",
    })
    os.remove(os.path.join(tmp, WRITING_MARK))  # a finished checkpoint holds its own files only
    write_manifest(tmp)  # last: a checkpoint whose manifest matches its files is whole
    os.rename(tmp, path)
    fsdp.barrier()


def parallel_mode(args):
    """"fsdp", "ddp" or "one": how the run spreads over processes, which decides what
    a checkpoint holds and which runs can resume it."""
    return "fsdp" if getattr(args, "fsdp", False) else "ddp" if getattr(args, "ddp", False) else "one"


def optimizer_file(pieces, rank):
    """The optimizer's state: one file, or under --ddp-shard-optimizer one per process
    (the moments of its pieces of the weights)."""
    return f"optimizer_rank{rank}.pt" if pieces else "optimizer.pt"


def rng_file(mode, rank):
    """One process's random generators: every process keeps its own under --fsdp and --ddp."""
    return "rng_state.pt" if mode == "one" else f"rng_state_rank{rank}.pt"


SHARDED_DIR = "sharded"  # --fsdp: DCP's files in DIR/checkpoint-K/sharded (tools/export_hf.py
#                           turns them into a save_pretrained folder)


def sharded_options(model):
    """What the DCP shards hold: the whole model, or with LoRA the adapters only
    (as save_pretrained writes a PeftModel's adapters only): the frozen weights are
    the ones the run started from, rebuilt by load_model, and saving them at every
    checkpoint would cost 16 GB for an 8B model instead of some 100 MB. strict=False:
    the frozen weights are then, rightly, missing on loading (load_sharded checks
    that nothing else is)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = models.is_peft_model(model)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def save_sharded(folder, model, optimizer):
    """--fsdp: the model's and AdamW's state as torch.distributed.checkpoint (DCP)
    shards: every process writes its own shards, in parallel, none gathers the
    whole model. get_state_dict names the optimizer's state by parameter name, as
    the model's, so the two are resumed together by set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=sharded_options(model))
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=os.path.join(folder, SHARDED_DIR))


def load_sharded(folder, model, optimizer):
    """Read save_sharded's shards into this process's shards of ``model`` and ``optimizer``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # get_state_dict creates AdamW's state first (one step with zero gradients and
    # lr 0, which changes no weight), so that there are tensors to load into.
    options = sharded_options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(folder, SHARDED_DIR))
    result = set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                            options=options)
    # DCP writes the values into the shards' memory without moving their version counters:
    # moved here, so that a copy cached on (memory, version) is made again (the FP8 casts of
    # frozen weights, kernel_ft/fp8_gather.py).
    for p in model.parameters():
        torch.autograd.graph.increment_version(p.to_local() if hasattr(p, "to_local") else p)
    frozen = frozen_parameter_names(model)
    missing = [k for k in result.missing_keys if k not in frozen]
    if missing or result.unexpected_keys:
        raise SystemExit(f"error: --resume {folder}: the shards do not fit this model "
                         f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})")


def frozen_parameter_names(model):
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def load_sharded_model(folder, model, flag):
    """Read the model part of save_sharded's shards into ``model`` whole, in this one
    process: no process group, no GPU, no torchrun (tools/export_hf.py).

    DCP's metadata gives each saved tensor's full shape and dtype; each is
    allocated so, and dcp.load (no_dist) fills it from every process's file,
    the pieces put together. The tensors then become the model's own (assign:
    ``model`` may be built on the meta device, no memory spent on weights that
    would be overwritten). With LoRA the shards hold the adapters only
    (sharded_options): the frozen weights are left as they are.
    """
    import torch.distributed.checkpoint as dcp

    shards = os.path.join(folder, SHARDED_DIR)
    saved = dcp.FileSystemReader(shards).read_metadata().state_dict_metadata
    skip = frozen_parameter_names(model) if sharded_options(model).ignore_frozen_params else set()
    wanted = {name: t for name, t in model.state_dict(keep_vars=True).items() if name not in skip}
    weights = {}
    for name, tensor in wanted.items():
        meta = saved.get(f"model.{name}")  # save_sharded's dict: {"model": ..., "optimizer": ...}
        if meta is None or tuple(meta.size) != tuple(tensor.shape):
            found = "is not in the shards" if meta is None else f"has shape {tuple(meta.size)} there"
            raise SystemExit(f"error: {flag} {folder}: the shards do not fit the model rebuilt from its "
                             f"{TRAINER_STATE}: {name} {found}")
        weights[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    state = {"model": weights}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=shards, no_dist=True)
    model.load_state_dict(state["model"], strict=not skip, assign=True)
    return model


def crc32_of(path):
    """The CRC-32 of a file's bytes, read in 8 MiB blocks, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def write_manifest(folder):
    """List every file of the checkpoint in ``folder`` with its size and CRC-32."""
    listed = {}
    for root, _, names in os.walk(folder):
        for name in names:
            file = os.path.join(root, name)
            relative = os.path.relpath(file, folder)
            if relative != MANIFEST:
                listed[relative] = {"bytes": os.path.getsize(file), "crc32": crc32_of(file)}
    files.write_json_atomic(os.path.join(folder, MANIFEST), {"files": dict(sorted(listed.items()))})


def damage(folder):
    """None if the checkpoint in ``folder`` is whole (its files are those of its
    manifest, byte for byte), else what is wrong, naming the file."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            listed = json.load(f)["files"]
    except FileNotFoundError:
        return f"no {MANIFEST}: its save never completed"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({files.one_line(e)})"
    forged = manifest_problem(folder, listed)
    if forged:
        return f"{MANIFEST} is not one this code wrote ({forged})"
    for relative, written in listed.items():
        file = os.path.join(folder, relative)
        if not os.path.isfile(file):
            return f"{relative} is missing"
        size = os.path.getsize(file)
        if size != written["bytes"]:
            return f"{relative} is damaged ({size:,} bytes, {written['bytes']:,} were written)"
        if crc32_of(file) != written["crc32"]:
            return f"{relative} is damaged (its bytes differ from those written: CRC-32 mismatch)"
    return None


def manifest_problem(folder, listed):
    """What makes a manifest's file list one this code did not write (None if nothing):
    not a {name: {"bytes": int, "crc32": 8 hex digits}} mapping, or a name outside ``folder``."""
    if not isinstance(listed, dict) or not listed:
        return "no list of files"
    root = os.path.realpath(folder)
    for relative, written in listed.items():
        crc = written.get("crc32") if isinstance(written, dict) else None
        if not isinstance(written.get("bytes") if crc else None, int) or not re.fullmatch(r"[0-9a-f]{8}", str(crc)):
            return f"the entry of {relative!r} has no byte count and CRC-32"
        inside = os.path.realpath(os.path.join(folder, relative))
        if os.path.isabs(relative) or os.path.commonpath([root, inside]) != root:
            return f"{relative!r} is not a file of the checkpoint folder"
    return None


def latest_complete(folder, flag):
    """A run's folder given to --resume: its latest checkpoint that is whole (said in a note)."""
    passed = []
    for step, path in sorted(existing_checkpoints(folder).items(), reverse=True):
        problem = damage(path)
        if problem is None:
            skipped = f" ({'; '.join(passed)})" if passed else ""
            flags.note(f"{flag} {folder}: taking its latest complete checkpoint, {path}{skipped}")
            return path
        passed.append(f"{os.path.basename(path)} skipped: {problem}")
    raise SystemExit(f"error: {flag} {folder}: no complete checkpoint in it ({'; '.join(passed[:3])})")


def read_checkpoint_state(path, flag="--resume"):
    """--resume (or ``flag``, the argument that named ``path``): the checkpoint's
    trainer_state.json (its "path": the checkpoint folder), or a one-line error.
    ``path`` is a checkpoint-K folder, verified against its manifest, or the run's
    folder that holds them: its latest complete checkpoint is taken."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise SystemExit(f"error: {flag} {path}: no such checkpoint directory")
    if not os.path.exists(os.path.join(path, TRAINER_STATE)) and existing_checkpoints(path):
        path = latest_complete(path, flag)
    try:
        with open(os.path.join(path, TRAINER_STATE)) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"error: {flag} {path}: not a checkpoint (no {TRAINER_STATE}); checkpoints are the "
                         f"{CHECKPOINT_PREFIX}K folders of an --output-dir") from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {flag} {path}: cannot read {TRAINER_STATE} ({files.one_line(e)})") from None
    if not isinstance(state, dict):
        raise SystemExit(f"error: {flag} {path}: {TRAINER_STATE} holds a {type(state).__name__}, not a checkpoint's "
                         f"state")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"error: {flag} {path}: checkpoint format {state.get('format')!r}, "
                         f"this code reads {CHECKPOINT_FORMAT}")
    problem = damage(path)
    if problem:
        raise SystemExit(f"error: {flag} {path}: {problem}; resume from another checkpoint (given the run's "
                         f"folder, --resume takes its latest complete one)")
    expected = {"step": int, "flags": dict, "model_config": dict, "history": dict, "model_name": str}
    wrong = [key for key, kind in expected.items() if not isinstance(state.get(key), kind)]
    if wrong:
        raise SystemExit(f"error: {flag} {path}: {TRAINER_STATE} lacks {', '.join(wrong)} (or holds another type): "
                         f"not a checkpoint this code wrote")
    state["path"] = path
    return state


def check_same_run(args, state):
    """The flags that decide the numbers must be those the checkpoint was made with."""
    name = "tiny" if args.tiny else args.model
    if state["model_name"] != name:
        raise SystemExit(f"error: --resume {state['path']}: the checkpoint is of {state['model_name']}, "
                         f"this run trains {name}")
    then, now = state["flags"], json.loads(json.dumps(run_flags(args)))
    if then != now:
        diff = flags.differences({"--" + k.replace("_", "-"): v for k, v in then.items()},
                                 {"--" + k.replace("_", "-"): v for k, v in now.items()})
        raise SystemExit(f"error: --resume {state['path']}: made with other settings: {diff}; "
                         f"resume with the flags of the run that saved it")
    if not state["step"] < args.warmup_steps + args.steps:
        raise SystemExit(f"error: --resume {state['path']}: the run is complete ({state['step']} steps)")
    now_mode = parallel_mode(args)
    then_mode = "fsdp" if state.get("sharded") else "ddp" if state.get("replicated") else "one"
    then_size, now_size = state.get("world_size", 1), fsdp.rank_and_size()[1] if now_mode != "one" else 1
    if then_mode != now_mode or then_size != now_size:
        def how(mode, size):
            return f"--{mode} with {size} processes" if mode != "one" else "one process without --fsdp or --ddp"
        raise SystemExit(f"error: --resume {state['path']}: written by {how(then_mode, then_size)}, this run is "
                         f"{how(now_mode, now_size)}; resume it as it was written (--batch-size is per process)")


def check_same_model(state, model, flag="--resume"):
    """The architecture (and the LoRA setup) must be the checkpoint's."""
    if state["model_config"] != model_fingerprint(model):
        raise SystemExit(f"error: {flag} {state['path']}: the checkpoint is of another model: "
                         f"{flags.differences(state['model_config'], model_fingerprint(model))}")
    if state["lora_config"] != lora_fingerprint(model):
        raise SystemExit(f"error: {flag} {state['path']}: the checkpoint has other LoRA adapters: "
                         f"{flags.differences(state['lora_config'] or {}, lora_fingerprint(model) or {})}")


def load_checkpoint(path, model, optimizer, scheduler):
    """Load a checkpoint's weights (or adapters), optimizer, schedule and random state
    into a freshly built ``model``, ``optimizer`` and ``scheduler`` of the same run."""
    from safetensors.torch import load_file

    device = str(next(model.parameters()).device)
    rank = fsdp.rank_and_size()[0]
    # check_same_run made sure this run spreads over processes as the one that saved
    rng = os.path.join(path, rng_file("one", rank))
    if not os.path.isfile(rng):  # --fsdp or --ddp: one file per process
        rng = os.path.join(path, rng_file("ddp", rank))
    if os.path.isdir(os.path.join(path, SHARDED_DIR)):  # --fsdp
        load_sharded(path, model, optimizer)
        scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt")))
        set_rng_states(torch.load(rng))
        return
    if models.is_peft_model(model):
        from peft import set_peft_model_state_dict

        weights = load_file(os.path.join(path, "adapter_model.safetensors"), device=device)
        result = set_peft_model_state_dict(model, weights)
        if result.unexpected_keys:
            raise SystemExit(f"error: --resume {path}: adapter tensors this model lacks: {result.unexpected_keys[:3]}")
    else:
        weights = {}
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):  # one file, or the shards
            weights.update(load_file(file, device=device))
        ddp.gather_now(model)  # --ddp-shard-weights: whole weights to load into (every process takes part)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        ddp.pieces_from_whole(model)
        # A tied LM head is saved once, as the embedding: loading that loaded both.
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded = {params[k].data_ptr() for k in weights if k in params}
        missing = [k for k in missing if k not in params or params[k].data_ptr() not in loaded]
        if missing or unexpected:
            raise SystemExit(f"error: --resume {path}: the weights do not fit this model "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    pieces = ddp.optimizer_in_pieces(model)
    state = os.path.join(path, optimizer_file(pieces, rank))
    if not os.path.isfile(state):
        other, flag = ("without", "--no-ddp-shard-optimizer") if pieces else ("with", "--ddp-shard-optimizer")
        raise SystemExit(f"error: --resume {path}: its optimizer state was written {other} --ddp-shard-optimizer "
                         f"(on by default with --ddp); resume with {flag}, as the run that saved it")
    optimizer.load_state_dict(torch.load(state, map_location=device))
    scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt")))
    set_rng_states(torch.load(rng))
