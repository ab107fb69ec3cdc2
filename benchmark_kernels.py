"""
Steps 7 and 10 -- Benchmark the fused kernels against every peer.

What: a table per kernel (RMSNorm, cross-entropy, SwiGLU, RoPE, linear + cross-entropy; one ``Spec``
each, in ``KERNELS``), rows per shape (LLaMA-3.1-8B's, bf16) and provider: ours; PyTorch eager in the
HF formulation (each kernel module's ``*_reference``), the native op if any, ``torch.compile``; the
peers of benchmark_peers.py (Liger-Kernel, cut-cross-entropy, the playbook's design).

How: ``fwd`` is the forward under ``torch.no_grad()``; ``fwd+bwd`` adds ``torch.autograd.grad`` of an
upstream gradient made beforehand (1.0 for a loss): what training pays; ``graph`` replays that from a
CUDA graph: GPU time without the host's launch cost. Latency: median of ``triton.testing.do_bench``
(warm-up excluded, L2 flushed). Inputs: random, made untimed, the same for every provider. The notes
under a table give the formula behind GB/s, what peak MB counts, what |err| compares with; OOM / ERR:
that provider failed, the run goes on. No GPU: Triton's interpreter, tiny shapes, |err| only, no time.

Usage: python benchmark_kernels.py [--kernel rmsnorm cross_entropy swiglu rope flce | all] [--quick]
    [--json bench.json] [--plot bench.png]; tools/plot_benchmark.py redraws a figure from the JSON.
"""

import argparse
import contextlib
import gc
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The kernel modules (and benchmark_peers) come before triton: without a GPU, kernel_common (which
# they import first) switches on Triton's interpreter, and that must precede `import triton`.
from attention_kernel import attention_reference, document_starts, packed_attention, visible_keys
from benchmark_peers import (NOT_INSTALLED, PlaybookCrossEntropy, cut_cross_entropy, flex_document_attention,
                             liger_cross_entropy, liger_flce,
                             liger_rmsnorm, liger_rope, liger_swiglu, playbook_rmsnorm, unavailable, version)
from cross_entropy_kernel import cross_entropy, cross_entropy_reference
from linear_cross_entropy_kernel import fused_linear_cross_entropy, linear_cross_entropy_reference
import flags
from flags import PNG_METADATA, check_output_path, environment_info, write_json_atomic
from rmsnorm_kernel import rmsnorm, rmsnorm_reference
from rope_kernel import rope, rope_reference
from swiglu_kernel import swiglu, swiglu_reference

import triton  # isort: skip - after the kernel modules (see above)
import triton.testing  # isort: skip

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPE = torch.bfloat16
BYTES = torch.finfo(DTYPE).bits // 8  # 2: every tensor the formulas count is bf16
EPS = 1e-6
NA_CPU = "n/a (CPU)"
NA_MASK = "n/a (mask)"  # a provider that runs without a mask only (one document per row)
BENCH_MS = {"full": (25, 100), "quick": (10, 40)}  # do_bench (warm-up, repetitions) in ms
# "graph" replays the fwd+bwd from a CUDA graph: every kernel launched from the GPU's side, with no
# Python, dispatcher or launch overhead. Eager minus graph is what the host costs per call, the part
# a compiled, graph-replayed training step does not pay.
PASSES = ("fwd", "fwdbwd", "graph")
WORK = {"fwd": "fwd", "fwdbwd": "fwdbwd", "graph": "fwdbwd"}  # which entry of bytes/flops a pass moves


def compiled(fn):
    """torch.compile of ``fn``, built afresh for every shape (dynamic=False: one static graph per
    shape, and the compile time printed under the table is that shape's). On CPU, backend
    "aot_eager" (traced and differentiated, no C++ toolchain needed)."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, backend="inductor" if ON_GPU else "aot_eager")


def loss64(logits_of_rows, targets, rows=1024):
    """Mean cross-entropy in float64, ``rows`` rows at a time (all of [N, V] in float64 would be
    17 GB at N = 16,384). No benchmark target is ignored: the mean is over N."""
    n, total = targets.shape[0], 0.0
    for lo in range(0, n, rows):
        hi = min(lo + rows, n)
        total += F.cross_entropy(logits_of_rows(lo, hi).double(), targets[lo:hi], reduction="sum").item()
    return total / n


def error(out, truth):
    """Loss: |loss - truth|. Tensors: max |out - truth| over all elements (and outputs)."""
    if isinstance(truth, float):
        return abs(out.double().item() - truth)
    outs, truths = (out, truth) if isinstance(out, tuple) else ((out,), (truth,))
    # out - truth promotes to float64 without a separate float64 copy of out.
    return max((o - t).abs_().max().item() for o, t in zip(outs, truths))


def randn(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


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


def attention_inputs(s):
    b, t, d = s["batch"], s["seq"], s["head_dim"]
    q = randn(b, t, s["heads"], d).transpose(1, 2).requires_grad_()  # HF's [B, H, T, D] views
    k = randn(b, t, s["kv_heads"], d).transpose(1, 2).requires_grad_()
    v = randn(b, t, s["kv_heads"], d).transpose(1, 2).requires_grad_()
    positions = torch.cat([torch.arange(n) for n in document_lengths(s)]).expand(b, t).to(DEVICE)
    return {"args": (q, k, v, document_starts(positions)), "wrt": (q, k, v),
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
        "ours (Triton)": lambda: lambda q, k, v, doc_start: packed_attention(q, k, v, doc_start),
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
    notes=["  Not counted: q, k, v, the document starts and the upstream gradient; SDPA's dense mask and",
           "  FlexAttention's block mask are built on the first call and kept (not in the peak).",
           "max |err|: the output vs the same attention per document in float64."],
)

KERNELS = {spec.name: spec for spec in (RMSNORM, CROSS_ENTROPY, SWIGLU, ROPE, FLCE, ATTENTION)}

# --- Measuring: one provider at one shape, one JSON record ----------------------------
def free_memory():
    """Drop unreachable tensors and cached blocks, so the next provider starts clean."""
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()


class NotApplicable(Exception):
    """A provider that does not apply to this row (its message is the row's status)."""


def guarded(stage, messages):
    """("ok", stage()), ("n/a ...", None) for a provider that does not apply, or
    ("OOM" / "ERR", None): a failing peer never stops the run."""
    try:
        return "ok", stage()
    except NotApplicable as exc:
        return str(exc), None
    except Exception as exc:  # noqa: BLE001 - OOM or anything else: a row, not a crash
        oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
        if not oom:
            messages.append(f"{type(exc).__name__}: {exc}".strip())
    free_memory()  # here, once the traceback (and the tensors its frames hold) is gone
    return ("OOM" if oom else "ERR"), None


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


def make_calls(spec, provider, shape, seed):
    """(fwd, fwdbwd): one provider's forward and training calls on fresh inputs of one shape."""
    torch.manual_seed(seed)  # the same values as the truth's and every other provider's
    inputs, op = spec.make_inputs(shape), spec.providers[provider]()
    args, wrt = inputs["args"], inputs["wrt"]
    # Forward-only calls get tensors that do not require grad: no provider prepares a gradient.
    fwd_args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    upstream = []  # cast to each output's dtype once, on the first fwd+bwd, outside any timing

    def fwd():
        with torch.no_grad():
            return op(*fwd_args)

    def fwdbwd():
        out = op(*args)
        outs = out if isinstance(out, tuple) else (out,)  # RoPE returns q' and k'
        if not upstream:
            upstream.extend(u.to(o.dtype) for u, o in zip(inputs["upstream"], outs))
        # autograd.grad returns the gradients instead of accumulating into .grad:
        # repeated calls neither pile up nor need .grad cleared.
        return torch.autograd.grad(outs, wrt, upstream)

    return fwd, fwdbwd


# A capture that fails (a peer that synchronizes with the host inside its call: Liger-Kernel's
# cross-entropy does) leaves PyTorch's CUDA random-number generator in the middle of a capture:
# every later random op in the process, ordinary work included, raises "Offset increment outside
# graph capture encountered unexpectedly". One clean capture of a random op closes that state
# again (repair_capture_state). So the CUDA-graph timings run after every eager timing of a
# kernel, ours first; a provider whose capture failed is not captured again (its other shapes
# say "skipped"); and if the repair itself fails, no capture is attempted for the rest of the run.
CAPTURE = {"failed": {}, "broken": None}  # failed: provider -> where; broken: why captures stopped


def repair_capture_state():
    """After a failed capture: one clean capture of a random op resets the CUDA generator's
    capture bookkeeping. Returns None, or why the repair failed."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.empty(8, device=DEVICE).uniform_()
        torch.cuda.synchronize()
        torch.empty(8, device=DEVICE).uniform_()  # ordinary random work runs again
        return None
    except Exception as exc:  # noqa: BLE001 - reported, and captures stop
        return f"{type(exc).__name__}: {exc}".strip()


def measure_graph(spec, provider, shape, seed, rec, bench_ms):
    """Fill rec's graph cells: fwd+bwd captured in a CUDA graph and replayed."""
    if not ON_GPU or rec["fwdbwd_status"] != "ok":
        rec["graph_status"] = NA_CPU if not ON_GPU else rec["fwdbwd_status"]
        return
    if CAPTURE["broken"] or provider in CAPTURE["failed"]:
        rec["graph_status"] = "skipped"
        return

    def stage():
        _, fwdbwd = make_calls(spec, provider, shape, seed)
        fwdbwd()  # first call outside the capture: compilation, autotuning, lazy allocations
        torch.cuda.synchronize()
        return bench(fwdbwd, bench_ms, graph=True)

    rec["graph_status"], rec["graph_ms"] = guarded(stage, rec["messages"])
    if rec["graph_status"] == "ERR":
        CAPTURE["failed"][provider] = f"{rec['label']} tokens"
        problem = repair_capture_state()
        if problem:
            CAPTURE["broken"] = f"after {provider}'s failed capture, CUDA stayed unusable ({problem})"
            rec["messages"].append(CAPTURE["broken"])


def shape_label(shape):
    """A table row's shape: the token count, and for attention how many documents share it."""
    if "docs" not in shape:
        return f"{shape['tokens']:,}"
    count = len(document_lengths(shape))
    return f"{shape['tokens']:,} in {count} doc{'s' if count > 1 else ''}"


def measure(spec, provider, shape, seed, truth, bench_ms):
    """Every number of one provider at one shape, as one JSON record. Never raises."""
    statuses = ("fwd_status", "fwdbwd_status", "graph_status", "memory_status")  # "ok", OOM, ERR, n/a (CPU), ...
    rec = {"provider": provider, "shape": dict(shape), "label": shape_label(shape),
           "bytes": spec.bytes and spec.bytes(shape), "flops": spec.flops and spec.flops(shape),
           **dict.fromkeys(statuses), "fwd_ms": None, "fwdbwd_ms": None, "graph_ms": None, "peak_extra_MB": None,
           "error": None, "first_fwd_s": None, "first_fwdbwd_s": None, "messages": []}
    for p in PASSES:  # filled in by derive()
        rec.update({f"{p}_GBps": None, f"{p}_pct_copy": None, f"{p}_TFLOPs": None, f"speedup_{p}": None})

    def give_up(status):  # every cell not yet filled says why
        rec.update({k: rec[k] or status for k in statuses})
        return rec

    if unavailable(provider):
        return give_up(unavailable(provider))

    status, built = guarded(lambda: make_calls(spec, provider, shape, seed), rec["messages"])
    if status != "ok":
        return give_up(status)
    fwd, fwdbwd = built

    def first_call(fn, key):
        """torch.compile compiles (and Triton JITs) here: timed once, kept out of do_bench."""
        t0 = time.perf_counter()
        out = fn()
        if ON_GPU:
            torch.cuda.synchronize()  # the GPU work is part of the first call
        rec[key] = time.perf_counter() - t0
        return out

    def fwd_stage():
        out = first_call(fwd, "first_fwd_s")
        rec["error"] = None if truth is None else error(out, truth)
        del out
        return bench(fwd, bench_ms)

    def memory_stage():
        if not ON_GPU:
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()  # the inputs, the upstream gradient, the truth
        grads = fwdbwd()
        torch.cuda.synchronize()
        del grads
        return (torch.cuda.max_memory_allocated() - before - spec.not_counted(shape)) / 1e6

    rec["fwd_status"], rec["fwd_ms"] = guarded(fwd_stage, rec["messages"])
    status, grads = guarded(lambda: first_call(fwdbwd, "first_fwdbwd_s"), rec["messages"])
    del grads  # freed before the memory stage
    if status != "ok":
        give_up(status)
    else:
        rec["memory_status"], rec["peak_extra_MB"] = guarded(memory_stage, rec["messages"])
        rec["fwdbwd_status"], rec["fwdbwd_ms"] = guarded(lambda: bench(fwdbwd, bench_ms), rec["messages"])
    if not ON_GPU:  # nothing was timed: every cell that ran says so, and no CPU time is kept
        rec.update({k: NA_CPU if rec[k] == "ok" else rec[k] for k in statuses}, first_fwd_s=None,
                   first_fwdbwd_s=None)
    return rec  # its tensors die with this frame; the caller frees the memory


def derive(records, copy_bw, ours):
    """Bandwidth, %copy, TFLOP/s and speedups over ours, from the latencies."""
    base = next((r for r in records if r["provider"] == ours), None)
    for rec in records:
        for p in PASSES:
            ms = rec.get(f"{p}_ms")
            if ms is None:
                continue
            if rec["bytes"]:
                rec[f"{p}_GBps"] = rec["bytes"][WORK[p]] / (ms * 1e-3) / 1e9
                if copy_bw:
                    rec[f"{p}_pct_copy"] = 100.0 * rec[f"{p}_GBps"] / copy_bw
            if rec["flops"]:
                rec[f"{p}_TFLOPs"] = rec["flops"][WORK[p]] / (ms * 1e-3) / 1e12
            if base is not None and base.get(f"{p}_ms") and rec is not base:
                rec[f"speedup_{p}"] = ms / base[f"{p}_ms"]


def run_kernel(spec, shapes, seed, bench_ms, copy_bw):
    """All providers at all shapes of one kernel: that kernel's block of the JSON."""
    providers = list(spec.providers)
    blocks = []  # one per shape: a record per provider, ours first
    for i, shape in enumerate(shapes):
        # The float64 truth, once per shape, on the values every provider gets (made
        # before any runs: Liger's RoPE and our in-place CE overwrite their inputs).
        def truth_of(shape=shape, seed=seed + i):
            torch.manual_seed(seed)
            return spec.truth(*[a.detach() for a in spec.make_inputs(shape)["args"]])

        failed = []
        status, truth = guarded(truth_of, failed)
        block = []
        for provider in providers:
            block.append(measure(spec, provider, shape, seed + i, truth, bench_ms))
            free_memory()  # the next provider starts clean
        if status != "ok":  # no truth, so no error column: say why, once
            block[0]["messages"].append(f"float64 truth: {status} {' '.join(failed)}".strip())
        del truth
        blocks.append(block)
    # CUDA graphs last (see CAPTURE), ours first: provider by provider, shape by shape.
    for k, provider in enumerate(providers):
        for i, shape in enumerate(shapes):
            measure_graph(spec, provider, shape, seed + i, blocks[i][k], bench_ms)
            free_memory()
    for block in blocks:
        derive(block, copy_bw, providers[0])
    return {"title": spec.title, "header": f"{spec.title} benchmark -- {spec.describe(shapes[0])}",
            "providers": providers, "ours": providers[0], "shapes": shapes,
            "error_label": spec.error_label, "rate_unit": "TFLOP/s" if spec.flops else "GB/s",
            "footnotes": footnotes(spec, shapes), "results": [rec for block in blocks for rec in block]}


def amount(x):
    return f"{x:,.1f}" if x >= 0.1 else f"{x:.2g}"  # 1,073.8 but also 0.0041 (CPU shapes)


def footnotes(spec, shapes):
    """The lines under a table: the formula, its value at each shape, then the notes."""
    lines = list(spec.formula)
    for s in shapes:
        if spec.bytes:
            b = spec.bytes(s)
            lines.append(f"  N = {s['tokens']:>6,}: fwd {amount(b['fwd'] / 1e6)} MB, "
                         f"fwd+bwd {amount(b['fwdbwd'] / 1e6)} MB")
        if spec.flops:
            f = spec.flops(s)
            logits = f"; the bf16 logits would be {amount(s['tokens'] * s['vocab'] * BYTES / 1e6)} MB" \
                if "vocab" in s else ""
            lines.append(f"  {shape_label(s)}: fwd {amount(f['fwd'] / 1e9)} GFLOP, fwd+bwd "
                         f"{amount(f['fwdbwd'] / 1e9)} GFLOP{logits}")
    return lines + [
        "Peak extra memory (fwd+bwd): max_memory_allocated() in one forward + backward minus what was",
        "  allocated just before it.",
    ] + spec.notes + [
        "%copy: effective bandwidth / device copy bandwidth measured at the start of this run.",
        "ours x: the peer's latency / ours (above 1.00x: ours is faster).",
    ]


# --- Output: one banner, one table per kernel ------------------------------------------
RULE = "=" * 100


def cell(value, fmt, suffix=""):
    return "-" if value is None else format(value, fmt) + suffix


def print_table(result, env):
    """The table of one kernel: one block of provider rows per shape, notes below."""
    rate = "TFLOPs" if result["rate_unit"] == "TFLOP/s" else "GBps"
    headers = ["tokens", "provider", "fwd us", result["rate_unit"], "%copy", "ours x",
               "fwd+bwd us", result["rate_unit"], "%copy", "ours x",
               "graph us", result["rate_unit"], "%copy", "ours x", "peak MB", result["error_label"]]
    rows, previous = [], None
    for rec in result["results"]:
        if previous is not None and rec["label"] != previous:
            rows.append(None)  # a blank line between shapes
        row = [rec["label"] if rec["label"] != previous else "", rec["provider"]]
        previous = rec["label"]
        for p in PASSES:  # a pass that has no latency shows its status once: OOM, ERR, n/a (CPU), ...
            ok = rec[f"{p}_status"] == "ok"
            row += [cell(rec[f"{p}_ms"] * 1e3, ",.1f") if ok else rec[f"{p}_status"],
                    cell(rec[f"{p}_{rate}"], ",.0f"), cell(rec[f"{p}_pct_copy"], ".0f", "%"),
                    cell(rec[f"speedup_{p}"], ".2f", "x")]
        row.append(cell(rec["peak_extra_MB"], ",.1f") if rec["memory_status"] == "ok" else rec["memory_status"])
        row.append(cell(rec["error"], ".1e"))
        rows.append(row)
    widths = [max([len(h)] + [len(r[k]) for r in rows if r]) for k, h in enumerate(headers)]

    def line(cells):  # text columns left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if k < 2 else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths))).rstrip()

    where = env["gpu"] if ON_GPU else "CPU (Triton interpreter, no timings)"
    copy = f"{env['copy_bandwidth_GBps']:,.0f} GB/s" if env["copy_bandwidth_GBps"] else "n/a"
    print(f"\n{RULE}\n{result['header']}\n{RULE}")
    print(f"GPU: {where} | torch {env['torch']} | triton {env['triton']} | copy bandwidth {copy}\n")
    print(line(headers) + "\n" + line(["-" * w for w in widths]))
    for row in rows:
        print(line(row) if row else "")
    print("\n" + "\n".join(result["footnotes"]))
    compile_times = [f"{r['label']} tokens: {r['first_fwd_s'] + (r['first_fwdbwd_s'] or 0):.1f} s"
                     for r in result["results"] if r["provider"].startswith("torch.compile") and r["first_fwd_s"]]
    if compile_times:
        print("torch.compile first calls (fwd graph + training graph compile, per shape): " + ", ".join(compile_times))
    if any(r["graph_status"] == "skipped" for r in result["results"]):
        failed = ", ".join(f"{p} at {where}" for p, where in CAPTURE["failed"].items())
        why = CAPTURE["broken"] or "a provider whose capture failed is not captured again"
        print(f"graph skipped: a CUDA-graph capture failed ({failed}); {why}")
    seen = {}  # every distinct error message once, with the shapes where it happened
    for r in result["results"]:
        for m in r["messages"]:
            seen.setdefault((r["provider"], m), []).append(r["label"])
    for (provider, m), labels in seen.items():
        m = m if len(m) <= 400 else m[:400] + " ..."
        print(f"ERR {provider} ({', '.join(dict.fromkeys(labels))} tokens): {m}")


def banner(env, bench_ms):
    versions = (f"Python {env['python']} | torch {env['torch']} | triton {env['triton']} | transformers "
                f"{env['transformers']} | CUDA {env['cuda']} | Liger-Kernel {env['liger_kernel'] or NOT_INSTALLED} | "
                f"cut-cross-entropy {env['cut_cross_entropy'] or NOT_INSTALLED}")
    print(f"{RULE}\nKernel benchmark -- ours (Triton) vs PyTorch eager, PyTorch native, torch.compile, "
          f"Liger-Kernel, cut-cross-entropy\n{RULE}")
    if ON_GPU:
        print(f"GPU: {env['gpu']}\nVersions: {versions}\nDate: {env['date']}")
        print(f"Device copy bandwidth: {env['copy_bandwidth_GBps']:,.0f} GB/s "
              "(1 GiB device-to-device copy, bytes read + written)")
        print(f"Timing: triton.testing.do_bench median, warm-up {bench_ms[0]} ms excluded, "
              f"rep {bench_ms[1]} ms, L2 flushed")
        return
    print("GPU: none -- CPU run, kernels execute in the Triton interpreter (TRITON_INTERPRET=1)")
    print(f"Versions: {versions}\nDate: {env['date']}\nDevice copy bandwidth: n/a (CPU)")
    print("Timing: NONE. This CPU run checks that every provider runs and reports numerical error;\n"
          "        it measures no time and makes no performance claim. torch.compile runs with\n"
          "        backend aot_eager; Liger-Kernel and cut-cross-entropy need CUDA and are skipped.")


# --- Main -------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", nargs="+", choices=[*KERNELS, "all"], default=["all"],
                        help="which kernels to benchmark (one or more, or all)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing loops (CPU: tiny shapes)")
    parser.add_argument("--json", metavar="PATH", help="write every number and the environment here")
    parser.add_argument("--plot", metavar="PATH.png", help="after measuring, draw tools/plot_benchmark.py's figure")
    parser.add_argument("--seed", type=flags.seed, default=0, help="0 .. 2**63 - 1")
    args = parser.parse_args(argv)
    CAPTURE.update(failed={}, broken=None)  # a fresh run tries every provider's capture again
    # Output paths are checked before anything is measured: a long run that cannot
    # write its results has lost them.
    if args.json:
        args.json = check_output_path(args.json, "--json", suffix=".json")
    if args.plot:
        args.plot = check_output_path(args.plot, "--plot", suffix=".png")
        if importlib.util.find_spec("matplotlib") is None:
            raise SystemExit("error: --plot needs matplotlib (pip install matplotlib)")
    started = time.perf_counter()
    bench_ms = BENCH_MS["quick" if args.quick else "full"]
    names = list(KERNELS) if "all" in args.kernel else list(dict.fromkeys(args.kernel))

    env = dict(environment_info(), liger_kernel=version("liger-kernel"), cut_cross_entropy=version("cut-cross-entropy"))
    env["copy_bandwidth_GBps"] = copy_bandwidth(bench_ms) if ON_GPU else None
    free_memory()
    banner(env, bench_ms)
    settings = {"quick": args.quick, "dtype": "bfloat16", "seed": args.seed,
                "timing": "triton.testing.do_bench median" if ON_GPU else "none (CPU, Triton interpreter)",
                "warmup_ms": bench_ms[0] if ON_GPU else None, "rep_ms": bench_ms[1] if ON_GPU else None,
                "fwd": "forward only, torch.no_grad(), inputs not requiring grad",
                "fwdbwd": "forward with autograd + torch.autograd.grad (upstream gradient: random for "
                          "tensor outputs, 1.0 for the scalar loss)",
                "graph": "fwdbwd captured in a CUDA graph and replayed: triton.testing.do_bench_cudagraph median"}
    results = {"environment": env, "settings": settings, "kernels": {}}
    for name in names:
        spec = KERNELS[name]
        shapes = spec.shapes["quick" if args.quick else "full"] if ON_GPU else spec.shapes["cpu"]
        results["kernels"][name] = run_kernel(spec, shapes, args.seed, bench_ms, env["copy_bandwidth_GBps"])
        print_table(results["kernels"][name], env)

    results["total_s"] = time.perf_counter() - started
    print(f"\nTotal time: {results['total_s']:.1f} s")
    if args.json:
        write_json_atomic(args.json, results)  # strict JSON (no NaN), never half a file
        print(f"Wrote {args.json}")
    if args.plot:
        # Imported here: matplotlib is needed only when a figure is asked for.
        from tools.plot_benchmark import plot_results

        plot_results(results, args.plot, metadata=PNG_METADATA)  # the mark: a later run may replace it
        print(f"Wrote {args.plot}")
    return results


if __name__ == "__main__":
    main()
