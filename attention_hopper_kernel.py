"""
Step 21, on Hopper -- the attention forward written in Gluon, Triton's explicit dialect, with the
schedule of FlashAttention-3 spelled out, since Triton's own compiler does not reach it for this
loop (NOTES.md, Step 21: `tl.range(warp_specialize=True)` is ignored or fails here).

attention_kernel.py leaves the schedule to the compiler; this file writes it by hand:

- Warp specialization. One warp only issues TMA copies (Q once, then K and V tiles into a ring of
  STAGES shared-memory buffers); the compute warps never wait on a global load. The two sides talk
  through mbarriers: `ready[s]` completes when a copy has landed (the copy itself counts the bytes
  in), `empty[s]` when the compute warps are done reading the buffer and the loader may refill it.
- Asynchronous tensor-core products (wgmma) overlapped with the softmax. Each key tile j costs two
  products, S_j = Q K_j^T and O += P_j V_j, and an online softmax between them. The loop issues
  S_j, then O += P_{j-1} V_{j-1}, and waits only for S_j: the softmax of tile j (exp2 on the
  special-function units, about half the time of the two products) runs while the tensor cores
  are still multiplying the previous tile's P V.
- P stays in registers: the second product takes its left operand from registers, in the layout
  the first product's accumulator already has, so P never goes through shared memory.
- Two compute partitions, one warp group each, 64 query rows each, sharing the loader's K and V
  tiles: while one runs its softmax the other's products keep the tensor cores busy
  (FlashAttention-3's ping-pong; here the warp schedulers interleave them).
- Registers handed over: the loader warp gives its registers back (24 left), the compute warps take
  them (240 each), which a warp group's two 64 x 128 float32 tiles (S and O) and P need.

Memory traffic is flash attention's: Q read once, K and V once per query tile that sees them, O and
the log-sum-exp written once. What it computes is attention_kernel.py's forward: causal rows of
one document or packed documents (doc_start), GQA, 16-bit, head dim 64 or 128; it returns the same
out [B, T, Hq, D] and log-sum-exp (log2 units) [B, Hq, T], which either backward reads.
attention_kernel.attention_forward sends it rows of one document that it supports (supports(); no
window, no soft cap) on an H100 / H200: 18% less time than the Triton forward on the 8K document,
level with cuDNN's (results/attention/gluon_h100/). Packed rows stay on the Triton forward: this
one's 128-row query tiles over documents of 40-200 tokens run 1.4x slower than its 64 x 64 tiles
(on documents of 512-4,096 tokens it is 3% faster), and the launcher cannot see the lengths
without a host sync.

The backward, further down, is written the same way: five products per tile where the Triton
kernels compute seven, dQ summed by the copy engine (TMA reductions, Triton 3.8 on) in a float32
buffer that dQ's 16-bit values are then written into, in place. It takes rows of one document and
packed ones.

There is no interpreter for Gluon: the CPU suite runs the Triton kernels, and the compile_sm90.py
scripts in results/attention/gluon_forward and gluon_backward compile these for sm_90 on a CPU.
"""
import functools
import math

import torch

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import LAUNCH_OPTIONS, fast_launch, num_sms  # what every launch asks (fused multiply-adds)

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language._core import builtin as gl_builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

# The TMA load's name: async_copy_global_to_shared in Triton 3.6, async_load from 3.8 on.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gl_builtin
def warpgroup_mma_wait_own(num_outstanding=0, deps=None, _semantic=None):
    # warpgroup_mma_wait, marked as a wait for the issuing warp group's own products only. In a
    # partition of two warp groups (8 warps) each group's wait covers its own products, so Triton's
    # shared-memory analysis makes all 256 threads meet at a barrier after every wait, in case a store
    # follows into a tile the other group's product still reads. The op's warpGroupLocal attribute
    # (Triton 3.9) drops that barrier, and the caller vouches for the stores: in the backward below the
    # tiles the products read (dS^T, Q_i, dO_i) are rewritten only after the barrier that comes before
    # the step releases Q_i and dO_i's slot, which stays.
    results = warpgroup_mma_wait(num_outstanding, deps, _semantic=_semantic)
    first = results if len(deps) == 1 else results[0]
    first.handle.set_attr("warpGroupLocal", _semantic.builder.get_unit_attr())
    return results


@gluon.jit
def _barriers(N: gl.constexpr, count: gl.constexpr):
    # N mbarriers in shared memory, each completing a phase after `count` arrivals (plus, once
    # mbarrier.expect has armed it, the bytes of the copies that name it).
    bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                    q_x, q_t, q_c, kv_x, kv_c, lo_t, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    # One warp, a few registers: it only computes coordinates and issues copies. A buffer is
    # refilled once the compute warps have arrived on its `empty` barrier; a fresh mbarrier counts
    # as having completed the phase before 0, so the first pass over the ring does not wait.
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    for i in gl.static_range(2):  # the query tile, in one piece per compute partition
        tma_load(q_desc, [q_x, q_t + i * q_desc.block_type.shape[1], q_c], q_bar, q_smem.index(i))
    for j in range(n_tiles):
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [kv_x, (lo_t + j) * BLOCK_N, kv_c], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), phase ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma_load(v_desc, [kv_x, (lo_t + j) * BLOCK_N, kv_c], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _softmax_tile(s, m_i, l_i, offs_m, starts, start_n, masked, qk_scale, BLOCK_N: gl.constexpr,
                  s_layout: gl.constexpr):
    # The online softmax of one tile of scores (log2 units: exp2 with the scale times log2 e).
    if masked:  # a document's first tiles and the diagonal: some keys are not visible
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= starts[:, None])
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    # A row that has seen no key yet (its document starts further on) keeps m = -inf;
    # subtracting 0 instead gives exp2(-inf) = 0, not NaN.
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _compute_partition(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, LSE, DOC_START,
                       b, h, bh, m0, T, HQ, lo_t, n_tiles, qk_scale,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                       DOCS: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    # The query rows [m0, m0 + BLOCK_M) against the key tiles [lo_t, lo_t + n_tiles).
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    if DOCS:  # packed rows: where each query's document starts
        starts = gl.load(DOC_START + b * T + offs_m, mask=offs_m < T, other=0)
        full_lo_t = gl.cdiv(gl.max(starts, 0), BLOCK_N)
    else:
        starts = gl.zeros([BLOCK_M], gl.int32, gl.SliceLayout(1, s_layout))
        full_lo_t = 0
    # Key tiles in [full_lo_t, full_hi_t) are visible whole to every row here: no mask there.
    full_hi_t = (m0 + 1) // BLOCK_N
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    q = q_smem.reshape([BLOCK_M, D])  # the [1, BLOCK_M, D] copy as the product reads it

    mbarrier.wait(q_bar, 0)
    # Tile 0 alone: there is no earlier P V to overlap with.
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, offs_m, starts, lo_t * BLOCK_N,
                                       (lo_t < full_lo_t) | (lo_t >= full_hi_t), qk_scale, BLOCK_N, s_layout)
    p = gl.convert_layout(p.to(q_smem.dtype), p_layout)

    for j in range(1, n_tiles):
        cur = j % STAGES
        prev = (j - 1) % STAGES
        # S_j = Q K_j^T, issued first ...
        mbarrier.wait(k_ready.index(cur), (j // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(cur).reshape([BLOCK_N, D]).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # ... then O += P_{j-1} V_{j-1}, left running while the softmax of tile j works.
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(prev).reshape([BLOCK_N, D]), acc, is_async=True)
        # Products finish in order: at most one outstanding means S_j is done.
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        mbarrier.arrive(k_empty.index(cur), count=1)
        t = lo_t + j
        p_new, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, offs_m, starts, t * BLOCK_N,
                                               (t < full_lo_t) | (t >= full_hi_t), qk_scale, BLOCK_N, s_layout)
        # P_{j-1} is read by the product in flight: passed to the wait, it stays alive until then.
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p = gl.convert_layout(p_new.to(q_smem.dtype), p_layout)

    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(last).reshape([BLOCK_N, D]), acc, is_async=True)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
    mbarrier.arrive(v_empty.index(last), count=1)

    # Every query sees itself, so l_i >= 1 on the rows that exist.
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / l_o[:, None]
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    ptrs = O + ((b.to(gl.int64) * T + rows[:, None]) * HQ + h) * D + cols[None, :]
    gl.store(ptrs, out.to(O.dtype.element_ty), mask=(rows < T)[:, None])
    gl.store(LSE + bh.to(gl.int64) * T + offs_m, m_i + gl.log2(l_i), mask=offs_m < T)


@gluon.jit
def _attn_fwd_hopper(q_desc, k_desc, v_desc, O, LSE, DOC_START, T, HQ, GROUP, q_xb, q_xh, q_ch, kv_xb, kv_xh, kv_ch,
                     qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                     DOCS: gl.constexpr, num_warps: gl.constexpr):
    # Two compute partitions of num_warps (4) warps, one warp group each, take half of the BLOCK_M
    # query rows and run on their own, so one's softmax can overlap the other's products
    # (FlashAttention-3's ping-pong, here left to the warp schedulers). Measured against one
    # partition of 8 warps on all 128 rows (whose two warp groups move in step: Gluon syncs a
    # partition before each arrive on a barrier): 913 against 1,149 us on the 8K document, H100.
    # Heaviest programs first: the last query tiles of a causal row read the most keys.
    # Tried and dropped: a persistent grid (a program per SM walking query tiles, the next tile's Q and first K
    # loaded while the last one ends): 8K document 938-945 us against 945-949, 16K 3,738-3,748 against 3,638-3,736,
    # head dim 64 651-667 against 659-660 (H100, results/attention/persistent_and_layout_h100/).
    bh = gl.program_id(0)
    pid_m = gl.num_programs(1) - 1 - gl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    kvh = h // GROUP
    m0 = pid_m * BLOCK_M
    m1 = gl.minimum(m0 + BLOCK_M, T) - 1
    if DOCS:  # documents are contiguous: the tile's first query has the earliest document start
        first_start = gl.load(DOC_START + b * T + m0)
    else:
        first_start = 0
    lo_t = first_start // BLOCK_N  # the key tiles [lo_t, lo_t + n_tiles) hold every visible key
    n_tiles = gl.cdiv(m1 + 1, BLOCK_N) - lo_t
    HALF: gl.constexpr = BLOCK_M // 2

    # Each compute partition's warp group takes its 64 query rows; instr_shape is [m, n, k] of one
    # wgmma: 16 rows per warp, the tile's full width, 16 along the reduction for 16-bit inputs.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = _barriers(1, 1).index(0)
    k_ready = _barriers(STAGES, 1)
    v_ready = _barriers(STAGES, 1)
    k_empty = _barriers(STAGES, 2)  # both compute partitions free a buffer
    v_empty = _barriers(STAGES, 2)

    gl.warp_specialize([
        (_compute_partition, (q_smem.index(0), k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, LSE,
                              DOC_START, b, h, bh, m0, T, HQ, lo_t, n_tiles, qk_scale,
                              HALF, BLOCK_N, D, STAGES, DOCS, s_layout, o_layout)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                           v_empty, b * q_xb + h * q_xh, m0, h * q_ch, b * kv_xb + kvh * kv_xh, kvh * kv_ch,
                           lo_t, n_tiles, BLOCK_N, STAGES)),
        (_compute_partition, (q_smem.index(1), k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, LSE,
                              DOC_START, b, h, bh, m0 + HALF, T, HQ, lo_t, n_tiles, qk_scale,
                              HALF, BLOCK_N, D, STAGES, DOCS, s_layout, o_layout)),
    ], [1, num_warps], [24, 240])


def _hf_layout(t):
    """Whether a [B, H, T, D] tensor is HF's [B, T, H, D] seen through a transpose (heads side by side in a row)."""
    B, H, T, D = t.shape
    sb, sh, st, sd = t.stride()
    return sd == 1 and sh >= D and H * sh <= st and sb == T * st


def _rows_view(t):
    """A rank-3 view [X, T, C] of a [B, H, T, D] tensor that TMA can read, and where head (b, h) sits
    in it: x = b * xb + h * xh, columns from h * ch. Two layouts need no copy: HF's [B, T, H, D]
    seen through a transpose (heads side by side in a row) and [B, H, T, D] with heads stacked."""
    B, H, T, D = t.shape
    sb, sh, st, sd = t.stride()
    if _hf_layout(t):
        return t.as_strided((B, T, H * sh), (sb, st, 1)), 1, 0, sh
    if sd == 1 and st >= D and sh >= T * st and sb == H * sh:  # [B, H, T, D], heads stacked
        return t.as_strided((B * H, T, D), (sh, st, 1)), H, 1, 0
    return _rows_view(t.contiguous())


def _kv_views(k, v):
    """_rows_view of k and v with one set of coordinates for both (the kernels read a key tile
    and its value tile at the same place): (k3, v3, (xb, xh, ch)); copied if their layouts differ."""
    k3, *k_at = _rows_view(k)
    v3, *v_at = _rows_view(v)
    if k_at != v_at:
        k3, *k_at = _rows_view(k.contiguous())
        v3, *v_at = _rows_view(v.contiguous())
    return k3, v3, tuple(k_at)


@functools.lru_cache(maxsize=None)
def _tile_layout(rows, D, dtype):
    # Kept per tile shape: working the layout out costs ~10 us of Python, the descriptor ~2; a fwd+bwd
    # makes eight descriptors (measured on a CPU core; the host time of short rows' eager steps).
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1, rows, D], gl_dtype)


def _descriptor(t3, rows, D):
    """A TMA descriptor of a _rows_view for tiles of rows x D, in the shared-memory layout
    (swizzled) the tensor cores read."""
    return TensorDescriptor(t3, list(t3.shape), list(t3.stride()), [1, rows, D], _tile_layout(rows, D, t3.dtype))


# head dim -> (BLOCK_M, BLOCK_N, STAGES), from results/attention/gluon_h100/gluon_forward.txt (H100):
# 128 x 128 tiles ahead of 128 x 64 everywhere; a third stage of K and V buffers (224 KB of shared
# memory in all at head dim 128) 3,615-3,702 us against 3,875 on the 16K document, level on 8K.
TILE = {64: (128, 128, 2), 128: (128, 128, 3)}


def supports(q, k, v):
    """Whether this forward takes these [B, H, T, D] tensors: 16-bit, one dtype, head dim 64 or 128,
    and what TMA needs of the views it reads (16-byte aligned start and row strides)."""
    if q.shape[-1] not in TILE or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    for t in (q, k, v):
        if t.dtype != q.dtype or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any(st <= 0 or st * t.element_size() % 16 for st in t.stride()[:-1]):
            return False
    return True


def attention_forward_hopper(q, k, v, scale, doc_start=None, block_n=None, stages=None, out=None, lse=None):
    """(out [B, T, Hq, D], lse [B, Hq, T] float32, log2 units) of causal attention; q [B, Hq, T, D],
    k, v [B, Hkv, T, D] (supports()); doc_start [B, T] int32 for packed rows
    (attention_kernel.document_starts), None for one document per row."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if not supports(q, k, v):
        raise ValueError(f"attention_forward_hopper: q {tuple(q.shape)} {q.dtype}: head dim 64 or 128, 16-bit, "
                         f"16-byte aligned rows only")
    block_m, bn, st = TILE[D]
    block_n = block_n or bn
    stages = stages or st
    q3, q_xb, q_xh, q_ch = _rows_view(q)
    k3, v3, (k_xb, k_xh, k_ch) = _kv_views(k, v)
    if out is None:
        out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    _attn_fwd_hopper[(B * Hq, triton.cdiv(T, block_m))](
        _descriptor(q3, block_m // 2, D), _descriptor(k3, block_n, D), _descriptor(v3, block_n, D), out, lse,
        out if doc_start is None else doc_start, T, Hq, Hq // Hkv, q_xb, q_xh, q_ch, k_xb, k_xh, k_ch,
        scale * math.log2(math.e), BLOCK_M=block_m, BLOCK_N=block_n, D=D, STAGES=stages,
        DOCS=doc_start is not None, num_warps=4, **LAUNCH_OPTIONS)
    return out, lse


# --------------------------------------------------------------------------------
# The backward: five products per tile, dQ summed by the copy engine
# --------------------------------------------------------------------------------
# attention_kernel.py's backward runs two kernels, dK/dV and dQ, and each recomputes S and dP:
# seven products where the gradients need five. Here one program holds a tile of BLOCK_N keys of
# one key/value head and walks every query tile (BLOCK_M rows) that sees it, for each query head
# of its GQA group:
#
#     S^T  = K Q_i^T     P^T  = exp2(S^T * scale log2 e - lse_i)      (masked where not visible)
#     dP^T = V dO_i^T    dS^T = P^T * (dP^T - delta_i)
#     dV  += P^T dO_i    dK  += dS^T Q_i    dQ_i += dS K
#
# dK and dV stay in registers to the end. dQ_i gets a contribution from every key tile that
# sees it, so it is summed in a float32 buffer in global memory: 4.3 GB of additions on an 8K
# document (each query row, one D-wide add per key tile). Relaxed atomics from the compute warps
# cost 1.5 ms there (measured: results/attention/gluon_h100/suite_and_backward/); here the
# partition writes dQ_i to shared memory and one TMA reduction (cp.reduce.async.bulk, Gluon's
# tma.async_atomic_add from Triton 3.8 on) adds the whole tile while the warps go on, as
# FlashAttention-3 does. Two such buffers: one is read by the copy engine while the next is written.
# Measured on an H100 (results/attention/gluon_h100/backward_tma/): 3.26-3.34 ms on the 8K document
# against 4.03 with the atomics and 3.73-3.83 for the Triton backward (cuDNN 2.80-2.91).
# Two orderings inside a step then bought 10% more (results/attention/gluon_h100/backward_options/, 8K
# document: 2.96-2.98 ms against 3.27-3.36, 461 TFLOP/s from 423; cuDNN 2.80-3.20 in the same runs):
# * dQ_i's product is issued before dK's and waited for alone, so its hand-off (the store to shared
#   memory and the reduction) runs while dK's product does (3.13-3.20 ms alone);
# * lse_i and delta_i of the next step are loaded once this step's products are done, so the first
#   product of a step never waits on an L2 round trip for them.
# Tried and dropped there: a writer warp of its own issuing the reductions (no faster: 2.91-3.03 ms
# with both orderings), and walking the query tiles from the last one down with every head of the
# group at each (slower, 3.41 ms alone; Nsight Compute: 1.94 GB read and 1.04 GB written to DRAM
# against 1.20 and 0.62 for the walk below).
# The rest of the traffic: K and V read once per program, Q_i, dO_i, lse_i and delta_i once per key
# tile that sees them, dK and dV written once.
#
# Q_i, dO_i and dQ_i are met again by every key tile before i, so what L2 keeps between two programs
# decides how much of them comes from memory: 8.7 GB of tile traffic on the 8K document, where they
# hold 0.27 GB. With the key/value heads interleaved (all key tiles 0 first, then all tiles 1, ...),
# the programs running side by side walk eight heads' queries at once: Nsight Compute counts 1.85 GB
# read and 1.02 GB written to memory, as an LRU model of a 50 MB L2 predicts (1.79 and 0.87,
# results/attention/gluon_backward/l2_model.py). The model says that taking the heads in groups that
# fill one wave of programs (two heads of 64 key tiles on 132 SMs) needs 0.27 and 0.11: each query
# tile read about once, at a load balance within 1% of the ideal (one head at a time: 24% longer).
# Measured on an H100 (results/attention/gluon_h100/backward_order/): 1.39 and 0.84 GB (the real L2
# keeps less than the model's), 8K document 2.81-2.98 ms against 2.92-3.00 interleaved, 16K
# 11.01-11.06 against 11.46-11.61; one head at a time on 8K 3.24-3.28, as the model's balance says.
# Packed rows are another matter: a key tile sees only the query tiles of its own document, so there
# is little for L2 to keep between key tiles, and interleaving every head is what pays (H100, a 16K row
# of 8 key/value heads, with the two settings below): documents of 512-4,096 tokens 2,329 us against
# 2,542 in groups of one head (2,458 in twos, 2,435 in fours), of 40-200 777 against 784.
#
# Keys along the rows of S^T (the transposed orientation) make P^T and dS^T the left operands
# of dV's and dK's products straight from registers; the price is that lse_i and delta_i lie
# along columns (16 registers each per thread), so the products start from -lse_i / scale and
# -delta_i instead of zeros and do the subtractions themselves: no vector stays live across them
# (with them live the compute warps spilled 80-128 bytes).
#
# Two settings the compiler would otherwise choose, each measured on an H100 with Triton 3.9 and the ptxas
# it ships (13.4), backward alone, median of three rounds (results/attention/gluon_backward/own_waits/):
# * The waits are the warp group's own (warpgroup_mma_wait_own above): of the seven barriers of all 256
#   compute threads a step had, the three after the tensor-core waits go; the four the step needs stay
#   (dS^T stored before dQ's product reads it, dQ's buffer free and stored before its reduction, Q_i and
#   dO_i read before their slot is released). The groups then drift apart between hand-offs:
#   documents of 512-4,096 tokens 2,871 -> 2,801 us, of 40-200 840 -> 830; one 8K document level.
# * ptxas allocates registers its own way. Triton 3.8+ asks ptxas for --regAllocOptLevel=2 (its
#   workaround for a ptxas 13 bug), with which this loop spills 60 bytes a thread (68 on packed rows;
#   compiled offline: results/attention/gluon_backward/ptxas_sm90/); ptxas's default spills none.
#   With both: 8K document 2,744-2,914 us against 2,988-3,518 (cuDNN 2,764-2,849 in the same call),
#   documents of 512-4,096 2,521 against 2,869, of 40-200 784 against 840. Most of what the option buys
#   is what 13.4's spills cost: ptxas 12.9, which spills with neither, ran the kernel as it was at
#   2,873-3,442 and 2,539-2,628 (results/attention/gluon_backward/ptxas_sm90/), the same code either way.
tma_reduce_add = getattr(tma, "async_atomic_add", None)  # Triton 3.8 or newer; None before
TMA_REDUCE = tma_reduce_add is not None
BWD_TILE = (64, 128, 2)  # (BLOCK_M queries, BLOCK_N keys, STAGES of Q / dO buffers)
# Given last, ptxas's own default allocation wins over Triton's flag; a user's TRITON_PTXAS_OPTIONS are kept.
BWD_PTXAS_OPTIONS = " ".join(filter(None, [triton.knobs.nvidia.ptxas_options, "--regAllocOptLevel=4"]))


@gluon.jit
def _bwd_step(it, kvh, i0, n_qt, GROUP: gl.constexpr, BLOCK_M: gl.constexpr):
    # Step `it` of a program's walk: (query head, first row of the query tile). Every query head of
    # the key/value head's group in turn, each over the query tiles i0 .. i0 + n_qt - 1 (the next key
    # tile's program reads each Q_i two steps earlier: L2 keeps it in between).
    return kvh * GROUP + it // n_qt, (i0 + it % n_qt) * BLOCK_M


@gluon.jit
def _bwd_load_partition(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
                        kv_x, kv_c, n0, q_xb, q_xh, q_ch, do_xb, do_xh, do_ch, b, kvh, i0, n_qt, n_iter,
                        GROUP: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    # K and V once; then Q_i and dO_i of every (query head, query tile) step into the ring.
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [kv_x, n0, kv_c], kv_bar, k_smem)
    tma_load(v_desc, [kv_x, n0, kv_c], kv_bar, v_smem)
    for it in range(n_iter):
        s = it % STAGES
        h, m0 = _bwd_step(it, kvh, i0, n_qt, GROUP, BLOCK_M)
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [b * q_xb + h * q_xh, m0, h * q_ch], ready.index(s), q_smem.index(s))
        tma_load(do_desc, [b * do_xb + h * do_xh, m0, h * do_ch], ready.index(s), do_smem.index(s))


@gluon.jit
def _grad_at(b, h, H, D: gl.constexpr, HF: gl.constexpr):
    # Where head h of row b sits in a gradient buffer [B, H, T, D] seen as rows: (x, first column, row width).
    # HF: the buffer is [B, T, H, D] (the layers' own layout: every head side by side in a row);
    # otherwise [B, H, T, D], heads stacked.
    if HF:
        return b, h * D, H * D
    else:
        return b * H + h, 0, D


@gluon.jit
def _bwd_row_stats(LSE, DELTA, b, kvh, i0, n_qt, it, n_iter, T, HQ, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                   layout: gl.constexpr):
    # lse_i and delta_i of step `it` (query head, query tile); zeros past the row or the last step.
    h, m0 = _bwd_step(it, kvh, i0, n_qt, GROUP, BLOCK_M)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=layout)
    row = (b * HQ + h).to(gl.int64) * T
    ok = (offs_m < T) & (it < n_iter)
    return gl.load(LSE + row + offs_m, mask=ok, other=0.0), gl.load(DELTA + row + offs_m, mask=ok, other=0.0)


@gluon.jit
def _bwd_compute_partition(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_desc, kv_bar, ready, empty,
                           LSE, DELTA, DOC_END, DQ, DK, DV, b, kvh, n0, T, HQ, HKV, i0, n_qt, n_iter, qk_scale,
                           scale, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                           STAGES: gl.constexpr, DOCS: gl.constexpr, DQ_TMA: gl.constexpr,
                           GRADS_HF: gl.constexpr, num_warps: gl.constexpr):
    # [BLOCK_N, BLOCK_M] products (S^T, dP^T) and [BLOCK_N, D] accumulators (dK, dV): keys along
    # rows, 16 per warp; dQ_i [BLOCK_M, D] splits D between the two warp groups.
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
    # The first step's lse and delta; later ones are loaded a step ahead (below).
    lse, delta = _bwd_row_stats(LSE, DELTA, b, kvh, i0, n_qt, 0, n_iter, T, HQ, GROUP, BLOCK_M,
                                gl.SliceLayout(0, st_layout))
    for it in range(n_iter):
        s = it % STAGES
        h, m0 = _bwd_step(it, kvh, i0, n_qt, GROUP, BLOCK_M)
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        q = q_smem.index(s).reshape([BLOCK_M, D])
        do = do_smem.index(s).reshape([BLOCK_M, D])
        # The first product starts from -lse_i, loaded during the previous step's tail: loaded
        # here, the product would wait for an L2 round trip every step.
        st = warpgroup_mma(k, q.permute((1, 0)), st_zero - (lse / qk_scale)[None, :], is_async=True)
        dpt = warpgroup_mma(v, do.permute((1, 0)), st_zero - delta[None, :], is_async=True)
        st = warpgroup_mma_wait_own(1, (st, ))
        pt = gl.exp2(st * qk_scale)
        # Some pair of the tile not visible: a key after a query (the diagonal), a query past the
        # first key's document or past the row's end (kend <= T).
        if (m0 < n0 + BLOCK_N - 1) | (m0 + BLOCK_M > first_end):
            visible = (offs_n[:, None] <= offs_m[None, :]) & (offs_m[None, :] < kend[:, None])
            pt = gl.where(visible, pt, 0.0)
        pt16 = gl.convert_layout(pt.to(dtype), a_layout)
        dv = warpgroup_mma(pt16, do, dv, is_async=True)
        dpt = warpgroup_mma_wait_own(1, (dpt, ))  # in order: dP^T done, dV running
        dst = (pt * dpt).to(dtype)
        ds_smem.store(dst)  # dQ's product needs dS, i.e. dS^T transposed: read through shared memory
        fence_async_shared()  # the generic-proxy store, before the products read it through the async proxy
        dst16 = gl.convert_layout(dst, a_layout)
        # P^T and dS^T are read from registers by products in flight: passed to the waits, kept alive.
        # dQ_i's product before dK's, waited for alone: its hand-off below runs while dK's product does.
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k, dq_zero, use_acc=False, is_async=True)
        dk = warpgroup_mma(dst16, q, dk, is_async=True)
        dv, dq, pt16 = warpgroup_mma_wait_own(1, (dv, dq, pt16))
        # The next step's lse and delta: loaded now, they live only through dQ's hand-off.
        lse, delta = _bwd_row_stats(LSE, DELTA, b, kvh, i0, n_qt, it + 1, n_iter, T, HQ, GROUP, BLOCK_M,
                                    gl.SliceLayout(0, st_layout))
        dq_x, dq_c, dq_w = _grad_at(b, h, HQ, D, GRADS_HF)
        if DQ_TMA:
            buf = dq_smem.index(it % 2)
            tma.store_wait(1)  # the reduction issued from this buffer two tiles ago has read it
            buf.reshape([BLOCK_M, D]).store(dq * scale)
            fence_async_shared()
            tma_reduce_add(dq_desc, [dq_x, m0, dq_c], buf)  # rows past T: clipped by the copy
        else:  # Triton before 3.8: fire-and-forget float32 atomics (slower, see above)
            rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
            cols = dq_c + gl.arange(0, D, layout=gl.SliceLayout(0, dq_layout))
            gl.atomic_add(DQ + (dq_x.to(gl.int64) * T + rows[:, None]) * dq_w + cols[None, :], dq * scale,
                          mask=(rows < T)[:, None], sem="relaxed")
        dk, dst16 = warpgroup_mma_wait_own(0, (dk, dst16))
        mbarrier.arrive(empty.index(s), count=1)  # Q_i and dO_i read: the loader may refill the slot
    if DQ_TMA:
        tma.store_wait(0)  # the buffers are read before the program's shared memory goes

    rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))
    kv_x, kv_c, kv_w = _grad_at(b, kvh, HKV, D, GRADS_HF)
    out = (kv_x.to(gl.int64) * T + rows[:, None]) * kv_w + kv_c + cols[None, :]
    gl.store(DK + out, (dk * scale).to(dtype), mask=(rows < T)[:, None])
    gl.store(DV + out, dv.to(dtype), mask=(rows < T)[:, None])


@gluon.jit
def _attn_bwd_hopper(k_desc, v_desc, q_desc, do_desc, dq_desc, LSE, DELTA, DOC_END, DQ, DK, DV, T, HQ, HKV,
                     kv_xb, kv_xh, kv_ch, q_xb, q_xh, q_ch, do_xb, do_xh, do_ch, qk_scale, scale,
                     GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                     KV_GROUP, STAGES: gl.constexpr, DOCS: gl.constexpr, DQ_TMA: gl.constexpr,
                     GRADS_HF: gl.constexpr, num_warps: gl.constexpr):
    # Which (row, key/value head) and key tile: programs start in the order of their ids, so the
    # order decides what runs side by side. Groups of KV_GROUP key/value heads one after the other;
    # inside a group key tile 0 of each head first (the tiles that see the most queries: measured
    # 4.04-4.10 ms against 4.69 lightest first on the 8K document), then key tile 1, ... (Why groups:
    # the notes above BWD_TILE.)
    pid = gl.program_id(0)
    n_kt = gl.cdiv(T, BLOCK_N)
    first = pid // (KV_GROUP * n_kt) * KV_GROUP  # the group's first (row, key/value head)
    size = gl.minimum(KV_GROUP, gl.num_programs(0) // n_kt - first)  # the last group may be smaller
    rest = pid - first * n_kt
    pid_n = rest // size
    bkv = first + rest % size
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
    if DQ_TMA:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    else:
        dq_smem = ds_smem  # not used
    kv_bar = _barriers(1, 1).index(0)
    ready = _barriers(STAGES, 1)
    empty = _barriers(STAGES, 1)

    # The compute warps (num_warps) and the loader warp.
    gl.warp_specialize([
        (_bwd_compute_partition, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_desc, kv_bar, ready, empty,
                                  LSE, DELTA, DOC_END, DQ, DK, DV, b, kvh, n0, T, HQ, HKV, i0, n_qt, n_iter,
                                  qk_scale, scale, GROUP, BLOCK_M, BLOCK_N, D, STAGES, DOCS, DQ_TMA, GRADS_HF,
                                  num_warps)),
        (_bwd_load_partition, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, ready,
                               empty, b * kv_xb + kvh * kv_xh, kvh * kv_ch, n0, q_xb, q_xh, q_ch, do_xb, do_xh,
                               do_ch, b, kvh, i0, n_qt, n_iter, GROUP, BLOCK_M, STAGES)),
    ], [1], [24])


# dQ's float32 buffer is 4 bytes per element of q, and dQ in q's dtype 2 more: 402 MB at 16K tokens of
# 32 heads of 128, where FlexAttention's whole backward takes 474 MB beyond its inputs. The cast can
# write into the buffer itself: row r's 16-bit copy fits in the first half of row r's float32 bytes,
# so a program that holds whole rows reads them all, waits at a barrier until every thread of it
# has, and writes them back in place. dQ is then a strided view (rows 2 x D apart) of the buffer,
# and q's dtype costs nothing more. Kernels downstream that take strides read it as it is (our RoPE
# backward, PyTorch's elementwise ops); only a consumer that needs a contiguous tensor copies it.
# Measured on an H100 (results/attention/gluon_h100/dq_in_place/): attention's extra memory in fwd+bwd
# on the 8K document 238 MB from 305 (cuDNN's 439), on a packed 16K row 476 MB (FlexAttention's 474)
# where a cast into a tensor of its own would need about 610 (computed); the backward's time unchanged (2.85-2.89 ms
# against 2.79-2.92 on the 8K document, 2.52 against 2.49-2.53 on documents of 512-4,096 tokens).
@fast_launch
@triton.jit
def _dq_cast_in_place(DQ, DQ_OUT, n_rows, D: tl.constexpr, BLOCK_R: tl.constexpr):
    # DQ: float32 rows of D; DQ_OUT: the same memory seen in q's dtype, rows of 2 * D of it.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D)
    keep = rows[:, None] < n_rows
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(DQ + rows64 * D + cols[None, :], mask=keep)
    # Every thread has read its part of these rows before any thread writes over them: a CTA barrier
    # orders the loads before it against the stores after it (no program reads another's rows).
    tl.debug_barrier()
    tl.store(DQ_OUT + rows64 * (2 * D) + cols[None, :], x.to(DQ_OUT.dtype.element_ty), mask=keep)


def cast_in_place(buffer, dtype):
    """buffer float32 [..., D] (contiguous) -> the same values in ``dtype`` (16-bit) as a view of
    buffer's own memory: [..., D] with rows 2 * D apart. buffer's float32 values are gone."""
    D = buffer.shape[-1]
    if (buffer.dtype != torch.float32 or not buffer.is_contiguous() or torch.finfo(dtype).bits != 16
            or D & (D - 1)):
        raise ValueError(f"cast_in_place: a contiguous float32 buffer of rows of a power of 2 to a 16-bit dtype, "
                         f"not {buffer.dtype} {tuple(buffer.shape)} (contiguous: {buffer.is_contiguous()}) to {dtype}")
    out = buffer.view(dtype)[..., :D]
    n_rows = buffer.numel() // D
    block_r = max(1, 4096 // D)
    _dq_cast_in_place[(triton.cdiv(n_rows, block_r), )](buffer, out, n_rows, D=D, BLOCK_R=block_r,
                                                        num_warps=4)
    return out


# Where the gradients go. A decoder layer hands attention q, k and v as transposed views of its projections'
# [B, T, H, D] outputs, and its backward takes their gradients back through the transpose and a reshape to
# [B, T, H * D]: a gradient laid out [B, H, T, D] is copied there, one read and one write per layer. Our RoPE
# backward writes dQ and dK in the layout of q and k before it whatever it reads, but dV goes straight back
# (34 MB at 16,384 tokens of 8 key/value heads of 128), and so do dQ and dK through a model's own rotary code
# (PyTorch's elementwise ops keep their input's layout). Written in the inputs' layout (rows of every head
# side by side: only where the kernel puts a head's tile changes, _grad_at), the reshape is a view. Traced
# calls keep contiguous gradients: the layout their fake kernel promises. The backward alone is as fast either way
# (H100, three rounds in one call, results/attention/persistent_and_layout_h100/: 8K document 2,762-3,224 us against
# 2,713-3,283, 16K 10,977-11,075 against 10,973-11,519, documents of 512-4,096 2,177-2,270 against 2,221-2,433).
def _grad_rows(B, H, T, D, dtype, device, hf, zeros=False):
    """A [B, H, T, D] gradient buffer: a transposed view of a contiguous [B, T, H, D] (hf), or contiguous."""
    make = torch.zeros if zeros else torch.empty
    if hf:
        return make(B, T, H, D, dtype=dtype, device=device).transpose(1, 2)
    return make(B, H, T, D, dtype=dtype, device=device)


def attention_backward_hopper(dout, q, k, v, lse, delta, doc_end, scale, dq_tma=None, block_m=None, block_n=None,
                              stages=None, kv_group=None, dq_in_place=False, grads_like_inputs=False):
    """(dq, dk, dv) of causal attention, as attention_kernel.attention_backward: dout [B, T, Hq, D],
    q [B, Hq, T, D], k, v [B, Hkv, T, D] (supports()), lse the forward's (log2 units), delta
    [B, Hq, T] (sum_d dO O), doc_end [B, T] int32 (attention_kernel.document_ends) for packed rows,
    None for one document per row. dq_tma: sum dQ by TMA reductions (default: where Triton has them)
    or by float32 atomics. kv_group: how many (row, key/value head) pairs run side by side (default: as
    many as one wave of programs holds all the key tiles of on rows of one document; B * Hkv, every pair key tile
    by key tile, on packed rows).
    dq_in_place: dq is cast into its float32 buffer and returned as a strided view of it (cast_in_place),
    not as a tensor of its own. grads_like_inputs: where q, k and v are all transposed views of HF's
    [B, T, H, D] (what decoder layers hand attention), dq, dk and dv are too, so that the layers' own
    backward (the transpose, then a reshape to [B, T, H * D]) copies none of them; contiguous otherwise."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if not supports(q, k, v):
        raise ValueError(f"attention_backward_hopper: q {tuple(q.shape)} {q.dtype}: head dim 64 or 128, 16-bit, "
                         f"16-byte aligned rows only")
    dq_tma = TMA_REDUCE if dq_tma is None else dq_tma
    if dq_tma and not TMA_REDUCE:
        raise RuntimeError(f"attention_backward_hopper: TMA reductions need Triton 3.8 or newer, "
                           f"not {triton.__version__}")
    bm, bn, st = BWD_TILE
    block_m, block_n, stages = block_m or bm, block_n or bn, stages or st
    k3, v3, (kv_xb, kv_xh, kv_ch) = _kv_views(k, v)
    q3, q_xb, q_xh, q_ch = _rows_view(q)
    do3, do_xb, do_xh, do_ch = _rows_view(dout.transpose(1, 2))
    hf = grads_like_inputs and all(_hf_layout(t) for t in (q, k, v))
    dq = _grad_rows(B, Hq, T, D, torch.float32, q.device, hf, zeros=True)
    dk = _grad_rows(B, Hkv, T, D, q.dtype, q.device, hf)
    dv = _grad_rows(B, Hkv, T, D, q.dtype, q.device, hf)
    dq3 = _rows_view(dq)[0]
    n_kt = triton.cdiv(T, block_n)
    kv_group = kv_group or (B * Hkv if doc_end is not None else max(1, num_sms(q.device) // n_kt))
    _attn_bwd_hopper[(B * Hkv * n_kt, )](
        _descriptor(k3, block_n, D), _descriptor(v3, block_n, D), _descriptor(q3, block_m, D),
        _descriptor(do3, block_m, D), _descriptor(dq3, block_m, D), lse, delta,
        dq if doc_end is None else doc_end, dq, dk, dv, T, Hq, Hkv, kv_xb, kv_xh, kv_ch, q_xb, q_xh, q_ch,
        do_xb, do_xh, do_ch, scale * math.log2(math.e), scale, GROUP=Hq // Hkv, BLOCK_M=block_m, BLOCK_N=block_n,
        D=D, KV_GROUP=min(kv_group, B * Hkv), STAGES=stages, DOCS=doc_end is not None, DQ_TMA=bool(dq_tma),
        GRADS_HF=hf, num_warps=8, ptx_options=BWD_PTXAS_OPTIONS, **LAUNCH_OPTIONS)
    if dq_in_place:  # cast within the buffer, seen in its own (contiguous) layout, then as [B, Hq, T, D] again
        dq = cast_in_place(dq.transpose(1, 2), q.dtype).transpose(1, 2) if hf else cast_in_place(dq, q.dtype)
        return dq, dk, dv
    return dq.to(q.dtype), dk, dv
