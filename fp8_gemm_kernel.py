"""
Step 22, second half -- the FP8 GEMM in Triton, to compare with cuBLASLt.

fp8_kernel.py casts a linear layer's operands to float8_e4m3fn with their scales and
multiplies them with ``torch._scaled_mm`` (cuBLASLt). Here the same product is one
Triton kernel: C[M, N] = (A8 @ B8^T) * inv_a * inv_b, A8 [M, K] and B8 [N, K] fp8 with
the reduction dim K contiguous, a float32 accumulator, the inverse scales (per tensor,
or per row of A and of B) applied once after the K loop.

Triton concepts new here
------------------------
* ``tl.dot`` on float8e4nv tiles: Hopper's FP8 tensor cores (wgmma), twice the bf16 rate.
* ``max_num_imprecise_acc``: how many K elements the tensor cores may add at their own
  reduced precision before the sum goes into the float32 accumulator.
* Grouped program order: programs that run together share tiles of A and B in L2.

Measured (benchmark_fp8.py, H200; results/fp8/bench_fp8_h200.txt): 770-829 TFLOP/s at
the 8B layers' shapes against cuBLASLt's 1,159-1,291: the lesson's kernel is simple
(no warp specialization, no persistent tiles); the training step uses cuBLASLt.

Nothing runs on import. See fp8_test.py for the checks.
"""

import torch

from fp8_kernel import FP8_DTYPE
from kernel_common import IN_INTERPRETER, INTERPRET, cast_to, cdiv, check_kernel_device, fast_launch

import triton
import triton.language as tl


# Program order: consecutive program ids walk GROUP_M tiles *down* a column of C before
# moving to the next column, so the programs running together share a few tiles of A
# and a few of B, which stay in L2; in plain row order each wave of programs would read
# all of B for one row of tiles of A.
@triton.jit
def _fp8_dot(a, b, acc, FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    # a [BM, BK], b [BN, BK] fp8 -> acc + a b^T (the interpreter: in float32). Hopper's FP8
    # tensor cores accumulate with fewer bits than float32; max_num_imprecise_acc=BLOCK_K
    # adds each K-tile's product into the float32 accumulator (_scaled_mm's
    # use_fast_accum=False). H200, 8192 x 4096 x 4096: that precision cost us 30% and
    # cuBLASLt 7%; benchmark_fp8.py times both precise.
    if IN_INTERPRETER:
        return acc + tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    elif FAST_ACCUM:
        return tl.dot(a, tl.trans(b), acc)
    else:
        return tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)


@fast_launch
@triton.jit
def _fp8_gemm_kernel(
    A,  # [M, K] fp8 row-major
    B,  # [N, K] fp8 row-major
    C,  # [M, N] out dtype
    INV_A, INV_B,  # float32 [M] and [N] (rowwise) or [1] each
    M, N, K,
    ROWWISE: tl.constexpr, FAST_ACCUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)  # the last group may be shorter
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    b_ptrs = B + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k < K)[None, :]
        a = tl.load(a_ptrs, mask=(offs_m < M)[:, None] & k_ok, other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n < N)[:, None] & k_ok, other=0.0)
        acc = _fp8_dot(a, b, acc, FAST_ACCUM, BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    # The scales multiply the float32 accumulator once, after the whole K loop: they are
    # constant along K (that is what "scaled along the reduction axis" buys).
    if ROWWISE:
        inv_a = tl.load(INV_A + offs_m, mask=offs_m < M, other=0.0)
        inv_b = tl.load(INV_B + offs_n, mask=offs_n < N, other=0.0)
        out = acc * inv_a[:, None] * inv_b[None, :]
    else:
        out = acc * (tl.load(INV_A) * tl.load(INV_B))
    c_ptrs = C + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(c_ptrs, cast_to(out, C.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def triton_scaled_mm(a8, inv_a, b8, inv_b, out_dtype, fast_accum=False):
    """scaled_mm as one Triton kernel (same arguments, no bias): for the benchmark."""
    if a8.dtype != FP8_DTYPE or b8.dtype != FP8_DTYPE or a8.dim() != 2 or b8.dim() != 2 \
            or a8.shape[1] != b8.shape[1]:
        raise ValueError(f"triton_scaled_mm: a8 [M, K] and b8 [N, K] must be {FP8_DTYPE}, got {a8.dtype} "
                         f"{tuple(a8.shape)} and {b8.dtype} {tuple(b8.shape)}")
    check_kernel_device(a8, b8, inv_a, inv_b)
    a8, b8 = a8.contiguous(), b8.contiguous()
    (M, K), N = a8.shape, b8.shape[0]
    c = torch.empty(M, N, dtype=out_dtype, device=a8.device)
    # 128 x 128 x 128 fp8 tiles: 32 KB of A and B per stage, 3 stages in shared memory.
    bm, bn, bk, warps, stages = (16, 16, 32, 1, 1) if INTERPRET else (128, 128, 128, 8, 3)
    if c.numel():
        _fp8_gemm_kernel[(cdiv(M, bm) * cdiv(N, bn),)](
            a8, b8, c, inv_a.reshape(-1), inv_b.reshape(-1), M, N, K,
            ROWWISE=inv_a.dim() == 2, FAST_ACCUM=fast_accum, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
            num_warps=warps, num_stages=stages)
    return c
