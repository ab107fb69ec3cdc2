"""
What each kernel's benchmark runs: one ``Spec`` per kernel (RMSNorm, cross-entropy, SwiGLU,
RoPE, linear + cross-entropy, attention in packed rows), all of them in ``KERNELS``.

A spec says what to run and how to count it: its shapes (LLaMA-3.1-8B's, bf16; tiny on CPU),
how to make the inputs, the providers (ours first; PyTorch eager in the HF formulation, the
native op if any, ``torch.compile``; the peers of benchmark_peers.py), the float64 truth, and
the byte or FLOP formula behind the GB/s and TFLOP/s columns, with the notes printed under
the table. A file of its own: benchmark_kernels.py measures every provider of a spec the same
way and prints the tables, so a new kernel's benchmark is a new spec here and nothing there.
tools/tune_kernels.py sweeps its tiles on the attention rows of this file.

Nothing runs on import.
"""

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The kernel modules come first: without a GPU, kernel_common (which they import first)
# switches on Triton's interpreter, and that must precede `import triton`.
from attention_kernel import (attention_reference, document_ends, document_starts, one_document_rows,
                              packed_attention, visible_keys)
from kernel_ft.benchmark_peers import (PlaybookCrossEntropy, compiled, cut_cross_entropy, flex_document_attention,
                                      liger_cross_entropy, liger_flce, liger_rmsnorm, liger_rope, liger_swiglu,
                                      playbook_rmsnorm)
from cross_entropy_kernel import cross_entropy, cross_entropy_reference
from linear_cross_entropy_kernel import fused_linear_cross_entropy, linear_cross_entropy_reference
from rmsnorm_kernel import rmsnorm, rmsnorm_reference
from rope_kernel import rope, rope_reference
from swiglu_kernel import swiglu, swiglu_reference
from kernel_ft import cuda_graphs

import triton.testing  # isort: skip - after the kernel modules (see above)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPE = torch.bfloat16
BYTES = torch.finfo(DTYPE).bits // 8  # 2: every tensor the formulas count is bf16
EPS = 1e-6
NA_CPU = "n/a (CPU)"
NA_MASK = "n/a (mask)"  # a provider that runs without a mask only (one document per row)


def loss64(logits_of_rows, targets, rows=1024):
    """Mean cross-entropy in float64, ``rows`` rows at a time (all of [N, V] in float64 would be
    17 GB at N = 16,384). No benchmark target is ignored: the mean is over N."""
    n, total = targets.shape[0], 0.0
    for lo in range(0, n, rows):
        hi = min(lo + rows, n)
        total += F.cross_entropy(logits_of_rows(lo, hi).double(), targets[lo:hi], reduction="sum").item()
    return total / n


def randn(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


class NotApplicable(Exception):
    """A provider that does not apply to this row (its message is the row's status)."""


# --- One spec per kernel: what to run, on what, and how to count it -------------------
@dataclass
class Spec:
    name: str  # --kernel NAME and the key in the JSON
    title: str  # the table heading is "<title> benchmark -- <describe(first shape)>"
    describe: Callable
    shapes: dict  # {"cpu": [...], "quick": [...], "full": [...]}; tiny on CPU (interpreter)
    make_inputs: Callable  # shape -> {"args": op's arguments, "wrt": what to differentiate, "upstream": ...}
    providers: dict  # name -> make_op() -> op(*args), called once per shape; ours first
    truth: Callable  # *args (detached) -> the float64 forward output (a float for a loss)
    error_label: str
    formula: list  # the byte (or FLOP) formula written out, printed under the table
    notes: list  # below it: what peak MB leaves out, what |err| is, caveats
    bytes: Callable | None = None  # shape -> {"fwd": bytes, "fwdbwd": bytes} of the formula
    flops: Callable | None = None  # shape -> {"fwd": FLOPs, "fwdbwd": FLOPs} (matmul-bound)
    not_counted: Callable = lambda shape: 0  # bytes subtracted from peak MB


# --- RMSNorm: y = w * x / rms(x) over the hidden dimension ----------------------------
def rmsnorm_inputs(s):
    x = randn(s["tokens"], s["hidden"]).requires_grad_()
    # A random, non-unit weight: with ones, a kernel could skip the multiply unnoticed.
    w = (1.0 + 0.1 * torch.randn(s["hidden"], device=DEVICE)).to(DTYPE).requires_grad_()
    return {"args": (x, w), "wrt": (x, w), "upstream": (randn(s["tokens"], s["hidden"]),)}


def hf_rmsnorm(x, w):
    return rmsnorm_reference(x, w, EPS)


RMSNORM = Spec(
    name="rmsnorm", title="RMSNorm", describe=lambda s: f"hidden {s['hidden']:,}, bfloat16, eps {EPS:g}",
    shapes={"cpu": [{"tokens": 64, "hidden": 256}],
            "quick": [{"tokens": n, "hidden": 4096} for n in (4096, 16384)],
            "full": [{"tokens": n, "hidden": 4096} for n in (4096, 16384, 65536)]},
    make_inputs=rmsnorm_inputs,
    providers={
        "ours (Triton)": lambda: lambda x, w: rmsnorm(x, w, EPS),
        "PyTorch eager (HF)": lambda: hf_rmsnorm,
        "F.rms_norm (native)": lambda: lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS),
        "torch.compile (HF)": lambda: compiled(hf_rmsnorm),
        "Liger-Kernel": lambda: liger_rmsnorm(EPS),
        "playbook design": lambda: playbook_rmsnorm(EPS),
    },
    truth=lambda x, w: rmsnorm_reference(x, w, EPS, compute_dtype=torch.float64),
    error_label="max |err|",
    bytes=lambda s: {"fwd": (2 * s["tokens"] + 1) * s["hidden"] * BYTES,
                     "fwdbwd": (5 * s["tokens"] + 3) * s["hidden"] * BYTES},
    formula=["Bytes (N tokens, H hidden, 2 B per bf16 element; each tensor read once, written once):",
             "  fwd     = read x + write y + read w                          = 2*N*H*2 + H*2",
             "  fwd+bwd = fwd + read x + read dy + write dx + read w + write dw",
             "          = 5 passes over [N, H] + 3 weight terms              = 5*N*H*2 + 3*H*2"],
    notes=["  Not counted: x, w and dy (the caller's). Counted: y, dx, dw, saved statistics and every",
           "  temporary (float32 copies, partial dw sums); floor y + dx = 2*N*H*2 bytes. Liger writes",
           "  dx into the dy buffer (in_place=True, its module default).",
           "max |err|: forward output vs the HF formula evaluated in float64, max over all elements."],
)


# --- Cross-entropy: mean loss over N rows of V logits ---------------------------------
def ce_inputs(s):
    logits = randn(s["tokens"], s["vocab"]).requires_grad_()
    targets = torch.randint(0, s["vocab"], (s["tokens"],), device=DEVICE)
    # The loss is a scalar and training calls loss.backward(): upstream 1.0.
    return {"args": (logits, targets), "wrt": (logits,), "upstream": (torch.ones((), device=DEVICE),)}


CROSS_ENTROPY = Spec(
    name="cross_entropy", title="Cross-entropy",
    describe=lambda s: f"vocabulary {s['vocab']:,}{' (LLaMA 3)' * (s['vocab'] == 128256)}, bfloat16, mean",
    shapes={"cpu": [{"tokens": 32, "vocab": 1000}],
            "quick": [{"tokens": n, "vocab": 128256} for n in (4096, 8192)],
            "full": [{"tokens": n, "vocab": 128256} for n in (1024, 4096, 8192, 16384)]},
    make_inputs=ce_inputs,
    providers={
        "ours (Triton)": lambda: cross_entropy,
        "ours (in-place)": lambda: lambda logits, t: cross_entropy(logits, t, inplace_backward=True),
        "PyTorch eager (HF fp32)": lambda: cross_entropy_reference,  # F.cross_entropy(logits.float())
        "F.cross_entropy (bf16)": lambda: F.cross_entropy,  # on the bf16 logits, no upcast
        "torch.compile (HF)": lambda: compiled(cross_entropy_reference),
        "Liger-Kernel": liger_cross_entropy,
        "playbook design": lambda: PlaybookCrossEntropy.apply,
    },
    truth=lambda logits, t: loss64(lambda lo, hi: logits[lo:hi], t),
    error_label="loss |err|",
    # Targets (N * 8 B) and the scalar loss are left out: < 0.01% of the total.
    bytes=lambda s: {"fwd": s["tokens"] * s["vocab"] * BYTES, "fwdbwd": 2 * s["tokens"] * s["vocab"] * BYTES},
    formula=["Bytes (N tokens, V vocabulary, 2 B per bf16 element; targets and the loss are left out):",
             "  fwd     = read logits                          = N*V*2",
             "  fwd+bwd = read logits + write their gradient   = 2*N*V*2",
             "  An implementation that reads the logits twice moves 3*N*V*2 bytes from memory and so",
             "  stays below 2/3 of the copy bandwidth on this metric, unless the second read hits in L2."],
    notes=["  Not counted: the logits, targets and upstream gradient (the caller's). The logits gradient",
           "  [N, V] (the fwd MB above) IS counted when a provider allocates it (all but ours (in-place)",
           "  and Liger, which write it into the logits buffer): subtract it to see the temporaries.",
           "fwd (no_grad) says little about training: there ours and Liger write the gradient in the forward",
           "  launch and backward only rescales it by the upstream gradient (one more read + write of [N, V],",
           "  skipped on the device when it is exactly 1.0, as after loss.backward() and in this benchmark).",
           "loss |err|: |loss - F.cross_entropy(logits.double(), targets)|, on the same logits."],
)


# --- SwiGLU: y = silu(gate) * up, the LLaMA MLP's activation --------------------------
def swiglu_inputs(s):
    gate = randn(s["tokens"], s["intermediate"]).requires_grad_()
    up = randn(s["tokens"], s["intermediate"]).requires_grad_()
    return {"args": (gate, up), "wrt": (gate, up), "upstream": (randn(s["tokens"], s["intermediate"]),)}


SWIGLU = Spec(
    name="swiglu", title="SwiGLU",
    describe=lambda s: f"silu(gate) * up, intermediate size {s['intermediate']:,}, bfloat16",
    shapes={"cpu": [{"tokens": 64, "intermediate": 300}],
            "quick": [{"tokens": 16384, "intermediate": 14336}],
            "full": [{"tokens": n, "intermediate": 14336} for n in (4096, 16384)]},
    make_inputs=swiglu_inputs,
    providers={
        "ours (Triton)": lambda: swiglu,
        "PyTorch eager (HF)": lambda: swiglu_reference,  # F.silu(gate) * up, as HF's LlamaMLP
        "torch.compile (HF)": lambda: compiled(swiglu_reference),
        "Liger-Kernel": liger_swiglu,
    },
    truth=lambda gate, up: swiglu_reference(gate.double(), up.double()),
    error_label="max |err|",
    bytes=lambda s: {p: k * s["tokens"] * s["intermediate"] * BYTES for p, k in (("fwd", 3), ("fwdbwd", 8))},
    formula=["Bytes (N tokens, I intermediate, 2 B per bf16 element):",
             "  fwd     = read gate + read up + write y                                 = 3*N*I*2",
             "  fwd+bwd = fwd + read dy + read gate + read up + write dgate + write dup  = 8*N*I*2"],
    notes=["  Not counted: gate, up and dy (the caller's). Floor: y + dgate + dup = 3*N*I*2.",
           "max |err|: forward output vs silu(gate) * up evaluated in float64, max over all elements."],
)


# --- RoPE: rotary position embedding of the queries and keys --------------------------
def rope_inputs(s):
    b, t, d = s["batch"], s["seq"], s["head_dim"]
    # As HF's attention makes them: [B, T, H*D] projections viewed as [B, H, T, D].
    q = randn(b, t, s["heads"], d).transpose(1, 2).requires_grad_()
    k = randn(b, t, s["kv_heads"], d).transpose(1, 2).requires_grad_()
    inv_freq = 500000.0 ** (-torch.arange(0, d, 2, device=DEVICE) / d)  # LLaMA 3's base
    angles = torch.arange(t, device=DEVICE).float()[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1).expand(b, t, d)
    cos, sin = emb.cos().to(DTYPE).contiguous(), emb.sin().to(DTYPE).contiguous()
    return {"args": (q, k, cos, sin), "wrt": (q, k), "upstream": (torch.randn_like(q), torch.randn_like(k))}


def rope_bytes(s):
    qk = s["tokens"] * (s["heads"] + s["kv_heads"]) * s["head_dim"] * BYTES
    table = 2 * s["tokens"] * s["head_dim"] * BYTES  # cos and sin
    return {"fwd": 2 * qk + table, "fwdbwd": 4 * qk + 2 * table}


ATTN_HEADS = {"heads": 32, "kv_heads": 8, "head_dim": 128}  # LLaMA-3.1-8B
ATTN = {"seq": 2048, **ATTN_HEADS}
ROPE = Spec(
    name="rope", title="RoPE",
    describe=lambda s: f"{s['heads']} query + {s['kv_heads']} key heads of {s['head_dim']}, seq {s['seq']:,}, bfloat16",
    shapes={"cpu": [{"tokens": 32, "batch": 2, "seq": 16, "heads": 4, "kv_heads": 2, "head_dim": 16}],
            "quick": [{"tokens": 2 * 2048, "batch": 2, **ATTN}],
            "full": [{"tokens": b * 2048, "batch": b, **ATTN} for b in (2, 8)]},
    make_inputs=rope_inputs,
    providers={
        "ours (Triton)": lambda: rope,
        "PyTorch eager (HF)": lambda: rope_reference,  # HF's apply_rotary_pos_emb
        "torch.compile (HF)": lambda: compiled(rope_reference),
        "Liger-Kernel": liger_rope,
    },
    truth=lambda q, k, cos, sin: rope_reference(q.double(), k.double(), cos.double(), sin.double()),
    error_label="max |err|",
    bytes=rope_bytes,
    formula=["Bytes (tokens N, Hq query + Hk key heads of D, 2 B per bf16 element):",
             "  fwd     = read q, k + write q', k' + read cos, sin           = 2*N*(Hq+Hk)*D*2 + 2*N*D*2",
             "  fwd+bwd = fwd + read dq', dk' + write dq, dk + read cos, sin = 4*N*(Hq+Hk)*D*2 + 4*N*D*2",
             "q and k are the transposed [B, H, T, D] views HF's attention builds; cos, sin are [B, T, D]."],
    notes=["  Not counted: q, k, cos, sin and the upstream gradients (the caller's).",
           "Liger-Kernel rotates q and k in place (its inputs are overwritten); the others return new tensors.",
           "max |err|: q' and k' vs HF's formula evaluated in float64 (on the inputs before any provider ran)."],
)


# --- Linear + cross-entropy: the LM head and the loss, logits never materialized ------
def flce_inputs(s):
    hidden = randn(s["tokens"], s["hidden"]).requires_grad_()
    # Logits of a few units, like a trained LM head's.
    weight = (torch.randn(s["vocab"], s["hidden"], device=DEVICE) * 2.0 / s["hidden"] ** 0.5).to(DTYPE).requires_grad_()
    targets = torch.randint(0, s["vocab"], (s["tokens"],), device=DEVICE)
    return {"args": (hidden, weight, targets), "wrt": (hidden, weight), "upstream": (torch.ones((), device=DEVICE),)}


def flce_truth(hidden, weight, targets):
    weight64 = weight.double()
    return loss64(lambda lo, hi: hidden[lo:hi].double() @ weight64.t(), targets)


FLCE = Spec(
    name="flce", title="Linear + cross-entropy",
    describe=lambda s: f"hidden {s['hidden']:,} -> vocabulary {s['vocab']:,}, bfloat16, mean",
    shapes={"cpu": [{"tokens": 32, "hidden": 64, "vocab": 1000}],
            "quick": [{"tokens": 4096, "hidden": 4096, "vocab": 128256}],
            "full": [{"tokens": n, "hidden": 4096, "vocab": 128256} for n in (4096, 16384)]},
    make_inputs=flce_inputs,
    providers={
        "ours (Triton + cuBLAS)": lambda: fused_linear_cross_entropy,
        "PyTorch eager (HF)": lambda: linear_cross_entropy_reference,  # lm_head, then HF's loss
        "torch.compile (HF)": lambda: compiled(linear_cross_entropy_reference),
        "Liger-Kernel FLCE": liger_flce,
        "Apple cut-cross-entropy": cut_cross_entropy,  # (hidden, weight, targets), its defaults
    },
    truth=flce_truth,
    error_label="loss |err|",
    # One [N, H] x [H, V] matmul forward; two of the same size backward (d hidden, d weight).
    flops=lambda s: {p: k * s["tokens"] * s["hidden"] * s["vocab"] for p, k in (("fwd", 2), ("fwdbwd", 6))},
    # d hidden [N, H] and d weight [V, H] are returned: training holds them anyway (.grad).
    not_counted=lambda s: (s["tokens"] + s["vocab"]) * s["hidden"] * BYTES,
    formula=["TFLOP/s = matmul FLOPs / latency: fwd = 2*N*H*V (the LM head), fwd+bwd = 3 x that (plus d hidden",
             "  and d weight). Providers that recompute the logits in backward do more work than counted."],
    notes=["  Not counted: hidden, weight, targets (the caller's) and the two returned gradients (d hidden",
           "  [N, H] + d weight [V, H], which training holds as .grad anyway). What remains is logits, their",
           "  gradient, copies and chunk buffers; the bf16 logits alone would be N*V*2 bytes.",
           "Apple cut-cross-entropy filters small gradient entries by default (filter_eps='auto'), an",
           "  approximation; the others compute the exact gradient.",
           "loss |err|: |loss - the same loss with hidden @ weight.T and the softmax in float64|."],
)

# --- Attention inside the documents of packed rows -------------------------------------
def document_lengths(s):
    """The documents of one row: one causal document, or lengths drawn uniformly from
    s["docs"] = (shortest, longest) with a fixed seed until the row is full."""
    if s["docs"] == "one":
        return [s["seq"]]
    gen, lengths = torch.Generator().manual_seed(0), []
    while sum(lengths) < s["seq"]:
        lengths.append(int(torch.randint(s["docs"][0], s["docs"][1] + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - s["seq"]
    return lengths


def row_document_starts(s):
    """[batch, seq] int32: where each token's document starts, every row holding document_lengths(s);
    rows of one document as the decoder hands them to the kernel (one_document_rows)."""
    if s["docs"] == "one":
        return one_document_rows(s["batch"], s["seq"], DEVICE)
    positions = torch.cat([torch.arange(n) for n in document_lengths(s)]).expand(s["batch"], s["seq"])
    return document_starts(positions.to(DEVICE))


def attention_inputs(s):
    b, t, d = s["batch"], s["seq"], s["head_dim"]
    q = randn(b, t, s["heads"], d).transpose(1, 2).requires_grad_()  # HF's [B, H, T, D] views
    k = randn(b, t, s["kv_heads"], d).transpose(1, 2).requires_grad_()
    v = randn(b, t, s["kv_heads"], d).transpose(1, 2).requires_grad_()
    return {"args": (q, k, v, row_document_starts(s)), "wrt": (q, k, v),
            "upstream": (randn(b, t, s["heads"], d),)}


def visible_pairs(s):
    """Query-key pairs inside the documents of all rows (the causal triangle of each)."""
    return s["batch"] * sum(n * (n + 1) // 2 for n in document_lengths(s))


def sdpa_documents(backend=None):
    """PyTorch SDPA: is_causal for one document per row, else the dense [B, 1, T, T] block
    mask (its memory-efficient kernel), built once per batch. ``backend``: that one
    backend only (torch.nn.attention.SDPBackend), for one document per row: without it,
    PyTorch chooses, and on Hopper it prefers cuDNN's kernel to flash."""
    masks = {}  # id(doc_start) -> the mask, or None for one document per row (decided once, no sync after)

    def op(q, k, v, doc_start):
        if id(doc_start) not in masks:
            one = bool((doc_start == 0).all())
            if backend is not None and not (ON_GPU and one):
                raise NotApplicable(NA_CPU if not ON_GPU else NA_MASK)
            masks[id(doc_start)] = None if one else visible_keys(doc_start)[:, None]
        mask = masks[id(doc_start)]
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return out.transpose(1, 2)
    return op


def attention_truth(q, k, v, doc_start):
    """Per query head in float64 (the whole [B, H, T, T] would not fit), as [B, T, Hq, D]."""
    group, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    heads = [attention_reference(q[:, h:h + 1].double(), k[:, h // group:h // group + 1].double(),
                                 v[:, h // group:h // group + 1].double(), doc_start, scale)
             for h in range(q.shape[1])]
    return torch.cat(heads, dim=1).transpose(1, 2)


# SDPA held to one backend, for rows of one document (a mask rules both out): flash
# (FlashAttention-2's kernels) and cuDNN's, which PyTorch's own choice picks on Hopper.
SDPA_PINNED = {"PyTorch SDPA, flash only": SDPBackend.FLASH_ATTENTION,
               "PyTorch SDPA, cuDNN only": SDPBackend.CUDNN_ATTENTION}


def ours_document_attention():
    """op(q, k, v, doc_start) -> [B, T, Hq, D]: packed_attention with the document ends its
    backward reads made on the first call for that doc_start and reused, as the decoder makes
    them once for all its layers (attention_routing.DOCUMENTS) and as FlexAttention's block
    mask is kept below."""
    ends = {}

    def op(q, k, v, doc_start):
        if id(doc_start) not in ends:
            ends[id(doc_start)] = document_ends(doc_start.contiguous())
        return packed_attention(q, k, v, doc_start, doc_end=ends[id(doc_start)])
    return op


ATTENTION = Spec(
    name="attention", title="Attention in packed rows",
    describe=lambda s: f"{s['heads']} query + {s['kv_heads']} key/value heads of {s['head_dim']}, bfloat16",
    shapes={"cpu": [{"tokens": 48, "batch": 1, "seq": 48, "heads": 4, "kv_heads": 2, "head_dim": 16, "docs": d}
                    for d in ("one", [3, 20])],
            "quick": [{"tokens": 4096, "batch": 1, "seq": 4096, **ATTN_HEADS, "docs": d} for d in ("one", [40, 200])],
            "full": [{"tokens": 8192, "batch": 1, "seq": 8192, **ATTN_HEADS, "docs": "one"}]
            + [{"tokens": 16384, "batch": 1, "seq": 16384, **ATTN_HEADS, "docs": d} for d in ([40, 200], [512, 4096])]},
    make_inputs=attention_inputs,
    providers={
        "ours (Triton)": ours_document_attention,
        "PyTorch SDPA": sdpa_documents,
        **{name: (lambda b=backend: sdpa_documents(b)) for name, backend in SDPA_PINNED.items()},
        "FlexAttention (compiled)": flex_document_attention,
    },
    truth=attention_truth,
    error_label="max |err|",
    flops=lambda s: {p: k * s["heads"] * s["head_dim"] * visible_pairs(s) for p, k in (("fwd", 4), ("fwdbwd", 12))},
    formula=["TFLOP/s counts the visible query-key pairs only (P = sum over documents of n(n+1)/2, heads Hq of D):",
             "  fwd = 4*Hq*D*P (q k^T and p v), fwd+bwd = 3 x that. Rows: one causal document, or documents",
             "  of random lengths (seeded) filling the row; a row is labelled by its tokens and documents."],
    notes=["  Not counted: q, k, v, the document starts and the upstream gradient; our document ends, SDPA's",
           "  dense mask and FlexAttention's block mask are built on the first call and kept (not in the peak).",
           "max |err|: the output vs the same attention per document in float64."],
)

KERNELS = {spec.name: spec for spec in (RMSNORM, CROSS_ENTROPY, SWIGLU, ROPE, FLCE, ATTENTION)}


# --------------------------------------------------------------------------------
# How one call is timed (benchmark_kernels.py, benchmark_fp8.py, tools/tune_kernels.py)
# --------------------------------------------------------------------------------
def free_memory():
    """Drop unreachable tensors and cached blocks, so the next provider starts clean."""
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()


def bench(fn, bench_ms, graph=False):
    """Median latency in ms of ``fn``, or with ``graph`` of ``fn`` captured in a CUDA graph and
    replayed. None on CPU: the interpreter's speed says nothing."""
    if not ON_GPU:
        return None
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=bench_ms[1], return_mode="median")
    return triton.testing.do_bench(fn, warmup=bench_ms[0], rep=bench_ms[1], return_mode="median")


def copy_bandwidth(bench_ms):
    """Device copy bandwidth in GB/s: a 1 GiB device-to-device copy, bytes read + written."""
    n = 2**28  # float32 elements = 1 GiB, far larger than any L2 cache
    src = torch.empty(n, dtype=torch.float32, device=DEVICE).uniform_(-1.0, 1.0)
    dst = torch.empty_like(src)
    return 2 * n * 4 / (bench(lambda: dst.copy_(src), bench_ms) * 1e-3) / 1e9


def repair_capture_state():
    """After a failed capture: the CUDA generator out of capture mode, checked with one random
    op. Returns None, or why the repair failed."""
    try:
        cuda_graphs.recover_from_failed_capture(torch.cuda.current_stream())
        torch.empty(8, device=DEVICE).uniform_()  # ordinary random work runs again
        return None
    except Exception as exc:  # noqa: BLE001 - reported, and captures stop
        return f"{type(exc).__name__}: {exc}".strip()
