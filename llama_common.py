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
* ``hf_loss`` and ``pytorch_adamw``: the baseline's loss and optimizer. The Triton
  kernels are switched in by finetune_optimized.py, in its own code, which hands
  ``run_finetune`` another loss function and optimizer.
* ``train_step`` / ``run_training``: forward, loss, backward, optimizer step, with
  NVTX ranges, synchronized timing, tokens/sec, peak memory, out-of-memory advice
  and Ctrl-C handling (the completed steps are kept).
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


def add_model_args(parser, custom_kernels_default=False):
    """Flags shared by every script that builds a model and trains it."""
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
        help=f"tokens per sequence (default: 2048; --tiny: 128, or {CPU_TINY_SEQ_LEN} without a GPU)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: %(default)s)")
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


# Defaults on a CPU, where the Triton kernels run in the interpreter (seconds per
# step even for the tiny model): the default run of either fine-tune script then
# ends within a minute on a 2-core laptop, with the loss visibly falling.
CPU_STEPS = 6
CPU_WARMUP_STEPS = 1  # no compilation, no autotuning: one step to allocate AdamW's state
CPU_TINY_SEQ_LEN = 32


def add_finetune_args(parser):
    """Flags of the fine-tune scripts (the profile script has its own --steps)."""
    g = parser.add_argument_group("training loop")
    g.add_argument(
        "--steps", type=positive_int, help=f"timed training steps (default: 20, or {CPU_STEPS} without a GPU)"
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
    return parser


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
        args.seq_len = (128 if on_gpu else CPU_TINY_SEQ_LEN) if args.tiny else 2048
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
def llama31_8b_config():
    """The architecture of meta-llama/Llama-3.1-8B (its config.json, written as code)."""
    return LlamaConfig(
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


def hub_problem(model_id):
    """Why the HF hub cannot give us ``model_id`` now, or None if it can.

    transformers retries a failing download for about 45 s before it gives up, so
    we ask the hub first, once, with a short timeout: no network, a gated repo
    without access, and a wrong id each become a one-line reason in seconds.
    """
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set and the model is not in the local cache"
    try:
        huggingface_hub.model_info(model_id, timeout=HUB_TIMEOUT_S)  # reachability and existence
        huggingface_hub.auth_check(model_id)  # access to the files of a gated repo
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


def is_default_model(model_id):
    """The default hub id, or a local copy of it (a directory named Llama-3.1-8B)."""
    name = os.path.basename(os.path.normpath(model_id)).lower()
    return model_id == DEFAULT_MODEL or name in ("llama-3.1-8b", "meta-llama-3.1-8b")


def looks_like_path(model_id):
    # Hub ids are "org/name"; anything else with a slash, a dot or a tilde in front is a path.
    return model_id.startswith(("/", ".", "~")) or model_id.count("/") > 1


def config_for(model_id, weights_problem=None):
    """The architecture of ``model_id`` without its weights; exits if it cannot be found.

    ``weights_problem`` is why the weights could not be loaded, if we tried: it is
    quoted in the error, and a hub that already failed is not asked again.
    """
    if is_default_model(model_id):
        return llama31_8b_config()
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
        f"default {DEFAULT_MODEL} config is bundled. Pass a local --model PATH, or --tiny."
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
    for layer in layers:
        if checkpointing:
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
            model = build_random(config, device, dtype)
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


def hf_loss(model, input_ids, labels):
    """Baseline: the loss the way HF computes it (it shifts, upcasts the logits to fp32
    and calls F.cross_entropy, which builds the log-softmax)."""
    return model(input_ids=input_ids, labels=labels).loss


def pytorch_adamw(params, lr):
    """torch.optim.AdamW with PyTorch's defaults (betas 0.9/0.999, eps 1e-8, weight decay 0.01).

    fused=True on CUDA: one kernel per step for all parameters instead of a dozen
    elementwise kernels per tensor. The CPU keeps PyTorch's default implementation.
    """
    return torch.optim.AdamW(params, lr=lr, fused=torch.cuda.is_available())


# --------------------------------------------------------------------------------
# Data, one training step, the training loop
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


def phase(name):
    """A named range: shows in torch.profiler traces, and in nsys as NVTX on a GPU."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.profiler.record_function(name))
    if torch.cuda.is_available():
        stack.enter_context(torch.cuda.nvtx.range(name))
    return stack


def train_step(model, optimizer, loss_fn, micro_batches, scheduler=None, max_grad_norm=0.0):
    """One optimizer step: forward + loss and backward for each micro-batch
    (``micro_batches``: a list of (input_ids, labels)), then gradient clipping, the
    AdamW update and the learning-rate schedule. Returns (loss, gradient norm):
    tensors, the loss averaged over every target token of the step; the norm is
    None when clipping is off."""
    loss = accumulate_gradients(model, loss_fn, micro_batches)
    with phase("optimizer"):
        grad_norm = optimizer_update(optimizer, scheduler, max_grad_norm)
    return loss, grad_norm


def target_count(labels):
    """How many positions of a micro-batch count in its loss (the shifted labels that
    are not IGNORE_INDEX), as a tensor: reading it would wait for the GPU."""
    return (shift_labels(labels) != IGNORE_INDEX).sum()


def accumulate_gradients(model, loss_fn, micro_batches):
    """Forward and backward of each micro-batch, adding up the gradients.

    ``loss_fn`` returns the mean over one micro-batch's target tokens. The step's
    loss must be the mean over all of its tokens, what one big batch would give,
    so each micro-batch's loss is weighted by its share of the step's tokens
    (1/N each when every micro-batch has as many; with padding, not). The weight
    is applied before backward, so the gradients are those of the step's loss.
    """
    counts = [target_count(labels) for _, labels in micro_batches]
    total = torch.stack(counts).sum().clamp(min=1)  # an all-padding step: loss 0, not 0/0
    step_loss = 0.0
    for (input_ids, labels), count in zip(micro_batches, counts):
        with phase("forward"):
            loss = loss_fn(model, input_ids, labels) * (count / total)  # exactly x1.0 without accumulation
        with phase("backward"):
            loss.backward()
        step_loss = step_loss + loss.detach()
    return step_loss


def optimizer_update(optimizer, scheduler, max_grad_norm):
    """Clip the gradients, update the parameters, advance the learning-rate schedule.
    Returns the gradient norm before clipping (a tensor), or None without clipping."""
    grad_norm = None
    if max_grad_norm > 0:
        # The parameters the optimizer updates are the ones to clip (LoRA: the adapters only).
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
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
    """Mean loss over ``batches`` ((input_ids, labels) pairs; held-out data), every
    target token weighted alike, with the model in eval mode (no dropout) and no
    gradients. Returns a float."""
    was_training = model.training
    model.eval()
    try:
        loss_sum, count_sum = 0.0, 0
        for input_ids, labels in batches:
            count = target_count(labels)
            loss_sum = loss_sum + loss_fn(model, input_ids, labels).float() * count
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


def run_training(args, model, loss_fn, optimizer, scheduler=None, resumed=None):
    """The fine-tuning loop: ``loss_fn(model, input_ids, labels)``, ``optimizer`` and the
    learning-rate ``scheduler`` at every step. Returns a dict of results (see write_json).

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
    batches = training_batches(args, model.config.vocab_size, device, start)
    tokens = args.batch_size * args.seq_len * args.grad_accum  # every micro-batch of a step
    total = args.warmup_steps + args.steps
    heldout = heldout_batches(args, model.config.vocab_size, device) if args.eval_every else None
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
                record = {"step": i + 1, "loss": loss.item(), "time_s": seconds, "warmup": warmup, "lr": lr,
                          "grad_norm": None if grad_norm is None else grad_norm.item()}
                steps.append(record)
                history["train"].append([i + 1, record["loss"]])
                report_step(args, bar, record, total, tokens)
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
        curve = plot_loss_curve(os.path.join(args.output_dir, LOSS_CURVE), history)
        print(f"Loss curve:   {curve}", flush=True)

    timed = [s["time_s"] for s in steps if not s["warmup"]]
    peak_bytes, peak_kind = peak_memory()
    return {
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
        "tokens_per_step": tokens,
        # None (null in the JSON) when Ctrl-C came before the first timed step.
        "time_per_step_s": sum(timed) / len(timed) if timed else None,
        "tokens_per_sec": tokens * len(timed) / sum(timed) if timed else None,
        "peak_memory_bytes": peak_bytes,
        "peak_memory_kind": peak_kind,
        "final_loss": steps[-1]["loss"] if steps else None,
    }


def report_step(args, bar, record, total, tokens):
    """A step's loss and speed: on the progress bar, or as a line every --log-every steps."""
    step, seconds = record["step"], record["time_s"]
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
    it returns ``(loss_fn, make_optimizer)``, a loss ``loss_fn(model, input_ids,
    labels)`` and an optimizer factory ``make_optimizer(params, lr)``, and prints
    what it chose. With --lora the model it gets is already wrapped by PEFT, and
    the optimizer is given the adapters' parameters only. Ctrl-C writes the
    completed steps (marked partial) and exits 130.
    """
    # Every check that needs no model comes first: a mistake costs a second, not a load.
    if args.json:
        args.json = check_output_path(args.json, "--json")  # now, not after minutes of training
    check_lora_flags(args)
    resumed = read_checkpoint_state(args.resume) if args.resume else None
    check_output_flags(args)
    env = environment_info()
    print_banner(title, env)
    resolve_defaults(args)
    if resumed:
        check_same_run(args, resumed)
    if args.output_dir:
        check_no_later_checkpoints(args.output_dir, resumed["step"] if resumed else 0)

    model, model_info = load_model(args)
    if args.lora:
        model = apply_lora(model, args)
    if resumed:
        check_same_model(args, resumed, model)
    params = trainable_parameters(model)
    model_info["trainable_parameters"] = sum(p.numel() for p in params)
    accum = f" x {args.grad_accum} micro-batches per step" if args.grad_accum > 1 else ""
    print(f"Batch:         {args.batch_size} x {args.seq_len} tokens{accum}, lr {args.lr:g}, seed {args.seed}")
    kernels = kernels_from_args(args)
    loss_fn, make_optimizer = switch_in(model, kernels)
    compile_decoder(model, args)  # after the kernels (and LoRA): they are what the graphs hold
    optimizer = make_optimizer(params, lr=args.lr)
    scheduler = make_scheduler(optimizer, args)
    print_schedule(args)
    if resumed:
        load_checkpoint(args.resume, model, optimizer, scheduler)
        print(f"Resumed:       {args.resume}: step {resumed['step']} of {args.warmup_steps + args.steps} done")
    results = run_training(args, model, loss_fn, optimizer, scheduler, resumed)
    results["kernels"] = kernels
    if results["partial"]:
        done = len(results["steps"])
        if args.json:
            write_json(args.json, script, args, env, model_info, results)
        where = f"wrote them to {args.json} (marked partial)" if args.json else "not written (no --json)"
        print(f"\nInterrupted: {done} of {results['planned_steps'] - results['start_step']} steps completed, "
              f"{where}", flush=True)
        raise SystemExit(130)  # 128 + SIGINT, what a shell reports for Ctrl-C
    print_results(f"{title}: results", results)
    if args.json:
        write_json(args.json, script, args, env, model_info, results)
        print(f"Wrote {args.json}")
    return results


# --------------------------------------------------------------------------------
# A real run's flags: accumulation, schedule, clipping, evaluation, checkpoints
# --------------------------------------------------------------------------------
LR_WARMUP_FRACTION = 0.1  # --lr-warmup-steps default: 10% of all steps
EVAL_SEED_OFFSET = 1_000_003  # held-out batches: the same generator with another seed
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
                   help="every N steps, the mean loss on held-out batches (synthetic data of another seed)")
    g.add_argument("--eval-batches", type=positive_int, default=4,
                   help="held-out batches per evaluation (default: %(default)s)")
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
# Batches of a step, held-out batches
# --------------------------------------------------------------------------------
def training_batches(args, vocab_size, device, start_step=0):
    """The micro-batches of each optimizer step: lists of --grad-accum (input_ids, labels).

    ``start_step``: the stream begins where step ``start_step`` + 1 of a run from
    the beginning would be (a resumed run gets the batches it would have had).
    synthetic_batches is a pure function of the seed, so skipping is replaying.
    """
    stream = synthetic_batches(args.batch_size, args.seq_len, vocab_size, args.seed, device)
    stream = itertools.islice(stream, start_step * args.grad_accum, None)
    while True:
        yield [next(stream) for _ in range(args.grad_accum)]


def heldout_batches(args, vocab_size, device):
    """--eval-batches batches no training step sees: the same kind of data, another seed."""
    stream = synthetic_batches(args.batch_size, args.seq_len, vocab_size, args.seed + EVAL_SEED_OFFSET, device)
    return list(itertools.islice(stream, args.eval_batches))


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
    import warnings

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
RUN_FLAGS = ("tiny", "seed", "batch_size", "seq_len", "grad_accum", "lr", "steps", "warmup_steps",
             "lr_warmup_steps", "max_grad_norm", "lora", "lora_r", "lora_alpha", "lora_dropout",
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
    return {name: getattr(args, name) for name in RUN_FLAGS}


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
    shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was interrupted
    os.makedirs(tmp)
    model.save_pretrained(tmp)  # safetensors; a PeftModel writes its adapters only
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
    torch.save(rng, os.path.join(tmp, "rng_state.pt"))
    write_json_atomic(os.path.join(tmp, TRAINER_STATE), {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "total_steps": args.warmup_steps + args.steps,
        "model_name": "tiny" if args.tiny else args.model,
        "flags": run_flags(args),
        "model_config": model_fingerprint(model),
        "lora_config": lora_fingerprint(model),
        "history": history,
    })
    os.rename(tmp, path)
    return path


def read_checkpoint_state(path):
    """--resume: the checkpoint's trainer_state.json, or a one-line error."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise SystemExit(f"error: --resume {path}: no such checkpoint directory")
    try:
        with open(os.path.join(path, TRAINER_STATE)) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"error: --resume {path}: not a checkpoint (no {TRAINER_STATE}); checkpoints are the "
                         f"{CHECKPOINT_PREFIX}K folders of an --output-dir") from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --resume {path}: cannot read {TRAINER_STATE} ({_one_line(e)})") from None
    if state.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"error: --resume {path}: checkpoint format {state.get('format')!r}, "
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


def check_same_model(args, state, model):
    """The architecture (and the LoRA setup) must be the checkpoint's."""
    if state["model_config"] != model_fingerprint(model):
        raise SystemExit(f"error: --resume {state['path']}: the checkpoint is of another model: "
                         f"{differences(state['model_config'], model_fingerprint(model))}")
    if state["lora_config"] != lora_fingerprint(model):
        raise SystemExit(f"error: --resume {state['path']}: the checkpoint has other LoRA adapters: "
                         f"{differences(state['lora_config'] or {}, lora_fingerprint(model) or {})}")


def load_checkpoint(path, model, optimizer, scheduler):
    """Load a checkpoint's weights (or adapters), optimizer, schedule and random state
    into a freshly built ``model``, ``optimizer`` and ``scheduler`` of the same run."""
    from safetensors.torch import load_file

    device = str(next(model.parameters()).device)
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
