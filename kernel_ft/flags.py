"""
What every script shares before the work starts: its flags and their defaults.
(The output files are files.py's; the environment banner is reporting.py's.)

Used by every script (README Step 2 lists the model and data flags; Steps 17-19 the
flags of a real run). What it teaches:

* One definition of each flag. profile_baseline.py, finetune_baseline.py and
  finetune_optimized.py must measure exactly the same work, or their numbers
  cannot be compared, so they share ``add_model_args`` / ``add_finetune_args``
  and differ only in what they switch in (``--use-custom-<kernel>``).
* Defaults that depend on the hardware (``settle``): without a GPU the
  kernels run in Triton's interpreter, so the default run is a tiny model for a
  few steps; on a GPU it is LLaMA-3.1-8B. A flag that another overrides is said
  in one ``Note:`` line, never silently.
* Settled once: ``settle`` returns the resolved flags as read-only ``Settings``;
  every module reads those and none writes into them.

Without a GPU the Triton kernels run through Triton's interpreter on CPU tensors.
The interpreter is switched on by an environment variable that must be set before
``triton`` is first imported (transformers imports it too): kernel_common sets it,
so it is imported first, here and in every module below that loads torch.

The workload's files, each importing only those before it (ddp makes a layer_weights.LayerWeights
when asked, importing it there):
files -> flags -> models -> ddp -> layer_weights -> fsdp -> dataloader -> checkpoints -> cuda_graphs
-> reporting -> training, and run.py, which composes them with the kernels (kernel_ft.apply).
Nothing runs on import.
"""

import argparse
import os

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)
import swap_common

import torch

from kernel_ft import files

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B"
# The clone this package sits in: the step scripts and the bundled data are there.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED_DATASET = os.path.join(ROOT, "data", "instructions.jsonl")  # the default --dataset
SYNTHETIC = "synthetic"  # --dataset synthetic: seeded random tokens, every slot real
EVAL_BATCHES = 4  # --eval-batches default (and the synthetic count when args has none)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # --lora-targets


# --------------------------------------------------------------------------------
# Command-line flags
# --------------------------------------------------------------------------------
def positive_int(text):
    """argparse type: an integer >= 1 (a zero batch would only fail later, obscurely)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def add_model_args(parser, custom_kernels_default=False, packing_default=False):
    """Flags shared by every script that builds a model and trains it.

    ``packing_default``: the baseline pads each batch to its longest example, as HF's
    collator does; finetune_optimized.py packs (see "Data" below).
    """
    g = parser.add_argument_group("model and data")
    g.add_argument("--model", default=DEFAULT_MODEL, help="HF hub id or local directory (default: %(default)s)")
    g.add_argument("--random-init", action="store_true", help="no weights: random init in the model's architecture")
    g.add_argument(
        "--tiny",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="small random LLaMA, float32 (default: on when there is no GPU and --model is not given)",
    )
    g.add_argument("--batch-size", type=positive_int, default=2, help="sequences per step (default: %(default)s)")
    g.add_argument(
        "--seq-len",
        type=positive_int,
        help=f"tokens per sequence, the longest a batch row can be (default: 2048; --tiny: {CPU_TINY_SEQ_LEN}, "
             f"room for a short prompt and its answer in byte tokens)",
    )
    g.add_argument("--seed", type=seed, default=0, help="seed of the weights and the data (default: %(default)s)")
    g.add_argument(
        "--dataset",
        metavar="NAME_OR_PATH",
        default=BUNDLED_DATASET,
        help="instruction data: a local .json/.jsonl/.parquet file or a HF hub dataset id, with Dolly "
             "(instruction, context, response) or Alpaca (instruction, input, output) fields; 'synthetic' "
             "for seeded random tokens of exactly --seq-len (pure throughput) (default: the bundled "
             "data/instructions.jsonl)",
    )
    g.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=packing_default,
        help="pack several examples into each --seq-len row (no padding; attention never crosses "
             "examples) instead of padding each batch to its longest example (default: %(default)s)",
    )
    g.add_argument(
        "--num-workers",
        type=non_negative_int,
        help="DataLoader worker processes that build the batches (default: 2 with a GPU, 0 without)",
    )
    g.add_argument(
        "--pin-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the DataLoader puts batches in pinned (page-locked) host memory, so the copy to the GPU is one "
             "asynchronous DMA; --no-pin-memory copies from pageable memory, through a staging buffer, "
             "while the CPU waits (GPU only; default: %(default)s)",
    )
    g.add_argument("--lr", type=positive_float, help="AdamW peak learning rate (default: 1e-5; --tiny: 3e-3)")
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each decoder layer in backward instead of storing its activations "
             "(HF's gradient_checkpointing_enable, non-reentrant): less memory, ~1/3 more compute",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each decoder layer, the kernels inside it (GPU: Inductor; CPU: aot_eager)",
    )
    g.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        default="default",
        help="torch.compile mode for --compile; reduce-overhead replays CUDA graphs (default: %(default)s)",
    )
    k = parser.add_argument_group("custom Triton kernels")
    for name, help_text in KERNEL_FLAGS.items():
        # finetune_optimized.py's kernels of the model are on where they compute the model's own
        # function (None: decided for the model by run.apply_kernels, which says why one is left
        # out; a flag given on the command line is strict: a kernel asked for that cannot go in
        # ends the run in one line). Attention, moreover, only where it pays off: packed real
        # data (kernels_from_args), families whose own attention is the eager one, and on a GPU
        # rows of one document where it is measured faster than SDPA (run.assemble).
        default = None if name != "adamw" and custom_kernels_default else custom_kernels_default
        said = DECIDED_PER_MODEL.get(name, WHERE_IT_APPLIES) if default is None else default
        k.add_argument(
            f"--use-custom-{name}",
            action=argparse.BooleanOptionalAction,
            default=default,
            help=f"{help_text} (default: {said})",
        )
    # Not a kernel of every model (and no column of the family matrix): LoRA layers only.
    k.add_argument("--use-custom-lora", action=argparse.BooleanOptionalAction,
                   default=None if custom_kernels_default else False,
                   help="with --lora: each adapter's scale and sum inside the base layer's matrix products (cuBLAS "
                        "epilogues) instead of PEFT's separate passes (default: "
                        f"{WHERE_IT_APPLIES if custom_kernels_default else False})")
    if custom_kernels_default:  # finetune_optimized.py
        add_fp8_arg(k)
    return parser


def add_fp8_arg(parser):
    """--fp8 {tensorwise,rowwise}: the fine-tune script's and the profiler's."""
    parser.add_argument("--fp8", choices=FP8_RECIPES,
                        help="the decoder's linear layers multiply in FP8 with dynamic scales (fp8_kernel.py): one "
                             "scale per tensor or per row; the LM head and LoRA adapters stay as they are (default: "
                             "off; needs a GPU with FP8 tensor cores)")
    parser.add_argument("--fp8-grads", choices=FP8_GRAD_FORMATS, default="e4m3",
                        help="with --fp8: the format of the output gradients backward casts: e4m3 (3 mantissa bits, "
                             "~2^17 of range below the largest value) or e5m2 (2 bits, ~2^32; torchao's tensorwise "
                             "choice) (default: e4m3)")
    parser.add_argument("--fp8-fast-accum", action="store_true",
                        help="with --fp8: the backward products (dX, dW) accumulate at the tensor cores' own "
                             "precision too, as the forward's always do: ~3%% faster at 8B; check the loss against a "
                             "run without it (fp8_kernel.py, \"Fast accumulation\") (default: off)")


# The kernels a run can switch on, in the order they are applied and reported,
# with the help of their --use-custom-<name> flags.
KERNEL_FLAGS = {
    "rmsnorm": "replace every RMSNorm module with TritonRMSNorm",
    "residual": "pre-norm decoder layers add the residual stream inside their RMSNorm kernels, forward and "
                "backward (their two norms become TritonRMSNorm)",
    "swiglu": "replace every gated MLP with one whose act(gate) * up is the fused Triton SwiGLU (GeGLU for Gemma)",
    "rope": "rotary position embedding with the fused Triton kernel, inside this model's forward only",
    "attention": "flash attention in Triton that takes the documents of a packed row from the position ids: "
                 "no T x T mask, no work across documents",
    "ce": "compute the loss with the Triton cross-entropy on the model's logits",
    "flce": "fused linear cross-entropy: LM head + loss in chunks, the logits are never built "
            "(supersedes --use-custom-ce)",
    "adamw": "the fused Triton AdamW step instead of torch.optim.AdamW(fused=True)",
    "projections": "the projections that read one input (q/k/v, gate/up) as one autograd node: their input "
                   "gradients summed in cuBLAS's epilogues instead of by add kernels",
}
KERNELS = tuple(KERNEL_FLAGS)
WHERE_IT_APPLIES = "on where it computes the model's own function; said in one line where not"
DECIDED_PER_MODEL = {
    "attention": "on with packed real data, where the model runs eager attention, and on a GPU for rows of one "
                 "document where measured faster than SDPA",
    "residual": "on where the decoder layers have the plain pre-norm form",
}
FP8_RECIPES = ("tensorwise", "rowwise")  # fp8_kernel.RECIPES (fp8_test checks they agree)
FP8_GRAD_FORMATS = ("e4m3", "e5m2")  # fp8_kernel.GRAD_FORMATS (the same)


def kernels_from_args(args):
    """{kernel name: on/off} from the --use-custom-* flags: True or False as given, None
    (finetune_optimized.py's defaults) for on where the kernel applies to the model."""
    kernels = {name: getattr(args, f"use_custom_{name}", False) for name in KERNELS}
    packed_real_data = getattr(args, "packing", False) and getattr(args, "dataset", None) != SYNTHETIC
    if kernels["attention"] is None and not packed_real_data:
        kernels["attention"] = False  # left at its default: on with packed real data (and see run.assemble)
    if getattr(args, "use_custom_lora", False) is not False and getattr(args, "lora", False):
        kernels["lora"] = args.use_custom_lora  # reported for LoRA runs only (None: where it applies)
    if getattr(args, "fp8", None):
        kernels["fp8"] = args.fp8  # the recipe
        kernels["fp8_grads"] = getattr(args, "fp8_grads", "e4m3")  # the gradients' format
        kernels["fp8_fast_accum"] = getattr(args, "fp8_fast_accum", False)  # the backward products' accumulation
        if getattr(args, "fsdp", False):  # --fsdp-fp8-gather's default depends on --lora: what it came to
            kernels["fp8_gathered"] = fp8_gathered(args)
    return kernels


def fp8_gathered(args):
    """Does this --fsdp run gather its FP8 layers' weights in FP8? (kernel_ft/fp8_gather.py)
    --fp8 tensorwise without --compile, and --fsdp-fp8-gather, or by default --lora: the
    frozen weights' FP8 copies are then each process's shard, not the whole weight."""
    chosen = getattr(args, "fsdp_fp8_gather", None)
    return getattr(args, "fsdp", False) and getattr(args, "fp8", None) == "tensorwise" \
        and not getattr(args, "compile", False) and bool(chosen or (chosen is None and getattr(args, "lora", False)))


def check_fp8_flags(args, flag="--fp8"):
    """An FP8 flag (--fp8, or the baseline's --torchao-fp8) before anything is built: a
    GPU with FP8 tensor cores, bf16 linear layers to cast; the peer in one process."""
    if not getattr(args, flag[2:].replace("-", "_"), None):
        return
    if getattr(args, "lora_4bit", False):
        raise SystemExit(f"error: {flag} with --lora-4bit: the frozen weights are 4-bit NF4, not linear layers "
                         f"FP8 could cast; use one or the other")
    parallel = "--fsdp" if getattr(args, "fsdp", False) else "--ddp" if getattr(args, "ddp", False) else None
    if parallel and flag != "--fp8":
        raise SystemExit(f"error: {flag} runs in one process (the peer of --fp8 on one GPU); leave out {parallel}")
    if parallel == "--fsdp" and getattr(args, "lora", False) and not fp8_gathered(args):
        # fp8_kernel caches the fp8 copies of frozen weights, whole: on every GPU that would undo the sharding.
        # Gathered in FP8, each process keeps the FP8 copy of its own shard only (kernel_ft/fp8_gather.py).
        raise SystemExit(f"error: {flag} {args.fp8} with --fsdp --lora: the fp8 copies of the frozen weights would be "
                         f"kept whole on every GPU, which undoes the sharding; use --fp8 tensorwise (gathered in FP8: "
                         f"without --compile or --no-fsdp-fp8-gather), or --ddp, or leave out {flag}")
    ok, reason = swap_common.fp8_supported(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if not ok:
        raise SystemExit(f"error: {flag}: {reason}")


# Defaults on a CPU, where the Triton kernels run in the interpreter (about 18 s
# per step of 2 x 128 tokens for the tiny model with every kernel on a 2-core
# laptop): the default run of either fine-tune script then ends in 1-2 minutes,
# with the loss visibly falling. 128 tokens (for --tiny on a GPU too), because
# without the model's own tokenizer every byte is a token (ByteTokenizer): room
# for a short prompt and its answer.
CPU_STEPS = 3
CPU_WARMUP_STEPS = 1  # no compilation, no autotuning: one step to allocate AdamW's state
CPU_TINY_SEQ_LEN = 128


def add_finetune_args(parser, cuda_graphs_default=False):
    """Flags of the fine-tune scripts (the profile script has its own --steps)."""
    g = parser.add_argument_group("training loop")
    add_cuda_graphs_arg(g, cuda_graphs_default)
    g.add_argument(
        "--steps",
        type=positive_int,
        help=f"timed training steps (default: 20, or {CPU_STEPS} without a GPU: with the Triton kernels in the "
             f"interpreter the default CPU run of finetune_optimized.py then takes 1-2 minutes)",
    )
    g.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        help=f"untimed steps first: kernel compilation, cuBLAS autotuning, the CUDA graph's capture (default: "
        f"{GPU_WARMUP_STEPS}, or {CPU_WARMUP_STEPS} without a GPU)",
    )
    g.add_argument(
        "--log-every",
        type=positive_int,
        help="a step line every N steps (default: a progress bar on a terminal, otherwise a line per step)",
    )
    g.add_argument("--json", metavar="PATH", help="write config, environment, losses, times and memory here")
    add_real_run_args(parser)
    add_lora_args(parser)
    add_fsdp_arg(g)
    return parser


# Untimed steps on a GPU: with --cuda-graphs the eager steps before the capture
# (cuda_graphs.EAGER_STEPS) and the capture's own step, so every timed step is a
# replay. The same without it: --cuda-graphs must not change the learning-rate
# schedule (it spans warm-up and timed steps), nor the baseline's.
GPU_WARMUP_STEPS = 3


def add_cuda_graphs_arg(group, default):
    """--cuda-graphs, for the fine-tune scripts and the profile script."""
    group.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=default,
        help="capture the whole step (forward, loss, backward, clipping, optimizer) in a CUDA graph after two "
             "eager steps and replay it: the GPU no longer waits for Python to queue kernels. Needs batches of "
             "one shape (packing, or synthetic data); otherwise the run says why and stays eager, as it does "
             "when the first replay is more than 5%% slower than an eager step (GPU only; default: %(default)s)",
    )


DDP_BUCKET_MB = 25  # --ddp-bucket-mb's default (DistributedDataParallel's bucket size)
DDP_GATHER_AHEAD = 1  # --ddp-gather-ahead's default
# ... and with --ddp-shard-weights, where each layer is gathered twice a step: at 8B on 4 x H200
# 0.930x / 0.943x one GPU's tokens/s per GPU against 0.918x / 0.932x with 1, on two hosts (0.7 GiB
# more); on 2 x H200 0.953x against 0.952x (NOTES.md, Step 19).
SHARD_WEIGHTS_GATHER_AHEAD = 2
FSDP_COMMS = ("auto", "copy-engines", "pytorch", "symm-mem", "pg-memory")  # --fsdp-comm (fsdp.py)


def add_fsdp_arg(group):
    """--fsdp, for the fine-tune scripts and the profile script."""
    group.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model, gradients and optimizer state over the processes of torchrun with FSDP2 "
             "(torchrun --nproc-per-node N SCRIPT --fsdp ...); --batch-size is per process, so a step "
             "trains N x --batch-size sequences",
    )
    group.add_argument(
        "--ddp",
        action="store_true",
        help="for a model that fits one GPU: a full copy on every process of torchrun, each gradient averaged "
             "in place while backward runs (no weight gathers); --batch-size is per "
             "process; rank 0 writes the checkpoints (--output-dir) as one process does. Under torchrun "
             "without --fsdp or --ddp the run picks one: --ddp where the model's state fits in 80%% of a GPU, "
             "else --ddp --ddp-shard-weights where its state does, else --fsdp",
    )
    group.add_argument(
        "--ddp-bucket-mb", type=positive_int, default=DDP_BUCKET_MB,
        help="--ddp: the small gradients (under 1 MB: norms, LoRA adapters) are packed into groups of at most "
             "this many MB, each averaged by one all-reduce; the others are averaged alone, in place "
             "(default: %(default)s)",
    )
    group.add_argument(
        "--ddp-shard-optimizer", action=argparse.BooleanOptionalAction, default=None,
        help="--ddp: each large gradient reduce-scattered instead of all-reduced, each process updating its "
             "1/N piece of those weights (AdamW and its moments over 1/N of them), the pieces all-gathered "
             "back while the next forward runs; one optimizer file per process in the checkpoints "
             "(default: on with the Triton AdamW, without --compile)",
    )
    group.add_argument(
        "--ddp-copy-engines", action=argparse.BooleanOptionalAction, default=True,
        help="--ddp-shard-optimizer on GPUs: the split weights live in NCCL's symmetric memory windows, where "
             "NCCL (2.28 or later, zero-CTA policy) moves their all-gathers with the GPUs' copy engines instead "
             "of SMs the matmuls beside them need (default: %(default)s where this torch and NCCL can; the "
             "DDP line says which)",
    )
    group.add_argument(
        "--ddp-embedding-rows", action=argparse.BooleanOptionalAction, default=True,
        help="--ddp: the input embedding's gradient (backward's last, with nothing left beside its average) "
             "averaged over the rows of the step's tokens only, every process's ids all-gathered, in the step's "
             "CUDA graph (default: %(default)s; an embedding tied to the output layer averages its whole gradient)",
    )
    group.add_argument(
        "--ddp-gather-ahead", type=non_negative_int, default=None,
        help="--ddp-shard-optimizer: how many layers ahead of the running one the forward gathers the updated "
             "pieces (the embedding's and the first layers' during the optimizer step); 0: all of them during "
             f"the optimizer step (default: {DDP_GATHER_AHEAD}; {SHARD_WEIGHTS_GATHER_AHEAD} with "
             f"--ddp-shard-weights, which also gathers that many ahead in backward)",
    )
    group.add_argument(
        "--ddp-shard-weights", action="store_true",
        help="--ddp-shard-optimizer: the decoder layers' weights sharded too (ZeRO-3): each process keeps its "
             "piece of each, and a layer's weights are gathered whole into one of a few reused buffers before "
             "its forward and again before its backward (--ddp-gather-ahead layers ahead: 2 by default here); "
             "full fine-tuning without --fp8, with or without --gradient-checkpointing; a checkpoint gathers "
             "every weight whole on every process while it is written",
    )
    group.add_argument(
        "--fsdp-prefetch", type=non_negative_int, default=0,
        help="--fsdp: gather the weights of this many next layers while one computes, forward and backward "
             "(default: %(default)s, FSDP's own order; 1 measured no faster on 2 x H200 at 8B)",
    )
    group.add_argument(
        "--fsdp-keep-gathered", nargs="?", const="on", choices=("auto", "on", "off"), default="auto",
        help="--fsdp: keep each layer's gathered weights from its forward to its backward instead of gathering "
             "them again (one all-gather per layer and step fewer; every process holds the bf16 weights of the "
             "layers between forward and backward). auto (the default): on a GPU, decided after the first "
             "steps from their measured peak memory (fsdp.decide_keep_gathered); off on a CPU. Alone: on",
    )
    group.add_argument(
        "--fsdp-fp8-gather", action=argparse.BooleanOptionalAction, default=None,
        help="--fsdp --fp8 tensorwise, not with --compile: each process casts its shard of a layer's weights to "
             "FP8 with the whole weight's scale and the all-gather moves FP8, 1 byte per weight instead of 2 "
             "(kernel_ft/fp8_gather.py; the same bits; 8B full: 13 GiB less per GPU, tokens/s within the eager "
             "step's noise). Default: on with --lora (which needs it), off for full fine-tuning",
    )
    group.add_argument(
        "--fsdp-reduce-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
        help="--fsdp on a GPU: the dtype the gradients are averaged over the processes in (bfloat16 moves half "
             "the bytes; default: %(default)s, bfloat16 over 2 processes when every trainable weight is bf16: "
             "the same gradients as float32, see fsdp.reduce_dtype_for; float32 otherwise)",
    )
    group.add_argument(
        "--fsdp-comm", choices=FSDP_COMMS, default="auto",
        help="--fsdp on GPUs: where FSDP2's all-gather buffers live. copy-engines: kept in NCCL's symmetric windows "
             "(FSDP2's custom all-gather), with NCCL_CTA_POLICY=2: on one host the copy engines move the weights and "
             "no SM is taken from the matmuls (NCCL 2.28+); pytorch: FSDP2's own (the caching allocator, NCCL's "
             "kernels); symm-mem: the same as copy-engines through FSDP2's set_symm_mem_for_comm (a torch newer than "
             "2.11); pg-memory: NCCL's own allocator (slower on 2 x H200). Default: %(default)s (copy-engines where "
             "the GPUs, NCCL and torch allow, else pytorch; the FSDP line says which and why)",
    )


class Settings(argparse.Namespace):
    """A run's flags once ``settle`` has resolved them: every default filled in, and
    read-only. Each module reads the same values for the whole run; one that needs
    another value (tools/max_seq_len.py, trying lengths) makes a changed copy with
    ``settings.but(seq_len=...)``. Pickles like any namespace (DataLoader workers)."""

    def __init__(self, values, notes=()):
        for key, value in values.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "_notes", tuple(notes))  # private: left out of the JSON config

    def __setattr__(self, name, value):
        raise AttributeError(f"settings.{name}: a run's flags are fixed once flags.settle() returned them; "
                             f"make a changed copy with .but({name}=...)")

    __delattr__ = __setattr__

    def but(self, **changes):
        """A copy with ``changes``, the notes kept."""
        values = {k: v for k, v in vars(self).items() if k != "_notes"}
        return Settings({**values, **changes}, self._notes)

    def noted(self, *notes):
        """A copy with ``notes`` added to those ``print_notes`` says."""
        return Settings({k: v for k, v in vars(self).items() if k != "_notes"}, self._notes + notes)


def settle(args):
    """The parsed flags -> their ``Settings``: the defaults that depend on the hardware
    and on --tiny resolved, the flags another overrides or that change nothing kept as
    notes (``print_notes`` says them, after the banner). ``args`` itself is not changed.
    Settling settings returns them as they are."""
    if isinstance(args, Settings):
        return args
    a = argparse.Namespace(**vars(args))  # the working copy
    notes = []
    on_gpu = torch.cuda.is_available()
    a.model = os.path.expanduser(a.model)
    model_given = a.model != DEFAULT_MODEL
    if a.tiny is None:
        # A laptop cannot train 8B parameters; an explicit --model says the user means it.
        a.tiny = not on_gpu and not model_given
        if a.tiny and a.random_init:
            notes.append("no GPU, so --tiny is on and --random-init changes nothing "
                         "(--no-tiny --random-init builds the 8B architecture on the CPU: slow, over 32 GB)")
    elif a.tiny and model_given:
        notes.append(f"--tiny overrides --model {a.model}: the tiny LLaMA is built instead")
    if a.seq_len is None:
        a.seq_len = CPU_TINY_SEQ_LEN if a.tiny else 2048  # --tiny: the same on a GPU
    if getattr(a, "num_workers", 0) is None:
        # Workers build the next batches while the GPU trains; on a CPU they would
        # only compete with the training for the same cores.
        a.num_workers = 2 if on_gpu else 0
    if getattr(a, "compile", False) and getattr(a, "use_custom_projections", False) is not False:
        # Compiled layers run each projection on its own (projections_kernel.py): the run says so.
        a.use_custom_projections = False
        notes.append("--compile: torch.compile plans each decoder layer's sums itself; --use-custom-projections is off")
    if getattr(a, "dataset", None) == SYNTHETIC and getattr(a, "packing", False):
        notes.append("--dataset synthetic has no examples to pack: every row is --seq-len random tokens; "
                     "--packing changes nothing")
    if a.lr is None:
        # Random tiny weights need a big step to show learning in a few steps (the
        # cosine schedule averages half the peak); 1e-5 is a usual full fine-tuning
        # rate for a pretrained 8B model.
        a.lr = 3e-3 if a.tiny else 1e-5
    # The fine-tune scripts' loop lengths (the profile script sets its own --steps).
    if getattr(a, "steps", 0) is None:
        a.steps = 20 if on_gpu else CPU_STEPS
    if getattr(a, "warmup_steps", 0) is None:
        a.warmup_steps = GPU_WARMUP_STEPS if on_gpu else CPU_WARMUP_STEPS
    if getattr(a, "lr_warmup_steps", 0) is None:
        a.lr_warmup_steps = round(LR_WARMUP_FRACTION * (a.warmup_steps + a.steps))
    return Settings(vars(a), notes + idle_flags(a))


def print_notes(settings):
    """The notes ``settle`` kept, one line each."""
    for text in settings._notes:
        note(text)


def require_settled(args, where):
    """A function that builds part of a run reads the settled flags, never raw ones."""
    if not isinstance(args, Settings):
        raise TypeError(f"{where} reads the flags flags.settle() returns, not the parsed ones")


def idle_flags(args):
    """The flags that change nothing in this run, one note each (a typo or a forgotten
    switch would otherwise pass unseen)."""
    notes = []
    total = getattr(args, "warmup_steps", 0) + getattr(args, "steps", 0)
    for flag in ("eval_every", "save_every"):
        every = getattr(args, flag, None)
        if every and total and every > total:
            notes.append(f"--{flag.replace('_', '-')} {every} is beyond the run's {total} steps: it never happens")
    if total and getattr(args, "lr_warmup_steps", 0) and args.lr_warmup_steps > total:
        notes.append(f"--lr-warmup-steps {args.lr_warmup_steps} spans the whole run of {total} steps: the learning "
                     f"rate never reaches --lr {args.lr:g}")
    lora_defaults = {"lora_r": 16, "lora_alpha": 32.0, "lora_dropout": 0.0, "lora_targets": list(LORA_TARGETS)}
    changed = [k for k, v in lora_defaults.items() if hasattr(args, k) and getattr(args, k) != v]
    if changed and not getattr(args, "lora", False):
        notes.append(f"{', '.join('--' + k.replace('_', '-') for k in changed)} without --lora: no adapters, "
                     f"nothing changes")
    if getattr(args, "fp8_grads", "e4m3") != "e4m3" and not getattr(args, "fp8", None):
        notes.append(f"--fp8-grads {args.fp8_grads} without --fp8 changes nothing")
    if getattr(args, "fp8_fast_accum", False) and not getattr(args, "fp8", None):
        notes.append("--fp8-fast-accum without --fp8 changes nothing")
    if getattr(args, "fsdp_fp8_gather", None) and getattr(args, "fsdp", False) and not fp8_gathered(args):
        why = "with --compile" if getattr(args, "compile", False) else "without --fp8 tensorwise"
        notes.append(f"--fsdp-fp8-gather {why} changes nothing: the weights are gathered in bf16")
    if getattr(args, "compile_mode", "default") != "default" and not getattr(args, "compile", False):
        notes.append(f"--compile-mode {args.compile_mode} without --compile changes nothing")
    if getattr(args, "fsdp", False) or getattr(args, "ddp", False) or processes_started() == 1:
        notes += idle_parallel_flags(args)  # else the mode is chosen later (run.choose_parallel), and these with it
    return notes


def shards_optimizer(args):
    """--ddp-shard-optimizer (kernel_ft/ddp.py, ShardedUpdate) as given, or by default where it
    applies: the Triton AdamW (its norm adds the pieces up) and no --compile (the layers wait
    in hooks). What it buys at 8B (NOTES.md, Step 19): 0.92x per GPU against 0.88x
    all-reduced on 4 x H200, 0.92x against 0.91x on 2, and a third to a half less memory
    per GPU."""
    asked = getattr(args, "ddp_shard_optimizer", None)
    if asked is not None:
        return asked
    return kernels_from_args(args)["adamw"] and not getattr(args, "compile", False)


def gather_ahead(args):
    """--ddp-gather-ahead as given, else its default for the run's mode."""
    asked = getattr(args, "ddp_gather_ahead", None)
    if asked is not None:
        return asked
    return SHARD_WEIGHTS_GATHER_AHEAD if getattr(args, "ddp_shard_weights", False) else DDP_GATHER_AHEAD


def idle_parallel_flags(args):
    """--fsdp's own flags without --fsdp, --ddp's without --ddp."""
    notes = []
    fsdp_changed = [f"--{'no-' if getattr(args, k, v) is False else ''}{k.replace('_', '-')}"
                    for k, v in (("fsdp_prefetch", 0), ("fsdp_keep_gathered", "auto"), ("fsdp_reduce_dtype", "auto"),
                                 ("fsdp_comm", "auto"), ("fsdp_fp8_gather", None))
                    if getattr(args, k, v) != v]
    if fsdp_changed and not getattr(args, "fsdp", False):
        notes.append(f"{', '.join(fsdp_changed)} without --fsdp changes nothing")
    shard = getattr(args, "ddp_shard_optimizer", None)
    ddp_changed = [flag for flag, changed in (
        ("--ddp-bucket-mb", getattr(args, "ddp_bucket_mb", DDP_BUCKET_MB) != DDP_BUCKET_MB),
        (f"--{'no-' if shard is False else ''}ddp-shard-optimizer", shard is not None),
        ("--ddp-gather-ahead", getattr(args, "ddp_gather_ahead", None) is not None),
        ("--no-ddp-copy-engines", getattr(args, "ddp_copy_engines", True) is False),
        ("--no-ddp-embedding-rows", getattr(args, "ddp_embedding_rows", True) is False),
        ("--ddp-shard-weights", getattr(args, "ddp_shard_weights", False)))
        if changed]
    if ddp_changed and not getattr(args, "ddp", False):
        notes.append(f"{', '.join(ddp_changed)} without --ddp changes nothing")
    elif ddp_changed and not shards_optimizer(args):
        if pieces_only := [f for f in ddp_changed if f in ("--ddp-gather-ahead", "--no-ddp-copy-engines")]:
            notes.append(f"{', '.join(pieces_only)} without --ddp-shard-optimizer (off: "
                         f"{'asked' if shard is False else 'it needs the Triton AdamW, not with --compile'}) "
                         f"changes nothing")
    return notes


def processes_started():
    """How many processes torchrun started for this run (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def differences(then, now, limit=4):
    """'key a there, b here' for the first ``limit`` keys whose values differ."""
    keys = [k for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)]
    text = "; ".join(f"{k} {then.get(k)!r} there, {now.get(k)!r} here" for k in keys[:limit])
    return text + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def note(text):
    """One line about a flag that was overridden or changes nothing."""
    print(f"Note:          {text}", flush=True)


def public_config(args):
    """The flags as a dict for the JSON files: no private keys, not the --json path itself."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "json"}


# --------------------------------------------------------------------------------
# A real run's flags: accumulation, schedule, clipping, evaluation, checkpoints
# --------------------------------------------------------------------------------
LR_WARMUP_FRACTION = 0.1  # --lr-warmup-steps default: 10% of all steps
LOSS_CURVE = "loss_curve.png"


def non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text):
    """argparse type: a finite number > 0 (a learning rate, an adapter scale: 0 trains nothing)."""
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


SEED_MAX = 2**63 - 1  # torch.manual_seed takes up to 2**64 - 1; the held-out stream adds an offset


def seed(text):
    """argparse type: a seed torch.manual_seed and every derived seed accept."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2**63 - 1, got {value}")
    return value


def probability(text):
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def name_list(text):
    """argparse type: 'a,b,c' -> ['a', 'b', 'c']."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated module names, e.g. q_proj,v_proj")
    return names


def add_real_run_args(parser):
    """Flags of a long run: how steps are made up, scheduled, evaluated and saved."""
    g = parser.add_argument_group("a real run")
    g.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches of --batch-size per optimizer step; the loss is their token-weighted "
                        "mean, as one batch N times larger would give (default: %(default)s)")
    g.add_argument("--lr-warmup-steps", type=non_negative_int,
                   help="learning rate rising linearly over the first N steps, then a cosine decay to 0 at "
                        "the last step (default: 10%% of all steps). Not --warmup-steps: those are untimed steps")
    g.add_argument("--max-grad-norm", type=non_negative_float, default=1.0,
                   help="clip the gradients to this global norm; 0 turns clipping off (default: %(default)s)")
    g.add_argument("--optimizer-in-backward", action="store_true",
                   help="update each weight inside backward as soon as its gradient is ready and free that "
                        "gradient at once: the gradients never all exist together (the Triton AdamW; needs "
                        "--max-grad-norm 0 and no --grad-accum)")
    g.add_argument("--skip-nonfinite-steps", action="store_true",
                   help="a step whose loss or gradient norm is NaN or infinite updates nothing and the run goes "
                        "on (counted in the JSON's skipped_steps); one host sync per step. Without it such a "
                        "step stops the run with an error")
    g.add_argument("--eval-every", type=positive_int,
                   help="every N steps, the mean loss on held-out batches: the held-out split of --dataset "
                        "(records no training step sees), or synthetic tokens of another seed")
    g.add_argument("--eval-batches", type=positive_int, default=EVAL_BATCHES,
                   help="held-out batches per evaluation, the same ones each time; fewer if the held-out "
                        "split has fewer (default: %(default)s)")
    g.add_argument("--output-dir", metavar="DIR",
                   help="save checkpoints as DIR/checkpoint-K (the model, or with --lora only the adapter, as "
                        "safetensors; optimizer, schedule, random state, data position) at the end, every "
                        "--save-every steps and on Ctrl-C or SIGTERM, and the loss curve as DIR/loss_curve.png. A run "
                        "never overwrites a checkpoint: DIR may hold none past the step the run starts from")
    g.add_argument("--save-every", type=positive_int, help="a checkpoint every N steps (needs --output-dir)")
    g.add_argument("--resume", metavar="DIR/checkpoint-K",
                   help="continue a run from its checkpoint, with the same flags (checked): the losses are "
                        "those the run would have had without the break. New checkpoints go beside it "
                        "unless --output-dir says otherwise")
    return parser


class ImpliesLora(argparse.Action):
    """--lora-4bit: a switch that also sets --lora, while the flags are parsed (no module
    changes them later)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        namespace.lora = True


def add_lora_args(parser):
    g = parser.add_argument_group("LoRA (PEFT)")
    g.add_argument("--lora", action="store_true",
                   help="train low-rank adapters only (pip install peft); the model's own weights are frozen")
    g.add_argument("--lora-r", type=positive_int, default=16, help="rank of each adapter (default: %(default)s)")
    g.add_argument("--lora-alpha", type=positive_float, default=32.0,
                   help="adapter scale: the update is (alpha / r) * B @ A (default: %(default)g)")
    g.add_argument("--lora-dropout", type=probability, default=0.0,
                   help="dropout on each adapter's input (default: %(default)g)")
    g.add_argument("--lora-targets", type=name_list, default=",".join(LORA_TARGETS),
                   help="comma-separated names of the linear layers that get adapters (default: every "
                        "linear layer of the decoder, %(default)s)")
    g.add_argument("--lora-4bit", action=ImpliesLora,
                   help="QLoRA: the frozen weights loaded in 4-bit NF4 (pip install bitsandbytes; CUDA GPU, "
                        "pretrained weights); implies --lora")
    return parser


def check_optimizer_in_backward(args):
    """--optimizer-in-backward's limits, one line each, before anything is built."""
    if not getattr(args, "optimizer_in_backward", False):
        return
    flag = "error: --optimizer-in-backward updates each weight as soon as its gradient exists"
    if args.max_grad_norm > 0:
        raise SystemExit(f"{flag}, before the norm over all of them is known: clipping cannot run; "
                         f"add --max-grad-norm 0")
    if args.grad_accum > 1:
        raise SystemExit(f"{flag}: with --grad-accum {args.grad_accum} it would update after every micro-batch; "
                         f"use --grad-accum 1")
    if args.skip_nonfinite_steps:
        raise SystemExit(f"{flag}, before the step's loss is known: --skip-nonfinite-steps cannot skip it")
    if getattr(args, "fsdp", False):
        raise SystemExit(f"{flag}; with --fsdp that is not implemented (the gradients are sharded DTensors)")
    if getattr(args, "ddp", False):
        raise SystemExit(f"{flag}; with --ddp that is not implemented (the gradients are averaged as backward "
                         f"makes them)")
    if not kernels_from_args(args)["adamw"]:
        raise SystemExit(f"{flag} through the Triton AdamW's per-parameter update: add --use-custom-adamw")


def check_shard_weights(args):
    """--ddp-shard-weights' limits (kernel_ft/layer_weights.py), one line each, before
    anything is built."""
    if not (getattr(args, "ddp_shard_weights", False) and getattr(args, "ddp", False)):
        return
    why = shard_weights_refusal(args)
    if why:
        raise SystemExit(f"error: --ddp-shard-weights {why}")


def shard_weights_refusal(args):
    """Why --ddp-shard-weights cannot run with these flags (completing "--ddp-shard-weights
    ..."), or None: also what keeps the choice of a mode under torchrun from taking it."""
    if not shards_optimizer(args):
        return ("shards the pieces --ddp-shard-optimizer makes, which is off (it needs the Triton AdamW and no "
                "--compile); add --ddp-shard-optimizer or leave --ddp-shard-weights out")
    if getattr(args, "lora", False):
        return ("with --lora is not implemented: the frozen weights are not split into pieces, only trained ones "
                "are; leave it out")
    if getattr(args, "fp8", None):
        return "with --fp8 is not implemented; leave one out"
    return None


def check_output_flags(args):
    """--output-dir / --save-every / --resume, before any work: one line each."""
    if args.resume and not args.output_dir:
        args.output_dir = os.path.dirname(os.path.abspath(os.path.expanduser(args.resume)))
    if args.save_every and not args.output_dir:
        raise SystemExit("error: --save-every needs --output-dir (where the checkpoints go)")
    if args.output_dir:
        args.output_dir = files.check_output_path(args.output_dir, "--output-dir", directory=True,
                                            inputs=files.input_paths(args))
        if getattr(args, "json", None) and os.path.realpath(args.json) == os.path.realpath(args.output_dir):
            raise SystemExit(f"error: --json {args.json} is the --output-dir: choose a file beside it")
        curve = os.path.join(args.output_dir, LOSS_CURVE)
        if os.path.exists(curve) and not files.written_here(curve):
            raise SystemExit(f"error: --output-dir {args.output_dir}: its {LOSS_CURVE} was not written by this "
                             f"project and a run would replace it; remove it or choose another --output-dir")


# --------------------------------------------------------------------------------
# Optional packages
# --------------------------------------------------------------------------------
def installed(package):
    import importlib.util

    return importlib.util.find_spec(package) is not None
