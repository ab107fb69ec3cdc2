"""
Step 14, continued -- The fused RoPE in Hugging Face's attention layers.

rope_kernel.py is the lesson of the kernels: forward, backward, launchers and
the autograd Function behind ``rope`` (also under HF's name,
``apply_rotary_pos_emb``). This file holds how a model is made to call it, a
concern of its own: HF's attention layers call a *module-level* function, not a
submodule, so there is nothing to swap with ``swap_modules``. Here:

* ``patched_rope(model)``: our function under HF's name in the model's python
  modules, for the duration of a ``with`` block.
* ``fuse_rope(model)``: the persistent swap, each attention layer given its own
  copy of ``forward`` that finds our function (gradient checkpointing and
  torch.compile see it too).
* ``check_same_rope``: before either, the family's function must compute what
  ours does (``RopeMismatch`` otherwise).

``from rope_kernel import fuse_rope`` keeps working: the kernel file finds these
names here on first use.

Nothing runs on import. See rope_test.py for the checks.
"""

import contextlib
import sys
import types

import torch

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import SwapMismatch
from rope_kernel import apply_rotary_pos_emb, rope_reference


# --------------------------------------------------------------------------------
# Model patching, scoped to a `with` block
# --------------------------------------------------------------------------------
# HF's attention layers call the *module-level* function: LlamaAttention.forward
# looks up ``apply_rotary_pos_emb`` in the globals of modeling_llama.py on every
# call. Assigning our function to that module attribute therefore switches every
# LLaMA attention layer to the fused kernel; there is no submodule to replace.
#
# Why a context manager and not a permanent patch: the attribute belongs to the
# python module, not to one model. A global assignment would silently change
# every other LLaMA model in the process as well: the unpatched baseline that a
# test or benchmark compares against in the same process, a reference model, a
# teacher. ``patched_rope(model)`` makes the swap only for the duration of the
# ``with`` block and then restores exactly what was there before, so
#
#     with patched_rope(model):
#         loss = model(ids, labels=ids).loss      # fused RoPE
#     loss.backward()                             # no patch needed here
#
# Backward needs no patch: the graph built inside the block holds our
# Function's nodes, whose backward calls rope_backward directly and never looks
# up the module attribute. Gradient checkpointing is the exception: it reruns
# the attention forward *during* backward, outside the block, where HF's
# function would produce different saved tensors (PyTorch stops with a
# CheckpointError). ``fuse_rope(model)`` below avoids the swap altogether: each
# attention layer gets its own copy of ``forward`` that finds our function.
#
# Caveats: while the block runs, *any* model whose attention lives in the same
# python module uses the fused kernel too (the scope is time, not the object),
# and the swap is not thread-safe. Nesting is fine: an inner block restores what
# the outer one installed, the outer one restores HF's original.
def _rope_attention_layers(model):
    """(attention submodule, its python module) for every layer whose python module
    defines the ``apply_rotary_pos_emb`` that its forward calls by name."""
    for sub in model.modules():
        cls = type(sub)
        if not cls.__name__.endswith("Attention"):
            continue
        pymod = sys.modules.get(cls.__module__)
        if pymod is not None and callable(vars(pymod).get("apply_rotary_pos_emb")):
            yield sub, pymod


def rope_patch_targets(model):
    """Python modules whose ``apply_rotary_pos_emb`` feeds ``model``'s attention layers.

    Returns (modules, count): the distinct python modules
    (``sys.modules[type(m).__module__]``) of every submodule whose class name ends
    with "Attention" and whose python module defines a function
    ``apply_rotary_pos_emb``; count is the number of such attention submodules.
    """
    layers = list(_rope_attention_layers(model))
    modules = {pymod.__name__: pymod for _, pymod in layers}
    return list(modules.values()), len(layers)


@contextlib.contextmanager
def _fused_in(pymods):
    """Our function under HF's name in each python module; the originals come back on exit."""
    saved = [(pymod, vars(pymod)["apply_rotary_pos_emb"]) for pymod in pymods]
    try:
        for pymod, _ in saved:
            pymod.apply_rotary_pos_emb = apply_rotary_pos_emb
        yield
    finally:
        for pymod, original in reversed(saved):
            pymod.apply_rotary_pos_emb = original


@contextlib.contextmanager
def patched_rope(model):
    """Use the fused RoPE in ``model``'s attention layers inside a ``with`` block.

    Yields the number of attention layers affected. On exit (also on an
    exception) each python module gets back exactly the function it had on entry.
    """
    modules, count = rope_patch_targets(model)
    with _fused_in(modules):
        yield count


def fuse_rope(model):
    """Make ``model``'s attention layers use the fused RoPE every time they run.

    Each attention submodule gets, on the instance (other models are untouched),
    a copy of its class's ``forward`` whose global names are those of its python
    module except that ``apply_rotary_pos_emb`` is ours: the same code, looking
    up our function where it looks up HF's. Nothing global changes, so this
    also holds when gradient checkpointing reruns the layer during backward and
    when torch.compile traces it (the compiler reads the copy's globals; a
    module attribute swapped during the call, as patched_rope does, is not
    always seen by it). Returns the number of layers; calling it again changes
    nothing.
    """
    layers = list(_rope_attention_layers(model))
    for pymod in {pymod.__name__: pymod for _, pymod in layers}.values():
        check_same_rope(vars(pymod)["apply_rotary_pos_emb"], model, pymod.__name__)
    count = 0
    for sub, _ in layers:
        forward = _forward_with_fused_rope(type(sub))
        if forward is None:
            continue
        count += 1
        # A method bound to the layer: copy.deepcopy(model) binds the copy's
        # forward to the copy.
        sub.forward = types.MethodType(forward, sub)
    return count


class RopeMismatch(SwapMismatch):
    """A family's apply_rotary_pos_emb that computes something else than ours."""


# --------------------------------------------------------------------------------
# Checking the swap: the family's function must compute what ours does
# --------------------------------------------------------------------------------
# Every decoder family names its function apply_rotary_pos_emb, but not every one
# computes LLaMA's x * cos + rotate_half(x) * sin: Cohere rotates interleaved pairs
# (x0, x1), (x2, x3), ... instead of the two halves, others add a scale. A random
# tiny model trains almost alike either way (its attention barely depends on the
# positions), so a wrong swap would pass unnoticed. Before the swap, the family's
# function and ours run on the same random q and k with the model's own cos and
# sin tables (their width says how many dims turn), in float32; they must agree.
@torch.no_grad()
def check_same_rope(original, model, where):
    """Raise RopeMismatch unless ``original`` computes what ``rope`` does for ``model``."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    device = next(model.parameters()).device
    device = torch.device("cpu") if device.type == "meta" else device  # --fsdp builds large models there
    seq_len = 8
    positions = torch.arange(seq_len, device=device)[None]
    tables = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    gen = torch.Generator(device="cpu").manual_seed(0)
    cos = sin = None
    if tables and not any(b.is_meta for b in tables[0].buffers()):
        with contextlib.suppress(TypeError):  # a table that wants more (Gemma-3: the layer type)
            cos, sin = tables[0](torch.zeros(1, seq_len, head_dim, device=device), positions)
            cos, sin = cos.float(), sin.float()
    if cos is None:  # no table to ask: random angles over the whole head
        angles = torch.rand(1, seq_len, head_dim // 2, generator=gen).to(device)
        cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    q = torch.randn(1, 2, seq_len, head_dim, generator=gen).to(device)
    k = torch.randn(1, 2, seq_len, head_dim, generator=gen).to(device)
    try:
        theirs = original(q, k, cos, sin)
    except Exception as e:  # noqa: BLE001 - any failure: not a function we can stand in for
        raise RopeMismatch(f"{where}.apply_rotary_pos_emb does not take (q, k, cos, sin) as HF LLaMA's does "
                           f"({type(e).__name__})") from None
    rotary = cos.shape[-1]  # what rope() computes, written with the reference formula (no kernel launch)
    turned = rope_reference(q[..., :rotary], k[..., :rotary], cos, sin)
    ours = [torch.cat([t, x[..., rotary:]], dim=-1) for t, x in zip(turned, (q, k))]
    for a, b in zip(ours, theirs):
        if a.shape != b.shape or not torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5):
            raise RopeMismatch(f"{where}.apply_rotary_pos_emb computes another rotation than the fused RoPE "
                               f"(x * cos + rotate_half(x) * sin on the first {cos.shape[-1]} of {head_dim} dims)")


_FUSED_FORWARDS = {}  # attention class -> its forward, reading our apply_rotary_pos_emb


def _copy_function(fn, names=None, closure=None):
    """A new function with fn's code and metadata, other globals and/or closure cells."""
    new = types.FunctionType(fn.__code__, fn.__globals__ if names is None else names, fn.__name__,
                             fn.__defaults__, fn.__closure__ if closure is None else closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    return new


def _cell_holds(cell, obj):
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def _with_fused_rope(fn, depth=0):
    """A copy of ``fn`` that finds our function under HF's name, or None.

    A forward that looks the name up in its globals is copied with those globals
    (ours in place of HF's). A decorated forward (transformers wraps some in
    ``deprecate_kwarg``, with functools.wraps: ``__wrapped__``) is copied around
    such a copy of the function it wraps, when it holds that function in a closure
    cell; the decorator's own work (renaming an old keyword) still runs.
    """
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    if "apply_rotary_pos_emb" in code.co_names and "apply_rotary_pos_emb" in fn.__globals__:
        names = dict(fn.__globals__)  # the module's globals as they are now
        names["apply_rotary_pos_emb"] = apply_rotary_pos_emb
        return _copy_function(fn, names=names)
    inner = getattr(fn, "__wrapped__", None)
    if inner is None or depth >= 4 or not fn.__closure__ or not any(_cell_holds(c, inner) for c in fn.__closure__):
        return None
    fused_inner = _with_fused_rope(inner, depth + 1)
    if fused_inner is None:
        return None
    closure = tuple(types.CellType(fused_inner) if _cell_holds(c, inner) else c for c in fn.__closure__)
    fused = _copy_function(fn, closure=closure)
    fused.__wrapped__ = fused_inner  # what it calls, for anything that unwraps it
    return fused


def _forward_with_fused_rope(cls):
    """``cls.forward`` reading our function under HF's name (see _with_fused_rope), or
    None when neither it nor the function a decorator wraps looks the name up."""
    if cls not in _FUSED_FORWARDS:
        _FUSED_FORWARDS[cls] = _with_fused_rope(cls.forward)
    return _FUSED_FORWARDS[cls]
