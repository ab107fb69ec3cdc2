"""
A run, set up once, in one order, for every script that trains: the fine-tune
scripts, the profile (profile_baseline.py) and the tools.

    checks        every flag that needs no model, before anything is loaded
    load          the data records, the model, the tokenized data, LoRA
    assemble      the kernels (kernel_ft.apply, through apply_kernels), FSDP,
                  torch.compile, CUDA graphs, the optimizer
    run_finetune  all of it plus the loop (training.run_training), the report,
                  the exit code of an interrupted or diverged run

The order matters and is written here only: the kernels go into the model that
LoRA wrapped, FSDP shards the model with the kernels in it, torch.compile and the
CUDA graph capture what was sharded, and the optimizer takes the parameters as
they are after all of that (fully_shard replaces every parameter).

This file composes the workload (flags, models, dataloader, fsdp, checkpoints,
training, reporting) with the library (kernel_ft.patching; kernel_ft.fp8_gather
under --fsdp --fp8): the other workload modules import no kernel. Nothing runs on
import.
"""

import argparse
import functools
import os
import signal
import sys
import warnings

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)
from swap_common import vocabulary_size
import torch

from kernel_ft import files, flags, models, ddp, fsdp, dataloader, checkpoints, reporting, training
from kernel_ft import fp8_gather
from kernel_ft.patching import APPLIED, KERNELS, LEFT_OUT, apply
from adamw_kernel import TritonAdamW
import attention_routing

# How each report entry is labelled in a run's output (kernel_ft.apply says what happened).
LABELS = {"fp8": "FP8 matmuls:", "rmsnorm": "Custom norm:", "residual": "Residual adds:",
          "swiglu": "Custom swiglu:", "flce": "Custom loss:",
          "ce": "Custom loss:", "rope": "Custom rope:", "attention": "Custom attn:", "lora": "Custom lora:",
          "projections": "Shared inputs:"}


# --------------------------------------------------------------------------------
# The kernels: the --use-custom-* flags are kernel_ft.apply's switches
# --------------------------------------------------------------------------------
def apply_switches(kernels):
    """kernel_ft.apply's keyword arguments from the --use-custom-* flags
    (flags.kernels_from_args): each kernel on or off, fp8 the recipe or None and its
    gradients' format and accumulation."""
    return {"fp8": kernels.get("fp8") or None, "fp8_grads": kernels.get("fp8_grads", "e4m3"),
            "fp8_fast_accum": bool(kernels.get("fp8_fast_accum")),
            # None (a flag left at finetune_optimized.py's default): on where it applies, as apply's own default
            **{name: kernels.get(name, False) in (None, True) for name in KERNELS if name != "fp8"}}


def apply_kernels(model, kernels):
    """Switch into ``model`` the kernels that ``kernels`` ({name: True, False or None}, see
    flags.kernels_from_args) turns on, through ``kernel_ft.apply`` (the call a user's
    own script makes). A kernel asked for (True) that cannot compute the model's function
    ends the run in one line; one left at its default (None) is then left to PyTorch,
    said in one line, and ``kernels`` records what each came to (True or False). Returns
    ``(loss_fn, make_optimizer)`` for training.run_training. With every kernel off (and
    no LoRA on a bf16 model) this is the plain HF baseline.
    """
    switches = apply_switches(kernels)
    defaulted = {name for name in KERNELS if kernels.get(name, False) is None}
    with warnings.catch_warnings():  # apply's warning of what it left out: said below, per kernel
        warnings.filterwarnings("ignore", message="kernel_ft.apply: left to PyTorch")
        report = apply(model, strict=False, **switches)
    for name, why in report.left_out.items():
        if name not in defaulted:
            flag = "--fp8" if name == "fp8" else f"--use-custom-{name}"
            undo = "run without it" if name == "fp8" else f"run with --no-use-custom-{name}"
            raise SystemExit(f"error: {flag}: {why}; {undo}")
    for name in defaulted:
        kernels[name] = name in report.applied
    for name, entry in report.items():
        if entry["status"] == LEFT_OUT:
            print(f"{LABELS[name]:<14} left to PyTorch: {entry['detail']}")
            continue
        if entry["status"] == APPLIED or (name == "projections" and kernels.get("projections")):
            print(f"{LABELS[name]:<14} {entry['detail']}")
    if "attention" in report.applied and say_attention_choice not in attention_routing.CHOICE_LISTENERS:
        attention_routing.CHOICE_LISTENERS.append(say_attention_choice)  # rows of one document: what was measured
    active = [name for name in flags.KERNELS if name in report.applied or (name == "adamw" and kernels.get(name))]
    if "lora" in report.applied:
        active.append("lora")
    if "fp8" in report.applied:
        fast = ", fast accumulation" if switches["fp8_fast_accum"] else ""
        active.append(f"fp8 ({switches['fp8']}, {switches['fp8_grads']} gradients{fast})")

    # The loss: HF's own call; with flce or ce the model computes it with our kernels.
    loss_fn, make_optimizer = training.hf_loss, training.pytorch_adamw
    if kernels.get("adamw"):  # a different optimizer class, same defaults and signature
        make_optimizer = TritonAdamW
        print("Custom optim:  fused Triton AdamW step (same hyperparameters as torch.optim.AdamW)")
        if switches["fp8"] == "tensorwise":  # the loop writes weights only in step(): safe (adamw_kernel.py)
            make_optimizer = functools.partial(TritonAdamW, fp8_weight_amax=True)
    # LoRA: the adapters' products in the model's dtype (not a kernel: PEFT's float32
    # compute path switched off). The baseline keeps PEFT's default.
    dtype = models.lora_compute_dtype(model)
    if dtype is not None:
        loss_fn = models.adapters_compute_in(dtype, model, loss_fn)
        print(f"LoRA compute:  adapters kept in float32, their products in {str(dtype).replace('torch.', '')} "
              f"(autocast; no float32 copies of the layer inputs)")
    print(f"Kernels:       {', '.join(active) if active else 'none (PyTorch / HF)'}")
    return loss_fn, make_optimizer


# --------------------------------------------------------------------------------
# The run, in its one order
# --------------------------------------------------------------------------------
def load(args, world=None):
    """The data records, the model, the tokenized data (None: synthetic) and, with
    --lora, the adapters. Returns (model, model_info, data). A bad --dataset fails
    before the model is built."""
    records = dataloader.load_records(args.dataset)
    model, model_info = models.load_model(args, world)
    data = dataloader.prepare_data(args, records, vocabulary_size(model))
    models.avoid_per_shape_attention_plans(args, data)
    if data is not None:  # the sliding window a dense mask must apply (the batches build it)
        data.dense_mask = not models.document_attention(args)
        data.mask_dtype = models.mask_dtype(model)
        data.mask_window = models.dense_mask_window(args, data, model.config, documents=not data.dense_mask)
    if getattr(args, "eval_every", None) and data is not None and not data.held_out:
        raise SystemExit(f"error: --eval-every: {data.name} leaves no held-out example to evaluate on (its "
                         f"held-out split is {dataloader.EVAL_FRACTION:.0%} of the records); use a larger dataset "
                         f"or leave --eval-every out")
    if args.lora:
        model = models.apply_lora(model, args)
    return model, model_info, data


def assemble(args, model, data, switch_in, world, after_kernels=None):
    """The kernels (``switch_in(model, kernels)`` -> (loss_fn, make_optimizer)), then
    ``after_kernels(model)`` if given, FSDP, torch.compile, CUDA graphs, the optimizer.
    Returns (kernels, loss_fn, optimizer, graphs)."""
    kernels = flags.kernels_from_args(args)
    if kernels_default_attention(args, model) and kernels["attention"] is False:
        # Rows SDPA cannot run through its causal kernels (kernels_default_attention): ours
        # is faster on every row, packed or not, and lets the step run as a CUDA graph.
        # On a GPU, rows of one document: the faster of ours and SDPA's, measured.
        kernels["attention"] = None  # where it applies
    loss_fn, make_optimizer = switch_in(model, kernels)
    if data is not None and not data.dense_mask and not kernels["attention"]:
        # Packed rows planned for the attention kernel, which could not go in: the model's own
        # attention keeps each document apart only through a dense mask (with its window).
        data.dense_mask = True
        data.mask_window = models.dense_mask_window(args, data, model.config, documents=False)
    if data is not None and data.dense_mask and getattr(args, "packing", False) and not world:
        # One process alone: under --fsdp the unsharded model may still be on the host.
        dataloader.check_dense_mask(model, data)
    if after_kernels:
        after_kernels(model)
    if world and args.ddp:  # after the kernels: the swapped modules are what is replicated
        ddp.replicate_model(model, world, args.ddp_bucket_mb, flags.shards_optimizer(args),
                             flags.gather_ahead(args),
                             getattr(args, "ddp_copy_engines", True), getattr(args, "ddp_embedding_rows", True),
                             getattr(args, "ddp_shard_weights", False))
    elif world:  # after the kernels: the swapped modules are what is sharded
        fsdp.shard_model(model, args, world)
        if flags.fp8_gathered(args):  # before the first forward: the weights' first gather is in FP8
            count = fp8_gather.attach(model)
            print(f"FSDP FP8:      {count} weights all-gathered in FP8 (each process casts its shard with the "
                  f"whole weight's scale)")
    models.compile_decoder(model, args)  # after the kernels (and LoRA): they are what the graphs hold
    graphs = training.use_cuda_graphs(args, model, data)
    # Taken now: fully_shard replaced every parameter with a sharded one (DTensor).
    # --ddp-shard-optimizer: the pieces of the split weights instead of the weights.
    optimizer = make_optimizer(ddp.optimizer_parameters(model, models.trainable_parameters(model)), lr=args.lr,
                               **({"capturable": True} if graphs else {}))
    ddp.attach_optimizer(model, optimizer)
    return kernels, loss_fn, optimizer, graphs


def say_attention_choice(line):
    print(f"Attention:     {line}", flush=True)


def kernels_default_attention(args, model):
    """--use-custom-attention left at its default, and either SDPA would not take these
    rows through its causal flash or cuDNN kernels: the model's attention is
    transformers' eager one (Gemma-2's soft-capped scores), or its layers slide a window
    shorter than the row (Mistral, Phi-3, Qwen2 and Gemma-3 past their window), which
    SDPA can only apply as a dense [B, 1, T, T] mask (the kernel skips the tiles outside
    the window); or the model is on a GPU, where rows of one document run whichever of
    ours and SDPA's is measured faster for their shape (attention_routing.plain_rows_to_theirs)."""
    if getattr(args, "use_custom_attention", False) is not None:
        return False
    window, sliding = models.sliding_layers(model.config)
    return model.config._attn_implementation == "eager" or bool(window and args.seq_len > window and any(sliding)) \
        or ("cuda" if torch.cuda.is_available() else "cpu") in attention_routing.MEASURED_DEVICES  # the run's device


def check_model_flags(args):
    """The checks of the flags that shape the model and its training, for every script that
    trains: LoRA, FP8, the optimizer in backward, then --fsdp's or --ddp's check of its environment."""
    models.check_lora_flags(args)
    for flag in ("--fp8", "--torchao-fp8"):  # flags that cannot go together, before --fsdp's check
        flags.check_fp8_flags(args, flag)
    flags.check_optimizer_in_backward(args)
    flags.check_shard_weights(args)
    fsdp.check_fsdp_flags(args)


def print_parallel_choice(settings):
    if getattr(settings, "parallel_choice", None):
        print(f"Parallel:      {settings.parallel_choice}", flush=True)


def choose_parallel(settings):
    """torchrun started several processes and neither --fsdp nor --ddp was given. The
    fastest mode whose state fits this device with room for activations (fsdp.REPLICA_SHARE
    of its memory), measured in this order (NOTES.md, Step 19): a whole copy per process
    (--ddp, no weight gathers); the decoder layers' weights sharded too (--ddp
    --ddp-shard-weights, where it applies); else --fsdp. --ddp-shard-weights given alone
    skips the whole copy. Returns the settings with the choice, and with the line that
    says why in ``parallel_choice`` (printed at the start, kept in the JSON)."""
    processes = flags.processes_started()
    if settings.fsdp or settings.ddp or processes == 1:
        return settings
    missing = [name for name in fsdp.TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise SystemExit(f"error: WORLD_SIZE is {processes} but {', '.join(missing)} not set: start the processes "
                         f"with torchrun --nproc-per-node {processes} {os.path.basename(sys.argv[0])} ...")
    need, memory, where = fsdp.replica_memory(settings)
    room = fsdp.REPLICA_SHARE * memory
    gib = lambda n: f"~{n / 2**30:.2f} GiB"  # noqa: E731 - a local format
    held = ("frozen weights" if getattr(settings, "lora", False) else
            f"weights, gradients and 1/{processes} of AdamW state" if flags.shards_optimizer(settings)
            else "weights, gradients and AdamW state")
    asked_pieces = getattr(settings, "ddp_shard_weights", False)
    if asked_pieces:  # asked for where it cannot run: its own refusal, whatever fits
        flags.check_shard_weights(settings.but(ddp=True))
    sharded = None  # --ddp-shard-weights' state, where it applies and releases a weight
    if flags.shard_weights_refusal(settings.but(ddp=True, ddp_shard_weights=True)) is None:
        sharded = fsdp.shard_weights_memory(settings)
    replicate = need <= room and not (asked_pieces and sharded is not None)
    pieces = not replicate and sharded is not None and sharded <= room
    start = f"torchrun started {processes} processes without --fsdp or --ddp, so "
    share = f"{fsdp.REPLICA_SHARE:.0%} of the {memory / 2**30:.1f} GiB {where}"
    if replicate:
        why = (f"{start}--ddp: a whole copy per process (its {held}, {gib(need)}, fit in {share}); pass --fsdp to "
               f"shard it")
    elif pieces:
        whole = "--ddp-shard-weights was given" if asked_pieces else f"a whole copy's {held}, {gib(need)}, exceed"
        why = (f"{start}--ddp --ddp-shard-weights: each process keeps 1/{processes} of the decoder layers' "
               f"weights, whole only around their use (at most {gib(sharded)} per process before activations, which "
               f"fits in {share}; {whole}); pass --fsdp for FSDP2")
    else:
        over = ([f"its {held}, {gib(need)}"] if need > room else []) + (
            [f"--ddp-shard-weights' {gib(sharded)}"] if sharded is not None else [])
        given = "; --ddp-shard-weights was given, so no whole copy" if need <= room else ""
        why = (f"{start}--fsdp: the model sharded over them ({', and '.join(over)}, exceed {share}{given}); pass "
               f"--ddp to copy it whole anyway")
    chosen = settings.but(fsdp=not (replicate or pieces), ddp=replicate or pieces,
                          ddp_shard_weights=asked_pieces or pieces, parallel_choice=why)
    check_model_flags(chosen)  # what the chosen mode refuses (FP8, the optimizer in backward)
    return chosen.noted(*flags.idle_parallel_flags(chosen))


def settle(args):
    """Every check of a script's flags that needs no model, right after parsing (a
    mistake costs a second, not a load), then the defaults (flags.settle). Returns
    (settings, resumed): the read-only Settings every module reads from then on, and
    the checkpoint state to resume from (None: a new run). ``args`` is not changed.
    Checks what the script has of --json, --trace-dir, --resume and --output-dir."""
    a = argparse.Namespace(**vars(args))  # the working copy, settled at the end
    for flag, options in (("--json", dict(suffix=".json")), ("--trace-dir", dict(directory=True))):
        name = flag[2:].replace("-", "_")
        if getattr(a, name, None):
            setattr(a, name, files.check_output_path(getattr(a, name), flag, inputs=files.input_paths(a), **options))
    check_model_flags(a)
    resumed = None
    if hasattr(a, "resume"):  # the fine-tune scripts: checkpoints
        resumed = checkpoints.read_checkpoint_state(a.resume) if a.resume else None
        if resumed:
            a.resume = resumed["path"]  # the checkpoint folder, also when --resume named the run's folder
        flags.check_output_flags(a)
    settings = flags.settle(a)
    if hasattr(settings, "fsdp"):  # the scripts that train under torchrun themselves
        settings = choose_parallel(settings.but(parallel_choice=None))
    return settings, resumed


def run_finetune(args, title, script, switch_in):
    """Everything a fine-tune script does after parsing its flags.

    ``switch_in(model, kernels)`` is the script's own choice of what to train with:
    it returns ``(loss_fn, make_optimizer)``, a loss ``loss_fn(model, batch)``
    (a batch dict, see dataloader.py) and an optimizer factory ``make_optimizer(params,
    lr)``, and prints what it chose. With --lora the model it gets is already
    wrapped by PEFT, and the optimizer is given the adapters' parameters only.
    SIGINT (Ctrl-C) or SIGTERM writes the completed steps (marked partial) and exits
    130 or 143; a diverged run (NaN or infinite loss) writes them and stops with an error.
    """
    args, resumed = settle(args)
    world = fsdp.init_distributed(args)  # --fsdp: rank 0 prints from here on
    env = reporting.environment_info()
    reporting.print_banner(title, env)
    flags.print_notes(args)
    print_parallel_choice(args)
    if resumed:
        checkpoints.check_same_run(args, resumed)
    if args.output_dir:
        checkpoints.check_no_later_checkpoints(args.output_dir, resumed["step"] if resumed else 0)

    model, model_info, data = load(args, world)
    if resumed:
        checkpoints.check_same_model(resumed, model)
    model_info["trainable_parameters"] = sum(p.numel() for p in models.trainable_parameters(model))
    accum = f" x {args.grad_accum} micro-batches per step" if args.grad_accum > 1 else ""
    per = f" per process, {world.size} processes" if world else ""
    print(f"Batch:         {args.batch_size} x {args.seq_len} tokens{per}{accum}, lr {args.lr:g}, seed {args.seed}")
    kernels, loss_fn, optimizer, graphs = assemble(args, model, data, switch_in, world)
    scheduler = training.make_scheduler(optimizer, args)
    training.print_schedule(args)
    if resumed:
        checkpoints.load_checkpoint(args.resume, model, optimizer, scheduler)
        if graphs:
            training.keep_capturable(optimizer)
        print(f"Resumed:       {args.resume}: step {resumed['step']} of {args.warmup_steps + args.steps} done")
    if getattr(args, "optimizer_in_backward", False):  # after the resume: the hooks update the loaded state
        optimizer.update_in_backward()
        print("Optimizer:     each weight updated inside backward as soon as its gradient is ready, the gradient "
              "freed at once (--optimizer-in-backward)")
    with training.stop_on_signals():  # SIGINT, SIGTERM: finish the step, save, write, exit 128 + signal
        results = training.run_training(args, model, loss_fn, optimizer, data, scheduler, resumed, graphs)
        results["kernels"] = kernels
        write = args.json and fsdp.is_main_process()  # --fsdp: rank 0 writes the one report
        if write:
            reporting.write_json(args.json, script, args, env, model_info, results)
    finish(args, title, results, write)
    return results


def finish(args, title, results, written):
    """The end of a fine-tune run: the results, or the error of a diverged run, or the
    exit code of an interrupted one (128 + the signal's number, what a shell reports
    for a process the signal ended)."""
    where = f"wrote them to {args.json} (marked partial)" if written else "not written (no --json)"
    done = f"{len(results['steps'])} of {results['planned_steps'] - results['start_step']} steps completed"
    if results["diverged_at_step"]:
        step = results["steps"][-1]
        kept = (f"the last checkpoint, {results['checkpoints'][-1]}, stays" if results["checkpoints"]
                else "no checkpoint was saved")
        norm = "not computed" if step["grad_norm"] is None else f"{step['grad_norm']:.4g}"
        raise SystemExit(f"error: step {step['step']}: loss {step['loss']:.4g}, gradient norm {norm}: "
                         f"training diverged and stopped ({done}, {where}; {kept}); lower --lr, or pass "
                         f"--skip-nonfinite-steps to skip such steps")
    if results["partial"]:
        print(f"\nInterrupted ({results['stop_reason']}): {done}, {where}", flush=True)
        raise SystemExit(128 + signal.Signals[results["stop_reason"]].value)
    reporting.print_results(f"{title}: results", results)
    if written:
        print(f"Wrote {args.json}")
    if results["skipped_steps"]:
        flags.note(f"{len(results['skipped_steps'])} steps had a non-finite loss or gradient and were skipped: "
                   f"{results['skipped_steps'][:10]}")
    fsdp.close_distributed()
