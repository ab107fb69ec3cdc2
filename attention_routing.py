"""
Step 21, in a model -- which of a Hugging Face model's attention calls the kernel takes.

attention_kernel.py computes causal attention inside the documents of packed rows.
This file puts it into a transformers model, as one attention function among the
model's own, and decides per call which one runs:

* ``hf_packed_attention``: the function HF's attention layers call under ``NAME``,
  with what they pass (q, k, v after RoPE, the position ids among the keyword
  arguments); it reads each token's document from the position ids.
* Before the switch, probes (``check_same_attention``, ``check_gradients_reach``,
  ``check_padding_is_routed``): the model's logits (a sequence classifier's last
  hidden states) and the reach of its attention parameters must be the same with
  ours, or the switch is refused in one line.
* At the decoder (``route_masked_calls``): a call with a padding mask, a KV cache
  (generate()), output_attentions, or position ids with use_cache on (transformers then
  reads no documents from them) goes to the model's own attention, with its mask;
  a recomputation by gradient checkpointing goes where its forward went; a model set
  to another attention after apply (set_attn_implementation) runs that one.
* Rows of one document (``plain_rows_to_theirs``): whichever attention is measured
  faster on this GPU for that shape.
* An image-text model (LLaVA, Qwen2-VL, ...): its text decoder only; the vision tower
  attends over its patches without a causal mask and keeps its own attention.

``use_packed_attention(model)`` does all of it; kernel_ft.apply calls it. Every
decision is taken from what a call carries (its arguments, never tensor values): no
host synchronization, so the step can still be one CUDA graph.

Nothing runs on import. tests/apply_test.py checks the routing and the choice.
"""

import contextlib
import inspect

import torch

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from swap_common import (
    SwapMismatch, additive_mask, decoder_of, error_line, gpu_clock, plain_causal_attention, probe_rounding, probing,
    CACHE_NAMES, our_forward, text_config, text_config_key, text_modules, vocabulary_size, warn_once, wrap_forward,
)
from attention_kernel import document_ends, document_starts, one_document_rows, packed_attention, visible_keys


# --------------------------------------------------------------------------------
# In a model: an attention function HF's layers call by name
# --------------------------------------------------------------------------------
# transformers looks each layer's attention up in AttentionInterface by the
# config's _attn_implementation; "sdpa" is torch's. We register ours under NAME:
# it takes what HF passes (q, k, v after RoPE, in [B, H, T, D]; the position ids
# among the keyword arguments). For a name with no mask function registered, HF
# builds no mask at all (and runs no host-side check of the position ids): the
# kernel reads each token's document from the position ids instead.
#
# So ours must only ever see calls that need no mask: causal rows of one or more
# documents, all of their keys in this call. A padding ``attention_mask`` (left or
# right), or a KV cache with earlier tokens in it (generate()'s decoding steps), is
# a call for the model's own attention. That decision is taken once per forward,
# at the decoder (``route_masked_calls`` below), from what the call carries (never
# from tensor values: no host synchronization, CUDA graphs stay possible).
NAME = "triton_packed"
# A call routed to the model's own attention (route_masked_calls) carries this keyword,
# the name of that attention, down to every layer: the decoder passes its keyword
# arguments on to each layer's attention function. Gradient checkpointing recomputes a
# layer in backward, after the decoder's forward has set the model back to NAME, so
# the recomputation calls ours, with the same arguments as the forward: the keyword
# says to run theirs again (same mask, same saved tensors), never ours without the mask.
# Rows of one document that the measurement gives to theirs (plain_rows_to_theirs) carry
# it too, with the model left at NAME: our function then calls theirs without a mask.
ROUTED = "kernel_ft_routed_to"
# A call without position ids that runs ours carries this keyword set to True: its rows hold one
# document each, which our function passes on as attention_kernel.one_document_rows (a broadcast
# zero the launcher reads without a host sync: such rows may take the Hopper forward). The model
# still hands the layers position ids it made itself (0 to T - 1): those say the same, but only
# by their values on the GPU.
ONE_DOCUMENT = "kernel_ft_one_document"
# A packed call (position ids, no mask) carries this keyword: a dict, empty at first, the same
# one for every layer of the call. The first layer leaves the documents' starts and ends there
# (document_starts, document_ends: a few small kernels each, two scans along the row) and the
# others read them: made once a call, not once a layer, also inside a CUDA graph capture (the
# dict is made in the captured call). What it buys: 18 kernels a layer in forward and backward,
# two of them scans along the row; the ends alone are 0.25 ms of the eager fwd+bwd of the 16K
# benchmark row of 133 documents on an H100, 1.27 against 1.02 ms (results/attention/gluon_h100/
# bounds_once/). Under torch.compile each layer makes its own (part of the compiler's graph).
DOCUMENTS = "kernel_ft_documents"


def attention_function(layer, name):
    """The attention function ``layer`` calls under the implementation ``name``: the
    registered one, or for "eager" (not registered) its family's own eager function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    for names in _eager_namespaces(layer):
        return names["eager_attention_forward"]
    raise ValueError(f"{NAME}: no attention function named {name!r} for {type(layer).__name__}")


def hf_packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function transformers calls under NAME (sdpa_attention_forward's signature)."""
    theirs = kwargs.pop(ROUTED, None)
    one_document = kwargs.pop(ONE_DOCUMENT, False)
    documents = kwargs.pop(DOCUMENTS, None)
    if theirs is not None:  # a recomputation of a routed call, or rows of one document measured faster there
        return attention_function(module, theirs)(module, query, key, value, attention_mask, scaling=scaling,
                                                  dropout=dropout, **kwargs)
    if attention_mask is not None:  # never ignored: a mask HF built reaches only the model's own attention
        raise ValueError(f"{NAME} attention got an attention mask {tuple(attention_mask.shape)}, which it cannot "
                         f"apply (a mask the model makes itself, or a masked call recomputed by gradient "
                         f"checkpointing in a decoder whose forward takes no keyword arguments to pass on)")
    if dropout:  # dropout set after the switch (apply refuses a model with it): the layer's own attention drops
        theirs = getattr(module, "_kernel_ft_theirs", None)
        if theirs is None:
            raise ValueError(f"{NAME} attention has no dropout (attention_dropout {dropout}); set it to 0")
        return attention_function(module, theirs)(module, query, key, value, attention_mask, scaling=scaling,
                                                  dropout=dropout, **kwargs)
    B, _, T, _ = query.shape
    if key.shape[2] != T:  # a KV cache: route_masked_calls sends such calls to the model's own attention
        raise ValueError(f"{NAME} attention got {T} queries for {key.shape[2]} keys (a KV cache); it computes "
                         f"causal rows whose keys are all in the call")
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as autocast runs SDPA: all three in its lower-precision dtype
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    positions = kwargs.get("position_ids")
    if positions is None or one_document:
        doc_start, doc_end = one_document_rows(B, T, query.device), None
    else:
        doc_start, doc_end = _document_bounds(positions.expand(B, T), documents)
    return packed_attention(query, key, value, doc_start, scaling, kwargs.get("sliding_window"),
                            kwargs.get("softcap"), doc_end), None


def _document_bounds(positions, documents):
    """(document starts, ends or None) of [B, T] position ids. ``documents``: the call's dict
    (DOCUMENTS), kept there for the next layers while their positions are these."""
    if documents is None or torch.compiler.is_compiling():
        return document_starts(positions), None  # the backward makes the ends
    key = (positions.data_ptr(), tuple(positions.shape), positions.stride(), positions._version)
    kept = documents.get("bounds")
    if kept is None or kept[0] != key:
        starts = document_starts(positions)
        kept = documents["bounds"] = (key, starts, document_ends(starts))
    return kept[1], kept[2]


# A family's attention may do more than softmax(scale q k^T) v (soft-capped scores,
# sliding windows, sink tokens, extra keyword arguments). So before the switch the
# model runs a packed probe row both ways: two examples of 5 and 3 tokens, with its
# own attention and the dense block mask, then with ours and only the position
# ids. The logits must agree to one rounding of the model's dtype; anything else,
# an error included, is a refusal in one line. In 16-bit weights two correct
# attentions drift apart through a deep model (a random 8B LLaMA's logits differ by
# ~0.1 between SDPA and eager): there the bound is also 4x the model's own drift,
# measured as the distance between its attention and HF's eager one on the same
# probe (eager is the reference implementation of every family). A family whose
# own attention is the eager one (Gemma-2: soft-capped scores) is measured against
# that same eager attention computed in float64: its own 16-bit rounding.
# The packed probe hands the model a causal block mask, so it cannot tell whether the
# model's own attention is causal: a second probe, one example with no mask and no
# position ids (what a plain call looks like), must agree too. A bidirectional
# encoder (BERT and its kin, which transformers also offers as causal LMs) sees every
# token there, and Doge adds a learned mask of its own where it is given none: both
# are refused.
PROBE_LENGTHS = (5, 3)


def _probe_ids(n, model, device):
    """n probe tokens: spread over the vocabulary, the same on every call."""
    return (torch.arange(n, device=device) * 7 + 1) % vocabulary_size(model)


def _per_token(model, **inputs):
    """What the probes compare: the model's output for every token of the call. That is
    a causal LM's logits [B, T, V]; a model whose head reads one token per row (a sequence
    classifier's logits are [B, labels]) is compared on its decoder's last hidden states."""
    logits = getattr(model(**inputs), "logits", None)
    if logits is not None and logits.dim() == 3 and logits.shape[:2] == inputs["input_ids"].shape:
        return logits
    return model(**inputs, output_hidden_states=True).hidden_states[-1]


def _attention_layers(model):
    """The attention modules of the model's text decoder (HF's classes are named
    *Attention); a multimodal model's vision tower is not among them (swap_common.text_modules)."""
    return (m for m in text_modules(model) if type(m).__name__.endswith("Attention"))


# Where configs keep the probability of dropping an attention weight in training
# (LLaMA and most decoders: attention_dropout; GPT-2-like: attn_pdrop).
DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")


def attention_dropout(model):
    """(p, where) of the largest attention-dropout probability p > 0 of the text config
    or its attention layers, or None. HF passes it to the attention function in training
    only."""
    config = text_config(model)
    found = [(getattr(config, key, None), f"config.{key}") for key in DROPOUT_KEYS]
    found += [(getattr(layer, "attention_dropout", None), f"{type(layer).__name__}.attention_dropout")
              for layer in _attention_layers(model)]
    found = [(float(p), where) for p, where in found if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0]
    return max(found, default=None)


def _set_attention(model, name):
    """The model's text decoder calls the attention ``name`` from now on. A multimodal
    model's other towers keep theirs: they attend over image patches without a causal
    mask, which ours would impose, and no probe here runs them."""
    key = text_config_key(model)
    model.set_attn_implementation(name if key is None else {key: name})


def _eager_namespaces(layer):
    """The globals in which ``layer``'s forward looks ``eager_attention_forward`` up
    (their python module's, or the copy fuse_rope gave them; behind a decorator, those
    of the function it wraps)."""
    ours = our_forward(layer.forward)  # fuse_rope's copy, run by the layer through swap_common.set_forward
    forward = ours.function if ours is not None else getattr(layer.forward, "__func__", layer.forward)
    for _ in range(5):  # through decorators (functools.wraps: __wrapped__) to the function that looks it up
        names = getattr(forward, "__globals__", {})
        if callable(names.get("eager_attention_forward")):
            yield names
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            break


@contextlib.contextmanager
def _eager_in_float64(model):
    """Within: the model's eager attention computes in float64 and rounds its output
    to the model's dtype. The layers look ``eager_attention_forward`` up by name in
    their forward's globals (_eager_namespaces), so it is swapped there. Yields False,
    changing nothing, where there is none."""
    spaces = {id(names): names for layer in _attention_layers(model) for names in _eager_namespaces(layer)}
    if not spaces:
        yield False
        return
    saved = [(names, names["eager_attention_forward"]) for names in spaces.values()]

    def in_float64(eager):
        def attention(layer, query, key, value, attention_mask, *args, **kwargs):
            mask = attention_mask
            if mask is not None and mask.is_floating_point():
                mask = mask.double()
            out, weights = eager(layer, query.double(), key.double(), value.double(), mask, *args, **kwargs)
            return out.to(query.dtype), weights
        return attention

    for names, eager in saved:
        names["eager_attention_forward"] = in_float64(eager)
    try:
        yield True
    finally:
        for names, eager in saved:
            names["eager_attention_forward"] = eager


@torch.no_grad()
def check_same_attention(model, theirs_name):
    """Raise SwapMismatch unless the model computes the same logits with NAME as with
    ``theirs_name`` (its attention before the switch) on the packed probe row."""
    weight = next(model.parameters())
    if weight.is_meta:
        return
    positions = torch.cat([torch.arange(n) for n in PROBE_LENGTHS])[None].to(weight.device)
    ids = _probe_ids(positions.shape[1], model, weight.device)[None]
    mask = visible_keys(document_starts(positions))[:, None]
    additive = additive_mask(mask, weight.dtype)  # eager adds its mask to the scores

    def logits(implementation, attention_mask):
        _set_attention(model, implementation)
        return _per_token(model, input_ids=ids, position_ids=positions, attention_mask=attention_mask).float()

    def plain_logits(implementation):  # one example, nothing but the tokens
        _set_attention(model, implementation)
        return _per_token(model, input_ids=ids[:, :PROBE_LENGTHS[0]]).float()

    drift = 0.0
    with probing(model):
        try:
            try:
                expected = logits(theirs_name, additive if theirs_name == "eager" else mask)
                plain_expected = plain_logits(theirs_name)
            except Exception as e:  # noqa: BLE001 - any failure of the model's own code: nothing to check against
                raise SwapMismatch(f"{type(model).__name__}'s own attention does not run a packed row (position ids "
                                   f"and a 4-D block mask), so ours cannot be checked against it "
                                   f"({error_line(e)})") from None
            if weight.dtype != torch.float32 and theirs_name != "eager":
                drift = (logits("eager", additive) - expected).abs().max().item()
            elif weight.dtype != torch.float32:
                with _eager_in_float64(model) as wide:
                    if wide:
                        drift = (logits("eager", additive) - expected).abs().max().item()
            _set_attention(model, NAME)
            try:
                got = _per_token(model, input_ids=ids, position_ids=positions).float()
                plain_got = plain_logits(NAME)
            except (ValueError, TypeError, RuntimeError) as e:
                raise SwapMismatch(f"{type(model).__name__}'s attention cannot run as {NAME} "
                                   f"({error_line(e)})") from None
        except SwapMismatch:
            _set_attention(model, theirs_name)
            raise
    rounding = probe_rounding(weight.dtype)

    def close(ours, theirs):
        return torch.allclose(ours, theirs, rtol=rounding, atol=max(rounding * theirs.abs().max().item(), 4 * drift))

    if not close(plain_got, plain_expected):
        _set_attention(model, theirs_name)
        raise SwapMismatch(f"{type(model).__name__}'s own attention on a row without a mask is not causal "
                           f"softmax(scale q k^T) v (bidirectional, or a mask of its own; max logit difference "
                           f"{(plain_got - plain_expected).abs().max().item():.2g}), which is all the kernel computes")
    if not close(got, expected):
        _set_attention(model, theirs_name)
        raise SwapMismatch(f"{type(model).__name__}'s attention computes something else than softmax(scale q k^T) v "
                           f"within each example (max logit difference {(got - expected).abs().max().item():.2g}, "
                           f"its own two implementations differ by {drift:.2g})")


# Same logits are not enough: a parameter that shapes the scores through a mask of the
# layer's own (Doge's learned mask, whose parameter starts at zero, so that the mask is
# flat and the logits agree) is dropped by the kernel, which takes no mask, and would
# never train. The first attention layer's trainable parameters must reach the loss
# through ours wherever they reach it through theirs. Reaching is read off the autograd
# graph of one forward (the AccumulateGrad nodes it leads to): no backward to run.
def _reaching(model, implementation):
    """Names of the first attention layer's trainable parameters that the plain probe
    row's logits depend on with ``implementation``."""
    layer = next(_attention_layers(model), None)
    params = {} if layer is None else {id(p): n for n, p in layer.named_parameters() if p.requires_grad}
    weight = None if layer is None else next(layer.parameters())
    if not params or weight.is_meta:
        return set()
    ids = _probe_ids(PROBE_LENGTHS[0], model, weight.device)[None]
    _set_attention(model, implementation)
    with torch.enable_grad():
        # The output stays referenced while its graph is walked: a custom Function's node (our RMSNorm's, where a
        # classifier's walk starts at the normed hidden states) is reachable only while the tensors it made live.
        output = _per_token(model, input_ids=ids)
        nodes, seen, found = [output.grad_fn], set(), set()
        while nodes:
            node = nodes.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf tensor
            if variable is not None and id(variable) in params:
                found.add(params[id(variable)])
            nodes.extend(next_node for next_node, _ in node.next_functions)
    return found


def check_gradients_reach(model, theirs_name):
    """Raise SwapMismatch unless every attention parameter that the model's own attention
    trains is trained through ours too; the model is left on ``theirs_name``."""
    with probing(model):
        try:
            lost = _reaching(model, theirs_name) - _reaching(model, NAME)
        except (ValueError, TypeError, RuntimeError) as e:
            lost = {f"(the gradient probe failed: {error_line(e)})"}
        finally:
            _set_attention(model, theirs_name)
    if lost:
        raise SwapMismatch(f"{type(model).__name__}'s attention parameters {', '.join(sorted(lost))} reach the loss "
                           f"through its own attention and not through the kernel (a mask of its own, which the kernel "
                           f"does not take)")


def _cached(decoder, arguments):
    """Whether the call's keys are not all its own tokens: a cache holding earlier tokens,
    or one whose keys are preallocated (a StaticCache hands each layer keys as long as
    its capacity, prefill included). Only an empty DynamicCache grows with the call.
    (transformers 5.24 renamed the argument ``past_key_values`` to ``cache`` and still
    takes the old name through **kwargs; either may come.)"""
    from transformers import DynamicCache

    cache = _argument(decoder, arguments, *CACHE_NAMES)
    if cache is None or not hasattr(cache, "get_seq_length"):
        return False
    return not isinstance(cache, DynamicCache) or cache.get_seq_length() > 0


def _argument(decoder, arguments, *names):
    """The first of ``names`` the call passed, by name or through **kwargs, or None."""
    extra = arguments.get(decoder._kernel_ft_var_keyword) or {}  # what came in through **kwargs
    return next((v for where in (arguments, extra) for v in map(where.get, names) if v is not None), None)


def _cache_hides_documents(decoder, arguments):
    """Whether transformers would attend across the documents of this call's rows: it
    reads documents from the position ids only where no cache exists when it builds the
    mask, and a decoder makes an empty DynamicCache itself whenever use_cache is on (the
    config's default, in training too), except where it turns use_cache off itself: a
    training call with gradients under gradient checkpointing. Such a call runs the model's
    own attention, which gives what transformers gives, whichever way the family decides.
    TRL passes use_cache=False, Trainer and our scripts set it in the config: there packed
    rows run ours, one document at a time."""
    if arguments.get("position_ids") is None:
        return False  # no documents to read: one per row, either way
    use_cache = _argument(decoder, arguments, "use_cache")
    if use_cache is None:
        use_cache = getattr(decoder.config, "use_cache", False)
    training = decoder.training and torch.is_grad_enabled()
    if training and getattr(decoder, "gradient_checkpointing", False):
        use_cache = False  # transformers' rule (without gradients its releases differ: theirs runs then)
    if not (use_cache or _argument(decoder, arguments, *CACHE_NAMES) is not None):
        return False
    if training:
        warn_once("use_cache in training", "kernel_ft: a training call with position ids and use_cache on: "
                  "transformers then keeps a KV cache and attends across the documents of packed rows, so the "
                  "model's own attention runs. Set use_cache = False in the decoder's config (model.config; "
                  "a multimodal model's model.config.text_config) or pass use_cache=False to train packed rows "
                  "with the kernel, each document attending only to itself.", stacklevel=3)
    return True


def _weights_asked(decoder, arguments):
    """Whether the call asks for the attention weights (output_attentions), which ours never
    forms: the model's own attention returns them. (transformers refuses the flag in the
    config under any implementation but eager.)"""
    return bool(_argument(decoder, arguments, "output_attentions"))


def decoder_forward_routed(decoder, *args, **kwargs):
    """The decoder's forward: ours for unmasked calls without a KV cache, a request for the
    attention weights or position ids that a cache would hide (_cache_hides_documents), the
    model's own attention (kept in ``_kernel_ft_theirs``) for the others, and for rows of
    one document where it is measured to be faster (plain_rows_to_theirs)."""
    config = getattr(decoder, "config", None)  # (none: not a decoder; check_padding_is_routed says so)
    if config is None or config._attn_implementation != NAME:  # set_attn_implementation after apply: that runs
        return decoder._kernel_ft_attention_forward(*args, **kwargs)
    arguments = decoder._kernel_ft_signature.bind(*args, **kwargs).arguments
    plain = not (_cached(decoder, arguments) or _weights_asked(decoder, arguments)
                 or _cache_hides_documents(decoder, arguments))
    if arguments.get("attention_mask") is None and plain:
        if decoder._kernel_ft_passes_keywords and plain_rows_to_theirs(decoder, arguments):
            # Theirs through hf_packed_attention, with no mask: what such rows get from it
            # (SDPA's causal flag). HF builds none under NAME, also inside a CUDA graph
            # capture, where it would build a dense one for SDPA (cuda_graphs.py).
            kwargs[ROUTED] = decoder._kernel_ft_theirs
        elif decoder._kernel_ft_passes_keywords and arguments.get("position_ids") is None:
            kwargs[ONE_DOCUMENT] = True
        elif decoder._kernel_ft_passes_keywords:
            kwargs[DOCUMENTS] = {}
        return decoder._kernel_ft_attention_forward(*args, **kwargs)
    theirs = decoder._kernel_ft_theirs
    if decoder._kernel_ft_passes_keywords:  # down to the layers, for their recomputation (ROUTED above)
        kwargs[ROUTED] = theirs
    config._attn_implementation = theirs  # read by every layer and by HF's mask builders
    try:
        return decoder._kernel_ft_attention_forward(*args, **kwargs)
    finally:
        config._attn_implementation = NAME


def route_masked_calls(model, theirs):
    """Send the calls of ``model``'s decoder that carry an attention mask or earlier
    cached tokens to its attention before the switch, ``theirs``; the others to ours."""
    decoder = decoder_of(model)
    decoder._kernel_ft_theirs = theirs
    decoder._kernel_ft_signature = inspect.signature(decoder.forward)
    decoder._kernel_ft_var_keyword = next((p.name for p in decoder._kernel_ft_signature.parameters.values()
                                           if p.kind is p.VAR_KEYWORD), None)
    decoder._kernel_ft_passes_keywords = decoder._kernel_ft_var_keyword is not None
    # For the measured choice (plain_rows_to_theirs), once: the first attention layer, and
    # the shortest window a layer keeps as its own attribute (0: none).
    windows = [w for m in _attention_layers(decoder) if (w := getattr(m, "sliding_window", None) or 0)]
    decoder._kernel_ft_plain_rows = next(_attention_layers(decoder), None), min(windows, default=0)
    wrap_forward(decoder, "_kernel_ft_attention_forward", decoder_forward_routed)


# --------------------------------------------------------------------------------
# Rows of one document: ours or the model's own, measured on this GPU
# --------------------------------------------------------------------------------
# A call without position ids holds one document per row: a plain causal row, which
# SDPA runs through its own causal kernels (cuDNN's on Hopper, FlashAttention-2's on
# others) without any mask. There ours skips nothing that theirs computes, so which
# is faster depends on the GPU, the head dim and the length (on an H200, 8,192 tokens
# of 32 heads of 128: cuDNN 3.81 ms fwd+bwd, ours 4.87). So the first such call of
# each shape times both on this device, fwd+bwd on random rows of that shape, and
# keeps the faster for every later call of the shape. Calls with position ids (packed
# rows: ours skips the pairs across documents, 3-50x fewer than the dense mask SDPA
# needs) and layers that slide a window shorter than the row (SDPA needs a dense mask
# there too) stay ours without a measurement, as does the model's own eager attention
# (the T x T scores in memory: Gemma-2). Nothing is measured in Triton's interpreter
# (no speed to compare), without gradients (generate()), inside a CUDA graph capture
# or a torch.compile trace: there a shape not measured yet runs ours.
# (device, dtype, B, T, Hq, Hkv, D, theirs) -> (theirs is faster, ours ms, theirs ms, why not measured or None)
PLAIN_ROW_CHOICES = {}
MEASURED_DEVICES = ("cuda",)  # not the CPU: Triton's interpreter has no speed to compare
# The model's own attentions that compute causal attention when given no mask (SDPA's
# is_causal flag, flash-attn's causal flag); FlexAttention without a block mask, say, is
# bidirectional: those stay ours.
CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")
MAX_MEASURED_SHAPES = 16  # past this many, a new shape takes the choice of the measured one nearest in tokens
MEASURE_REPEATS = 5
CHOICE_LISTENERS = []  # callables given each choice's line once (the scripts print it)


def _plain_row_key(decoder, arguments):
    """The key of this call's rows in PLAIN_ROW_CHOICES, with the attention layer that
    takes them, or None where no measurement applies (see above)."""
    if arguments.get("position_ids") is not None or decoder._kernel_ft_theirs not in CAUSAL_WITHOUT_MASK:
        return None
    ids = arguments.get("input_ids")
    ids = arguments.get("inputs_embeds") if ids is None else ids
    layer, window = decoder._kernel_ft_plain_rows
    if ids is None or ids.dim() < 2 or ids.device.type not in MEASURED_DEVICES or layer is None:
        return None
    B, T = ids.shape[:2]
    config = decoder.config
    if 0 < window < T or not plain_causal_attention(config, T):  # a window shorter than the row, chunks
        return None
    where = ids.device.type
    embeds = arguments.get("inputs_embeds")  # q, k, v come out of the layers in the hidden states' dtype
    dtype = embeds.dtype if embeds is not None else decoder.get_input_embeddings().weight.dtype
    dtype = torch.get_autocast_dtype(where) if torch.is_autocast_enabled(where) else dtype
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(layer, "head_dim", None) or config.hidden_size // heads
    return (str(ids.device), dtype, B, T, heads, kv_heads, head_dim, decoder._kernel_ft_theirs), layer


def plain_rows_to_theirs(decoder, arguments):
    """Whether this unmasked call's rows of one document run the model's own attention:
    measured faster than ours on this device for this shape (see above)."""
    found = _plain_row_key(decoder, arguments)
    if found is None:
        return False
    key, layer = found
    if key in PLAIN_ROW_CHOICES:
        return PLAIN_ROW_CHOICES[key][0]
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or capturing:
        return False
    if len(PLAIN_ROW_CHOICES) >= MAX_MEASURED_SHAPES:
        def distance(k):  # another layout of heads or dtype last, then the difference in tokens
            return k[:2] + k[4:] != key[:2] + key[4:], abs(k[2] * k[3] - key[2] * key[3])
        return PLAIN_ROW_CHOICES[min(PLAIN_ROW_CHOICES, key=distance)][0]
    failed = None
    try:
        ours_ms, theirs_ms = time_plain_rows(layer, key)
    except Exception as e:  # noqa: BLE001 - out of memory for the random rows, say: ours, as without the choice
        failed, ours_ms, theirs_ms = error_line(e), float("nan"), float("nan")
    if failed and torch.cuda.is_available():
        torch.cuda.empty_cache()  # outside the handler: the traceback no longer holds the random rows
    PLAIN_ROW_CHOICES[key] = (theirs_ms < ours_ms, ours_ms, theirs_ms, failed)
    for listener in CHOICE_LISTENERS:
        listener(choice_line(key))
    return PLAIN_ROW_CHOICES[key][0]


def choice_line(key):
    """One line saying what a measured shape runs, and why."""
    theirs_faster, ours_ms, theirs_ms, failed = PLAIN_ROW_CHOICES[key]
    _, dtype, B, T, heads, kv_heads, head_dim, theirs = key
    kept = f"the model's own ({theirs})" if theirs_faster else "ours"
    measured = (f"not measured ({failed})" if failed else
                f"measured fwd+bwd per layer: ours {ours_ms:.3f} ms, {theirs} {theirs_ms:.3f} ms")
    return (f"rows of one document, {B} x {T:,} tokens, {heads}/{kv_heads} heads of {head_dim}, "
            f"{str(dtype).replace('torch.', '')}: {kept}, {measured}")


def time_plain_rows(layer, key, repeats=MEASURE_REPEATS, clock=None):
    """(ours ms, theirs ms): median of ``repeats`` fwd+bwd calls of each attention on
    random rows of ``key``'s shape, through ``layer`` (its scaling, heads, causality),
    one of each in turn after a first call each (compilation, caches). The rows are laid
    out as a decoder layer's projections give them (q, k, v [B, h, T, D] transposed views
    of [B, T, h, D]): both kernels' speeds depend on it (H100, 16,384 tokens of 32 / 8
    heads of 128: cuDNN 13.93 ms contiguous, 14.06 so; ours 15.16 and 14.68). ``clock``: a
    function timing one call in ms (default: swap_common.gpu_clock's CUDA events)."""
    device, dtype, B, T, heads, kv_heads, head_dim, theirs = key
    generator = torch.Generator(device=device).manual_seed(0)  # not the run's random stream

    def rows(h):  # in the layout a decoder layer hands attention: a transposed view of [B, T, h, D]
        x = torch.randn(B, T, h, head_dim, generator=generator, device=device, dtype=dtype)
        return x.transpose(1, 2).requires_grad_()

    q, k, v = rows(heads), rows(kv_heads), rows(kv_heads)
    upstream = torch.randn(B, T, heads, head_dim, generator=generator, device=device, dtype=dtype)
    scaling = getattr(layer, "scaling", None)
    calls = {
        "ours": lambda: hf_packed_attention(layer, q, k, v, None, scaling=scaling)[0],
        "theirs": lambda: attention_function(layer, theirs)(layer, q, k, v, None, scaling=scaling, dropout=0.0)[0],
    }

    def once(name):
        q.grad = k.grad = v.grad = None
        calls[name]().backward(upstream)

    clock = clock or (lambda call: gpu_clock(call)[1])
    # The measurement runs inside the user's forward: whatever saved-tensor hooks wrap it
    # (activation offloading to the CPU, a memory count) must neither see nor slow its
    # tensors. Only the innermost pair of hooks applies: this one keeps tensors as they are.
    with torch.autograd.graph.saved_tensors_hooks(_as_it_is, _as_it_is):
        for name in calls:
            once(name)
        times = {name: [] for name in calls}
        for _ in range(repeats):
            for name in calls:
                times[name].append(clock(lambda: once(name)))
    return tuple(sorted(t)[len(t) // 2] for t in (times["ours"], times["theirs"]))


def _as_it_is(t):
    return t


def use_packed_attention(model):
    """Make ``model``'s attention layers call ours (registered once under NAME), after
    checking that it computes what theirs does (check_same_attention), with calls that
    carry a padding mask or a KV cache routed to theirs (route_masked_calls); return
    the number of attention layers. Calling it again changes nothing."""
    from transformers import AttentionInterface

    count = sum(1 for _ in _attention_layers(model))
    theirs = text_config(model)._attn_implementation
    if theirs == NAME:
        return count
    AttentionInterface.register(NAME, hf_packed_attention)
    try:
        padded = _padded_logits(model)  # the model's own, before the switch
    except Exception as e:  # noqa: BLE001 - its own attention cannot take a padded row: nothing to check against
        raise SwapMismatch(f"{type(model).__name__}'s own attention does not run a left-padded row "
                           f"({error_line(e)})") from None
    check_same_attention(model, theirs)
    check_gradients_reach(model, theirs)
    # Last: where the kernel could not compute the model's attention anyway, that is the line to say.
    dropout = attention_dropout(model)
    if dropout:
        raise SwapMismatch(f"{type(model).__name__}'s attention drops probabilities in training ({dropout[1]} = "
                           f"{dropout[0]:g}), which the kernel does not: set it to 0 to use the kernel")
    _set_attention(model, NAME)
    for layer in _attention_layers(model):
        layer._kernel_ft_theirs = theirs  # for a call with dropout (hf_packed_attention)
    route_masked_calls(model, theirs)
    check_padding_is_routed(model, theirs, padded)
    return count


# A padding mask must reach the model's own attention. The routing wraps the decoder's
# forward, so a family whose causal LM does not call that module (ModernBERT's decoder)
# would run ours on a padded row, its mask unseen: the last check runs a left-padded
# probe through the switched model and compares it with the model's own logits.
@torch.no_grad()
def _padded_logits(model):
    weight = next(model.parameters())
    if weight.is_meta:
        return None
    ids = _probe_ids(2 * PROBE_LENGTHS[0], model, weight.device).view(2, -1)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    with probing(model):
        return _per_token(model, input_ids=ids, attention_mask=mask).float()[mask.bool()]


def _undo_switch(model, theirs):
    decoder = decoder_of(model)
    for name in ("forward", "_kernel_ft_attention_forward"):
        decoder.__dict__.pop(name, None)
    _set_attention(model, theirs)


def check_padding_is_routed(model, theirs, expected):
    """Undo the switch and raise SwapMismatch unless a padded row gives ``expected``."""
    if expected is None:
        return
    try:
        got = _padded_logits(model)
    except Exception as e:  # noqa: BLE001 - the model's own attention ran this row before the switch
        _undo_switch(model, theirs)
        raise SwapMismatch(f"{type(model).__name__}: a row with a padding mask fails once switched "
                           f"({error_line(e)})") from None
    rounding = probe_rounding(next(model.parameters()).dtype)
    if not torch.allclose(got, expected, rtol=rounding, atol=rounding * expected.abs().max().item()):
        _undo_switch(model, theirs)
        raise SwapMismatch(f"{type(model).__name__}: a row with a padding mask does not reach the model's own "
                           f"attention through its decoder's forward (max logit difference "
                           f"{(got - expected).abs().max().item():.2g}); the kernel would ignore the mask")
