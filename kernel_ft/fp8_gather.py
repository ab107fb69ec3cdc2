"""
FP8 weights under FSDP2: each process casts its own shard, and the all-gather moves FP8.

README Step 22 (FP8) meets Step 19 (FSDP). Without this, ``--fsdp --fp8`` gathers every
layer's weights in bf16 (2 bytes per weight) and then each process casts the whole
gathered weight to FP8 (an amax pass over it, a cast pass, a transposed copy), in the
forward and again in the backward's gather. Here a per-tensor (``tensorwise``) FP8
layer's weight shard casts itself before the gather, with the scale of the whole
weight, and the gather moves 1 byte per weight:

    before: shard (bf16) --all-gather, 2 B--> W (bf16) --amax, cast--> W8, W8^T
    here:   shard (bf16) --amax, cast--> shard8 --all-gather, 1 B--> W8 --transpose--> W8^T

What it buys per gathered weight: half the bytes over NVLink, and the amax and cast
passes over 1/N of the weight instead of all of it (N processes); the transposed copy
(for dX) is made from the 1-byte W8 in backward, where the layer saves the gathered
weight instead of a whole W8^T (fp8_kernel._linear_save). The bits are those
of the path before: one scale per tensor from the maximum |w| over all shards (one
all-reduce of the maxima of every FP8 weight in the layer, per gather), and the cast
is elementwise, so every shard's bytes are those of the whole weight's cast.

How FSDP2 lets us: a sharded parameter whose local tensor has ``fsdp_pre_all_gather``
and ``fsdp_post_all_gather`` methods gathers what the first returns and hands the
gathered tensors to the second, which builds the unsharded parameter. So:

* ``FP8Shard``: the weight's shard, a plain tensor subclass sharing its memory (the
  optimizer, checkpoints and gradient clipping see the bf16 shard as before), made the
  local tensor of FSDP's DTensor parameter by ``attach`` after ``fully_shard``.
* ``FP8Weight``: the unsharded parameter the layer sees in its forward: a bf16
  tensor to autograd and to every shape check, holding the gathered FP8 bytes and
  their inverse scale, which fp8_kernel's layer uses as they are (``fp8_copy``, with
  W8^T made by a tile transpose, ``transpose_fp8``).
  Its gradient is a plain bf16 tensor, which FSDP reduce-scatters as before. Any
  other read of it computes on the dequantized weight (correct, slow); a write into
  it is refused.

Frozen weights (``--lora``) cast their shard once, and again only when it changes
(a checkpoint loads: its version counter moves); they need no all-reduce after that.

Per-row scaling (``rowwise``) is not gathered in FP8: W^T's scales are maxima over
columns, which span every shard; those layers gather bf16 as before.

Measured (2 x H200, 8B full, NOTES.md Step 22): the same losses, 47.30 instead of 60.51
GiB per GPU, tokens/s within the noise of the eager FSDP step (no faster: that step
waits for the host); 8B LoRA 1.17x bf16's tokens/s. Switched on by
``--fsdp-fp8-gather``, and by default with ``--lora`` (run.assemble calls ``attach``),
whose frozen weights' FP8 copies are then each process's shard, not the whole weight.
"""

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)

import torch
import triton
import triton.language as tl
from torch.utils._pytree import tree_map

from fp8_kernel import FP8_DTYPE, FP8Linear, quantize
from kernel_common import cdiv, fast_launch

aten = torch.ops.aten

# --------------------------------------------------------------------------------
# W8^T from the gathered W8: a tile transpose
# --------------------------------------------------------------------------------
# dX = dY W needs W's columns contiguous (cuBLASLt's FP8 products read both operands
# along the reduction dim), i.e. W8^T [K, N] as its own tensor. PyTorch's copy of a
# transposed view (``w.t().contiguous()``) moves a byte tensor at ~350 GB/s on an
# H200 (8B, 2 GPUs: 40 ms a step for the 224 weights). A tile kernel reads a
# BLOCK x BLOCK tile along its rows (coalesced), and ``tl.trans`` lets the compiler
# turn it in shared memory, so the stores are coalesced along W^T's rows too: each
# byte is read once and written once (measured in NOTES.md Step 22).
TRANSPOSE_TILE = (128, 128, 8)  # rows, columns, warps


@fast_launch
@triton.jit
def _transpose_kernel(X, Y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # X [N, K] bytes, row-major; Y [K, N] = X^T, row-major. One tile per program.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (rows[:, None] < N) & (cols[None, :] < K)
    tile = tl.load(X + rows[:, None].to(tl.int64) * K + cols[None, :], mask=inside)
    tl.store(Y + cols[:, None].to(tl.int64) * N + rows[None, :], tl.trans(tile), mask=tl.trans(inside))


def transpose_fp8(data):
    """data [N, K] (1-byte elements, rows contiguous) -> data^T [K, N], contiguous."""
    N, K = data.shape
    if data.stride(1) != 1 or data.stride(0) != K:
        data = data.contiguous()
    out = torch.empty(K, N, dtype=data.dtype, device=data.device)
    if data.numel():
        bn, bk, warps = TRANSPOSE_TILE
        _transpose_kernel[(cdiv(N, bn), cdiv(K, bk))](data.view(torch.uint8), out.view(torch.uint8), N, K,
                                                       BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out


def _dequantize(w):
    # Each FP8 value times the float32 inverse scale, rounded once to the weight's dtype.
    return (w._data.to(torch.float32) * w._inv_scale).to(w.dtype)


class FP8Weight(torch.Tensor):
    """A gathered per-tensor FP8 weight: ``dtype`` (bf16) outside, FP8 bytes inside.

    ``_data`` [N, K] float8_e4m3fn (a view of FSDP's all-gather buffer), ``_inv_scale``
    the float32 scalar that multiplies it back."""

    @staticmethod
    def __new__(cls, data, inv_scale, dtype, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=dtype,
                                                   device=data.device, requires_grad=requires_grad)

    def __init__(self, data, inv_scale, dtype, requires_grad=False):
        self._data, self._inv_scale = data, inv_scale

    def fp8_copy(self, transpose=False):
        """(data [N, K], inverse scale, data^T [K, N] or None): what fp8_kernel's layer
        multiplies with; the transposed copy made here when asked (for dX)."""
        return self._data, self._inv_scale, transpose_fp8(self._data) if transpose else None

    def __repr__(self):
        return f"FP8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, inv_scale={self._inv_scale})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0]
        if func in (aten.detach.default, aten.alias.default):  # nn.Parameter, autograd: the same weight
            return FP8Weight(w._data, w._inv_scale, w.dtype)
        if func is aten.as_strided.default:  # FSDP: the weight's rows of its (padded) gather buffer
            return FP8Weight(func(w._data, *args[1:], **kwargs), w._inv_scale, w.dtype)
        if func._schema.is_mutable:
            raise RuntimeError(f"{func}: the FP8 weight FSDP gathered is read-only (its shards are the weight)")
        # Anything else reads the weight: it computes on the dequantized values.
        return func(*tree_map(lambda t: _dequantize(t) if isinstance(t, FP8Weight) else t, args),
                    **tree_map(lambda t: _dequantize(t) if isinstance(t, FP8Weight) else t, kwargs))


class FP8Shard(torch.Tensor):
    """A per-tensor FP8 layer's weight as FSDP2 shards it; gathered in FP8 (module doc).

    A plain subclass: the same memory and the same arithmetic as the bf16 tensor, plus
    the two methods FSDP2 calls around its all-gather. Its state lives on the layer
    (``module``, which FSDP passes in): the layer's group of FP8 weights (one FSDP unit)
    and, for frozen weights, their cast shards."""

    # No Python layer around its operations: what they return is a plain tensor (FSDP keeps
    # this object as the local tensor and asks it for the two methods; nothing in our runs
    # needs an operation's result to be one: FSDP's CPU offload would, refused in attach).
    # With the default layer every read of a shard (its size, storage, a view) passed through
    # Python, ~75 per weight and step from FSDP and the optimizer: 491 -> 426 ms of host time
    # per step without it at 8B on 2 GPUs (profile_baseline.py, NOTES.md Step 22).
    __torch_function__ = torch._C._disabled_torch_function_impl

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        group = module._fp8_gather_group
        amax = group.amax.pop(module, None)
        if amax is None:  # the unit's first FP8 weight FSDP asks in this gather: all of their maxima at once
            group.measure(mesh)
            amax = group.amax.pop(module)
        shard = self.detach().as_subclass(torch.Tensor)
        rows = -(-outer_size[0] // mesh.size())  # FSDP pads every shard to the first one's rows
        cached = module._fp8_shard_cache
        frozen = not module.weight.requires_grad
        key = (shard.data_ptr(), shard._version, amax.data_ptr())
        if frozen and cached is not None and cached[0] == key:
            data, inv = cached[1]
        else:
            q = quantize(shard.reshape(-1, outer_size[1]), "tensorwise", amax=amax.view(1))
            data, inv = q.data.view(torch.uint8), q.inv_scale
            if data.shape[0] < rows:
                data = torch.cat([data, data.new_zeros(rows - data.shape[0], data.shape[1])])
            # Frozen weights only: FSDP's local shard never requires grad, its parameter does, and
            # the optimizer's kernel writes a trained shard without moving its version counter.
            if frozen:
                module._fp8_shard_cache = (key, (data, inv))
        return (data,), inv

    def fsdp_post_all_gather(self, outputs, inv_scale, param_dtype, *, out=None):
        (data,) = outputs
        if inv_scale.is_cuda:
            # Made on FSDP's copy-in stream, read by this (the compute) stream's products: its
            # memory must not go back to the copy-in stream's pool before they have run.
            inv_scale.record_stream(torch.cuda.current_stream(inv_scale.device))
        if out is not None:  # later gathers: the same buffer, this gather's scale
            out._inv_scale = inv_scale
            return None
        return FP8Weight(data.view(FP8_DTYPE), inv_scale, param_dtype), (data,)


class _Group:
    """The FP8 weights of one FSDP unit: their maxima over every shard, measured once per
    gather by the first of them FSDP asks (one all-reduce), then taken one by one."""

    def __init__(self, modules):
        self.modules = modules
        self.amax = {}
        self.frozen_amax = None

    def measure(self, mesh):
        shards = {m: m.weight.to_local().detach().as_subclass(torch.Tensor) for m in self.modules}
        frozen = [m for m in self.modules if not m.weight.requires_grad]
        stale = self.frozen_amax is None or set(self.frozen_amax) != set(frozen) or any(
            m._fp8_shard_cache is None or m._fp8_shard_cache[0][:2] != (shards[m].data_ptr(), shards[m]._version)
            for m in frozen)
        measured = [m for m in self.modules if stale or m.weight.requires_grad]
        values = {}
        if measured:
            # One launch for all of them (a multi-tensor max |w|); the maximum of bf16 values is
            # exact. An empty shard (fewer rows than processes) counts as 0.
            local = [shards[m] if shards[m].numel() else shards[m].new_zeros(1) for m in measured]
            maxima = torch.stack(torch._foreach_norm(local, float("inf"))).float()
            if mesh.size() > 1:
                torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
            values = dict(zip(measured, maxima.unbind()))
        if stale:
            self.frozen_amax = {m: values[m] for m in frozen}
        self.amax = {m: amax for m, amax in values.items() if m.weight.requires_grad}
        self.amax.update(self.frozen_amax)  # the frozen set is this gather's (stale above otherwise)


def attach(model):
    """After ``fully_shard`` (and materialize): every per-tensor FP8Linear weight FSDP2
    shards gets an FP8Shard as its local tensor, and the FP8 weights of each FSDP unit one
    group. Returns how many weights were switched. (FSDP2 rebuilds a parameter's local
    tensor when it makes the sharded DTensor, so a subclass given before ``fully_shard``
    would not survive: the switch goes where FSDP2 looks for the two methods.)"""
    from torch.distributed.fsdp import FSDPModule

    count = 0
    for unit in model.modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        if group is None:
            continue
        params = [p for p in group.fsdp_params if p._module_info.param_name == "weight"
                  and isinstance(p._module_info.module, FP8Linear) and p._module_info.module.recipe == "tensorwise"]
        shared = _Group([p._module_info.module for p in params])
        for p in params:
            if p.all_gather_outputs:
                raise RuntimeError("fp8_gather.attach: FSDP has gathered these weights already; attach before "
                                   "the first forward")
            if getattr(p, "offload_to_cpu", False):  # FSDP would move the shard first: a plain tensor then
                raise RuntimeError("fp8_gather.attach: FSDP's CPU offload is not supported with FP8 gathers; "
                                   "gather bf16 (leave out --fsdp-fp8-gather) or turn the offload off")
            p.sharded_param._local_tensor = p.sharded_param._local_tensor.as_subclass(FP8Shard)
            p._init_extensions()
            module = p._module_info.module
            module._fp8_gather_group, module._fp8_shard_cache = shared, None
        count += len(params)
    return count
