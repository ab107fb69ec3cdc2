"""
What every kernel's model patching shares: read it after kernel_common.py.

Each kernel file ends with the code that puts its kernel into a Hugging Face model
(``replace_rmsnorm``, ``fuse_rope``, ``use_packed_attention``, ...). Those swaps ask
the same questions of a model, and the answers live here, once:

* ``SwapMismatch``: the refusal. A kernel goes in only where a probe shows that it
  computes what the model's own module computes; ``probe_ids``, ``evaluating``,
  ``probing`` and ``probe_rounding`` are what the probes run with and compare by.
* Finding the parts: ``decoder_of`` (the decoder under the LM head), ``text_config``
  and ``text_modules`` (a multimodal model's text decoder, without its vision
  tower), ``vocabulary_size``, ``sliding_layers`` and ``plain_causal_attention``
  (which masks the attention layers use, from the config alone); ``additive_mask``
  (a bool mask in the form transformers' eager attention adds to the scores).
* Replacing: ``swap_modules`` (modules), ``wrap_forward``, ``set_forward`` and
  ``InstanceForward`` (one module's forward, in a form that deep copies and
  ``torch.save`` keep, and that torch.compile compiles once for all layers);
  ``called_plainly``: whether a layer may run inside a larger kernel uncalled.
* The FP8 layers' choice: ``fp8_supported`` and ``linears_to_cast``, shared with the
  flags' check and the torchao peer, which import no kernel.
* ``loss_only``: evaluation calls that skip the logits (kernel_ft.loss_only).

No kernels here: this file is about models. It imports kernel_common first only for the
interpreter switch, so that it is safe to import before anything else.
"""

import contextlib
import functools
import inspect
import types
import warnings

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)
import torch


class SwapMismatch(ValueError):
    """A module (or function) of a model that a kernel would replace computes
    something else than the kernel: the swap is refused, never made silently.
    Decoder families reuse names (every one has an ``*RMSNorm`` and an
    ``apply_rotary_pos_emb``) for math that differs (an offset weight, another
    cast order, other rotated pairs), and a tiny random model trains almost alike
    either way, so a name alone proves nothing."""


def vocabulary_size(model_or_config):
    """How many token ids a model takes: its config's ``vocab_size``, or its text config's
    (a multimodal config such as Fuyu's keeps it there and has none of its own)."""
    config = getattr(model_or_config, "config", model_or_config)
    size = getattr(config, "vocab_size", None)
    return size if size is not None else config.get_text_config().vocab_size


def probe_ids(model, device):
    """The three tokens the swaps' probes run a model on: [[1, 2, 3]] (modulo its vocabulary)."""
    return torch.tensor([[1, 2, 3]], device=device) % vocabulary_size(model)


@contextlib.contextmanager
def evaluating(model):
    """Within: ``model`` in eval mode (no dropout), its own mode restored after, also
    when the block raises. The swaps' probes and the evaluation run in it."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


# kernel_ft.loss_only(): evaluation calls of a model with the fused loss skip the logits
# too (linear_cross_entropy_kernel reads it); here, so that the loop uses it without
# importing a kernel.
_LOSS_ONLY = []


@contextlib.contextmanager
def loss_only():
    """Within: a fused model's evaluation calls with labels compute the loss without
    logits too (``with kernel_ft.loss_only(): trainer.evaluate()``, no compute_metrics)."""
    _LOSS_ONLY.append(True)
    try:
        yield
    finally:
        _LOSS_ONLY.pop()


def losses_only():
    """Whether a loss_only() block is open."""
    return bool(_LOSS_ONLY)


@contextlib.contextmanager
def probing(model):
    """``evaluating``, and in the configs an MoE's ``output_router_logits`` and
    ``use_cache`` off: a swap's probe compares what the model computes with and without a
    kernel, and the router's auxiliary loss (added after the loss function, from router
    logits that no 4-D probe mask fits) is neither; with a cache, transformers would not
    read the probe's documents from its position ids (training runs without one).
    Restored after."""
    switched = [(c, key) for c in {id(c): c for c in (model.config, text_config(model))}.values()
                for key in ("output_router_logits", "use_cache") if getattr(c, key, False)]
    for config, key in switched:
        setattr(config, key, False)
    try:
        with evaluating(model):
            yield model
    finally:
        for config, key in switched:
            setattr(config, key, True)


def gpu_clock(run):
    """(run(), milliseconds on the GPU's clock from before its first kernel to after its
    last, by CUDA events around it): when Python queues slower than the GPU runs, the
    wait is in it too."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = run()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end)


# The attention layers' masks from the config alone (the fine-tune scripts, the CUDA
# graphs and the attention kernel's routing ask the same question).
def sliding_layers(config):
    """(window, [whether layer i attends through it]): a sliding window of ``window``
    keys (0: none) in the layers that slide; without ``layer_types`` every layer does."""
    window = getattr(config, "sliding_window", None) or 0
    if not window:
        return 0, [False] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return window, [t == "sliding_attention" for t in types]


def plain_causal_attention(config, seq_len):
    """Whether every layer of this model attends causally to all earlier tokens of a
    row of ``seq_len`` tokens: no window shorter than the row, no chunked attention,
    a decoder (``is_causal``). Then SDPA's is_causal flag is every layer's mask."""
    window, sliding = sliding_layers(config)
    if window and seq_len > window and any(sliding):
        return False
    return not getattr(config, "attention_chunk_size", None) and getattr(config, "is_causal", True)


def additive_mask(allowed, dtype):
    """A bool attention mask (True: may attend) in transformers' additive form: 0 where
    allowed, ``dtype``'s lowest value elsewhere. Its eager attention adds a ready 4-D mask to
    the scores as it is, so a bool one would add 1 and 0 and hide nothing."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def error_line(e):
    """An exception in one line, for a refusal: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


SAID = set()  # the keys warn_once has said in this process


def warn_once(key, message, stacklevel=2):
    """warnings.warn ``message`` the first time ``key`` comes, whatever the warnings filter:
    advice that every layer or every forward would otherwise repeat. Nothing while
    torch.compile traces (a fullgraph trace stops at warnings.warn)."""
    if key not in SAID and not torch.compiler.is_compiling():
        SAID.add(key)
        warnings.warn(message, stacklevel=stacklevel + 1)


def probe_rounding(dtype):
    """How far two computations of a probe's logits may part: one rounding of ``dtype``, and margin."""
    return 1e-4 if dtype == torch.float32 else 2**-6


def swap_modules(model, matches, replacement, check=None):
    """Replace every submodule for which ``matches(module)`` holds by ``replacement(module)``.

    Returns the count. We collect first and swap afterwards: changing the module
    tree while iterating over it is unsafe. The root module itself is never
    swapped (it has no parent to hold the replacement), and when a match lies
    inside another match only the outer one is replaced (the inner one goes
    with it; replacing both would graft the inner replacement onto the new
    outer module). ``check(original, new)``, once per module class before any
    swap, raises SwapMismatch when the two compute different things: then the
    model is left as it was.
    """
    targets = []
    for name, module in model.named_modules():  # parents come before their children
        inside_a_target = any(name.startswith(outer + ".") for outer, _ in targets)
        if name and not inside_a_target and matches(module):
            targets.append((name, module))
    new = [replacement(module) for _, module in targets]
    if check is not None:
        checked = set()
        for (_, module), swapped in zip(targets, new):
            if type(module) not in checked:
                check(module, swapped)
                checked.add(type(module))
    for (name, _), swapped in zip(targets, new):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, swapped)
    return len(targets)


def decoder_of(model):
    """A causal LM's decoder, the model under its LM head: ``model.get_decoder()``, or where
    that answers with the causal LM itself (Llama-4's text model in transformers 5.17) the
    submodule its ``base_model_prefix`` names, else its ``model``. Where it answers with a
    language model of its own (Llama-4's image-text model: its ``language_model``, a causal
    LM with a head), that one's decoder."""
    decoder = model.get_decoder()
    head = getattr(decoder, "get_output_embeddings", None)
    if decoder is not model and callable(head) and head() is not None:
        return decoder_of(decoder)
    if decoder is model:
        names = (getattr(model, "base_model_prefix", None), "model")
        decoder = next((getattr(model, n) for n in names if n and isinstance(getattr(model, n, None), torch.nn.Module)),
                       None)
        if decoder is None:
            raise SwapMismatch(f"{type(model).__name__}.get_decoder() returns the model itself and no decoder "
                               f"under it was found")
    return decoder


# A multimodal model (LLaVA, Mistral-3, Qwen2-VL, Gemma-3: image-text-to-text) holds its
# text decoder beside other towers (vision, audio), each a sub-model with a sub-config of
# its own. The towers attend bidirectionally over patches, rotate positions in 2-D and
# are called only with images, which no probe before a swap feeds them: the swaps whose
# check runs the model on text (attention, RoPE) touch the text decoder only.
def text_config(model):
    """The config of ``model``'s text decoder: its own, or a multimodal model's text sub-config."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def text_config_key(model):
    """The name of a multimodal model's text sub-config ("text_config"), or None where
    ``model``'s config is its text decoder's own."""
    config, text = model.config, text_config(model)
    if text is config:
        return None
    return next((key for key in getattr(config, "sub_configs", {}) if getattr(config, key, None) is text), None)


def text_modules(model):
    """``model``'s modules, parents first, without the other towers of a multimodal model:
    a sub-model whose config is one of its sub-configs other than the text one is left out
    with everything under it."""
    config = getattr(model, "config", None)
    text = text_config(model) if config is not None else None
    towers = [c for key in getattr(config, "sub_configs", None) or {}
              if (c := getattr(config, key, None)) is not None and c is not text]

    def walk(module):
        yield module
        for child in module.children():
            if not any(getattr(child, "config", None) is tower for tower in towers):
                yield from walk(child)

    return walk(model)


def called_plainly(*modules, ours=()):
    """Whether calling each of ``modules`` would run just its class's forward: no hooks of its
    own or global ones (they run only when a module is called), no forward set on the
    instance (offloading, parameter gathers); for the modules in ``ours``, whose forward is
    one of our kernels' (set on the instance), no hooks and that forward still ours (not one
    wrapped around it later: accelerate's hooks keep the old forward and set their own). A
    kernel that runs a layer's products inside a larger autograd Function, without calling
    the layer, asks this first."""
    hooks = torch.nn.modules.module
    if (hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
            or hooks._global_backward_pre_hooks):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                   or ("forward" in m.__dict__ and (m not in ours or our_forward(m.__dict__["forward"]) is None))
                   for m in (*modules, *ours))


# The names a KV cache goes by in a call and in a model's output: transformers 5.24
# renamed past_key_values to cache (the old name still taken, with a warning).
CACHE_NAMES = ("cache", "past_key_values")


class InstanceForward(functools.partial):
    """``function(module, *args, **kwargs)`` as one module instance's forward: what
    ``types.MethodType(function, module)`` is, and what it is not.

    * A deep copy of the model calls its own copy (a closure would keep calling the
      original), as a bound method does.
    * ``pickle`` / ``torch.save(model)`` keep it. A bound method pickles as
      ``getattr(module, function.__name__)``, which on loading finds no such attribute,
      or, named ``forward``, the class's forward: the kernel silently gone. This one
      pickles as the function itself (found by its import path) or, for a function
      made at run time, as ``made_by`` = (maker, argument) that makes it again.
    * ``inspect.signature`` shows ``signature_of``'s (the forward it replaced, kept on
      the module under that name): transformers' Trainer reads a model's forward
      signature to pick the dataset columns it keeps and whether to pass
      ``num_items_in_batch``. Read when asked, so a loaded copy shows it too.
    * ``__func__`` / ``__self__``, as on a bound method, for code that rebinds a forward:
      accelerate's mixed precision wraps ``model.forward.__func__`` and binds the wrapper
      to the model. ``__func__`` is a copy of the function that shows the replaced
      forward's signature (with the module's parameter first), as the wrapper keeps it,
      and is named ``forward``: accelerate's ``unwrap_model(keep_fp32_wrapper=False)``
      binds it to the model as a plain method, which pickles by that name, so a copy
      saved then loads with its class's forward, as a model of HF's own would, and not
      with an error at ``torch.load``.
    * A ``functools.partial`` of ``function`` and ``module``, for code that makes a
      shallow copy of a module and binds its forward to the copy: accelerate's
      ``compile_regions`` (1.15 through ``__func__``, 1.16 and later a partial's
      arguments, never another object). Without it the copy's forward would run the
      original module, whose layers are not the compiled ones.
    """

    def __new__(cls, function, module, signature_of=None, made_by=None):
        self = super().__new__(cls, function, module)
        self.signature_of, self.made_by = signature_of, made_by
        return self

    function = property(lambda self: self.func, doc="The function called with the module first.")
    module = property(lambda self: self.args[0], doc="The module it is the forward of.")

    def __call__(self, *args, **kwargs):  # a Python method, that set_forward binds
        return self.func(self.args[0], *args, **kwargs)

    def __getattr__(self, name):  # only for what the instance lacks
        if name == "__signature__":
            if self.signature_of is not None:
                return inspect.signature(getattr(self.module, self.signature_of))
            return inspect.signature(functools.partial(self.function, self.module))
        if name in ("__name__", "__qualname__"):
            return getattr(self.function, name)
        raise AttributeError(name)

    @property
    def __self__(self):
        return self.module

    @property
    def __func__(self):
        f = self.function
        copy = types.FunctionType(f.__code__, f.__globals__, "forward", f.__defaults__, f.__closure__)
        copy.__kwdefaults__, copy.__doc__ = f.__kwdefaults__, f.__doc__
        copy.__dict__.update(f.__dict__)  # __wrapped__ too: attention_routing walks a decorator's chain
        module_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        signature = self.__signature__
        copy.__signature__ = signature.replace(parameters=[module_parameter, *signature.parameters.values()])
        return copy

    def __reduce__(self):
        return _loaded_forward, (self.made_by or self.function, self.module, self.signature_of)

    def __repr__(self):
        return f"<forward {self.function.__qualname__} of {type(self.module).__name__}>"


def _loaded_forward(function, module, signature_of):
    """An InstanceForward again, from what its __reduce__ kept."""
    if isinstance(function, tuple):  # made at run time: make it again
        maker, argument = function
        return InstanceForward(maker(argument), module, signature_of, made_by=function)
    return InstanceForward(function, module, signature_of)


def set_forward(module, function, made_by=None):
    """``function(module, *args, **kwargs)`` as the forward of ``module``, a module inside
    a decoder layer (attention, a linear layer): the bound ``__call__`` of an
    InstanceForward, which copies and pickles as above.

    Why bound and not the object itself: torch.compile guards a forward set on an
    instance by that object's identity, but a bound method by its function's code.
    Compiled one decoder layer at a time (--compile, accelerate's regional
    compilation), every layer then passes the first layer's guards and one
    compilation serves them all; with a distinct object per layer each layer compiles
    again, and past Dynamo's recompile limit (8) the rest run eagerly or, under
    fullgraph=True, the run fails. (The bound forward shows ``(*args, **kwargs)`` to
    inspect.signature; nothing reads the signature of a module inside a layer.)
    """
    module.forward = InstanceForward(function, module, made_by=made_by).__call__


def our_forward(value):
    """The InstanceForward that ``value`` (a module's attribute) is or is bound to, or None.
    (An InstanceForward's own ``__self__`` is its module: it is checked first.)"""
    if isinstance(value, InstanceForward):
        return value
    bound_to = getattr(value, "__self__", None)
    return bound_to if isinstance(bound_to, InstanceForward) else None


def wrap_forward(module, slot, wrapper):
    """Make ``wrapper(module, *args, **kwargs)`` this instance's forward (an
    InstanceForward), the forward it had kept as ``module.<slot>`` for the wrapper to
    call; return False (and change nothing) if ``slot`` is taken already: wrapping
    twice would call ours twice. The new forward shows the old one's signature."""
    if slot in module.__dict__:
        return False
    setattr(module, slot, module.forward)
    module.forward = InstanceForward(wrapper, module, signature_of=slot)
    return True

# What the FP8 layers (fp8_kernel.py) share with the flags' check (flags.py) and
# with their torchao peer (finetune_baseline.py --torchao-fp8), which import no kernel.
FP8_NEEDS = "FP8 matmuls need a CUDA GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell)"


def fp8_supported(device):
    """(True, "") where FP8 tensor cores exist, else (False, why) in one line."""
    device = torch.device(device)
    if device.type == "cpu":
        return False, f"{FP8_NEEDS}; this is a CPU"
    if device.type != "cuda":
        return False, f"{FP8_NEEDS}; this is a {device.type} device"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return False, f"{FP8_NEEDS}; {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
    return True, ""


def linears_to_cast(model, skip=("lm_head",)):
    """The plain nn.Linear layers of ``model`` an FP8 recipe should take, as (targets,
    skipped): targets a list of (qualified name, module); skipped the names of layers
    left alone because their in/out features are not multiples of 16 (FP8 GEMMs need it).

    Not taken: modules whose qualified name ends with an entry of ``skip`` (the LM head:
    its logits are the loss's input, and often tied to the embedding), LoRA adapters
    (names with a ``lora_`` part: small, and trained in bf16) and subclasses of nn.Linear
    (they may compute something else)."""
    targets, skipped = [], []
    for name, module in model.named_modules():
        if not name or type(module) is not torch.nn.Linear:
            continue
        if any(part.startswith("lora_") for part in name.split(".")):
            continue
        if any(name == s or name.endswith("." + s) for s in skip):
            continue
        if module.in_features % 16 or module.out_features % 16:
            skipped.append(name)
            continue
        targets.append((name, module))
    return targets, skipped
