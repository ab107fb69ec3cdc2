"""
Shared pieces of the profile and fine-tune scripts: loading, data, flags, the
training loop and JSON. It imports no kernel.

profile_baseline.py, finetune_baseline.py and finetune_optimized.py must measure
exactly the same work, or their numbers cannot be compared. So the work is written
once, here, and the scripts choose what to switch in and print results:

* ``add_model_args`` / ``add_finetune_args`` / ``resolve_defaults``: the flags
  every script shares, and the defaults that depend on the hardware.
* ``load_model``: real weights with transformers (bf16 + SDPA on GPU); random
  weights in the same architecture when the weights cannot be had (no network,
  gated model, missing path) or with ``--random-init``; ``--tiny`` for laptops and
  tests (the default without a GPU).
* ``load_records`` / ``prepare_data`` / ``training_batches``: the data. A bundled
  instruction set (data/instructions.jsonl), a local JSON/JSONL/Parquet file or
  a hub dataset, formatted as prompt + response with the loss on the response
  only, padded or packed into batches (see "Data" below); or ``synthetic``
  tokens for pure throughput runs.
* ``hf_loss`` and ``pytorch_adamw``: the baseline's loss and optimizer. The Triton
  kernels are switched in by finetune_optimized.py, in its own code, which hands
  ``run_finetune`` another loss function and optimizer.
* ``train_step`` / ``run_training``: forward, loss and backward of each
  micro-batch (--grad-accum, token-weighted), gradient clipping, optimizer step
  and learning-rate schedule (warm-up + cosine), with NVTX ranges, synchronized
  timing, tokens/sec (all token slots and real tokens only), peak memory,
  out-of-memory advice and Ctrl-C handling (the completed steps are kept);
  ``evaluate`` on the held-out batches (--eval-every).
* ``apply_lora`` (--lora, PEFT), ``compile_decoder`` (--compile), checkpoints
  (--output-dir, --save-every, --resume: exact, as the batches are a pure
  function of the seed and the step) and the loss curve.
* ``check_output_path`` / ``write_json_atomic``: output files are checked before
  the work and written whole (strict JSON, temporary file + rename) or not at all.

Without a GPU the Triton kernels run through Triton's interpreter on CPU tensors.
The interpreter is switched on by an environment variable that must be set before
``triton`` is first imported (transformers imports it too): kernel_common sets it,
so it is imported first.

Nothing runs on import.
"""

import argparse
import contextlib
import datetime
import functools
import glob
import itertools
import json
import math
import os
import platform
import random
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
import triton
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B"
IGNORE_INDEX = -100  # HF's label value for "no loss at this position"
HUB_TIMEOUT_S = 5  # how long we wait for huggingface.co before giving up on it
HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED_DATASET = os.path.join(HERE, "data", "instructions.jsonl")  # the default --dataset


# --------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------
def environment_info():
    """Return the device and library versions as a dict (quoted with every figure)."""
    on_gpu = torch.cuda.is_available()
    return {
        "device": "cuda" if on_gpu else "cpu",
        "gpu": torch.cuda.get_device_name(0) if on_gpu else "CPU",
        "triton_interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
    }


def print_banner(title, env):
    print("=" * 72)
    print(title)
    print("=" * 72)
    device = env["gpu"] if env["device"] == "cuda" else "CPU"
    if env["triton_interpreter"]:
        device += " (Triton kernels run in the interpreter: correct but slow)"
    print(f"Device:        {device}")
    print(
        f"Versions:      python {env['python']}, torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}, CUDA {env['cuda'] or '-'}"
    )
    print(f"Date:          {env['date']}")


# --------------------------------------------------------------------------------
# Output files: checked before the work, written whole or not at all
# --------------------------------------------------------------------------------
def check_output_path(path, flag, directory=False):
    """Fail now, in one line, if ``path`` cannot be written; return it absolute.

    A run that trains for minutes and then cannot write its results has lost them,
    so every script checks its output paths before it builds a model. ``directory``:
    the path is a folder to create (or reuse), not a file.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if directory:
        if os.path.exists(path) and not os.path.isdir(path):
            raise SystemExit(f"error: {flag} {path}: exists and is not a directory")
        parent = path if os.path.isdir(path) else os.path.dirname(path)
        while not os.path.exists(parent):  # the first existing ancestor must let us create the rest
            parent = os.path.dirname(parent)
    else:
        if os.path.isdir(path):
            raise SystemExit(f"error: {flag} {path}: is a directory, expected a file path")
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise SystemExit(f"error: {flag} {path}: directory {parent} does not exist")
    try:  # os.access says yes to root everywhere; creating a file is the real test
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise SystemExit(f"error: {flag} {path}: cannot write in {parent} ({e.strerror})") from None
    return path


def check_input_file(path, flag):
    """Fail now, in one line, if ``path`` is not a readable file; return it absolute."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise SystemExit(f"error: {flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise SystemExit(f"error: {flag} {path}: not readable")
    return path


def strict_json(value):
    """``value`` with every float NaN or infinity replaced by None: JSON has no NaN,
    and a file with a bare NaN in it is rejected by most JSON readers."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_json_atomic(path, doc):
    """Write ``doc`` as strict JSON to a temporary file beside ``path``, then rename it:
    a reader (or a crash) never sees half a file, and an older file at ``path``
    stays whole until the new one is complete."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(strict_json(doc), f, indent=2, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # no half-written temporary file left behind
            os.remove(tmp)
        raise


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
    g.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: %(default)s)")
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
    g.add_argument("--lr", type=float, help="AdamW peak learning rate (default: 1e-5; --tiny: 3e-3)")
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
        k.add_argument(
            f"--use-custom-{name}",
            action=argparse.BooleanOptionalAction,
            default=custom_kernels_default,
            help=f"{help_text} (default: %(default)s)",
        )
    return parser


# The kernels a run can switch on, in the order they are applied and reported,
# with the help of their --use-custom-<name> flags.
KERNEL_FLAGS = {
    "rmsnorm": "replace every RMSNorm module with TritonRMSNorm",
    "swiglu": "replace every LLaMA MLP with one whose SiLU * up is the fused Triton SwiGLU",
    "rope": "rotary position embedding with the fused Triton kernel, inside this model's forward only",
    "ce": "compute the loss with the Triton cross-entropy on the model's logits",
    "flce": "fused linear cross-entropy: LM head + loss in chunks, the logits are never built "
            "(supersedes --use-custom-ce)",
    "adamw": "the fused Triton AdamW step instead of torch.optim.AdamW(fused=True)",
}
KERNELS = tuple(KERNEL_FLAGS)


def kernels_from_args(args):
    """{kernel name: on/off} from the --use-custom-* flags."""
    return {name: getattr(args, f"use_custom_{name}") for name in KERNELS}


# Defaults on a CPU, where the Triton kernels run in the interpreter (about 10 s
# per step of 2 x 128 tokens for the tiny model with every kernel on a 2-core
# laptop): the default run of either fine-tune script then ends within a minute,
# with the loss visibly falling. 128 tokens (for --tiny on a GPU too), because
# without the model's own tokenizer every byte is a token (ByteTokenizer): room
# for a short prompt and its answer.
CPU_STEPS = 3
CPU_WARMUP_STEPS = 1  # no compilation, no autotuning: one step to allocate AdamW's state
CPU_TINY_SEQ_LEN = 128


def add_finetune_args(parser):
    """Flags of the fine-tune scripts (the profile script has its own --steps)."""
    g = parser.add_argument_group("training loop")
    g.add_argument(
        "--steps",
        type=positive_int,
        help=f"timed training steps (default: 20, or {CPU_STEPS} without a GPU: with the Triton kernels in the "
             f"interpreter the default CPU run then ends in about a minute)",
    )
    g.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        help=f"untimed steps first: kernel compilation, cuBLAS autotuning (default: 2, or {CPU_WARMUP_STEPS} "
        f"without a GPU)",
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


def add_fsdp_arg(group):
    """--fsdp, for the fine-tune scripts and the profile script."""
    group.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model, gradients and optimizer state over the processes of torchrun with FSDP2 "
             "(torchrun --nproc-per-node N SCRIPT --fsdp ...); --batch-size is per process, so a step "
             "trains N x --batch-size sequences",
    )


def resolve_defaults(args):
    """Fill the defaults that depend on the hardware and on --tiny; print each flag
    that another one overrides. Call it after the banner; a second call changes nothing."""
    if getattr(args, "_resolved", False):
        return args
    args._resolved = True  # private: left out of the JSON config (see public_config)
    on_gpu = torch.cuda.is_available()
    args.model = os.path.expanduser(args.model)
    model_given = args.model != DEFAULT_MODEL
    if args.tiny is None:
        # A laptop cannot train 8B parameters; an explicit --model says the user means it.
        args.tiny = not on_gpu and not model_given
        if args.tiny and args.random_init:
            note("no GPU, so --tiny is on and --random-init changes nothing "
                 "(--no-tiny --random-init builds the 8B architecture on the CPU: slow, over 32 GB)")
    elif args.tiny and model_given:
        note(f"--tiny overrides --model {args.model}: the tiny LLaMA is built instead")
    if args.seq_len is None:
        args.seq_len = CPU_TINY_SEQ_LEN if args.tiny else 2048  # --tiny: the same on a GPU
    if getattr(args, "num_workers", 0) is None:
        # Workers build the next batches while the GPU trains; on a CPU they would
        # only compete with the training for the same cores.
        args.num_workers = 2 if on_gpu else 0
    if getattr(args, "dataset", None) == SYNTHETIC and getattr(args, "packing", False):
        note("--dataset synthetic has no examples to pack: every row is --seq-len random tokens; "
             "--packing changes nothing")
    if args.lr is None:
        # Random tiny weights need a big step to show learning in a few steps (the
        # cosine schedule averages half the peak); 1e-5 is a usual full fine-tuning
        # rate for a pretrained 8B model.
        args.lr = 3e-3 if args.tiny else 1e-5
    # The fine-tune scripts' loop lengths (the profile script sets its own --steps).
    if getattr(args, "steps", 0) is None:
        args.steps = 20 if on_gpu else CPU_STEPS
    if getattr(args, "warmup_steps", 0) is None:
        args.warmup_steps = 2 if on_gpu else CPU_WARMUP_STEPS
    if getattr(args, "lr_warmup_steps", 0) is None:
        args.lr_warmup_steps = round(LR_WARMUP_FRACTION * (args.warmup_steps + args.steps))
    return args


def note(text):
    """One line about a flag that was overridden or changes nothing."""
    print(f"Note:          {text}", flush=True)


def public_config(args):
    """The flags as a dict for the JSON files: no private keys, not the --json path itself."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "json"}


# --------------------------------------------------------------------------------
# Model configurations: the default model's config is bundled, so that falling back
# to random weights needs no download (and no hub account: the repo is gated).
# --------------------------------------------------------------------------------
def llama31_8b_config(**changes):
    """The architecture of meta-llama/Llama-3.1-8B (its config.json, written as code);
    ``changes`` override fields (llama31_70b_config)."""
    fields = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,  # grouped-query attention: 4 query heads share a K/V head
        hidden_act="silu",
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        attention_bias=False,
        mlp_bias=False,
    )
    return LlamaConfig(**{**fields, **changes})


def llama31_70b_config():
    """meta-llama/Llama-3.1-70B: the 8B's architecture, twice as wide and 80 layers deep
    (the FSDP step trains it on several GPUs, random weights built on the meta device)."""
    return llama31_8b_config(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                             num_attention_heads=64)


# Configs known without the hub, by hub id; a local folder with the same name counts too.
BUNDLED_CONFIGS = {DEFAULT_MODEL: llama31_8b_config, "meta-llama/Llama-3.1-70B": llama31_70b_config}


def tiny_config():
    """LLaMA architecture, small enough for a laptop CPU, but with a vocabulary large
    enough (8,192) that the logits and the loss are still a visible part of the step."""
    return LlamaConfig(
        vocab_size=8192,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


# --------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------
def _one_line(exc):
    """An exception as one short line: the reason, not the traceback."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:200]}"


def hub_problem(model_id, repo_type="model"):
    """Why the HF hub cannot give us ``model_id`` now, or None if it can.

    transformers retries a failing download for about 45 s before it gives up, so
    we ask the hub first, once, with a short timeout: no network, a gated repo
    without access, and a wrong id each become a one-line reason in seconds.
    ``repo_type``: "model", or "dataset" for --dataset.
    """
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return f"HF_HUB_OFFLINE is set and the {repo_type} is not in the local cache"
    info = huggingface_hub.model_info if repo_type == "model" else huggingface_hub.dataset_info
    try:
        info(model_id, timeout=HUB_TIMEOUT_S)  # reachability and existence
        huggingface_hub.auth_check(model_id, repo_type=repo_type)  # access to the files of a gated repo
    except GatedRepoError:
        return "gated repo: accept the license on huggingface.co and set HF_TOKEN"
    except RepositoryNotFoundError:
        return "not found on the hub (wrong id, or private without a token)"
    except Exception as e:  # noqa: BLE001 - any network failure means the same thing here
        return f"cannot reach huggingface.co ({_one_line(e)})"
    return None


def _from_pretrained(model_id, device, dtype, **kwargs):
    return AutoModelForCausalLM.from_pretrained(
        model_id,
        dtype=dtype,
        attn_implementation="sdpa",
        device_map=str(device),  # load straight onto the GPU, not via a CPU copy
        **kwargs,
    )


def _attempt_pretrained(model_id, device, dtype, **kwargs):
    """(model, None) or (None, one-line reason); running out of memory is not a reason to fall back."""
    try:
        return _from_pretrained(model_id, device, dtype, **kwargs), None
    except Exception as e:  # noqa: BLE001 - any loading problem becomes the reason we print
        if is_out_of_memory(e):
            raise
        return None, _one_line(e)


def try_pretrained(model_id, device, dtype, **kwargs):
    """Return (model, None) with real weights, or (None, reason) when they cannot be had.
    ``kwargs`` go to from_pretrained (--lora-4bit: the quantization config)."""
    if looks_like_path(model_id) and not os.path.exists(model_id):
        return None, "no such file or directory"
    if os.path.exists(model_id):
        return _attempt_pretrained(model_id, device, dtype, **kwargs)
    # Already in the local cache? Then no network is needed at all.
    model, _ = _attempt_pretrained(model_id, device, dtype, local_files_only=True, **kwargs)
    if model is not None:
        return model, None
    problem = hub_problem(model_id)  # not cached (or only partly): ask the hub
    if problem:
        return None, problem
    print(f"Downloading {model_id} from the HF hub (once; later runs use the cache)...")
    return _attempt_pretrained(model_id, device, dtype, **kwargs)


def bundled_config(model_id):
    """The bundled config function for ``model_id``: a hub id of BUNDLED_CONFIGS, or a
    local copy of one (a directory named Llama-3.1-8B or Meta-Llama-3.1-8B); else None."""
    name = os.path.basename(os.path.normpath(model_id)).lower()
    for hub_id, make in BUNDLED_CONFIGS.items():
        short = hub_id.split("/")[1].lower()
        if model_id == hub_id or name in (short, "meta-" + short):
            return make
    return None


def looks_like_path(model_id):
    # Hub ids are "org/name"; anything else with a slash, a dot or a tilde in front is a path.
    return model_id.startswith(("/", ".", "~")) or model_id.count("/") > 1


def config_for(model_id, weights_problem=None):
    """The architecture of ``model_id`` without its weights; exits if it cannot be found.

    ``weights_problem`` is why the weights could not be loaded, if we tried: it is
    quoted in the error, and a hub that already failed is not asked again.
    """
    if bundled_config(model_id):
        return bundled_config(model_id)()
    why = f"weights: {weights_problem}; " if weights_problem else ""
    if looks_like_path(model_id) and not os.path.exists(model_id):
        raise SystemExit(f"error: --model {model_id}: no such file or directory")
    if os.path.exists(model_id):
        try:
            return AutoConfig.from_pretrained(model_id)
        except Exception as e:  # noqa: BLE001
            raise SystemExit(f"error: cannot use {model_id!r} ({why}config: {_one_line(e)})") from None
    with contextlib.suppress(Exception):
        return AutoConfig.from_pretrained(model_id, local_files_only=True)
    problem = weights_problem or hub_problem(model_id)
    if problem is None:
        with contextlib.suppress(Exception):
            return AutoConfig.from_pretrained(model_id)
        problem = "its config.json could not be downloaded"
    raise SystemExit(
        f"error: cannot use {model_id!r} ({problem}) and its architecture is unknown: only the "
        f"configs of {' and '.join(BUNDLED_CONFIGS)} are bundled. Pass a local --model PATH, or --tiny."
    )


def check_seq_len(seq_len, config):
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise SystemExit(f"error: --seq-len {seq_len} is longer than the model's maximum of {max_pos} positions")


def build_random(config, device, dtype):
    """Random weights, created directly on ``device`` in ``dtype``.

    Building 8B parameters in float32 on the CPU and then converting and copying
    them would take minutes and 32 GB of host memory; allocating them in bf16 on
    the GPU takes seconds.
    """
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")


def enable_checkpointing(model):
    """HF's per-layer activation checkpointing, non-reentrant (transformers renamed the
    method in 5.2x: activation_checkpointing_enable; older releases only have the old name)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
BACKENDS = {"cuda": "inductor", "cpu": "aot_eager"}  # torch.compile backend by device


def compile_decoder(model, args):
    """--compile: compile every decoder layer, with whatever kernels are in it.

    Per layer is the usual way to compile a transformer for training: the layers
    share their code, so one compilation serves them all (later layers only
    check guards), and the embedding, the loss and the optimizer stay eager,
    outside the graphs. ``fullgraph=True`` makes a graph break an error instead
    of a silent fallback to Python: our kernels are custom operators
    (kernel_common.kernel_op), so a layer is one graph. Without a GPU the
    backend is aot_eager (the graph is traced and differentiated, and runs
    eagerly: the Triton kernels in the interpreter); Inductor on a GPU.
    """
    if not getattr(args, "compile", False):
        return 0
    on_gpu = next(model.parameters()).device.type == "cuda"
    backend = BACKENDS["cuda" if on_gpu else "cpu"]
    options = {"mode": args.compile_mode} if on_gpu and args.compile_mode != "default" else {}
    if not on_gpu and args.compile_mode != "default":
        note(f"--compile-mode {args.compile_mode} needs a GPU; compiling with the aot_eager backend")
    layers = model.get_decoder().layers
    checkpointing = getattr(args, "gradient_checkpointing", False)
    sharded = getattr(args, "fsdp", False)
    for layer in layers:
        if sharded and not checkpointing:
            # --fsdp (shard_model ran first): FSDP gathers a layer's weights in hooks
            # that its __call__ runs around forward, and frees them after; backward
            # hooks reduce-scatter the gradients. Compiling forward itself keeps those
            # hooks outside the graph, eager, by construction. (layer.compile() also
            # ends up there today: FSDP's hooks are dynamo-disabled, and Dynamo skips
            # nn.Module's own __call__ frame and starts at forward; we do not rely on
            # that.) Inside forward the parameters are the gathered full tensors,
            # plain ones, not the sharded DTensors: the layer is one graph as on one
            # GPU, and fullgraph holds. torchtitan compiles each block before
            # fully_shard instead; either way only forward is compiled.
            layer.forward = torch.compile(layer.forward, backend=backend, fullgraph=True, **options)
        elif checkpointing:
            # HF checkpoints a layer in its __call__, outside the forward that
            # layer.compile() compiles, and Dynamo does not trace under the hooks
            # that non-reentrant checkpointing installs: the layer would quietly
            # run uncompiled. Inside the compiled function instead, checkpoint()
            # becomes part of the graph, and the compiler recomputes the layer's
            # activations in backward.
            layer.gradient_checkpointing = False
            layer.forward = torch.compile(_checkpointed(layer.forward), backend=backend, fullgraph=True, **options)
        else:
            layer.compile(backend=backend, fullgraph=True, **options)
    mode = f", mode {args.compile_mode}" if options else ""
    inside = ", checkpointing inside the graphs" if checkpointing else ""
    inside += ", FSDP's gathering outside them" if sharded else ""
    print(f"Compile:       {len(layers)} decoder layers with torch.compile (backend {backend}{mode}, fullgraph{inside}); "
          "compiled during the warm-up steps")
    return len(layers)


def _checkpointed(forward):
    def checkpointed_forward(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpointed_forward


def load_model(args):
    """Build the model the flags ask for; return (model, info dict). Prints what it did."""
    resolve_defaults(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    world = getattr(args, "_world", None)
    if world is not None:
        device = world.device  # --fsdp: this process's GPU (cuda:LOCAL_RANK)
    # bf16 is what LLaMA is trained in on GPUs; CPUs do float32 well and bf16 slowly.
    # The tiny model is for learning and tests: float32 everywhere, so its losses
    # can be compared to 1e-4 on any device.
    dtype = torch.bfloat16 if device.type == "cuda" and not args.tiny else torch.float32
    torch.manual_seed(args.seed)  # same seed, same random weights, in every script

    model = None
    try:
        if args.tiny:
            name, source = "tiny LLaMA (2 layers, hidden 128, vocab 8192)", "random init (--tiny)"
            config = tiny_config()
        elif args.random_init:
            name, source = args.model, "random init (--random-init)"
            config = config_for(args.model)
        else:
            name, source = args.model, "pretrained weights"
            quantized = getattr(args, "lora_4bit", False)
            extra = {"quantization_config": qlora_quantization_config()} if quantized else {}
            model, reason = try_pretrained(args.model, device, dtype, **extra)
            if model is None and quantized:  # random weights cannot be quantized on loading
                raise SystemExit(f"error: --lora-4bit: cannot load the weights of {args.model} ({reason})")
            if quantized:
                source = "pretrained weights, quantized to 4-bit NF4 (--lora-4bit)"
            if model is None:
                config = config_for(args.model, weights_problem=reason)
                print(
                    f"Could not load weights for {args.model}: {reason}. "
                    f"Continuing with random weights in the same architecture."
                )
                source = "random init (weights unavailable)"
        if model is None:
            check_seq_len(args.seq_len, config)  # before spending a minute building 8B parameters
            # --fsdp: no process could hold the whole large model, so it is built on the
            # meta device (shapes only) and each process initializes its own shards once
            # it is sharded (shard_model). The tiny model is built whole, with the weights
            # one process would have: the losses then match a single-process run.
            meta = getattr(args, "fsdp", False) and not args.tiny
            model = build_random(config, torch.device("meta") if meta else device, dtype)
            if meta:
                source += ", built on the meta device and initialized shard by shard"
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        where = "GPU" if isinstance(e, torch.OutOfMemoryError) else "CPU"
        raise SystemExit(
            f"error: out of {where} memory while loading {args.model} in {str(dtype).replace('torch.', '')} "
            f"on {device}; it needs {dtype.itemsize} bytes per parameter (use a smaller --model, or --tiny)"
        ) from None
    check_seq_len(args.seq_len, model.config)

    model.config.use_cache = False  # training: no KV cache
    n_params = sum(p.numel() for p in model.parameters())
    max_pos = getattr(model.config, "max_position_embeddings", None)
    info = {
        "name": name,
        "source": source,
        "architecture": type(model).__name__,
        "parameters": n_params,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "vocab_size": model.config.vocab_size,
        "max_position_embeddings": max_pos,
    }
    print(f"Model:         {name} [{type(model).__name__}], {source}")
    size = f"{n_params / 1e9:.2f} B" if n_params >= 1e9 else f"{n_params / 1e6:.1f} M"
    print(f"Parameters:    {n_params:,} ({size}), dtype {info['dtype']}, on {device}")
    if getattr(args, "gradient_checkpointing", False):
        # Non-reentrant: it checks that the recomputation saves what the forward
        # saved, so a kernel swapped in for the forward only would be caught.
        enable_checkpointing(model)
        print("Checkpointing: each decoder layer is recomputed in backward (activations not stored)")
    return model, info


# --------------------------------------------------------------------------------
# The baseline's loss and optimizer (finetune_optimized.py switches in the kernels)
# --------------------------------------------------------------------------------
def shift_labels(labels):
    """Targets for causal LM: position t predicts token t+1; the last position predicts nothing.

    [B, T] -> [B, T]: shifted left by one and padded with IGNORE_INDEX, so a loss
    can use the model's [B, T, V] logits whole (no slice, no .contiguous() copy of
    the largest tensor of the step). Only the small int64 labels are copied.
    """
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def hf_loss(model, batch):
    """Baseline: the loss the way HF computes it (it shifts, upcasts the logits to fp32
    and calls F.cross_entropy, which builds the log-softmax). ``batch``: see "Data"."""
    return model(**model_inputs(batch), labels=batch["labels"]).loss


def pytorch_adamw(params, lr):
    """torch.optim.AdamW with PyTorch's defaults (betas 0.9/0.999, eps 1e-8, weight decay 0.01).

    fused=True on CUDA: one kernel per step for all parameters instead of a dozen
    elementwise kernels per tensor. The CPU keeps PyTorch's default implementation.
    """
    return torch.optim.AdamW(params, lr=lr, fused=torch.cuda.is_available())


# --------------------------------------------------------------------------------
# Synthetic data: fixed-length random tokens, for pure throughput runs
# --------------------------------------------------------------------------------
def synthetic_batches(batch_size, seq_len, vocab_size, seed, device):
    """Endless seeded token batches: the same seed gives every script the same data.

    Tokens are drawn with Zipf frequencies (token k about 1/(k+1) as often as the
    most common one), like words in real text, and each sequence repeats a 16-token
    phrase. So there is something to learn (which tokens are common, then copying
    what came 16 tokens ago) and a falling loss shows that training works, without
    downloading a dataset.
    """
    gen = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
    phrase_len = min(16, seq_len)
    repeats = -(-seq_len // phrase_len)  # ceil
    while True:
        phrase = torch.multinomial(zipf, batch_size * phrase_len, replacement=True, generator=gen)
        ids = phrase.view(batch_size, phrase_len).repeat(1, repeats)[:, :seq_len].to(device)
        yield ids, ids  # labels are the inputs; the loss shifts them


# --------------------------------------------------------------------------------
# Data: instruction records -> prompt + response tokens -> padded or packed batches
#
# One batch is a dict (the only format the losses and the training loop know):
#   input_ids       [B, T] int64   token ids; padding slots hold the pad id
#   labels          [B, T] int64   the token to learn at each position, IGNORE_INDEX
#                                  on prompt tokens, padding and each example's first
#                                  token (the loss functions shift them by one)
#   position_ids    [B, T] int64 or None   packing: restart at 0 in every example;
#                                  None: the model counts 0, 1, 2, ... itself
#   attention_mask  None, [B, T] (1 = real token, padding) or [B, 1, T, T] bool
#                   (packing: True where query t may attend to key s)
#   num_tokens      int: B * T, the token slots the model computes
#   num_real_tokens int: the slots that hold real tokens, not padding
# The two counts are Python ints, known without asking the GPU (no sync).
# A training step is a list of --grad-accum such batches, its micro-batches
# (training_batches); the losses and evaluate() take one batch at a time.
# --------------------------------------------------------------------------------
SYNTHETIC = "synthetic"  # --dataset synthetic: seeded random tokens, every slot real
EVAL_SEED_OFFSET = 1_000_003  # synthetic held-out batches: the same generator with another seed
EVAL_BATCHES = 4  # --eval-batches default (and the synthetic count when args has none)
EVAL_FRACTION = 0.05  # share of the records held out for evaluation
SPLIT_SEED = "held-out split"  # fixed: the held-out records do not change with --seed

# Field names: Dolly-15k's first, then Alpaca's.
INSTRUCTION_FIELDS = ("instruction",)
CONTEXT_FIELDS = ("context", "input")
RESPONSE_FIELDS = ("response", "output")

# The prompt format when the tokenizer has no chat template (Alpaca/Dolly style).
# The loss is computed on the response that follows it, never on the prompt.
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_TEMPLATE_WITH_CONTEXT = "### Instruction:\n{instruction}\n\n### Context:\n{context}\n\n### Response:\n"


def lm_batch(input_ids, labels=None):
    """A batch of full rows of real tokens (no padding, no packing): the model's
    default positions and causal mask. Labels default to the inputs (the loss shifts)."""
    return {
        "input_ids": input_ids,
        "labels": input_ids if labels is None else labels,
        "position_ids": None,
        "attention_mask": None,
        "num_tokens": input_ids.numel(),
        "num_real_tokens": input_ids.numel(),
    }


def model_inputs(batch):
    """The keyword arguments of the model's forward that come from the batch."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}


def batch_to(batch, device):
    """Copy the batch's tensors to ``device``. non_blocking: from pinned host memory
    the copy runs asynchronously, so the CPU goes on queueing work meanwhile."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


# ---- Reading records ------------------------------------------------------------
def dataset_name(dataset):
    """How a --dataset value is printed: the bundled file by its path in the repo."""
    if dataset and os.path.abspath(dataset) == BUNDLED_DATASET:
        return "bundled data/instructions.jsonl"
    return dataset


def load_records(dataset):
    """The records of --dataset as [{"instruction", "context", "response"}] (context may
    be ""), or None for ``synthetic``. Every problem ends the run here, in one line,
    before a model is built."""
    if dataset == SYNTHETIC:
        return None
    flag = f"--dataset {dataset}"
    path = os.path.abspath(os.path.expanduser(dataset))
    is_file_name = dataset.lower().endswith((".json", ".jsonl", ".parquet"))
    if os.path.exists(path) or is_file_name or looks_like_path(dataset):
        check_input_file(path, "--dataset")
        rows = read_data_file(path, flag)
    else:
        rows = read_hub_dataset(dataset, flag)
    if not rows:
        raise SystemExit(f"error: {flag}: no records in it")
    return [instruction_record(row, number, flag) for number, row in enumerate(rows, start=1)]


def read_data_file(path, flag):
    """The rows of a .parquet file, a JSON array of objects, or JSON Lines (one
    object per line; a .json file that holds JSON Lines is read too)."""
    if not path.lower().endswith((".json", ".jsonl", ".parquet")):
        raise SystemExit(f"error: {flag}: expected a .json, .jsonl or .parquet file")
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet  # installed with datasets

        try:
            return pyarrow.parquet.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same problem
            raise SystemExit(f"error: {flag}: cannot read it as Parquet ({_one_line(e)})") from None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {flag}: cannot read it ({_one_line(e)})") from None
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except ValueError as e:
            raise SystemExit(f"error: {flag}: not valid JSON ({e})") from None
    rows = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise SystemExit(f"error: {flag}: line {line_number} is not valid JSON ({e})") from None
    return rows


def read_hub_dataset(name, flag):
    """The train split of a HF hub dataset, through the ``datasets`` library."""
    problem = hub_problem(name, repo_type="dataset")
    if problem:
        raise SystemExit(
            f"error: {flag}: not a local file, and the HF hub cannot serve it ({problem}); pass a local "
            f".json/.jsonl/.parquet file, or leave --dataset out for the bundled set"
        )
    import datasets

    try:
        return list(datasets.load_dataset(name, split="train"))
    except Exception as e:  # noqa: BLE001 - any loading problem is reported the same way
        raise SystemExit(f"error: {flag}: cannot load its train split ({_one_line(e)})") from None


def instruction_record(row, number, flag):
    """One row as {"instruction", "context", "response"}, with Dolly or Alpaca names."""
    if not isinstance(row, dict):
        raise SystemExit(f"error: {flag}: record {number} is a {type(row).__name__}, expected an object")

    def field(names):
        return next((row[name] for name in names if row.get(name) is not None), None)

    instruction, context, response = field(INSTRUCTION_FIELDS), field(CONTEXT_FIELDS), field(RESPONSE_FIELDS)
    if instruction is None or response is None:
        raise SystemExit(
            f"error: {flag}: record {number} has fields {sorted(row)}; expected instruction and response "
            f"(Dolly: instruction, context, response; Alpaca: instruction, input, output)"
        )
    for name, value in (("instruction", instruction), ("context", context), ("response", response)):
        if value is not None and not isinstance(value, str):
            raise SystemExit(f"error: {flag}: record {number}: {name} is a {type(value).__name__}, expected text")
    if not instruction.strip():
        raise SystemExit(f"error: {flag}: record {number} has an empty instruction")
    if not response.strip():
        raise SystemExit(f"error: {flag}: record {number} has an empty response")
    return {"instruction": instruction, "context": context or "", "response": response}


def split_records(records):
    """(train, held out): a fixed EVAL_FRACTION of the records, the same in every
    run whatever --seed, for the evaluation loop."""
    order = list(range(len(records)))
    random.Random(SPLIT_SEED).shuffle(order)
    held = set(order[: int(len(records) * EVAL_FRACTION)])
    return ([r for i, r in enumerate(records) if i not in held],
            [r for i, r in enumerate(records) if i in held])


# ---- Tokenizing -----------------------------------------------------------------
class ByteTokenizer:
    """The tokenizer used when the model's own cannot be had (--tiny, offline):
    every UTF-8 byte of the text is one token.

    Ids 0, 1, 2 are PAD, BOS and EOS (the tiny config's bos/eos ids); byte b is id
    b + 3, so 259 ids in all, which any LLaMA vocabulary covers. No vocabulary
    file and no download; the price is 3-4 times more tokens than a BPE tokenizer
    needs for English text.
    """

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    BYTE_OFFSET = 3
    vocab_size = 256 + BYTE_OFFSET
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        ids = [b + self.BYTE_OFFSET for b in text.encode("utf-8")]
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids):
        return bytes(i - self.BYTE_OFFSET for i in ids if i >= self.BYTE_OFFSET).decode("utf-8", errors="replace")

    def __len__(self):
        return self.vocab_size


def load_tokenizer(args):
    """(tokenizer, description): the model's own tokenizer when it can be had, else
    the byte-level one (with a note saying why)."""
    if args.tiny:
        return ByteTokenizer(), "byte-level (--tiny)"
    from transformers import AutoTokenizer

    model_id, problem = args.model, None
    try:
        if os.path.exists(model_id):
            return AutoTokenizer.from_pretrained(model_id), f"{model_id}'s own"
        if not looks_like_path(model_id):
            with contextlib.suppress(Exception):
                return AutoTokenizer.from_pretrained(model_id, local_files_only=True), f"{model_id}'s own"
            problem = hub_problem(model_id)
            if problem is None:
                return AutoTokenizer.from_pretrained(model_id), f"{model_id}'s own"
        else:
            problem = "no such file or directory"
    except Exception as e:  # noqa: BLE001 - any loading problem: fall back to bytes
        problem = _one_line(e)
    note(f"no tokenizer for {model_id} ({problem}): the byte-level tokenizer is used instead")
    return ByteTokenizer(), "byte-level (the model's own is unavailable)"


def prompt_text(record):
    """The plain-template prompt of a record (it ends where the response begins)."""
    if record["context"].strip():
        return PROMPT_TEMPLATE_WITH_CONTEXT.format(**record)
    return PROMPT_TEMPLATE.format(**record)


def encode_record(tokenizer, record):
    """(ids, labels) of one record; labels are IGNORE_INDEX on the prompt.

    With a chat template: the prompt is the user turn plus the assistant header
    (add_generation_prompt), the response is what the full conversation adds to
    it. Without: PROMPT_TEMPLATE after BOS, then the response and EOS.
    """
    if getattr(tokenizer, "chat_template", None):
        user = record["instruction"] + (f"\n\n{record['context']}" if record["context"].strip() else "")
        turns = [{"role": "user", "content": user}]
        prompt = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
        full = tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": record["response"]}],
                                             tokenize=True, return_dict=False)
        if full[: len(prompt)] != prompt:
            raise SystemExit("error: the tokenizer's chat template writes the prompt differently once the "
                             "answer follows, so the response tokens cannot be told apart")
        response = full[len(prompt):]
    else:
        prompt = tokenizer.encode(prompt_text(record), add_special_tokens=True)  # BOS first, if it has one
        response = tokenizer.encode(record["response"], add_special_tokens=False)
        if tokenizer.eos_token_id is not None:
            response = response + [tokenizer.eos_token_id]  # so the model learns where an answer ends
    return prompt + response, [IGNORE_INDEX] * len(prompt) + response


def encode_records(tokenizer, records, seq_len):
    """Token examples [(ids, labels)], cut to ``seq_len``; also how many were cut
    and how many lost their whole response to the cut (those are left out)."""
    examples, cut, lost = [], 0, 0
    for record in records:
        ids, labels = encode_record(tokenizer, record)
        if len(ids) > seq_len:
            cut += 1
            ids, labels = ids[:seq_len], labels[:seq_len]
            if all(label == IGNORE_INDEX for label in labels):
                lost += 1
                continue
        examples.append((ids, labels))
    return examples, cut, lost


class InstructionData:
    """The tokenized data of a run: train and held-out examples, and how they were made."""

    def __init__(self, name, tokenizer, tokenizer_desc, train, held_out, cut, lost):
        self.name = name
        self.tokenizer = tokenizer
        self.tokenizer_desc = tokenizer_desc
        self.train, self.held_out = train, held_out
        self.cut, self.lost = cut, lost
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = pad if pad is not None else 0  # any valid id: padding is masked and has no label


def prepare_data(args, records, vocab_size):
    """Tokenize ``records`` (from load_records) for the model; None for synthetic.
    Prints what it did; refuses a tokenizer whose ids the model cannot embed."""
    if records is None:
        print(f"Data:          synthetic tokens, {args.batch_size} x {args.seq_len} per step (no padding)")
        return None
    tokenizer, tokenizer_desc = load_tokenizer(args)
    largest_id = len(tokenizer) - 1
    if largest_id >= vocab_size:
        raise SystemExit(f"error: the tokenizer's ids go up to {largest_id} but the model's vocabulary has only "
                         f"{vocab_size} entries")
    train_records, held_records = split_records(records)
    train, cut, lost = encode_records(tokenizer, train_records, args.seq_len)
    held_out, _, _ = encode_records(tokenizer, held_records, args.seq_len)
    if not train:
        raise SystemExit(f"error: --seq-len {args.seq_len} leaves no response token in any training example; "
                         f"raise --seq-len")
    data = InstructionData(dataset_name(args.dataset), tokenizer, tokenizer_desc, train, held_out, cut, lost)
    template = "the tokenizer's chat template" if tokenizer.chat_template else "the ### Instruction/### Response template"
    print(f"Data:          {data.name}: {len(records)} records, {len(train_records)} for training, "
          f"{len(held_records)} held out")
    print(f"Tokens:        {tokenizer_desc} tokenizer, {template}; loss on the response tokens only")
    if args.packing:
        print(f"Batches:       {args.batch_size} rows of {args.seq_len} tokens, examples packed end to end "
              f"(each attends only to itself)")
    else:
        print(f"Batches:       {args.batch_size} examples, padded to the longest of the batch (at most "
              f"{args.seq_len} tokens)")
    if cut:
        left_out = f"; {lost} lose their whole response and are left out" if lost else ""
        note(f"{cut} of {len(train_records)} training examples are longer than --seq-len {args.seq_len} and "
             f"are cut to it{left_out}")
    return data


# ---- Batches --------------------------------------------------------------------
PACKING_WINDOW = 16  # rows still open to later examples: less padding, a bounded search


class StepBatches(torch.utils.data.Dataset):
    """Batch ``k`` of a run, built on the CPU, for any step ``k``: a pure function
    of (examples, seed, k), so a run resumed at step K gets exactly the batches
    that an uninterrupted run gets from step K on.

    Epoch e visits the examples in an order drawn from (seed, e). Its rows are the
    examples one by one (padding), or the examples concatenated into rows of
    ``seq_len`` tokens, each into the first recent row it fits in (packing). Batch k is rows
    k*B ... k*B + B - 1 of the epochs laid end to end. ``endless=False``: one
    epoch in the examples' own order (the held-out set), the last batch may be short.
    """

    def __init__(self, examples, batch_size, seq_len, packing, seed, pad_id, endless=True, rank=0, ranks=1):
        self.examples, self.batch_size, self.seq_len = examples, batch_size, seq_len
        # --fsdp: step k's global batch is rows k*N*B ... of N ranks x B rows; this
        # process (rank r of N) takes its slice, rows k*N*B + r*B ... + B - 1.
        self.rank, self.ranks = rank, ranks
        self.packing, self.seed, self.pad_id, self.endless = packing, seed, pad_id, endless
        self._epochs = {}  # epoch -> its rows (lists of example indices); lengths only, cheap

    def epoch_rows(self, epoch):
        if epoch not in self._epochs:
            order = list(range(len(self.examples)))
            if self.endless:
                random.Random(f"data seed {self.seed}, epoch {epoch}").shuffle(order)
            rows, used = [], []  # used[r]: tokens in rows[r] so far
            for i in order:
                length = len(self.examples[i][0])
                # Packing: into the first of the last PACKING_WINDOW rows that has
                # room for it (a short example fills the gap a long one left);
                # else, and always when padding, it opens a row of its own.
                first = max(0, len(rows) - PACKING_WINDOW)
                fits = [r for r in range(first, len(rows)) if used[r] + length <= self.seq_len]
                if self.packing and fits:
                    rows[fits[0]].append(i)
                    used[fits[0]] += length
                else:
                    rows.append([i])
                    used.append(length)
            self._epochs[epoch] = rows
        return self._epochs[epoch]

    def num_batches(self):
        """Batches in one epoch (the held-out set's batch count)."""
        return -(-len(self.epoch_rows(0)) // self.batch_size)

    def rows(self, start, count):
        """Rows start ... start + count - 1 of the epochs laid end to end."""
        out, epoch, epoch_start = [], 0, 0
        while len(out) < count:
            rows = self.epoch_rows(epoch)
            i = start + len(out) - epoch_start
            if i < len(rows):
                out.extend(rows[i: i + count - len(out)])
            elif not self.endless:
                break
            else:
                epoch, epoch_start = epoch + 1, epoch_start + len(rows)
        return out

    def __getitem__(self, step):
        first = (step * self.ranks + self.rank) * self.batch_size
        return self.collate(self.rows(first, self.batch_size))

    def collate(self, rows):
        """The batch dict (see the top of this section) of ``rows`` of example indices."""
        lengths = [[len(self.examples[i][0]) for i in row] for row in rows]
        width = self.seq_len if self.packing else max(sum(row) for row in lengths)
        shape = (len(rows), width)
        input_ids = torch.full(shape, self.pad_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        document = torch.zeros(shape, dtype=torch.long)  # packing: which example each slot holds
        for b, row in enumerate(rows):
            t = 0
            for d, i in enumerate(row):
                ids, labs = self.examples[i]
                n = len(ids)
                input_ids[b, t: t + n] = torch.tensor(ids)
                labels[b, t: t + n] = torch.tensor(labs)
                # The first token of an example is never a target: after the shift
                # it would be predicted from the previous example's last token.
                labels[b, t] = IGNORE_INDEX
                position_ids[b, t: t + n] = torch.arange(n)  # RoPE sees each example from position 0
                document[b, t: t + n] = d
                t += n
            # The padding after the last example is a document of its own: no real
            # token attends to it, and each padding query still sees itself (a query
            # that may attend to nothing gives NaN in SDPA).
            position_ids[b, t:] = torch.arange(width - t)
            document[b, t:] = len(row)
        real = sum(sum(row) for row in lengths)
        if self.packing:
            attention_mask = block_causal_mask(document)
        else:
            # Padding: one example per row, padded on the right, so the model's own
            # positions 0, 1, 2, ... are right and a [B, T] mask hides the padding.
            attention_mask = (document == 0).long()
            position_ids = None
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                "attention_mask": attention_mask, "num_tokens": input_ids.numel(), "num_real_tokens": real}


def block_causal_mask(document):
    """[B, T] example index of every slot -> [B, 1, T, T] bool, True where query t may
    attend to key s: same example, and s <= t.

    Passed to the model as a ready 4-D mask, HF's SDPA attention uses it as given:
    attention never crosses examples, exactly. It costs B * T * T bytes
    (8 MB at 2 x 2048), and SDPA with an explicit mask uses the memory-efficient
    kernel, not flash attention.
    """
    seq_len = document.shape[1]
    same = document[:, :, None] == document[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return (same & causal)[:, None]


def loader(dataset, steps, args):
    """A DataLoader over batch indices ``steps``: --num-workers processes build the
    batches ahead of the training step, in pinned host memory when there is a GPU
    (--pin-memory, the default). From pinned memory the GPU's copy engine reads the
    batch directly and cudaMemcpyAsync returns at once; from pageable memory the
    driver first copies it into a pinned staging buffer, and the CPU waits for that
    instead of queueing the next kernels (profile_baseline.py counts both kinds)."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,  # each index is a whole batch already
        sampler=steps,
        num_workers=args.num_workers,
        pin_memory=torch.cuda.is_available() and getattr(args, "pin_memory", True),
    )


def training_batches(args, data, device, vocab_size, start_step=0):
    """The endless stream of training steps on ``device``, from step ``start_step``
    on (0-based): each is a list of --grad-accum batch dicts (its micro-batches).

    Micro-batch k of the run (k = step * grad_accum + m) is the same whether the
    stream started at 0 or later: synthetic data replays its seeded generator,
    real data builds batch k from (seed, k) alone (StepBatches). So a resumed run
    gets exactly the batches the uninterrupted run had.
    """
    accum = getattr(args, "grad_accum", 1)  # the profile script has no --grad-accum
    first = start_step * accum
    # --fsdp: each of the N processes takes its B rows of the global batch of N x B
    # rows, the batch one process with --batch-size N x B would train on.
    rank, ranks = rank_and_size()
    if data is None:  # synthetic: the seeded generator, replayed up to the first micro-batch
        b = args.batch_size
        stream = (lm_batch(ids[rank * b: (rank + 1) * b]) for ids, _ in
                  synthetic_batches(b * ranks, args.seq_len, vocab_size, args.seed, device))
        stream = itertools.islice(stream, first, None)
    else:
        dataset = StepBatches(data.train, args.batch_size, args.seq_len, args.packing, args.seed, data.pad_id,
                              rank=rank, ranks=ranks)
        stream = (batch_to(batch, device) for batch in loader(dataset, itertools.count(first), args))
    while True:
        yield [next(stream) for _ in range(accum)]


def held_out_batches(args, data, device, vocab_size):
    """The held-out batches an evaluation averages over, a list (at most
    --eval-batches of them; ``args.eval_batches`` None: all). Real data: the held-out
    examples, in a fixed order, batched like the training data (none if the set
    is too small to hold any out). Synthetic: the same generator with another
    seed, so no training step sees them."""
    limit = getattr(args, "eval_batches", None)
    if data is None:
        stream = synthetic_batches(args.batch_size, args.seq_len, vocab_size, args.seed + EVAL_SEED_OFFSET, device)
        return [lm_batch(ids) for ids, _ in itertools.islice(stream, limit or EVAL_BATCHES)]
    if not data.held_out:
        return []
    dataset = StepBatches(data.held_out, args.batch_size, args.seq_len, args.packing, args.seed, data.pad_id,
                          endless=False)
    count = dataset.num_batches() if limit is None else min(limit, dataset.num_batches())
    return [batch_to(batch, device) for batch in loader(dataset, range(count), args)]


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


def train_step(model, optimizer, loss_fn, micro_batches, scheduler=None, max_grad_norm=0.0):
    """One optimizer step: forward + loss and backward for each micro-batch
    (``micro_batches``: a list of batch dicts, see "Data"; one without --grad-accum),
    then gradient clipping, the AdamW update and the learning-rate schedule.
    Returns (loss, gradient norm): tensors, the loss averaged over every target
    token of the step; the norm is None when clipping is off."""
    loss = accumulate_gradients(model, loss_fn, micro_batches)
    with phase("optimizer"):
        grad_norm = optimizer_update(optimizer, scheduler, max_grad_norm)
    return loss, grad_norm


def target_count(batch):
    """How many positions of a batch count in its loss (the shifted labels that are
    not IGNORE_INDEX: prompts, padding and each example's first token are not), as
    a tensor: reading it would wait for the GPU."""
    return (shift_labels(batch["labels"]) != IGNORE_INDEX).sum()


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
    rank, ranks = rank_and_size()
    if ranks > 1:
        # --fsdp: the step's loss is the mean over the target tokens of every rank,
        # so each rank weighs its tokens by the global count. FSDP averages the
        # gradients over the N ranks (it divides their sum by N): multiplying by N
        # here makes them the gradients of the global mean, as one process with the
        # whole batch computes them. No host sync: an all-reduce of a device scalar.
        torch.distributed.all_reduce(total)
    total = total.clamp(min=1)  # an all-padding step: loss 0, not 0/0
    step_loss = 0.0
    for batch, count in zip(micro_batches, counts):
        with phase("forward"):
            loss = loss_fn(model, batch) * (count * ranks / total)  # exactly x1.0 on one process without accumulation
        with phase("backward"):
            loss.backward()
        step_loss = step_loss + loss.detach()
    if ranks > 1:  # the global mean: the sum of the ranks' shares, over N
        step_loss = step_loss.clone() if torch.is_tensor(step_loss) else torch.tensor(step_loss, device=total.device)
        torch.distributed.all_reduce(step_loss)
        step_loss = step_loss / ranks
    return step_loss


def optimizer_update(optimizer, scheduler, max_grad_norm):
    """Clip the gradients, update the parameters, advance the learning-rate schedule.
    Returns the gradient norm before clipping (a tensor), or None without clipping."""
    grad_norm = None
    if max_grad_norm > 0 and hasattr(optimizer, "clip_grad_norm_"):
        # An optimizer that clips inside its own step (the Triton AdamW: the scaling
        # happens as the step reads each gradient, one pass over them fewer).
        grad_norm = optimizer.clip_grad_norm_(max_grad_norm)
    elif max_grad_norm > 0:
        # The parameters the optimizer updates are the ones to clip (LoRA: the adapters only).
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # --fsdp: a DTensor of partial norms; the global norm
            grad_norm = grad_norm.full_tensor()
    # Ctrl-C in the middle of the update would leave some tensors updated and others
    # not, and no checkpoint could be saved: it is held until the update is complete.
    with hold_interrupts():
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)  # frees the gradients until next backward
    return grad_norm


_HELD_INTERRUPTS = []  # Ctrl-C pressed during an optimizer update (see hold_interrupts)


@contextlib.contextmanager
def hold_interrupts():
    """Ctrl-C inside this block is recorded instead of raised; run_training raises it
    once the step is recorded (interrupt_if_held). Only the main thread gets signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: _HELD_INTERRUPTS.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupt_if_held():
    if _HELD_INTERRUPTS:
        _HELD_INTERRUPTS.clear()
        raise KeyboardInterrupt


@torch.no_grad()
def evaluate(model, loss_fn, batches):
    """Mean loss over ``batches`` (batch dicts; held_out_batches), every target token
    weighted alike, with the model in eval mode (no dropout) and no gradients.
    Returns a float."""
    was_training = model.training
    model.eval()
    try:
        loss_sum, count_sum = 0.0, 0
        for batch in batches:
            count = target_count(batch)
            loss_sum = loss_sum + loss_fn(model, batch).float() * count
            count_sum = count_sum + count
    finally:
        model.train(was_training)
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


def is_out_of_memory(exc):
    """A GPU out-of-memory error, or a failed CPU allocation (a plain RuntimeError)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "DefaultCPUAllocator" in text)


@contextlib.contextmanager
def exit_on_oom(args, what, model):
    """Turn an out-of-memory error, GPU or CPU, into one line: what was attempted, what to reduce."""
    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError, so is a failed CPU allocation
        if not is_out_of_memory(e):
            raise
        where = "GPU" if isinstance(e, torch.OutOfMemoryError) else "CPU"
        name = "the tiny LLaMA" if args.tiny else args.model
        # Weights, gradients and AdamW's two moments: 4 tensors the size of the model,
        # before a single activation is stored.
        state_gib = sum(4 * p.numel() * p.element_size() for p in model.parameters()) / 2**30
        hint = "" if getattr(args, "use_custom_flce", False) else ", or add --use-custom-flce (no logits at all)"
        raise SystemExit(
            f"error: out of {where} memory while {what} {name} with batch {args.batch_size} x seq "
            f"{args.seq_len} ({args.batch_size * args.seq_len:,} tokens per step; weights, gradients "
            f"and AdamW state alone take {state_gib:.1f} GiB); reduce --batch-size or --seq-len{hint}"
        ) from None


LONG_RUN_S = 120  # a run that will take longer than this says so after its first step


def print_estimate(first_step_s, steps_left):
    """After the first step: how long the rest will take, when that is long.

    The first step is the slowest (Triton compilation on a GPU, AdamW's state
    allocation everywhere), so the figure is an upper bound.
    """
    left_s = first_step_s * steps_left
    if left_s > LONG_RUN_S:
        print(
            f"Estimate:      up to {duration(left_s)} for the remaining {steps_left} steps at the first "
            f"step's pace; fewer --steps or a shorter --seq-len finish sooner (Ctrl-C keeps the steps done)",
            flush=True,
        )


def duration(seconds):
    """'45 s', '7 min', '2.5 h': a human reading of a rough estimate."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def run_training(args, model, loss_fn, optimizer, data=None, scheduler=None, resumed=None):
    """The fine-tuning loop: ``loss_fn(model, batch)``, ``optimizer`` and the
    learning-rate ``scheduler`` at every step, on the batches of ``data``
    (prepare_data; None: synthetic). Returns a dict of results (see write_json).

    Throughput is counted two ways: ``tokens_per_sec``, every token slot the model
    computed (padding included), and ``real_tokens_per_sec``, the slots that hold
    real tokens of an example (prompt or response), not padding.
    ``padding_fraction``: the share of the slots of all steps run that is padding.

    ``resumed``: the trainer state of the checkpoint this run continues (see
    load_checkpoint): the loop starts after its step, on the batches that step
    would have been given. With --eval-every the held-out loss is measured every N
    steps; with --output-dir a checkpoint is saved every --save-every steps and at
    the end. Ctrl-C stops the loop between or inside a step: the results then hold
    the completed steps and ``partial`` is True (the caller writes them and exits
    130); with --output-dir the completed steps are saved as a checkpoint first.
    """
    device = next(model.parameters()).device
    start = resumed["step"] if resumed else 0
    history = resumed["history"] if resumed else {"train": [], "eval": []}  # every step, for the curve
    # The batches are a pure function of (seed, step): a resumed run gets those
    # the uninterrupted run had from its step on.
    batches = training_batches(args, data, device, model.config.vocab_size, start)
    total = args.warmup_steps + args.steps
    heldout = held_out_batches(args, data, device, model.config.vocab_size) if args.eval_every else None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the peak of training, weights included

    steps, evals, saved = [], [], []
    partial = False
    rng = rng_states()  # the random state after the last completed step: what a checkpoint holds
    bar = progress_bar(args, total, start)
    say = bar.write if bar else functools.partial(print, flush=True)
    with exit_on_oom(args, "training", model):
        try:
            for i in range(start, total):
                micro_batches = next(batches)
                warmup = i - start < args.warmup_steps  # the first steps of this process are not timed
                lr = optimizer.param_groups[0]["lr"]
                sync()  # time only this step's work, not what is still queued
                begin = time.perf_counter()
                loss, grad_norm = train_step(model, optimizer, loss_fn, micro_batches, scheduler, args.max_grad_norm)
                sync()
                seconds = time.perf_counter() - begin
                # Every micro-batch of the step, of every process (--fsdp: the global batch).
                tokens, real_tokens = reduce_over_ranks([sum(b["num_tokens"] for b in micro_batches),
                                                         sum(b["num_real_tokens"] for b in micro_batches)])
                record = {"step": i + 1, "loss": loss.item(), "time_s": seconds, "warmup": warmup, "lr": lr,
                          "grad_norm": None if grad_norm is None else grad_norm.item(),
                          "tokens": int(tokens), "real_tokens": int(real_tokens)}
                steps.append(record)
                history["train"].append([i + 1, record["loss"]])
                report_step(args, bar, record, total)
                if i == start and not bar:
                    print_estimate(seconds, total - i - 1)
                if args.eval_every and (i + 1) % args.eval_every == 0:
                    eval_loss = evaluate(model, loss_fn, heldout)
                    evals.append({"step": i + 1, "loss": eval_loss})
                    history["eval"].append([i + 1, eval_loss])
                    say(f"eval {i + 1:>4}/{total}  held-out loss {eval_loss:.4f} ({len(heldout)} batches)")
                rng = rng_states()
                if args.output_dir and args.save_every and (i + 1) % args.save_every == 0:
                    saved.append(save_checkpoint(args, model, optimizer, scheduler, i + 1, history, rng))
                    say(f"Saved         {saved[-1]}")
                interrupt_if_held()  # Ctrl-C during the update: this step is complete and recorded
        except KeyboardInterrupt:
            partial = True  # keep what is done; the step in progress is lost
        finally:
            if bar:
                bar.close()

    done = start + len(steps)
    if args.output_dir:
        # The end of the run, or the last completed step of an interrupted one.
        if done > start and not os.path.exists(checkpoint_path(args.output_dir, done)):
            saved.append(save_checkpoint(args, model, optimizer, scheduler, done, history, rng))
            print(f"Saved         {saved[-1]}", flush=True)
        if is_main_process():
            curve = plot_loss_curve(os.path.join(args.output_dir, LOSS_CURVE), history)
            print(f"Loss curve:   {curve}", flush=True)

    timed = [s for s in steps if not s["warmup"]]
    timed_s = sum(s["time_s"] for s in timed)
    slots = sum(s["tokens"] for s in steps)
    peak_bytes, peak_kind = peak_memory()
    _, ranks = rank_and_size()
    if ranks > 1:  # the largest of the processes' peaks: what each GPU must hold
        peak_bytes = int(reduce_over_ranks([peak_bytes], op="max")[0])
        peak_kind += f", the largest of {ranks} processes"
    tokens_per_sec = sum(s["tokens"] for s in timed) / timed_s if timed else None
    return {
        "world_size": ranks,
        "partial": partial,
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
        "final_loss": steps[-1]["loss"] if steps else None,
    }


def report_step(args, bar, record, total):
    """A step's loss and speed: on the progress bar, or as a line every --log-every steps."""
    step, seconds, tokens = record["step"], record["time_s"], record["tokens"]
    speed = "warm-up" if record["warmup"] else f"{tokens / seconds:,.0f} tok/s"
    if bar:
        bar.set_postfix_str(f"loss {record['loss']:.4f}, {speed}", refresh=False)
        bar.update(1)
        return
    if step % (args.log_every or 1) == 0 or step == total or record["warmup"]:
        tag = "  (warm-up, not timed)" if record["warmup"] else f"  {tokens / seconds:>10,.0f} tokens/s"
        print(f"step {step:>4}/{total}  loss {record['loss']:.4f}  {seconds:8.3f} s{tag}", flush=True)


def progress_bar(args, total, start):
    """A tqdm bar (loss, tokens/s, ETA) on a terminal when --log-every is not given;
    otherwise None, and each step prints a line (logs, pipes, tests)."""
    if args.log_every is not None or not sys.stdout.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stdout)


def print_results(title, results):
    """The playbook's result block: time per step, throughput, peak memory."""
    print("=" * 72)
    print(title)
    print("=" * 72)
    print(f"Timed steps:                {results['timed_steps']} (after {results['warmup_steps']} warm-up)")
    print(f"Average time per step:      {results['time_per_step_s']:.3f} s")
    print(f"Average throughput:         {results['tokens_per_sec']:,.0f} tokens/sec")
    if results.get("world_size", 1) > 1:
        label = f"Per GPU ({results['world_size']} processes):"
        print(f"{label:<28}{results['tokens_per_sec_per_gpu']:,.0f} tokens/sec")
    print(f"Real tokens (no padding):   {results['real_tokens_per_sec']:,.0f} tokens/sec "
          f"(padding: {results['padding_fraction'] * 100:.1f}% of the token slots)")
    print(f"Peak memory:                {results['peak_memory_bytes'] / 2**30:.2f} GiB ({results['peak_memory_kind']})")
    print(f"Final loss:                 {results['final_loss']:.4f}")
    if results.get("eval"):
        last = results["eval"][-1]
        print(f"Held-out loss:              {last['loss']:.4f} (step {last['step']})")


def write_json(path, script, args, env, model_info, results):
    """--json: everything needed to compare two runs later, in one file (strict JSON,
    NaN as null, written atomically)."""
    doc = {
        "script": script,
        "config": public_config(args),
        "environment": env,
        "model": model_info,
        **results,
    }
    write_json_atomic(path, doc)


def run_finetune(args, title, script, switch_in):
    """Everything a fine-tune script does after parsing its flags.

    ``switch_in(model, kernels)`` is the script's own choice of what to train with:
    it returns ``(loss_fn, make_optimizer)``, a loss ``loss_fn(model, batch)``
    (a batch dict, see "Data") and an optimizer factory ``make_optimizer(params,
    lr)``, and prints what it chose. With --lora the model it gets is already
    wrapped by PEFT, and the optimizer is given the adapters' parameters only.
    Ctrl-C writes the completed steps (marked partial) and exits 130.
    """
    # Every check that needs no model comes first: a mistake costs a second, not a load.
    if args.json:
        args.json = check_output_path(args.json, "--json")  # now, not after minutes of training
    check_lora_flags(args)
    check_fsdp_flags(args)
    resumed = read_checkpoint_state(args.resume) if args.resume else None
    check_output_flags(args)
    world = init_distributed(args)  # --fsdp: rank 0 prints from here on
    env = environment_info()
    print_banner(title, env)
    resolve_defaults(args)
    if resumed:
        check_same_run(args, resumed)
    if args.output_dir:
        check_no_later_checkpoints(args.output_dir, resumed["step"] if resumed else 0)
    records = load_records(args.dataset)  # a bad --dataset fails now, before the model is built

    model, model_info = load_model(args)
    data = prepare_data(args, records, model.config.vocab_size)
    if args.eval_every and data is not None and not data.held_out:
        raise SystemExit(f"error: --eval-every: {data.name} leaves no held-out example to evaluate on (its "
                         f"held-out split is {EVAL_FRACTION:.0%} of the records); use a larger dataset or leave "
                         f"--eval-every out")
    if args.lora:
        model = apply_lora(model, args)
    if resumed:
        check_same_model(resumed, model)
    params = trainable_parameters(model)
    model_info["trainable_parameters"] = sum(p.numel() for p in params)
    accum = f" x {args.grad_accum} micro-batches per step" if args.grad_accum > 1 else ""
    per = f" per process, {world.size} processes" if world else ""
    print(f"Batch:         {args.batch_size} x {args.seq_len} tokens{per}{accum}, lr {args.lr:g}, seed {args.seed}")
    kernels = kernels_from_args(args)
    loss_fn, make_optimizer = switch_in(model, kernels)
    if world:  # after the kernels: the swapped modules are what is sharded
        shard_model(model, args)
        loss_fn = loss_inside_forward(model, loss_fn)
    compile_decoder(model, args)  # after the kernels (and LoRA): they are what the graphs hold
    # Taken again: fully_shard replaced every parameter with a sharded one (DTensor).
    optimizer = make_optimizer(trainable_parameters(model), lr=args.lr)
    scheduler = make_scheduler(optimizer, args)
    print_schedule(args)
    if resumed:
        load_checkpoint(args.resume, model, optimizer, scheduler)
        print(f"Resumed:       {args.resume}: step {resumed['step']} of {args.warmup_steps + args.steps} done")
    results = run_training(args, model, loss_fn, optimizer, data, scheduler, resumed)
    results["kernels"] = kernels
    write = args.json and is_main_process()  # --fsdp: rank 0 writes the one report
    if results["partial"]:
        done = len(results["steps"])
        if write:
            write_json(args.json, script, args, env, model_info, results)
        where = f"wrote them to {args.json} (marked partial)" if args.json else "not written (no --json)"
        print(f"\nInterrupted: {done} of {results['planned_steps'] - results['start_step']} steps completed, "
              f"{where}", flush=True)
        raise SystemExit(130)  # 128 + SIGINT, what a shell reports for Ctrl-C
    print_results(f"{title}: results", results)
    if write:
        write_json(args.json, script, args, env, model_info, results)
        print(f"Wrote {args.json}")
    close_distributed()
    return results


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
    g.add_argument("--eval-every", type=positive_int,
                   help="every N steps, the mean loss on held-out batches: the held-out split of --dataset "
                        "(records no training step sees), or synthetic tokens of another seed")
    g.add_argument("--eval-batches", type=positive_int, default=EVAL_BATCHES,
                   help="held-out batches per evaluation, the same ones each time; fewer if the held-out "
                        "split has fewer (default: %(default)s)")
    g.add_argument("--output-dir", metavar="DIR",
                   help="save checkpoints as DIR/checkpoint-K (the model, or with --lora only the adapter, as "
                        "safetensors; optimizer, schedule, random state, data position) at the end, every "
                        "--save-every steps and on Ctrl-C, and the loss curve as DIR/loss_curve.png. A run "
                        "never overwrites a checkpoint: DIR may hold none past the step the run starts from")
    g.add_argument("--save-every", type=positive_int, help="a checkpoint every N steps (needs --output-dir)")
    g.add_argument("--resume", metavar="DIR/checkpoint-K",
                   help="continue a run from its checkpoint, with the same flags (checked): the losses are "
                        "those the run would have had without the break. New checkpoints go beside it "
                        "unless --output-dir says otherwise")
    return parser


def add_lora_args(parser):
    g = parser.add_argument_group("LoRA (PEFT)")
    g.add_argument("--lora", action="store_true",
                   help="train low-rank adapters only (pip install peft); the model's own weights are frozen")
    g.add_argument("--lora-r", type=positive_int, default=16, help="rank of each adapter (default: %(default)s)")
    g.add_argument("--lora-alpha", type=non_negative_float, default=32.0,
                   help="adapter scale: the update is (alpha / r) * B @ A (default: %(default)g)")
    g.add_argument("--lora-dropout", type=probability, default=0.0,
                   help="dropout on each adapter's input (default: %(default)g)")
    g.add_argument("--lora-targets", type=name_list, default=",".join(LORA_TARGETS),
                   help="comma-separated names of the linear layers that get adapters (default: every "
                        "linear layer of the decoder, %(default)s)")
    g.add_argument("--lora-4bit", action="store_true",
                   help="QLoRA: the frozen weights loaded in 4-bit NF4 (pip install bitsandbytes; CUDA GPU, "
                        "pretrained weights); implies --lora")
    return parser


def check_output_flags(args):
    """--output-dir / --save-every / --resume, before any work: one line each."""
    if args.resume and not args.output_dir:
        args.output_dir = os.path.dirname(os.path.abspath(os.path.expanduser(args.resume)))
    if args.save_every and not args.output_dir:
        raise SystemExit("error: --save-every needs --output-dir (where the checkpoints go)")
    if args.output_dir:
        args.output_dir = check_output_path(args.output_dir, "--output-dir", directory=True)


def print_schedule(args):
    total = args.warmup_steps + args.steps
    clip = f"clipped to norm {args.max_grad_norm:g}" if args.max_grad_norm > 0 else "not clipped"
    print(f"Schedule:      {total} steps: lr warm-up over {args.lr_warmup_steps}, then cosine to 0; "
          f"gradients {clip}")


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


# --------------------------------------------------------------------------------
# LoRA (PEFT)
# --------------------------------------------------------------------------------
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def installed(package):
    import importlib.util

    return importlib.util.find_spec(package) is not None


def check_lora_flags(args):
    """What --lora and --lora-4bit need, checked before anything is built."""
    if args.lora_4bit:
        args.lora = True
        if not installed("bitsandbytes"):
            raise SystemExit("error: --lora-4bit needs bitsandbytes for the 4-bit weights: pip install bitsandbytes")
        if not torch.cuda.is_available():
            raise SystemExit("error: --lora-4bit needs a CUDA GPU (bitsandbytes' 4-bit kernels)")
        if args.tiny or args.random_init:
            raise SystemExit("error: --lora-4bit quantizes pretrained weights while loading them; "
                             "it cannot be used with --tiny or --random-init")
    if args.lora and not installed("peft"):
        raise SystemExit("error: --lora needs the peft package: pip install peft")


def qlora_quantization_config():
    """QLoRA's storage of the frozen weights: 4-bit NF4, double-quantized scales,
    matmuls computed in bf16."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def apply_lora(model, args):
    """Wrap ``model`` with PEFT LoRA adapters on --lora-targets; freeze everything else.

    Each target ``y = x @ W.T`` becomes ``y = x @ W.T + (alpha / r) * dropout(x) @ A.T @ B.T``
    with A [r, in] random and B [out, r] zero, so training starts from the model
    itself. Only A and B are trained: for r = 16 on every linear layer of LLaMA-3.1-8B
    that is 42 M parameters instead of 8 B, and AdamW state for those only.
    Returns the PeftModel (it forwards config, get_decoder, lm_head... to the model).
    """
    import peft

    linear = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in args.lora_targets if t not in linear]
    if missing:
        raise SystemExit(f"error: --lora-targets: {type(model).__name__} has no linear layer named "
                         f"{', '.join(missing)} (it has {', '.join(sorted(linear))})")
    if args.lora_4bit:  # norms and embeddings in float32, the quantized layers ready for adapters
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                             target_modules=list(args.lora_targets), task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft asks transformers about checkpointing by a deprecated name
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.get_peft_model(model, config)
    trainable = sum(p.numel() for p in trainable_parameters(model))
    total = sum(p.numel() for p in model.parameters())
    print(f"LoRA:          r {args.lora_r}, alpha {args.lora_alpha:g}, dropout {args.lora_dropout:g} on "
          f"{','.join(args.lora_targets)}: {trainable:,} of {total:,} parameters trained "
          f"({100 * trainable / total:.2f}%)")
    return model


def is_peft_model(model):
    return hasattr(model, "peft_config")


def trainable_parameters(model):
    """The parameters the optimizer gets: all of them, or with LoRA the adapters only
    (frozen weights get no gradient, no AdamW state, no update)."""
    return [p for p in model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------------
# Checkpoints: DIR/checkpoint-K holds everything step K+1 needs
# --------------------------------------------------------------------------------
# Layout of DIR/checkpoint-K:
#   model.safetensors + config.json          the model (save_pretrained), or with LoRA
#   adapter_model.safetensors + adapter_config.json     the adapters only
#   optimizer.pt, scheduler.pt               their state_dict()s (torch.save)
#   rng_state.pt                             python, torch CPU and CUDA generators
#   trainer_state.json                       step K, the flags and model config it was
#                                            made with, the loss history
# It is written as checkpoint-K.tmp and renamed when complete: a crash or Ctrl-C
# during the save never leaves a half checkpoint under the real name.
CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"
CHECKPOINT_FORMAT = 1

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
    later = sorted(k for k in existing_checkpoints(output_dir) if k > start_step)
    if later:
        how = f"resumed from step {start_step}" if start_step else "starting from step 0"
        raise SystemExit(f"error: --output-dir {output_dir} already holds {CHECKPOINT_PREFIX}{later[0]}, which a "
                         f"run {how} would overwrite; continue it with --resume "
                         f"{checkpoint_path(output_dir, later[-1])}, or choose another --output-dir")


def run_flags(args):
    flags = {name: getattr(args, name) for name in RUN_FLAGS}
    flags["dataset"] = dataset_name(args.dataset)  # the bundled set wherever the repository is
    return flags


def model_fingerprint(model):
    """The model's config as plain JSON values, less what does not change the numbers."""
    config = model.config.to_dict()
    for key in ("transformers_version", "_name_or_path", "use_cache", "architectures"):
        config.pop(key, None)
    return json.loads(json.dumps(config, default=str, sort_keys=True))


def lora_fingerprint(model):
    if not is_peft_model(model):
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


def save_checkpoint(args, model, optimizer, scheduler, step, history, rng):
    """Write DIR/checkpoint-``step`` (layout above); return its path."""
    path = checkpoint_path(args.output_dir, step)
    tmp = path + ".tmp"
    rank, ranks = rank_and_size()
    sharded = getattr(args, "fsdp", False)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was interrupted
        os.makedirs(tmp)
    barrier()  # --fsdp: every process writes into the folder rank 0 made
    if sharded:
        save_sharded(tmp, model, optimizer)
        torch.save(rng, os.path.join(tmp, f"rng_state_rank{rank}.pt"))  # each process's own generators
    else:
        model.save_pretrained(tmp)  # safetensors; a PeftModel writes its adapters only
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        torch.save(rng, os.path.join(tmp, "rng_state.pt"))
    barrier()
    if rank != 0:
        barrier()  # until rank 0 has renamed the folder
        return path
    torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
    write_json_atomic(os.path.join(tmp, TRAINER_STATE), {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "total_steps": args.warmup_steps + args.steps,
        "model_name": "tiny" if args.tiny else args.model,
        "flags": run_flags(args),
        "model_config": model_fingerprint(model),
        "lora_config": lora_fingerprint(model),
        "history": history,
        "world_size": ranks,  # --fsdp: the shards fit this many processes only
        "sharded": sharded,
    })
    os.rename(tmp, path)
    barrier()
    return path


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

    lora = is_peft_model(model)
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


def read_checkpoint_state(path, flag="--resume"):
    """--resume (or ``flag``, the argument that named ``path``): the checkpoint's
    trainer_state.json, or a one-line error."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise SystemExit(f"error: {flag} {path}: no such checkpoint directory")
    try:
        with open(os.path.join(path, TRAINER_STATE)) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"error: {flag} {path}: not a checkpoint (no {TRAINER_STATE}); checkpoints are the "
                         f"{CHECKPOINT_PREFIX}K folders of an --output-dir") from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {flag} {path}: cannot read {TRAINER_STATE} ({_one_line(e)})") from None
    if state.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"error: {flag} {path}: checkpoint format {state.get('format')!r}, "
                         f"this code reads {CHECKPOINT_FORMAT}")
    state["path"] = path
    return state


def differences(then, now, limit=4):
    """'key a there, b here' for the first ``limit`` keys whose values differ."""
    keys = [k for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)]
    text = "; ".join(f"{k} {then.get(k)!r} there, {now.get(k)!r} here" for k in keys[:limit])
    return text + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def check_same_run(args, state):
    """The flags that decide the numbers must be those the checkpoint was made with."""
    name = "tiny" if args.tiny else args.model
    if state["model_name"] != name:
        raise SystemExit(f"error: --resume {state['path']}: the checkpoint is of {state['model_name']}, "
                         f"this run trains {name}")
    then, now = state["flags"], json.loads(json.dumps(run_flags(args)))
    if then != now:
        diff = differences({"--" + k.replace("_", "-"): v for k, v in then.items()},
                           {"--" + k.replace("_", "-"): v for k, v in now.items()})
        raise SystemExit(f"error: --resume {state['path']}: made with other settings: {diff}; "
                         f"resume with the flags of the run that saved it")
    if not state["step"] < args.warmup_steps + args.steps:
        raise SystemExit(f"error: --resume {state['path']}: the run is complete ({state['step']} steps)")
    fsdp = bool(getattr(args, "fsdp", False))
    then_size, now_size = state.get("world_size", 1), rank_and_size()[1] if fsdp else 1
    then_fsdp, now_fsdp = state.get("sharded", False), fsdp
    if then_fsdp != now_fsdp or then_size != now_size:
        def how(fsdp, size):
            return f"--fsdp with {size} processes" if fsdp else "one process without --fsdp"
        raise SystemExit(f"error: --resume {state['path']}: written by {how(then_fsdp, then_size)}, this run is "
                         f"{how(now_fsdp, now_size)}; resume it as it was written (--batch-size is per process)")


def check_same_model(state, model, flag="--resume"):
    """The architecture (and the LoRA setup) must be the checkpoint's."""
    if state["model_config"] != model_fingerprint(model):
        raise SystemExit(f"error: {flag} {state['path']}: the checkpoint is of another model: "
                         f"{differences(state['model_config'], model_fingerprint(model))}")
    if state["lora_config"] != lora_fingerprint(model):
        raise SystemExit(f"error: {flag} {state['path']}: the checkpoint has other LoRA adapters: "
                         f"{differences(state['lora_config'] or {}, lora_fingerprint(model) or {})}")


def load_checkpoint(path, model, optimizer, scheduler):
    """Load a checkpoint's weights (or adapters), optimizer, schedule and random state
    into a freshly built ``model``, ``optimizer`` and ``scheduler`` of the same run."""
    from safetensors.torch import load_file

    device = str(next(model.parameters()).device)
    if os.path.isdir(os.path.join(path, SHARDED_DIR)):  # --fsdp (check_same_run made sure this run is too)
        load_sharded(path, model, optimizer)
        scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt")))
        set_rng_states(torch.load(os.path.join(path, f"rng_state_rank{rank_and_size()[0]}.pt"), weights_only=False))
        return
    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        weights = load_file(os.path.join(path, "adapter_model.safetensors"), device=device)
        result = set_peft_model_state_dict(model, weights)
        if result.unexpected_keys:
            raise SystemExit(f"error: --resume {path}: adapter tensors this model lacks: {result.unexpected_keys[:3]}")
    else:
        weights = {}
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):  # one file, or the shards
            weights.update(load_file(file, device=device))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        # A tied LM head is saved once, as the embedding: loading that loaded both.
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded = {params[k].data_ptr() for k in weights if k in params}
        missing = [k for k in missing if k not in params or params[k].data_ptr() not in loaded]
        if missing or unexpected:
            raise SystemExit(f"error: --resume {path}: the weights do not fit this model "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), map_location=device))
    scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt")))
    set_rng_states(torch.load(os.path.join(path, "rng_state.pt")))


# --------------------------------------------------------------------------------
# The loss curve
# --------------------------------------------------------------------------------
def plot_loss_curve(path, history):
    """Train (every step) and held-out losses against the step, as a PNG; returns the path.
    matplotlib's Agg canvas directly: no display, no pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for points, style, label in ((history["train"], "-", "train"), (history["eval"], "o-", "held-out")):
        points = [(step, loss) for step, loss in points if loss is not None]  # NaN was saved as null
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp)
    os.replace(tmp, path)
    return path


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
    """--fsdp needs torchrun; torchrun with several processes needs --fsdp. One line
    each, before any work."""
    fsdp = getattr(args, "fsdp", False)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if not fsdp:
        if world > 1:
            raise SystemExit(f"error: started by torchrun with {world} processes but without --fsdp: each "
                             f"would train its own full copy of the model; add --fsdp")
        return
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise SystemExit(f"error: --fsdp runs under torchrun, which sets {', '.join(missing)}: "
                         f"torchrun --nproc-per-node N {os.path.basename(sys.argv[0])} --fsdp ...")
    if getattr(args, "lora_4bit", False):  # --lora (bf16 or float32 adapters and weights) is sharded like any model
        raise SystemExit("error: --fsdp with --lora-4bit is not supported: FSDP2 would have to shard "
                         "bitsandbytes' packed 4-bit weights; use --lora, or --lora-4bit on one GPU")
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"error: --fsdp: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs "
                             f"are visible; start at most that many processes per node")


def init_distributed(args):
    """--fsdp: join torchrun's process group (NCCL between GPUs, gloo on CPU), pin this
    process to GPU LOCAL_RANK; every process but rank 0 stops printing. Returns a
    World, or None without --fsdp."""
    if not getattr(args, "fsdp", False):
        return None
    rank, size, local_rank = (int(os.environ[name]) for name in TORCHRUN_ENV)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # "cuda" is now this process's GPU
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not torch.distributed.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        torch.distributed.init_process_group(backend=backend, **kwargs)
    if rank != 0:  # one report, rank 0's; errors still reach stderr from every rank
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    args._world = World(rank, size, local_rank, device)
    return args._world


def close_distributed():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def shard_model(model, args):
    """--fsdp: fully_shard each decoder layer, then the root (embedding, final norm,
    LM head); a model built on the meta device (load_model) is then materialized,
    shard by shard. Call it after the kernels are switched in: the module swaps
    must see the modules as built, and FSDP gives every module's forward its full
    (unsharded) weights, so TritonRMSNorm and TritonLlamaMLP run unchanged.

    On a GPU the weights are gathered in bf16 and the gradients reduced in float32
    (MixedPrecisionPolicy); the tiny float32 model (and the CPU) keeps float32 throughout.

    With --lora (apply_lora ran before, on the whole model) each layer's frozen
    weights and its adapters are sharded together, one group: FSDP2 gathers both
    for the forward and reduce-scatters only the gradients that exist, the
    adapters'; the optimizer then gets the adapters' shards (trainable_parameters).
    A model built on the meta device gets PEFT's adapter initialization back after
    HF's (materialize).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = args._world
    kwargs = {}
    if world.device.type == "cuda" and not args.tiny:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.get_decoder().layers
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    materialized = ""
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        materialize(model, world.device)
        materialized = "; built on the meta device, each process initialized its own shards"
    precision = "bf16 weights, float32 gradient reduction" if kwargs else "float32"
    print(f"FSDP:          {world.size} processes, {len(layers)} decoder layers + the root sharded "
          f"({precision}){materialized}")
    return model


def materialize(model, device):
    """A model built on the meta device (shapes, no memory), now sharded: allocate
    each process's shards on ``device`` (to_empty: uninitialized memory) and fill
    them with HF's own initialization, module by module. The random draws of a
    DTensor are those of the full tensor, so every shard is a piece of one model.
    HF's _init_weights also recomputes the rotary embedding's buffers."""
    model.to_empty(device=device)
    with torch.no_grad():
        model.apply(model._init_weights)
        if is_peft_model(model):
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


def loss_inside_forward(model, loss_fn):
    """A loss that runs the model's parts itself must run inside an FSDP forward.

    FSDP gathers a module's weights in the hooks around its ``forward``. The fused
    linear cross-entropy (finetune_optimized.py) calls the decoder, then uses
    ``lm_head.weight`` directly: neither goes through the root's forward, so the
    embedding, the final norm and the LM head (the root's shards) would still be
    sharded there, and their gradients would not be reduced. So the loss becomes a
    method of the root module that FSDP treats as a forward
    (register_fsdp_forward_method): its hooks gather the root's weights before it
    and schedule the gradient reduce-scatter after backward, as for forward().
    Chosen over sharding lm_head apart and unsharding by hand: one call, and the
    loss function itself stays the same on one GPU and under FSDP.
    Losses that call ``model(...)`` themselves (HF's, the Triton CE on the logits)
    already run inside the root's forward and are returned unchanged.
    """
    if not getattr(loss_fn, "calls_model_parts", False):
        return loss_fn
    from torch.distributed.fsdp import register_fsdp_forward_method

    model.fsdp_loss = functools.partial(loss_fn, model)
    register_fsdp_forward_method(model, "fsdp_loss")

    def loss_in_root_forward(model, batch):
        return model.fsdp_loss(batch)

    return loss_in_root_forward


def reduce_over_ranks(values, op="sum"):
    """A list of Python numbers, summed (or max) over the processes; as given on one."""
    if rank_and_size()[1] == 1:
        return values
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM)
    return t.tolist()
