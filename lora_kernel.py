"""
Step 20, part 2 -- A LoRA layer in the base layer's matrix products.

What it computes
----------------
A LoRA layer (PEFT's ``lora.Linear``) adds a low-rank update to a frozen linear layer::

    y = x W^T + b + s * (x A^T) B^T        A [r, K], B [N, r], s = alpha / r

PEFT computes it as written, in separate operations: the base layer, then
``lora_B(lora_A(dropout(x)))``, then ``* s``, then ``+``. With r = 16 the two adapter
products are tiny, but the scaling and the sum are each a full pass over the
[tokens, N] output, and backward repeats the pattern: ``dy * s`` over [tokens, N],
and the two gradients of x (through W and through A) summed in one more pass over
[tokens, K]. In bf16 that is 10 bytes per output value forward (scale: read 2, write
2; sum: read 4, write 2), 4 backward, and 6 per input value for the sum of dx. For one
LLaMA-8B decoder block (seven adapted layers) at 8,192 tokens: about 7 GB, 1.4 ms at
an H200's 4.8 TB/s, 46 ms of a step's 32 blocks, plus a dozen small launches per layer.
A profile of the LoRA step shows them as "other elementwise", a quarter of the GPU
time at 1.5B parameters (README, Step 20).

The idea: no new kernel, the GEMMs' own epilogue
------------------------------------------------
cuBLAS computes ``C = beta * C + alpha * (A @ B)`` in one pass: the sum and the scale
happen in the product's epilogue, while the output tile is still in registers
(``torch.addmm`` / ``Tensor.addmm_``). So::

    forward   y  = x W^T + b                 (one GEMM, bias in the epilogue)
              xa = x A^T                     ([tokens, r], tiny)
              y += s * xa B^T                (addmm_: scale and sum in the epilogue)
    backward  g  = s * dy B                  ([tokens, r], tiny)
              dx = dy W ; dx += g A          (addmm_ again: no separate sum)
              dA = g^T x ; dB = s * dy^T xa  ([r, K] and [N, r])

The [tokens, N] output is written once and read once more by the second product's
epilogue (2 bytes per value instead of 10); the gradient of x is summed inside its
GEMM the same way, and the scale lands on [tokens, r] tensors, r = 16 values a row. The
adapter weights stay in float32 (the optimizer's copy; small updates would vanish in
bf16) and are cast to the compute dtype once per call: r rows, negligible. Their
gradients come back in float32. The arithmetic differs from PEFT's only in where
roundings happen (fewer here: the epilogue adds in float32).

The Function takes a list of such layers on one x (each with or without an adapter):
projections_kernel.py groups an attention's q/k/v and an MLP's gate/up through it, so that
the sum of their gradients of x is one more addmm_ per layer, not an add kernel, and
their adapters' A matrices are stacked: x A^T and dA = g^T x, thin products bound by
their read of x, read x once for the whole group.

When it applies
---------------
Each adapted layer is checked on every call; anything else runs PEFT's own forward:
one active adapter of plain LoRA (no DoRA or other variant, no adapter bias), not
merged or disabled, no per-example adapter names, a plain ``nn.Linear`` (or FP8Linear:
below) base layer with a frozen weight, and x in the base weight's dtype or under
autocast (then the products run in autocast's dtype, as F.linear's would). QLoRA's
4-bit layers keep PEFT's path.

FP8 base layers (Step 22: fp8_kernel.FP8Linear, its weight frozen by LoRA) run their
two products in FP8 here, through fp8_kernel's ``frozen_linear_forward`` and
``frozen_linear_input_grad``: the casts and products of the layer's own forward and
backward. cuBLASLt's FP8 product has no ``beta``, so it cannot add into an output:
the adapter's term goes in by the bf16 ``addmm_`` after it, as above, and the FP8
gradients of x of a group are summed by adds (what autograd would do). Over PEFT's path
that still saves the scale, the sum and the backward scale over every output (12 of its
14 bytes per output value) and the adapters' own dx sums: for one LLaMA-8B block at
8,192 tokens about 5 GB of memory traffic. Under torch.compile an FP8 base layer is an
operator: PEFT's path.

LoRA dropout (p > 0) drops elements of the adapter's input only: x_a = dropout(x), and
``(x_a A^T) B^T``, while the base product reads x. PEFT's own dropout module makes x_a
before the call (its random draws are PEFT's, in PEFT's order); the Function takes it as
the adapter's input, multiplies it by A on its own (it cannot share the stacked read of
x) and returns its gradient to the dropout module, which applies the mask. Without
dropout x_a is x itself and nothing of this runs.

Nothing runs on import. See lora_test.py for the checks.
"""

import math

import torch
import torch.nn as nn

import rmsnorm_kernel
from fp8_kernel import FP8Linear, frozen_linear_forward, frozen_linear_input_grad
from kernel_common import first_order_only, traced
from swap_common import called_plainly, set_forward


class LoRALinearFunction(torch.autograd.Function):
    """Projections of one input x as one autograd node, each y_i = x W_i^T + b_i,
    plus s_i (x_i A_i^T) B_i^T where it has an adapter: x [..., K], W_i [N_i, K],
    A_i [r_i, K], B_i [N_i, r_i]. The adapter reads x itself (x_i = x), or with LoRA
    dropout its own input x_i = dropout(x), computed by PEFT's dropout module before
    the call. One projection is a LoRA layer; several are projections_kernel.py's groups
    (q/k/v, gate/up), whose gradients of x are summed in the same epilogues. ``fp8s``:
    per projection, None (W_i in the products' dtype) or the FP8Linear that holds W_i."""

    @staticmethod
    def forward(ctx, x, dtype, scalings, fp8s, *params):
        # Every cast below is explicit (to ``dtype``, autocast's when it is on: compute_dtype);
        # autocast would cast again, and its casts cannot write into the outputs (out=).
        with torch.autocast(x.device.type, enabled=False):
            return _lora_forward(ctx, x, dtype, scalings, fp8s, *params)

    @staticmethod
    @first_order_only("lora_linear")
    def backward(ctx, *grads):
        with torch.autocast(grads[0].device.type if grads[0] is not None else "cpu", enabled=False):
            return _lora_backward(ctx, *grads)


PER_PROJECTION = 5  # LoRALinearFunction's inputs per projection: W, b, A, B, x_i (b, A, B, x_i may be None)
REMAKE_NORMS = True  # False: keep x itself from forward to backward (A/B, tests)
# Saved per projection: W (of an FP8 layer only if FSDP gathered it in FP8), W8^T and its
# inverse scale (FP8 layers), B, A, x_i, x_i A^T.
SAVED = 7


def _lora_forward(ctx, x, dtype, scalings, fp8s, *params):
    """LoRALinearFunction's forward, autocast off (module-level: torch.compile traces it)."""
    n = PER_PROJECTION
    x2 = x.to(dtype).reshape(-1, x.shape[-1])  # no copy when x is in dtype already
    members = [params[n * i:n * i + n] for i in range(len(scalings))]
    # Optimization: the A of every adapter that reads x stacked, [sum r_i, K], so that
    # x is read once for all of them: xa = x A^T is a thin product, bound by its read of
    # x (M x K), not by arithmetic. A group of three adapters reads x once instead of
    # three times, here and for dA in backward. One adapter: A itself, no copy.
    # An adapter with dropout reads its own input: its product is its own.
    adapters = [a.to(dtype) for _, _, a, _, own in members if a is not None and own is None]
    a_all = (adapters[0] if len(adapters) == 1 else torch.cat(adapters)) if adapters else None
    xa_all = None if a_all is None else torch.mm(x2, a_all.t())  # [M, sum r]
    # Kept for backward only what a gradient needs: x for dW and dA, x A^T for dB.
    needs = ctx.needs_input_grad[4:]
    keep_x = any(needs[n * i] or (needs[n * i + 2] and m[4] is None) for i, m in enumerate(members))
    keep_xa = any(needs[n * i + 3] for i in range(len(members)))
    # Optimization: x an RMSNorm's output, its recipe kept instead of x (rmsnorm_kernel.py,
    # "the output made again in backward"): one [tokens, K] tensor less per norm.
    recipe = (rmsnorm_kernel.remade_later(x) if keep_x and REMAKE_NORMS and all(f is None for f in fp8s)
              else None)
    ctx.recipe = None if recipe is None else recipe[1]
    outs, saved, start = [], [x2 if keep_x and recipe is None else None, a_all, xa_all if keep_xa else None], 0
    for (weight, bias, lora_a, lora_b, own), s, fp8 in zip(members, scalings, fp8s):
        if fp8 is None:
            y, y2 = base_product(x2, weight, bias, dtype, x.shape[:-1])
            # The weight as it is: cast again in backward (no float32 -> bf16 copy kept alive).
            w_saved = (weight, None, None)
        else:  # its FP8 product (a new tensor too); backward keeps W8^T, cached for a frozen weight
            y2, (w_t, w_inv_t, gathered) = frozen_linear_forward(fp8, x2, ctx.needs_input_grad[0])
            y, w_saved = y2.view(*x.shape[:-1], weight.shape[0]), (gathered, w_t, w_inv_t)
        b, a, own2, xa = None, None, None, None
        if lora_a is not None:
            b, r = lora_b.to(dtype), lora_a.shape[0]  # r rows: cheap; no copy when already dtype
            if own is None:
                xa = xa_all[:, start:start + r]
                start += r
            else:
                a, own2 = lora_a.to(dtype), own.to(dtype).reshape(-1, own.shape[-1])
                xa = torch.mm(own2, a.t())
            y2.addmm_(xa, b.t(), alpha=s)  # the scale and the sum in the epilogue
        saved += [*w_saved, b, a, own2, xa if own is not None and keep_xa else None]
        outs.append(y)
    ctx.save_for_backward(*saved, *(recipe[0] if recipe is not None else ()))
    ctx.scalings, ctx.fp8s, ctx.dtype, ctx.x_shape, ctx.x_dtype = scalings, fp8s, dtype, x.shape, x.dtype
    ctx.param_dtypes = [None if p is None else p.dtype for p in params]
    ctx.ranks = [None if m[2] is None else m[2].shape[0] for m in members]
    ctx.set_materialize_grads(False)  # an output nobody used gets None, not zeros to multiply
    return tuple(outs)


def base_product(x2, weight, bias, dtype, lead):
    """x2 W^T (+ bias) in ``dtype``, written into a new [*lead, N] tensor: its own storage,
    not a view of another, so the caller may change it in place as F.linear's output.
    Returns it and its [M, N] view (the adapter's product is added into that in place)."""
    y = x2.new_empty(*lead, weight.shape[0])
    y2 = y.view(-1, weight.shape[0])
    w = weight.to(dtype)
    if bias is None:
        torch.mm(x2, w.t(), out=y2)
    else:
        torch.addmm(bias.to(dtype), x2, w.t(), out=y2)
    return y, y2


def adapter_output_grads(dy, b, xa, s, need_b, b_dtype):
    """For y += s (x A^T) B^T: g = s dy B, the gradient of x A^T (scaled where it is small,
    [M, r]), and dB = dy^T (s x A^T) in ``b_dtype`` when ``need_b`` (else None)."""
    g = torch.mm(dy, b) * s
    db = torch.mm(dy.t(), xa * s).to(b_dtype) if need_b else None
    return g, db


def _lora_backward(ctx, *grads):
    """LoRALinearFunction's backward, autocast off."""
    n = PER_PROJECTION
    x2, a_all, xa_all, *saved = ctx.saved_tensors
    if ctx.recipe is not None:  # x made again by the norm's forward kernel: its bits
        x2 = rmsnorm_kernel.remake(*saved[-2:], ctx.recipe).to(ctx.dtype).reshape(-1, ctx.x_shape[-1])
        saved = saved[:-2]
    need_x, need = ctx.needs_input_grad[0], ctx.needs_input_grad[4:]
    dx, params, gs, start = None, [], [], 0
    for i, (dy, s, r, fp8) in enumerate(zip(grads, ctx.scalings, ctx.ranks, ctx.fp8s)):
        weight, w_t, w_inv_t, b, a, own2, own_xa = saved[SAVED * i:SAVED * i + SAVED]
        need_w, need_bias, need_a, need_b, need_own = need[n * i:n * i + n]
        w_dtype, bias_dtype, a_dtype, b_dtype, own_dtype = ctx.param_dtypes[n * i:n * i + n]
        stacked = r is not None and own2 is None
        xa = xa_all[:, start:start + r] if stacked and xa_all is not None else own_xa
        start += r if stacked else 0
        if dy is None:
            if stacked:  # its adapter's share of dx and dA is zero
                gs.append(a_all.new_zeros(math.prod(ctx.x_shape[:-1]), r))
            params += [None] * n
            continue
        dy = dy.reshape(-1, dy.shape[-1]).to(ctx.dtype)
        if need_x and fp8 is not None:  # FP8: no epilogue to sum in, an add (as autograd's)
            d = frozen_linear_input_grad(fp8, dy, (w_t, w_inv_t, weight), ctx.dtype)
            dx = d if dx is None else dx.add_(d)
        elif need_x:
            w = weight.to(ctx.dtype)
            if dx is None:
                dx = torch.mm(dy, w)
            else:
                dx.addmm_(dy, w)  # the projections' gradients of x summed in the epilogue
        dw = torch.mm(dy.t(), x2).to(w_dtype) if need_w else None
        dbias = dy.sum(0).to(bias_dtype) if need_bias else None
        da = db = d_own = None
        if r is not None:
            g, db = adapter_output_grads(dy, b, xa, s, need_b, b_dtype)
            if stacked:
                gs.append(g)
            else:  # dropout's input: its gradient goes back through PEFT's dropout module
                da = torch.mm(g.t(), own2).to(a_dtype) if need_a else None
                d_own = torch.mm(g, a).view(*ctx.x_shape[:-1], -1).to(own_dtype) if need_own else None
        params += [dw, dbias, da, db, d_own]
    if gs:
        # All stacked adapters at once, as in forward: g = [g_1 | g_2 | ...], [M, sum r].
        g = gs[0] if len(gs) == 1 else torch.cat(gs, dim=1)
        if need_x and dx is not None:
            dx.addmm_(g, a_all)  # and the adapters' gradients of x, in the epilogue too
        stacked_a = [i for i, r in enumerate(ctx.ranks) if r is not None and saved[SAVED * i + 5] is None]
        if any(need[n * i + 2] for i in stacked_a):
            da_all, start = torch.mm(g.t(), x2), 0  # [sum r, K]: x read once
            for i in stacked_a:
                r = ctx.ranks[i]
                if need[n * i + 2] and grads[i] is not None:
                    params[n * i + 2] = da_all[start:start + r].to(ctx.param_dtypes[n * i + 2])
                start += r
    if dx is not None:
        dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
    return (dx, None, None, None, *params)


def lora_linear(x, weight, bias, lora_a, lora_b, scaling, adapter_input=None, fp8=None):
    """PEFT's ``base(x) + lora_B(lora_A(x_a)) * scaling`` for one plain LoRA adapter, fused;
    x_a is ``adapter_input`` (PEFT's dropout of x) when given, else x. ``fp8``: the
    fp8_kernel.FP8Linear whose (frozen) weight and bias these are: its products in FP8."""
    dtype = compute_dtype(x, (weight, bias))
    if dtype is None:
        raise ValueError(f"lora_linear: x is {x.dtype}, the base weight {weight.dtype}: they must agree "
                         f"(or run under autocast)")
    return LoRALinearFunction.apply(x, dtype, (float(scaling),), (fp8,), weight, bias, lora_a, lora_b,
                                    adapter_input)[0]


def compute_dtype(x, weights):
    """The dtype the products of x with the base ``weights`` (None entries skipped) run
    in, as F.linear would: autocast's dtype when it is on (bf16 autocast over float32
    weights, Trainer's ``bf16=True``), else the inputs' own when they agree; None where
    they cannot run fused (float64 under autocast, or x and weights in different dtypes).
    LoRA's adapter weights are cast to it (they stay float32 for the optimizer)."""
    bases = {w.dtype for w in weights if w is not None}
    if torch.is_autocast_enabled(x.device.type):
        # Autocast casts float32 (and half types) to its dtype but leaves float64 alone.
        return None if torch.float64 in bases | {x.dtype} else torch.get_autocast_dtype(x.device.type)
    return x.dtype if bases == {x.dtype} else None


def unfused_adapter(layer, name):
    """Why adapter ``name`` of ``layer`` is beyond lora_linear whatever the call (PEFT's
    forward computes it), or None. lora_linear computes x W^T + b + s (x A^T) B^T with
    plain bias-free A and B over a frozen plain (or FP8) base layer, nothing else."""
    variant = getattr(layer, "lora_variant", {}).get(name)
    if variant is not None or getattr(layer, "use_dora", {}).get(name, False):  # older PEFT: DoRA without variants
        return f"a LoRA variant ({'DoRA' if variant is None else type(variant).__name__})"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out weights"
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear or lora_a.bias is not None \
            or lora_b.bias is not None:
        return "an adapter with a bias (lora_bias)"
    base = layer.base_layer
    if type(base) not in (nn.Linear, FP8Linear):
        return f"a {type(base).__module__.split('.')[0]} {type(base).__name__} base layer, not a plain Linear"
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return "a trained base layer"
    return None


def active_adapter_unfused(layer):
    """unfused_adapter of ``layer``'s one active adapter (None with none or several active:
    that is decided per call)."""
    active = layer.active_adapters
    return unfused_adapter(layer, active[0]) if len(active) == 1 and active[0] in layer.lora_A else None


def unfused_layers(model):
    """{reason: count} over the routed LoRA layers whose active adapter keeps PEFT's
    forward whatever the call (for apply's report)."""
    reasons = {}
    for module in model.modules():
        why = "_peft_forward" in module.__dict__ and active_adapter_unfused(module)
        if why:
            reasons[why] = reasons.get(why, 0) + 1
    return reasons


def _fusable(layer, x, args, kwargs):
    """The one active plain adapter of ``layer`` as (A, B, scaling, dropout, fp8), or None:
    PEFT's path. ``dropout`` is the adapter's dropout module when it drops anything (p > 0,
    training), else None; ``fp8`` the base layer if it is an FP8Linear, else None."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1 or active[0] not in layer.lora_A or unfused_adapter(layer, active[0]):
        return None
    name = active[0]
    base = layer.base_layer
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    if not called_plainly(base, lora_a, lora_b):
        return None  # hooks that must see the call (offloading moves the weights in): PEFT's path calls them
    # An FP8 base layer eagerly only: under a tracer its own operators run.
    fp8 = type(base) is FP8Linear and not (traced(x) or torch.compiler.is_compiling())
    if (type(base) is not nn.Linear and not fp8) or compute_dtype(x, (base.weight, base.bias)) is None:
        return None
    dropout = layer.lora_dropout[name]
    drops = not isinstance(dropout, nn.Identity) and dropout.training and getattr(dropout, "p", 1.0) > 0
    return lora_a.weight, lora_b.weight, layer.scaling[name], dropout if drops else None, base if fp8 else None


def plain_adapter(layer, x):
    """(W, b, A, B, s) of ``layer``'s one adapter where a call on x would run lora_linear over
    a plain base layer with no dropout (the layer routed by fuse_lora), else None: what a
    caller that computes x itself needs to run the same products (swiglu_kernel's LoRA
    down_proj, which recomputes its input h in backward instead of keeping it)."""
    adapter = "_peft_forward" in layer.__dict__ and _fusable(layer, x, (), {})
    if not adapter or adapter[3] is not None or adapter[4] is not None:
        return None
    lora_a, lora_b, scaling = adapter[:3]
    return layer.base_layer.weight, layer.base_layer.bias, lora_a, lora_b, float(scaling)


def adapter_input(x, dropout):
    """What the adapter reads: x, or PEFT's own dropout module applied to it (the same
    module, the same random draws in the same order as PEFT's forward makes them)."""
    return None if dropout is None else dropout(x)


def _fused_forward(layer, x, *args, **kwargs):
    adapter = _fusable(layer, x, args, kwargs)
    if adapter is None:
        return layer._peft_forward(x, *args, **kwargs)
    lora_a, lora_b, scaling, dropout, fp8 = adapter
    return lora_linear(x, layer.base_layer.weight, layer.base_layer.bias, lora_a, lora_b, scaling,
                       adapter_input(x, dropout), fp8)


def lora_layer(module):
    """Whether ``module`` is PEFT's LoRA wrapper of a linear layer (peft.tuners.lora's Linear)."""
    return type(module).__name__ == "Linear" and type(module).__module__.startswith("peft.tuners.lora")


def fuse_lora(model):
    """Route every PEFT ``lora.Linear`` of ``model`` through lora_linear where it applies
    (checked per call; PEFT's own forward otherwise). The modules, their parameters,
    state dict and PEFT's save/merge stay PEFT's: only the instance's forward changes.
    Returns how many layers were routed."""
    count = 0
    for module in model.modules():
        if not lora_layer(module):
            continue
        if "_peft_forward" not in module.__dict__:
            module._peft_forward = module.forward
            set_forward(module, _fused_forward)
        count += 1
    return count
