"""Probe: the attention backward for Hopper in Gluon with five products per tile instead of the Triton
kernels' seven (attention_kernel.py runs a dK/dV kernel and a dQ kernel, each recomputing S and dP).

One program holds a tile of BLOCK_N keys of one key/value head, and walks every query tile that
sees it, for every query head of its GQA group:

    S^T  = K Q_i^T            P^T = exp2(S^T * scale log2 e - lse_i)     (masked where not visible)
    dP^T = V dO_i^T           dS^T = P^T * (dP^T - delta_i)              (the subtractions inside the products)
    dV  += P^T dO_i           dK  += dS^T Q_i
    dQ_i += dS K              (dS^T through shared memory, added into a float32 dQ by relaxed atomics)

dK and dV stay in registers until the end; dQ of a query tile gets a contribution from every key tile,
so it is summed in global memory: the atomics are fire-and-forget reductions (red.global.add.f32),
and a loader warp keeps the next Q_i / dO_i tiles coming by TMA while the compute warps multiply.
The log-sum-exp is the forward's (log2 units), delta_i = sum_d dO_id O_id from attention_kernel's
delta kernel; what it returns is attention_kernel.attention_backward's (dq, dk, dv).

Not run on a GPU yet; compiled for sm_90 on a CPU by compile_sm90.py beside it.
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
import attention_kernel as ak  # first: kernel_common's import rule
from kernel_common import LAUNCH_OPTIONS
from attention_hopper_kernel import TensorDescriptor, _descriptor, _kv_views, _rows_view, tma_load  # the forward's TMA views

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

# How dQ_i's contribution of each key tile reaches the float32 dQ in global memory (DQ_MODE):
# 0: relaxed vector atomics issued by the compute warps; 1: not at all (timing only: what the
# atomics cost); 2: written to shared memory and added by one TMA reduction (cp.reduce.async.bulk,
# FlashAttention-3's way: the copy engine does the adds), which Gluon offers from Triton 3.9 on.
tma_atomic_add = getattr(tma, "async_atomic_add", None)


@gluon.jit
def _bwd_load(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
              kv_x, kv_c, n0, q_xb, q_xh, q_ch, do_xb, do_xh, do_ch, b, kvh, i0, n_qt, n_iter,
              GROUP: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [kv_x, n0, kv_c], kv_bar, k_smem)
    tma_load(v_desc, [kv_x, n0, kv_c], kv_bar, v_smem)
    for it in range(n_iter):
        s = it % STAGES
        h = kvh * GROUP + it // n_qt
        m0 = (i0 + it % n_qt) * BLOCK_M
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [b * q_xb + h * q_xh, m0, h * q_ch], ready.index(s), q_smem.index(s))
        tma_load(do_desc, [b * do_xb + h * do_xh, m0, h * do_ch], ready.index(s), do_smem.index(s))


@gluon.jit
def _bwd_compute(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_desc, kv_bar, ready, empty, LSE, DELTA,
                 DOC_END, DQ, DK, DV, b, kvh, n0, T, HQ, HKV, i0, n_qt, n_iter, qk_scale, scale,
                 GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                 STAGES: gl.constexpr, DOCS: gl.constexpr, DQ_MODE: gl.constexpr, num_warps: gl.constexpr):
    # [BLOCK_N, BLOCK_M] products (S^T, dP^T): keys along rows, 16 per warp; [BLOCK_N, D] accumulators
    # (dK, dV) the same way; dQ_i [BLOCK_M, D] splits D between the two warp groups.
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                        instr_shape=[16, D // (num_warps // 4), 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dtype: gl.constexpr = k_smem.dtype

    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    if DOCS:  # where each key's document ends (exclusive): the queries that see key n are [n, end[n])
        kend = gl.load(DOC_END + b * T + offs_n, mask=offs_n < T, other=0)
        first_end = gl.load(DOC_END + b * T + n0)
    else:
        kend = gl.full([BLOCK_N], 0, gl.int32, gl.SliceLayout(1, st_layout)) + T
        first_end = T
    dk = gl.zeros([BLOCK_N, D], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, D], gl.float32, kv_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    dq_zero = gl.zeros([BLOCK_M, D], gl.float32, dq_layout)
    k = k_smem.reshape([BLOCK_N, D])
    v = v_smem.reshape([BLOCK_N, D])
    mbarrier.wait(kv_bar, 0)
    for it in range(n_iter):
        s = it % STAGES
        h = kvh * GROUP + it // n_qt
        m0 = (i0 + it % n_qt) * BLOCK_M
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        row = (b * HQ + h).to(gl.int64) * T
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        q = q_smem.index(s).reshape([BLOCK_M, D])
        do = do_smem.index(s).reshape([BLOCK_M, D])
        # The products start from -lse_i / scale and -delta_i instead of zeros: what the softmax and
        # dS subtract is already in, so the [BLOCK_M] vectors (16 registers each in this layout) are
        # dead before the products run. Without it the compute warps spill (80-128 bytes of stack).
        lse = gl.load(LSE + row + offs_m, mask=offs_m < T, other=0.0)
        st = warpgroup_mma(k, q.permute((1, 0)), st_zero - (lse / qk_scale)[None, :], is_async=True)
        delta = gl.load(DELTA + row + offs_m, mask=offs_m < T, other=0.0)
        dpt = warpgroup_mma(v, do.permute((1, 0)), st_zero - delta[None, :], is_async=True)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
        pt = gl.exp2(st * qk_scale)
        # Some pair of the tile not visible: a key after a query (the diagonal), a query past the
        # first key's document or past the row's end (kend <= T).
        if (m0 < n0 + BLOCK_N - 1) | (m0 + BLOCK_M > first_end):
            visible = (offs_n[:, None] <= offs_m[None, :]) & (offs_m[None, :] < kend[:, None])
            pt = gl.where(visible, pt, 0.0)
        pt16 = gl.convert_layout(pt.to(dtype), a_layout)
        dv = warpgroup_mma(pt16, do, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))  # in order: dP^T done, dV running
        dst = (pt * dpt).to(dtype)
        ds_smem.store(dst)
        fence_async_shared()  # the generic-proxy store, before the products read it through the async proxy
        dst16 = gl.convert_layout(dst, a_layout)
        dk = warpgroup_mma(dst16, q, dk, is_async=True)
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k, dq_zero, use_acc=False, is_async=True)
        # P^T and dS^T are read from registers by products in flight: passed to the wait, kept alive.
        dv, dk, dq, pt16, dst16 = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq, pt16, dst16))
        mbarrier.arrive(empty.index(s), count=1)
        if DQ_MODE == 0:
            rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
            cols = gl.arange(0, D, layout=gl.SliceLayout(0, dq_layout))
            gl.atomic_add(DQ + (row + rows[:, None]) * D + cols[None, :], dq * scale, mask=(rows < T)[:, None],
                          sem="relaxed")
        elif DQ_MODE == 2:
            tma.store_wait(0)  # the previous tile's reduction has read the buffer
            dq_smem.reshape([BLOCK_M, D]).store(dq * scale)
            fence_async_shared()
            tma_atomic_add(dq_desc, [b * HQ + h, m0, 0], dq_smem)  # rows past T are clipped by the copy

    if DQ_MODE == 2:
        tma.store_wait(0)

    rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))
    out = ((b * HKV + kvh).to(gl.int64) * T + rows[:, None]) * D + cols[None, :]
    gl.store(DK + out, (dk * scale).to(dtype), mask=(rows < T)[:, None])
    gl.store(DV + out, dv.to(dtype), mask=(rows < T)[:, None])


@gluon.jit
def _attn_bwd_hopper(k_desc, v_desc, q_desc, do_desc, dq_desc, LSE, DELTA, DOC_START, DOC_END, DQ, DK, DV, T, HQ,
                     HKV, kv_xb, kv_xh, kv_ch, q_xb, q_xh, q_ch, do_xb, do_xh, do_ch, qk_scale, scale,
                     GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                     STAGES: gl.constexpr, DOCS: gl.constexpr, DQ_MODE: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                     num_warps: gl.constexpr):
    if HEAVY_FIRST:  # the grid's first axis runs fastest: key tile 0 of every head first (the most queries)
        bkv = gl.program_id(0)
        pid_n = gl.program_id(1)
    else:
        pid_n = gl.program_id(0)
        bkv = gl.program_id(1)
    b = bkv // HKV
    kvh = bkv % HKV
    n0 = pid_n * BLOCK_N
    n1 = gl.minimum(n0 + BLOCK_N, T) - 1
    i0 = n0 // BLOCK_M  # the first query tile that sees a key of this tile
    if DOCS:
        q_end = gl.load(DOC_END + b * T + n1)  # the last key's document end: no later query sees the tile
    else:
        q_end = T
    n_qt = gl.cdiv(q_end, BLOCK_M) - i0
    n_iter = GROUP * n_qt

    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], k_desc.dtype)
    ds_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, BLOCK_M], ds_layout)
    if DQ_MODE == 2:
        dq_smem = gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape, dq_desc.layout)
    else:
        dq_smem = ds_smem  # unused
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    gl.warp_specialize([
        (_bwd_compute, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_desc, kv_bar, ready, empty, LSE,
                        DELTA, DOC_END, DQ, DK, DV, b, kvh, n0, T, HQ, HKV, i0, n_qt, n_iter, qk_scale, scale,
                        GROUP, BLOCK_M, BLOCK_N, D, STAGES, DOCS, DQ_MODE, num_warps)),
        (_bwd_load, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
                     b * kv_xb + kvh * kv_xh, kvh * kv_ch, n0, q_xb, q_xh, q_ch, do_xb, do_xh, do_ch, b, kvh,
                     i0, n_qt, n_iter, GROUP, BLOCK_M, STAGES)),
    ], [1], [24])


def attention_backward_hopper(dout, q, k, v, out, lse, doc_start, scale, block_m=64, block_n=128, stages=2,
                              docs=True, dq_mode=0, heavy_first=False):
    """(dq, dk, dv) of causal attention over packed documents, as attention_kernel.attention_backward;
    dout [B, T, Hq, D], q [B, Hq, T, D], k, v [B, Hkv, T, D], lse the forward's (log2 units)."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    delta = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    ak._attn_bwd_delta_kernel[(triton.cdiv(T, 64), B * Hq)](
        out, dout, delta, dout.stride(0), dout.stride(1), dout.stride(2), T, Hq, D=D, DP=D, BLOCK_T=64)
    doc_end = ak.document_ends(doc_start)
    k3, v3, (kv_xb, kv_xh, kv_ch) = _kv_views(k, v)
    q3, q_xb, q_xh, q_ch = _rows_view(q)
    do3, do_xb, do_xh, do_ch = _rows_view(dout.transpose(1, 2))
    dq = torch.zeros(B, Hq, T, D, dtype=torch.float32, device=q.device)
    dk = torch.empty(B, Hkv, T, D, dtype=q.dtype, device=q.device)
    dv = torch.empty(B, Hkv, T, D, dtype=q.dtype, device=q.device)
    if dq_mode == 2 and tma_atomic_add is None:
        raise RuntimeError(f"dq_mode 2 needs Gluon's TMA reduction (Triton 3.9 or newer), not {triton.__version__}")
    dq3 = dq.view(B * Hq, T, D)
    dq_desc = TensorDescriptor(dq3, list(dq3.shape), list(dq3.stride()), [1, block_m, D],
                               gl.NVMMASharedLayout.get_default_for([1, block_m, D], gl.float32))
    grid = (B * Hkv, triton.cdiv(T, block_n)) if heavy_first else (triton.cdiv(T, block_n), B * Hkv)
    _attn_bwd_hopper[grid](
        _descriptor(k3, block_n, D), _descriptor(v3, block_n, D), _descriptor(q3, block_m, D), _descriptor(do3, block_m, D),
        dq_desc, lse, delta, doc_start, doc_end,
        dq, dk, dv, T, Hq, Hkv, kv_xb, kv_xh, kv_ch, q_xb, q_xh, q_ch, do_xb, do_xh, do_ch,
        scale * math.log2(math.e), scale, GROUP=Hq // Hkv, BLOCK_M=block_m, BLOCK_N=block_n, D=D, STAGES=stages,
        DOCS=docs, DQ_MODE=dq_mode, HEAVY_FIRST=heavy_first, num_warps=8, **LAUNCH_OPTIONS)
    return dq.to(q.dtype), dk, dv
