"""
Step 24 -- The residual adds inside the norms.

What a decoder layer does around its norms
------------------------------------------
A pre-norm decoder layer (LLaMA and the families that copy it) keeps a residual
stream h and adds each sublayer's output to it::

    s   = h + attention(norm_1(h))           # add, then the next norm reads s
    out = s + mlp(norm_2(s))

PyTorch runs ``h + a`` as one kernel (read h and a, write s) and ``norm_2(s)`` as the
next (read s, write y): s goes out to HBM and comes straight back. In backward,
autograd meets each of h and s twice (the norm reads it and the residual carries it
on), so it adds their two gradients in a kernel of its own: the norm's backward
writes its dx, and an add reads it again with the residual's gradient and writes the
sum. With per-tensor FP8 (Step 22) one more pass reads that sum for its max |.|,
which the casts of o_proj's and down_proj's output gradients need, since the sum is
their gradient.

The fusion, and what it moves (one layer, [tokens, H] passes)
------------------------------------------------------------
* forward: the second norm reads h and a, writes s and y: 4 passes instead of 5;
* backward: each norm's kernel reads the residual's gradient and writes dx = its own
  gradient + that one: 4 passes instead of 6, twice;
* FP8: the backward kernels fold max |dx| into a few slots as they store it (as the
  forward's producers do, Step 22): the two amax passes are gone.

So 5 passes fewer per layer in bf16, 7 with FP8, and 3 launches fewer. At LLaMA-8B,
4,096 tokens, a pass is 32 MB: 5-7 GB a step, ~2 ms of an H100's bandwidth, about 1% of
the 8B full fine-tuning step. Measured (H100, 2026-12-06, torch 2.11, triton 3.6; 8B
synthetic rows, ``--no-use-custom-residual`` alternating with the default in one call,
results/residual/): ``--fp8 tensorwise`` 2 x 2,048 15,129-15,185 -> 15,242-15,296
tokens/s (+0.7%), bf16 11,379 -> 11,436 (+0.5%), LoRA r16 FP8 4 x 2,048 21,525-21,628
-> 21,685-21,799 (+0.8%); the same peak memory. Small, and free: nothing is kept that
was not kept before (norm_1 keeps h, norm_2 keeps s, as HF's norms do).

The kernels are the RMSNorm's own (rmsnorm_kernel.py): ``ADD`` makes the forward load
the second input and store the sum it normalizes (rounded to the stream's dtype
first, as PyTorch's add stores it, so the norm sees the same bits as HF's); ``HAS_DRES``
makes the backward add the residual's gradient in float32 before its one rounding
(HF rounds the norm's dx and then the sum: within one unit of bf16 of ours, equal in
float32). Two autograd Functions carry them:

* ``_NormKeep``: norm_1, that also hands its input on as the residual, so the
  residual's gradient comes back to its backward instead of to an add;
* ``_AddNorm``: s = h + a and norm_2(s); its backward returns one dx for both inputs
  (the gradient of a sum is the same for each of its terms).

When it applies
---------------
Only where the layer computes exactly this, and that is proved, not assumed.
``fuse_residuals`` takes decoder layers whose children are exactly ``self_attn``,
``mlp``, ``input_layernorm`` and ``post_attention_layernorm`` (no dropout module, no
extra norm, no parameter of the layer's own: Gemma-2's four norms, Phi-3's residual
dropout, Cohere's parallel block and Doge's learned residual scales are left as they
are), both norms RMSNorms of one formula. Then, once per layer class, its own forward
(with PyTorch's formulation of the norms) and ours run on a random float32 input with
stand-ins for the attention and the MLP (``_check_layer``): the same output and
gradients to float32 rounding, and every argument the attention is called with the
same object (its mask, positions, cache, keyword arguments). A layer that scales its residual (Granite's multiplier),
applies dropout or normalizes after the sublayer fails that, and is refused in one
line (``swap_common.SwapMismatch``). At run time the fused forward steps aside for
the layer's own where it cannot apply: under torch.compile (which fuses such adds
itself), where hooks set on the norms after the swap must run (accelerate's
offloading brings their weights in at the call), and where the attention's output
differs from the stream in shape, dtype or device (autocast's bf16 products on a
float32 stream). Only decoder layers of a multimodal model's text decoder are looked at.

The norms' outputs are noted for the LoRA groups' recomputation (rmsnorm_kernel.py,
``remade_later``) exactly as TritonRMSNorm's: norm_2's from the sum s it keeps.
"""

import functools
import inspect

import torch

from kernel_common import amax_slots, first_order_only, note_amax
from rmsnorm_kernel import (TritonRMSNorm, _backward_launch, _check_inputs, _forward, _is_rmsnorm,
                            _note_made, check_same_rmsnorm, rmsnorm_reference)
from swap_common import SwapMismatch, called_plainly, our_forward, set_forward, swap_modules, text_modules

LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def _formula(norm):
    """(eps, weight_offset, cast_first) of a TritonRMSNorm, or of the HF RMSNorm it will replace."""
    if not isinstance(norm, TritonRMSNorm):
        norm = TritonRMSNorm.from_hf_rmsnorm(norm)  # reads the epsilon and the formula as the swap will
    return norm.variance_epsilon, norm.weight_offset, norm.cast_first


def _norm_backward(ctx, dy, dres, x, weight, rstd, need_dw):
    """dx = the norm's gradient + the residual's (dres), with max |dx| for an FP8 cast of
    it; dw where the weight needs one (a frozen weight's partial sums are never made)."""
    if dy is None:  # nothing of the norm's output reached the loss
        dy = torch.zeros_like(x)
    slots = amax_slots(dy)
    dx, dw = _backward_launch(dy, x, weight, rstd, need_dw, ctx.weight_offset, dres,
                              None if slots is None else slots[0])
    if slots is not None:
        note_amax(dx, slots[0])
    return dx, (dw if need_dw else None)


class _NormKeep(torch.autograd.Function):
    """(norm(x), x): x handed on as the residual, whose gradient backward adds into dx."""

    @staticmethod
    def forward(ctx, x, weight, eps, weight_offset, cast_first):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros made
        slots = amax_slots(x)  # a per-tensor FP8 layer may read y: its amax comes from here
        y, rstd = _forward(x, weight, eps, weight_offset, cast_first, None if slots is None else slots[0])
        if slots is not None:
            note_amax(y, slots[0])
        ctx.save_for_backward(x, weight, rstd)
        ctx.weight_offset = weight_offset
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            _note_made(y, x, weight, (eps, weight_offset, cast_first))
        return y, x.view_as(x)

    @staticmethod
    @first_order_only("residual rmsnorm")
    def backward(ctx, dy, dres):
        x, weight, rstd = ctx.saved_tensors
        if dy is None and dres is None:
            return None, None, None, None, None
        return (*_norm_backward(ctx, dy, dres, x, weight, rstd, ctx.needs_input_grad[1]), None, None, None)


class _AddNorm(torch.autograd.Function):
    """(norm(x + delta), x + delta); backward: one dx for both x and delta."""

    @staticmethod
    def forward(ctx, x, delta, weight, eps, weight_offset, cast_first):
        ctx.set_materialize_grads(False)
        slots = amax_slots(x)
        y, rstd, s = _forward(x, weight, eps, weight_offset, cast_first, None if slots is None else slots[0], delta)
        if slots is not None:
            note_amax(y, slots[0])
        ctx.save_for_backward(s, weight, rstd)
        ctx.weight_offset = weight_offset
        if any(ctx.needs_input_grad[:3]):
            _note_made(y, s, weight, (eps, weight_offset, cast_first))  # y is remade from the kept sum
        return y, s

    @staticmethod
    @first_order_only("residual rmsnorm")
    def backward(ctx, dy, dsum):
        s, weight, rstd = ctx.saved_tensors
        if dy is None and dsum is None:
            return None, None, None, None, None, None
        dx, dw = _norm_backward(ctx, dy, dsum, s, weight, rstd, ctx.needs_input_grad[2])
        return dx, dx, dw, None, None, None


def norm_keep(x, weight, eps=1e-6, weight_offset=0.0, cast_first=True):
    """(rmsnorm(x), x) where x's second use, the residual, gets its gradient added inside
    the norm's backward kernel. Differentiable in x and weight."""
    _check_inputs(x, weight, eps, weight_offset)
    return _NormKeep.apply(x, weight, float(eps), float(weight_offset), bool(cast_first))


def add_rmsnorm(x, delta, weight, eps=1e-6, weight_offset=0.0, cast_first=True):
    """(rmsnorm(x + delta), x + delta) in one pass; x and delta of one shape, dtype and
    device. Differentiable in x, delta and weight."""
    _check_inputs(x, weight, eps, weight_offset)
    if delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device:
        raise ValueError(f"add_rmsnorm: delta must have x's shape, dtype and device: got {tuple(delta.shape)} "
                         f"{delta.dtype} {delta.device} against {tuple(x.shape)} {x.dtype} {x.device}")
    return _AddNorm.apply(x, delta, weight, float(eps), float(weight_offset), bool(cast_first))


# --------------------------------------------------------------------------------
# The decoder layer's forward
# --------------------------------------------------------------------------------
@functools.cache
def _named_arguments(layer_class):
    """(name, default) of each argument the class's forward passes on to its attention
    (those after hidden_states, before **kwargs), in order."""
    parameters = list(inspect.signature(layer_class.forward).parameters.values())[2:]
    return tuple((p.name, p.default) for p in parameters
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def residual_layer_forward(layer, hidden_states, *args, **kwargs):
    """The forward of a pre-norm decoder layer with its residual adds in the norms
    (``fuse_residuals`` proves, per layer class, that it computes the class's own)."""
    first, second = layer.input_layernorm, layer.post_attention_layernorm
    # The layer's own forward where the norms must be called (hooks set on them after the
    # swap: accelerate's offloading brings their weights in at the call) and under
    # torch.compile, which fuses the adds itself: its graph keeps HF's form.
    if torch.compiler.is_compiling() or not called_plainly(first, second):
        return type(layer).forward(layer, hidden_states, *args, **kwargs)
    names = _named_arguments(type(layer))
    if len(args) > len(names):
        raise TypeError(f"{type(layer).__name__}.forward takes {len(names) + 1} positional arguments, "
                        f"got {len(args) + 1}")
    passed = dict(zip((name for name, _ in names), args))
    for name, default in names[len(args):]:
        passed[name] = kwargs.pop(name, default)
        if passed[name] is inspect.Parameter.empty:
            raise TypeError(f"{type(layer).__name__}.forward missing required argument {name!r}")
    normed, residual = norm_keep(hidden_states, first.weight, *_formula(first))
    attended = layer.self_attn(hidden_states=normed, **passed, **kwargs)[0]
    if attended.shape != residual.shape or attended.dtype != residual.dtype or attended.device != residual.device:
        summed = residual + attended  # e.g. autocast's bf16 attention on a float32 stream: HF's own add
        normed = second(summed)
    else:
        normed, summed = add_rmsnorm(residual, attended, second.weight, *_formula(second))
    return summed + layer.mlp(normed)


# --------------------------------------------------------------------------------
# Checking and patching
# --------------------------------------------------------------------------------
class _Stand(torch.nn.Module):
    """A stand-in for a layer's attention (``returns_pair``) or MLP: a cheap function of its
    input with weights of its own, recording every call's arguments."""

    def __init__(self, width, seed, returns_pair):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.scale = torch.nn.Parameter(0.5 + torch.rand(width, generator=gen))
        self.returns_pair = returns_pair
        self.calls = []

    def forward(self, hidden_states, *args, **kwargs):
        self.calls.append((args, kwargs))
        out = hidden_states * self.scale + torch.tanh(hidden_states)
        return (out, None) if self.returns_pair else out


class _PyTorchNorm(TritonRMSNorm):
    """The same RMSNorm in PyTorch operations (rmsnorm_kernel.rmsnorm_reference)."""

    def forward(self, hidden_states):
        return rmsnorm_reference(hidden_states, self.weight, self.variance_epsilon, torch.float32,
                                 self.weight_offset, self.cast_first)


def _probe_copy(layer, attention, mlp, norms):
    """A shallow copy of ``layer`` whose children are the given stand-ins: the layer is not touched."""
    probe = object.__new__(type(layer))
    probe.__dict__.update(layer.__dict__)
    probe._parameters, probe._buffers = {}, {}
    probe._modules = {"self_attn": attention, "mlp": mlp, "input_layernorm": norms[0],
                      "post_attention_layernorm": norms[1]}
    return probe


@torch.enable_grad()
def _check_layer(layer, device):
    """Raise SwapMismatch unless ``residual_layer_forward`` computes what the class's own
    forward does, on a random float32 input with stand-ins for the attention and the MLP."""
    name = type(layer).__name__
    first = layer.input_layernorm
    width = first.weight.shape[-1]
    runs = []
    for forward in (type(layer).forward, residual_layer_forward):
        gen = torch.Generator().manual_seed(0)
        # Ours against the class's forward with PyTorch's formulation of the same norms: a
        # truth of its own, and no weight gradient of the RMSNorm kernel runs for a check.
        kind = TritonRMSNorm if forward is residual_layer_forward else _PyTorchNorm
        norms = [kind(width, *_formula(n)) for n in (first, layer.post_attention_layernorm)]
        for n in norms:
            n.weight.data = 0.3 + torch.rand(width, generator=gen)
        stands = [_Stand(width, 1, True), _Stand(width, 2, False)]
        probe = _probe_copy(layer, *stands, norms).to(device)
        x = (torch.randn(2, 5, width, generator=gen) * torch.tensor([1e-2, 1.0, 3.0, 0.5, 8.0])[:, None]).to(device)
        x.requires_grad_(True)
        markers = {"attention_mask": torch.ones(1, device=device), "position_ids": torch.arange(5, device=device)[None],
                   "position_embeddings": (torch.ones(1, device=device), torch.zeros(1, device=device)),
                   "use_cache": False, "probe_keyword": object()}
        try:
            out = forward(probe, x, **markers)
            if not isinstance(out, torch.Tensor):
                raise SwapMismatch(f"{name}.forward returns {type(out).__name__}, not the hidden states alone")
            out.backward(torch.cos(out.detach()))
        except SwapMismatch:
            raise
        except Exception as e:  # noqa: BLE001 - a forward that cannot run on stand-ins is not this layer's form
            raise SwapMismatch(f"{name}.forward does not run as a pre-norm decoder layer ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''})") from None
        grads = [x.grad, *(n.weight.grad for n in norms), *(s.scale.grad for s in stands)]
        calls = [s.calls for s in stands]
        runs.append((out.detach(), grads, calls, markers))
    (theirs, their_grads, their_calls, their_markers), (ours, our_grads, our_calls, our_markers) = runs
    if len(their_calls[0]) != 1 or len(their_calls[1]) != 1:
        raise SwapMismatch(f"{name}.forward calls its attention {len(their_calls[0])} and its MLP "
                           f"{len(their_calls[1])} times, not once each")
    if not _same_call(their_calls[0][0], their_markers, our_calls[0][0], our_markers):
        raise SwapMismatch(f"{name}.forward passes its attention other arguments than a pre-norm layer's "
                           f"({sorted(their_calls[0][0][1])})")
    for what, a, b in [("output", ours, theirs), *zip(("gradient of the input", "gradient of input_layernorm",
                                                       "gradient of post_attention_layernorm",
                                                       "gradient through the attention",
                                                       "gradient through the MLP"), our_grads, their_grads)]:
        if b is None or a is None or not torch.allclose(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item()):
            diff = "missing" if a is None or b is None else f"max difference {(a - b).abs().max().item():.2g}"
            raise SwapMismatch(f"{name}.forward computes something else than a pre-norm decoder layer with plain "
                               f"residual adds ({what}: {diff})")


def _same_call(theirs, their_markers, ours, our_markers):
    """The attention got the same arguments: each marker where the other run got its own."""
    (their_args, their_kwargs), (our_args, our_kwargs) = theirs, ours
    if their_args or our_args or their_kwargs.keys() != our_kwargs.keys():
        return False

    def mark(value, markers):  # a marker by name, anything else as it is
        for key, marker in markers.items():
            if value is marker:
                return key
            if isinstance(marker, tuple) and isinstance(value, tuple) and all(v is m for v, m in zip(value, marker)):
                return key
        return value if value is None or isinstance(value, (bool, int, float, str)) else type(value).__name__
    return all(mark(their_kwargs[k], their_markers) == mark(our_kwargs[k], our_markers) for k in their_kwargs)


def _why_not(layer):
    """Why ``layer`` is no pre-norm decoder layer this forward can stand in for, or None."""
    children = {name for name, _ in layer.named_children()}
    own = [name for name, _ in layer.named_parameters(recurse=False)]
    if own:
        return f"they have parameters of their own: {', '.join(own)}"
    if children - LAYER_CHILDREN:
        return f"they have modules besides attention, MLP and two norms: {', '.join(sorted(children - LAYER_CHILDREN))}"
    if LAYER_CHILDREN - children:
        return f"they have no {' and no '.join(sorted(LAYER_CHILDREN - children))}"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(isinstance(n, TritonRMSNorm) or _is_rmsnorm(n) for n in norms):
        return f"their norms are {type(norms[0]).__name__} and {type(norms[1]).__name__}, not RMSNorms"
    if not called_plainly(layer, *norms):
        return "they have hooks or a forward of their own already (offloading, another library's patch)"
    return None


def fused_layers(model):
    """The layers of ``model`` whose forward is ``residual_layer_forward`` already."""
    return [m for m in model.modules() if (mine := our_forward(m.__dict__.get("forward"))) is not None
            and mine.function is residual_layer_forward]


def fuse_residuals(model):
    """Give every pre-norm decoder layer of ``model`` the forward with its residual adds
    in the norms; return the count. Its two norms become TritonRMSNorm where they are
    not (checked as ``rmsnorm_kernel.replace_rmsnorm`` checks them). Raises
    SwapMismatch, changing nothing, where a layer class computes anything else."""
    todo = _layers_to_fuse(model)
    norms = {id(n) for m in todo for n in (m.input_layernorm, m.post_attention_layernorm)}
    if any(not isinstance(m.input_layernorm, TritonRMSNorm) or not isinstance(m.post_attention_layernorm,
                                                                            TritonRMSNorm) for m in todo):
        swap_modules(model, lambda m: id(m) in norms and not isinstance(m, TritonRMSNorm),
                     TritonRMSNorm.from_hf_rmsnorm, check=check_same_rmsnorm)
    for m in todo:
        set_forward(m, residual_layer_forward)
    return len(todo)


def _layers_to_fuse(model):
    """The decoder layers of ``model`` to fuse (not fused yet), each class checked; or SwapMismatch."""
    layers = [m for m in text_modules(model) if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise SwapMismatch(f"found no decoder layers in {type(model).__name__} (modules named *DecoderLayer)")
    fused = fused_layers(model)
    todo = [m for m in layers if not any(m is f for f in fused)]
    reasons = {m: _why_not(m) for m in todo}
    refused = [m for m in todo if reasons[m] is not None]
    if refused:
        raise SwapMismatch(f"the decoder layers are no plain pre-norm ones: {reasons[refused[0]]}")
    checked = set()
    for m in todo:  # first the checks, then the changes: a refusal leaves the model as it was
        formulas = {_formula(n)[1:] for n in (m.input_layernorm, m.post_attention_layernorm)}
        if len(formulas) != 1:
            raise SwapMismatch(f"{type(m).__name__}'s two norms compute different formulas")
        if type(m) not in checked:  # on stand-ins: a layer on the meta device (a model for FSDP before
            device = m.input_layernorm.weight.device  # its weights exist) is checked on the GPU or the CPU
            if device.type == "meta":
                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            _check_layer(m, device)
            checked.add(type(m))
    return todo


