"""
Step 21 -- Attention for packed batches: flash attention in Triton that never
looks across documents.

What it computes
----------------
A packed row holds several documents (instruction examples) end to end. Each
token attends to the earlier tokens of its own document and to itself, never to
another document. With ``s`` the first position of token i's document::

    out_i = sum_{j = s..i} softmax_j(scale * q_i . k_j) v_j

per head, with grouped-query attention (GQA: 32 query heads sharing 8 key/value
heads in LLaMA-3-8B; query head h reads key/value head h // (Hq / Hkv)).

Why a kernel
------------
PyTorch's SDPA knows one causal shape. For documents it needs an explicit
boolean mask ``[B, 1, T, T]`` (dataloader.block_causal_mask), which costs B·T²
bytes (1 GiB for one 32K row), rules out SDPA's flash backend and computes every
query-key pair of the T x T square, including all pairs of different documents
the mask then throws away. With the bundled data's ~100-token examples in a
16K row, under 1% of the causal triangle is inside a document.

Flash attention (Dao et al.) streams over key tiles with an online softmax:
for each block of BLOCK_M queries it keeps the running maximum m, the running sum
l of exp(s - m) and the running output, rescaled whenever m grows, so the
T x T scores never reach memory. What we add is where the loop starts. Documents
are contiguous, so the keys any query of a tile may see start at the document
start of the tile's *first* query (the smallest one) and end at the tile's last
query: the key loop runs over exactly those tiles, and a tile of queries deep in
a 100-token document reads two or three key tiles instead of the whole prefix.
The boundaries come in as one int32 per token (``doc_start``: the position where
its document starts), which the batch already implies (position ids restart at
0 with each document: ``doc_start = t - position_id``). No mask exists anywhere.

FlexAttention (PyTorch) reaches the same skipping differently: a ``BlockMask``
built ahead of time lists, per query tile, the key tiles that are full, partial
or empty, from a ``mask_mod`` function that torch.compile inlines into a
generated flash kernel. Ours has the document structure built in: the key range
of a query tile is two loads (no block mask to build and keep, no compilation),
and it cannot express other masks (sliding windows, prefix-LM).

Memory traffic: the forward reads q once and each needed k, v tile once per
query tile, writes the output and one float32 log-sum-exp per row and head
(the backward recomputes the probabilities from it instead of storing them).
The FLOPs counted in benchmarks are those of the visible pairs only.

The backward (FlashAttention-2's): with P = softmax(S), S = scale · Q K^T, and
the upstream dO::

    dV = P^T dO            dP = dO V^T
    dS = P * (dP - delta)  delta_i = sum_d dO_id O_id   (= sum_j P_ij dP_ij)
    dQ = scale · dS K      dK = scale · dS^T Q

One kernel walks the key tiles (dK, dV: for key tile j, the query tiles from j to
the end of the document of its last key, for every query head of the group, so
no two programs write the same dK row), one walks the query tiles (dQ, the
forward's loop). ``delta`` comes first, from a small kernel that reads O and dO once.

Masks only where needed: in a query tile's key range, most tiles of a long
document are seen whole by every query of the tile (inside the document, before
the diagonal). Each loop runs in three pieces, the document's first tile and the
diagonal with the mask, the run between them without it (``_split``); a
``tl.constexpr`` flag compiles the loop body twice, once without the mask code.

Soft-capped scores (Gemma-2): the scores s = scale q k^T pass through
cap * tanh(s / cap) before the softmax, which SDPA cannot do (HF runs such models
with its eager attention: the T x T scores in memory). Here it is one more
elementwise step on the tile; the backward multiplies dS by the cap's derivative
1 - tanh^2, recomputed with the probabilities.

What each change bought (H100, bf16, 32 query / 8 key-value heads of 128; ms on
one 8,192-token document, 16,384 tokens in 133 documents, in 7 documents;
results/attention/tma_h100.txt):

* TMA loads (Hopper's tensor memory accelerator) in the forward and the dK/dV
  kernel: a tensor descriptor per input describes its [B, H, T, D] layout once,
  and one instruction copies a whole tile into shared memory, asynchronously,
  the rows past T and the padded head-dim columns filled with zeros by the
  hardware; no address computed per element, and the copies of the next tiles
  run under the products of this one. Same call, before -> after: forward
  1.21-1.34 / 0.31 / 1.04 -> 1.13-1.26 / 0.22 / 0.87-0.90, forward and backward
  5.44-5.46 / 1.33 / 4.27 -> 4.87-5.01 / 1.04 / 3.91-3.92. The dQ kernel gained
  nothing and keeps plain loads; so do devices before Hopper and layouts the
  copies cannot take (a start or row stride not a multiple of 16 bytes).
* Measured and not kept (results/attention/hopper_limits_h100/): dQ added up
  across key tiles in float32 by the dK/dV kernel (five products per tile instead
  of seven, FlashAttention-2's way), with TMA reduce-adds or relaxed atomics, tiles
  from 16 x 128 to 128 x 128: at best 0.72x of the two kernels. With 64 keys per
  tile the adds move 8.6 GB of float32 for one 8K document, more than the atomics
  can hide (~3 TB/s here); larger key tiles spill the dK and dV accumulators.
  128-query tiles with TMA. Warp specialization (``tl.range(warp_specialize=True)``):
  does not compile for this loop in Triton 3.6; in the tutorial's one-loop shape it
  compiles with 8 warps and is no faster, with 4 warps it returns NaN.

Triton concepts new in this step
--------------------------------
* ``tl.dot`` on tiles: the matrix units (tensor cores), float32 accumulation
  from bf16/fp16 tiles; for float32 inputs ``input_precision="ieee"`` keeps
  full float32 (the default would round to TF32).
* A loop with bounds computed at run time from data (``range(lo, hi, BLOCK_N)``):
  every program does only the work its documents need.
* exp2 instead of exp: the scores are scaled by log2(e) once, so each softmax
  element is one ``ex2`` instruction; the scale itself rides in the subtraction
  of the running maximum (``x * unit - m``: one fused multiply-add).
* ``tl.dot(a, b, acc)``: the tensor cores add the product into the accumulator.
* Tensor descriptors (``TensorDescriptor`` on the host, ``desc.load`` in the
  kernel): TMA copies, above.

Nothing runs on import. See attention_test.py for the checks.
"""

import contextlib
import inspect
import math

import torch

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import (
    IN_INTERPRETER, INTERPRET, SUPPORTED_DTYPES, SwapMismatch, cast_to, cdiv, check_kernel_device, decoder_of,
    evaluating, exp, fast_launch, first_order_only, gpu_clock, kernel_op, log, next_power_of_2, plain_causal_attention,
    probe_rounding, tanh, vocabulary_size, wrap_forward,
)

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


# --------------------------------------------------------------------------------
# The reference: plain softmax attention, document by document
# --------------------------------------------------------------------------------
def document_starts(position_ids):
    """[B, T] position ids that restart at 0 with every document (packing) -> [B, T]
    int32, the position where each token's document starts. Positions that count on
    from 0 in one piece (one document per row) give 0 everywhere."""
    t = torch.arange(position_ids.shape[-1], device=position_ids.device)
    return (t - position_ids).clamp(min=0).minimum(t).to(torch.int32)


def document_ends(doc_start):
    """[B, T] document starts -> [B, T] int32, one past the last position of each
    token's document (the next start, or T). No host sync: a reversed running minimum."""
    T = doc_start.shape[-1]
    t = torch.arange(T, device=doc_start.device)
    begins = torch.where(doc_start == t, t, T)  # a document begins where a token is its own start
    after = torch.cat([begins[..., 1:], torch.full_like(begins[..., :1], T)], dim=-1)
    return torch.flip(torch.cummin(torch.flip(after, [-1]), dim=-1).values, [-1]).to(torch.int32)


def visible_keys(doc_start, window=0):
    """[B, T] document starts -> [B, T, T] bool, True where query t may attend to key
    s: the same document, s <= t, and with a ``window`` > 0, s > t - window. The
    dense mask the kernel never builds (the reference, the model probe and SDPA do)."""
    t = torch.arange(doc_start.shape[-1], device=doc_start.device)
    visible = (t[None, :, None] >= t[None, None, :]) & (t[None, None, :] >= doc_start[:, :, None].long())
    if window:
        visible &= t[None, None, :] > t[None, :, None] - window
    return visible


def attention_reference(q, k, v, doc_start, scale, window=0, softcap=0.0):
    """The truth: q [B, Hq, T, D], k, v [B, Hkv, T, D], doc_start [B, T]; per row and
    head, softmax(scale q k^T) v over the visible keys (same document, not later,
    and with a sliding ``window`` > 0 fewer than ``window`` positions back); with a
    ``softcap`` > 0 the scores are capped first, as Gemma-2's: cap tanh(scores / cap).
    In the inputs' dtype, float64 for the truth. Returns [B, Hq, T, D]."""
    B, Hq, T, D = q.shape
    group = Hq // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible_keys(doc_start, window)[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# --------------------------------------------------------------------------------
# Tile helpers shared by the kernels
# --------------------------------------------------------------------------------
@triton.jit
def _scores(q, k, DOT_PRECISION: tl.constexpr):
    # q [BM, D], k [BN, D] -> q k^T [BM, BN] in float32. The interpreter multiplies
    # in float32 (NumPy); on the GPU bf16 tiles go to the tensor cores.
    if IN_INTERPRETER:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)


@triton.jit
def _matmul_add(acc, a, b, DOT_PRECISION: tl.constexpr):
    # acc + a b: the tensor cores add the product into the accumulator they hold
    # (no separate pass over acc).
    if IN_INTERPRETER:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _logits(q, k, cap_in, DOT_PRECISION: tl.constexpr, PRECISE: tl.constexpr, SOFTCAP: tl.constexpr):
    # The scores are x * unit: x = q k^T, unit = scale (times log2(e) for exp2); or,
    # with Gemma-2's cap on them (HF: cap * tanh(scores / cap)), x = t = tanh(scale
    # q k^T / cap) (cap_in = scale / cap) and unit = cap. Kept apart, the scale costs
    # nothing: _exp(x * unit - m) is one fused multiply-add per score. The backward
    # needs t for the cap's derivative: d(cap t)/d(scale q k^T) = 1 - t^2. Float32
    # inputs take the accurate tanh: with cap 50 most scores are small, where
    # 2 sigmoid(2x) - 1 cancels (kernel_common.tanh).
    s = _scores(q, k, DOT_PRECISION)
    if SOFTCAP:
        return tanh(s * cap_in, PRECISE)
    else:
        return s


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    # The scores arrive pre-scaled for this: by scale * log2(e) for exp2, one fast
    # ex2 instruction per element (16-bit inputs); by scale alone for float32
    # inputs, whose exp must be float32-accurate, as PyTorch's is (an error in the
    # exponent becomes a relative error of the probability).
    if PRECISE:
        return exp(x, True)
    else:
        return tl.exp2(x)


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return log(x)
    else:
        return tl.log2(x)


@triton.jit
def _tile_for_dot(x, like):
    # A float32 tile (probabilities, dS) for a product with ``like``'s 16-bit tiles:
    # rounded to their dtype on the GPU, as every flash kernel does (the tensor
    # cores take both operands in one dtype); kept in float32 in the interpreter.
    if IN_INTERPRETER:
        return x
    else:
        return x.to(like.dtype)


@triton.jit
def _rows(base, offs, stride, ok, offs_d, d_ok, MASK_ROWS: tl.constexpr):
    # A [len(offs), DP] tile of a [.., T, D] tensor: rows ``offs``, the head dim
    # padded to DP. Rows past T exist only in edge tiles (MASK_ROWS); the padded
    # head-dim columns fold away when D is a power of two (d_ok is all-true then).
    if MASK_ROWS:
        return tl.load(base + offs[:, None] * stride + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    else:
        return tl.load(base + offs[:, None] * stride + offs_d[None, :], mask=d_ok[None, :], other=0.0)


@triton.jit
def _head_rows(X, b, h, start, sb, sh, st, T, offs_d, d_ok, BLOCK: tl.constexpr, DP: tl.constexpr,
               MASK_ROWS: tl.constexpr, TMA: tl.constexpr):
    # Rows [start, start + BLOCK) of head h of batch row b: a [BLOCK, DP] tile.
    # TMA (Hopper's tensor memory accelerator): X is a tensor descriptor, and one
    # instruction copies the whole tile to shared memory, asynchronously, rows past
    # T and padded head-dim columns filled with zeros by the hardware: no address
    # per element, no masks, and the loads of the next tiles overlap the products.
    if TMA:
        return X.load([b, h, start, 0]).reshape(BLOCK, DP)
    else:
        offs = start + tl.arange(0, BLOCK)
        return _rows(X + b.to(tl.int64) * sb + h * sh, offs, st, offs < T, offs_d, d_ok, MASK_ROWS)


@triton.jit
def _visible(offs_m, offs_n, starts, WINDOW):
    # Query offs_m may see key offs_n: not later, not before its document's start,
    # and fewer than WINDOW positions back (WINDOW = T: no window).
    return (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= starts[:, None]) \
        & (offs_n[None, :] > offs_m[:, None] - WINDOW)


@triton.jit
def _split(lo, hi, full_lo, full_hi):
    # The tile range [lo, hi) holds one run of tiles every pair of which is visible,
    # [full_lo, full_hi) (empty when full_lo >= full_hi): those skip the mask. Returns
    # the ends of the three runs: masked [lo, e1), full [e1, e2), masked [e2, hi).
    e1 = tl.minimum(tl.maximum(full_lo, lo), hi)
    e2 = tl.maximum(tl.minimum(full_hi, hi), e1)
    return e1, e2


# --------------------------------------------------------------------------------
# Forward: one program per (query tile, batch row and query head)
# --------------------------------------------------------------------------------
@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, K, V, b, kvh, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, offs_m, starts, offs_d, d_ok, lo,
               hi, T, WINDOW, unit, cap_in, BLOCK_N: tl.constexpr, DP: tl.constexpr,
               DOT_PRECISION: tl.constexpr, PRECISE: tl.constexpr, SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
               TMA: tl.constexpr):
    # The online softmax over the key tiles [lo, hi). MASKED: tiles on a document's
    # edge or the diagonal, where some pairs are not visible; the others (most of a
    # long document's tiles) skip building and applying the mask.
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _head_rows(K, b, kvh, start_n, sk_b, sk_h, sk_t, T, offs_d, d_ok, BLOCK_N, DP, MASKED, TMA)
        v = _head_rows(V, b, kvh, start_n, sv_b, sv_h, sv_t, T, offs_d, d_ok, BLOCK_N, DP, MASKED, TMA)
        x = _logits(q, k, cap_in, DOT_PRECISION, PRECISE, SOFTCAP)
        if MASKED:
            x = tl.where(_visible(offs_m, offs_n, starts, WINDOW), x, float("-inf"))
        # Online softmax: a new maximum rescales what was summed so far.
        m_new = tl.maximum(m_i, tl.max(x, 1) * unit)
        if MASKED:
            # A row that sees nothing in this tile yet (its document starts further on)
            # keeps m = -inf; subtracting 0 instead gives exp2(-inf) = 0, not NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        p = _exp(x * unit - m_sub[:, None], PRECISE)
        alpha = _exp(m_i - m_sub, PRECISE)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _matmul_add(acc * alpha[:, None], _tile_for_dot(p, v), v, DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _query_tile_keys(DOC_START, b, pid_m, T, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The key tiles a query tile [m0, m1] needs, and the run of them it sees whole.
    m0 = pid_m * BLOCK_M
    m1 = tl.minimum(m0 + BLOCK_M, T) - 1
    # From the document start of its first query (the smallest, documents being
    # contiguous), rounded down to a tile, to its last query.
    lo = (tl.maximum(tl.load(DOC_START + b * T + m0), m0 - WINDOW + 1) // BLOCK_N) * BLOCK_N
    hi = m1 + 1
    # Seen by every query: keys at or after the last query's document start (the
    # largest), within the last query's window, and not after the first query.
    full_lo = tl.cdiv(tl.maximum(tl.load(DOC_START + b * T + m1), m1 - WINDOW + 1), BLOCK_N) * BLOCK_N
    full_hi = ((m0 + 1) // BLOCK_N) * BLOCK_N
    e1, e2 = _split(lo, hi, full_lo, full_hi)
    return lo, e1, e2, hi


@fast_launch
@triton.jit(do_not_specialize=["T", "WINDOW"])  # vary with T: not specialized (rmsnorm_kernel.py)
def _attn_fwd_kernel(
    Q, K, V,  # [B, Hq, T, D], [B, Hkv, T, D] x 2: any strides, contiguous last dim (TMA: their descriptors)
    O,  # [B, T, Hq, D] contiguous: the layout HF's attention returns (no transpose copy after)
    LSE,  # [B, Hq, T] float32: the log-sum-exp of the scaled scores (log2 units with exp2), for backward
    DOC_START,  # [B, T] int32: where each token's document starts
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
    T, HQ, GROUP,
    WINDOW,  # a sliding window: keys fewer than WINDOW positions back (T: none)
    unit, cap_in,  # the scores are x * unit, see _logits; unit in _exp's units (times log2(e) for exp2)
    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PRECISE: tl.constexpr, SOFTCAP: tl.constexpr, TMA: tl.constexpr,
):
    # Program order: every head of the last query tile first. A causal query tile
    # late in a long document has the most key tiles to read; launching the
    # heaviest programs first keeps the GPU from finishing on a few long ones.
    bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    kvh = h // GROUP  # GQA: the key/value head this query head reads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DP)  # the head dim, padded to a power of two (Phi-3: 96 -> 128)
    d_ok = offs_d < D
    row_ok = offs_m < T
    q = _head_rows(Q, b, h, pid_m * BLOCK_M, sq_b, sq_h, sq_t, T, offs_d, d_ok, BLOCK_M, DP, True, TMA)
    starts = tl.load(DOC_START + b * T + offs_m, mask=row_ok, other=0)
    lo, e1, e2, hi = _query_tile_keys(DOC_START, b, pid_m, T, WINDOW, BLOCK_M, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    # Three runs of key tiles: the document's first (masked), the inside (no mask), the diagonal (masked).
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, b, kvh, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, offs_m, starts,
                               offs_d, d_ok, lo, e1, T, WINDOW, unit, cap_in, BLOCK_N, DP,
                               DOT_PRECISION, PRECISE, SOFTCAP, True, TMA)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, b, kvh, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, offs_m, starts,
                               offs_d, d_ok, e1, e2, T, WINDOW, unit, cap_in, BLOCK_N, DP,
                               DOT_PRECISION, PRECISE, SOFTCAP, False, TMA)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, b, kvh, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, offs_m, starts,
                               offs_d, d_ok, e2, hi, T, WINDOW, unit, cap_in, BLOCK_N, DP,
                               DOT_PRECISION, PRECISE, SOFTCAP, True, TMA)

    # Every query sees itself, so l_i >= 1 on the rows that exist.
    out = acc / l_i[:, None]
    tl.store(O + ((b.to(tl.int64) * T + offs_m[:, None]) * HQ + h) * D + offs_d[None, :],
             cast_to(out, O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + _log(l_i, PRECISE), mask=row_ok)


# --------------------------------------------------------------------------------
# Backward, delta: one program per (row tile, batch row and query head)
# --------------------------------------------------------------------------------
@fast_launch
@triton.jit(do_not_specialize=["T"])  # a varying count: not specialized (rmsnorm_kernel.py)
def _attn_bwd_delta_kernel(
    O, DO,  # [B, T, Hq, D]: the output (contiguous) and its gradient (any strides, contiguous last dim)
    DELTA,  # [B, Hq, T] float32, written: rowsum(dO * O)
    sdo_b, sdo_t, sdo_h, T, HQ,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # One read of O and dO, in float32 registers: no [B, T, Hq, D] float32 copies.
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, DP)
    ok = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    o = tl.load(O + ((b.to(tl.int64) * T + offs_t[:, None]) * HQ + h) * D + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdo_b + h * sdo_h + offs_t[:, None] * sdo_t + offs_d[None, :],
                 mask=ok, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_t, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_t < T)


# --------------------------------------------------------------------------------
# Backward, dK and dV: one program per (key tile, batch row and key/value head)
# --------------------------------------------------------------------------------
@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q, DO, b, h, sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, row_base, LSE, DELTA, DOC_START,
                offs_n, offs_d, d_ok, lo, hi, T, WINDOW, unit, cap_in, BLOCK_M: tl.constexpr,
                DP: tl.constexpr, DOT_PRECISION: tl.constexpr, PRECISE: tl.constexpr, SOFTCAP: tl.constexpr,
                MASKED: tl.constexpr, TMA: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < T
        q = _head_rows(Q, b, h, start_m, sq_b, sq_h, sq_t, T, offs_d, d_ok, BLOCK_M, DP, MASKED, TMA)
        do = _head_rows(DO, b, h, start_m, sdo_b, sdo_h, sdo_t, T, offs_d, d_ok, BLOCK_M, DP, MASKED, TMA)
        lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
        # The probabilities again, from the saved log-sum-exp: P = exp2(S * log2 e - lse).
        x = _logits(q, k, cap_in, DOT_PRECISION, PRECISE, SOFTCAP)
        p = _exp(x * unit - lse[:, None], PRECISE)
        if MASKED:
            starts = tl.load(DOC_START + b * T + offs_m, mask=row_ok, other=0)
            p = tl.where(_visible(offs_m, offs_n, starts, WINDOW) & row_ok[:, None], p, 0.0)
        dv = _matmul_add(dv, _tile_for_dot(tl.trans(p), do), do, DOT_PRECISION)
        dp = _scores(do, v, DOT_PRECISION)  # dO V^T
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - x * x)  # through the cap: x = t, d(cap tanh(s / cap))/ds = 1 - t^2
        if MASKED:
            # A query that sees only itself (an example of one token) has P = 1, and
            # dS = 1 * (dP - dP) = 0 exactly; from delta = dO . O it would be rounding
            # noise. (Never in a full tile: there every query sees BLOCK_N keys.)
            ds = tl.where(starts[:, None] == offs_m[:, None], 0.0, ds)
        dk = _matmul_add(dk, _tile_for_dot(tl.trans(ds), q), q, DOT_PRECISION)
    return dk, dv


@fast_launch
@triton.jit(do_not_specialize=["T", "WINDOW"])  # vary with T: not specialized (rmsnorm_kernel.py)
def _attn_bwd_dkdv_kernel(
    Q, K, V,  # as in the forward
    DO,  # [B, T, Hq, D]: the output's gradient, in the output's layout (any strides, contiguous last dim;
    #      TMA: the descriptor of its [B, Hq, T, D] view)
    LSE, DELTA,  # [B, Hq, T] float32: the forward's log2-sum-exp; rowsum(dO * O)
    DOC_START, DOC_END,  # [B, T] int32
    DK, DV,  # [B, Hkv, T, D] contiguous, written
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_t, sdo_h,
    T, HQ, HKV, GROUP, scale, WINDOW, unit, cap_in,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PRECISE: tl.constexpr, SOFTCAP: tl.constexpr, TMA: tl.constexpr,
):
    bkv = tl.program_id(0)
    pid_n = tl.program_id(1)  # the first key tiles (seen by the most queries) first
    b = bkv // HKV
    kvh = bkv % HKV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DP)  # the head dim, padded to a power of two (Phi-3: 96 -> 128)
    d_ok = offs_d < D
    col_ok = offs_n < T
    k = _head_rows(K, b, kvh, pid_n * BLOCK_N, sk_b, sk_h, sk_t, T, offs_d, d_ok, BLOCK_N, DP, True, TMA)
    v = _head_rows(V, b, kvh, pid_n * BLOCK_N, sv_b, sv_h, sv_t, T, offs_d, d_ok, BLOCK_N, DP, True, TMA)
    dk = tl.zeros([BLOCK_N, DP], tl.float32)
    dv = tl.zeros([BLOCK_N, DP], tl.float32)
    # The queries that may see keys [n0, n1]: from the first key on (causal), to the
    # end of the document of the last key (documents are contiguous) or its window.
    n0 = pid_n * BLOCK_N
    n1 = tl.minimum(n0 + BLOCK_N, T) - 1
    lo = (n0 // BLOCK_M) * BLOCK_M
    hi = tl.minimum(tl.load(DOC_END + b * T + n1), n1 + WINDOW)
    # Seeing every key: queries at or after the last key, still in the first key's
    # document and window (so their document starts at or before it).
    full_lo = tl.cdiv(n1, BLOCK_M) * BLOCK_M
    full_hi = (tl.minimum(tl.load(DOC_END + b * T + n0), n0 + WINDOW) // BLOCK_M) * BLOCK_M
    e1, e2 = _split(lo, hi, full_lo, full_hi)
    for g in range(0, GROUP):  # every query head that reads this key/value head
        h = kvh * GROUP + g
        row_base = (b * HQ + h).to(tl.int64) * T
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, b, h, sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, row_base, LSE, DELTA,
                             DOC_START, offs_n, offs_d, d_ok, lo, e1, T, WINDOW, unit, cap_in, BLOCK_M,
                             DP, DOT_PRECISION, PRECISE, SOFTCAP, True, TMA)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, b, h, sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, row_base, LSE, DELTA,
                             DOC_START, offs_n, offs_d, d_ok, e1, e2, T, WINDOW, unit, cap_in, BLOCK_M,
                             DP, DOT_PRECISION, PRECISE, SOFTCAP, False, TMA)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, b, h, sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, row_base, LSE, DELTA,
                             DOC_START, offs_n, offs_d, d_ok, e2, hi, T, WINDOW, unit, cap_in, BLOCK_M,
                             DP, DOT_PRECISION, PRECISE, SOFTCAP, True, TMA)
    out = (b * HKV + kvh).to(tl.int64) * T * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out, cast_to(dk * scale, DK.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])
    tl.store(DV + out, cast_to(dv, DV.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------------
# Backward, dQ: one program per (query tile, batch row and query head), the forward's loop
# --------------------------------------------------------------------------------
@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_base, v_base, sk_t, sv_t, offs_m, starts, offs_d, d_ok, lo, hi, T, WINDOW,
              unit, cap_in, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
              PRECISE: tl.constexpr, SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _rows(k_base, offs_n, sk_t, offs_n < T, offs_d, d_ok, MASKED)
        v = _rows(v_base, offs_n, sv_t, offs_n < T, offs_d, d_ok, MASKED)
        x = _logits(q, k, cap_in, DOT_PRECISION, PRECISE, SOFTCAP)
        p = _exp(x * unit - lse[:, None], PRECISE)
        ds = p * (_scores(do, v, DOT_PRECISION) - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - x * x)
        if MASKED:
            ds = tl.where(_visible(offs_m, offs_n, starts, WINDOW) & (starts[:, None] != offs_m[:, None]), ds, 0.0)
        dq = _matmul_add(dq, _tile_for_dot(ds, k), k, DOT_PRECISION)
    return dq


@fast_launch
@triton.jit(do_not_specialize=["T", "WINDOW"])  # vary with T: not specialized (rmsnorm_kernel.py)
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DOC_START,
    DQ,  # [B, Hq, T, D] contiguous, written
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_t, sdo_h,
    T, HQ, GROUP, scale, WINDOW, unit, cap_in,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PRECISE: tl.constexpr, SOFTCAP: tl.constexpr,
):
    bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest first, as in the forward
    b = bh // HQ
    h = bh % HQ
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DP)  # the head dim, padded to a power of two (Phi-3: 96 -> 128)
    d_ok = offs_d < D
    row_ok = offs_m < T
    q = _rows(Q + b.to(tl.int64) * sq_b + h * sq_h, offs_m, sq_t, row_ok, offs_d, d_ok, True)
    do = _rows(DO + b.to(tl.int64) * sdo_b + h * sdo_h, offs_m, sdo_t, row_ok, offs_d, d_ok, True)
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
    starts = tl.load(DOC_START + b * T + offs_m, mask=row_ok, other=0)
    lo, e1, e2, hi = _query_tile_keys(DOC_START, b, pid_m, T, WINDOW, BLOCK_M, BLOCK_N)
    dq = tl.zeros([BLOCK_M, DP], tl.float32)
    k_base = K + b.to(tl.int64) * sk_b + kvh * sk_h
    v_base = V + b.to(tl.int64) * sv_b + kvh * sv_h
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, sk_t, sv_t, offs_m, starts, offs_d, d_ok, lo, e1, T, WINDOW,
                   unit, cap_in, BLOCK_N, DOT_PRECISION, PRECISE, SOFTCAP, True)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, sk_t, sv_t, offs_m, starts, offs_d, d_ok, e1, e2, T, WINDOW,
                   unit, cap_in, BLOCK_N, DOT_PRECISION, PRECISE, SOFTCAP, False)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, sk_t, sv_t, offs_m, starts, offs_d, d_ok, e2, hi, T, WINDOW,
                   unit, cap_in, BLOCK_N, DOT_PRECISION, PRECISE, SOFTCAP, True)
    tl.store(DQ + bh.to(tl.int64) * T * D + offs_m[:, None] * D + offs_d[None, :],
             cast_to(dq * scale, DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------------
# Launch configuration and checks
# --------------------------------------------------------------------------------
# Tiles per kernel: (BLOCK_M queries, BLOCK_N keys, warps, pipeline stages), by the
# padded head dim, for 16-bit inputs. Chosen by `python tools/tune_kernels.py --only
# attention` on an H100 (NOTES.md has the table): 64 x 64 tiles with 4 warps won
# for every kernel and head dim; larger query tiles (128) read each key tile for
# more queries but spill the [BLOCK_M, DP] float32 accumulator out of registers.
# Stages: how many tiles' loads the compiler keeps in flight (software
# pipelining) while one is multiplied; 3 stages of 256-wide tiles overflow the
# H100's 227 KiB of shared memory. Float32 inputs (the tests' exact path, dots
# in full float32) take small tiles: their registers are twice as wide. The
# interpreter runs every program in Python: 16 x 16 tiles, so that small test
# rows still cross several tiles and document boundaries inside tiles.
TILES = {
    ("fwd", 64): (64, 64, 4, 3), ("dkdv", 64): (64, 64, 4, 3), ("dq", 64): (64, 64, 4, 3),
    ("fwd", 128): (64, 64, 4, 3), ("dkdv", 128): (64, 64, 4, 2), ("dq", 128): (64, 64, 4, 2),
    ("fwd", 256): (64, 64, 4, 3), ("dkdv", 256): (64, 64, 8, 2), ("dq", 256): (64, 64, 4, 2),
}
FLOAT32_TILES = (32, 32, 4, 1)
# TMA loads (Hopper) keep these tiles: with them 64 x 64 stayed ahead of 128 x 64
# (4 or 8 warps) on two of the three benchmark rows (results/attention/tma_h100.txt).
# The dQ kernel gained nothing from TMA there and keeps its pointer loads.
USE_TMA = True  # tests switch it off to run the pointer loads on the same rows


def _tiles(kernel, dp, dtype):
    if INTERPRET:
        return 16, 16, 4, 1
    if dtype == torch.float32:
        return FLOAT32_TILES
    return TILES[kernel, max(64, dp)]


def _tma_ok(*tensors):
    """Whether the kernels may read these [B, H, T, D] tensors through TMA descriptors:
    a Hopper GPU or newer (or the interpreter, which runs the same code on the CPU),
    and what the hardware's copies need: a 16-byte aligned start, every stride but
    the last a positive multiple of 16 bytes, the last dim contiguous."""
    if not USE_TMA or (not INTERPRET and torch.cuda.get_device_capability(tensors[0].device) < (9, 0)):
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or t.stride(-1) != 1 or any(st <= 0 or st * size % 16 for st in t.stride()[:-1]):
            return False
    return True


def _descriptor(t, rows, dp):
    """A TMA descriptor of a [B, H, T, D] tensor for tiles of ``rows`` x ``dp`` (the head
    dim padded to a power of two: the copy fills the columns past D with zeros)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, dp])


MAX_HEAD_DIM = 256
LOG2_E = math.log2(math.e)


def _check(q, k, v, doc_start, name="attention"):
    for what, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: {what} must be a [B, H, T, D] tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: unsupported {what} dtype {t.dtype}; use float32, float16 or bfloat16")
    B, Hq, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, Hkv, T, D] with q's "
                         f"B, T, D ({tuple(q.shape)})")
    if Hq % k.shape[1]:
        raise ValueError(f"{name}: {Hq} query heads cannot share {k.shape[1]} key/value heads (GQA needs a divisor)")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"{name}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim {D} is not supported (1 to {MAX_HEAD_DIM})")
    if not isinstance(doc_start, torch.Tensor) or tuple(doc_start.shape) != (B, T) or doc_start.dtype != torch.int32:
        what = f"{doc_start.dtype} {tuple(doc_start.shape)}" if isinstance(doc_start, torch.Tensor) else "none"
        raise ValueError(f"{name}: doc_start must be an int32 [B, T] = [{B}, {T}] tensor (document_starts), "
                         f"got {what}")
    check_kernel_device(q, k, v, doc_start)


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _score_scale(scale, dtype):
    """What the kernels multiply q k^T by before _exp: scale * log2(e) for exp2, or scale."""
    return scale if dtype == torch.float32 else scale * LOG2_E


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit tiles


def _score_args(scale, softcap, dtype):
    """The kernels' (unit, cap_in, SOFTCAP) for a scale and a score cap (0: none), see _logits."""
    if not softcap:
        return dict(unit=_score_scale(scale, dtype), cap_in=0.0, SOFTCAP=False)
    return dict(unit=_score_scale(softcap, dtype), cap_in=scale / softcap, SOFTCAP=True)


# --------------------------------------------------------------------------------
# The launchers, registered as operators (kernel_common.kernel_op)
# --------------------------------------------------------------------------------
def _attention_forward_fake(q, k, v, doc_start, scale, window, softcap):
    B, Hq, T, D = q.shape
    return q.new_empty(B, T, Hq, D), q.new_empty(B, Hq, T, dtype=torch.float32)


@kernel_op("attention_forward", fake=_attention_forward_fake)
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_start: torch.Tensor,
                      scale: float, window: int, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, Hq, D], lse [B, Hq, T] float32) of q [B, Hq, T, D], k, v [B, Hkv, T, D]."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    dp = max(16, next_power_of_2(D))
    tma = _tma_ok(q, k, v)
    block_m, block_n, warps, stages = _tiles("fwd", dp, q.dtype)
    if tma:
        q, k, v = _descriptor(q, block_m, dp), _descriptor(k, block_n, dp), _descriptor(v, block_n, dp)
    _attn_fwd_kernel[(B * Hq, cdiv(T, block_m))](
        q, k, v, out, lse, doc_start,
        *strides, T, Hq, Hq // Hkv, window or T, **_score_args(scale, softcap, out.dtype),
        D=D, DP=dp, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=_precision(out.dtype),
        PRECISE=out.dtype == torch.float32, TMA=tma, num_warps=warps, num_stages=stages,
    )
    return out, lse


def _attention_backward_fake(dout, q, k, v, out, lse, doc_start, scale, window, softcap):
    # Contiguous, as the launcher makes them (empty_like would copy q's strides: HF's q is a transposed view).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@kernel_op("attention_backward", fake=_attention_backward_fake)
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, doc_start: torch.Tensor, scale: float, window: int,
                       softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's, k's, v's shapes (contiguous) from dout [B, T, Hq, D]."""
    q, k, v, dout = (_last_dim_contiguous(t) for t in (q, k, v, dout))
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    dq = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hkv, T, D, dtype=k.dtype, device=k.device)
    dv = torch.empty(B, Hkv, T, D, dtype=v.dtype, device=v.device)
    if dq.numel() == 0:
        return dq, dk, dv
    dp = max(16, next_power_of_2(D))
    # delta_i = sum_d dO_id O_id, per row and head, [B, Hq, T] float32.
    delta = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    block_t = 16 if INTERPRET else 64
    _attn_bwd_delta_kernel[(cdiv(T, block_t), B * Hq)](
        out, dout, delta, dout.stride(0), dout.stride(1), dout.stride(2), T, Hq, D=D, DP=dp, BLOCK_T=block_t)
    doc_end = document_ends(doc_start)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2))
    common = dict(D=D, DP=dp, DOT_PRECISION=_precision(q.dtype), PRECISE=q.dtype == torch.float32,
                  **_score_args(scale, softcap, q.dtype))
    tma = _tma_ok(q, k, v, dout)
    block_m, block_n, warps, stages = _tiles("dkdv", dp, q.dtype)
    inputs = (q, k, v, dout)
    if tma:  # dO through the [B, Hq, T, D] view of its [B, T, Hq, D] layout
        inputs = (_descriptor(q, block_m, dp), _descriptor(k, block_n, dp), _descriptor(v, block_n, dp),
                  _descriptor(dout.transpose(1, 2), block_m, dp))
    _attn_bwd_dkdv_kernel[(B * Hkv, cdiv(T, block_n))](
        *inputs, lse, delta, doc_start, doc_end, dk, dv, *strides,
        T, Hq, Hkv, Hq // Hkv, scale, window or T,
        BLOCK_M=block_m, BLOCK_N=block_n, TMA=tma, num_warps=warps, num_stages=stages, **common,
    )
    block_m, block_n, warps, stages = _tiles("dq", dp, q.dtype)
    _attn_bwd_dq_kernel[(B * Hq, cdiv(T, block_m))](
        q, k, v, dout, lse, delta, doc_start, dq, *strides,
        T, Hq, Hq // Hkv, scale, window or T,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common,
    )
    return dq, dk, dv


# --------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------
def _attention_save(ctx, inputs, output):
    q, k, v, doc_start, scale, window, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, doc_start)
    ctx.scale, ctx.window, ctx.softcap = scale, window, softcap
    ctx.mark_non_differentiable(lse)


def _attention_grads(ctx, dout, _dlse):
    q, k, v, out, lse, doc_start = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, doc_start, ctx.scale, ctx.window, ctx.softcap)
    return dq, dk, dv, None, None, None, None


class TritonAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc_start, scale, window, softcap):
        output = attention_forward(q, k, v, doc_start, scale, window, softcap)
        _attention_save(ctx, (q, k, v, doc_start, scale, window, softcap), output)
        return output

    @staticmethod
    @first_order_only("attention")
    def backward(ctx, dout, dlse):
        return _attention_grads(ctx, dout, dlse)


attention_forward.op.register_autograd(first_order_only("attention")(_attention_grads),
                                       setup_context=_attention_save)


def packed_attention(q, k, v, doc_start, scale=None, window=None, softcap=None):
    """Causal attention inside documents: q [B, Hq, T, D], k, v [B, Hkv, T, D]
    (bf16/fp16/fp32), doc_start [B, T] int32 (document_starts of the position ids).
    Returns [B, T, Hq, D] (HF's attention output layout). Differentiable in q, k
    and v. ``scale``: 1/sqrt(D) by default. ``window``: HF's sliding window (keys
    fewer than ``window`` positions back), None or 0 for none. ``softcap``: Gemma-2's
    cap on the scores (cap tanh(scores / cap)), None or 0 for none."""
    _check(q, k, v, doc_start)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    window = int(window or 0)
    if window < 0:
        raise ValueError(f"attention: window must be >= 0 (0: none), got {window}")
    softcap = float(softcap or 0.0)
    if not softcap >= 0.0 or math.isinf(softcap):
        raise ValueError(f"attention: softcap must be a finite number >= 0 (0: none), got {softcap}")
    if torch.compiler.is_compiling():
        return attention_forward.op(q, k, v, doc_start, scale, window, softcap)[0]
    return TritonAttentionFunction.apply(q, k, v, doc_start, scale, window, softcap)[0]


# --------------------------------------------------------------------------------
# In a model: an attention function HF's layers call by name
# --------------------------------------------------------------------------------
# transformers looks each layer's attention up in AttentionInterface by the
# config's _attn_implementation; "sdpa" is torch's. We register ours under NAME:
# it takes what HF passes (q, k, v after RoPE, in [B, H, T, D]; the position ids
# among the keyword arguments). For a name with no mask function registered, HF
# builds no mask at all (and runs no host-side check of the position ids): the
# kernel reads each token's document from the position ids instead.
#
# So ours must only ever see calls that need no mask: causal rows of one or more
# documents, all of their keys in this call. A padding ``attention_mask`` (left or
# right), or a KV cache with earlier tokens in it (generate()'s decoding steps), is
# a call for the model's own attention. That decision is taken once per forward,
# at the decoder (``route_masked_calls`` below), from what the call carries (never
# from tensor values: no host synchronization, CUDA graphs stay possible).
NAME = "triton_packed"
# A call routed to the model's own attention (route_masked_calls) carries this keyword,
# the name of that attention, down to every layer: the decoder passes its keyword
# arguments on to each layer's attention function. Gradient checkpointing recomputes a
# layer in backward, after the decoder's forward has set the model back to NAME, so
# the recomputation calls ours, with the same arguments as the forward: the keyword
# says to run theirs again (same mask, same saved tensors), never ours without the mask.
# Rows of one document that the measurement gives to theirs (plain_rows_to_theirs) carry
# it too, with the model left at NAME: our function then calls theirs without a mask.
ROUTED = "kernel_ft_routed_to"


def attention_function(layer, name):
    """The attention function ``layer`` calls under the implementation ``name``: the
    registered one, or for "eager" (not registered) its family's own eager function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    for names in _eager_namespaces(layer):
        return names["eager_attention_forward"]
    raise ValueError(f"{NAME}: no attention function named {name!r} for {type(layer).__name__}")


def hf_packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function transformers calls under NAME (sdpa_attention_forward's signature)."""
    theirs = kwargs.pop(ROUTED, None)
    if theirs is not None:  # a recomputation of a routed call, or rows of one document measured faster there
        return attention_function(module, theirs)(module, query, key, value, attention_mask, scaling=scaling,
                                                  dropout=dropout, **kwargs)
    if attention_mask is not None:  # never ignored: a mask HF built reaches only the model's own attention
        raise ValueError(f"{NAME} attention got an attention mask {tuple(attention_mask.shape)}, which it cannot "
                         f"apply (a mask the model makes itself, or a masked call recomputed by gradient "
                         f"checkpointing in a decoder whose forward takes no keyword arguments to pass on)")
    if dropout:
        raise ValueError(f"{NAME} attention has no dropout (attention_dropout {dropout}); set it to 0")
    B, _, T, _ = query.shape
    if key.shape[2] != T:  # a KV cache: route_masked_calls sends such calls to the model's own attention
        raise ValueError(f"{NAME} attention got {T} queries for {key.shape[2]} keys (a KV cache); it computes "
                         f"causal rows whose keys are all in the call")
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as autocast runs SDPA: all three in its lower-precision dtype
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    positions = kwargs.get("position_ids")
    if positions is None:
        doc_start = torch.zeros(B, T, dtype=torch.int32, device=query.device)
    else:
        doc_start = document_starts(positions.expand(B, T))
    return packed_attention(query, key, value, doc_start, scaling, kwargs.get("sliding_window"),
                            kwargs.get("softcap")), None


# A family's attention may do more than softmax(scale q k^T) v (soft-capped scores,
# sliding windows, sink tokens, extra keyword arguments). So before the switch the
# model runs a packed probe row both ways: two examples of 5 and 3 tokens, with its
# own attention and the dense block mask, then with ours and only the position
# ids. The logits must agree to one rounding of the model's dtype; anything else,
# an error included, is a refusal in one line. In 16-bit weights two correct
# attentions drift apart through a deep model (a random 8B LLaMA's logits differ by
# ~0.1 between SDPA and eager): there the bound is also 4x the model's own drift,
# measured as the distance between its attention and HF's eager one on the same
# probe (eager is the reference implementation of every family). A family whose
# own attention is the eager one (Gemma-2: soft-capped scores) is measured against
# that same eager attention computed in float64: its own 16-bit rounding.
# The packed probe hands the model a causal block mask, so it cannot tell whether the
# model's own attention is causal: a second probe, one example with no mask and no
# position ids (what a plain call looks like), must agree too. A bidirectional
# encoder (BERT and its kin, which transformers also offers as causal LMs) sees every
# token there, and Doge adds a learned mask of its own where it is given none: both
# are refused.
PROBE_LENGTHS = (5, 3)


def _error_line(e):
    """An exception in one line, for a refusal: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _probe_ids(n, model, device):
    """n probe tokens: spread over the vocabulary, the same on every call."""
    return (torch.arange(n, device=device) * 7 + 1) % vocabulary_size(model)


def _attention_layers(model):
    """The model's attention modules (HF's classes are named *Attention)."""
    return (m for m in model.modules() if type(m).__name__.endswith("Attention"))


def _eager_namespaces(layer):
    """The globals in which ``layer``'s forward looks ``eager_attention_forward`` up
    (their python module's, or the copy fuse_rope gave them; behind a decorator, those
    of the function it wraps)."""
    forward = getattr(layer.forward, "__func__", layer.forward)
    for _ in range(5):  # through decorators (functools.wraps: __wrapped__) to the function that looks it up
        names = getattr(forward, "__globals__", {})
        if callable(names.get("eager_attention_forward")):
            yield names
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            break


@contextlib.contextmanager
def _eager_in_float64(model):
    """Within: the model's eager attention computes in float64 and rounds its output
    to the model's dtype. The layers look ``eager_attention_forward`` up by name in
    their forward's globals (_eager_namespaces), so it is swapped there. Yields False,
    changing nothing, where there is none."""
    spaces = {id(names): names for layer in _attention_layers(model) for names in _eager_namespaces(layer)}
    if not spaces:
        yield False
        return
    saved = [(names, names["eager_attention_forward"]) for names in spaces.values()]

    def in_float64(eager):
        def attention(layer, query, key, value, attention_mask, *args, **kwargs):
            mask = attention_mask
            if mask is not None and mask.is_floating_point():
                mask = mask.double()
            out, weights = eager(layer, query.double(), key.double(), value.double(), mask, *args, **kwargs)
            return out.to(query.dtype), weights
        return attention

    for names, eager in saved:
        names["eager_attention_forward"] = in_float64(eager)
    try:
        yield True
    finally:
        for names, eager in saved:
            names["eager_attention_forward"] = eager


@torch.no_grad()
def check_same_attention(model, theirs_name):
    """Raise SwapMismatch unless the model computes the same logits with NAME as with
    ``theirs_name`` (its attention before the switch) on the packed probe row."""
    weight = next(model.parameters())
    if weight.is_meta:
        return
    positions = torch.cat([torch.arange(n) for n in PROBE_LENGTHS])[None].to(weight.device)
    ids = _probe_ids(positions.shape[1], model, weight.device)[None]
    mask = visible_keys(document_starts(positions))[:, None]
    additive = torch.zeros(mask.shape, dtype=weight.dtype, device=mask.device)  # eager adds its mask to the scores
    additive.masked_fill_(~mask, torch.finfo(weight.dtype).min)

    def logits(implementation, attention_mask):
        model.set_attn_implementation(implementation)
        return model(input_ids=ids, position_ids=positions, attention_mask=attention_mask).logits.float()

    def plain_logits(implementation):  # one example, nothing but the tokens
        model.set_attn_implementation(implementation)
        return model(input_ids=ids[:, :PROBE_LENGTHS[0]]).logits.float()

    drift = 0.0
    with evaluating(model):
        try:
            try:
                expected = logits(theirs_name, additive if theirs_name == "eager" else mask)
                plain_expected = plain_logits(theirs_name)
            except Exception as e:  # noqa: BLE001 - any failure of the model's own code: nothing to check against
                raise SwapMismatch(f"{type(model).__name__}'s own attention does not run a packed row (position ids "
                                   f"and a 4-D block mask), so ours cannot be checked against it "
                                   f"({_error_line(e)})") from None
            if weight.dtype != torch.float32 and theirs_name != "eager":
                drift = (logits("eager", additive) - expected).abs().max().item()
            elif weight.dtype != torch.float32:
                with _eager_in_float64(model) as wide:
                    if wide:
                        drift = (logits("eager", additive) - expected).abs().max().item()
            model.set_attn_implementation(NAME)
            try:
                got = model(input_ids=ids, position_ids=positions).logits.float()
                plain_got = plain_logits(NAME)
            except (ValueError, TypeError, RuntimeError) as e:
                raise SwapMismatch(f"{type(model).__name__}'s attention cannot run as {NAME} "
                                   f"({_error_line(e)})") from None
        except SwapMismatch:
            model.set_attn_implementation(theirs_name)
            raise
    rounding = probe_rounding(weight.dtype)

    def close(ours, theirs):
        return torch.allclose(ours, theirs, rtol=rounding, atol=max(rounding * theirs.abs().max().item(), 4 * drift))

    if not close(plain_got, plain_expected):
        model.set_attn_implementation(theirs_name)
        raise SwapMismatch(f"{type(model).__name__}'s own attention on a row without a mask is not causal "
                           f"softmax(scale q k^T) v (bidirectional, or a mask of its own; max logit difference "
                           f"{(plain_got - plain_expected).abs().max().item():.2g}), which is all the kernel computes")
    if not close(got, expected):
        model.set_attn_implementation(theirs_name)
        raise SwapMismatch(f"{type(model).__name__}'s attention computes something else than softmax(scale q k^T) v "
                           f"within each example (max logit difference {(got - expected).abs().max().item():.2g}, "
                           f"its own two implementations differ by {drift:.2g})")


# Same logits are not enough: a parameter that shapes the scores through a mask of the
# layer's own (Doge's learned mask, whose parameter starts at zero, so that the mask is
# flat and the logits agree) is dropped by the kernel, which takes no mask, and would
# never train. The first attention layer's trainable parameters must reach the loss
# through ours wherever they reach it through theirs. Reaching is read off the autograd
# graph of one forward (the AccumulateGrad nodes it leads to): no backward to run.
def _reaching(model, implementation):
    """Names of the first attention layer's trainable parameters that the plain probe
    row's logits depend on with ``implementation``."""
    layer = next(_attention_layers(model), None)
    params = {} if layer is None else {id(p): n for n, p in layer.named_parameters() if p.requires_grad}
    weight = None if layer is None else next(layer.parameters())
    if not params or weight.is_meta:
        return set()
    ids = _probe_ids(PROBE_LENGTHS[0], model, weight.device)[None]
    model.set_attn_implementation(implementation)
    with torch.enable_grad():
        nodes, seen, found = [model(input_ids=ids).logits.grad_fn], set(), set()
        while nodes:
            node = nodes.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf tensor
            if variable is not None and id(variable) in params:
                found.add(params[id(variable)])
            nodes.extend(next_node for next_node, _ in node.next_functions)
    return found


def check_gradients_reach(model, theirs_name):
    """Raise SwapMismatch unless every attention parameter that the model's own attention
    trains is trained through ours too; the model is left on ``theirs_name``."""
    with evaluating(model):
        try:
            lost = _reaching(model, theirs_name) - _reaching(model, NAME)
        except (ValueError, TypeError, RuntimeError) as e:
            lost = {f"(the gradient probe failed: {_error_line(e)})"}
        finally:
            model.set_attn_implementation(theirs_name)
    if lost:
        raise SwapMismatch(f"{type(model).__name__}'s attention parameters {', '.join(sorted(lost))} reach the loss "
                           f"through its own attention and not through the kernel (a mask of its own, which the kernel "
                           f"does not take)")


def decoder_forward_routed(decoder, *args, **kwargs):
    """The decoder's forward: ours for unmasked calls without earlier cached tokens,
    the model's own attention (kept in ``_kernel_ft_theirs``) for the others, and for
    rows of one document where it is measured to be faster (plain_rows_to_theirs)."""
    arguments = decoder._kernel_ft_signature.bind(*args, **kwargs).arguments
    cache = arguments.get("past_key_values")
    cached = cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0
    if arguments.get("attention_mask") is None and not cached:
        if decoder._kernel_ft_passes_keywords and plain_rows_to_theirs(decoder, arguments):
            # Theirs through hf_packed_attention, with no mask: what such rows get from it
            # (SDPA's causal flag). HF builds none under NAME, also inside a CUDA graph
            # capture, where it would build a dense one for SDPA (cuda_graphs.py).
            kwargs[ROUTED] = decoder._kernel_ft_theirs
        return decoder._kernel_ft_attention_forward(*args, **kwargs)
    theirs = decoder._kernel_ft_theirs
    if decoder._kernel_ft_passes_keywords:  # down to the layers, for their recomputation (ROUTED above)
        kwargs[ROUTED] = theirs
    config = decoder.config
    config._attn_implementation = theirs  # read by every layer and by HF's mask builders
    try:
        return decoder._kernel_ft_attention_forward(*args, **kwargs)
    finally:
        config._attn_implementation = NAME


def route_masked_calls(model, theirs):
    """Send the calls of ``model``'s decoder that carry an attention mask or earlier
    cached tokens to its attention before the switch, ``theirs``; the others to ours."""
    decoder = decoder_of(model)
    decoder._kernel_ft_theirs = theirs
    decoder._kernel_ft_signature = inspect.signature(decoder.forward)
    decoder._kernel_ft_passes_keywords = any(p.kind is p.VAR_KEYWORD
                                             for p in decoder._kernel_ft_signature.parameters.values())
    # For the measured choice (plain_rows_to_theirs), once: the first attention layer, and
    # the shortest window a layer keeps as its own attribute (0: none).
    windows = [w for m in _attention_layers(decoder) if (w := getattr(m, "sliding_window", None) or 0)]
    decoder._kernel_ft_plain_rows = next(_attention_layers(decoder), None), min(windows, default=0)
    wrap_forward(decoder, "_kernel_ft_attention_forward", decoder_forward_routed)


# --------------------------------------------------------------------------------
# Rows of one document: ours or the model's own, measured on this GPU
# --------------------------------------------------------------------------------
# A call without position ids holds one document per row: a plain causal row, which
# SDPA runs through its own causal kernels (cuDNN's on Hopper, FlashAttention-2's on
# others) without any mask. There ours skips nothing that theirs computes, so which
# is faster depends on the GPU, the head dim and the length (on an H200, 8,192 tokens
# of 32 heads of 128: cuDNN 3.81 ms fwd+bwd, ours 4.87). So the first such call of
# each shape times both on this device, fwd+bwd on random rows of that shape, and
# keeps the faster for every later call of the shape. Calls with position ids (packed
# rows: ours skips the pairs across documents, 3-50x fewer than the dense mask SDPA
# needs) and layers that slide a window shorter than the row (SDPA needs a dense mask
# there too) stay ours without a measurement, as does the model's own eager attention
# (the T x T scores in memory: Gemma-2). Nothing is measured in Triton's interpreter
# (no speed to compare), without gradients (generate()), inside a CUDA graph capture
# or a torch.compile trace: there a shape not measured yet runs ours.
# (device, dtype, B, T, Hq, Hkv, D, theirs) -> (theirs is faster, ours ms, theirs ms, why not measured or None)
PLAIN_ROW_CHOICES = {}
MEASURED_DEVICES = ("cuda",)  # not the CPU: Triton's interpreter has no speed to compare
# The model's own attentions that compute causal attention when given no mask (SDPA's
# is_causal flag, flash-attn's causal flag); FlexAttention without a block mask, say, is
# bidirectional: those stay ours.
CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")
MAX_MEASURED_SHAPES = 16  # past this many, a new shape takes the choice of the measured one nearest in tokens
MEASURE_REPEATS = 5
CHOICE_LISTENERS = []  # callables given each choice's line once (the scripts print it)


def _plain_row_key(decoder, arguments):
    """The key of this call's rows in PLAIN_ROW_CHOICES, with the attention layer that
    takes them, or None where no measurement applies (see above)."""
    if arguments.get("position_ids") is not None or decoder._kernel_ft_theirs not in CAUSAL_WITHOUT_MASK:
        return None
    ids = arguments.get("input_ids")
    ids = arguments.get("inputs_embeds") if ids is None else ids
    layer, window = decoder._kernel_ft_plain_rows
    if ids is None or ids.dim() < 2 or ids.device.type not in MEASURED_DEVICES or layer is None:
        return None
    B, T = ids.shape[:2]
    config = decoder.config
    if 0 < window < T or not plain_causal_attention(config, T):  # a window shorter than the row, chunks
        return None
    where = ids.device.type
    embeds = arguments.get("inputs_embeds")  # q, k, v come out of the layers in the hidden states' dtype
    dtype = embeds.dtype if embeds is not None else decoder.get_input_embeddings().weight.dtype
    dtype = torch.get_autocast_dtype(where) if torch.is_autocast_enabled(where) else dtype
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(layer, "head_dim", None) or config.hidden_size // heads
    return (str(ids.device), dtype, B, T, heads, kv_heads, head_dim, decoder._kernel_ft_theirs), layer


def plain_rows_to_theirs(decoder, arguments):
    """Whether this unmasked call's rows of one document run the model's own attention:
    measured faster than ours on this device for this shape (see above)."""
    found = _plain_row_key(decoder, arguments)
    if found is None:
        return False
    key, layer = found
    if key in PLAIN_ROW_CHOICES:
        return PLAIN_ROW_CHOICES[key][0]
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or capturing:
        return False
    if len(PLAIN_ROW_CHOICES) >= MAX_MEASURED_SHAPES:
        def distance(k):  # another layout of heads or dtype last, then the difference in tokens
            return k[:2] + k[4:] != key[:2] + key[4:], abs(k[2] * k[3] - key[2] * key[3])
        return PLAIN_ROW_CHOICES[min(PLAIN_ROW_CHOICES, key=distance)][0]
    failed = None
    try:
        ours_ms, theirs_ms = time_plain_rows(layer, key)
    except Exception as e:  # noqa: BLE001 - out of memory for the random rows, say: ours, as without the choice
        failed, ours_ms, theirs_ms = _error_line(e), float("nan"), float("nan")
    if failed and torch.cuda.is_available():
        torch.cuda.empty_cache()  # outside the handler: the traceback no longer holds the random rows
    PLAIN_ROW_CHOICES[key] = (theirs_ms < ours_ms, ours_ms, theirs_ms, failed)
    for listener in CHOICE_LISTENERS:
        listener(choice_line(key))
    return PLAIN_ROW_CHOICES[key][0]


def choice_line(key):
    """One line saying what a measured shape runs, and why."""
    theirs_faster, ours_ms, theirs_ms, failed = PLAIN_ROW_CHOICES[key]
    _, dtype, B, T, heads, kv_heads, head_dim, theirs = key
    kept = f"the model's own ({theirs})" if theirs_faster else "ours"
    measured = (f"not measured ({failed})" if failed else
                f"measured fwd+bwd per layer: ours {ours_ms:.3f} ms, {theirs} {theirs_ms:.3f} ms")
    return (f"rows of one document, {B} x {T:,} tokens, {heads}/{kv_heads} heads of {head_dim}, "
            f"{str(dtype).replace('torch.', '')}: {kept}, {measured}")


def time_plain_rows(layer, key, repeats=MEASURE_REPEATS, clock=None):
    """(ours ms, theirs ms): median of ``repeats`` fwd+bwd calls of each attention on
    random rows of ``key``'s shape, through ``layer`` (its scaling, heads, causality),
    one of each in turn after a first call each (compilation, caches). ``clock``: a
    function timing one call in ms (default: kernel_common.gpu_clock's CUDA events)."""
    device, dtype, B, T, heads, kv_heads, head_dim, theirs = key
    generator = torch.Generator(device=device).manual_seed(0)  # not the run's random stream

    def rows(h):
        return torch.randn(B, h, T, head_dim, generator=generator, device=device, dtype=dtype).requires_grad_()

    q, k, v = rows(heads), rows(kv_heads), rows(kv_heads)
    upstream = torch.randn(B, T, heads, head_dim, generator=generator, device=device, dtype=dtype)
    scaling = getattr(layer, "scaling", None)
    calls = {
        "ours": lambda: hf_packed_attention(layer, q, k, v, None, scaling=scaling)[0],
        "theirs": lambda: attention_function(layer, theirs)(layer, q, k, v, None, scaling=scaling, dropout=0.0)[0],
    }

    def once(name):
        q.grad = k.grad = v.grad = None
        calls[name]().backward(upstream)

    clock = clock or (lambda call: gpu_clock(call)[1])
    for name in calls:
        once(name)
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name in calls:
            times[name].append(clock(lambda: once(name)))
    return tuple(sorted(t)[len(t) // 2] for t in (times["ours"], times["theirs"]))




def use_packed_attention(model):
    """Make ``model``'s attention layers call ours (registered once under NAME), after
    checking that it computes what theirs does (check_same_attention), with calls that
    carry a padding mask or a KV cache routed to theirs (route_masked_calls); return
    the number of attention layers. Calling it again changes nothing."""
    from transformers import AttentionInterface

    count = sum(1 for _ in _attention_layers(model))
    theirs = model.config._attn_implementation
    if theirs == NAME:
        return count
    AttentionInterface.register(NAME, hf_packed_attention)
    try:
        padded = _padded_logits(model)  # the model's own, before the switch
    except Exception as e:  # noqa: BLE001 - its own attention cannot take a padded row: nothing to check against
        raise SwapMismatch(f"{type(model).__name__}'s own attention does not run a left-padded row "
                           f"({_error_line(e)})") from None
    check_same_attention(model, theirs)
    check_gradients_reach(model, theirs)
    model.set_attn_implementation(NAME)
    route_masked_calls(model, theirs)
    check_padding_is_routed(model, theirs, padded)
    return count


# A padding mask must reach the model's own attention. The routing wraps the decoder's
# forward, so a family whose causal LM does not call that module (ModernBERT's decoder)
# would run ours on a padded row, its mask unseen: the last check runs a left-padded
# probe through the switched model and compares it with the model's own logits.
@torch.no_grad()
def _padded_logits(model):
    weight = next(model.parameters())
    if weight.is_meta:
        return None
    ids = _probe_ids(2 * PROBE_LENGTHS[0], model, weight.device).view(2, -1)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    with evaluating(model):
        return model(input_ids=ids, attention_mask=mask).logits.float()[mask.bool()]


def _undo_switch(model, theirs):
    decoder = decoder_of(model)
    for name in ("forward", "_kernel_ft_attention_forward"):
        decoder.__dict__.pop(name, None)
    model.set_attn_implementation(theirs)


def check_padding_is_routed(model, theirs, expected):
    """Undo the switch and raise SwapMismatch unless a padded row gives ``expected``."""
    if expected is None:
        return
    try:
        got = _padded_logits(model)
    except Exception as e:  # noqa: BLE001 - the model's own attention ran this row before the switch
        _undo_switch(model, theirs)
        raise SwapMismatch(f"{type(model).__name__}: a row with a padding mask fails once switched "
                           f"({_error_line(e)})") from None
    rounding = probe_rounding(next(model.parameters()).dtype)
    if not torch.allclose(got, expected, rtol=rounding, atol=rounding * expected.abs().max().item()):
        _undo_switch(model, theirs)
        raise SwapMismatch(f"{type(model).__name__}: a row with a padding mask does not reach the model's own "
                           f"attention through its decoder's forward (max logit difference "
                           f"{(got - expected).abs().max().item():.2g}); the kernel would ignore the mask")
