"""
Step 12, continued -- The fused SwiGLU at work in Hugging Face's gated MLPs.

swiglu_kernel.py is the lesson of the kernels: the forward and backward kernels,
their launchers and the autograd Function behind ``swiglu`` and ``geglu``. This
file holds what puts them into a model, one concern of its own (the split of
Liger-Kernel's ops / modules / patching):

* ``swiglu_down_proj``: the gated activation and the down projection as one
  Function that recomputes the MLP's hidden activation in backward instead of
  keeping it (3.8 GB less at the peak for LLaMA-3.1-8B at 2 x 2048 tokens).
* ``TritonLlamaMLP`` and ``TritonGateUpMLP``: drop-in replacements for HF's gated
  MLPs (separate gate_proj/up_proj, or Phi-3's fused gate_up_proj), the matmuls
  left to cuBLAS.
* ``check_same_mlp`` and ``replace_swiglu``: each MLP class is run next to its
  replacement before the swap, and one that computes something else is refused.
* The experts of MoE layers (Mixtral, Qwen3-MoE): the kernel as their gate.

``from swiglu_kernel import TritonLlamaMLP, replace_swiglu`` keeps working: the
kernel file finds these names here on first use.

Nothing runs on import. See swiglu_test.py for the checks.
"""

import functools
import types
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import INTERPRET, SwapMismatch, first_order_only, kernel_op, nothing, swap_modules
from swiglu_kernel import (
    FUNCTION_NAMES,
    REFERENCES,
    _check_inputs,
    _out_dtype,
    _swiglu_backward_fake,
    _wanted,
    gated_activation,
    swiglu_backward_and_hidden,
    swiglu_forward,
)


# --------------------------------------------------------------------------------
# Optimization: recompute the MLP's hidden activation instead of saving it
# --------------------------------------------------------------------------------
# down_proj = F.linear(h, W) saves its input h = act(gate) * up for the weight
# gradient dW = dout^T @ h: a third [N, I] tensor per layer kept from forward to
# backward, next to gate and up. But h is a cheap function of gate and up, which
# are saved anyway. This Function runs the gated activation and the down
# projection together, saves only (gate, up, W), and recomputes h in backward:
# the SwiGLU backward kernel, which reads gate and up for their gradients, writes
# h as well (2 B per element more; ~0.03 ms per layer at 4096 x 14336 on an H200).
#
# What it buys: 117 MB per layer at 2 x 2048 tokens of LLaMA-3.1-8B, 3.8 GB over
# the 32 layers, at the moment of peak memory (the end of forward). The matmuls
# are the same cuBLAS calls autograd would make, so the results are identical.
# Under torch.compile it is one opaque operator too: the compiler cannot
# recompute through an operator it does not see into, so we keep doing it.
def _down_proj_fake(gate, up, weight, dtype, activation="silu"):
    return gate.new_empty(gate.shape[:-1] + (weight.shape[0],), dtype=dtype)


@kernel_op("swiglu_down_proj_forward", fake=_down_proj_fake)
def swiglu_down_proj_forward(gate: torch.Tensor, up: Optional[torch.Tensor], weight: torch.Tensor,
                             dtype: torch.dtype, activation: str = "silu") -> torch.Tensor:
    """F.linear(act(gate) * up, weight) computed in ``dtype``; h dies inside.

    ``dtype`` is what F.linear would compute in at the call: autocast's dtype
    when autocast is on, else the inputs'. It is an argument because a compiled
    graph has no autocast state when it runs: the tracer resolved it already.
    """
    h = swiglu_forward(gate, up, activation)
    return F.linear(h.to(dtype), weight.to(dtype))


def _down_proj_backward_fake(dout, gate, up, weight, need_gate, need_up, need_w, activation="silu"):
    return _swiglu_backward_fake(dout, gate, up, need_gate, need_up) + (
        weight.new_empty(weight.shape) if need_w else nothing(weight),)


@kernel_op("swiglu_down_proj_backward", fake=_down_proj_backward_fake)
def swiglu_down_proj_backward(dout: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor],
                              weight: torch.Tensor, need_gate: bool, need_up: bool, need_w: bool,
                              activation: str = "silu",
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_gate, d_up, d_weight) of F.linear(act(gate) * up, weight); the matmuls run in dout's dtype."""
    dg, du, h = nothing(gate), nothing(gate if up is None else up), None
    if need_gate or need_up:
        dh = dout @ weight.to(dout.dtype)  # [..., I]
        # Optimization: the backward kernel reads gate and up anyway; it writes h for
        # dW too (2 B per element) instead of a forward launch that reads them again
        # (6 B). 8B, 2 x 2,048 tokens: SwiGLU 9.8 -> 8.0 ms per step (H200, NOTES.md).
        dg, du, h = swiglu_backward_and_hidden(dh, gate, up, need_gate, need_up, activation, store_h=need_w)
        del dh
    dw = nothing(weight)
    if need_w:
        if h is None:  # gate and up are frozen: the recomputation on its own, same kernel, same bits
            h = swiglu_forward(gate, up, activation)
        h = h.to(dout.dtype)
        dw = (dout.reshape(-1, dout.shape[-1]).t() @ h.reshape(-1, h.shape[-1])).to(weight.dtype)
    return dg, du, dw


def _down_proj_save(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    # Under torch.autocast, F.linear ran in the autocast dtype (weight cast to
    # bf16, say), but backward runs outside autocast: it redoes that cast
    # itself, as autograd would have through autocast's own cast op.
    ctx.compute_dtype = output.dtype
    ctx.activation = inputs[4] if len(inputs) > 4 else "silu"


def _down_proj_grads(ctx, dout):
    gate, up, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    dout = dout.to(ctx.compute_dtype)  # no-op without autocast
    grads = swiglu_down_proj_backward(dout, gate, up, weight, *needs, ctx.activation)
    return _wanted(grads, needs) + (None, None)


class TritonSwiGLUDownProjFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight, dtype, activation="silu"):
        out = swiglu_down_proj_forward(gate, up, weight, dtype, activation)
        _down_proj_save(ctx, (gate, up, weight, dtype, activation), out)
        return out

    @staticmethod
    @first_order_only("swiglu_down_proj")
    def backward(ctx, dout):
        return _down_proj_grads(ctx, dout)


swiglu_down_proj_forward.op.register_autograd(
    first_order_only("swiglu_down_proj")(_down_proj_grads), setup_context=_down_proj_save
)


def swiglu_down_proj(gate, up, weight, activation="silu"):
    """``F.linear(act(gate) * up, weight)`` that saves gate and up only (h is recomputed).

    ``activation``: "silu" (SwiGLU) or "gelu_tanh" (GeGLU); up None: gate holds [gate | up].
    """
    _check_inputs(gate, up, "swiglu_down_proj")
    n_cols = gate.shape[-1] if up is not None else gate.shape[-1] // 2
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != n_cols:
        raise ValueError(
            f"swiglu_down_proj: weight must be [H, {n_cols}], got "
            f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}"
        )
    if activation not in FUNCTION_NAMES:
        raise ValueError(f"swiglu_down_proj: activation must be one of {sorted(FUNCTION_NAMES)}, got {activation!r}")
    # The dtype F.linear computes in: autocast's when it is on, else the inputs'.
    if torch.is_autocast_enabled(gate.device.type):
        dtype = torch.get_autocast_dtype(gate.device.type)
    else:
        dtype = torch.promote_types(_out_dtype(gate, up), weight.dtype)
    if torch.compiler.is_compiling():
        return swiglu_down_proj_forward.op(gate, up, weight, dtype, activation)
    return TritonSwiGLUDownProjFunction.apply(gate, up, weight, dtype, activation)


# --------------------------------------------------------------------------------
# Drop-in modules and model patching
# --------------------------------------------------------------------------------
# HF's names of the activations we implement (config.hidden_act, or Gemma 2/3's
# config.hidden_activation) -> the kernels' name.
CONFIG_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def module_activation(mlp):
    """The kernels' name ("silu" or "gelu_tanh") for the activation module of a gated
    MLP (``act_fn``, Phi-3's ``activation_fn``) when it is exactly one we implement, else None."""
    act = getattr(mlp, "act_fn", None)
    if act is None:
        act = getattr(mlp, "activation_fn", None)
    # nn.SiLU (ACT2FN["swish"]) or HF's own SiLUActivation (ACT2FN["silu"]).
    if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else None  # "none" is the erf GELU
    # HF's GELUTanh (alias PytorchGELUTanh, ACT2FN["gelu_pytorch_tanh"]) calls
    # F.gelu(approximate="tanh"), unless built with use_gelu_tanh_python: then a
    # formula of five ops, each rounded to bf16, which is not what we compute.
    # gelu_new and gelu_fast are such formulas too, and "gelu" is the erf GELU.
    if type(act).__name__ in ("GELUTanh", "PytorchGELUTanh"):
        fn = getattr(act, "act", None)  # older versions: no attribute, forward is F.gelu(approximate="tanh")
        if fn is None or (isinstance(fn, functools.partial) and fn.func is F.gelu
                          and not fn.args and fn.keywords == {"approximate": "tanh"}):
            return "gelu_tanh"
    return None


class TritonLlamaMLP(nn.Module):
    """Drop-in replacement for HF's gated MLPs with gate_proj, up_proj and down_proj
    (``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``, ``GemmaMLP``, ...): the same
    projections, the fused SwiGLU or GeGLU between them.

    The three projections stay ``nn.Linear`` (cuBLAS); only ``act(gate) * up``
    runs in Triton. ``activation`` is "silu" or "gelu_tanh". Parameter names
    match the HF module's, so state dicts load either way.
    """

    def __init__(self, config):
        super().__init__()
        name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if name not in CONFIG_ACTIVATIONS:
            raise ValueError(f"{type(self).__name__} implements SiLU and tanh-GELU gating only "
                             f"(hidden_act 'silu' or 'gelu_pytorch_tanh'), the config has {name!r}")
        self.activation = CONFIG_ACTIVATIONS[name]
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self._make_projections(getattr(config, "mlp_bias", False))

    def _make_projections(self, bias):
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)

    @classmethod
    def from_mlp(cls, mlp):
        """Wrap an existing gated MLP, reusing its projection modules (same Parameters).

        Sharing the modules keeps optimizer state, LoRA adapters or quantized
        layers attached to the projections working after the swap.
        """
        activation = module_activation(mlp)
        if activation is None:
            raise ValueError(f"{cls.__name__}: the activation of {type(mlp).__name__} is neither SiLU nor "
                             "GELU with the tanh approximation")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        if hasattr(mlp, "config"):
            new.config = mlp.config
        new.activation = activation
        new._take_projections(mlp)
        return new

    from_llama_mlp = from_mlp  # the older name

    def _take_projections(self, mlp):
        self.hidden_size = getattr(mlp, "hidden_size", getattr(mlp.gate_proj, "in_features", None))
        self.intermediate_size = getattr(mlp, "intermediate_size", getattr(mlp.gate_proj, "out_features", None))
        self.gate_proj = mlp.gate_proj
        self.up_proj = mlp.up_proj
        self.down_proj = mlp.down_proj

    # Recompute h = act(gate) * up in backward instead of keeping it (see
    # TritonSwiGLUDownProjFunction). Only for a plain bias-free nn.Linear
    # down_proj: a LoRA or quantized wrapper must see h itself (a LoRA adapter's
    # A matrix needs h for its own gradient, so h is stored there anyway).
    recompute_hidden = True

    def recomputes_hidden(self):
        """True when forward runs swiglu_down_proj (h recomputed in backward)."""
        down = self.down_proj
        return self.recompute_hidden and type(down) is nn.Linear and down.bias is None

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.recomputes_hidden():
            return swiglu_down_proj(gate, up, self.down_proj.weight, self.activation)
        return self.down_proj(gated_activation(gate, up, self.activation))

    def extra_repr(self):
        act = {"silu": "SwiGLU", "gelu_tanh": "GeGLU (tanh)"}[self.activation]
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, act=fused {act}, "
                f"recompute_hidden={self.recompute_hidden}")


class TritonGateUpMLP(TritonLlamaMLP):
    """The fused layout (HF ``Phi3MLP``, ``GlmMLP``): one ``gate_up_proj`` Linear
    of 2I outputs, [gate | up] on the last dimension, then ``down_proj``.

    The kernels read gate and up in place as the two halves of gate_up_proj's
    output and write their gradients into the halves of one [..., 2I] tensor
    (see swiglu). Parameter names match Phi3MLP's.
    """

    def _make_projections(self, bias):
        self.gate_up_proj = nn.Linear(self.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)

    def _take_projections(self, mlp):
        config = getattr(mlp, "config", None)
        self.hidden_size = getattr(mlp.gate_up_proj, "in_features", getattr(config, "hidden_size", None))
        self.intermediate_size = getattr(mlp.down_proj, "in_features", getattr(config, "intermediate_size", None))
        self.gate_up_proj = mlp.gate_up_proj
        self.down_proj = mlp.down_proj

    def forward(self, x):
        gate_up = self.gate_up_proj(x)  # [..., 2I]: gate | up, never split into copies
        if self.recomputes_hidden():
            return swiglu_down_proj(gate_up, None, self.down_proj.weight, self.activation)
        return self.down_proj(gated_activation(gate_up, None, self.activation))


def triton_mlp_class(module):
    """TritonLlamaMLP or TritonGateUpMLP for a gated MLP we can stand in for, else None.

    Found by type name (``*MLP``), projection modules (nn.Linear, a LoRA or
    quantized wrapper: ours just calls them) and an activation we implement; a
    gated MLP with the erf GELU or any other activation is left alone.
    """
    if not type(module).__name__.endswith("MLP") or isinstance(module, TritonLlamaMLP):
        return None
    if module_activation(module) is None:
        return None

    def has(*names):
        return all(isinstance(getattr(module, name, None), nn.Module) for name in names)
    if has("gate_proj", "up_proj", "down_proj"):
        return TritonLlamaMLP
    if has("gate_up_proj", "down_proj"):
        return TritonGateUpMLP
    return None


# --------------------------------------------------------------------------------
# The check before the swap: does our module compute what the model's does?
# --------------------------------------------------------------------------------
# Names and attributes do not prove the math: a family may clamp the gate, keep
# only its top-k entries (Gemma-3n), order the fused halves [up | gate], or scale
# the output, with the same attribute names. So before swapping, each MLP class
# is run next to its replacement on the same random input, and the swap is
# refused when they differ by more than rounding.
#
# How much rounding: in bf16/fp16 both round h = act(gate) * up to the same
# 16-bit values (bar a rare last-bit flip) and down_proj is the same matmul, so
# the outputs differ by about one rounding of the output dtype at most: eps x
# the largest output. In float32 the activation itself is evaluated with different
# float32 exp or tanh code on either side (each a few ulp from the truth), and
# down_proj sums I such differences with random signs: measured up to 3 float32
# ulps at the size of the largest output (LLaMA and Gemma MLPs, 64 x 128 to
# 3072 x 24576, CPU). So the tolerance is one rounding of the output dtype, and
# never below 8 float32 ulps. A change in the math (another activation, a clamp,
# a scale) moves the output by percents. GELU's erf and tanh forms differ by up
# to 5e-4 (1e-4 relative for small gates): hundreds of float32 ulps, but less
# than one bf16 rounding, so in bf16 only module_activation tells them apart.
CHECK_ROWS = 4
MIN_TOLERANCE = 8 * torch.finfo(torch.float32).eps


def rounding_excess(ours, theirs):
    """None when ``ours`` is ``theirs`` to one rounding of the output dtype at the size
    of the largest element (at least 8 float32 ulps, above); else the max difference
    (NaN never passes)."""
    difference = (ours.double() - theirs.double()).abs().max().item()
    tolerance = max(torch.finfo(ours.dtype).eps, MIN_TOLERANCE) * theirs.double().abs().max().item()
    return None if difference <= tolerance else difference


def _reference_output(mlp, x):
    """What ``mlp`` (ours) computes, with PyTorch's formula in place of the kernel
    (for a device the kernels cannot run on, as CPU tensors on a GPU machine: the
    module is swapped there and moved to the GPU afterwards)."""
    if isinstance(mlp, TritonGateUpMLP):
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    else:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    return mlp.down_proj(REFERENCES[mlp.activation](gate, up))


def check_same_mlp(original, new):
    """Raise SwapMismatch unless ``new`` computes what ``original`` does.

    Both run on CHECK_ROWS random rows of the hidden size, in the module's
    dtype and on its device, under no_grad, each from the same random-number
    state (a dropout inside a shared projection, as LoRA's, draws the same mask
    for both; the global state is left as it was). Allowed difference: one
    rounding of the output dtype at the size of the largest output element,
    at least 8 float32 ulps (above).
    Modules on the meta device (no data) are not checked.
    """
    params = list(original.parameters())
    if any(p.is_meta for p in params):
        return
    floats = [p for p in params if p.is_floating_point()]
    dtype = floats[0].dtype if floats else torch.get_default_dtype()  # none: a quantized layer
    device = params[0].device if params else torch.device("cpu")
    theirs_name, ours_name = type(original).__name__, type(new).__name__
    if not isinstance(new.hidden_size, int):
        raise SwapMismatch(f"{theirs_name} cannot be checked against {ours_name}: its hidden size is unknown")
    x = torch.randn(CHECK_ROWS, new.hidden_size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    rng_devices = [device] if device.type == "cuda" else []
    with torch.no_grad():
        try:
            with torch.random.fork_rng(devices=rng_devices):
                theirs = original(x)
        except Exception as e:  # noqa: BLE001 - any failure: not a module we can stand in for
            first_line = str(e).splitlines()[0] if str(e) else ""
            raise SwapMismatch(f"{theirs_name} cannot be checked against {ours_name}: its forward failed on a "
                               f"[{CHECK_ROWS}, {new.hidden_size}] input ({type(e).__name__}: {first_line})") from None
        with torch.random.fork_rng(devices=rng_devices):
            kernels_run_here = device.type == "cuda" or (device.type == "cpu" and INTERPRET)
            ours = new(x) if kernels_run_here else _reference_output(new, x)
    if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape or theirs.dtype != ours.dtype:
        what = (f"{tuple(theirs.shape)} {theirs.dtype}" if isinstance(theirs, torch.Tensor)
                else type(theirs).__name__)
        raise SwapMismatch(f"{theirs_name} returns {what}, {ours_name} {tuple(ours.shape)} {ours.dtype}")
    difference = rounding_excess(ours, theirs)
    if difference is not None:
        raise SwapMismatch(f"{theirs_name} computes something else than {ours_name} "
                           f"(max difference {difference:.2g} on a random input)")


def replace_swiglu(model):
    """Replace every SiLU- or tanh-GELU-gated MLP in ``model`` with ours; return the count.

    MLPs with gate_proj/up_proj/down_proj become ``TritonLlamaMLP``, Phi-3's
    gate_up_proj/down_proj ``TritonGateUpMLP`` (see triton_mlp_class for how they
    are found). Each MLP class is first checked against its replacement
    (check_same_mlp): one that computes something else raises SwapMismatch and
    the model is left unchanged. kernel_common.swap_modules does the swapping.
    The experts of MoE layers keep their module, with the kernel as its gate
    (fuse_expert_gates); each counts as one.
    """
    experts = checked_expert_gates(model)  # all checks before any change
    count = swap_modules(model, lambda m: triton_mlp_class(m) is not None,
                         lambda m: triton_mlp_class(m).from_mlp(m), check=check_same_mlp)
    return count + fuse_expert_gates(experts)


# --------------------------------------------------------------------------------
# Mixture-of-experts layers (Mixtral, Qwen3-MoE, ... in transformers 5)
# --------------------------------------------------------------------------------
# The experts of an MoE layer are one module with 3-D weights: gate_up_proj
# [E, 2I, H] (each expert's gate and up rows, concatenated) and down_proj [E, H, I].
# Its forward gathers the tokens routed to each expert, multiplies them by that
# expert's slice of gate_up_proj (transformers' grouped or batched matrix products,
# its default "experts implementation"), and calls ``self._apply_gate`` on the
# [S, 2I] result: act(gate) * up, the gated activation of a dense MLP, over all
# routed tokens at once. So the fused kernel goes in there, reading the two halves
# in place (the fused gate_up layout, swiglu_kernel.py), and the products stay
# transformers'.
# transformers' "eager" experts implementation writes act(gate) * up inline instead
# of calling _apply_gate: with it nothing could be fused, and the swap is refused.
def experts_activation(experts):
    """The kernels' activation of a transformers experts module whose gate can be
    fused ("silu" or "gelu_tanh"), or None for any other module."""
    if not (hasattr(experts, "_apply_gate") and getattr(experts, "has_gate", False)
            and getattr(experts, "is_concatenated", False)):
        return None
    gate_up = getattr(experts, "gate_up_proj", None)
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 3:
        return None
    return module_activation(experts)


def _fused_expert_gate(experts, gate_up_out):
    """``_apply_gate`` of a patched experts module: act(gate) * up of [S, 2I], fused."""
    return gated_activation(gate_up_out, None, experts.fused_activation)


def check_same_expert_gate(experts, activation):
    """Raise SwapMismatch unless the fused gate computes the module's own _apply_gate
    (a family may clamp or reorder the halves under the same names), on random rows
    of [CHECK_ROWS, 2I] in the module's dtype, to check_same_mlp's tolerance; and
    unless the module's forward calls _apply_gate at all."""
    name = type(experts).__name__
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if implementation in (None, "eager"):
        raise SwapMismatch(f"{name} runs transformers' eager experts implementation, which computes act(gate) * up "
                           f"inline; load the model with experts_implementation='grouped_mm' (the default)")
    weight = experts.gate_up_proj
    if weight.is_meta:
        return
    x = torch.randn(CHECK_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device,
                                                                                             weight.dtype)
    with torch.no_grad():
        theirs = type(experts)._apply_gate(experts, x)
        kernels_run_here = x.device.type == "cuda" or (x.device.type == "cpu" and INTERPRET)
        gate, up = x.chunk(2, dim=-1)
        ours = gated_activation(x, None, activation) if kernels_run_here else REFERENCES[activation](gate, up)
    if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
        raise SwapMismatch(f"{name}._apply_gate does not return act(gate) * up of its [S, 2I] input")
    difference = rounding_excess(ours, theirs)
    if difference is not None:
        raise SwapMismatch(f"{name}._apply_gate computes something else than the fused gate "
                           f"(max difference {difference:.2g} on a random input)")


def checked_expert_gates(model):
    """[(experts module, activation)] of ``model``, each checked (check_same_expert_gate)."""
    found = [(m, experts_activation(m)) for m in model.modules() if experts_activation(m) is not None]
    for experts, activation in found:
        check_same_expert_gate(experts, activation)
    return found


def fuse_expert_gates(found):
    """Fuse the gated activation of each checked experts module (checked_expert_gates):
    it keeps its weights and forward, its ``_apply_gate`` becomes the kernel."""
    for experts, activation in found:
        experts.fused_activation = activation
        experts._apply_gate = types.MethodType(_fused_expert_gate, experts)
    return len(found)
