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

When it applies
---------------
Each adapted layer is checked on every call; anything else runs PEFT's own forward:
one active adapter of plain LoRA (no DoRA or other variant, no adapter bias), no
dropout (p = 0, PEFT's ``nn.Identity``), not merged or disabled, no per-example
adapter names, a plain ``nn.Linear`` base layer with a frozen weight, and x in the
base weight's dtype. QLoRA's 4-bit layers, FP8 base layers (Step 22) and dropout
keep PEFT's path.

Nothing runs on import. See lora_test.py for the checks.
"""

import types

import torch
import torch.nn as nn


class LoRALinearFunction(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T, x [..., K], W [N, K] frozen, A [r, K], B [N, r]."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):
        dtype = weight.dtype
        x2 = x.reshape(-1, x.shape[-1])
        a, b = lora_a.to(dtype), lora_b.to(dtype)  # r rows: cheap; no copy when already dtype
        y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias.to(dtype), x2, weight.t())
        xa = torch.mm(x2, a.t())  # [M, r]
        y.addmm_(xa, b.t(), alpha=scaling)  # the scale and the sum in the GEMM's epilogue
        ctx.save_for_backward(x2, weight, a, b, xa)
        ctx.scaling, ctx.x_shape = scaling, x.shape
        ctx.adapter_dtypes = lora_a.dtype, lora_b.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight, a, b, xa = ctx.saved_tensors
        need_x, _, _, need_a, need_b, _ = ctx.needs_input_grad
        dy = dy.reshape(-1, dy.shape[-1]).to(weight.dtype)
        s = ctx.scaling
        g = torch.mm(dy, b) * s  # [M, r]: the adapter's share of the gradient, scaled where it is small
        dx = da = db = None
        if need_x:
            dx = torch.mm(dy, weight)
            dx.addmm_(g, a)  # both paths' gradients of x summed in the epilogue
            dx = dx.view(ctx.x_shape)
        if need_a:
            da = torch.mm(g.t(), x2).to(ctx.adapter_dtypes[0])
        if need_b:
            db = torch.mm(dy.t(), xa * s).to(ctx.adapter_dtypes[1])
        return dx, None, None, da, db, None


def lora_linear(x, weight, bias, lora_a, lora_b, scaling):
    """PEFT's ``base(x) + lora_B(lora_A(x)) * scaling`` for one plain LoRA adapter, fused."""
    return LoRALinearFunction.apply(x, weight, bias, lora_a, lora_b, float(scaling))


def _fusable(layer, x, args, kwargs):
    """The one active plain adapter of ``layer`` as (A, B, scaling), or None: PEFT's path."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1 or active[0] not in layer.lora_A or active[0] in getattr(layer, "lora_variant", {}):
        return None
    name = active[0]
    if getattr(layer, "use_dora", {}).get(name, False):  # older PEFT: DoRA without lora_variant
        return None
    base = layer.base_layer
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    if (type(base) is not nn.Linear or base.weight.requires_grad or x.dtype != base.weight.dtype
            or not isinstance(layer.lora_dropout[name], nn.Identity) or getattr(layer, "fan_in_fan_out", False)
            or type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear
            or lora_a.bias is not None or lora_b.bias is not None):
        return None
    if base.bias is not None and base.bias.requires_grad:
        return None
    return lora_a.weight, lora_b.weight, layer.scaling[name]


def _fused_forward(layer, x, *args, **kwargs):
    adapter = _fusable(layer, x, args, kwargs)
    if adapter is None:
        return layer._peft_forward(x, *args, **kwargs)
    return lora_linear(x, layer.base_layer.weight, layer.base_layer.bias, *adapter)


def fuse_lora(model):
    """Route every PEFT ``lora.Linear`` of ``model`` through lora_linear where it applies
    (checked per call; PEFT's own forward otherwise). The modules, their parameters,
    state dict and PEFT's save/merge stay PEFT's: only the instance's forward changes.
    Returns how many layers were routed."""
    count = 0
    for module in model.modules():
        if type(module).__name__ != "Linear" or not type(module).__module__.startswith("peft.tuners.lora"):
            continue
        if "_peft_forward" not in module.__dict__:
            module._peft_forward = module.forward
            module.forward = types.MethodType(_fused_forward, module)
        count += 1
    return count
