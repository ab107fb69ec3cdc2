"""
Step 20 -- When the GPU waits for Python: the whole training step in one CUDA graph.

Why
---
A training step of a 1.5B model on 4 x 512 tokens is a few thousand kernels, most
of them short: an RMSNorm of 2,048 rows takes the GPU ~10 us, but queueing it costs
the host 20-60 us of Python, autograd and launch overhead (NOTES.md measures it).
When the host needs longer to queue a step than the GPU needs to run it, the GPU
sits idle between kernels and the step takes the host's time, not the GPU's:
profile_baseline.py calls that step "host-bound" and shows the gaps.

A CUDA graph removes the host from the step. The step is run once under
``torch.cuda.graph``, which records every kernel with its arguments (pointers
included) instead of running it; afterwards ``graph.replay()`` submits the whole
recording with one call, whatever the number of kernels. What is recorded here is
everything the step does on the GPU: forward, loss, backward (autograd runs its
kernels during the capture like any other), the gradient norm and clipping, and
the AdamW update. The learning-rate schedule stays on the host.

What a recording requires, and how this file meets it
-----------------------------------------------------
* Fixed addresses. A replay reads the inputs from the tensors the capture read,
  so every batch is copied into the same buffers (``StaticInputs``); the outputs
  (the loss, the gradient norm) are the same tensors after every replay. The
  gradients too: at capture ``.grad`` is None, so backward allocates them inside
  the graph and every replay writes them in place.
* Fixed shapes. A batch whose shapes differ from the captured one cannot be
  replayed: packing (and synthetic data) make every batch B x T, padded batches
  do not. A batch that does not fit runs eagerly, with a note.
* No host synchronization inside the step (``.item()``, a Python branch on a
  tensor, a ``nonzero``): the kernels of this repository have none; MoE routing
  and --skip-nonfinite-steps (which reads the loss before deciding to update)
  do, so they run eagerly.
* Per-step values in memory, not in launch arguments: PyTorch's AdamW with
  ``capturable=True`` and a tensor learning rate, and TritonAdamW's scalars
  (adamw_kernel.py, "In a CUDA graph"), are refreshed before each replay.
* The attention of the eager step. For rows without padding or packing,
  transformers builds no mask and lets SDPA's ``is_causal`` flag do the masking
  (its flash and cuDNN kernels skip the tiles above the diagonal); to know, it
  reads the rows on the host (are the position ids one sequence? is the padding
  mask all ones?). While a graph is captured it cannot read them, counts the
  capture as tracing and builds the [B, 1, T, T] mask, in every replay; SDPA then
  runs its masked kernels: at 8B, 2 x 2048 tokens on an H100, the attention took
  57 ms per step instead of 23. Synthetic rows are known to have neither padding
  nor packing, so for them ``keep_sdpa_causal`` registers SDPA under a name of
  its own whose mask function builds nothing inside a capture.
* Work already set up: the first steps run eagerly (Triton compiles its kernels,
  cuBLAS picks its algorithms, AdamW allocates its state), on a side stream as
  PyTorch's documentation asks, and the capture comes after them.
* With --ddp, the averages of the gradients inside the graph (NCCL collectives can
  be captured; ddp.GradientAverage launches them from backward's hooks), and every
  decision is taken by all processes together (``agree``): a graph with collectives
  must be replayed by every process or none.
  What it bought (with DistributedDataParallel then): 2 x H200, per GPU against one
  GPU, 8B LoRA r16 0.97x -> 0.985x, 8B full 0.900x -> 0.912x (NOTES.md, Step 19).

What it costs: the capture itself (a step's worth of host time, once), and
memory: the graph keeps its own pool, so the activations' memory stays reserved
between steps instead of returning to PyTorch's cache (the peak is about the
same; it is what a step needs anyway). Everything else is the eager step's
arithmetic, kernel by kernel, in the same order: the losses are the eager run's.

Graphs remove the host's time from the step; where the GPU bounds the step there is
none to remove, and a replay may be no faster than the eager step. So the second
replay is timed against the last eager warm-up step, on the GPU's clock (the first
also uploads the graph to the GPU, which CUDA does at a graph's first launch: a cost
paid once); a replay more than 5% slower keeps the rest of the run eager, with a note.

Nothing runs on import.
"""

import contextlib

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)
import swap_common

import torch

from kernel_ft import files, flags

EAGER_STEPS = 2  # steps run eagerly before the capture: compilation, autotuning, optimizer state
# A replay slower than the last eager step by more than this keeps the run eager (see
# GraphedStep._keep_faster): graphs remove the host's time, and where the GPU bounds the
# step there is none to remove.
SLOWER = 0.05
TIMED_REPLAY = 1  # which replay is timed: the second (the first also uploads the graph)


@contextlib.contextmanager
def side_stream(device):
    """Run the block on a new CUDA stream that starts after the current one's work and
    that the current one waits for at the end (on a CPU: the block as it is)."""
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        torch.cuda.current_stream(device).wait_stream(side)


def reason_to_stay_eager(args, model, data):
    """None when the training step of this run can be captured; otherwise why not,
    in a few words (the run says it in one line and trains eagerly)."""
    config = model.config
    if not torch.cuda.is_available():
        return "no GPU"
    if getattr(args, "fsdp", False):
        # FSDP2's hooks can be captured (2 x H200, 8B full, FSDP2's own buffers: the same losses),
        # bf16 0.7% faster (NOTES.md, Step 19); but FSDP2 keeps on the host which weights are
        # gathered and the events its streams wait for, and a replay updates neither: an
        # evaluation or a checkpoint between replays would act on that stale record. Eager,
        # FP8's host work shows (8B --fp8 tensorwise: 0.72x per GPU on 2 x H200, NOTES.md Step 22).
        return "--fsdp: FSDP2 keeps its gather state on the host, which a replayed step would leave stale"
    if getattr(args, "skip_nonfinite_steps", False):
        return "--skip-nonfinite-steps reads each step's loss on the host before the update"
    if getattr(args, "optimizer_in_backward", False):
        return "--optimizer-in-backward updates inside backward with the learning rate as a launch argument"
    if getattr(args, "compile", False) and args.compile_mode in ("reduce-overhead", "max-autotune"):
        return f"--compile-mode {args.compile_mode} replays torch.compile's own CUDA graphs"
    if data is not None and not args.packing:
        return "--no-packing: padded batches change shape from step to step"
    if getattr(args, "lora_4bit", False):
        return "--lora-4bit: bitsandbytes' 4-bit layers are not known to be capturable"
    if any(getattr(config, name, None) for name in ("num_local_experts", "num_experts")):
        return f"{config.model_type} routes tokens to experts with host-side indexing (a host sync per layer)"
    if getattr(config, "_attn_implementation", None) == "eager":
        # transformers' eager attention (Gemma-2's soft-capped scores) builds its mask
        # from torch.tensor(0.0, device=...) in every forward: a host-to-device copy.
        return f"{config.model_type} needs transformers' eager attention, whose mask is copied from the host"
    return None


# --------------------------------------------------------------------------------
# The attention: SDPA's causal flag inside the graph, as in the eager step
# --------------------------------------------------------------------------------
SDPA_CAUSAL = "sdpa_causal_in_graphs"  # the name keep_sdpa_causal registers SDPA under


def _mask_as_in_eager(*args, **kwargs):
    """The mask function of SDPA_CAUSAL. Outside a capture: transformers' own
    (``sdpa_mask``), decisions included. Inside one: no mask, so SDPA gets
    is_causal, which is what the eager step gets for these rows; a padding mask
    there is refused (keep_sdpa_causal is for rows that have none)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if not torch.cuda.is_current_stream_capturing() or kwargs.get("use_vmap"):
        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)  # use_vmap: a model's own mask overlay
    if kwargs.get("attention_mask") is not None:
        raise ValueError("a padding mask reached a step captured for rows without padding (cuda_graphs.SDPA_CAUSAL)")
    return None


def keep_sdpa_causal(model, seq_len):
    """For rows without padding or packing (synthetic data), make the captured step
    attend as the eager one does (this file's docstring, "The attention of the eager
    step"): SDPA is registered again under SDPA_CAUSAL, with _mask_as_in_eager as its
    mask function. Only where every layer's mask is the causal one for rows of
    ``seq_len`` tokens (swap_common.plain_causal_attention); other attention
    implementations (eager, ours for packed rows) are left alone. Returns whether
    the model was switched."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if not swap_common.plain_causal_attention(config, seq_len):
        return False
    AttentionInterface.register(SDPA_CAUSAL, ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register(SDPA_CAUSAL, _mask_as_in_eager)
    model.set_attn_implementation(SDPA_CAUSAL)
    return True


def recover_from_failed_capture(stream):
    """What a capture that failed leaves behind, undone.

    When cudaStreamEndCapture reports the capture broken, ``torch.cuda.graph`` raises
    on leaving before it restores the stream the step ran on, and before PyTorch takes
    the device's random generator out of capture mode. The step would then go on on the
    capture's side stream, and every later random op outside a graph (dropout, a
    model's random init) would fail with "Offset increment outside graph capture
    encountered unexpectedly". So the stream is set back, and the generator gets a copy
    of its own state, which is not capturing: the same seed and offset, so the eager
    steps draw the numbers they would have drawn without the attempt."""
    torch.cuda.set_stream(stream)
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    generator.graphsafe_set_state(generator.clone_state())


class StaticInputs:
    """The buffers a captured step reads its micro-batches from: a copy of the
    first batches' tensors, refilled in place for every replay."""

    def __init__(self, micro_batches):
        self.batches = [{k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()} for b in micro_batches]

    def fits(self, micro_batches):
        """Whether ``micro_batches`` can be copied in: as many, with the same keys, each
        tensor of the same shape, dtype and device (None where None)."""
        if len(micro_batches) != len(self.batches):
            return False
        for new, old in zip(micro_batches, self.batches):
            if new.keys() != old.keys():
                return False
            for k, v in new.items():
                if torch.is_tensor(v) != torch.is_tensor(old[k]) or (v is None) != (old[k] is None):
                    return False
                if torch.is_tensor(v) and (v.shape != old[k].shape or v.dtype != old[k].dtype
                                           or v.device != old[k].device):
                    return False
        return True

    def fill(self, micro_batches):
        for new, old in zip(micro_batches, self.batches):
            for k, v in new.items():
                if torch.is_tensor(v):
                    old[k].copy_(v, non_blocking=True)
                else:
                    old[k] = v


class GraphedStep:
    """A training step that is captured once and replayed.

    ``captured(micro_batches)`` is the GPU work of a step (forward, backward,
    clipping, optimizer update) and returns its outputs (tensors or None);
    ``eager(micro_batches)`` is the whole step run eagerly (the same work, and the
    gradients freed at its end); ``after_replay()`` is the host's share of a step
    (the learning-rate schedule); ``clear_gradients()`` sets every ``.grad`` to
    None; ``before_capture()`` allocates what the captured step will read (outside
    the capture); ``before_replay()`` refreshes per-step values the captured
    launches read from memory; ``after_failed_capture()`` forgets what a capture that failed
    recorded (on every process: after ``agree``). Calls with batches of another shape, and
    the first EAGER_STEPS calls, run eagerly.
    """

    def __init__(self, captured, eager, after_replay, clear_gradients, before_replay=None, before_capture=None,
                 hold=contextlib.nullcontext, say=print, eager_steps=EAGER_STEPS, agree=None, after_failed_capture=None):
        self.captured, self.eager = captured, eager
        self.eager_steps = eager_steps
        # Several processes (--ddp): agree(flag) is True when every process's flag is, so
        # that all capture, replay or fall back together. None: one process.
        self.agree = agree
        self.after_replay, self.before_replay = after_replay, before_replay
        self.before_capture = before_capture
        self.after_failed_capture = after_failed_capture
        self.clear_gradients = clear_gradients
        self.hold = hold  # a context in which a signal waits: the replay and the schedule's step are one update
        self.say = say
        self.graph = None
        self.inputs = None
        self.outputs = None
        self.eager_calls = 0
        self.eager_ms = None  # the last warm-up step's time
        self.replays = 0
        self.disabled = None  # why capturing failed, once it has
        self.mismatch_noted = False

    def __call__(self, micro_batches):
        if self.disabled:
            return self.eager(micro_batches)
        if self.graph is None:
            if self.eager_calls < self.eager_steps:
                return self._eager_on_side_stream(micro_batches)
            if not self._capture(micro_batches):
                return self.eager(micro_batches)
        elif not self.inputs.fits(micro_batches):
            if self.agree is not None:  # the others replay: this process alone cannot step eagerly
                raise RuntimeError(
                    "CUDA graphs with several processes: this process got a batch of another shape than the captured "
                    "step, and every process must replay the graph together; rerun with --no-cuda-graphs")
            if not self.mismatch_noted:
                flags.note("CUDA graphs: a batch of another shape than the captured one runs eagerly "
                           "(this note is printed once)")
                self.mismatch_noted = True
            self.clear_gradients()  # eager backward must start from None, not from the graph's gradients
            return self.eager(micro_batches)
        else:
            self.inputs.fill(micro_batches)
        with self.hold():
            if self.before_replay is not None:
                self.before_replay()
            replay_ms = None
            if self.replays == TIMED_REPLAY:  # _keep_faster
                replay_ms = self._clock(self.graph.replay)[1]
            else:
                self.graph.replay()
            self.after_replay()
        self.replays += 1
        outputs = self.outputs
        if replay_ms is not None:
            self._keep_faster(replay_ms)
        return outputs

    def _clock(self, run):
        """(run(), its milliseconds on the GPU's clock): swap_common.gpu_clock."""
        return swap_common.gpu_clock(run)

    def _keep_faster(self, replay_ms):
        """After the timed replay: if it was slower than the last eager step (on any
        process), the rest of the run is eager, with a note (the same arithmetic either way)."""
        slower = self.eager_ms is not None and replay_ms > self.eager_ms * (1 + SLOWER)
        if (not slower) if self.agree is None else self.agree(not slower):
            return
        self.disabled = (f"a replay took {replay_ms:.0f} ms, an eager step {self.eager_ms:.0f} ms" if slower
                         else "another process's replay was slower than its eager step")
        flags.note(f"CUDA graphs: {self.disabled}; training eagerly (the GPU, not Python, bounds this step)")
        self.graph = self.inputs = self.outputs = None
        self.clear_gradients()  # the graph's gradients; eager backward starts from None

    def _eager_on_side_stream(self, micro_batches):
        """A warm-up step, on a side stream: what it allocates lazily (cuBLAS
        workspaces, autograd's streams) is then in place for the capture."""
        self.eager_calls += 1
        with side_stream(torch.device("cuda", torch.cuda.current_device())):
            if self.eager_calls < self.eager_steps:
                return self.eager(micro_batches)
            # the last one is timed: the replay must beat it (_keep_faster)
            outputs, self.eager_ms = self._clock(lambda: self.eager(micro_batches))
            return outputs

    def _capture(self, micro_batches):
        """Record the step; True if it worked. Nothing runs during a capture: the
        caller replays it once for this step. A failure (an operation that cannot
        be captured) leaves a note and the run eager."""
        self.inputs = StaticInputs(micro_batches)
        self.clear_gradients()  # backward allocates them inside the graph
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            if self.before_capture is not None:
                self.before_capture()
            # thread_local: only this thread's calls are checked. The DataLoader's
            # pin-memory thread keeps allocating pinned buffers for the next batches,
            # which a global capture would refuse (and the capture with it).
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.outputs = self.captured(self.inputs.batches)
            failed = None
        except Exception as e:  # noqa: BLE001 - any operation the capture refused: train eagerly
            failed = files.one_line(e)
            torch.cuda.synchronize()
            recover_from_failed_capture(stream)
        if self.agree is not None and not self.agree(failed is None):
            failed = failed or "another process could not capture its step"
        if failed:
            self.disabled = failed
            if self.after_failed_capture is not None:  # what the capture recorded never ran
                self.after_failed_capture()
            self.graph = self.inputs = self.outputs = None
            self.clear_gradients()  # what the capture allocated is not a gradient
            flags.note(f"CUDA graphs: the step could not be captured ({self.disabled}); training eagerly")
            return False
        self.graph = graph
        self.say("CUDA graphs:   step captured (forward, loss, backward, clipping, optimizer); replayed from now on")
        return True
