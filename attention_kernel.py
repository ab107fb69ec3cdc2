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
  compiles with 8 warps and is no faster, with 4 warps it returns NaN. Computing
  dK/dV transposed (S^T = K Q^T, no transposed register tiles), and issuing the next
  key tile's scores before this tile's softmax: both slower, the second because the
  compiler stops pipelining that loop (results/attention/kernel_probes_h200/).

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

In a Hugging Face model the kernel is one attention function among the model's own;
attention_routing.py says which calls it takes (and checks, before the switch, that it
computes what the model's attention computes).

Nothing runs on import. See attention_test.py for the checks.
"""

import math
from typing import Optional

import torch

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import (
    IN_INTERPRETER, INTERPRET, SUPPORTED_DTYPES, cast_to, cdiv, check_kernel_device, exp, fast_launch,
    first_order_only, kernel_op, log, next_power_of_2, tanh, traced,
)

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

try:  # the Hopper forward, in Gluon (a Triton without its experimental dialect: the kernels below only)
    import attention_hopper_kernel
except ImportError:
    attention_hopper_kernel = None


# --------------------------------------------------------------------------------
# The reference: plain softmax attention, document by document
# --------------------------------------------------------------------------------
def document_starts(position_ids):
    """[B, T] position ids -> [B, T] int32, the position where each token's document
    starts. A document begins wherever the position does not follow the one before by
    exactly 1, transformers' rule for packed rows (masking_utils.find_packed_sequence_indices):
    packing restarts the positions at 0 with every document; positions that count on in
    one piece, from any start, are one document (0 everywhere). No host sync: a running
    maximum of the positions where documents begin."""
    t = torch.arange(position_ids.shape[-1], device=position_ids.device)
    begins = torch.ones_like(position_ids, dtype=torch.bool)
    begins[..., 1:] = position_ids[..., 1:] - position_ids[..., :-1] != 1
    return torch.cummax(torch.where(begins, t, 0), dim=-1).values.to(torch.int32)


def one_document_rows(B, T, device):
    """doc_start of B rows of T tokens that hold one document each: 0 everywhere, as one element
    broadcast (stride 0 along the rows). That form says so to the launchers without reading the
    tensor (a host sync): only such rows may take the Hopper kernels (see USE_HOPPER_FORWARD)."""
    return torch.zeros(1, 1, dtype=torch.int32, device=device).expand(B, T)


def _one_document(doc_start):
    # One start for every token of a row (stride 0 along it): token 0's, which is 0. (A dim of
    # size 1 keeps its stride in a broadcast; a row of one token is one document anyway.)
    return doc_start.shape[-1] == 1 or doc_start.stride(-1) == 0


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

# On an H100 / H200 the forward runs attention_hopper_kernel.py (Gluon: warp-specialized, the
# softmax overlapped with the products) where it applies: rows of one document (one_document_rows),
# 16-bit, head dim 64 or 128, no window, no soft cap, rows TMA can read. Measured on an H100
# (results/attention/gluon_h100/): the 8K document 913-980 us against this file's 1,110-1,205
# (cuDNN 976-998), 16K 3,615-3,702 against 4,404-4,599. Packed rows stay here: short documents run
# faster on this file's smaller tiles (attention_hopper_kernel.py says by how much).
USE_HOPPER_FORWARD = True


# The backward there too (five products per tile instead of seven; dQ summed by TMA reductions,
# which Gluon has from Triton 3.8 on: before that its float32 atomics make it slower than this
# file's backward). H100, Triton 3.9 (results/attention/gluon_h100/backward_order/): the 8K document
# 3.00-3.04 ms against this file's 3.67-3.78 (cuDNN 2.82-2.90).
USE_HOPPER_BACKWARD = True
# Packed rows too, where the caller lets dQ be a view of its float32 buffer (attention_backward's
# dq_view: eager autograd, not a traced graph). Measured on an H100 (results/attention/gluon_h100/
# dq_in_place/): documents of 512-4,096 tokens 2.49-2.53 ms against this file's 2.79-2.90, of 40-200
# 0.78 against 0.87; attention's extra memory on those 16K rows 476 MB against 343 here (FlexAttention's
# 474: dQ cast in place keeps the buffer within it; a dQ of its own would make it about 610, computed).
# A traced backward keeps this file's kernels on packed rows, and their 343 MB.
USE_HOPPER_BACKWARD_PACKED = True


def _hopper_ok(q, k, v, doc_start, window, softcap, packed=False):
    """Whether attention_hopper_kernel.py takes these rows: one document each (or packed ones too),
    an H100 / H200, what its kernels support (supports()), no window, no soft cap."""
    return (attention_hopper_kernel is not None and not INTERPRET and q.is_cuda
            and (packed or _one_document(doc_start))
            and torch.cuda.get_device_capability(q.device) == (9, 0) and attention_hopper_kernel.supports(q, k, v)
            and not window and not softcap)


def _hopper_forward_ok(q, k, v, doc_start, window, softcap):
    return USE_HOPPER_FORWARD and _hopper_ok(q, k, v, doc_start, window, softcap)


def _hopper_backward_ok(q, k, v, doc_start, window, softcap, dq_view=False):
    """Rows of one document; packed rows too where dq may be a view of its buffer (attention_backward)."""
    packed = dq_view and USE_HOPPER_BACKWARD_PACKED
    return (USE_HOPPER_BACKWARD and _hopper_ok(q, k, v, doc_start, window, softcap, packed=packed)
            and attention_hopper_kernel.TMA_REDUCE)


def _check(q, k, v, doc_start, doc_end=None, name="attention"):
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
    bounds = [("doc_start", doc_start, "an", "document_starts")]
    if doc_end is not None:
        bounds.append(("doc_end", doc_end, "None or an", "document_ends"))
    for what, t, allowed, made_by in bounds:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, T) or t.dtype != torch.int32:
            got = (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                   else "none" if t is None else type(t).__name__)
            raise ValueError(f"{name}: {what} must be {allowed} int32 [B, T] = [{B}, {T}] tensor ({made_by}), "
                             f"got {got}")
    check_kernel_device(q, k, v, *(t for _, t, _, _ in bounds))


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
def _attention_forward_fake(q, k, v, doc_start, scale, window, softcap, doc_end=None):
    B, Hq, T, D = q.shape
    return q.new_empty(B, T, Hq, D), q.new_empty(B, Hq, T, dtype=torch.float32)


@kernel_op("attention_forward", fake=_attention_forward_fake)
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_start: torch.Tensor,
                      scale: float, window: int, softcap: float, doc_end: Optional[torch.Tensor] = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, Hq, D], lse [B, Hq, T] float32) of q [B, Hq, T, D], k, v [B, Hkv, T, D].
    doc_end is not read here: an input of the operator only so that its backward gets it."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if _hopper_forward_ok(q, k, v, doc_start, window, softcap):
        return attention_hopper_kernel.attention_forward_hopper(q, k, v, scale, None, out=out, lse=lse)
    doc_start = doc_start.contiguous()  # the kernels read it as [B, T] (one_document_rows: broadcast)
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


def backward_delta(out, dout):
    """delta_i = sum_d dO_id O_id per row and head, [B, Hq, T] float32, which every backward reads
    (out and dout [B, T, Hq, D])."""
    B, T, Hq, D = out.shape
    delta = torch.empty(B, Hq, T, dtype=torch.float32, device=out.device)
    block_t = 16 if INTERPRET else 64
    _attn_bwd_delta_kernel[(cdiv(T, block_t), B * Hq)](
        out, dout, delta, dout.stride(0), dout.stride(1), dout.stride(2), T, Hq, D=D,
        DP=max(16, next_power_of_2(D)), BLOCK_T=block_t)
    return delta


def _attention_backward_fake(dout, q, k, v, out, lse, doc_start, scale, window, softcap, dq_view=False,
                             doc_end=None):
    # Contiguous, as the launcher makes them (empty_like would copy q's strides: HF's q is a transposed view).
    # Traced calls never pass dq_view (_attention_grads), so this is the layout they get.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ends_as_rows(doc_start, doc_end):
    """doc_end as the kernels read it, [B, T] contiguous (b * T + t): the caller's, or made here."""
    return document_ends(doc_start.contiguous()) if doc_end is None else doc_end.contiguous()


@kernel_op("attention_backward", fake=_attention_backward_fake)
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, doc_start: torch.Tensor, scale: float, window: int,
                       softcap: float, dq_view: bool = False, doc_end: Optional[torch.Tensor] = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's, k's, v's shapes (contiguous unless dq_view) from dout [B, T, Hq, D]. dq_view: dq may be
    the Gluon backward's strided view of its float32 buffer (attention_hopper_kernel.cast_in_place),
    which saves its own 2 bytes per element, and the Gluon backward's gradients come in the inputs'
    layout where that is HF's (grads_like_inputs: no copies in the layers' backward); only then do
    packed rows take that backward. doc_end:
    document_ends(doc_start) where the caller made it already (made here otherwise)."""
    q, k, v, dout = (_last_dim_contiguous(t) for t in (q, k, v, dout))
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if q.numel() == 0:
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    delta = backward_delta(out, dout)
    if _hopper_backward_ok(q, k, v, doc_start, window, softcap, dq_view):
        doc_end = None if _one_document(doc_start) else _ends_as_rows(doc_start, doc_end)
        return attention_hopper_kernel.attention_backward_hopper(dout, q, k, v, lse, delta, doc_end, scale,
                                                                 dq_in_place=dq_view, grads_like_inputs=dq_view)
    dq = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hkv, T, D, dtype=k.dtype, device=k.device)
    dv = torch.empty(B, Hkv, T, D, dtype=v.dtype, device=v.device)
    dp = max(16, next_power_of_2(D))
    doc_end = _ends_as_rows(doc_start, doc_end)
    doc_start = doc_start.contiguous()
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
    q, k, v, doc_start, scale, window, softcap, doc_end = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, doc_start, doc_end)
    ctx.scale, ctx.window, ctx.softcap = scale, window, softcap
    ctx.mark_non_differentiable(lse)


def _attention_grads(ctx, dout, _dlse):
    q, k, v, out, lse, doc_start, doc_end = ctx.saved_tensors
    # A strided dq only in eager mode: a traced backward gets the fake's layout, contiguous.
    dq_view = not (torch.compiler.is_compiling() or traced(dout))
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, doc_start, ctx.scale, ctx.window, ctx.softcap,
                                    dq_view, doc_end)
    return dq, dk, dv, None, None, None, None, None


class TritonAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc_start, scale, window, softcap, doc_end):
        output = attention_forward(q, k, v, doc_start, scale, window, softcap, doc_end)
        _attention_save(ctx, (q, k, v, doc_start, scale, window, softcap, doc_end), output)
        return output

    @staticmethod
    @first_order_only("attention")
    def backward(ctx, dout, dlse):
        return _attention_grads(ctx, dout, dlse)


attention_forward.op.register_autograd(first_order_only("attention")(_attention_grads),
                                       setup_context=_attention_save)


def packed_attention(q, k, v, doc_start, scale=None, window=None, softcap=None, doc_end=None):
    """Causal attention inside documents: q [B, Hq, T, D], k, v [B, Hkv, T, D]
    (bf16/fp16/fp32), doc_start [B, T] int32 (document_starts of the position ids).
    Returns [B, T, Hq, D] (HF's attention output layout). Differentiable in q, k
    and v. ``scale``: 1/sqrt(D) by default. ``window``: HF's sliding window (keys
    fewer than ``window`` positions back), None or 0 for none. ``softcap``: Gemma-2's
    cap on the scores (cap tanh(scores / cap)), None or 0 for none. ``doc_end``:
    document_ends(doc_start) [B, T] int32, which the backward reads, where the caller
    keeps it for every layer (None: the backward makes it)."""
    _check(q, k, v, doc_start, doc_end)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    window = int(window or 0)
    if window < 0:
        raise ValueError(f"attention: window must be >= 0 (0: none), got {window}")
    softcap = float(softcap or 0.0)
    if not softcap >= 0.0 or math.isinf(softcap):
        raise ValueError(f"attention: softcap must be a finite number >= 0 (0: none), got {softcap}")
    if torch.compiler.is_compiling():
        return attention_forward.op(q, k, v, doc_start, scale, window, softcap, doc_end)[0]
    return TritonAttentionFunction.apply(q, k, v, doc_start, scale, window, softcap, doc_end)[0]
