"""
Shared pieces of the profile and fine-tune scripts: one model loader, one training
step, one training loop.

profile_baseline.py, finetune_baseline.py and finetune_optimized.py must measure
exactly the same work, or their numbers cannot be compared. So the work is written
once, here, and the scripts only choose flags and print results:

* ``add_model_args`` / ``add_finetune_args``: the flags every script shares.
* ``load_model``: real weights with transformers (bf16 + SDPA on GPU); random
  weights in the same architecture when the weights cannot be had (no network,
  gated model, missing path) or with ``--random-init``; ``--tiny`` for laptops and
  tests (the default without a GPU).
* ``apply_kernels``: swaps in the Triton kernels and returns the loss function.
* ``train_step`` / ``run_training``: forward, loss, backward, AdamW, with NVTX
  ranges, synchronized timing, tokens/sec and peak memory.

Without a GPU the Triton kernels run through Triton's interpreter on CPU tensors.
The interpreter is switched on by an environment variable that must be set before
``triton`` is first imported (transformers imports it too), hence the order of the
imports below: torch, then the variable, then everything else.

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

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
import triton  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig  # noqa: E402

from adamw_kernel import TritonAdamW  # noqa: E402
from cross_entropy_kernel import cross_entropy  # noqa: E402
from linear_cross_entropy_kernel import fused_linear_cross_entropy  # noqa: E402
from rmsnorm_kernel import replace_rmsnorm  # noqa: E402
from rope_kernel import patched_rope, rope_patch_targets  # noqa: E402
from swiglu_kernel import replace_swiglu  # noqa: E402

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
    with open(tmp, "w") as f:
        json.dump(strict_json(doc), f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


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
    g.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: 2048; --tiny: 128)")
    g.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: %(default)s)")
    g.add_argument("--lr", type=float, help="AdamW learning rate (default: 1e-5; --tiny: 1e-3)")
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


def add_finetune_args(parser):
    """Flags of the fine-tune scripts (the profile script has its own --steps)."""
    g = parser.add_argument_group("training loop")
    g.add_argument("--steps", type=positive_int, default=20, help="timed training steps (default: %(default)s)")
    g.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        default=2,
        help="untimed steps first: kernel compilation, cuBLAS autotuning (default: %(default)s)",
    )
    g.add_argument("--log-every", type=positive_int, default=1, help="a step line every N steps (default: %(default)s)")
    g.add_argument("--json", metavar="PATH", help="write config, environment, losses, times and memory here")
    return parser


def resolve_defaults(args):
    """Fill the defaults that depend on the hardware and on --tiny."""
    args.model = os.path.expanduser(args.model)
    if args.tiny is None:
        # A laptop cannot train 8B parameters; an explicit --model says the user means it.
        args.tiny = not torch.cuda.is_available() and args.model == DEFAULT_MODEL
    if args.seq_len is None:
        args.seq_len = 128 if args.tiny else 2048
    if args.lr is None:
        # Random tiny weights need a big step to show learning in a few steps;
        # 1e-5 is a usual full fine-tuning rate for a pretrained 8B model.
        args.lr = 1e-3 if args.tiny else 1e-5
    return args


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
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - any loading problem becomes the reason we print
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
    except torch.OutOfMemoryError:
        raise SystemExit(
            f"error: out of memory while loading {args.model} in {dtype} on {device}; "
            f"it needs 2 bytes per parameter on the GPU (use a smaller --model, or --tiny)"
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
    return model, info


# --------------------------------------------------------------------------------
# Kernels and the loss
# --------------------------------------------------------------------------------
def shift_labels(labels):
    """Targets for causal LM: position t predicts token t+1; the last position predicts nothing.

    [B, T] -> [B, T]: shifted left by one and padded with IGNORE_INDEX, so the loss
    can use the model's [B, T, V] logits whole (no slice, no .contiguous() copy of
    the largest tensor of the step). Only the small int64 labels are copied.
    """
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def hf_loss(model, input_ids, labels):
    """Baseline: the loss the way HF computes it (it shifts, upcasts the logits to fp32
    and calls F.cross_entropy, which builds the log-softmax)."""
    return model(input_ids=input_ids, labels=labels).loss


def triton_ce_loss(model, input_ids, labels):
    """The same shifted, ignore-index mean loss with the fused Triton cross-entropy."""
    logits = model(input_ids=input_ids).logits  # [B, T, V] in the model's dtype
    return cross_entropy(logits, shift_labels(labels), ignore_index=IGNORE_INDEX)


def triton_flce_loss(model, input_ids, labels):
    """The same loss with the LM head fused into it: the decoder's hidden states go
    straight into the fused linear cross-entropy, so no [B, T, V] logits exist."""
    hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state  # [B, T, H]
    weight = model.get_output_embeddings().weight  # [V, H], possibly tied to the embedding
    return fused_linear_cross_entropy(hidden, weight, shift_labels(labels), ignore_index=IGNORE_INDEX)


def _check_flce_head(model):
    """The fused loss computes hidden @ W.T: refuse heads that do more than that."""
    head = model.get_output_embeddings()
    extras = [a for a in ("final_logit_softcapping", "logit_scale") if getattr(model.config, a, None)]
    if head is None or not isinstance(head, torch.nn.Linear) or head.bias is not None or extras:
        raise SystemExit(
            f"error: --use-custom-flce needs an LM head that is a plain bias-free Linear "
            f"({type(model).__name__} has {type(head).__name__}{', ' + ', '.join(extras) if extras else ''}); "
            f"run with --no-use-custom-flce"
        )


def apply_kernels(model, kernels):
    """Patch ``model`` with the kernels switched on in ``kernels`` ({name: bool}, see
    KERNELS); return the loss function. Each kernel is one block: a module swap, or
    a different loss function."""
    active = []
    swaps = (
        ("rmsnorm", replace_rmsnorm, "RMSNorm modules", "TritonRMSNorm",
         "modules named *RMSNorm with weight and variance_epsilon"),
        ("swiglu", replace_swiglu, "LLaMA MLPs", "TritonLlamaMLP (fused SwiGLU)",
         "modules named *MLP with gate_proj, up_proj, down_proj and a SiLU act_fn"),
    )
    for name, replace, noun, new, looks_for in swaps:
        if not kernels.get(name):
            continue
        count = replace(model)
        if count == 0:
            raise SystemExit(
                f"error: --use-custom-{name} found no {noun} to replace in {type(model).__name__} "
                f"(it looks for {looks_for}); run without it"
            )
        label = f"Custom {name}:"
        print(f"{label:<14} replaced {count} {noun} with {new}")
        active.append(name)
    loss_fn = hf_loss
    if kernels.get("flce"):
        _check_flce_head(model)
        loss_fn = triton_flce_loss
        note = " (supersedes --use-custom-ce)" if kernels.get("ce") else ""
        print(f"Custom loss:   fused linear cross-entropy, LM head + loss in chunks, no logits{note}")
        active.append("flce")
    elif kernels.get("ce"):
        loss_fn = triton_ce_loss
        print("Custom loss:   Triton cross-entropy on the model's [B, T, V] logits (not copied)")
        active.append("ce")
    if kernels.get("rope"):
        # RoPE is a function HF's attention looks up by name, not a module: it is
        # swapped only while this model's forward runs (backward needs no patch).
        _, count = rope_patch_targets(model)
        if count == 0:
            raise SystemExit(
                f"error: --use-custom-rope found no attention modules using apply_rotary_pos_emb in "
                f"{type(model).__name__}; run without it"
            )
        print(f"Custom rope:   fused RoPE in {count} attention modules, during this model's forward")
        loss_fn = _with_rope(loss_fn)
        active.append("rope")
    if kernels.get("adamw"):
        print("Custom optim:  fused Triton AdamW step (same hyperparameters as torch.optim.AdamW)")
        active.append("adamw")  # the optimizer itself is built by make_optimizer
    active = [name for name in KERNELS if name in active]  # one order in every report
    print(f"Kernels:       {', '.join(active) if active else 'none (PyTorch / HF)'}")
    return loss_fn


def _with_rope(loss_fn):
    def loss_with_fused_rope(model, input_ids, labels):
        with patched_rope(model):
            return loss_fn(model, input_ids, labels)

    loss_with_fused_rope.__doc__ = f"{loss_fn.__name__} with the fused RoPE patched in during the forward."
    return loss_with_fused_rope


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


def make_optimizer(model, lr, use_triton=False):
    """AdamW with PyTorch's defaults (betas 0.9/0.999, eps 1e-8, weight decay 0.01).

    use_triton: the fused Triton step (adamw_kernel.py, one launch per tensor at
    ~96% of copy bandwidth). Otherwise PyTorch's fused=True: one kernel per step
    for all parameters instead of a dozen elementwise kernels per tensor (CUDA only).
    """
    if use_triton:
        return TritonAdamW(model.parameters(), lr=lr)
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=torch.cuda.is_available())


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


@contextlib.contextmanager
def exit_on_oom(args, what, model):
    """Turn an out-of-memory error into one line: what was attempted, what to reduce."""
    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError, so is a failed CPU allocation
        cpu_oom = "can't allocate memory" in str(e) or "DefaultCPUAllocator" in str(e)
        if not isinstance(e, torch.OutOfMemoryError) and not cpu_oom:
            raise
        where = "GPU" if isinstance(e, torch.OutOfMemoryError) else "CPU"
        name = "the tiny LLaMA" if args.tiny else args.model
        # Weights, gradients and AdamW's two moments: 4 tensors the size of the model,
        # before a single activation is stored.
        state_gib = sum(4 * p.numel() * p.element_size() for p in model.parameters()) / 2**30
        hint = "" if args.use_custom_flce else ", or add --use-custom-flce (no logits at all)"
        raise SystemExit(
            f"error: out of {where} memory while {what} {name} with batch {args.batch_size} x seq "
            f"{args.seq_len} ({args.batch_size * args.seq_len:,} tokens per step; weights, gradients "
            f"and AdamW state alone take {state_gib:.1f} GiB); reduce --batch-size or --seq-len{hint}"
        ) from None


def run_training(args, model, loss_fn):
    """The fine-tuning loop. Returns a dict of results (see write_json)."""
    device = next(model.parameters()).device
    optimizer = make_optimizer(model, args.lr, use_triton=args.use_custom_adamw)
    batches = synthetic_batches(args.batch_size, args.seq_len, model.config.vocab_size, args.seed, device)
    tokens = args.batch_size * args.seq_len
    total = args.warmup_steps + args.steps
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the peak of training, weights included

    steps = []
    with exit_on_oom(args, "training", model):
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

    timed = [s["time_s"] for s in steps if not s["warmup"]]
    peak_bytes, peak_kind = peak_memory()
    return {
        "steps": steps,
        "losses": [s["loss"] for s in steps],
        "step_times_s": [s["time_s"] for s in steps],
        "warmup_steps": args.warmup_steps,
        "timed_steps": len(timed),
        "tokens_per_step": tokens,
        "time_per_step_s": sum(timed) / len(timed),
        "tokens_per_sec": tokens * len(timed) / sum(timed),
        "peak_memory_bytes": peak_bytes,
        "peak_memory_kind": peak_kind,
        "final_loss": steps[-1]["loss"],
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
    """--json: everything needed to compare two runs later, in one file."""
    doc = {
        "script": script,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "environment": env,
        "model": model_info,
        **results,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"Wrote {path}")


def run_finetune(args, title, script):
    """Everything a fine-tune script does after parsing its flags."""
    resolve_defaults(args)
    env = environment_info()
    print_banner(title, env)
    model, model_info = load_model(args)
    print(f"Batch:         {args.batch_size} x {args.seq_len} tokens, lr {args.lr:g}, seed {args.seed}")
    kernels = kernels_from_args(args)
    loss_fn = apply_kernels(model, kernels)
    results = run_training(args, model, loss_fn)
    results["kernels"] = kernels
    print_results(f"{title}: results", results)
    if args.json:
        write_json(args.json, script, args, env, model_info, results)
    return results
