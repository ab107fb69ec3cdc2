"""
The training loop: one step (forward, loss, backward, clipping, optimizer,
schedule), the loop around it, and what it reports (printed and written by
reporting.py).

README Step 11 (the same loop with and without the kernels) and Steps 16-19. What
it teaches, as a reader of nanoGPT's train.py would expect to find it in one sitting:

* ``train_step``: each micro-batch of the step (``--grad-accum``) runs forward and
  backward with its loss weighted by its share of the step's target tokens, so the
  gradient is that of the mean over all of them; then the gradient norm is clipped,
  the optimizer steps and the learning rate follows warm-up + cosine
  (``lr_factor``). NVTX ranges name each phase for the profiler.
* ``run_training``: warm-up steps (compilation, autotuning) are untimed; each timed
  step is synchronized, so its time is the GPU's, not the host's; tokens per second
  are counted two ways (every slot, and real tokens only, padding excluded); peak
  memory is ``torch.cuda.max_memory_allocated``. Evaluation every ``--eval-every``
  steps, checkpoints every ``--save-every``, a progress bar or a line per step.
* What can go wrong: out of memory ends in one line of advice. SIGINT (Ctrl-C)
  and SIGTERM (a scheduler's preemption) finish the step, save a checkpoint and
  the partial JSON, and exit 130 / 143; an optimizer update is never cut in half.
  A NaN or infinite loss or gradient norm stops the run at that step with an error
  (the last good checkpoint stays), or with --skip-nonfinite-steps that step
  updates nothing and the run goes on.
* The baseline's loss (``hf_loss``) and optimizer (``pytorch_adamw``); run.py sets a
  run up around this loop (run.run_finetune), with the kernels or without.

Nothing runs on import.
"""

import contextlib
import functools
import math
import os
import resource
import signal
import sys
import threading
import time

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)
from swap_common import evaluating, loss_only, vocabulary_size

import torch

from kernel_ft import flags, models, ddp, fsdp, dataloader, checkpoints, cuda_graphs, reporting


# --------------------------------------------------------------------------------
# The baseline's loss and optimizer (finetune_optimized.py switches in the kernels)
# --------------------------------------------------------------------------------
def hf_loss(model, batch):
    """Baseline: the loss the way HF computes it (it shifts, upcasts the logits to fp32
    and calls F.cross_entropy, which builds the log-softmax). ``batch``: see "Data"."""
    return model(**dataloader.model_inputs(batch), labels=batch["labels"]).loss


def pytorch_adamw(params, lr, capturable=False):
    """torch.optim.AdamW with PyTorch's defaults (betas 0.9/0.999, eps 1e-8, weight decay 0.01).

    fused=True on CUDA: one kernel per step for all parameters instead of a dozen
    elementwise kernels per tensor. The CPU keeps PyTorch's default implementation.
    ``capturable`` (a step replayed as a CUDA graph, cuda_graphs.py): the step
    count and the learning rate live in GPU memory, where each replay reads them
    (the schedule writes the rate into that tensor), instead of being launch arguments.
    """
    if capturable:
        params = list(params)
        rate = torch.tensor(lr, dtype=torch.float32, device=params[0].device)
        return torch.optim.AdamW(params, lr=rate, fused=True, capturable=True)
    return torch.optim.AdamW(params, lr=lr, fused=torch.cuda.is_available())


# --------------------------------------------------------------------------------
# One training step, the training loop
# --------------------------------------------------------------------------------
def phase(name):
    """A named range: shows in torch.profiler traces, and in nsys as NVTX on a GPU."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.profiler.record_function(name))
    if torch.cuda.is_available():
        stack.enter_context(torch.cuda.nvtx.range(name))
    return stack


def train_step(model, optimizer, loss_fn, micro_batches, scheduler=None, max_grad_norm=0.0, skip_nonfinite=False):
    """One optimizer step: forward + loss and backward for each micro-batch
    (``micro_batches``: a list of batch dicts, see "Data"; one without --grad-accum),
    then gradient clipping, the AdamW update and the learning-rate schedule.
    Returns (loss, gradient norm): tensors, the loss averaged over every target
    token of the step; the norm is None when clipping is off.

    ``skip_nonfinite`` (--skip-nonfinite-steps): a step whose loss or gradient norm
    is NaN or infinite changes nothing (no update, the schedule does not advance);
    it costs one host sync per step, to know before the update. The norm is then
    always computed and returned, clipping or not (step_is_finite says which steps
    were skipped)."""
    loss = accumulate_gradients(model, loss_fn, micro_batches)
    with phase("optimizer"):
        if skip_nonfinite:
            norm = gradient_norm(optimizer, max_grad_norm)
            if not step_is_finite(loss.item(), norm.item()):
                optimizer.zero_grad(set_to_none=True)
                return loss, norm
            grad_norm = optimizer_update(optimizer, scheduler, max_grad_norm, norm)
            return loss, norm if grad_norm is None else grad_norm
        grad_norm = optimizer_update(optimizer, scheduler, max_grad_norm)
    return loss, grad_norm


def step_function(args, model, optimizer, loss_fn, scheduler, graphs):
    """This run's training step as ``step(micro_batches) -> (loss, gradient norm)``:
    train_step with the run's settings, or, with ``graphs`` (use_cuda_graphs), the
    same step captured in a CUDA graph once and replayed (cuda_graphs.py)."""
    skip = getattr(args, "skip_nonfinite_steps", False)
    max_grad_norm = getattr(args, "max_grad_norm", 0.0)
    eager = functools.partial(train_step, model, optimizer, loss_fn, scheduler=scheduler,
                              max_grad_norm=max_grad_norm, skip_nonfinite=skip)
    if not graphs:
        return eager

    def captured(micro_batches):
        # train_step's GPU work, without what stays on the host (the schedule) or
        # what a replay must not do (free the gradients it writes in place).
        loss = accumulate_gradients(model, loss_fn, micro_batches)
        grad_norm = gradient_norm(optimizer, max_grad_norm) if max_grad_norm > 0 else None
        optimizer.step()
        return loss, grad_norm

    # --ddp: what the host keeps around the graph (the pieces' gathers, the embedding's token ids).
    ddp_before_capture, ddp_replayed, ddp_capture_failed = ddp.graph_hooks(model)
    prepare = getattr(optimizer, "prepare_capture", lambda: None)  # TritonAdamW: its scalars' memory

    def before_capture():
        ddp_before_capture()
        prepare()

    def after_replay():
        if scheduler is not None:
            scheduler.step()
        ddp_replayed()

    return cuda_graphs.GraphedStep(
        captured, eager,
        after_replay=after_replay,
        clear_gradients=functools.partial(optimizer.zero_grad, set_to_none=True),
        before_capture=before_capture,
        after_failed_capture=ddp_capture_failed,
        before_replay=getattr(optimizer, "stage_graph_step", None),  # TritonAdamW: this step's scalars
        hold=hold_interrupts,
        agree=ddp.all_agree if getattr(args, "ddp", False) else None,  # every process replays, or none
    )


def keep_capturable(optimizer):
    """After a checkpoint was loaded into a PyTorch AdamW made for CUDA graphs
    (pytorch_adamw(capturable=True)): load_state_dict takes the param groups as
    saved, and one saved by an eager run holds a float learning rate and
    capturable=False. A replayed graph would then keep the captured step's rate
    for ever: the groups are made capturable again, the rate a GPU tensor that the
    schedule writes into. (TritonAdamW keeps floats: it stages them itself.)"""
    if not isinstance(optimizer, torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        group["capturable"] = True
        if not torch.is_tensor(group["lr"]):
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=group["params"][0].device)


def use_cuda_graphs(args, model, data):
    """Whether this run's step is captured in a CUDA graph (--cuda-graphs, and
    nothing that rules it out: cuda_graphs.reason_to_stay_eager). Prints the choice;
    a reason that overrides the flag is a note."""
    if not getattr(args, "cuda_graphs", False):
        print("CUDA graphs:   off: every step is queued by Python, kernel by kernel")
        return False
    reason = cuda_graphs.reason_to_stay_eager(args, model, data)
    if reason == "no GPU":
        print("CUDA graphs:   off (no GPU)")
        return False
    if reason:
        flags.note(f"CUDA graphs are off, the step runs eagerly: {reason}")
        return False
    print(f"CUDA graphs:   on: the step is captured after {cuda_graphs.EAGER_STEPS} eager steps, then replayed "
          f"(--no-cuda-graphs: eager)")
    if data is None:  # synthetic rows: no padding, no packing; the eager step's causal attention, also in the graph
        cuda_graphs.keep_sdpa_causal(model, args.seq_len)
    return True


def step_is_finite(loss, grad_norm):
    """A step that learned something: its loss and gradient norm (floats; None: not
    computed) are numbers. NaN or infinity means the run diverged."""
    return math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))


def target_count(batch):
    """How many positions of a batch count in its loss (the shifted labels that are
    not IGNORE_INDEX: prompts, padding and each example's first token are not), as
    a tensor: reading it would wait for the GPU."""
    return (dataloader.shift_labels(batch["labels"]) != dataloader.IGNORE_INDEX).sum()


def counted(loss, count):
    """A micro-batch's mean loss, 0 where it has no target: transformers' mean over none
    is 0 / 0, NaN, which its weight of 0 would not remove (NaN x 0 is NaN). A NaN of a
    batch with targets stays. torch.where: no host sync, and zero gradients there."""
    return torch.where(count > 0, loss, torch.zeros_like(loss))


def accumulate_gradients(model, loss_fn, micro_batches):
    """Forward and backward of each micro-batch, adding up the gradients.

    ``loss_fn`` returns the mean over one micro-batch's target tokens. The step's
    loss must be the mean over all of its tokens, what one big batch would give,
    so each micro-batch's loss is weighted by its share of the step's tokens
    (1/N each when every micro-batch has as many; with padding, not). The weight
    is applied before backward, so the gradients are those of the step's loss.
    """
    counts = [target_count(batch) for batch in micro_batches]
    total = torch.stack(counts).sum()
    rank, ranks = fsdp.rank_and_size()
    if ranks > 1:
        # --fsdp: the step's loss is the mean over the target tokens of every rank,
        # so each rank weighs its tokens by the global count. FSDP averages the
        # gradients over the N ranks (it divides their sum by N): multiplying by N
        # here makes them the gradients of the global mean, as one process with the
        # whole batch computes them. No host sync: an all-reduce of a device scalar.
        torch.distributed.all_reduce(total)
    total = total.clamp(min=1)  # an all-padding step: loss 0, not 0/0
    step_loss = 0.0
    for i, (batch, count) in enumerate(zip(micro_batches, counts)):
        with phase("forward"):
            # x1.0 exactly on one process with one micro-batch
            loss = counted(loss_fn(model, batch), count) * (count * ranks / total)
        # --ddp: the last micro-batch's backward averages the gradients over the processes
        with phase("backward"), ddp.averaged_backward(model, last=i == len(micro_batches) - 1):
            loss.backward()
        step_loss = step_loss + loss.detach()
    if ranks > 1:  # the global mean: the sum of the ranks' shares, over N
        step_loss = step_loss.clone() if torch.is_tensor(step_loss) else torch.tensor(step_loss, device=total.device)
        torch.distributed.all_reduce(step_loss)
        step_loss = step_loss / ranks
    return step_loss


def optimizer_update(optimizer, scheduler, max_grad_norm, grad_norm=None):
    """Clip the gradients, update the parameters, advance the learning-rate schedule.
    Returns the gradient norm before clipping (a tensor), or None without clipping.
    ``grad_norm``: the norm, when gradient_norm already computed it (with clipping
    on, the gradients are then already clipped)."""
    if grad_norm is None and max_grad_norm > 0:
        grad_norm = gradient_norm(optimizer, max_grad_norm)
    elif max_grad_norm <= 0:
        grad_norm = None
    # Ctrl-C or SIGTERM in the middle of the update would leave some tensors updated
    # and others not, and no checkpoint could be saved: held until the step is recorded.
    with hold_interrupts():
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)  # frees the gradients until next backward
    return grad_norm


def gradient_norm(optimizer, max_grad_norm):
    """The global norm of the gradients the optimizer updates (LoRA: the adapters
    only), a tensor; with ``max_grad_norm`` > 0 the gradients are clipped to it."""
    if hasattr(optimizer, "clip_grad_norm_"):
        # An optimizer that clips inside its own step (the Triton AdamW: the scaling
        # happens as the step reads each gradient, one pass over them fewer) and knows
        # its parameters' norm (under --ddp-shard-optimizer, pieces of every process's).
        return optimizer.clip_grad_norm_(max_grad_norm) if max_grad_norm > 0 else optimizer.total_norm()
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:  # --skip-nonfinite-steps without clipping: the norm alone
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):  # --fsdp: a DTensor of partial norms; the global norm
        norm = norm.full_tensor()
    return norm


# --------------------------------------------------------------------------------
# Stopping on a signal: SIGINT (Ctrl-C) and SIGTERM (what a cluster scheduler sends
# before it kills a job) ask the run to stop. The step in progress completes, the
# completed steps are saved as a checkpoint (--output-dir) and written to the JSON
# (marked partial), and the process exits 128 + the signal's number (130, 143), as
# a shell reports a process that the signal killed. A second signal while a step
# runs abandons that step (it is not recorded; the weights stay those of the last
# recorded step), unless it lands in a clean-up that cannot be interrupted: then
# the step completes. Signals during an optimizer update wait until the step is
# recorded, and during the wrap-up (checkpoint, JSON) they are ignored: nothing is
# ever cut in half.
# --------------------------------------------------------------------------------
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """What the signal handler saw (the first signal), and whether the run is writing
    something that must not be cut in half (a checkpoint; after the loop, everything)."""

    def __init__(self):
        self.signum = None
        self.protected = False


_STOP = StopRequest()
_HELD_SIGNALS = []  # signals that came during an optimizer update (see hold_interrupts)


def _on_stop_signal(signum, frame):
    if _STOP.signum is None:
        _STOP.signum = signum  # the loop stops after the step in progress
    elif not _STOP.protected:
        raise KeyboardInterrupt  # a second signal: abandon the step in progress
    # While a checkpoint or the results are written: the first signal said it all.


@contextlib.contextmanager
def stop_on_signals():
    """Inside this block SIGINT and SIGTERM ask the run to stop (see above); yields
    the StopRequest that run_training reads. Only the main thread gets signals."""
    global _STOP
    _STOP = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield _STOP
        return
    previous = {s: signal.signal(s, _on_stop_signal) for s in STOP_SIGNALS}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _second_signal_in_a_cleanup(previous_hook)
    try:
        yield _STOP
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.unraisablehook = previous_hook
        _STOP = StopRequest()  # a later run outside this block starts with none


def _second_signal_in_a_cleanup(hook):
    """The KeyboardInterrupt of a second signal can land inside code whose exceptions
    Python cannot pass on (a finalizer, e.g. a profiler range closing): Python then
    prints it as a traceback and goes on. The step in progress then completes (it is
    recorded, and the run stops after it as the first signal asked); say that in one
    line instead. Every other such exception goes to the previous hook."""
    def unraisable(info):
        if issubclass(info.exc_type, KeyboardInterrupt) and _STOP.signum is not None:
            print("A second signal came while a clean-up ran: the step in progress completes, then the run stops.",
                  file=sys.stderr, flush=True)
        else:
            hook(info)
    return unraisable


@contextlib.contextmanager
def hold_interrupts():
    """A signal inside this block is recorded instead of acted on; run_training
    delivers it once the step is recorded (interrupt_if_held)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, lambda signum, frame: _HELD_SIGNALS.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        # A signal whose handler is the default action (SIGTERM outside a run's loop,
        # e.g. in the profile script) ends the process now, the update complete.
        for signum in [s for s in _HELD_SIGNALS if previous[s] == signal.SIG_DFL]:
            _HELD_SIGNALS.remove(signum)
            signal.raise_signal(signum)


def interrupt_if_held():
    """Deliver the signals held during the update, to whatever handles them now."""
    held = list(_HELD_SIGNALS)
    _HELD_SIGNALS.clear()
    for signum in held:
        signal.raise_signal(signum)


@torch.no_grad()
def evaluate(model, loss_fn, batches):
    """Mean loss over ``batches`` (batch dicts; held_out_batches), every target token
    weighted alike, with the model in eval mode (no dropout) and no gradients.
    Returns a float."""
    loss_sum, count_sum = 0.0, 0
    with evaluating(model), loss_only():  # the fused loss: no [B, T, V] logits here either
        for batch in batches:
            count = target_count(batch)
            loss_sum = loss_sum + counted(loss_fn(model, batch), count).float() * count
            count_sum = count_sum + count
    return float(loss_sum / max(int(count_sum), 1))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_memory():
    """(bytes, what was measured): GPU allocator peak, or the process peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(), "GPU max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return (rss if sys.platform == "darwin" else rss * 1024), "CPU process peak RSS"


@contextlib.contextmanager
def exit_on_oom(args, what, model):
    """Turn an out-of-memory error, GPU or CPU, into one line: what was attempted, what to reduce."""
    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError, so is a failed CPU allocation
        if not models.is_out_of_memory(e):
            raise
        where = "GPU" if isinstance(e, torch.OutOfMemoryError) else "CPU"
        name = "the tiny LLaMA" if args.tiny else args.model
        hint = "" if getattr(args, "use_custom_flce", False) is not False else ", or add --use-custom-flce (no logits at all)"
        if getattr(args, "ddp", False) and getattr(args, "ddp_shard_weights", False):
            hint += ", or add --gradient-checkpointing, or shard the model with --fsdp instead"
        elif getattr(args, "ddp", False):  # chosen by torchrun's memory rule, or asked for
            hint += ", or shard the model with --fsdp instead of --ddp (a whole copy on every GPU)"
        raise SystemExit(
            f"error: out of {where} memory while {what} {name} with batch {args.batch_size} x seq "
            f"{args.seq_len} ({args.batch_size * args.seq_len:,} tokens per step; {held_state(model)}); "
            f"reduce --batch-size or --seq-len{hint}"
        ) from None


def held_state(model):
    """What the run holds before a single activation is stored, in words: the weights,
    and for each trained one its gradient and AdamW's two moments (its dtype each).
    A LoRA run's frozen base has neither gradients nor AdamW state."""
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad) / 2**30
    trained = sum(4 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**30
    if not frozen:
        return f"weights, gradients and AdamW state alone take {trained:.1f} GiB"
    return (f"the frozen weights alone take {frozen:.1f} GiB, the trained ones with their gradients and AdamW "
            f"state {trained:.2f} GiB")


def save_at_end(args, model, optimizer, scheduler, start, done, diverged, history, rng):
    """--output-dir at the end of the run, or after the last completed step of an
    interrupted one: its checkpoint (never the weights of a diverged step; none if
    that step was just saved) and the loss curve. Returns the paths saved."""
    saved = []
    if done > start and not diverged and not os.path.exists(checkpoints.checkpoint_path(args.output_dir, done)):
        saved.append(checkpoints.save_checkpoint(args, model, optimizer, scheduler, done, history, rng))
        print(f"Saved         {saved[-1]}", flush=True)
    if fsdp.is_main_process():
        curve = reporting.plot_loss_curve(os.path.join(args.output_dir, flags.LOSS_CURVE), history)
        print(f"Loss curve:   {curve}", flush=True)
    return saved


def run_training(args, model, loss_fn, optimizer, data=None, scheduler=None, resumed=None, graphs=False):
    """The fine-tuning loop: ``loss_fn(model, batch)``, ``optimizer`` and the
    learning-rate ``scheduler`` at every step, on the batches of ``data``
    (prepare_data; None: synthetic). Returns a dict of results (see reporting.write_json).

    Throughput is counted two ways: ``tokens_per_sec``, every token slot the model
    computed (padding included), and ``real_tokens_per_sec``, the slots that hold
    real tokens of an example (prompt or response), not padding.
    ``padding_fraction``: the share of the slots of all steps run that is padding.

    ``resumed``: the trainer state of the checkpoint this run continues (see
    load_checkpoint): the loop starts after its step, on the batches that step
    would have been given. With --eval-every the held-out loss is measured every N
    steps; with --output-dir a checkpoint is saved every --save-every steps and at
    the end. A signal (inside stop_on_signals) stops the loop after the step in
    progress, a second one or a KeyboardInterrupt inside it: the results then hold
    the completed steps and ``partial`` is True (the caller writes them and exits
    128 + the signal); with --output-dir the completed steps are saved as a
    checkpoint first. A step with a NaN or infinite loss or gradient norm ends the
    loop (``diverged_at_step``; no checkpoint of its weights), or with
    --skip-nonfinite-steps is recorded as skipped. ``graphs``: the step is replayed
    as a CUDA graph (step_function).
    """
    device = next(model.parameters()).device
    start = resumed["step"] if resumed else 0
    history = resumed["history"] if resumed else {"train": [], "eval": []}  # every step, for the curve
    # The batches are a pure function of (seed, step): a resumed run gets those
    # the uninterrupted run had from its step on.
    vocab = vocabulary_size(model)
    batches = dataloader.training_batches(args, data, device, vocab, start)
    total = args.warmup_steps + args.steps
    heldout = dataloader.held_out_batches(args, data, device, vocab) if args.eval_every else None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the peak of training, weights included

    steps, evals, saved = [], [], []
    keep_gathered = None  # --fsdp-keep-gathered auto: what was decided, when (fsdp.decide_keep_gathered)
    partial, diverged = False, None
    skip_nonfinite = getattr(args, "skip_nonfinite_steps", False)
    step = step_function(args, model, optimizer, loss_fn, scheduler, graphs)
    stop = _STOP  # set by stop_on_signals (run_finetune); never set without it
    rng = checkpoints.rng_states()  # the random state after the last completed step: what a checkpoint holds
    bar = reporting.progress_bar(args, total, start)
    say = bar.write if bar else functools.partial(print, flush=True)
    with exit_on_oom(args, "training", model):
        try:
            for i in range(start, total):
                micro_batches = next(batches)
                warmup = i - start < args.warmup_steps  # the first steps of this process are not timed
                sync()  # time only this step's work, not what is still queued
                lr = float(optimizer.param_groups[0]["lr"])  # a tensor with --cuda-graphs (pytorch_adamw)
                begin = time.perf_counter()
                loss, grad_norm = step(micro_batches)
                sync()
                seconds = time.perf_counter() - begin
                record, stop_votes = step_record(i + 1, micro_batches, loss, grad_norm, seconds, warmup, lr, stop)
                finite = step_is_finite(record["loss"], record["grad_norm"])
                if not finite and skip_nonfinite:
                    record["skipped"] = True  # nothing was updated (train_step)
                steps.append(record)
                history["train"].append([i + 1, record["loss"]])
                reporting.report_step(args, bar, record, total)
                if not finite and not skip_nonfinite:
                    # The update has been made with NaN or infinite gradients: these weights
                    # are lost. Stop here; the last checkpoint saved stays the last good one.
                    diverged = i + 1
                    break
                if i == start and not bar:
                    reporting.print_estimate(seconds, total - i - 1)
                if i - start + 1 == fsdp.KEEP_DECIDED_AFTER and (decision := fsdp.decide_keep_gathered(args, model)):
                    say(fsdp.keep_gathered_line(decision))
                    keep_gathered = {**decision, "after_step": i + 1}
                if args.eval_every and (i + 1) % args.eval_every == 0:
                    evals.append(evaluate_now(model, loss_fn, heldout, i + 1, total, history, say))
                rng = checkpoints.rng_states()
                if args.output_dir and args.save_every and (i + 1) % args.save_every == 0:
                    saved.append(save_whole(args, model, optimizer, scheduler, i + 1, history, rng, stop))
                    say(f"Saved         {saved[-1]}")
                interrupt_if_held()  # a signal during the update: this step is complete and recorded
                if stop_votes:
                    say(f"Stopping: {signal.Signals(stop.signum or signal.SIGTERM).name} received; step {i + 1} is "
                        f"the last")
                    partial = True
                    break
        except KeyboardInterrupt:
            partial = True  # keep what is done; the step in progress is lost
        finally:
            stop.protected = True  # from here on signals are ignored: the checkpoint and JSON are written whole
            if bar:
                bar.close()

    if args.output_dir:
        saved += save_at_end(args, model, optimizer, scheduler, start, start + len(steps), diverged, history, rng)
    stop_reason = ("non-finite loss or gradient" if diverged else
                   signal.Signals(stop.signum).name if stop.signum else "SIGINT" if partial else None)
    return training_results(args, steps, evals, saved, start, total, partial or diverged is not None, stop_reason,
                            diverged, keep_gathered, ddp.released_weights(model))


def save_whole(args, model, optimizer, scheduler, step, history, rng, stop):
    """--save-every: the checkpoint of ``step``; a second signal waits until it is written whole."""
    stop.protected = True
    path = checkpoints.save_checkpoint(args, model, optimizer, scheduler, step, history, rng)
    stop.protected = False
    return path


def step_record(step, micro_batches, loss, grad_norm, seconds, warmup, lr, stop):
    """One step's record for the report, and whether any process was asked to stop.
    Its tokens count every micro-batch of every process (--fsdp: the global batch); the
    stop votes are summed too, so that all processes stop after the same step."""
    tokens, real_tokens, stop_votes = fsdp.reduce_over_ranks(
        [sum(b["num_tokens"] for b in micro_batches), sum(b["num_real_tokens"] for b in micro_batches),
         int(stop.signum is not None)])
    record = {"step": step, "loss": loss.item(), "time_s": seconds, "warmup": warmup, "lr": lr,
              "grad_norm": None if grad_norm is None else grad_norm.item(),
              "tokens": int(tokens), "real_tokens": int(real_tokens)}
    return record, stop_votes


def evaluate_now(model, loss_fn, heldout, step, total, history, say):
    """--eval-every: the held-out loss after ``step``, recorded in ``history`` and said."""
    eval_loss = evaluate(model, loss_fn, heldout)
    history["eval"].append([step, eval_loss])
    batches = f"{len(heldout)} batch" + ("" if len(heldout) == 1 else "es")
    say(f"eval {step:>4}/{total}  held-out loss {eval_loss:.4f} ({batches})")
    return {"step": step, "loss": eval_loss}


def training_results(args, steps, evals, saved, start, total, partial, stop_reason, diverged, keep_gathered,
                     released=0):
    """The loop's results (see run_training): every step's record, throughput over the
    timed steps, the peak memory (the largest of the processes' under --fsdp)."""
    timed = [s for s in steps if not s["warmup"]]
    timed_s = sum(s["time_s"] for s in timed)
    slots = sum(s["tokens"] for s in steps)
    peak_bytes, peak_kind = peak_memory()
    _, ranks = fsdp.rank_and_size()
    if ranks > 1:  # the largest of the processes' peaks: what each GPU must hold
        peak_bytes = int(fsdp.reduce_over_ranks([peak_bytes], op="max")[0])
        peak_kind += f", the largest of {ranks} processes"
    tokens_per_sec = sum(s["tokens"] for s in timed) / timed_s if timed else None
    return {
        "world_size": ranks,
        "partial": partial,
        # Why the run ended before its last step: "SIGINT", "SIGTERM", "non-finite loss or gradient" or None.
        "stop_reason": stop_reason,
        "diverged_at_step": diverged,
        "skipped_steps": [s["step"] for s in steps if s.get("skipped")],
        "planned_steps": total,
        "start_step": start,  # steps already done by the checkpoint this run resumed (0: a fresh run)
        "steps": steps,  # this run's steps; "step" counts from the start of training
        "losses": [s["loss"] for s in steps],
        "step_times_s": [s["time_s"] for s in steps],
        "eval": evals,
        "checkpoints": saved,
        "warmup_steps": args.warmup_steps,
        "timed_steps": len(timed),
        "grad_accum": args.grad_accum,
        "tokens_per_step": slots / len(steps) if steps else None,  # the mean: padded batches vary
        # None (null in the JSON) when Ctrl-C came before the first timed step.
        "time_per_step_s": timed_s / len(timed) if timed else None,
        "tokens_per_sec": tokens_per_sec,  # every process's tokens (--fsdp: the total of all GPUs)
        "tokens_per_sec_per_gpu": tokens_per_sec / ranks if tokens_per_sec is not None else None,
        "real_tokens_per_sec": sum(s["real_tokens"] for s in timed) / timed_s if timed else None,
        "padding_fraction": 1 - sum(s["real_tokens"] for s in steps) / slots if steps else None,
        "peak_memory_bytes": peak_bytes,
        "peak_memory_kind": peak_kind,
        "fsdp_keep_gathered_auto": keep_gathered,
        "ddp_released_weights": released,  # --ddp-shard-weights: the weights kept as pieces between uses
        "final_loss": steps[-1]["loss"] if steps else None,
    }


# --------------------------------------------------------------------------------
# The learning-rate schedule
# --------------------------------------------------------------------------------
def lr_factor(step, warmup, total):
    """The multiplier of --lr for optimizer step ``step`` (0-based) of ``total``.

    A linear warm-up over the first ``warmup`` steps (1/warmup, 2/warmup, ... 1:
    Adam's first updates, from moments estimated on one or two batches, are the
    least reliable, so they are kept small), then half a cosine from 1 down to 0 at
    step ``total`` (the last step trains with a small, non-zero rate).
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_scheduler(optimizer, args):
    """A LambdaLR over lr_factor: it sets each group's lr, so any torch optimizer
    follows it (torch.optim.AdamW, TritonAdamW). Stepped once per optimizer step."""
    total = args.warmup_steps + args.steps
    factor = functools.partial(lr_factor, warmup=args.lr_warmup_steps, total=total)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def print_schedule(args):
    total = args.warmup_steps + args.steps
    clip = f"clipped to norm {args.max_grad_norm:g}" if args.max_grad_norm > 0 else "not clipped"
    print(f"Schedule:      {total} steps: lr warm-up over {args.lr_warmup_steps}, then cosine to 0; "
          f"gradients {clip}")
