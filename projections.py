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
one per MLP, 32 layers); README Step 20 has what it buys on an H200.

What it takes: the projections must be one autograd node, so that its backward
sees dq, dk and dv together. ``shared_input_linear`` is that node (an autograd
Function; the products are the cuBLAS calls autograd makes for nn.Linear, so
outputs and weight gradients are the same bits, and dx differs only in being
rounded to bf16 once instead of after each term). HF's attention forward
calls its three projections one by one, though, and that code is the model's.
``group_projections`` makes them cooperate without touching it: the first
projection called computes all of them from its input, and the others, called
next with that same tensor, take their output instead of multiplying again.

Where grouping does not apply, nothing changes: under torch.compile (Inductor
sees the whole layer and plans the sums itself), without gradients (evaluation,
generation), for projections that are not plain nn.Linear (LoRA, FP8 and
quantized layers keep their own backward), and for a model whose forward does
not call its projections one after another on one input: the first time a
group's outputs go unused, that group falls back to separate products for good,
with a one-line note.

Nothing runs on import. See projections_test.py for the checks.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import first_order_only

# The projections of one module that read the same input, by the names HF gives them.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


# --------------------------------------------------------------------------------
# The autograd node: several products of one input
# --------------------------------------------------------------------------------
class SharedInputLinearFunction(torch.autograd.Function):
    """``tuple(F.linear(x, w, b) for w, b in pairs)`` as one autograd node."""

    @staticmethod
    def forward(ctx, x, dtype, *params):  # params: w0, b0, w1, b1, ... (a bias may be None)
        weights, biases = params[0::2], params[1::2]
        xc = x.to(dtype)  # no copy when x is in dtype already (autocast casts x the same way)
        outs = tuple(F.linear(xc, w.to(dtype), None if b is None else b.to(dtype)) for w, b in zip(weights, biases))
        # The weights are saved as they are and cast again in backward, as swiglu_down_proj
        # does: under autocast with float32 weights that is a copy we do not keep alive.
        ctx.save_for_backward(xc, *weights)
        ctx.x_dtype, ctx.dtype = x.dtype, dtype
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        # An output nobody used gets None, not a tensor of zeros to multiply.
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    @first_order_only("shared_input_linear")
    def backward(ctx, *grads):
        xc, *weights = ctx.saved_tensors
        x2d = xc.reshape(-1, xc.shape[-1])
        dx, params = None, []
        for i, (g, w, bias_dtype) in enumerate(zip(grads, weights, ctx.bias_dtypes)):
            need_w, need_b = ctx.needs_input_grad[2 + 2 * i], ctx.needs_input_grad[3 + 2 * i]
            if g is None:
                params += [None, None]
                continue
            g2d = g.to(ctx.dtype).reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[0]:
                wc = w.to(ctx.dtype)
                if dx is None:
                    dx = g2d @ wc
                else:
                    # The point of this file: beta = 1, the running sum read in the epilogue.
                    dx.addmm_(g2d, wc)
            dw = (g2d.t() @ x2d).to(w.dtype) if need_w else None
            db = g2d.sum(0).to(bias_dtype) if need_b else None
            params += [dw, db]
        if dx is not None:
            dx = dx.view(xc.shape).to(ctx.x_dtype)
        return (dx, None, *params)


def compute_dtype(x, linears):
    """The dtype F.linear would compute in: autocast's when it is on, else the
    inputs' (None when they differ: F.linear itself raises for that)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    dtypes = {x.dtype} | {p.dtype for m in linears for p in (m.weight, m.bias) if p is not None}
    return x.dtype if len(dtypes) == 1 else None


def shared_input_linear(x, linears):
    """``tuple(m(x) for m in linears)`` for plain nn.Linear modules as one autograd
    node, whose backward sums the input gradients in cuBLAS's epilogues."""
    dtype = compute_dtype(x, linears)
    if dtype is None:
        return tuple(F.linear(x, m.weight, m.bias) for m in linears)
    params = [p for m in linears for p in (m.weight, m.bias)]
    return SharedInputLinearFunction.apply(x, dtype, *params)


# --------------------------------------------------------------------------------
# In a model: HF's forward calls the projections one by one
# --------------------------------------------------------------------------------
class ProjectionGroup:
    """The projections of one module that read one input.

    ``output(i, x)``: the first call computes every projection of x at once and
    keeps the others' outputs; a call for one of those, on the same x (same
    tensor, not modified in place since), returns it.
    """

    def __init__(self, owner, names, linears):
        self.owner, self.names, self.linears = owner, names, linears
        self.enabled = True
        self._source, self._version, self._pending = None, None, {}

    def _clear(self):
        self._source, self._version, self._pending = None, None, {}

    def output(self, index, x):
        if (self._pending and index in self._pending and x is self._source
                and x._version == self._version):
            out = self._pending.pop(index)
            if not self._pending:
                self._clear()  # nothing of x is held past the last projection
            return out
        if self._pending:
            # Outputs computed for nothing: this model does not call the projections
            # on one input one after another. Separate products from now on.
            self.enabled = False
            self._clear()
            print(f"note: {self.owner}: {', '.join(self.names)} are not called in turn on one unchanged input; "
                  f"separate products from now on (their input gradients summed by autograd)")
        linear = self.linears[index]
        # Nothing to gain without an input gradient, or where torch.compile plans the layer.
        if not (self.enabled and torch.is_grad_enabled() and x.requires_grad) or torch.compiler.is_compiling():
            return F.linear(x, linear.weight, linear.bias)
        outs = shared_input_linear(x, self.linears)
        self._pending = {i: out for i, out in enumerate(outs) if i != index}
        self._source, self._version = x, x._version
        return outs[index]


class GroupedLinear(nn.Linear):
    """An nn.Linear (same Parameters, same state-dict names) that computes
    through its ProjectionGroup."""

    group: ProjectionGroup
    index: int

    @classmethod
    def from_linear(cls, linear, group, index):
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameters: optimizer and ties unchanged
        new.group, new.index = group, index
        return new

    def forward(self, x):
        return self.group.output(self.index, x)

    def extra_repr(self):
        return super().extra_repr() + f", grouped with {', '.join(self.group.names)}"


def group_projections(model):
    """Group each module's projections that read one input (``GROUPS``: q/k/v,
    gate/up) where at least two of them are plain nn.Linear of the same width.
    Returns the number of groups; a model whose projections are fused already
    (Phi-3's qkv_proj and gate_up_proj) has none to make."""
    count = 0
    for name, module in list(model.named_modules()):
        for names in GROUPS:
            members = [(n, getattr(module, n, None)) for n in names]
            members = [(n, m) for n, m in members if type(m) is nn.Linear]
            if len(members) < 2 or len({m.in_features for _, m in members}) != 1:
                continue
            group = ProjectionGroup(f"{name or type(module).__name__}",
                                    tuple(n for n, _ in members), [m for _, m in members])
            group.linears = [GroupedLinear.from_linear(m, group, i) for i, (_, m) in enumerate(members)]
            for (n, _), grouped in zip(members, group.linears):
                setattr(module, n, grouped)
            count += 1
    return count
