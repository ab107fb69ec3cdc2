"""
Step 14 -- Fused rotary position embedding (RoPE) in Triton, forward and backward.

What it computes
----------------
LLaMA tells attention where each token sits by *rotating* its query and key
vectors by an angle that grows with the position. Every attention layer of
Hugging Face's LLaMA does, right after the q/k projections::

    q = q_proj(h).view(B, T, nh, D).transpose(1, 2)      # [B, nh, T, D]
    k = k_proj(h).view(B, T, n_kv, D).transpose(1, 2)    # [B, n_kv, T, D]
    cos, sin = position_embeddings                       # [B, T, D], no grad
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)

    apply_rotary_pos_emb:  x * cos + rotate_half(x) * sin      (cos, sin broadcast over heads)
    rotate_half(x)      =  cat(-x[..., D/2:], x[..., :D/2])

Split a head vector into halves x1 = x[..., :D/2] and x2 = x[..., D/2:], and the
same for cos (c1, c2) and sin (s1, s2). Then the formula is, element by element::

    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2

For the real RoPE tables c1 == c2 = cos(theta_i) and s1 == s2 = sin(theta_i)
(HF builds them as cat(freqs, freqs)), so each pair (x1[i], x2[i]) is turned by
the angle theta_i = position * base^(-2i/D). We use the halves separately
anyway: that is what HF computes, whatever tables it is given.

Dtype behaviour, reproduced exactly. In bf16 each product is its own PyTorch
kernel, computed in float32 and rounded to bf16; the sum is rounded once more::

    y1 = round( round(x1 * c1) - round(x2 * s1) )

(negating before or after the rounding gives the same bits). The fused kernel
rounds at the same two places, so a patched model computes the same numbers as
an unpatched one, bit for bit. The result dtype is
``torch.promote_types(q.dtype, cos.dtype)``, as in PyTorch.

Why a custom kernel
-------------------
RoPE is a handful of multiply-adds per element on q and k: pure memory traffic.
Eager PyTorch runs it as 5 kernels per tensor in forward (mul, neg, cat, mul,
add) and about 9 in backward (two muls, a neg, two ``slice_backward``s that
each fill a zero tensor and copy a half into it, two adds to sum the three
gradient contributions). In bf16 (2 bytes per element of q or k)::

    forward   x*cos 4 B, neg (half) 2 B, cat 4 B, *sin 4 B, add 6 B     ~ 20 B / element
    backward  g*cos 4 B, g*sin 4 B, neg 2 B, 2 slice_backward 8 B,
              2 adds 12 B                                                ~ 30 B / element

The fused forward reads q and k once and writes q_embed and k_embed once
(4 B / element); the fused backward reads the upstream gradient and writes the
input gradient (4 B / element). cos and sin are a [T, D] table shared by all
heads: each program reads its tokens' rows once and reuses them for every head.

For LLaMA-3.1-8B (nh = 32, n_kv = 8, D = 128) at 2 x 2048 tokens, one layer's q
and k hold 4096 x (32 + 8) x 128 = 21.0 M elements. Eager: 50 B x 21 M = 1.05 GB
and 28 launches per layer, 34 GB and ~900 launches per training step over the
32 layers. Fused: 8 B x 21 M = 168 MB and 2 launches per layer, 5.4 GB per step.
Memory capacity hardly changes: eager autograd keeps only cos and sin (q and k
are not needed to differentiate x * cos with respect to x), and so do we.

Measured during development (an ad-hoc CUDA-graph timing, not kept) on one H200
(torch 2.11, triton 3.6, copy bandwidth 4.24 TB/s), that shape in bf16, GPU time
per layer (graph replay, so Python overhead is excluded): eager forward 301 us, forward + backward 589 us, i.e. 19 ms per
step over 32 layers; fused 23.5 us and 48 us (3.66 and 3.58 TB/s effective by
the byte counts above, 85-86% of copy speed), 1.5 ms per step. Launched from
Python one call at a time, both versions are limited by host time at this size
(ours costs ~65 us of Python per forward call, measured on tiny tensors; see
NOTES.md on the host time of autograd Functions). In a training step that host
time overlaps with GPU work already queued (the large matmuls); how much of it
hides is for the end-to-end measurement to show: in the profile of a full step
(README Step 16) RoPE takes 1.4 ms of GPU time, and the GPU idles 9.9 ms of
357 ms in all.

Triton concepts new in this step (see rmsnorm_kernel.py, swiglu_kernel.py)
--------------------------------------------------------------------------
* A 4-D strided tensor. HF's q is a *transposed view*: logically [B, nh, T, D],
  physically the [B, T, nh, D] output of q_proj. The kernel takes the element
  (b, h, t, d) at ``base + b*stride_b + h*stride_h + t*stride_t + d``, so the
  view is read in place, whatever its layout (only the last dimension must be
  contiguous). The outputs get the same layout (``torch.empty_like`` keeps the
  strides of a dense view), so attention downstream sees what it sees today.
* One program per token (b, t) on a GPU, all heads of q and k: the program
  loads the token's cos/sin row once and rotates [1, heads, D/2] tiles of q,
  then of k. In the HF layout a token's heads are one contiguous nh x D block
  (8 KB of bf16 for LLaMA's q), so each tile is a compact, fully used piece of
  memory. The tiles are 3-D, [BLOCK_T tokens, heads, D/2], because the CPU
  interpreter, which pays Python time for every program, gives a program up to
  64 tokens (of the B * T, across rows); on a GPU BLOCK_T is 1, and the token
  dimension of one entry costs nothing.
* Broadcasting inside the kernel: the cos/sin rows are loaded as [tokens, 1, D/2]
  and used against the [tokens, heads, D/2] tile as they are (the size-1 axis
  stretches over the heads); a cos table shared by the whole batch ([1, T, D])
  is addressed with a batch stride of 0.
* The backward of a rotation is its transpose, i.e. the rotation by -theta: it
  needs only the upstream gradient and cos/sin, no saved activations.
* ``enable_fp_fusion=False``: forbid the compiler from merging ``a*b - c*d`` into
  a fused multiply-add, which rounds once instead of twice. PyTorch rounds twice
  (separate kernels), and so must we if float32 results are to match its bits.

Using it in a model
-------------------
``fuse_rope(model)`` makes each attention layer of ``model`` find our function
under HF's module-level name ``apply_rotary_pos_emb`` while that layer runs,
gradient checkpointing's recomputation included; ``patched_rope(model)`` is the
same swap as a context manager around a whole forward pass. Both are at
the end of this file, which also says why the swap is scoped.

Nothing runs on import. See rope_test.py for the checks.
"""

import contextlib
import functools
import sys
import types
from typing import Optional

import torch

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import (
    SUPPORTED_DTYPES, cast_to, check_kernel_device, fast_launch, first_order_only, kernel_op, next_power_of_2, nothing,
)
from swap_common import SwapMismatch, our_forward, set_forward, text_config, text_modules

import triton
import triton.language as tl


# --------------------------------------------------------------------------------
# The reference: Hugging Face's eager formula. Tests compare against it (and its
# float64 version); the benchmark times it as "PyTorch eager".
# --------------------------------------------------------------------------------
def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(q, k, cos, sin, unsqueeze_dim=1):
    """HF ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin`` for q and k."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate_half(q) * sin)
    k_embed = (k * cos) + (_rotate_half(k) * sin)
    return q_embed, k_embed


# --------------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------------
@triton.jit
def _round(x, dtype: tl.constexpr):
    # Round a float32 value to dtype and come back to float32: what storing an
    # intermediate tensor of that dtype does in eager PyTorch.
    return cast_to(x, dtype).to(tl.float32)


@triton.jit
def _rope_fwd_heads(
    X,  # [B, H, T, D] input, last dim contiguous
    Y,  # [B, H, T, D] output, last dim contiguous, promoted dtype
    x_tok,  # [BLOCK_T] int64 offsets of (b, 0, t, 0) in X, one per token
    y_tok,  # [BLOCK_T] int64 offsets of (b, 0, t, 0) in Y
    tok_mask,  # [BLOCK_T] which of them are tokens (the last program's tail is not)
    stride_xh,
    stride_yh,
    n_heads,
    half,  # D / 2
    d,  # [BLOCK_D] column indices 0 .. BLOCK_D-1
    d_mask,  # [BLOCK_D] d < half
    c1, c2, s1, s2,  # [BLOCK_T, 1, BLOCK_D] float32 halves of the tokens' cos and sin rows
    BLOCK_H: tl.constexpr,
):
    OUT: tl.constexpr = Y.dtype.element_ty
    # All heads of the tokens, BLOCK_H at a time (LLaMA-3.1-8B: 4 trips for q, 1 for k).
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = tok_mask[:, None, None] & (h < n_heads)[None, :, None] & d_mask[None, None, :]
        # 64-bit offsets: in a contiguous [B, H, T, D] q, h * stride_h = h * T * D
        # passes 2**31 at 32 heads of 512K tokens (b and t are int64 already).
        h64 = h.to(tl.int64)
        x_ptrs = X + x_tok[:, None, None] + h64[None, :, None] * stride_xh + d[None, None, :]
        y_ptrs = Y + y_tok[:, None, None] + h64[None, :, None] * stride_yh + d[None, None, :]
        x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptrs + half, mask=mask, other=0.0).to(tl.float32)

        # HF's order of rounding: each product to the output dtype, then the sum.
        # For float32 outputs _round is a no-op and the kernel is launched with
        # enable_fp_fusion=False, so the products are not folded into an FMA.
        y1 = _round(x1 * c1, OUT) - _round(x2 * s1, OUT)
        y2 = _round(x2 * c2, OUT) + _round(x1 * s2, OUT)
        tl.store(y_ptrs, cast_to(y1, OUT), mask=mask)
        tl.store(y_ptrs + half, cast_to(y2, OUT), mask=mask)


@triton.jit
def _load_cos_sin(COS, SIN, b, t, tok_mask, stride_cb, stride_ct, stride_sb, stride_st, half, d, d_mask):
    # The tokens' rows of the tables ([BLOCK_T] b and t), split in halves, in
    # float32, shaped [BLOCK_T, 1, BLOCK_D] to broadcast over the heads. A table
    # shared by the batch ([1, T, D]) comes with stride_cb == 0.
    c_row = (COS + b * stride_cb + t * stride_ct)[:, None, None] + d[None, None, :]
    s_row = (SIN + b * stride_sb + t * stride_st)[:, None, None] + d[None, None, :]
    mask = tok_mask[:, None, None] & d_mask[None, None, :]
    c1 = tl.load(c_row, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_row, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + half, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@fast_launch
@triton.jit(do_not_specialize=["seq_len", "n_tokens"])  # varying counts: not specialized (rmsnorm_kernel.py)
def _rope_fwd_kernel(
    Q,  # [B, nh, T, D] query (HF: a transposed view of [B, T, nh, D]); last dim contiguous
    K,  # [B, n_kv, T, D] key, same kind of layout (its strides may differ from Q's)
    COS,  # [B or 1, T, D] cosine table; batch stride 0 when shared by the batch
    SIN,  # [B or 1, T, D] sine table, same shape and dtype as COS
    QO,  # [B, nh, T, D] output q_embed, laid out like Q
    KO,  # [B, n_kv, T, D] output k_embed, laid out like K
    seq_len,
    n_tokens,  # B * T
    n_q_heads,
    n_k_heads,
    half,  # D / 2
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_qob, stride_qoh, stride_qot,
    stride_kob, stride_koh, stride_kot,
    stride_cb, stride_ct,
    stride_sb, stride_st,
    BLOCK_D: tl.constexpr,  # power of two >= D / 2
    BLOCK_HQ: tl.constexpr,  # q heads per tile
    BLOCK_HK: tl.constexpr,  # k heads per tile
    BLOCK_T: tl.constexpr,  # tokens per program: 1 on a GPU
):
    # One program per token (BLOCK_T tokens in the interpreter): token = b * T + t.
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < n_tokens
    b = tok // seq_len
    t = tok % seq_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < half

    # The tokens' cos/sin rows: loaded once, used for every q head and every k head.
    c1, c2, s1, s2 = _load_cos_sin(COS, SIN, b, t, tok_mask, stride_cb, stride_ct, stride_sb, stride_st, half, d,
                                   d_mask)

    # Both tensors in one launch: one launch instead of two, and k reuses the
    # cos/sin rows already in registers.
    _rope_fwd_heads(Q, QO, b * stride_qb + t * stride_qt, b * stride_qob + t * stride_qot, tok_mask,
                    stride_qh, stride_qoh, n_q_heads, half, d, d_mask, c1, c2, s1, s2,
                    BLOCK_HQ)
    _rope_fwd_heads(K, KO, b * stride_kb + t * stride_kt, b * stride_kob + t * stride_kot, tok_mask,
                    stride_kh, stride_koh, n_k_heads, half, d, d_mask, c1, c2, s1, s2,
                    BLOCK_HK)


# --------------------------------------------------------------------------------
# Backward kernel
# --------------------------------------------------------------------------------
# Derivation (per head, per pair i < D/2; g = dL/dy, the upstream gradient):
#
#   y1 = x1 * c1 - x2 * s1          dy1/dx1 =  c1    dy1/dx2 = -s1
#   y2 = x2 * c2 + x1 * s2          dy2/dx1 =  s2    dy2/dx2 =  c2
#
#   dx1 = g1 * dy1/dx1 + g2 * dy2/dx1 =  g1 * c1 + g2 * s2
#   dx2 = g1 * dy1/dx2 + g2 * dy2/dx2 = -g1 * s1 + g2 * c2
#
# In matrix form the forward is y = R x with R = [[c1, -s1], [s2, c2]] and the
# backward is dx = R^T g. For the real tables (c1 = c2 = cos, s1 = s2 = sin) R is
# the rotation by +theta and R^T the rotation by -theta: the backward rotates
# the gradient back. (With HF's attention_scaling != 1 the tables are scaled,
# R^T is no longer R's inverse; the formula above is the transpose either way.)
#
# Only g, cos and sin appear: nothing from the forward pass but the two small
# tables is kept. The roundings of the forward have no derivative; we compute
# in float32 and round once, where eager PyTorch rounds each of its ~5
# intermediate gradients to bf16 (so ours is slightly more accurate). In
# float32, eager autograd computes exactly fl(fl(g1*c1) + fl(g2*s2)) (the other
# contributions it adds are zeros), and so do we with FMA contraction off: a
# float32 model gets the same gradient bits with or without the patch.
@triton.jit
def _rope_bwd_heads(
    G,  # [B, H, T, D] upstream gradient, last dim contiguous
    DX,  # [B, H, T, D] input gradient, laid out like the forward input
    g_tok,  # [BLOCK_T] offsets, as in _rope_fwd_heads
    dx_tok,
    tok_mask,
    stride_gh,
    stride_dxh,
    n_heads,
    half,
    d,
    d_mask,
    c1, c2, s1, s2,
    BLOCK_H: tl.constexpr,
):
    OUT: tl.constexpr = DX.dtype.element_ty
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = tok_mask[:, None, None] & (h < n_heads)[None, :, None] & d_mask[None, None, :]
        h64 = h.to(tl.int64)
        g_ptrs = G + g_tok[:, None, None] + h64[None, :, None] * stride_gh + d[None, None, :]
        dx_ptrs = DX + dx_tok[:, None, None] + h64[None, :, None] * stride_dxh + d[None, None, :]
        g1 = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(g_ptrs + half, mask=mask, other=0.0).to(tl.float32)
        dx1 = g1 * c1 + g2 * s2
        dx2 = g2 * c2 - g1 * s1
        tl.store(dx_ptrs, cast_to(dx1, OUT), mask=mask)
        tl.store(dx_ptrs + half, cast_to(dx2, OUT), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["seq_len", "n_tokens"])  # varying counts: not specialized (rmsnorm_kernel.py)
def _rope_bwd_kernel(
    DQO,  # [B, nh, T, D] gradient of q_embed; any strides, last dim contiguous
    DKO,  # [B, n_kv, T, D] gradient of k_embed
    COS,  # [B or 1, T, D], as in forward
    SIN,  # [B or 1, T, D]
    DQ,  # [B, nh, T, D] output gradient of q, laid out like q was
    DK,  # [B, n_kv, T, D] output gradient of k, laid out like k was
    seq_len,
    n_tokens,
    n_q_heads,
    n_k_heads,
    half,
    stride_gqb, stride_gqh, stride_gqt,
    stride_gkb, stride_gkh, stride_gkt,
    stride_dqb, stride_dqh, stride_dqt,
    stride_dkb, stride_dkh, stride_dkt,
    stride_cb, stride_ct,
    stride_sb, stride_st,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    COMPUTE_DQ: tl.constexpr,  # False when q needs no gradient: its loop is compiled out
    COMPUTE_DK: tl.constexpr,  # False when k needs no gradient
    BLOCK_T: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < n_tokens
    b = tok // seq_len
    t = tok % seq_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < half
    c1, c2, s1, s2 = _load_cos_sin(COS, SIN, b, t, tok_mask, stride_cb, stride_ct, stride_sb, stride_st, half, d,
                                   d_mask)
    if COMPUTE_DQ:
        _rope_bwd_heads(DQO, DQ, b * stride_gqb + t * stride_gqt, b * stride_dqb + t * stride_dqt, tok_mask,
                        stride_gqh, stride_dqh, n_q_heads, half, d, d_mask, c1, c2, s1, s2,
                        BLOCK_HQ)
    if COMPUTE_DK:
        _rope_bwd_heads(DKO, DK, b * stride_gkb + t * stride_gkt, b * stride_dkb + t * stride_dkt, tok_mask,
                        stride_gkh, stride_dkh, n_k_heads, half, d, d_mask, c1, c2, s1, s2,
                        BLOCK_HK)


# --------------------------------------------------------------------------------
# Launch helpers: checks, tile sizes, grid
# --------------------------------------------------------------------------------
# Elements per [heads, D/2] tile of one token. On a GPU each program moves all of its
# token's q and k, 2 x (32 + 8) x 128 x 2 B = 20 KB for LLaMA-3.1-8B, BLOCK_H heads at a time;
# the loop over head blocks keeps registers bounded for any head count. With
# D/2 = 64, a 512-element tile is 8 heads: q takes 4 trips, k one.
# Sweep on an H200 (2 x 2048 tokens, 32/8 heads, D = 128, bf16, CUDA-graph
# timing; tiles 512-4096 x 1/2/4/8 warps): the forward ran 23.4-27.6 us for
# every setting (near copy speed); the backward 24.7 us with 512 x 4 warps,
# 26-29 us for most others and 34 us with 2048+ x 8 warps.
TILE_ELEMENTS = 512
NUM_WARPS = 4
# The interpreter runs programs one by one, each for Python time: up to this many
# tokens per program there (a GPU program takes one token).
INTERPRET_TOKENS = 64


def _tokens_per_program(n_tokens, device):
    """BLOCK_T: 1 on a GPU; in the interpreter up to INTERPRET_TOKENS, so that the
    B * T tokens take cdiv(B * T, 64) programs."""
    return 1 if device.type == "cuda" else min(INTERPRET_TOKENS, next_power_of_2(max(n_tokens, 1)))


@functools.lru_cache(maxsize=None)  # host time counts (Step 17)
def _launch_config(half, n_q_heads, n_k_heads):
    """(BLOCK_D, BLOCK_HQ, BLOCK_HK) for a head dim D = 2 * half."""
    block_d = next_power_of_2(max(half, 1))
    rows = max(1, TILE_ELEMENTS // block_d)
    block_hq = min(next_power_of_2(max(n_q_heads, 1)), rows)
    block_hk = min(next_power_of_2(max(n_k_heads, 1)), rows)
    return block_d, block_hq, block_hk


def _last_dim_contiguous(t):
    """The kernels need stride(-1) == 1; anything else (rare) is copied."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _table_strides(table, batch, seq_len):
    """(batch stride, time stride) of a [B or 1, T or 1, D] table; 0 where it broadcasts."""
    sb = table.stride(0) if table.shape[0] == batch else 0
    st = table.stride(1) if table.shape[1] == seq_len else 0
    return sb, st


def _normalize_unsqueeze_dim(unsqueeze_dim):
    # cos/sin are [B, T, D]; unsqueeze(1) fits q as [B, H, T, D] (HF LLaMA's
    # layout), unsqueeze(2) fits q as [B, T, H, D]. Negative forms name the same
    # positions of a 3-D tensor.
    if unsqueeze_dim in (1, -3):
        return 1
    if unsqueeze_dim in (2, -2):
        return 2
    raise NotImplementedError(
        f"rope: unsqueeze_dim={unsqueeze_dim!r} is not supported; use 1 for q, k as [B, heads, T, D] "
        "(HF LLaMA) or 2 for q, k as [B, T, heads, D], with cos, sin as [B, T, D]"
    )


def _check_inputs(q, k, cos, sin, layout):
    """Clear errors for bad input; layout 1: q, k are [B, H, T, D], layout 2: [B, T, H, D]."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rope expects tensors for q, k, cos and sin, got {type(t).__name__} for {name}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"rope: unsupported {name} dtype {t.dtype}; use float32, float16 or bfloat16")
    if cos.dtype != sin.dtype:
        raise TypeError(f"rope: cos and sin must have the same dtype, got {cos.dtype} and {sin.dtype}")
    layout_name = "[B, heads, T, D]" if layout == 1 else "[B, T, heads, D]"
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"rope: {name} must be 4-D {layout_name}, got shape {tuple(t.shape)}")
    t_axis = 2 if layout == 1 else 1
    batch, seq_len, head_dim = q.shape[0], q.shape[t_axis], q.shape[3]
    if head_dim % 2:
        raise ValueError(f"rope: the head dim D must be even (it is split into two halves), got D = {head_dim}")
    if (k.shape[0], k.shape[t_axis], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(
            f"rope: k's batch, T and D do not match q's: k {tuple(k.shape)} vs q {tuple(q.shape)} "
            f"(both {layout_name}, the head counts may differ)"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        ok = t.dim() == 3 and t.shape[0] in (1, batch) and t.shape[1] in (1, seq_len) and t.shape[2] == head_dim
        if not ok:
            raise ValueError(
                f"rope: {name} shape {tuple(t.shape)} does not fit q's [B, T, D] = "
                f"[{batch}, {seq_len}, {head_dim}] (B and T may be 1 to broadcast); it is "
                f"unsqueezed at dim {layout} to broadcast over the heads of q {layout_name}"
            )
    check_kernel_device(q, k, cos, sin)


def _embed_like(x, table):
    """The output for input ``x``: x's layout (``empty_like`` keeps the strides of a
    dense tensor such as HF's transposed view), dtype promote_types(x, table)."""
    return torch.empty_like(_last_dim_contiguous(x), dtype=torch.promote_types(x.dtype, table.dtype))


def _rope_forward_fake(q, k, cos, sin):
    return _embed_like(q, cos), _embed_like(k, cos)


@kernel_op("rope_forward", fake=_rope_forward_fake)
def rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on [B, H, T, D] tensors. Returns (q_embed, k_embed)."""
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    cos, sin = _last_dim_contiguous(cos), _last_dim_contiguous(sin)
    q_out, k_out = _embed_like(q, cos), _embed_like(k, cos)
    batch, n_q, seq_len, head_dim = q.shape
    n_k = k.shape[1]
    if batch * seq_len * head_dim > 0 and n_q + n_k > 0:
        half = head_dim // 2
        block_d, block_hq, block_hk = _launch_config(half, n_q, n_k)
        n_tokens = batch * seq_len
        block_t = _tokens_per_program(n_tokens, q.device)
        _rope_fwd_kernel[(triton.cdiv(n_tokens, block_t),)](
            q, k, cos, sin, q_out, k_out,
            seq_len, n_tokens, n_q, n_k, half,
            *q.stride()[:3], *k.stride()[:3],  # one stride() call each: host time
            *q_out.stride()[:3], *k_out.stride()[:3],
            *_table_strides(cos, batch, seq_len), *_table_strides(sin, batch, seq_len),
            BLOCK_D=block_d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_T=block_t,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,  # round a*b and c*d separately, as PyTorch does
        )
    return q_out, k_out


def _rope_backward_fake(dq_out, dk_out, cos, sin, q_shape, q_strides, q_dtype, k_shape, k_strides, k_dtype):
    return (
        cos.new_empty_strided(q_shape, q_strides, dtype=q_dtype) if dq_out is not None else nothing(cos),
        cos.new_empty_strided(k_shape, k_strides, dtype=k_dtype) if dk_out is not None else nothing(cos),
    )


@kernel_op("rope_backward", fake=_rope_backward_fake)
def rope_backward(dq_out: Optional[torch.Tensor], dk_out: Optional[torch.Tensor], cos: torch.Tensor,
                  sin: torch.Tensor, q_shape: list[int], q_strides: list[int], q_dtype: torch.dtype,
                  k_shape: list[int], k_strides: list[int], k_dtype: torch.dtype,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel. Returns (dq, dk); each is empty if its upstream gradient is None.

    dq_out, dk_out: gradients of q_embed, k_embed (any strides) or None.
    q_shape, q_strides, q_dtype (k_... likewise): the layout of the forward
    inputs; the input gradients are created with it, so the transpose and view
    that made q from q_proj's output are undone by autograd without a copy.
    """
    compute_dq, compute_dk = dq_out is not None, dk_out is not None
    cos, sin = _last_dim_contiguous(cos), _last_dim_contiguous(sin)
    dq, dk = nothing(cos), nothing(cos)
    if compute_dq:
        dq_out = _last_dim_contiguous(dq_out)
        dq = torch.empty_strided(q_shape, q_strides, dtype=q_dtype, device=cos.device)
    if compute_dk:
        dk_out = _last_dim_contiguous(dk_out)
        dk = torch.empty_strided(k_shape, k_strides, dtype=k_dtype, device=cos.device)
    if not (compute_dq or compute_dk):
        return dq, dk
    # A switched-off side gets the other side's tensors as placeholders: its
    # loop is compiled out, so they are never read or written.
    gq, gk = (dq_out if compute_dq else dk_out), (dk_out if compute_dk else dq_out)
    xq, xk = (dq if compute_dq else dk), (dk if compute_dk else dq)
    batch, _, seq_len, head_dim = q_shape if compute_dq else k_shape
    n_q = q_shape[1] if compute_dq else 0
    n_k = k_shape[1] if compute_dk else 0
    if batch * seq_len * head_dim > 0 and n_q + n_k > 0:
        half = head_dim // 2
        block_d, block_hq, block_hk = _launch_config(half, n_q, n_k)
        n_tokens = batch * seq_len
        block_t = _tokens_per_program(n_tokens, cos.device)
        _rope_bwd_kernel[(triton.cdiv(n_tokens, block_t),)](
            gq, gk, cos, sin, xq, xk,
            seq_len, n_tokens, n_q, n_k, half,
            *gq.stride()[:3], *gk.stride()[:3],
            *xq.stride()[:3], *xk.stride()[:3],
            *_table_strides(cos, batch, seq_len), *_table_strides(sin, batch, seq_len),
            BLOCK_D=block_d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
            COMPUTE_DQ=compute_dq, COMPUTE_DK=compute_dk, BLOCK_T=block_t,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,  # float32 gradients with eager PyTorch's bits (see above)
        )
    return dq, dk


# --------------------------------------------------------------------------------
# Autograd function (and the same formula on the custom operator)
# --------------------------------------------------------------------------------
def _rope_save(ctx, inputs, output):
    q, k, cos, sin = inputs
    q_embed, k_embed = output
    # Only the two small tables are kept for backward (a rotation's gradient
    # needs no activations), and the layout that dq and dk should have.
    ctx.save_for_backward(cos, sin)
    ctx.q_layout = (list(q.shape), list(q_embed.stride()), q.dtype)
    ctx.k_layout = (list(k.shape), list(k_embed.stride()), k.dtype)
    # As in eager PyTorch, an output whose input needs no gradient (a frozen
    # k, say) does not require grad either.
    for embed, needed in zip((q_embed, k_embed), ctx.needs_input_grad[:2]):
        if not needed:
            ctx.mark_non_differentiable(embed)
    # An output that does not reach the loss gets None instead of a tensor
    # of zeros: nothing to read, nothing to launch for it.
    ctx.set_materialize_grads(False)


def _rope_grads(ctx, dq_embed, dk_embed):
    cos, sin = ctx.saved_tensors
    need_q, need_k = ctx.needs_input_grad[:2]
    dq_out = dq_embed if need_q else None
    dk_out = dk_embed if need_k else None
    if dq_out is None and dk_out is None:
        return None, None, None, None
    dq, dk = rope_backward(dq_out, dk_out, cos, sin, *ctx.q_layout, *ctx.k_layout)
    return (dq if dq_out is not None else None), (dk if dk_out is not None else None), None, None


class TritonRoPEFunction(torch.autograd.Function):
    """RoPE on q, k in the [B, H, T, D] layout; gradients for q and k only.

    cos and sin are treated as constants (HF computes them under no_grad): their
    gradient is never computed. ``rope()`` sends inputs whose cos or sin
    requires grad to the reference formula instead. The classic form (forward
    with ctx) costs less host time per eager call than forward + setup_context;
    the operator registers the same two pieces.
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        out = rope_forward(q, k, cos, sin)
        _rope_save(ctx, (q, k, cos, sin), out)
        return out

    @staticmethod
    @first_order_only("rope")
    def backward(ctx, dq_embed, dk_embed):
        return _rope_grads(ctx, dq_embed, dk_embed)


rope_forward.op.register_autograd(first_order_only("rope")(_rope_grads), setup_context=_rope_save)


def rope(q, k, cos, sin, unsqueeze_dim=1):
    """Fused RoPE with HF ``apply_rotary_pos_emb``'s signature, numbers and dtypes.

    q: [B, nh, T, D], k: [B, n_kv, T, D] (unsqueeze_dim=1, HF LLaMA's layout; any
    strides with a contiguous last dim, e.g. HF's transposed views), or
    [B, T, nh, D] and [B, T, n_kv, D] with unsqueeze_dim=2. cos, sin: [B, T, D]
    (B or T may be 1 to broadcast), same dtype. D must be even.
    Returns (q_embed, k_embed), laid out like q and k. Differentiable in q and k.

    cos and sin are constants for the kernels. If one of them requires grad
    (while grad mode is on), this falls back to ``rope_reference`` so that its
    gradient is still right; HF computes them under no_grad, so a model never
    takes that path.
    """
    layout = _normalize_unsqueeze_dim(unsqueeze_dim)
    rotary = cos.shape[-1] if isinstance(cos, torch.Tensor) and cos.dim() == 3 else None
    if isinstance(q, torch.Tensor) and q.dim() == 4 and rotary and rotary < q.shape[-1]:
        # Partial rotary (Phi-3 with partial_rotary_factor, ...): the tables cover
        # the first ``rotary`` dims of each head, which turn; the rest pass through,
        # as HF's function does it. The slices keep a contiguous last dim, so the
        # kernel reads them in place; the concatenation is one copy of q and k.
        q_rot, k_rot = rope(q[..., :rotary], k[..., :rotary], cos, sin, unsqueeze_dim)
        return torch.cat([q_rot, q[..., rotary:]], dim=-1), torch.cat([k_rot, k[..., rotary:]], dim=-1)
    _check_inputs(q, k, cos, sin, layout)
    if layout == 2:
        # [B, T, H, D] is [B, H, T, D] with two strides swapped: transposed views
        # in, transposed views back out, no copies.
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        # The kernels do not compute gradients for the tables: use the reference
        # formula (same numbers, eager speed) so that they are still right.
        q_embed, k_embed = rope_reference(q, k, cos, sin, unsqueeze_dim=1)
    elif torch.compiler.is_compiling():
        q_embed, k_embed = rope_forward.op(q, k, cos, sin)  # one node of the compiled graph
    else:
        q_embed, k_embed = TritonRoPEFunction.apply(q, k, cos, sin)
    if layout == 2:
        return q_embed.transpose(1, 2), k_embed.transpose(1, 2)
    return q_embed, k_embed


# HF's name and signature, so the function can replace the one in a model's
# python module (see patched_rope below).
apply_rotary_pos_emb = rope


# --------------------------------------------------------------------------------
# Model patching, scoped to a `with` block
# --------------------------------------------------------------------------------
# HF's attention layers call the *module-level* function: LlamaAttention.forward
# looks up ``apply_rotary_pos_emb`` in the globals of modeling_llama.py on every
# call. Assigning our function to that module attribute therefore switches every
# LLaMA attention layer to the fused kernel; there is no submodule to replace.
#
# Why a context manager and not a permanent patch: the attribute belongs to the
# python module, not to one model. A global assignment would silently change
# every other LLaMA model in the process as well: the unpatched baseline that a
# test or benchmark compares against in the same process, a reference model, a
# teacher. ``patched_rope(model)`` makes the swap only for the duration of the
# ``with`` block and then restores exactly what was there before, so
#
#     with patched_rope(model):
#         loss = model(ids, labels=ids).loss      # fused RoPE
#     loss.backward()                             # no patch needed here
#
# Backward needs no patch: the graph built inside the block holds our
# Function's nodes, whose backward calls rope_backward directly and never looks
# up the module attribute. Gradient checkpointing is the exception: it reruns
# the attention forward *during* backward, outside the block, where HF's
# function would produce different saved tensors (PyTorch stops with a
# CheckpointError). ``fuse_rope(model)`` below avoids the swap altogether: each
# attention layer gets its own copy of ``forward`` that finds our function.
#
# Caveats: while the block runs, *any* model whose attention lives in the same
# python module uses the fused kernel too (the scope is time, not the object),
# and the swap is not thread-safe. Nesting is fine: an inner block restores what
# the outer one installed, the outer one restores HF's original.
def _rope_attention_layers(model):
    """(attention submodule, its python module) for every layer of the text decoder whose
    python module defines the ``apply_rotary_pos_emb`` that its forward calls by name (a
    multimodal model's vision tower keeps its own 2-D rotation: swap_common.text_modules)."""
    for sub in text_modules(model):
        cls = type(sub)
        if not cls.__name__.endswith("Attention"):
            continue
        pymod = sys.modules.get(cls.__module__)
        if pymod is not None and callable(vars(pymod).get("apply_rotary_pos_emb")):
            yield sub, pymod


def rope_patch_targets(model):
    """Python modules whose ``apply_rotary_pos_emb`` feeds ``model``'s attention layers.

    Returns (modules, count): the distinct python modules
    (``sys.modules[type(m).__module__]``) of every submodule whose class name ends
    with "Attention" and whose python module defines a function
    ``apply_rotary_pos_emb``; count is the number of such attention submodules.
    """
    layers = list(_rope_attention_layers(model))
    modules = {pymod.__name__: pymod for _, pymod in layers}
    return list(modules.values()), len(layers)


@contextlib.contextmanager
def _fused_in(pymods):
    """Our function under HF's name in each python module; the originals come back on exit."""
    saved = [(pymod, vars(pymod)["apply_rotary_pos_emb"]) for pymod in pymods]
    try:
        for pymod, _ in saved:
            pymod.apply_rotary_pos_emb = apply_rotary_pos_emb
        yield
    finally:
        for pymod, original in reversed(saved):
            pymod.apply_rotary_pos_emb = original


@contextlib.contextmanager
def patched_rope(model):
    """Use the fused RoPE in ``model``'s attention layers inside a ``with`` block.

    Yields the number of attention layers affected. On exit (also on an
    exception) each python module gets back exactly the function it had on entry.
    """
    modules, count = rope_patch_targets(model)
    with _fused_in(modules):
        yield count


def fuse_rope(model):
    """Make ``model``'s attention layers use the fused RoPE every time they run.

    Each attention submodule gets, on the instance (other models are untouched),
    a copy of its class's ``forward`` whose global names are those of its python
    module except that ``apply_rotary_pos_emb`` is ours: the same code, looking
    up our function where it looks up HF's. Nothing global changes, so this
    also holds when gradient checkpointing reruns the layer during backward and
    when torch.compile traces it (the compiler reads the copy's globals; a
    module attribute swapped during the call, as patched_rope does, is not
    always seen by it). Returns the number of layers; calling it again changes
    nothing.
    """
    layers = list(_rope_attention_layers(model))
    for pymod in {pymod.__name__: pymod for _, pymod in layers}.values():
        check_same_rope(vars(pymod)["apply_rotary_pos_emb"], model, pymod.__name__)
    count = 0
    for sub, _ in layers:
        forward = _forward_with_fused_rope(type(sub))
        if forward is None:
            continue
        if "forward" in sub.__dict__:
            # Ours already (apply called again): counted, kept. Anyone else's (accelerate's
            # hooks keep the old forward and call it): left as it is, and the model's RoPE with it.
            count += our_forward(sub.__dict__["forward"]) is not None
            continue
        count += 1
        # Bound to the layer (copy.deepcopy(model) binds the copy's forward to the
        # copy); pickled as the class it is made from, and made again on loading.
        set_forward(sub, forward, made_by=(_forward_with_fused_rope, type(sub)))
    return count


class RopeMismatch(SwapMismatch):
    """A family's apply_rotary_pos_emb that computes something else than ours."""


# --------------------------------------------------------------------------------
# Checking the swap: the family's function must compute what ours does
# --------------------------------------------------------------------------------
# Every decoder family names its function apply_rotary_pos_emb, but not every one
# computes LLaMA's x * cos + rotate_half(x) * sin: Cohere rotates interleaved pairs
# (x0, x1), (x2, x3), ... instead of the two halves, others add a scale. A random
# tiny model trains almost alike either way (its attention barely depends on the
# positions), so a wrong swap would pass unnoticed. Before the swap, the family's
# function and ours run on the same random q and k with the model's own cos and
# sin tables (their width says how many dims turn), in float32; they must agree.
@torch.no_grad()
def check_same_rope(original, model, where):
    """Raise RopeMismatch unless ``original`` computes what ``rope`` does for ``model``."""
    config = text_config(model)  # a multimodal model's: its text decoder's
    try:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    except Exception as e:  # noqa: BLE001 - Gemma-4's config refuses a global head_dim: it varies per layer
        raise RopeMismatch(f"{type(model).__name__}'s config has no single head_dim ({type(e).__name__}); the RoPE "
                           f"check needs one") from None
    device = next(model.parameters()).device
    device = torch.device("cpu") if device.type == "meta" else device  # --fsdp builds large models there
    seq_len = 8
    positions = torch.arange(seq_len, device=device)[None]
    tables = [m for m in text_modules(model) if type(m).__name__.endswith("RotaryEmbedding")]
    gen = torch.Generator(device="cpu").manual_seed(0)
    cos = sin = None
    if tables and not any(b.is_meta for b in tables[0].buffers()):
        # A table that wants more (Gemma-3, DeepSeek-V4: the layer type) or fails: random angles below.
        with contextlib.suppress(TypeError, AttributeError, KeyError, IndexError, ValueError, RuntimeError):
            cos, sin = tables[0](torch.zeros(1, seq_len, head_dim, device=device), positions)
            cos, sin = cos.float(), sin.float()
    if cos is None:  # no table to ask: random angles over the whole head
        angles = torch.rand(1, seq_len, head_dim // 2, generator=gen).to(device)
        cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    q = torch.randn(1, 2, seq_len, head_dim, generator=gen).to(device)
    k = torch.randn(1, 2, seq_len, head_dim, generator=gen).to(device)
    try:
        theirs = original(q, k, cos, sin)
    except Exception as e:  # noqa: BLE001 - any failure: not a function we can stand in for
        raise RopeMismatch(f"{where}.apply_rotary_pos_emb does not take (q, k, cos, sin) as HF LLaMA's does "
                           f"({type(e).__name__})") from None
    rotary = cos.shape[-1]  # what rope() computes, written with the reference formula (no kernel launch)
    turned = rope_reference(q[..., :rotary], k[..., :rotary], cos, sin)
    ours = [torch.cat([t, x[..., rotary:]], dim=-1) for t, x in zip(turned, (q, k))]
    for a, b in zip(ours, theirs):
        if a.shape != b.shape or not torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5):
            raise RopeMismatch(f"{where}.apply_rotary_pos_emb computes another rotation than the fused RoPE "
                               f"(x * cos + rotate_half(x) * sin on the first {cos.shape[-1]} of {head_dim} dims)")


_FUSED_FORWARDS = {}  # attention class -> its forward, reading our apply_rotary_pos_emb


def _copy_function(fn, names=None, closure=None):
    """A new function with fn's code and metadata, other globals and/or closure cells."""
    new = types.FunctionType(fn.__code__, fn.__globals__ if names is None else names, fn.__name__,
                             fn.__defaults__, fn.__closure__ if closure is None else closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__  # FunctionType takes it from the globals' __name__
    return new


def _cell_holds(cell, obj):
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def _with_fused_rope(fn, depth=0):
    """A copy of ``fn`` that finds our function under HF's name, or None.

    A forward that looks the name up in its globals is copied with those globals
    (ours in place of HF's). A decorated forward (transformers wraps some in
    ``deprecate_kwarg``, with functools.wraps: ``__wrapped__``) is copied around
    such a copy of the function it wraps, when it holds that function in a closure
    cell; the decorator's own work (renaming an old keyword) still runs.
    """
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    if "apply_rotary_pos_emb" in code.co_names and "apply_rotary_pos_emb" in fn.__globals__:
        names = dict(fn.__globals__)  # the module's globals as they are now
        names["apply_rotary_pos_emb"] = apply_rotary_pos_emb
        # Without the module's __name__ the copy's globals are a scope of their own to
        # torch.compile: it reads a global of a function whose globals have a
        # __name__ as that module's attribute and guards on it there, where HF's
        # function (or, from transformers 5.25 on, the nn.Module the `kernels`
        # package wraps it in) sits, not ours: guards that fail or check the wrong
        # object. Without one, it guards on this dict's own entries.
        names.pop("__name__", None)
        return _copy_function(fn, names=names)
    inner = getattr(fn, "__wrapped__", None)
    if inner is None or depth >= 4 or not fn.__closure__ or not any(_cell_holds(c, inner) for c in fn.__closure__):
        return None
    fused_inner = _with_fused_rope(inner, depth + 1)
    if fused_inner is None:
        return None
    closure = tuple(types.CellType(fused_inner) if _cell_holds(c, inner) else c for c in fn.__closure__)
    fused = _copy_function(fn, closure=closure)
    fused.__wrapped__ = fused_inner  # what it calls, for anything that unwraps it
    return fused


def _forward_with_fused_rope(cls):
    """``cls.forward`` reading our function under HF's name (see _with_fused_rope), or
    None when neither it nor the function a decorator wraps looks the name up."""
    if cls not in _FUSED_FORWARDS:
        _FUSED_FORWARDS[cls] = _with_fused_rope(cls.forward)
    return _FUSED_FORWARDS[cls]
