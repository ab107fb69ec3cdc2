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
import json
import os
import platform
import resource
import sys
import tempfile
import time

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)

import torch
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
    g.add_argument("--lr", type=float, help="AdamW learning rate (default: 1e-5; --tiny: 1e-3)")
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
    g.add_argument("--log-every", type=positive_int, default=1, help="a step line every N steps (default: %(default)s)")
    g.add_argument("--json", metavar="PATH", help="write config, environment, losses, times and memory here")
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
        # Random tiny weights need a big step to show learning in a few steps;
        # 1e-5 is a usual full fine-tuning rate for a pretrained 8B model.
        args.lr = 1e-3 if args.tiny else 1e-5
    # The fine-tune scripts' loop lengths (the profile script sets its own --steps).
    if getattr(args, "steps", 0) is None:
        args.steps = 20 if on_gpu else CPU_STEPS
    if getattr(args, "warmup_steps", 0) is None:
        args.warmup_steps = 2 if on_gpu else CPU_WARMUP_STEPS
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


def try_pretrained(model_id, device, dtype):
    """Return (model, None) with real weights, or (None, reason) when they cannot be had."""
    if looks_like_path(model_id) and not os.path.exists(model_id):
        return None, "no such file or directory"
    if os.path.exists(model_id):
        return _attempt_pretrained(model_id, device, dtype)
    # Already in the local cache? Then no network is needed at all.
    model, _ = _attempt_pretrained(model_id, device, dtype, local_files_only=True)
    if model is not None:
        return model, None
    problem = hub_problem(model_id)  # not cached (or only partly): ask the hub
    if problem:
        return None, problem
    print(f"Downloading {model_id} from the HF hub (once; later runs use the cache)...")
    return _attempt_pretrained(model_id, device, dtype)


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
            model, reason = try_pretrained(args.model, device, dtype)
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


def train_step(model, optimizer, loss_fn, input_ids, labels):
    """One step: forward + loss, backward, AdamW update. Returns the loss (a tensor)."""
    with phase("forward"):
        loss = loss_fn(model, input_ids, labels)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # frees the gradients until next backward
    return loss.detach()


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


def run_training(args, model, loss_fn, optimizer):
    """The fine-tuning loop: ``loss_fn(model, input_ids, labels)`` and ``optimizer``
    at every step. Returns a dict of results (see write_json).

    Ctrl-C stops the loop between or inside a step: the results then hold the
    completed steps and ``partial`` is True (the caller writes them and exits 130).
    """
    device = next(model.parameters()).device
    batches = synthetic_batches(args.batch_size, args.seq_len, model.config.vocab_size, args.seed, device)
    tokens = args.batch_size * args.seq_len
    total = args.warmup_steps + args.steps
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the peak of training, weights included

    steps = []
    partial = False
    with exit_on_oom(args, "training", model):
        try:
            for i in range(total):
                input_ids, labels = next(batches)
                warmup = i < args.warmup_steps
                sync()  # time only this step's work, not what is still queued
                start = time.perf_counter()
                loss = train_step(model, optimizer, loss_fn, input_ids, labels)
                sync()
                seconds = time.perf_counter() - start
                steps.append({"step": i + 1, "loss": loss.item(), "time_s": seconds, "warmup": warmup})
                if (i + 1) % args.log_every == 0 or i + 1 == total or warmup:
                    tag = "  (warm-up, not timed)" if warmup else f"  {tokens / seconds:>10,.0f} tokens/s"
                    print(f"step {i + 1:>4}/{total}  loss {loss.item():.4f}  {seconds:8.3f} s{tag}", flush=True)
                if i == 0:
                    print_estimate(seconds, total - 1)
        except KeyboardInterrupt:
            partial = True  # keep what is done; the step in progress is lost

    timed = [s["time_s"] for s in steps if not s["warmup"]]
    peak_bytes, peak_kind = peak_memory()
    return {
        "partial": partial,
        "planned_steps": total,
        "steps": steps,
        "losses": [s["loss"] for s in steps],
        "step_times_s": [s["time_s"] for s in steps],
        "warmup_steps": args.warmup_steps,
        "timed_steps": len(timed),
        "tokens_per_step": tokens,
        # None (null in the JSON) when Ctrl-C came before the first timed step.
        "time_per_step_s": sum(timed) / len(timed) if timed else None,
        "tokens_per_sec": tokens * len(timed) / sum(timed) if timed else None,
        "peak_memory_bytes": peak_bytes,
        "peak_memory_kind": peak_kind,
        "final_loss": steps[-1]["loss"] if steps else None,
    }


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
    what it chose. Ctrl-C writes the completed steps (marked partial) and exits 130.
    """
    if args.json:
        args.json = check_output_path(args.json, "--json")  # now, not after minutes of training
    env = environment_info()
    print_banner(title, env)
    resolve_defaults(args)
    model, model_info = load_model(args)
    print(f"Batch:         {args.batch_size} x {args.seq_len} tokens, lr {args.lr:g}, seed {args.seed}")
    kernels = kernels_from_args(args)
    loss_fn, make_optimizer = switch_in(model, kernels)
    compile_decoder(model, args)
    optimizer = make_optimizer(model.parameters(), lr=args.lr)
    results = run_training(args, model, loss_fn, optimizer)
    results["kernels"] = kernels
    if results["partial"]:
        done = len(results["steps"])
        if args.json:
            write_json(args.json, script, args, env, model_info, results)
        where = f"wrote them to {args.json} (marked partial)" if args.json else "not written (no --json)"
        print(f"\nInterrupted: {done} of {results['planned_steps']} steps completed, {where}", flush=True)
        raise SystemExit(130)  # 128 + SIGINT, what a shell reports for Ctrl-C
    print_results(f"{title}: results", results)
    if args.json:
        write_json(args.json, script, args, env, model_info, results)
        print(f"Wrote {args.json}")
    return results
