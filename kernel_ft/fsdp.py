"""
Several GPUs under torchrun: the processes, and FSDP2 (``--fsdp``); a whole copy per GPU
(``--ddp``) is kernel_ft/ddp.py.

README Step 19. What it teaches: how a model too big for one GPU's memory (weights,
gradients and AdamW's two moments: 16 bytes per parameter for full fine-tuning)
is spread over N processes, and what that costs.

* torchrun starts N copies of the script; ``init_distributed`` finds this process's
  rank and GPU and joins the others (NCCL on GPUs, gloo on CPU for the tests).
* ``shard_model``: every decoder layer, then the whole model, becomes a
  ``fully_shard`` unit. Each process keeps 1/N of every weight, gradient and
  optimizer state; a layer's full weights are gathered just before it runs and
  freed after; gradients are reduce-scattered, so each process ends the backward
  with the averaged gradient of its own shard only.
  The fused linear cross-entropy runs inside the model's own forward
  (linear_cross_entropy_kernel.fuse_linear_cross_entropy), so the root's hooks
  gather the LM head's weight for it and reduce its gradient after it.
* ``ddp.replicate_model`` (``--ddp``, for a model that fits one GPU, kernel_ft/ddp.py):
  a whole copy per process, each gradient averaged in place as backward makes it.
* ``reduce_over_ranks``: token counts and losses summed over the processes, so a
  step's loss is the mean over all of its tokens, as on one GPU.

Every rank trains; rank 0 alone prints and writes. Nothing runs on import.
"""

import math
import os
import sys

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)
import swap_common

import torch

from kernel_ft import ddp, flags, models

# --------------------------------------------------------------------------------
# Several processes: FSDP2 under torchrun (--fsdp)
# --------------------------------------------------------------------------------
# torchrun starts N copies of the script and tells each who it is in three
# environment variables. With --fsdp every process holds 1/N of each weight, of its
# gradient and of AdamW's state (torch.distributed.fsdp.fully_shard, "FSDP2": the
# parameters become DTensors sharded on dim 0), and gathers a layer's full weights
# just before the layer runs, forward and backward. Each process trains on its own
# --batch-size rows of the step's global batch (training_batches), and the
# gradients are averaged over the processes by a reduce-scatter that leaves each
# process the gradient of its own shard only.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class World:
    """This process's place among torchrun's: rank, size (N), local rank, device."""

    def __init__(self, rank, size, local_rank, device):
        self.rank, self.size, self.local_rank, self.device = rank, size, local_rank, device


def rank_and_size():
    """(rank, number of processes): (0, 1) unless torch.distributed is running."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def is_main_process():
    """Rank 0: the one process that prints and writes files shared by all."""
    return rank_and_size()[0] == 0


def barrier():
    if rank_and_size()[1] > 1:
        torch.distributed.barrier()


def check_fsdp_flags(args):
    """--fsdp and --ddp need torchrun. One line each, before any work. (torchrun with
    several processes and neither flag gets one: run.choose_parallel.)"""
    sharded, replicated = getattr(args, "fsdp", False), getattr(args, "ddp", False)
    if sharded and replicated:
        raise SystemExit("error: --fsdp and --ddp: choose one (--fsdp shards the model, --ddp copies it whole)")
    if not sharded and not replicated:
        return
    flag = "--fsdp" if sharded else "--ddp"
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise SystemExit(f"error: {flag} runs under torchrun, which sets {', '.join(missing)}: "
                         f"torchrun --nproc-per-node N {os.path.basename(sys.argv[0])} {flag} ...")
    check_fsdp_comm(args)
    if replicated and getattr(args, "ddp_shard_optimizer", None):
        if not flags.kernels_from_args(args)["adamw"]:
            raise SystemExit("error: --ddp-shard-optimizer updates pieces of the weights through the Triton AdamW, "
                             "whose gradient norm adds up every process's pieces: add --use-custom-adamw")
        if getattr(args, "compile", False):
            raise SystemExit("error: --ddp-shard-optimizer with --compile is not supported: the layers wait for "
                             "their gathered weights in forward hooks, which a compiled layer would trace; leave "
                             "one of them out")
    if getattr(args, "lora_4bit", False):  # --lora (bf16 or float32 adapters and weights) is sharded like any model
        raise SystemExit("error: --fsdp with --lora-4bit is not supported: FSDP2 would have to shard "
                         "bitsandbytes' packed 4-bit weights; use --lora, or --lora-4bit on one GPU")
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"error: {flag}: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs "
                             f"are visible; start at most that many processes per node")


# A whole copy per process (--ddp) when its weights, gradients and AdamW state take at
# most this share of the device's memory; the rest is for activations. 8B full
# fine-tuning, 2 x 2,048 per GPU, measured on 2 x H200: 60.15-60.65 GiB at the peak with
# --ddp (one GPU alone: 60.15; the averages add no copy), where REPLICA_STATE_COPIES x 16 GB
# of bf16 weights is 59.8 GiB: 75% of an 80 GB H100, so an H100 takes --ddp for it too
# (faster than --fsdp where both fit: NOTES.md, Step 19).
REPLICA_SHARE = 0.8
# Weights, their gradients and AdamW's two moments, each in the weights' dtype (the
# gradients are averaged where they lie: GradientAverage keeps no second copy). Where
# the pieces apply (flags.shards_optimizer) each process keeps 1/N of the two moments of
# every weight split into pieces: 2 + 2/N copies of those (8B over 2 GPUs: 3 x 14.96 =
# 44.9 GiB; measured peak 45.20 on 2 x H200), counted weight by weight
# (layer_weights.state_bytes).
REPLICA_STATE_COPIES = 4


def replica_memory(args):
    """(bytes a whole copy of the model holds before any activation, bytes of this
    process's device, the device in words): what --ddp needs per process, and what it
    has. With --lora only the adapters train: the frozen weights alone count; with the
    pieces (--ddp-shard-optimizer, on by default where it applies) 1/N of AdamW's state of
    each weight split into pieces (layer_weights.state_bytes)."""
    model, itemsize = _meta_model(args)
    weights = sum(p.numel() for p in model.parameters()) * itemsize
    if getattr(args, "lora", False):
        need = weights
    elif flags.shards_optimizer(args):
        need = _pieces_state(args, model, itemsize, release=False)
    else:
        need = REPLICA_STATE_COPIES * weights
    return (need, *device_memory())


def shard_weights_memory(args):
    """What each process would hold under --ddp --ddp-shard-weights before any activation,
    in bytes, with what holds more for a while (layer_weights.state_bytes), for the same
    comparison as replica_memory's; None where it would release no weight."""
    return _pieces_state(args, *_meta_model(args), release=True)


def _meta_model(args):
    """The run's model built on the meta device, and its weights' bytes per value here."""
    config = models.tiny_config() if args.tiny else models.config_for(args.model)
    return models.meta_model(config), models.weights_dtype(args, _this_device()).itemsize


def _pieces_state(args, model, itemsize, release):
    from kernel_ft import layer_weights  # the lesson that counts them; it imports ddp, which this file does too

    resumed = bool(getattr(args, "resume", None))
    return layer_weights.state_bytes(model, flags.processes_started(), itemsize,
                                     flags.gather_ahead(args.but(ddp_shard_weights=release)),
                                     accumulate=getattr(args, "grad_accum", 1) > 1 or resumed, release=release,
                                     checkpoints=bool(getattr(args, "output_dir", None)) or resumed)


def _this_device():
    on_gpu = torch.cuda.is_available()
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")


def device_memory():
    """(bytes, in words) of this process's device: the whole memory, not what is free
    now, as every process must make the same choice (they have no process group yet to
    agree on one), and the free memory of two GPUs of one host can differ by what else
    runs on them."""
    device = _this_device()
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return properties.total_memory, f"of an {properties.name}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)  # processes of this host share its RAM
    total = models.available_ram("MemTotal")
    return (total or 0) // local, f"of host memory per process ({local} on this host)"


# --fsdp-comm: where FSDP2's all-gather buffers live. copy-engines (the default where it
# can: "auto"): kept in NCCL's symmetric windows (WindowGathers, below), so that the
# all-gathers run on the copy engines instead of SMs and the matmuls beside them keep
# every SM; what it bought at 8B, 2 x 2,048 tokens per GPU on 2 x H200: 0.869-0.876x of
# one GPU per GPU against 0.851x (weights kept gathered), 0.867x against 0.833x
# (gathered again in backward), 2.4 GiB more at the peak (NOTES.md, Step 19). The others
# call one FSDPModule method on every sharded module: symm-mem, the same idea in torch's
# own symmetric memory (torch 2.11 lacks it); pg-memory, NCCL's own buffers, which it can
# send from without a copy where the fabric allows (NVLS; measured slower: 0.77x against
# 0.81x per GPU, 8B full on 2 x H200).
COMM_SETTERS = {"symm-mem": ("set_symm_mem_for_comm", "NCCL"),
                "pg-memory": ("set_allocate_memory_from_process_group_for_comm", True)}
WINDOW_GATHERS = "set_custom_all_gather"  # the FSDPModule method --fsdp-comm copy-engines calls
WINDOW_GATHERS_READ = ((2, 11), (2, 13))  # torch versions whose FSDP2 gather order WindowGathers relies on


class WindowGathers:
    """--fsdp-comm copy-engines: FSDP2's all-gathers from NCCL's symmetric windows, which
    NCCL 2.28 moves with the copy engines under the zero-CTA policy (as --ddp's pieces:
    ddp.into_windows), through FSDPModule.set_custom_all_gather on a torch that lacks
    set_symm_mem_for_comm. FSDP2 asks ``allocate`` for each all-gather's output (its copy-in
    writes this process's shards into it, so the input lies there too) and drops the
    tensor after its copy out; windows are registered by every process in the same order,
    once, so the buffers are kept: ``ring`` of each size, handed out in turn. When is one
    free again? FSDP2's gather streams wait for a copy-out event before each new gather
    (FSDPParamGroup.wait_for_unshard, read in torch 2.11 and 2.13: WINDOW_GATHERS_READ): in
    a forward without explicit prefetch, that of two layers back; with P layers prefetched,
    one back from P + 1 ahead; in backward, the one just done. So the decoder layers share
    one WindowGathers of max(2, P + 1) buffers (at most one per layer), and the root,
    gathered once at the start of a step (its gather streams wait for all the work before
    it; FSDP2 keeps the root whole through backward), one of its own. Windows live in the
    default group's communicator: the one FSDP2's default mesh uses (another group's
    gathers would find no window and run on NCCL's kernels)."""

    def __init__(self, device, ring):
        self.backend = torch.distributed.group.WORLD._get_backend(device)
        self.ring = ring
        self.buffers = {}  # (numel, dtype) -> [the ring's tensors, the next one's index]

    def allocate(self, size, *, dtype, device):
        numel = math.prod(int(n) for n in size)
        key = (numel, dtype)
        if key not in self.buffers:  # the first gather of this size, on every process in turn
            with ddp.new_window(self.backend):
                tensors = [torch.empty(numel, dtype=dtype, device=device) for _ in range(self.ring)]
            self.buffers[key] = [tensors, 0]
        tensors, turn = self.buffers[key]
        self.buffers[key][1] = (turn + 1) % len(tensors)
        return tensors[turn].view(*size)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return ddp.all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def check_fsdp_comm(args):
    """--fsdp-comm asked for by name: NCCL on GPUs, and a torch that has the method (and
    for copy-engines what else is known before NCCL starts: window_gathers_refused)."""
    comm = getattr(args, "fsdp_comm", "auto")
    if comm in ("auto", "pytorch") or not getattr(args, "fsdp", False):
        return
    if not torch.cuda.is_available():
        raise SystemExit(f"error: --fsdp-comm {comm} places NCCL's buffers on GPUs; without a GPU (gloo) leave it out")
    from torch.distributed.fsdp import FSDPModule

    method = WINDOW_GATHERS if comm == "copy-engines" else COMM_SETTERS[comm][0]
    if not hasattr(FSDPModule, method):
        raise SystemExit(f"error: --fsdp-comm {comm} needs FSDPModule.{method}, which torch {torch.__version__} "
                         f"lacks; leave it out or upgrade torch")
    if comm == "copy-engines" and (refused := window_gathers_refused(asked=True)):
        raise SystemExit(f"error: --fsdp-comm copy-engines: {refused}; leave it out")


def window_gathers_refused(asked):
    """What rules the FSDP all-gathers by the copy engines out before NCCL starts (None:
    nothing): a GPU, FSDP2's custom all-gather, NCCL 2.28, one host; and unless ``asked``
    for by name (--fsdp-comm copy-engines), a torch whose FSDP2 was read for it."""
    from torch.distributed.fsdp import FSDPModule

    if not torch.cuda.is_available():
        return "NCCL on GPUs only"
    if not hasattr(FSDPModule, WINDOW_GATHERS):
        return f"torch {torch.__version__} has no FSDPModule.{WINDOW_GATHERS}"
    version = tuple(int(n) for n in torch.__version__.split("+")[0].split(".")[:2])
    if not asked and not WINDOW_GATHERS_READ[0] <= version <= WINDOW_GATHERS_READ[1]:
        return (f"torch {torch.__version__}: its FSDP2's order of gathers and copies was not checked "
                f"(--fsdp-comm copy-engines asks for it anyway)")
    return ddp.copy_engines_refused()


def window_gathers_unavailable(device, asked=False):
    """Why FSDP2's all-gathers on ``device`` cannot go by the copy engines (None: they can)."""
    if device.type != "cuda":
        return "NCCL on GPUs only"
    return window_gathers_refused(asked) or ddp.copy_engines_unavailable(device)


def init_distributed(args):
    """--fsdp or --ddp: join torchrun's process group (NCCL between GPUs, gloo on CPU),
    pin this process to GPU LOCAL_RANK; every process but rank 0 stops printing.
    Returns a World, or None without either."""
    if not getattr(args, "fsdp", False) and not getattr(args, "ddp", False):
        return None
    rank, size, local_rank = (int(os.environ[name]) for name in TORCHRUN_ENV)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # "cuda" is now this process's GPU
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    comm = getattr(args, "fsdp_comm", "auto") if getattr(args, "fsdp", False) else None
    if backend == "nccl" and (comm in ("symm-mem", "copy-engines") or (
            comm == "auto" and window_gathers_refused(asked=False) is None) or (
            getattr(args, "ddp", False) and flags.shards_optimizer(args) and getattr(args, "ddp_copy_engines", True))):
        # NCCL reads it when the communicator is made: its all-gathers from symmetric
        # memory then go through the copy engines (zero CTAs). A value set by hand stays.
        os.environ.setdefault("NCCL_CTA_POLICY", ddp.NCCL_ZERO_CTA)
    if not torch.distributed.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        torch.distributed.init_process_group(backend=backend, **kwargs)
    print_on_rank0_only(rank)
    return World(rank, size, local_rank, device)


def print_on_rank0_only(rank):
    """One report, rank 0's; errors still reach stderr from every rank."""
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process


def close_distributed():
    """The end of a run under torchrun: every rank reaches the teardown before any closes
    its connections (a rank that tears gloo down while the other still sends can abort
    that one), then the process group goes, then the process itself, at once.

    Why at once: Python's own shutdown then still runs C++ destructors (gloo's worker
    threads, the autograd engine's) against an interpreter half torn down, and now and
    then that aborts a rank (SIGABRT, "terminate called without an active exception")
    after its work is done and its results are written: torchrun then reports the whole
    run as failed. Everything is written and flushed by now, so nothing is lost."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    torch.distributed.barrier()
    while ddp.WINDOWS:  # NCCL's windows go before their communicator does
        backend, pool = ddp.WINDOWS.pop()
        backend.deregister_mem_pool(pool)
    torch.distributed.destroy_process_group()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker, not a test holding a group
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def shard_model(model, args, world):
    """--fsdp: fully_shard each decoder layer, then the root (embedding, final norm,
    LM head); a model built on the meta device (load_model) is then materialized,
    shard by shard. Call it after the kernels are switched in: the module swaps
    must see the modules as built, and FSDP gives every module's forward its full
    (unsharded) weights, so TritonRMSNorm and TritonLlamaMLP run unchanged.

    On a GPU the weights are gathered in bf16 and the gradients reduced in the dtype
    reduce_dtype_for chooses (MixedPrecisionPolicy); the tiny float32 model (and the CPU)
    keeps float32 throughout.

    With --lora (apply_lora ran before, on the whole model) each layer's frozen
    weights and its adapters are sharded together, one group: FSDP2 gathers both
    for the forward and reduce-scatters only the gradients that exist, the
    adapters'; the optimizer then gets the adapters' shards (trainable_parameters).
    A model built on the meta device gets PEFT's adapter initialization back after
    HF's (materialize).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    reduce_dtype = reduce_dtype_for(args, model, world.size)
    if world.device.type == "cuda" and not args.tiny:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=getattr(torch, reduce_dtype))
    layers = swap_common.decoder_of(model).layers
    # --fsdp-keep-gathered (what it buys: backward skips one all-gather per layer, and
    # FSDP's copy out of its buffer; what it costs: the layers' bf16 weights stay whole
    # on every process from forward until their backward, the memory sharding saved).
    # "auto" starts without and decides after the first steps (decide_keep_gathered).
    keep = getattr(args, "fsdp_keep_gathered", "off") == "on"
    for layer in layers:
        fully_shard(layer, reshard_after_forward=not keep, **kwargs)
    fully_shard(model, **kwargs)
    # Prefetch (what it buys: the next layers' all-gathers run while this one computes,
    # instead of starting when the next layer's forward is reached, which a host that
    # is not far ahead of the GPU reaches late). Backward walks the layers in reverse.
    prefetch = getattr(args, "fsdp_prefetch", 0)
    comm, unavailable = getattr(args, "fsdp_comm", "auto"), None
    if comm in ("auto", "copy-engines"):
        unavailable = window_gathers_unavailable(world.device, asked=comm == "copy-engines")
        if unavailable and comm == "copy-engines":
            raise SystemExit(f"error: --fsdp-comm copy-engines: {unavailable}; leave it out")
        comm = "pytorch" if unavailable else "copy-engines"
    if comm == "copy-engines":
        gathers = WindowGathers(world.device, ring=min(max(2, prefetch + 1), len(layers)))
        for layer in layers:
            getattr(layer, WINDOW_GATHERS)(gathers)
        getattr(model, WINDOW_GATHERS)(WindowGathers(world.device, ring=1))
    elif comm in COMM_SETTERS:
        method, value = COMM_SETTERS[comm]
        for module in [*layers, model]:
            getattr(module, method)(value)
    if prefetch:
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(list(layers[i + 1:i + 1 + prefetch]))
            layer.set_modules_to_backward_prefetch(list(layers[max(0, i - prefetch):i])[::-1])
    materialized = ""
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        materialize(model, world.device)
        materialized = "; built on the meta device, each process initialized its own shards"
    precision = f"bf16 weights, {reduce_dtype} gradient reduction" if kwargs else "float32"
    ahead = f"{prefetch} layer{'s' if prefetch > 1 else ''} gathered ahead" if prefetch else "no prefetch"
    kept = ""
    if keep:
        kept = "; weights kept gathered from forward to backward"
    elif keep_gathered_is_decided(args):
        kept = f"; weights kept gathered from forward to backward if they fit, decided after step {KEEP_DECIDED_AFTER}"
    if comm == "copy-engines":
        comms = "; all-gathers by the copy engines (NCCL windows)"
    elif comm == "pytorch":  # where auto fell back on GPUs: why
        on_gpu = world.device.type == "cuda"
        comms = f"; all-gathers by NCCL's kernels ({unavailable})" if unavailable and on_gpu else ""
    else:
        comms = f"; communication buffers: {comm}"
    print(f"FSDP:          {world.size} processes, {len(layers)} decoder layers + the root sharded "
          f"({precision}; {ahead}{kept}{comms}){materialized}")
    return model


# --fsdp-keep-gathered auto: decided after this many steps (the second step is the first
# with AdamW's state, which the first allocates at its end), against this share of the
# smallest GPU's memory (what the allocator's cache and fragmentation need beyond it).
KEEP_DECIDED_AFTER = 2
KEEP_HEADROOM = 0.90


def keep_gathered_fits(peak, weights, capacity):
    """The rule of --fsdp-keep-gathered auto, in bytes: keep the layers' weights gathered
    when the peak measured so far plus all of them whole stays within KEEP_HEADROOM of
    the GPU's memory. (The layer being computed is already whole in the peak: the rule
    counts it twice, on the safe side.)"""
    return peak + weights <= KEEP_HEADROOM * capacity


def keep_gathered_is_decided(args):
    """Does this run decide --fsdp-keep-gathered after its first steps? (auto, --fsdp, a GPU)"""
    return getattr(args, "fsdp", False) and getattr(args, "fsdp_keep_gathered", "off") == "auto" \
        and torch.cuda.is_available()


def decide_keep_gathered(args, model):
    """--fsdp-keep-gathered auto on a GPU, called by every process after KEEP_DECIDED_AFTER
    steps: from the largest peak of any process so far, the smallest GPU and the bytes of
    every layer's weights as FSDP gathers them, the same answer on every process (they must
    agree: a process that gathers again in backward waits for the others). Keeping them
    switches each layer to reshard_after_forward=False for the steps to come. Returns the
    decision and its numbers (keep_gathered_line prints them), or None where there is
    nothing to decide (not auto, not a GPU)."""
    if not keep_gathered_is_decided(args):
        return None
    layers = swap_common.decoder_of(model).layers
    # Bytes per weight as gathered: shard_model's bf16 (tiny: float32), or 1 where the shard
    # gathers itself in FP8 (kernel_ft/fp8_gather.py gives its local tensor the method).
    plain = 4 if args.tiny else 2
    weights = sum(p.numel() * (1 if hasattr(getattr(p, "_local_tensor", None), "fsdp_pre_all_gather") else plain)
                  for layer in layers for p in layer.parameters())  # DTensors: whole sizes
    capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    peak, minus_capacity = reduce_over_ranks([torch.cuda.max_memory_allocated(), -capacity], op="max")
    capacity = -minus_capacity  # the smallest GPU's
    decision = {"kept": keep_gathered_fits(peak, weights, capacity), "peak_bytes": int(peak),
                "weights_bytes": int(weights), "capacity_bytes": int(capacity)}
    if decision["kept"]:
        for layer in layers:
            layer.set_reshard_after_forward(False, recurse=False)
    return decision


def keep_gathered_line(decision):
    """The line that says what decide_keep_gathered chose, and why."""
    verdict = "kept from forward to backward from now on" if decision["kept"] else "gathered again in backward"
    return (f"FSDP:          after {KEEP_DECIDED_AFTER} steps the layers' weights are {verdict} (--fsdp-keep-gathered "
            f"auto): peak {decision['peak_bytes'] / 2**30:.1f} GiB + {decision['weights_bytes'] / 2**30:.1f} GiB of "
            f"whole weights {'<=' if decision['kept'] else '>'} {KEEP_HEADROOM:.0%} of "
            f"{decision['capacity_bytes'] / 2**30:.1f} GiB")


def reduce_dtype_for(args, model, processes):
    """The dtype FSDP averages the gradients over the processes in: --fsdp-reduce-dtype,
    or for "auto" bfloat16 over 2 processes when every trainable weight is bf16, else float32.

    Why bfloat16 is free there: the backward computes each gradient in bf16 and the
    shard keeps it in the weight's dtype, bf16. Averaged over 2 processes in float32,
    (a + b) / 2 of two bf16 numbers is exact, and the cast back to bf16 rounds once.
    In bfloat16, NCCL adds the two halves once and rounds the sum once, to nearest:
    the same bits (tests/fsdp_test.py checks it on 2 GPUs), with half the bytes to send and
    to copy. Over more processes a ring adds hop by hop and rounds to bf16 at each
    hop; with float32 weights (or adapters) float32 keeps digits that bf16 would drop.
    """
    chosen = getattr(args, "fsdp_reduce_dtype", "auto")
    if chosen != "auto":
        return chosen
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    return "bfloat16" if processes == 2 and trainable == {torch.bfloat16} else "float32"


def materialize(model, device):
    """A model built on the meta device (shapes, no memory), now sharded: allocate
    each process's shards on ``device`` (to_empty: uninitialized memory) and fill
    them with HF's own initialization, module by module. The random draws of a
    DTensor are those of the full tensor, so every shard is a piece of one model.
    HF's _init_weights also recomputes the rotary embedding's buffers."""
    model.to_empty(device=device)
    with torch.no_grad():
        model.apply(model._init_weights)
        if models.is_peft_model(model):
            reset_lora_adapters(model)


def reset_lora_adapters(model):
    """HF's _init_weights (materialize) treats each adapter's A and B as the plain
    Linear layers they are and draws both at random: B would no longer be zero, and
    the model would not start as the base model. PEFT's own initialization of
    each LoRA layer puts them back: A as PEFT draws it, B zeros."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name in module.lora_A:
                module.reset_lora_parameters(name, model.peft_config[name].init_lora_weights)


def reduce_over_ranks(values, op="sum"):
    """A list of Python numbers, summed (or max) over the processes; as given on one."""
    if rank_and_size()[1] == 1:
        return values
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM)
    return t.tolist()
