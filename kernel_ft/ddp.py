"""
A whole copy of the model per GPU under torchrun (``--ddp``), for a model whose weights,
gradients and optimizer state fit one GPU's memory.

README Step 19. What it teaches: the two halves of an all-reduce, and how each can hide
behind the step's compute.

* ``GradientAverage``: each gradient averaged over the processes in place, as soon as
  backward has made it, in the same order on every process; the input embedding's over
  the rows of the step's tokens only.
* ``ShardedUpdate`` (--ddp-shard-optimizer, on by default): each large gradient is
  reduce-scattered instead, every process updates its own piece of the weight (AdamW and
  its moments over 1/N), and the pieces are all-gathered back for the next forward, by
  the GPUs' copy engines where NCCL can (--ddp-copy-engines).
* --ddp-shard-weights: the decoder layers' weights kept as pieces too (ZeRO-3), each
  layer's gathered whole around its forward and again around its backward
  (kernel_ft/layer_weights.py).
* ``replicate_model`` sets them up; ``averaged_backward`` says which backward averages.

The processes themselves (torchrun, init_distributed) are kernel_ft/fsdp.py's. Nothing
runs on import.
"""

import contextlib
import functools
import os

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)
import swap_common

import torch

from kernel_ft import flags


# --------------------------------------------------------------------------------
# A whole copy per process (--ddp): each gradient averaged where autograd put it
# --------------------------------------------------------------------------------
# DistributedDataParallel copies every gradient into flat buckets (scaled by 1/N on the
# way), all-reduces the buckets and hands the gradients back as views into them. The
# copy reads and writes every gradient once more, 32 GB a step at 8B (8.1 ms of
# ``aten::mul`` on an H200, NOTES.md Step 19), and the buckets stay allocated through
# the forward, where one process alone has no gradients at all (they are freed after
# each step): 15 GiB more at the peak. Here each gradient is averaged in place, by
# NCCL's average, as soon as autograd has written it (a post-accumulate-grad hook): no
# copy, no second home for the gradients. Only the small ones, under PACKED_BYTES (norms,
# LoRA's adapters), are packed together into groups of at most --ddp-bucket-mb, so that
# they take one collective instead of hundreds (a copy of a few MB).
#
# Every process must join the same collectives in the same order. The order is the one
# in which rank 0's first averaged backward made the gradients (that backward averages
# them all at its end); from then on each group is averaged as soon as it and every
# group before it are complete, the same sequence on every process whatever order its
# backward happens to take. A gradient a process did not make (a weight its data never
# used, such as an MoE expert no token chose) is zero there, averaged after its
# backward; where no process made it, it is then zero, where one process alone would
# have none (AdamW decays a weight with a zero gradient and skips one without). With
# --grad-accum only the last micro-batch's backward averages; the others add into the
# gradients on each process.
#
# The input embedding's gradient is the last one backward makes, so its average has
# nothing left beside it: at 8B its 1 GB crosses NVLink while every GPU waits. Yet only
# the rows of the tokens this step saw are not zero (4,096 of 128,256 per process at
# 2 x 2,048). So (--ddp-embedding-rows) the forward keeps the token ids its input
# embedding looked up, and instead of the whole gradient the processes average only the
# rows at every process's ids (all-gathered first): 64 MB instead of 1 GB over 2 GPUs.
# The all-gather needs as many ids from every process, and the step's CUDA graph keeps
# each process's batch shape fixed (a batch of another shape stops the run), so it is
# done there, in the captured step; the eager steps average the whole gradient. The
# first averaged backward checks on every process that the gradient is zero outside its
# own ids (an embedding whose weight something else also reads would not be) and that
# the counts agree; if not, the whole gradient is averaged, as before, and so it is where
# the rows would be more than half the vocabulary (many GPUs, long accumulation). What it
# buys at 8B on 2 x H200, one call: 0.966x one GPU's tokens/s per GPU against 0.962x.
PACKED_BYTES = 2**20  # smaller gradients are packed into groups; larger ones are averaged alone, in place


def averages_rows(model, embedding, params):
    """Whether --ddp-embedding-rows applies to ``embedding`` (the model's input
    embedding): an nn.Embedding whose large weight trains, tied to no output layer."""
    if not isinstance(embedding, torch.nn.Embedding) or embedding.sparse or embedding.max_norm is not None:
        return False
    weight = embedding.weight
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (any(p is weight for p in params) and weight.numel() * weight.element_size() >= PACKED_BYTES
            and (head is None or getattr(head, "weight", None) is not weight))


class GradientAverage:
    """The trainable parameters of ``model`` averaged over the ``size`` processes of the
    default group (see above); gradients under PACKED_BYTES are packed into groups of at
    most ``group_bytes``. ``averaged_backward`` says which backward passes average."""

    def __init__(self, model, size, group_bytes, rank=0, embedding_rows=False):
        self.rank, self.size, self.group_bytes = rank, size, group_bytes
        self.pieces = {}  # --ddp-shard-optimizer: weight -> this process's piece (ShardedUpdate)
        self.released = None  # --ddp-shard-weights: the LayerWeights whose weights are whole only in use
        self.params = [p for p in model.parameters() if p.requires_grad]  # tied weights once
        self.names = {p: name for name, p in model.named_parameters()}
        self.groups = None  # made at the end of the first averaged backward (learn_order)
        self.active = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._made)
        # --ddp-embedding-rows: the input embedding's weight, whose gradient is averaged over
        # the rows the step's ids used; decided (rows_checked) at the first averaged backward.
        embedding = model.get_input_embeddings() if embedding_rows and hasattr(model, "get_input_embeddings") else None
        self.rows = embedding.weight if embedding is not None and averages_rows(model, embedding, self.params) else None
        self.rows_checked = False
        self.rows_in_eager = False  # tests: every process's batch has one shape outside a capture too
        self.rows_averaged = 0  # how many averaged backward passes took the rows path (a capture counts once)
        if self.rows is not None:
            embedding.register_forward_pre_hook(self._saw_ids)
        self._reset()

    def _reset(self):
        self.made = {}  # the gradients this backward made, in the order it made them
        self.filled = set()  # those made_by_now made (a gradient of one arriving later is an error)
        self.missing = [len(group) for group in self.groups] if self.groups else None
        self.next = 0  # the first group not averaged yet
        self.pending = []  # (work, what to do once it is done, or None)
        self.in_flight = []  # --ddp-shard-weights: (reduce-scatter, the whole gradient it reads)
        self.ids = []  # the token ids the input embedding looked up since the last averaged backward

    def _flat_ids(self):
        """The token ids kept since the last averaged backward, as one vector."""
        return torch.cat([i.reshape(-1) for i in self.ids])

    def _saw_ids(self, module, args):
        if torch.is_grad_enabled() and args and torch.is_tensor(args[0]):
            self.ids.append(args[0])

    def _made(self, p):
        if not self.active:
            return
        if p in self.made:
            if p in self.filled:
                raise RuntimeError(f"--ddp-shard-weights: the gradient of {self.names[p]} arrived after its decoder "
                                   f"layer's backward was taken as over (a weight its layer shares with an earlier "
                                   f"one?); leave --ddp-shard-weights out")
            raise RuntimeError(f"--ddp: {self.names[p]} received a second gradient in one averaged backward; a "
                               f"weight used by two backward passes of one micro-batch is not supported")
        self.made[p] = None
        if self.groups is None:  # the first averaged backward: its order is learned, all averaged at its end
            return
        self.missing[self.group_of[p]] -= 1
        while self.next < len(self.groups) and self.missing[self.next] == 0:
            self._average(self.groups[self.next])
            self.next += 1

    def made_by_now(self, params):
        """--ddp-shard-weights: the backward of the decoder layer that holds ``params`` is
        over (LayerWeights says so two layers later). A gradient of one of them that this
        backward did not make (an MoE expert no token of this process's batch chose) is
        made now as zeros, or as what earlier micro-batches summed (--grad-accum), so that
        this process averages in the same order as the others instead of holding its later
        averages back to the end of backward, where the others' waits (in_flight) would
        wait for it while it waits for their gathers."""
        if not self.active:
            return
        for p in params:
            if p in self.made:
                continue
            self._zeros_if_missing(p)
            self.filled.add(p)
            self._made(p)

    def _zeros_if_missing(self, p):
        """A gradient this backward did not make is zeros; a released weight's zeros go
        straight to its reduce-scatter (its memory is empty: _average_piece makes them)."""
        if p.grad is None and not self._released(p):
            p.grad = torch.zeros_like(p)

    def learn_order(self):
        """The groups, in the order rank 0's backward made the gradients (then those it did
        not make), told to every process (one broadcast, once: the host waits for it, so
        never inside a CUDA graph's capture; the eager steps before it come first)."""
        if capturing():
            raise RuntimeError("--ddp: the first averaged backward learns the gradients' order with a host "
                               "broadcast, which a CUDA graph cannot capture: run at least one eager step first")
        index = {p: i for i, p in enumerate(self.params)}
        order = [index[p] for p in self.made]
        seen = set(order)
        order += [i for i in reversed(range(len(self.params))) if i not in seen]
        told = [order]
        torch.distributed.broadcast_object_list(told, src=0)
        self.groups, packed, packed_bytes = [], [], 0
        for p in (self.params[i] for i in told[0]):
            size = self._shape(p).numel() * p.element_size()
            if size >= PACKED_BYTES:  # alone, in place; the packed ones before it go first
                self.groups += [packed, [p]] if packed else [[p]]
                packed, packed_bytes = [], 0
                continue
            if packed and packed_bytes + size > self.group_bytes:
                self.groups.append(packed)
                packed, packed_bytes = [], 0
            packed.append(p)
            packed_bytes += size
        if packed:
            self.groups.append(packed)
        self.group_of = {p: i for i, group in enumerate(self.groups) for p in group}

    def _rows_only(self, p):
        """Whether this backward averages only the used rows of ``p``'s gradient: the input
        embedding, checked at the first backward, in a capture (or the tests' eager knob),
        and all processes' rows at most half of its rows (else the whole one is cheaper)."""
        return (p is self.rows and self.rows_checked and bool(self.ids) and (capturing() or self.rows_in_eager)
                and self.size * sum(i.numel() for i in self.ids) <= p.shape[0] // 2)

    def _average(self, group):
        if self._rows_only(group[0]):
            return self._average_rows(group[0])
        if group[0] in self.pieces:  # alone in its group (over PACKED_BYTES)
            return self._average_piece(group[0])
        grads = [p.grad for p in group]
        packed = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else None
        flat = grads[0] if packed is None else packed
        work = self._launch_average(torch.distributed.all_reduce, flat)
        self.pending.append((work, None if packed is None else functools.partial(_unpack, packed, grads)))

    def _launch_average(self, collective, flat, *output):
        """``collective(*output, flat)``, asynchronous, averaging ``flat`` over the processes:
        NCCL averages inside its own kernel; gloo has no average: each process's share, then
        their sum (DistributedDataParallel's way)."""
        dist = torch.distributed
        if flat.is_cuda:
            return collective(*output, flat, op=dist.ReduceOp.AVG, async_op=True)
        flat.div_(self.size)
        return collective(*output, flat, async_op=True)

    def _piece_grad(self, p):
        """--ddp-shard-optimizer: this process's piece of ``p.grad`` (a view), given to the
        optimizer as ``piece.grad``."""
        if not p.grad.is_contiguous():
            raise RuntimeError(f"--ddp-shard-optimizer: the gradient of {self.names[p]} is not contiguous; "
                               f"its pieces would not be pieces of its memory (leave the flag out)")
        piece = self.pieces[p]
        piece.grad = piece_of(p.grad, self.rank, self.size)
        return piece.grad

    def _average_piece(self, p):
        """--ddp-shard-optimizer: a reduce-scatter in place instead of the all-reduce; this
        process's piece of the gradient becomes the average of every process's piece
        there (NCCL in place: the output is the input's piece at offset rank). The rest of
        p.grad stays this process's own sum (on gloo, divided by N)."""
        if self._released(p):  # the piece's gradient, a buffer of its own
            piece = self.pieces[p]
            grad = p.grad if p.grad is not None else piece.new_zeros(self._shape(p))  # one this backward never made
            if not grad.is_contiguous():
                raise RuntimeError(f"--ddp-shard-weights: the gradient of {self.names[p]} is not contiguous")
            piece.grad = torch.empty_like(piece)
            p.grad = None
            self.in_flight.append((self._launch_average(reduce_scatter, grad.view(-1), piece.grad), grad))
            # The whole gradient's memory goes back once its reduce-scatter has read it, not at
            # the end of backward: this stream waits for the reduce-scatter released.in_flight
            # gradients back (long done by then: no stall), so that only that many whole
            # gradients live at a time instead of every layer's. The wait is on the other
            # processes too. A process whose backward did not make a gradient (an MoE expert no
            # token chose) makes it as zeros two layers later (made_by_now) and averages on from
            # there, in the same order: the others' waits are then on reduce-scatters it issues
            # before it needs any gather they issue after those waits. (Past the last released
            # layers nothing waits for a gather, and the rest may be held back to finish().)
            while len(self.in_flight) > self.released.in_flight:
                self.in_flight.pop(0)[0].wait()
            return
        mine = self._piece_grad(p)
        self.pending.append((self._launch_average(reduce_scatter, p.grad.view(-1), mine), None))

    def _average_rows(self, p):
        """--ddp-embedding-rows: the rows of ``p.grad`` at every process's ids averaged (an
        id twice is the same row twice: both copies carry the same sum), then written back;
        every other row is zero on every process, so ``p.grad`` is then the whole average."""
        ids = self._flat_ids()
        everyone = ids.new_empty(self.size * ids.numel())
        all_gather(everyone, ids)
        rows = p.grad.index_select(0, everyone)
        work = self._launch_average(torch.distributed.all_reduce, rows)
        if p in self.pieces:
            self._piece_grad(p)
        self.pending.append((work, functools.partial(p.grad.index_copy_, 0, everyone, rows)))
        self.rows_averaged += 1

    def _only_rows_seen(self):
        """Whether the input embedding's gradient is zero outside the rows of this
        process's ids (read on the host: the first averaged backward only)."""
        grad = self.rows.grad
        if grad is None or not self.ids:
            return False
        seen = torch.zeros(grad.shape[0], dtype=torch.bool, device=grad.device)
        seen[self._flat_ids()] = True
        largest = torch.linalg.vector_norm(grad, ord=float("inf"), dim=1)
        return largest.masked_fill_(seen, 0).max().item() == 0

    def finish(self):
        """After the backward that averages: the groups not averaged yet (a gradient this
        process never made is zero), then this stream waits for every average."""
        if self.groups is None:
            self.learn_order()
            if self.rows is not None:  # every process agrees, or every one averages the whole gradient
                # The ids' all-gather needs one count on every process: the largest and the smallest.
                n = sum(i.numel() for i in self.ids)
                counts = torch.tensor([n, -n], device=self.rows.device)
                torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
                one_count = counts[0].item() == -counts[1].item()
                self.rows_checked = all_agree(one_count and self._only_rows_seen())
        for group in self.groups[self.next:]:
            for p in group:
                self._zeros_if_missing(p)
            self._average(group)
        for work, then in self.pending:
            work.wait()  # on NCCL: this stream waits for NCCL's; the host does not wait
            if then is not None:
                then()
        for work, _ in self.in_flight:
            work.wait()
        if self.released is not None:  # the last layers' weights, kept for this backward, go back
            self.released.release_all()

    def _released(self, p):
        """Whether --ddp-shard-weights keeps ``p`` as a piece between uses (its memory empty)."""
        return self.released is not None and p in self.released.shape

    def _shape(self, p):
        """``p``'s whole shape (--ddp-shard-weights: a released weight's memory is empty)."""
        return self.released.shape[p] if self._released(p) else p.shape


def piece_of(t, rank, size):
    """Process ``rank``'s piece of ``t`` among ``size``: elements [rank n/size, (rank + 1)
    n/size) of its memory, a view (where NCCL's reduce-scatter writes and its all-gather reads)."""
    n = t.numel() // size
    return t.view(-1).narrow(0, rank * n, n)


def _unpack(packed, grads):
    """A packed group's average back into each of its gradients."""
    offset = 0
    for g in grads:
        g.copy_(packed[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


# --------------------------------------------------------------------------------
# --ddp-shard-optimizer: each process updates its own piece of every large weight
# --------------------------------------------------------------------------------
# Under --ddp every process runs the same AdamW update of the whole model (28 ms of an
# H200's 344 ms step at 8B, 38 of an H100's) and keeps the same two moments (4 bytes per
# bf16 parameter). An all-reduce is a reduce-scatter followed by an all-gather; here the
# two halves are pulled apart. Backward reduce-scatters each large gradient, so process r
# holds the average of its own piece r (1/N of the elements); it updates that piece of
# the weight, with AdamW's moments of that piece only; and the next forward all-gathers
# the updated pieces back into whole weights. The same bytes cross between the GPUs as
# the all-reduce moved. What it buys: AdamW and the gradient norm over 1/N of those
# weights, 1/N of their moments in memory. What it costs: most all-gathers run beside the
# forward, where the all-reduces ran beside the backward, and a weight is whole only
# after the next forward's gather (or gather_now).
#
# No copies: piece r of a weight is elements [r n/N, (r+1) n/N) of its own memory, where
# NCCL's reduce-scatter writes and its all-gather reads in place, and the optimizer is
# given that piece as a Parameter of its own, a view, so AdamW's update writes the weight.
# The gathers go out in the order the forward needs the weights (embedding, decoder layers
# one by one, output embedding), on NCCL's stream: the first ones (the embedding's and the
# first --ddp-gather-ahead layers') during the optimizer step, as soon as their pieces are
# updated, beside the rest of the update; each of the others when the forward reaches the
# layer that many before it. A forward pre-hook makes each decoder layer wait for its own
# weights only, and the LM head's are waited for after the last layer (the fused loss
# reads its weight without calling it). Which weights: those of the embeddings and the
# decoder layers that train, hold at least PACKED_BYTES and split into N equal pieces;
# the others are averaged whole and updated on every process as before.
def reduce_scatter(output, input, **kwargs):
    """torch.distributed's reduce-scatter of one tensor (reduce_scatter_single from torch
    2.13 on, where the older name warns; the same arguments)."""
    dist = torch.distributed
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(output, input, **kwargs)


def all_gather(output, input, **kwargs):
    """torch.distributed's all-gather of one tensor (all_gather_single from torch 2.13 on)."""
    dist = torch.distributed
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(output, input, **kwargs)


# The gathers by the copy engines (--ddp-copy-engines, on by default where it can). A GPU
# also has DMA engines that copy memory, to another GPU over NVLink too, without an SM.
# NCCL's all-gather kernel needs SMs, and while the forward's matmuls hold them it waits
# for some: measured on 2 x H200 (tools/comm_overlap.py, results/ddp/copy_engines/),
# an 8B layer's weights x 4 (1.6 GB) gather in 4.5 ms alone and in 24 ms beside matmuls.
# NCCL 2.28 moves an all-gather with the copy engines when both its buffers lie in
# symmetric windows (memory from NCCL's own allocator, registered by every process with the
# same sizes in the same order) and the communicator's CTA policy is zero: the same
# gathers then take 2.8 ms beside the matmuls. So the split weights are moved into such
# memory once, before their pieces are made; the reduce-scatters of the gradients keep
# NCCL's kernels (a sum needs an SM). What it buys at 8B, 2 x 2,048 tokens per GPU: per
# GPU 0.965x one GPU's tokens/s on 2 x H200 (0.933x by NCCL's kernels), 0.971x on 4
# (0.929x); NOTES.md, Step 19.
NCCL_ZERO_CTA = "2"  # NCCL_CTA_POLICY_ZERO, read from the environment when a communicator is made
WINDOWS = []  # (NCCL backend, memory pool) registered by this process, deregistered by close_distributed


def copy_engines_refused():
    """What rules the all-gathers by the copy engines out before NCCL starts (None:
    nothing): an NCCL before 2.28, processes on several hosts (the copy engines reach the
    GPUs of their own host), an NCCL_CTA_POLICY set by hand to another value."""
    version = torch.cuda.nccl.version()
    if version < (2, 28):
        return f"NCCL {'.'.join(map(str, version))} (2.28 or later moves all-gathers by the copy engines)"
    local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's: the processes on this host
    if local is not None and local != os.environ.get("WORLD_SIZE", local):
        return "processes on several hosts (a copy engine reaches the GPUs of its own host)"
    policy = os.environ.get("NCCL_CTA_POLICY")
    if policy not in (None, NCCL_ZERO_CTA):
        return f"NCCL_CTA_POLICY={policy} set by hand ({NCCL_ZERO_CTA}, zero CTAs, needed)"
    return None


def copy_engines_unavailable(device):
    """Why the all-gathers on ``device`` cannot go by the copy engines (None: they can)."""
    if device.type != "cuda":
        return "NCCL on GPUs only"
    refused = copy_engines_refused()
    if refused:
        return refused
    backend = torch.distributed.group.WORLD._get_backend(device)
    if not (hasattr(backend, "mem_allocator") and hasattr(backend, "register_mem_pool")):
        return f"torch {torch.__version__} cannot register NCCL windows (ProcessGroupNCCL.register_mem_pool)"
    if os.environ.get("NCCL_CTA_POLICY") != NCCL_ZERO_CTA:
        return f"NCCL_CTA_POLICY unset when NCCL started ({NCCL_ZERO_CTA}, zero CTAs, needed)"
    return None


@contextlib.contextmanager
def new_window(backend):
    """The tensors made inside come from the memory of NCCL's allocator (``backend``, a
    ProcessGroupNCCL), registered at the end as symmetric windows by every process (a
    collective: every process makes the same sizes in the same order) and kept in WINDOWS,
    which close_distributed deregisters."""
    pool = torch.cuda.MemPool(backend.mem_allocator)
    with torch.cuda.use_mem_pool(pool):
        yield
    backend.register_mem_pool(pool, symm=True)
    WINDOWS.append((backend, pool))


def into_windows(weights):
    """Each of ``weights`` moved into one new window (new_window). The Parameters stay the
    same objects."""
    with torch.no_grad(), new_window(torch.distributed.group.WORLD._get_backend(weights[0].device)):
        for p in weights:
            moved = torch.empty_like(p)
            moved.copy_(p)
            p.data = moved
    torch.cuda.empty_cache()  # their old memory back to the device


def capturing():
    """Whether a CUDA graph is being captured on this thread's stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def splits(p, size, itemsize=None):
    """Whether --ddp-shard-optimizer splits weight ``p`` into ``size`` pieces: one averaged
    alone (PACKED_BYTES or more, in ``itemsize`` bytes per value where given: a weight
    built on the meta device to estimate memory), divisible by ``size`` and contiguous."""
    return p.numel() * (itemsize or p.element_size()) >= PACKED_BYTES and p.numel() % size == 0 and p.is_contiguous()


def first_released(ahead):
    """The first decoder layer --ddp-shard-weights releases, gathering ``ahead`` layers
    ahead: the ones before it stay whole between the steps (ShardedUpdate, below)."""
    return max(ahead, 1) + 1


class ShardedUpdate:
    """--ddp-shard-optimizer for ``model`` under ``average`` (its GradientAverage)."""

    def __init__(self, model, average, ahead=flags.DDP_GATHER_AHEAD, windows=False, release=False):
        self.average, self.size = average, average.size
        layers = list(swap_common.decoder_of(model).layers)
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        owners = [embedding, *layers] + ([head] if head is not None and head is not embedding else [])
        trains = set(average.params)
        self.order, taken = [], set()  # (owner module, its weights split into pieces), forward order
        for owner in owners:
            weights = [p for p in owner.parameters() if p in trains and p not in taken and splits(p, self.size)]
            taken.update(weights)
            if weights:
                self.order.append((owner, weights))
        # --ddp-shard-weights: the decoder layers' weights whole only while used (LayerWeights),
        # but for the first ahead + 1 layers, which stay whole as --ddp-shard-optimizer keeps them
        # (gathered during the optimizer step): the forward starts without waiting for a gather
        # and the backward ends without one. What it buys at 8B on 2 x H200: 0.952x one GPU's
        # tokens/s per GPU against 0.946x with every layer released, for 0.4 GiB (NOTES.md).
        first = layers[:first_released(ahead)]
        in_layers = [(owner, weights) for owner, weights in self.order
                     if release and owner in layers and owner not in first]
        self.order = [entry for entry in self.order if entry not in in_layers]
        self.released = None
        if in_layers:
            from kernel_ft import layer_weights  # the file after this one (it uses this one's collectives)

            self.released = layer_weights.LayerWeights(average, in_layers, ahead, windows)
        if windows and self.order:  # before the pieces: they are views of the weights' memory
            into_windows([p for _, weights in self.order for p in weights])
        for _, weights in self.order:
            for p in weights:
                # A view: the optimizer's update of the piece writes the weight's own memory.
                average.pieces[p] = torch.nn.Parameter(piece_of(p.detach(), average.rank, self.size))
        self.gathers = {}  # owner -> the all-gathers it waits for
        self.stale = False  # True from an update until every piece's gather of its round is issued
        self.issued = len(self.order)  # owners of this round whose gathers are issued
        self.index = {owner: i for i, (owner, _) in enumerate(self.order)}
        self.owner_of = {average.pieces[p]: i for i, (_, weights) in enumerate(self.order) for p in weights}
        # How many owners ahead of the running one are gathered (0: all of them, during the
        # optimizer step).
        self.ahead = ahead if ahead > 0 else len(self.order)
        # The first owners the next forward needs at once (the embedding, the first layers)
        # are gathered during the optimizer step instead, right after their pieces' updates,
        # beside the rest of the update: what it buys, the forward does not start by waiting.
        self.early = min(1 + self.ahead, len(self.order))
        self.updating = False  # between the step's first piece update and its end
        embedding.register_forward_pre_hook(self._start)  # first: the embedding waits for its own after it
        for owner, _ in self.order:
            if owner is head and head is not embedding:  # after the last layer: the loss may read it directly
                layers[-1].register_forward_hook(lambda module, args, out, owner=owner: self._wait(owner))
            else:
                owner.register_forward_pre_hook(lambda module, args, owner=owner: self._wait(owner))

    def optimizer_parameters(self, params):
        """``params`` with each split weight replaced by this process's piece of it."""
        return [self.average.pieces.get(p, p) for p in params]

    def attach(self, optimizer):
        """The optimizer's gradient norm adds up the pieces' sums over the processes; its
        zero_grad frees the whole gradients too; its step makes the weights stale."""
        optimizer.add_up_pieces = self._add_up
        zero_grad = optimizer.zero_grad

        def zero_grad_and_whole(set_to_none=True):
            zero_grad(set_to_none=set_to_none)
            for p in self.average.pieces:  # backward must start from nothing, not from last step's sums
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

        optimizer.zero_grad = zero_grad_and_whole
        optimizer.after_update = self._piece_updated
        optimizer.register_step_post_hook(lambda *args: self.updated())

    def _piece_updated(self, piece):
        """The optimizer has just queued ``piece``'s update: the step's first piece starts
        a new round of gathers; an early owner whose pieces are all updated is gathered now
        (in the forward order: every process issues the same collectives in the same order)."""
        if piece not in self.owner_of:
            return
        if not self.updating:
            self.updating, self.issued = True, 0
            self.left = [len(weights) for _, weights in self.order]
        self.left[self.owner_of[piece]] -= 1
        while self.issued < self.early and self.left[self.issued] == 0:
            self._issue(self.issued + 1)

    def updated(self):
        """After the optimizer step (eager, or being captured): the pieces are new. The early
        gathers are waited for here, at the step's end (a CUDA graph's capture must join
        every stream it forked before it ends)."""
        self.stale, self.updating = True, False
        for owner, _ in self.order[:self.issued]:
            self._join(owner)
        if self.released is not None:  # whole weights held now (gather_now's) are the old ones
            self.released.release_all()
        if self.issued == len(self.order) and not capturing():
            self.stale = False

    def _add_up(self, params, sums):
        """``sums[i]``: this process's sum of squares of params[i]'s gradient; those of the
        pieces added up over the processes (one all-reduce of their sums)."""
        key = tuple(map(id, params))
        if getattr(self, "_rows", (None,))[0] != key:  # made in the eager steps; a capture finds it made
            pieces = set(self.average.pieces.values())
            rows = [i for i, p in enumerate(params) if p in pieces]
            self._rows = (key, torch.tensor(rows, dtype=torch.long, device=sums.device))
        rows = self._rows[1]
        if rows.numel() == 0:
            return sums
        shared = sums.index_select(0, rows)
        torch.distributed.all_reduce(shared)
        return sums.index_copy(0, rows, shared)

    def _issue(self, upto):
        """The all-gathers of the owners before index ``upto`` of the forward order that are
        not issued yet (in place: each piece into its whole weight)."""
        while self.issued < min(upto, len(self.order)):
            owner, weights = self.order[self.issued]
            pieces = self.average.pieces  # each a view of its weight at offset rank: NCCL gathers in place
            self.gathers[owner] = [all_gather(p.detach().view(-1), pieces[p].detach(), async_op=True) for p in weights]
            self.issued += 1
        # A capture records the gathers without running them: the weights stay stale until
        # a replay, and after a replay they are stale again (updated()).
        if self.issued == len(self.order) and not capturing():
            self.stale = False

    def _start(self, module, args):
        """The input embedding's forward begins: the round's next gathers if the pieces are new
        (and --ddp-shard-weights' first layers)."""
        if self.stale:
            self._issue(1 + self.ahead)
        if self.released is not None:
            self.released.start()

    def _wait(self, owner):
        """Before ``owner`` runs: the next ``ahead`` owners' gathers issued (and its own, where
        no embedding forward started the round: a model fed inputs_embeds), then its own done
        (on NCCL: this stream waits for NCCL's, the host does not wait)."""
        if self.stale:
            self._issue(self.index[owner] + 1 + self.ahead)
        self._join(owner)

    # A CUDA graph replays what its capture recorded, and no Python runs then: the host's
    # record of the round (stale, issued) is set to what every replay leaves, whatever an
    # evaluation or a checkpoint between two replays did to it.
    def before_capture(self):
        """Outside the capture, before it: every pending gather joined, and the round set to
        what the captured forward must find after each replayed step (the early owners
        gathered by the step, the others not), so that it records their gathers."""
        for owner, _ in self.order:
            self._join(owner)
        self.updating, self.issued, self.stale = False, self.early, True
        if self.released is not None:  # the captured step starts from every layer given back, as it ends
            self.released.release_all()

    def replayed(self):
        """After each replay: the early owners whole (gathered in its step), the others stale."""
        self.gathers.clear()  # every gather of the replay was joined inside it
        self.updating, self.issued = False, self.early
        self.stale = self.early < len(self.order)
        if self.released is not None:  # the replay ends with every layer given back; what the host held is old
            self.released.forget()

    def capture_failed(self):
        """A capture that failed (on any process) recorded gathers that never ran: forget them;
        the next forward gathers every piece again, the same on every process."""
        self.gathers.clear()
        self.updating, self.issued, self.stale = False, 0, True
        if self.released is not None:
            self.released.forget()

    def _join(self, owner):
        for work in self.gathers.pop(owner, ()):
            work.wait()

    def gather_now(self):
        """Whole weights now (before a checkpoint is written): every process calls it."""
        if self.stale:
            self._issue(len(self.order))
        for owner, _ in self.order:
            self._wait(owner)
        if self.released is not None:
            self.released.gather_now()


def _sharded(model):
    """The model's ShardedUpdate (--ddp-shard-optimizer with weights to split), or None."""
    return getattr(model, "_sharded_update", None)


def gather_now(model):
    """--ddp-shard-optimizer: every weight whole and current (a collective); else nothing."""
    sharded = _sharded(model)
    if sharded is not None:
        sharded.gather_now()


def pieces_from_whole(model):
    """--ddp-shard-weights: after whole weights were loaded into the model (a resume, after
    gather_now), each process's pieces taken from them; else nothing."""
    sharded = _sharded(model)
    if sharded is not None and sharded.released is not None:
        sharded.released.pieces_from_whole()


def released_weights(model):
    """How many weights --ddp-shard-weights keeps as pieces between uses (0: none)."""
    sharded = _sharded(model)
    return 0 if sharded is None or sharded.released is None else len(sharded.released.shape)


def optimizer_in_pieces(model):
    """Whether the optimizer holds pieces of the weights (--ddp-shard-optimizer)."""
    return _sharded(model) is not None


def graph_hooks(model):
    """--ddp under CUDA graphs: (before the capture, after each replay, after a failed
    capture). Around the capture the token ids kept for --ddp-embedding-rows are dropped:
    the captured step records its own; with --ddp-shard-optimizer, ShardedUpdate's."""
    average, sharded = getattr(model, "_gradient_average", None), _sharded(model)

    def drop_ids():
        if average is not None:
            average.ids = []

    def both(first, then):
        return lambda: (first(), then())

    if sharded is None:
        return drop_ids, (lambda: None), drop_ids
    return both(drop_ids, sharded.before_capture), sharded.replayed, both(drop_ids, sharded.capture_failed)


def optimizer_parameters(model, params):
    """The parameters the optimizer gets: ``params``, or under --ddp-shard-optimizer the
    pieces of the split weights in their place."""
    sharded = _sharded(model)
    return params if sharded is None else sharded.optimizer_parameters(params)


def attach_optimizer(model, optimizer):
    sharded = _sharded(model)
    if sharded is not None:
        sharded.attach(optimizer)


def replicate_model(model, world, bucket_mb=flags.DDP_BUCKET_MB, shard_optimizer=False,
                   gather_ahead=flags.DDP_GATHER_AHEAD, copy_engines=False, embedding_rows=False,
                   shard_weights=False):
    """--ddp: a whole copy of ``model`` per process, its gradients averaged over the
    processes in every training step (GradientAverage). Every process starts from rank
    0's weights and buffers (broadcast now). Call it after the kernels are switched in,
    like shard_model; the model stays the HF model it was. ``shard_optimizer``: the large
    weights updated in pieces (ShardedUpdate), gathered ``gather_ahead`` layers ahead, by
    the copy engines where ``copy_engines`` and the GPUs' NCCL can. ``embedding_rows``:
    the input embedding's gradient averaged over the rows the step used. ``shard_weights``
    (with ``shard_optimizer``): the decoder layers' weights whole only while used
    (LayerWeights)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            whole = t if t.is_contiguous() else t.contiguous()  # a collective sends contiguous memory
            torch.distributed.broadcast(whole, src=0)
            if whole is not t:
                t.copy_(whole)
    model._gradient_average = GradientAverage(model, world.size, int(bucket_mb * 2**20), world.rank,
                                              embedding_rows and world.size > 1)
    if model._gradient_average.rows is not None:
        print("DDP:           the input embedding's gradient averaged over the rows of the step's tokens only "
              "(all-gathered ids) in the step's CUDA graph, once the first backward shows no other row is used; "
              "eager steps average it whole")
    if shard_optimizer and world.size > 1:
        why_not = copy_engines_unavailable(world.device) if copy_engines else "--no-ddp-copy-engines"
        if copy_engines and world.device.type == "cuda" and not all_agree(why_not is None):
            why_not = why_not or "another process cannot"  # registering windows is a collective: all or none
        sharded = ShardedUpdate(model, model._gradient_average, gather_ahead, windows=why_not is None,
                                release=shard_weights)
        pieces = model._gradient_average.pieces
        numel = lambda p: model._gradient_average._shape(p).numel()  # noqa: E731 - a released weight's is empty
        split = sum(numel(p) for p in pieces)
        whole = sum(numel(p) for p in model._gradient_average.params)
        if split:  # else (small LoRA adapters) every weight is averaged whole, as without the flag
            model._sharded_update = sharded
            by = "the copy engines (NCCL windows)" if why_not is None else f"NCCL's kernels ({why_not})"
            print(f"DDP:           {world.size} processes; --ddp-shard-optimizer: {len(pieces)} "
                  f"weights ({split / max(whole, 1):.0%} of the trained parameters) reduce-scattered, updated in "
                  f"pieces of 1/{world.size} and gathered again for the next forward by {by}")
            if shard_weights and sharded.released is None:
                print("DDP:           --ddp-shard-weights changes nothing: no decoder layer has a weight split into "
                      f"pieces (each trained one under {PACKED_BYTES / 2**20:g} MB or not divisible by {world.size})")
            if sharded.released is not None:
                layers = sharded.released
                print(f"DDP:           --ddp-shard-weights: {len(layers.shape)} weights of {len(layers.modules)} "
                      f"decoder layers kept as pieces, whole only around their layer's forward and backward "
                      f"({layers.ahead} layer(s) gathered ahead, {layers.ahead + 2} slots per layer shape)")


@contextlib.contextmanager
def averaged_backward(model, last=True):
    """Around a backward of the training step: under --ddp, with ``last`` (the step's last
    micro-batch) the gradients are averaged over the processes as backward makes them,
    and all of them are when this ends. Anything else: nothing."""
    average = getattr(model, "_gradient_average", None)
    if average is None or not last:
        yield
        return
    average.active = True
    try:
        yield
        average.finish()
    finally:  # ready for the next backward, also after one that raised
        average.active = False
        average._reset()


def all_agree(flag):
    """True on every process when ``flag`` is True on every process (one all-reduce of a
    flag, read on the host): the processes of a --ddp run take their CUDA-graph decisions
    together."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    agreed = torch.tensor([int(bool(flag))], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    return bool(agreed.item())
