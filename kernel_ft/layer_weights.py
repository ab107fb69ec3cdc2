"""
--ddp-shard-weights: the decoder layers' weights sharded too (ZeRO-3), each layer whole only
around its forward and its backward, on --ddp-shard-optimizer's pieces (kernel_ft/ddp.py).

README Step 19. What it teaches: what FSDP does with a layer's weights, without the copies
FSDP2 makes, and how autograd's saved tensors are found again once their memory has served
another layer (saved-tensor hooks).

``ddp.ShardedUpdate`` makes a ``LayerWeights`` for the layers it releases and calls it
around the optimizer step and the step's CUDA graph; ``ddp.GradientAverage`` reduce-scatters
their gradients. Nothing runs on import.
"""

import contextlib
import functools

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)
import swap_common

import torch

from kernel_ft import ddp


# --------------------------------------------------------------------------------
# --ddp-shard-weights: the decoder layers' weights whole only while they are used
# --------------------------------------------------------------------------------
# With --ddp-shard-optimizer every process still holds every weight whole between the
# steps (2 bytes per parameter: 15 GiB at 8B) though it updates a piece of each. Here a
# decoder layer's split weights are whole only around their use: each process keeps its
# piece r of each in memory of its own (1/N), and the layer's whole weights are gathered
# into a slot, a set of buffers of that layer's shapes, before its forward (``ahead``
# layers before it, as the pieces' gathers are), given back after it, and gathered again
# before its backward. This is what FSDP (ZeRO-3) does; the difference from FSDP2 is
# where the bytes lie. FSDP2 gathers a layer's weights into one flat buffer, rank-major,
# and copies each weight out of it, and copies each gradient into another flat buffer
# for the reduce-scatter: at 8B on 2 x H200 28 ms of copies in a 402 ms step (NOTES.md,
# Step 19). Here each weight is gathered alone, straight into its slot (NCCL writes the
# whole weight: piece r of it at offset r n/N), and its gradient is reduce-scattered
# where autograd wrote it, as --ddp-shard-optimizer does: no copies. The slots are few
# (ahead + 2 per shape, taken from NCCL's windows once, so the copy engines move the
# gathers) and reused layer after layer. What it buys at 8B, 2 x 2,048 tokens per GPU on
# H200s: 0.950x one GPU's tokens/s per GPU on 2 GPUs in 42.3 GiB, where FSDP2 keeps
# 0.87-0.89x in 52.7-55.2 GiB; 0.956x against FSDP2's 0.881x with checkpointing; 0.930-0.938x
# on 4 in 31.1 GiB against FSDP2's 0.829x.
#
# The one subtle part is what autograd keeps. A layer's forward saves its weights for
# the backward (dx = dy W), and by then that slot holds another layer's weights. So
# while a layer's forward runs, saved-tensor hooks (torch.autograd.graph.
# saved_tensors_hooks) replace any tensor that lies in a slot with a note of which
# layer, which weight and which view it was; the backward turns the note back into
# the same view of the weight gathered again. A hook on the layer's output starts that
# gather (and the next ``ahead`` layers'): its gradient exists just before the layer's
# backward runs. The last ahead + 1 layers keep their weights from forward to backward
# (the backward needs them at once). The gathers go on a process group of their own,
# so that their order, set by the hooks, never mixes with the reduce-scatters' order,
# set by GradientAverage. Between two uses a layer's weights are empty tensors (no
# elements): anything that reads them outside a forward of the layer fails loudly instead
# of reading another layer's numbers (gather_now makes every weight whole).
# Which layers: the decoder layers past the first ahead + 1, with --ddp-shard-optimizer's
# split weights; the embeddings and those first layers stay whole between the steps
# (--ddp-shard-optimizer's pieces of them, gathered in place during the optimizer step).


# How many layers' whole gradients may wait for their reduce-scatters before the stream
# waits for the oldest: at 8B on 4 x H200, 8 measured 0.942x one GPU's tokens/s per GPU
# against 0.932x with 2 (0.5 GiB more at the peak); on 2 x H200, 4 against 2 the same. With
# --grad-accum the whole gradients add up across micro-batches and live until the last
# one's backward, and the first averaged backward (which learns the order) averages them
# all at its end.
IN_FLIGHT_LAYERS = 8


def state_bytes(model, processes, itemsize, ahead=1, accumulate=False, release=True, checkpoints=False):
    """What each of ``processes`` holds under --ddp with --ddp-shard-optimizer's pieces
    before any activation, in bytes, for full fine-tuning of ``model`` (built on the meta
    device is enough) in weights of ``itemsize`` bytes; with ``release``, under
    --ddp-shard-weights too (None: it would release no weight). The choice of a mode under
    torchrun (run.choose_parallel) reads it. The selection ShardedUpdate and LayerWeights
    make, weight by weight:
    - a released weight (a split weight of a decoder layer from ddp.first_released(ahead)
      on): its piece, its gradient's piece and its two moments' pieces, 4/N of its bytes;
    - another split weight (the embeddings, the first layers; every split weight without
      ``release``): whole, with its whole gradient, and 1/N of each moment, 2 + 2/N;
    - the rest (norms, small weights, weights not divisible by N): 4 copies, as on one GPU;
    - the slots, ahead + 2 of the largest released layer, and the whole gradients waiting
      for their reduce-scatters: IN_FLIGHT_LAYERS layers', or with ``accumulate`` every
      released layer's (--grad-accum, which adds them up until the last micro-batch, and
      the first step after a resume, whose backward learns the order at its end).
    And what holds more for a while: the model is loaded whole on every process, then its
    pieces are copied out (the whole weights + 1/N of the released ones); with
    ``checkpoints`` (written or resumed) every weight is gathered whole beside the rest.
    Measured against it (NOTES.md, Step 19): a Qwen2 of 32B's shape over 4 GPUs, ~80 GiB by
    this count, peaked at 86.2 GiB with checkpointing's activations."""
    layers = list(swap_common.decoder_of(model).layers)
    released = {layer: [p for p in layer.parameters() if ddp.splits(p, processes, itemsize)]
                for layer in (layers[ddp.first_released(ahead):] if release else [])}
    in_layers = {p for weights in released.values() for p in weights}
    if release and not in_layers:
        return None
    steady = whole = 0.0
    for p in model.parameters():  # each once, tied weights too
        size = p.numel() * itemsize
        whole += size
        steady += size * (4 / processes if p in in_layers else
                          2 + 2 / processes if ddp.splits(p, processes, itemsize) else 4)
    if not release:  # the pieces gather in place: nothing holds more for a while
        return int(steady)
    layer_bytes = [sum(p.numel() for p in weights) * itemsize for weights in released.values()]
    largest = max(layer_bytes, default=0)
    whole_gradients = sum(layer_bytes) if accumulate else IN_FLIGHT_LAYERS * largest
    steady += (max(ahead, 1) + 2) * largest + whole_gradients
    loaded = whole + sum(layer_bytes) / processes
    gathered = steady + sum(layer_bytes) if checkpoints else 0
    return int(max(steady, loaded, gathered))


def _in_backward():
    """Whether autograd's engine is running a backward on this thread (a forward now is
    checkpointing's recomputation; torch.utils.checkpoint asks the same)."""
    return torch._C._current_graph_task_id() != -1


class _Saved:
    """What the saved-tensor hook keeps of a view of a slot: its layer, weight and view."""

    __slots__ = ("layer", "weight", "size", "stride", "offset")

    def __init__(self, layer, weight, t):
        self.layer, self.weight = layer, weight
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class LayerWeights:
    """--ddp-shard-weights for ``layers`` ([(decoder layer, its split weights)], forward
    order) under ``average`` (GradientAverage): see above."""

    def __init__(self, average, layers, ahead, windows):
        self.average = average
        self.modules = [m for m, _ in layers]
        trained = set(average.params)
        self.trained = [[p for p in m.parameters() if p in trained] for m in self.modules]  # split or not
        self.weights = [list(w) for _, w in layers]
        self.shape = {p: p.shape for ws in self.weights for p in ws}  # their whole shapes
        average.released = self
        self.ahead = max(ahead, 1)  # --ddp-gather-ahead 0 (every gather in the optimizer step) would hold them all
        # Whole gradients alive at a time: IN_FLIGHT_LAYERS layers'.
        self.in_flight = IN_FLIGHT_LAYERS * max(len(ws) for ws in self.weights)
        self.keep_from = len(self.modules) - (self.ahead + 1)  # these keep their weights from forward to backward
        device = self.weights[0][0].device
        self.group = torch.distributed.new_group(list(range(average.size)))
        backend = None
        if windows:
            torch.distributed.all_reduce(torch.zeros(1, device=device), group=self.group)  # its communicator, now
            backend = self.group._get_backend(device)
        self.signature = [tuple((p.shape, p.dtype) for p in ws) for ws in self.weights]
        self.free = {}  # signature -> slots (lists of whole-weight buffers) not held by a layer
        with torch.no_grad(), ddp.new_window(backend) if windows else contextlib.nullcontext():
            for ws in self.weights:  # each process's piece, in memory of its own
                for p in ws:
                    average.pieces[p] = torch.nn.Parameter(ddp.piece_of(p.detach(), average.rank, average.size).clone())
        with ddp.new_window(backend) if windows else contextlib.nullcontext():
            for signature in dict.fromkeys(self.signature):  # first-seen order: the same on every process
                self.free[signature] = [[torch.empty(shape, dtype=dtype, device=device) for shape, dtype in signature]
                                        for _ in range(self.ahead + 2)]
        self.empty = [[p.detach().new_empty(0) for p in ws] for ws in self.weights]
        self.held = [None] * len(self.modules)  # layer -> its slot while its weights are whole
        self.extra = set()  # layers whose slot is not one of the pool's (gather_now, or the pool ran out)
        self.where = {}  # a held buffer's storage address -> (layer, weight)
        self.gathers = {}  # layer -> its pending all-gathers
        self.packing = []  # (layer, its saved-tensor hooks) entered by the running layers' forwards
        for i, ws in enumerate(self.weights):
            for p, empty in zip(ws, self.empty[i]):
                p.data = empty  # the whole weight's memory goes back (empty_cache below)
        for i, module in enumerate(self.modules):
            module.register_forward_pre_hook(functools.partial(self._before_forward, i))
            module.register_forward_hook(functools.partial(self._after_forward, i), always_call=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def _gather(self, i, pooled=True):
        """Layer ``i``'s whole weights into a slot (asynchronous), unless they are whole;
        ``pooled``: a slot of the pool if one is free, else buffers outside it."""
        if i < 0 or i >= len(self.modules) or self.held[i] is not None:
            return
        free = self.free[self.signature[i]] if pooled else []
        if free:
            slot = free.pop()
        else:  # outside the pool (and NCCL's windows): NCCL's kernels gather it
            device = self.average.pieces[self.weights[i][0]].device
            slot = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.signature[i]]
            self.extra.add(i)
        self.held[i] = slot
        pieces = self.average.pieces
        works = []
        for j, (p, whole) in enumerate(zip(self.weights[i], slot)):
            self.where[whole.untyped_storage().data_ptr()] = (i, j)
            p.data = whole
            works.append(ddp.all_gather(whole.view(-1), pieces[p].detach(), group=self.group, async_op=True))
        self.gathers[i] = works

    def _join(self, i):
        for work in self.gathers.pop(i, ()):
            work.wait()  # on NCCL: this stream waits for the gather's; the host does not wait

    def _release(self, i):
        """Layer ``i``'s slot back to the pool (a later gather into it is queued after
        every kernel queued so far, which includes this layer's)."""
        slot = self.held[i]
        if slot is None:
            return
        self._join(i)
        for whole in slot:
            del self.where[whole.untyped_storage().data_ptr()]
        for p, empty in zip(self.weights[i], self.empty[i]):
            p.data = empty
        self.held[i] = None
        if i in self.extra:
            self.extra.discard(i)
        else:
            self.free[self.signature[i]].append(slot)

    def release_all(self):
        for i in range(len(self.modules)):
            self._release(i)

    def forget(self):
        """After a replay of the step's CUDA graph or a failed capture: the gathers the host
        recorded were joined inside the graph or never ran; every layer given back."""
        self.gathers.clear()
        self.release_all()

    def gather_now(self):
        """Every layer whole (a checkpoint's writer reads them): outside the pool, one
        buffer per weight; the next forward or optimizer step gives them back."""
        for i in range(len(self.modules)):
            self._gather(i, pooled=False)
        for i in range(len(self.modules)):
            self._join(i)

    def pieces_from_whole(self):
        """Each piece copied out of its whole weight (every layer whole: gather_now)."""
        with torch.no_grad():
            for i, ws in enumerate(self.weights):
                self._join(i)
                for p in ws:
                    piece = self.average.pieces[p]
                    piece.copy_(ddp.piece_of(p, self.average.rank, self.average.size))

    def start(self):
        """A forward begins (the input embedding's pre-hook): the first layers' gathers."""
        for i in range(self.ahead + 1):
            self._gather(i)

    # With --gradient-checkpointing a layer's forward saves nothing but its input, and its
    # backward begins by running the forward again. The weights gathered again for the
    # backward are then in their slot while the recomputed forward saves its views and
    # while the backward reads them, so no note is needed: the saved-tensor hooks stay out
    # of both forwards (checkpointing's own are the ones that must see them). Where HF
    # checkpoints the layer's whole __call__ (transformers 5.17) these hooks run again in
    # the recomputation, which then only waits for its gather; where it checkpoints the
    # forward inside __call__ (5.24) they do not run again, and the weights are whole since
    # _before_backward gathered them.
    def _checkpointed(self, module):
        return getattr(module, "gradient_checkpointing", False) and module.training

    def _before_forward(self, i, module, args):
        """Layer ``i``'s forward begins: it and the ``ahead`` after it gathered, its own
        waited for; with gradients, its saved tensors pass through _pack. In a backward
        (checkpointing's recomputed forward, after _before_backward gathered it): its own
        gather waited for, nothing else."""
        if _in_backward():
            if not self._checkpointed(module) or self.held[i] is None:
                raise RuntimeError("--ddp-shard-weights: a decoder layer's forward ran inside a backward that did "
                                   "not announce it (only non-reentrant --gradient-checkpointing is supported)")
            self._join(i)
            return
        if i == 0:  # a new forward: what an earlier one left held (one with no backward) goes back
            for j in range(self.ahead + 1, len(self.modules)):
                self._release(j)
        for j in range(i, i + self.ahead + 1):
            self._gather(j)
        self._join(i)
        if torch.is_grad_enabled() and not self._checkpointed(module):
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()
            self.packing.append((i, hooks))

    def _after_forward(self, i, module, args, output):
        """Layer ``i``'s forward is done: its backward announced by a hook on its output,
        its slot given back (unless it is one of the last, which keep theirs to backward).
        A forward recomputed in backward keeps its slot for the backward that follows."""
        if self.packing and self.packing[-1][0] == i:  # always_call: also after a forward that raised
            self.packing.pop()[1].__exit__(None, None, None)
        if _in_backward():
            return
        out = output[0] if isinstance(output, (tuple, list)) else output
        backward = torch.is_grad_enabled() and torch.is_tensor(out) and out.requires_grad
        if backward:
            out.register_hook(functools.partial(self._before_backward, i))
        if not backward or i < self.keep_from:
            self._release(i)

    def _before_backward(self, i, grad):
        """The gradient of layer ``i``'s output exists: its backward is next. Layer i + 1's
        backward has run (its slot goes back); whatever gradient layer i + 2's backward did
        not make is made now (GradientAverage.made_by_now); layer i and the ``ahead`` before
        it are gathered."""
        if i + 1 < len(self.modules):
            self._release(i + 1)
        if i + 2 < len(self.modules):  # its backward is surely over (one layer of margin)
            self.average.made_by_now(self.trained[i + 2])
        for j in range(i, i - self.ahead - 1, -1):
            self._gather(j)
        self._join(i)

    def _pack(self, t):
        """A tensor the forward saves: a view of a slot becomes a note, anything else stays."""
        try:
            where = self.where.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without plain storage: kept as it is
            where = None
        return t.detach() if where is None else _Saved(*where, t)  # detached: no reference cycle through t

    def _unpack(self, saved):
        """The backward reads a saved tensor: a note becomes the same view of the weight
        gathered again."""
        if not isinstance(saved, _Saved):
            return saved
        if self.held[saved.layer] is None:  # a backward its hooks did not announce: gathered now
            self._gather(saved.layer)
        self._join(saved.layer)
        return self.held[saved.layer][saved.weight].as_strided(saved.size, saved.stride, saved.offset)
