"""
Step 20, continued -- Projections that read one input: their input gradients summed inside cuBLAS.

An attention layer's q_proj, k_proj and v_proj all read the same normed hidden
state x, and so do a gated MLP's gate_proj and up_proj. Autograd differentiates
each nn.Linear on its own, dx_q = dq @ Wq, dx_k = dk @ Wk, dx_v = dv @ Wv, and its
engine then adds the three up with elementwise kernels: each add reads two
[tokens, hidden] tensors and writes one, 6 B per element in bf16, for nothing a
matrix product could not have done itself.

The idea: cuBLAS computes C = A @ B + beta * C. With beta = 1 the sum happens in
the product's epilogue, as each output tile is written:

    dx = dq @ Wq;  dx.addmm_(dk, Wk);  dx.addmm_(dv, Wv)

The add kernels are gone; each addmm_ reads dx once more (2 B per element),
inside a product that is bound by arithmetic, not memory. At LLaMA-3.1-8B with
2 x 2,048 tokens that is 96 adds of 32 MB tensors per step (two per attention,
one per MLP, 32 layers); README Step 20 has what it buys.

What it takes: the projections must be one autograd node, so that its backward
sees dq, dk and dv together. lora_kernel.LoRALinearFunction is that node: it
already sums a LoRA layer's two gradients of x in the epilogue, and takes a list
of projections, each with or without an adapter. Its products are the cuBLAS
calls autograd makes for nn.Linear, so outputs and weight gradients are the same
bits, and dx differs only in being rounded once instead of after each term.
HF's attention forward calls its three projections one by one, though, and that
code is the model's. ``group_projections`` makes them cooperate without touching
it: the first projection called computes all of them from its input, and the
others, called next with that same tensor, take their output instead of
multiplying again. Members are plain nn.Linear layers and the LoRA layers that
lora_kernel.fuse_lora routes (so it runs first).

FP8 layers (fp8_kernel.FP8Linear) group another way: cuBLASLt's FP8 product cannot
add into its output, so their weights are stacked instead, [Wq; Wk; Wv], and
dx = [dq | dk | dv] @ [Wq; Wk; Wv] is one product whose reduction runs over all
three (FP8StackedFunction with split outputs: the three forward products stay
apart, so q, k and v keep the layout the attention reads).

Where grouping does not apply, each projection runs on its own as before: under
torch.compile (Inductor sees the whole layer and plans the sums itself), without
gradients of x (evaluation, generation, a frozen first layer), for FP8 layers
that do not stack (FP8Linear.stacked_with says which) and quantized ones, for
LoRA layers outside lora_kernel's cases (DoRA, QLoRA, ...;
checked at every call), and for a model whose forward does not call its
projections one after another on one input: when a group's outputs go unused
in two forwards in a row (once is an exception cutting a forward short), that
group falls back to separate products for good, with a one-line note. Between
the first projection's call and the others', nothing may change the weights.
LoRA layers over FP8 base layers do group: their adapters' x A^T and dA read x once,
and their gradients of x through A are summed in one epilogue.

Nothing runs on import. See projections_test.py for the checks.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8_kernel import FP8Linear
from swap_common import called_plainly, set_forward, warn_once
from lora_kernel import (
    LoRALinearFunction, _fusable, _fused_forward, active_adapter_unfused, adapter_input, compute_dtype,
)

# The projections of one module that read the same input, by the names HF gives them.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


# --------------------------------------------------------------------------------
# The autograd node: several products of one input
# --------------------------------------------------------------------------------
# lora_kernel.LoRALinearFunction takes a list of projections, each with or without a
# LoRA adapter: its forward is the products autograd would run, its backward sums
# the gradients of x with addmm_ (beta = 1). Below: what it is given.
def grouped_products(x, specs):
    """The projections (W, b, A, B, s, dropout, fp8) of x as one autograd node, or None
    where they cannot be (then each runs on its own). Each adapter's dropout (None: none)
    runs here, in the group's order, which is the order the model calls the projections
    in; ``fp8``: the FP8Linear holding W (its products in FP8), or None."""
    dtype = compute_dtype(x, [p for spec in specs for p in spec[:2]])
    if dtype is None:
        return None
    scalings = tuple(float(spec[4]) for spec in specs)
    fp8s = tuple(spec[6] for spec in specs)
    params = [p for w, b, a, bb, _, dropout, _ in specs for p in (w, b, a, bb, adapter_input(x, dropout))]
    return LoRALinearFunction.apply(x, dtype, scalings, fp8s, *params)


def shared_input_linear(x, linears):
    """``tuple(m(x) for m in linears)`` for plain nn.Linear modules as one autograd
    node, whose backward sums the input gradients in cuBLAS's epilogues."""
    out = grouped_products(x, [(m.weight, m.bias, None, None, 1.0, None, None) for m in linears])
    return tuple(F.linear(x, m.weight, m.bias) for m in linears) if out is None else out


# --------------------------------------------------------------------------------
# In a model: HF's forward calls the projections one by one
# --------------------------------------------------------------------------------
# A member of a group is a plain nn.Linear (made a GroupedLinear below) or a PEFT
# LoRA layer that lora_kernel.fuse_lora routes (its forward made _grouped_forward).
def _is_routed_lora(module):
    return "_peft_forward" in module.__dict__  # lora_kernel.fuse_lora's mark


def _spec(module, x, args, kwargs):
    """(W, b, A, B, s, dropout, fp8) of one member for the grouped product, or None: its own forward."""
    if _is_routed_lora(module):
        adapter = _fusable(module, x, args, kwargs)
        return None if adapter is None else (module.base_layer.weight, module.base_layer.bias, *adapter)
    return None if args or kwargs else (module.weight, module.bias, None, None, 1.0, None, None)


def _own_forward(module, x, args, kwargs):
    if _is_routed_lora(module):
        return _fused_forward(module, x, *args, **kwargs)  # one fused LoRA layer, or PEFT's forward
    if isinstance(module, FP8Linear):
        return FP8Linear.forward(module, x)
    return F.linear(x, module.weight, module.bias)


def _fp8_group(members):
    return isinstance(members[0], FP8Linear)  # a group is all FP8Linear or none (group_projections)


class ProjectionGroup:
    """The projections of one module that read one input.

    ``output(i, x)``: the first call computes every projection of x at once and
    keeps the others' outputs; a call for one of those, on the same x (same
    tensor, not modified in place since), returns it.
    """

    def __init__(self, owner, names, members, module=None):
        self.owner, self.names, self.members = owner, names, members
        self._module = module  # the module holding the members (a plain reference: the model pickles)
        self._wrapped_said = module is None
        self.enabled = True
        self._abandoned = 0  # forwards in a row that left outputs unused
        self._source, self._version, self._pending = None, None, {}

    def _clear(self):
        self._source, self._version, self._pending = None, None, {}

    def output(self, index, x, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (self._pending and index in self._pending and x is self._source
                and x._version == self._version and not args and not kwargs):
            out = self._pending.pop(index)
            if not self._pending:
                self._clear()  # nothing of x is held past the last projection
                self._abandoned = 0
            return out
        if self._pending:
            # Outputs computed for nothing: an exception cut the last forward short (once),
            # or this model does not call the projections one after another on one input
            # (every time): then separate products from now on.
            self._clear()
            self._abandoned += 1
            if self._abandoned >= 2:
                self.enabled = False
                print(f"note: {self.owner}: {', '.join(self.names)} are not called in turn on one unchanged "
                      f"input; separate products from now on (their input gradients summed by autograd)")
        if not self._wrapped_said and not torch.compiler.is_compiling():
            self._warn_if_wrapped()  # each eager forward until it says so: PEFT may wrap after any call
        outs = None
        # Nothing to gain without an input gradient, or where torch.compile plans the layer.
        # The called member's hooks have run; the others' would not (offloading moves weights in).
        others = [m for i, m in enumerate(self.members) if i != index]
        routed = [m for m in others if _is_routed_lora(m)]  # their forward on the instance is ours
        if (self.enabled and torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling()
                and called_plainly(*(m for m in others if m not in routed), ours=routed)):
            if _fp8_group(self.members):
                # FP8: the weights stacked, one product for dx (fp8_kernel.FP8StackedFunction, split).
                outs = None if args or kwargs else self.members[0].stacked_with(x, *self.members[1:], split=True)
            else:
                specs = [_spec(m, x, args if i == index else (), kwargs if i == index else {})
                         for i, m in enumerate(self.members)]
                if all(spec is not None for spec in specs):
                    outs = grouped_products(x, specs)
        if outs is None:
            return _own_forward(self.members[index], x, args, kwargs)
        self._pending = {i: out for i, out in enumerate(outs) if i != index}
        self._source, self._version = x, x._version
        return outs[index]

    def _warn_if_wrapped(self):
        """Say so if PEFT wrapped a member after the group was made (kernel_ft.apply before
        get_peft_model, or TRL's SFTTrainer given a peft_config): its adapter then runs
        PEFT's own forward, unfused, until apply is called again (which makes the groups
        anew, with the adapters; ungroup_under_adapters)."""
        wrapped = [n for n, m in zip(self.names, self.members)
                   if getattr(getattr(self._module, n, None), "base_layer", None) is m]
        if wrapped:  # once per process: the advice is the same for every group
            self._wrapped_said = True
            warn_once("lora after apply", f"kernel_ft: {self.owner}.{wrapped[0]} got a LoRA adapter after "
                      f"kernel_ft.apply; such adapters run PEFT's own forward, unfused. Call kernel_ft.apply(model) "
                      f"again after get_peft_model (with TRL's peft_config: kernel_ft.apply(trainer.model) before "
                      f"trainer.train()).", stacklevel=3)


class Grouped:
    """A layer (same Parameters, same state-dict names) that computes through its ProjectionGroup."""

    group: ProjectionGroup
    index: int

    @classmethod
    def from_linear(cls, linear, group, index):
        new = cls.__new__(cls)
        # Everything the module holds: the same Parameters (optimizer and ties unchanged),
        # its hooks, its training flag.
        new.__dict__.update(linear.__dict__)
        new.group, new.index = group, index
        return new

    def forward(self, x):
        return self.group.output(self.index, x)

    def ungrouped(self):
        """The same layer out of its group: the plain nn.Linear or FP8Linear it was made from."""
        plain = self.PLAIN.__new__(self.PLAIN)
        plain.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("group", "index")})
        return plain

    def extra_repr(self):
        return super().extra_repr() + f", grouped with {', '.join(self.group.names)}"


class GroupedLinear(Grouped, nn.Linear):
    """An nn.Linear in a group."""
    PLAIN = nn.Linear


class GroupedFP8Linear(Grouped, FP8Linear):
    """An FP8Linear in a group (still an FP8Linear: it stacks with the others)."""
    PLAIN = FP8Linear


def _grouped_forward(layer, x, *args, **kwargs):
    """A routed PEFT LoRA layer's forward once it is in a group."""
    return layer.projection_group.output(layer.projection_index, x, args, kwargs)


def _width(module):
    return module.base_layer.in_features if _is_routed_lora(module) else module.in_features


def group_projections(model):
    """Group each module's projections that read one input (``GROUPS``: q/k/v,
    gate/up) where at least two of them are plain nn.Linear or LoRA layers routed
    by lora_kernel.fuse_lora, or else FP8Linear layers, all of one width. Returns
    the number of groups; a model whose projections are fused already (Phi-3's
    qkv_proj and gate_up_proj) has none to make."""
    count = 0
    for name, module in list(model.named_modules()):
        for names in GROUPS:
            members = [(n, getattr(module, n, None)) for n in names]
            # A forward set on the instance (accelerate's offloading hooks, say) is left to run.
            plain = [(n, m) for n, m in members if (type(m) is nn.Linear and "forward" not in m.__dict__)
                     or (m is not None and _is_routed_lora(m) and "projection_group" not in m.__dict__
                         and not active_adapter_unfused(m))]
            fp8 = [(n, m) for n, m in members if type(m) is FP8Linear and "forward" not in m.__dict__]
            members = plain if len(plain) >= 2 else fp8  # a group is all FP8Linear or none
            if len(members) < 2 or len({_width(m) for _, m in members}) != 1:
                continue
            group = ProjectionGroup(name or type(module).__name__, tuple(n for n, _ in members), [], module)
            for i, (n, m) in enumerate(members):
                if _is_routed_lora(m):
                    m.projection_group, m.projection_index = group, i
                    set_forward(m, _grouped_forward)
                else:
                    m = (GroupedFP8Linear if members is fp8 else GroupedLinear).from_linear(m, group, i)
                    setattr(module, n, m)
                group.members.append(m)
            count += 1
    return count


def ungroup_under_adapters(model):
    """Undo the groups of which PEFT wrapped a member since they were made (kernel_ft.apply
    before get_peft_model): every member of such a group becomes the plain layer it was,
    under its LoRA layer or not, so that lora_kernel.fuse_lora can route the adapters and
    group_projections group them again, adapters included. Returns the number undone."""
    count = 0
    for module in list(model.modules()):
        for names in GROUPS:
            members = {n: getattr(module, n, None) for n in names}
            if not any(isinstance(getattr(m, "base_layer", None), Grouped) for m in members.values()):
                continue
            for n, m in members.items():
                if isinstance(m, Grouped):
                    setattr(module, n, m.ungrouped())
                elif m is not None and "projection_group" in m.__dict__:  # a LoRA layer routed into the group:
                    del m.projection_group, m.projection_index  # fuse_lora's forward again
                    set_forward(m, _fused_forward)
                if isinstance(getattr(m, "base_layer", None), Grouped):
                    m.base_layer = m.base_layer.ungrouped()
            count += 1
    return count


def groups_in(model):
    """How many projection groups ``model`` holds (an earlier group_projections')."""
    return len({id(m.group) if isinstance(m, Grouped) else id(m.projection_group) for m in model.modules()
                if isinstance(m, Grouped) or "projection_group" in m.__dict__})
