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
* ``train_step`` / ``run_training``: forward, loss, backward, optimizer step, with
  NVTX ranges, synchronized timing, tokens/sec (all token slots and real tokens
  only), peak memory, out-of-memory advice and Ctrl-C handling (the completed
  steps are kept).
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
import itertools
import json
import os
import platform
import random
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
        help=f"tokens per sequence (default: 2048; --tiny: 128, or {CPU_TINY_SEQ_LEN} without a GPU)",
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
    g.add_argument("--lr", type=float, help="AdamW learning rate (default: 1e-5; --tiny: 1e-3)")
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each decoder layer in backward instead of storing its activations "
             "(HF's gradient_checkpointing_enable, non-reentrant): less memory, ~1/3 more compute",
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


# Defaults on a CPU, where the Triton kernels run in the interpreter (about 15 s
# per step of 2 x 128 tokens for the tiny model with every kernel): the default
# run of either fine-tune script then ends in about a minute on a 2-core laptop,
# with the loss visibly falling. 128 tokens, because without the model's own
# tokenizer every byte is a token (ByteTokenizer): room for a short prompt and
# its answer.
CPU_STEPS = 3
CPU_WARMUP_STEPS = 1  # no compilation, no autotuning: one step to allocate AdamW's state
CPU_TINY_SEQ_LEN = 128


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
    if getattr(args, "num_workers", 0) is None:
        # Workers build the next batches while the GPU trains; on a CPU they would
        # only compete with the training for the same cores.
        args.num_workers = 2 if on_gpu else 0
    if getattr(args, "dataset", None) == SYNTHETIC and getattr(args, "packing", False):
        note("--dataset synthetic has no examples to pack: every row is --seq-len random tokens; "
             "--packing changes nothing")
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
# --------------------------------------------------------------------------------
SYNTHETIC = "synthetic"  # --dataset synthetic: seeded random tokens, every slot real
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

    def __init__(self, examples, batch_size, seq_len, packing, seed, pad_id, endless=True):
        self.examples, self.batch_size, self.seq_len = examples, batch_size, seq_len
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
        return self.collate(self.rows(step * self.batch_size, self.batch_size))

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


def loader(dataset, steps, num_workers):
    """A DataLoader over batch indices ``steps``: worker processes build the batches
    ahead of the training step, in pinned host memory when there is a GPU (the
    copy to the GPU then needs no staging buffer and can be asynchronous)."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,  # each index is a whole batch already
        sampler=steps,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
    )


def training_batches(args, data, device, vocab_size, start_step=0):
    """The endless stream of training batches on ``device``, from step ``start_step``
    on (0-based): batch k is the same whether the stream started at 0 or at k."""
    if data is None:  # synthetic: the seeded generator, replayed up to start_step
        stream = (lm_batch(ids) for ids, _ in
                  synthetic_batches(args.batch_size, args.seq_len, vocab_size, args.seed, device))
        return itertools.islice(stream, start_step, None)
    dataset = StepBatches(data.train, args.batch_size, args.seq_len, args.packing, args.seed, data.pad_id)
    return (batch_to(batch, device) for batch in loader(dataset, itertools.count(start_step), args.num_workers))


def held_out_batches(args, data, device):
    """One pass over the held-out examples, in a fixed order, batched like the
    training data (empty for synthetic data or a set too small to hold any out)."""
    if data is None or not data.held_out:
        return iter(())
    dataset = StepBatches(data.held_out, args.batch_size, args.seq_len, args.packing, args.seed, data.pad_id,
                          endless=False)
    return (batch_to(batch, device) for batch in loader(dataset, range(dataset.num_batches()), args.num_workers))


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


def train_step(model, optimizer, loss_fn, batch):
    """One step: forward + loss, backward, AdamW update. Returns the loss (a tensor)."""
    with phase("forward"):
        loss = loss_fn(model, batch)
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


def run_training(args, model, loss_fn, optimizer, data=None, start_step=0):
    """The fine-tuning loop: ``loss_fn(model, batch)`` and ``optimizer`` at every
    step, on the batches of ``data`` (prepare_data; None: synthetic) from step
    ``start_step`` on. Returns a dict of results (see write_json).

    Throughput is counted two ways: ``tokens_per_sec``, every token slot the model
    computed (padding included), and ``real_tokens_per_sec``, the slots that hold
    real tokens of an example (prompt or response), not padding.
    ``padding_fraction``: the share of the slots of all steps run that is padding.

    Ctrl-C stops the loop between or inside a step: the results then hold the
    completed steps and ``partial`` is True (the caller writes them and exits 130).
    """
    device = next(model.parameters()).device
    batches = training_batches(args, data, device, model.config.vocab_size, start_step)
    total = args.warmup_steps + args.steps
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the peak of training, weights included

    steps = []
    partial = False
    with exit_on_oom(args, "training", model):
        try:
            for i in range(total):
                batch = next(batches)
                tokens = batch["num_tokens"]
                warmup = i < args.warmup_steps
                sync()  # time only this step's work, not what is still queued
                start = time.perf_counter()
                loss = train_step(model, optimizer, loss_fn, batch)
                sync()
                seconds = time.perf_counter() - start
                steps.append({"step": start_step + i + 1, "loss": loss.item(), "time_s": seconds, "warmup": warmup,
                              "tokens": tokens, "real_tokens": batch["num_real_tokens"]})
                if (i + 1) % args.log_every == 0 or i + 1 == total or warmup:
                    tag = "  (warm-up, not timed)" if warmup else f"  {tokens / seconds:>10,.0f} tokens/s"
                    step = f"{start_step + i + 1:>4}/{start_step + total}"
                    print(f"step {step}  loss {loss.item():.4f}  {seconds:8.3f} s{tag}", flush=True)
                if i == 0:
                    print_estimate(seconds, total - 1)
        except KeyboardInterrupt:
            partial = True  # keep what is done; the step in progress is lost

    timed = [s for s in steps if not s["warmup"]]
    timed_s = sum(s["time_s"] for s in timed)
    slots = sum(s["tokens"] for s in steps)
    peak_bytes, peak_kind = peak_memory()
    return {
        "partial": partial,
        "planned_steps": total,
        "steps": steps,
        "losses": [s["loss"] for s in steps],
        "step_times_s": [s["time_s"] for s in steps],
        "warmup_steps": args.warmup_steps,
        "timed_steps": len(timed),
        "tokens_per_step": slots / len(steps) if steps else None,  # the mean: padded batches vary
        # None (null in the JSON) when Ctrl-C came before the first timed step.
        "time_per_step_s": timed_s / len(timed) if timed else None,
        "tokens_per_sec": sum(s["tokens"] for s in timed) / timed_s if timed else None,
        "real_tokens_per_sec": sum(s["real_tokens"] for s in timed) / timed_s if timed else None,
        "padding_fraction": 1 - sum(s["real_tokens"] for s in steps) / slots if steps else None,
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
    print(f"Real tokens (no padding):   {results['real_tokens_per_sec']:,.0f} tokens/sec "
          f"(padding: {results['padding_fraction'] * 100:.1f}% of the token slots)")
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
    it returns ``(loss_fn, make_optimizer)``, a loss ``loss_fn(model, batch)``
    (a batch dict, see "Data") and an optimizer factory ``make_optimizer(params,
    lr)``, and prints what it chose. Ctrl-C writes the completed steps (marked partial) and exits 130.
    """
    if args.json:
        args.json = check_output_path(args.json, "--json")  # now, not after minutes of training
    env = environment_info()
    print_banner(title, env)
    resolve_defaults(args)
    records = load_records(args.dataset)  # a bad --dataset fails now, before the model is built
    model, model_info = load_model(args)
    data = prepare_data(args, records, model.config.vocab_size)
    print(f"Batch:         {args.batch_size} x {args.seq_len} tokens, lr {args.lr:g}, seed {args.seed}")
    kernels = kernels_from_args(args)
    loss_fn, make_optimizer = switch_in(model, kernels)
    optimizer = make_optimizer(model.parameters(), lr=args.lr)
    results = run_training(args, model, loss_fn, optimizer, data)
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
