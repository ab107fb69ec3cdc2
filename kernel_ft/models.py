"""
The model: which architecture, which weights, and what is wrapped around it
(LoRA adapters, torch.compile, gradient checkpointing).

README Step 2 (``--model``, ``--random-init``, ``--tiny``), Step 17 (``--compile``)
and Step 18 (``--lora``). What it teaches:

* ``load_model``: real weights through transformers (bf16 and SDPA attention on a
  GPU) from the HF cache, the hub or a local folder. When the weights cannot be had
  (no network, a gated repo, a missing path) or with ``--random-init``, random
  weights in the same architecture: the configs of LLaMA-3.1-8B and 70B are
  bundled, so throughput runs need no download and no hub account. The hub is
  asked once, with a short timeout, so an offline machine falls back in seconds
  instead of transformers' long retries. ``--tiny``: a 2-layer LLaMA in float32 for
  laptops and tests (the default without a GPU).
* ``apply_lora``: PEFT's LoRA adapters on the projections (``--lora-targets``); only
  the adapters train, so AdamW keeps state for a few million parameters instead of
  billions. ``--lora-4bit`` (QLoRA) loads the frozen weights in 4 bits.
* ``compile_decoder``: torch.compile of each decoder layer (``--compile``), and the
  CUDA-graph modes that remove the host's launch cost.
* ``enable_checkpointing``: recompute each decoder layer in backward instead of
  keeping its activations (``--gradient-checkpointing``).

This file imports no kernel: finetune_optimized.py swaps them into the model it
gets from here. Nothing runs on import.
"""

import contextlib
import os
import warnings

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)
from swap_common import (
    decoder_of, error_line, evaluating, probe_ids, sliding_layers, text_config, vocabulary_size,
)

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from kernel_ft import files, flags

HUB_TIMEOUT_S = 5  # how long we wait for huggingface.co before giving up on it


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


def qwen25_1_5b_config():
    """The architecture of Qwen/Qwen2.5-1.5B (its config.json, written as code): the
    small model of Step 20, where the host's time to queue a step shows."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
        tie_word_embeddings=True,  # the LM head is the embedding matrix
        bos_token_id=151643,
        eos_token_id=151643,
    )


def gemma2_2b_config():
    """google/gemma-2-2b (its config.json as code): the family benchmark of Step 16, with
    soft-capped attention (eager attention) and logits, GeGLU and (1 + w) RMSNorm."""
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256, sliding_window=4096,
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )


def phi3_mini_config():
    """microsoft/Phi-3-mini-4k-instruct (its config.json as code): one fused gate_up_proj
    per MLP, one qkv_proj per attention."""
    from transformers import Phi3Config

    return Phi3Config(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, hidden_act="silu", max_position_embeddings=4096,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=2047,
        tie_word_embeddings=False, pad_token_id=32000, bos_token_id=1, eos_token_id=32000,
    )


# Configs known without the hub, by hub id; a local folder with the same name counts too.
BUNDLED_CONFIGS = {flags.DEFAULT_MODEL: llama31_8b_config, "meta-llama/Llama-3.1-70B": llama31_70b_config,
                   "Qwen/Qwen2.5-1.5B": qwen25_1_5b_config, "google/gemma-2-2b": gemma2_2b_config,
                   "microsoft/Phi-3-mini-4k-instruct": phi3_mini_config}


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
# Loading: real weights from the hub or a folder, else random weights
# --------------------------------------------------------------------------------
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
        return f"cannot reach huggingface.co ({files.one_line(e)})"
    return None


def attention_for(config):
    """transformers' own choice, PyTorch's fused attention (SDPA) wherever the family
    supports it (None: asking for "sdpa" by name stops a family without it, Bloom), unless
    the family needs what SDPA cannot do: Gemma-2's attention logit soft-capping (tanh on
    the scores) runs only in HF's eager attention, in the baseline and here alike."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) else None


def avoid_per_shape_attention_plans(args, data):
    """Padded batches (--no-packing on real data) change their length every step.
    For each new length PyTorch's cuDNN attention backend builds a new execution
    plan on the host: 70-110 ms per forward and backward, and every few steps a
    step of about 3 s (an H100 profile, Step 20). Its other fused backends (flash,
    memory-efficient) have no such plans: for padded runs cuDNN's is switched off,
    in the baseline and the optimized script alike. Packed and synthetic batches
    keep one shape, so the plan is built once and cuDNN stays available."""
    if data is None or getattr(args, "packing", True) or not torch.cuda.is_available():
        return
    torch.backends.cuda.enable_cudnn_sdp(False)
    print("Attention:     PyTorch's cuDNN attention off (padded batches: it would plan anew for every length)")


def dense_mask_window(args, data, config, documents=None):
    """The sliding window that packed rows' dense [B, 1, T, T] mask must carry, or 0.

    HF applies a ready 4-D mask as given, to every layer: it replaces the sliding-window
    mask a layer would build itself. So where a layer's window is shorter than a row
    (an example of more than ``window`` tokens then loses keys in HF's own attention),
    the dense mask carries the window when every layer slides (Mistral, Phi-3), and
    packing with it is refused in one line when layers differ (Gemma-2 and -3 alternate
    sliding and full attention): no single mask is right for both. The attention
    kernel (--use-custom-attention) takes each layer's own window and needs none."""
    window, sliding = sliding_layers(config)
    documents = document_attention(args) if documents is None else documents
    if data is None or not getattr(args, "packing", False) or documents \
            or not window or args.seq_len <= window:
        return 0
    if not any(sliding):
        return 0
    if all(sliding):
        return window
    raise SystemExit(f"error: --packing with a dense mask: {config.model_type} mixes sliding-window ({window} tokens) "
                     f"and full attention layers, and HF applies one 4-D mask to every layer, so rows of "
                     f"{args.seq_len} tokens would train with the wrong attention in some of them; use --seq-len "
                     f"{window} or less, --no-packing, or --use-custom-attention (finetune_optimized.py)")


def _from_pretrained(model_id, device, dtype, **kwargs):
    # The config too from the cache alone when the weights are (local_files_only): else
    # transformers asks the hub for it, with ~23 s of retries where the hub cannot be reached.
    config = AutoConfig.from_pretrained(model_id, local_files_only=kwargs.get("local_files_only", False))
    return AutoModelForCausalLM.from_pretrained(
        model_id,
        dtype=dtype,
        attn_implementation=attention_for(config),
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
        return None, files.one_line(e)


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
            raise SystemExit(f"error: cannot use {model_id!r} ({why}config: {files.one_line(e)})") from None
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


def check_causal_lm(config, model_id):
    """Only causal language models are fine-tuned here (each position predicts the
    next token from the ones before it): an encoder (BERT), an encoder-decoder (T5)
    or any config transformers has no causal-LM class for is refused in one line."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = getattr(config, "model_type", type(config).__name__)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "is_encoder_decoder", False):
        raise SystemExit(f"error: --model {model_id}: a {kind} model is not a causal decoder (transformers has no "
                         f"causal-LM class for it); only decoder language models are fine-tuned here")
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < 2:
        raise SystemExit(f"error: --model {model_id}: a vocabulary of {vocab} token has nothing to predict "
                         f"(the loss is 0 whatever the weights)")


@torch.no_grad()
def check_causal(model, model_id):
    """The same rule, tested on the model itself: the output at a position must not
    change when a later token does. Encoders such as BERT have a causal-LM class in
    transformers but attend both ways unless configured as decoders; trained as
    one they would learn to copy the next token, not to predict it. Two forwards of
    3 tokens; skipped for a model on the meta device (--fsdp builds it there)."""
    if any(p.is_meta for p in model.parameters()):
        return
    try:
        with evaluating(model):  # no dropout: the two forwards differ only where the inputs do
            ids = probe_ids(model, next(model.parameters()).device)
            later = ids.clone()
            later[0, 2] = (ids[0, 2] + 1) % vocabulary_size(model)
            before = model(input_ids=ids).logits[0, :2].float()
            after = model(input_ids=later).logits[0, :2].float()
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        if is_out_of_memory(e):
            raise
        raise SystemExit(f"error: --model {model_id}: the model does not run a forward pass of 3 tokens "
                         f"({files.one_line(e)}); is its config consistent?") from None
    if not torch.allclose(before, after, rtol=1e-3, atol=1e-3 * before.abs().max().item()):
        raise SystemExit(f"error: --model {model_id}: not a causal decoder (the output at a position depends on "
                         f"the tokens after it); only decoder language models are fine-tuned here")


def check_seq_len(seq_len, config):
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise SystemExit(f"error: --seq-len {seq_len} is longer than the model's maximum of {max_pos} positions")


def build_random(config, device, dtype):
    """Random weights, created directly on ``device`` in ``dtype``, for training: no KV
    cache (with one, transformers attends across the documents of packed rows).

    Building 8B parameters in float32 on the CPU and then converting and copying
    them would take minutes and 32 GB of host memory; allocating them in bf16 on
    the GPU takes seconds.
    """
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention_for(config))
    no_kv_cache(model)
    return model


def no_kv_cache(model):
    """use_cache off, for training, where transformers reads it: the model's config and a
    multimodal model's text config (with a cache it attends across packed documents)."""
    for config in (model.config, text_config(model)):
        config.use_cache = False


def mask_dtype(model):
    """The dtype packed rows' dense mask takes for ``model``'s own attention: None (bool)
    for SDPA and the others that read a bool mask as one, the model's float dtype for
    transformers' eager attention, which adds a ready 4-D mask to the scores as it is."""
    if getattr(text_config(model), "_attn_implementation", None) != "eager":
        return None
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def document_attention(args):
    """Whether batches leave the attention mask out (the attention kernel reads the
    documents from the position ids) instead of carrying a dense [B, 1, T, T] one: the
    kernel asked for, or left at its default with packed real data (until the run finds
    it cannot go into the model: run.assemble)."""
    return bool(getattr(args, "packing", False)) and flags.kernels_from_args(args)["attention"] is not False


def is_out_of_memory(exc):
    """A GPU out-of-memory error, or a failed CPU allocation (a plain RuntimeError)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "DefaultCPUAllocator" in text)


def available_ram(field="MemAvailable"):
    """Bytes of host memory available to a new allocation (Linux: MemAvailable), or
    another field of /proc/meminfo (MemTotal: all of it), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_pad_token(config):
    """A pad_token_id past the vocabulary (as transformers' own defaults give with a small
    vocab_size) builds no model: torch's embedding asserts. Said in one line instead."""
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not -vocab <= pad < vocab:  # torch's padding_idx rule
        raise SystemExit(f"error: the model's config has pad_token_id {pad}, outside its vocabulary of {vocab} "
                         f"tokens; set pad_token_id in its config.json to a token id below {vocab}, or to null")


def meta_model(config):
    """``config``'s model built on the meta device: its shapes, no memory. A config that
    builds none ends the run in one line."""
    check_pad_token(config)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (AssertionError, ValueError, TypeError, IndexError) as e:
        raise SystemExit(f"error: the model's config ({type(config).__name__}) builds no model: {error_line(e)}") \
            from None


def parameter_count(config):
    """The number of parameters of ``config``'s model (built on the meta device)."""
    return sum(p.numel() for p in meta_model(config).parameters())


def weights_dtype(args, device):
    """bf16 is what LLaMA is trained in on GPUs; CPUs do float32 well and bf16 slowly.
    The tiny model is for learning and tests: float32 everywhere, so its losses can be
    compared to 1e-4 on any device."""
    return torch.bfloat16 if device.type == "cuda" and not args.tiny else torch.float32


def check_fits_in_ram(config, dtype, args):
    """On a CPU, refuse a run whose model and batch cannot fit in the host's memory, with
    the estimate, before anything is built: otherwise the OS kills the process without a
    word. A lower bound only: the weights, and for full fine-tuning their gradients and
    AdamW's two moments, plus the float32 logits HF's loss keeps with their gradient."""
    available = available_ram()
    if available is None:
        return
    weights = parameter_count(config) * dtype.itemsize
    state = 0 if getattr(args, "lora", False) else 3 * weights  # gradients, exp_avg, exp_avg_sq
    logits = 2 * 4 * args.batch_size * args.seq_len * vocabulary_size(config)
    need = weights + state + logits
    if need > available:
        gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731 - a local format
        raise SystemExit(f"error: this run needs at least {gib(need)} of host memory (weights {gib(weights)}, "
                         f"gradients and AdamW state {gib(state)}, logits of {args.batch_size} x {args.seq_len} "
                         f"tokens {gib(logits)}) and {gib(available)} is available on this CPU; use --tiny, a "
                         f"smaller --model, --lora, or a smaller --batch-size / --seq-len")


def enable_checkpointing(model):
    """HF's per-layer activation checkpointing, non-reentrant (transformers renamed the
    method in 5.2x: activation_checkpointing_enable; older releases only have the old name)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


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
        flags.note(f"--compile-mode {args.compile_mode} needs a GPU; compiling with the aot_eager backend")
    layers = decoder_of(model).layers
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
            compiled = torch.compile(_checkpointed(layer.forward), backend=backend, fullgraph=True, **options)
            layer.forward = _python_effects_once(compiled)
        else:
            layer.compile(backend=backend, fullgraph=True, **options)
    mode = f", mode {args.compile_mode}" if options else ""
    inside = ", checkpointing inside the graphs" if checkpointing else ""
    inside += ", FSDP's gathering outside them" if sharded else ""
    print(f"Compile:       {len(layers)} decoder layers with torch.compile (backend {backend}{mode}, fullgraph{inside}); "
          "compiled during the warm-up steps")
    return len(layers)


def _python_effects_once(compiled):
    """``compiled`` tracing with Dynamo's leave to run a checkpointed layer's Python side
    effects once, in forward, and not again in the backward's recomputation.

    Dynamo refuses to compile a checkpointed region that changes Python state from
    outside it, because eager checkpointing would repeat that change when it reruns
    the layer and a graph cannot. transformers 5.25's attention forwards make such a
    change on every call (the `kernels` package sets, then resets, a context variable
    naming the model's own RoPE wrapper), so a fullgraph compile with checkpointing
    stopped there, with our kernels or without. The change is undone before forward
    returns and only steers which function the trace sees, so not repeating it changes
    no number. Any other Python side effect of a layer's forward also runs once
    (an eager checkpointed layer runs it twice). Scoped to these calls (the tracing
    happens inside them); PyTorch releases without the option trace as before."""
    option = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    if not hasattr(torch._dynamo.config, option):
        return compiled
    return torch._dynamo.config.patch(**{option: True})(compiled)


def _checkpointed(forward):
    def checkpointed_forward(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpointed_forward


def load_model(args, world=None):
    """Build the model the flags ask for; return (model, info dict). Prints what it did.
    ``world``: --fsdp's process (fsdp.init_distributed), whose GPU the model goes to."""
    flags.require_settled(args, "models.load_model")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if world is not None:
        device = world.device  # --fsdp: this process's GPU (cuda:LOCAL_RANK)
    dtype = weights_dtype(args, device)
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
            if device.type == "cpu" and bundled_config(args.model):  # a known architecture: checked before loading
                check_fits_in_ram(bundled_config(args.model)(), dtype, args)
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
            check_causal_lm(config, args.model)
            check_seq_len(args.seq_len, config)  # before spending a minute building 8B parameters
            check_pad_token(config)
            if device.type == "cpu":
                check_fits_in_ram(config, dtype, args)
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
    no_kv_cache(model)  # training: no KV cache
    check_causal_lm(model.config, args.model)
    check_causal(model, args.model)

    info = describe(model, name, source, dtype, device)
    if getattr(args, "gradient_checkpointing", False):
        # Non-reentrant: it checks that the recomputation saves what the forward
        # saved, so a kernel swapped in for the forward only would be caught.
        enable_checkpointing(model)
        print("Checkpointing: each decoder layer is recomputed in backward (activations not stored)")
    return model, info


def describe(model, name, source, dtype, device):
    """The model's info dict for the JSON reports, and its two printed lines."""
    n_params = sum(p.numel() for p in model.parameters())
    info = {
        "name": name,
        "source": source,
        "architecture": type(model).__name__,
        "parameters": n_params,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "vocab_size": vocabulary_size(model),
        "max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
    }
    print(f"Model:         {name} [{type(model).__name__}], {source}")
    size = f"{n_params / 1e9:.2f} B" if n_params >= 1e9 else f"{n_params / 1e6:.1f} M"
    print(f"Parameters:    {n_params:,} ({size}), dtype {info['dtype']}, on {device}")
    return info


# --------------------------------------------------------------------------------
# LoRA (PEFT)
# --------------------------------------------------------------------------------
def check_lora_flags(args):
    """What --lora and --lora-4bit need, checked before anything is built."""
    if args.lora_4bit:
        if not flags.installed("bitsandbytes"):
            raise SystemExit("error: --lora-4bit needs bitsandbytes for the 4-bit weights: pip install bitsandbytes")
        if not torch.cuda.is_available():
            raise SystemExit("error: --lora-4bit needs a CUDA GPU (bitsandbytes' 4-bit kernels)")
        if args.tiny or args.random_init:
            raise SystemExit("error: --lora-4bit quantizes pretrained weights while loading them; "
                             "it cannot be used with --tiny or --random-init")
    if (args.lora or args.lora_4bit) and not flags.installed("peft"):
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


def lora_compute_dtype(model):
    """bf16/fp16 when ``model`` is a PEFT model whose adapters PEFT keeps in float32 on a
    bf16/fp16 base (its default); None otherwise (no LoRA, a float32 model, QLoRA)."""
    if not is_peft_model(model) or getattr(model, "is_loaded_in_4bit", False):
        return None
    base = model.get_input_embeddings().weight.dtype
    adapters = {p.dtype for p in trainable_parameters(model)}
    return base if base in (torch.bfloat16, torch.float16) and adapters == {torch.float32} else None


def adapters_compute_in(dtype, model, loss_fn):
    """LoRA's adapters computed in the base model's ``dtype``, kept in float32.

    PEFT stores the adapters in float32 on a bf16 model (small updates would vanish
    in bf16) and casts each adapted layer's input to float32 to match: per layer a
    float32 copy of its input, saved for backward, seven per decoder layer, so a
    float32 matrix product each and twice the activation memory of the bf16 ones.
    Instead: no input cast, and the forward under autocast, which casts each
    adapter's weights to ``dtype`` once per forward (tiny: r rows) and runs its
    products in ``dtype``. The gradients flow back through the cast into the float32
    weights, which the optimizer updates in float32, as mixed-precision training
    does (FSDP's MixedPrecisionPolicy does the same for --fsdp). Everything else in
    the model is already in ``dtype``: autocast leaves it alone.
    """
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):  # PEFT's adapted layers
            module.cast_input_dtype_enabled = False

    def loss_with_adapters_in_dtype(model, batch):
        with torch.autocast(batch["input_ids"].device.type, dtype=dtype):
            return loss_fn(model, batch)

    return loss_with_adapters_in_dtype
