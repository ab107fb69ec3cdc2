"""
Steps 7 and 10 -- Benchmark the fused kernels against every peer.

Usage:
    python benchmark_kernels.py --kernel rmsnorm
    python benchmark_kernels.py --kernel cross_entropy
    python benchmark_kernels.py --kernel swiglu
    python benchmark_kernels.py --kernel rope
    python benchmark_kernels.py --kernel flce       # LM head + loss: TFLOP/s and memory
    python benchmark_kernels.py --kernel all --json bench.json --plot bench.png
    python benchmark_kernels.py --quick        # short run; on CPU: tiny shapes, no timings

For every kernel, shape and provider (ours, PyTorch eager in the Hugging Face
formulation, PyTorch's native op, torch.compile of the HF formulation, Liger-Kernel
when it is installed) the script reports, in one run and one table:

* forward latency and forward+backward latency: the median of
  ``triton.testing.do_bench`` (warm-up excluded, L2 cache flushed before each
  call). "fwd" is the forward alone under ``torch.no_grad()`` on inputs that do
  not require grad (evaluation / inference); "fwd+bwd" is what a training step
  pays: forward with autograd, then ``torch.autograd.grad`` with an upstream
  gradient created beforehand (random for RMSNorm; 1.0 for the scalar loss,
  as ``loss.backward()`` gives). Inputs are random, never zeros, and are
  allocated outside the timed region; every provider gets its own fresh copy.
* effective bandwidth = bytes of a written-out formula / latency. The formula
  counts each tensor the op must touch once (read once, written once): the
  minimum traffic any implementation needs. Extra passes an implementation
  makes are not counted, so they show up as lower effective bandwidth.
* that bandwidth as a percentage of the device copy bandwidth, measured at the
  start of the same run with a 1 GiB device-to-device copy (read + write bytes).
* "ours x": the peer's latency divided by ours (above 1: ours is faster).
* peak extra memory of forward+backward: ``torch.cuda.max_memory_allocated()``
  minus what was allocated just before the call (the caller's inputs).
* numerical error against a float64 truth (RMSNorm: max |y - y64|; cross-entropy:
  |loss - loss64| with loss64 = F.cross_entropy(logits.double(), targets)).

Without a GPU the kernels run in the Triton interpreter on tiny shapes. That run
checks that every provider works and shows the numerical error, but it measures
no time and makes no performance claim.

Adding a kernel: subclass ``KernelBench`` (shapes, inputs, providers, byte
formula, error) and register it in ``KERNELS``.
"""

import argparse
import gc
import importlib.metadata
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

# The Triton interpreter must be chosen before triton is imported (by us or by the
# kernel modules): without a GPU the kernels run on CPU tensors through it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from cross_entropy_kernel import cross_entropy, cross_entropy_reference  # noqa: E402
from linear_cross_entropy_kernel import fused_linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402
from llama_common import environment_info  # noqa: E402
from rmsnorm_kernel import rmsnorm, rmsnorm_reference  # noqa: E402
from rope_kernel import rope, rope_reference  # noqa: E402
from swiglu_kernel import swiglu, swiglu_reference  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPE = torch.bfloat16
OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)

NA_CPU = "n/a (CPU)"
SKIPPED_CPU = "skipped (CPU)"
NOT_INSTALLED = "not installed"

# do_bench budgets in milliseconds: (warm-up, repetitions) for a full and a quick run.
FULL_BENCH_MS = (25, 100)
QUICK_BENCH_MS = (10, 40)

PASSES = ("fwd", "fwdbwd")
PASS_LABEL = {"fwd": "fwd", "fwdbwd": "fwd+bwd"}


# --------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------
def _sync():
    if ON_GPU:
        torch.cuda.synchronize()


def _free_memory():
    """Drop unreachable tensors and return cached blocks, so the next provider starts clean."""
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _liger_version():
    return _version("liger-kernel")


def _gpu_package_availability(package):
    """None when ``package`` can run here, else the reason shown in its cells."""
    if _version(package) is None:
        return NOT_INSTALLED
    if not ON_GPU:
        return SKIPPED_CPU  # their Triton kernels do not run in the CPU interpreter
    return None


def _liger_availability():
    return _gpu_package_availability("liger-kernel")


def _cce_availability():
    return _gpu_package_availability("cut-cross-entropy")


def _cuda_only():
    return None if ON_GPU else SKIPPED_CPU


def _quiet_liger_logs():
    # Liger logs a warning for every optional backend (CuTe DSL, Ascend, ...) that
    # cannot be imported; they are irrelevant here and would clutter the tables.
    logging.getLogger("liger_kernel").setLevel(logging.ERROR)


def _compiled(fn):
    """torch.compile of ``fn`` for one fixed shape (called once per shape)."""
    # A fresh Dynamo state per shape: each shape compiles its own static graph
    # (dynamic=False), and the compile time we report belongs to that shape.
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def _chunks(n_rows, row_elems, max_elems=2**27):
    """Row ranges of at most ``max_elems`` elements, to bound float64 temporaries."""
    step = max(1, max_elems // max(row_elems, 1))
    return [(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


def measure_copy_bandwidth(bench_ms):
    """Device copy bandwidth in GB/s: a 1 GiB device-to-device copy, read + written bytes."""
    n = 2**28  # float32 elements = 1 GiB, far larger than any L2 cache
    src = torch.empty(n, dtype=torch.float32, device=DEVICE).uniform_(-1.0, 1.0)
    dst = torch.empty_like(src)
    warmup, rep = bench_ms
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=warmup, rep=rep, return_mode="median")
    del src, dst
    _free_memory()
    return 2 * n * 4 / (ms * 1e-3) / 1e9


# --------------------------------------------------------------------------------
# The registry: what a kernel benchmark provides
# --------------------------------------------------------------------------------
@dataclass
class Provider:
    """One implementation of the op.

    build(shape) returns the op, a function of the tensors ``KernelBench.args``
    returns. It runs once per shape, before the inputs exist (torch.compile
    compiles lazily on the first call, which we time separately).
    """

    name: str
    build: Callable
    availability: Callable = lambda: None  # None, or why the provider cannot run here


class KernelBench:
    """Base class of one kernel's benchmark. Subclasses fill in the blanks."""

    name = ""
    title = ""
    error_label = "|err|"
    rate_unit = "GB/s"  # "TFLOP/s" for benches that define flops()

    def shapes(self, quick):
        raise NotImplementedError

    def shape_label(self, shape):
        return f"{shape['tokens']:,}"

    def make_inputs(self, shape):
        """Fresh random tensors; returns a dict with the keys used below."""
        raise NotImplementedError

    def args(self, inputs):
        """The op's positional arguments, in order."""
        raise NotImplementedError

    def wrt(self, inputs):
        """The tensors forward+backward differentiates with respect to."""
        raise NotImplementedError

    def upstream(self, inputs):
        """The upstream gradient for forward+backward (random, created before timing)."""
        return inputs["upstream"]

    def providers(self):
        raise NotImplementedError

    def bytes_moved(self, shape):
        """{"fwd": bytes, "fwdbwd": bytes} of the byte formula (None: not bandwidth-bound)."""
        raise NotImplementedError

    def flops(self, shape):
        """{"fwd": FLOPs, "fwdbwd": FLOPs} for matmul-bound work, reported as TFLOP/s; else None."""
        return None

    def counted_as_inputs_bytes(self, shape):
        """Bytes of the returned gradients that the peak-memory column leaves out (default: none)."""
        return 0

    def truth(self, inputs):
        """Computed before any provider runs on the inputs (some overwrite them)."""
        return None

    def error(self, out, inputs, truth):
        raise NotImplementedError

    def header(self, shapes):
        return self.title

    def footnotes(self, shapes):
        return []

    def bytes_lines(self, shapes, extra=lambda nb: ""):
        """One footnote line per shape: the MB of the byte formula, fwd and fwd+bwd."""
        lines = []
        for shape in shapes:
            nb = self.bytes_moved(shape)
            lines.append(
                f"  N = {shape['tokens']:>6,}: fwd {nb['fwd'] / 1e6:,.1f} MB, fwd+bwd {nb['fwdbwd'] / 1e6:,.1f} MB"
                + extra(nb)
            )
        return lines


# --------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------
class RMSNormBench(KernelBench):
    name = "rmsnorm"
    title = "RMSNorm"
    error_label = "max |err|"
    hidden = 4096
    eps = 1e-6

    def shapes(self, quick):
        if not ON_GPU:
            return [{"tokens": 64, "hidden": 256}]
        tokens = (4096, 16384) if quick else (4096, 16384, 65536)
        return [{"tokens": n, "hidden": self.hidden} for n in tokens]

    def make_inputs(self, shape):
        n, h = shape["tokens"], shape["hidden"]
        x = torch.randn(n, h, device=DEVICE, dtype=DTYPE).requires_grad_(True)
        # A random, non-unit weight: with ones, a kernel could skip the multiply unnoticed.
        w = (1.0 + 0.1 * torch.randn(h, device=DEVICE)).to(DTYPE).requires_grad_(True)
        dy = torch.randn(n, h, device=DEVICE, dtype=DTYPE)
        return {"x": x, "w": w, "upstream": dy}

    def args(self, inputs):
        return inputs["x"], inputs["w"]

    def wrt(self, inputs):
        return inputs["x"], inputs["w"]

    def providers(self):
        eps = self.eps

        def ours(shape):
            return lambda x, w: rmsnorm(x, w, eps)

        def eager(shape):
            return lambda x, w: rmsnorm_reference(x, w, eps)

        def native(shape):
            return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps)

        def compiled(shape):
            fn = _compiled(rmsnorm_reference)
            return lambda x, w: fn(x, w, eps)

        def liger(shape):
            _quiet_liger_logs()
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            # Positional arguments: X, W, eps, offset, casting_mode, in_place. These
            # are the defaults of LigerRMSNorm (the module that Liger's LLaMA patch
            # installs): HF's casting order, and dx written into the dy buffer.
            return lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", True)

        return [
            Provider("ours (Triton)", ours),
            Provider("PyTorch eager (HF)", eager),
            Provider("F.rms_norm (native)", native),
            Provider("torch.compile (HF)", compiled, _cuda_only),
            Provider("Liger-Kernel", liger, _liger_availability),
        ]

    def bytes_moved(self, shape):
        n, h = shape["tokens"], shape["hidden"]
        b = torch.finfo(DTYPE).bits // 8  # x, y, dy, dx and w all have this dtype
        return {
            # read x + write y + read w
            "fwd": 2 * n * h * b + h * b,
            # forward again, then backward: read x, read dy, write dx, read w, write dw
            # = 5 passes over [N, H] (x twice, y, dy, dx) + 3 weight-sized terms
            "fwdbwd": 5 * n * h * b + 3 * h * b,
        }

    def error(self, out, inputs, truth):
        # No precomputed truth: no provider overwrites x, so it is computed here.
        x, w = inputs["x"].detach(), inputs["w"].detach()
        worst = 0.0
        for lo, hi in _chunks(x.shape[0], x.shape[1]):
            ref = rmsnorm_reference(x[lo:hi], w, self.eps, compute_dtype=torch.float64)
            worst = max(worst, (out[lo:hi].double() - ref).abs().max().item())
        return worst

    def header(self, shapes):
        hidden = ", ".join(f"{h:,}" for h in sorted({s["hidden"] for s in shapes}))
        return f"RMSNorm benchmark -- hidden {hidden}, {str(DTYPE).replace('torch.', '')}, eps {self.eps:g}"

    def footnotes(self, shapes):
        lines = [
            "Bytes (N tokens, H hidden, 2 B per bf16 element; each tensor read once, written once):",
            "  fwd     = read x + write y + read w                          = 2*N*H*2 + H*2",
            "  fwd+bwd = fwd + read x + read dy + write dx + read w + write dw",
            "          = 5 passes over [N, H] + 3 weight terms              = 5*N*H*2 + 3*H*2",
        ]
        lines += self.bytes_lines(shapes)
        lines += [
            "Peak extra memory (fwd+bwd): max_memory_allocated() during one forward + backward minus the memory",
            "  allocated just before it. x, w and dy (the caller's) are not counted; y, dx, dw, saved",
            "  statistics and every temporary (float32 copies, partial dw sums) are. Floor: y + dx =",
            "  2*N*H*2 bytes. Liger writes dx into the dy buffer (in_place=True, its module default).",
            "max |err|: forward output vs the HF formula evaluated in float64, max over all elements.",
        ]
        return lines


# --------------------------------------------------------------------------------
# Cross-entropy
# --------------------------------------------------------------------------------
class CrossEntropyBench(KernelBench):
    name = "cross_entropy"
    title = "Cross-entropy"
    error_label = "loss |err|"
    vocab = 128256  # LLaMA-3

    def shapes(self, quick):
        if not ON_GPU:
            return [{"tokens": 32, "vocab": 1000}]
        tokens = (4096, 8192) if quick else (1024, 4096, 8192, 16384)
        return [{"tokens": n, "vocab": self.vocab} for n in tokens]

    def make_inputs(self, shape):
        n, v = shape["tokens"], shape["vocab"]
        logits = torch.randn(n, v, device=DEVICE, dtype=DTYPE).requires_grad_(True)
        targets = torch.randint(0, v, (n,), device=DEVICE)
        # The loss is a scalar and training calls loss.backward(): upstream is 1.0.
        upstream = torch.ones((), device=DEVICE)
        return {"logits": logits, "targets": targets, "upstream": upstream}

    def args(self, inputs):
        return inputs["logits"], inputs["targets"]

    def wrt(self, inputs):
        return (inputs["logits"],)

    def providers(self):
        def ours(shape):
            return lambda logits, targets: cross_entropy(logits, targets)

        def ours_inplace(shape):
            return lambda logits, targets: cross_entropy(logits, targets, inplace_backward=True)

        def eager(shape):
            return cross_entropy_reference  # F.cross_entropy(logits.float(), ...) as HF

        def native_bf16(shape):
            return lambda logits, targets: F.cross_entropy(logits, targets)

        def compiled(shape):
            return _compiled(cross_entropy_reference)

        def liger(shape):
            _quiet_liger_logs()
            from liger_kernel.transformers import LigerCrossEntropyLoss

            return LigerCrossEntropyLoss(ignore_index=-100, reduction="mean")

        return [
            Provider("ours (Triton)", ours),
            Provider("ours (in-place)", ours_inplace),
            Provider("PyTorch eager (HF fp32)", eager),
            Provider("F.cross_entropy (bf16)", native_bf16),
            Provider("torch.compile (HF)", compiled, _cuda_only),
            Provider("Liger-Kernel", liger, _liger_availability),
        ]

    def bytes_moved(self, shape):
        n, v = shape["tokens"], shape["vocab"]
        b = torch.finfo(DTYPE).bits // 8
        # Targets (N * 8 B) and the scalar loss are left out: < 0.01% of the total.
        return {"fwd": n * v * b, "fwdbwd": 2 * n * v * b}

    def truth(self, inputs):
        logits, targets = inputs["logits"].detach(), inputs["targets"]
        total = 0.0
        for lo, hi in _chunks(logits.shape[0], logits.shape[1]):
            total += F.cross_entropy(logits[lo:hi].double(), targets[lo:hi], reduction="sum").item()
        return total / max(int((targets != -100).sum().item()), 1)

    def error(self, out, inputs, truth):
        return abs(float(out.double().item()) - truth)

    def header(self, shapes):
        vocab = ", ".join(f"{v:,}" for v in sorted({s["vocab"] for s in shapes}))
        llama = " (LLaMA 3)" if vocab == f"{self.vocab:,}" else ""
        return f"Cross-entropy benchmark -- vocabulary {vocab}{llama}, {str(DTYPE).replace('torch.', '')}, mean"

    def footnotes(self, shapes):
        lines = [
            "Bytes (N tokens, V vocabulary, 2 B per bf16 element; targets and the loss are left out):",
            "  fwd     = read logits                          = N*V*2",
            "  fwd+bwd = read logits + write their gradient   = 2*N*V*2",
            "  An implementation that reads the logits twice moves 3*N*V*2 bytes from memory and so",
            "  stays below 2/3 of the copy bandwidth on this metric, unless the second read hits in L2.",
        ]
        lines += self.bytes_lines(shapes, lambda nb: f" (the logits gradient alone: {nb['fwd'] / 1e6:,.1f} MB)")
        lines += [
            "Peak extra memory (fwd+bwd): max_memory_allocated() during one loss + backward minus the memory",
            "  allocated just before it; the logits, targets and upstream gradient (the caller's) are not",
            "  counted. The logits gradient [N, V] IS counted when a provider allocates it (all but",
            "  ours (in-place) and Liger, which write it into the logits buffer), so subtract the size",
            "  above to see the temporaries alone.",
            "fwd runs under torch.no_grad() on logits that do not require grad (evaluation). In training,",
            "  ours and Liger write the gradient during the forward launch and backward only rescales it",
            "  by the upstream gradient (an extra read + write of [N, V], skipped on the device when it",
            "  is exactly 1.0, as after loss.backward(), which is what this benchmark does).",
            "loss |err|: |loss - F.cross_entropy(logits.double(), targets)|, on the same logits.",
        ]
        return lines


# --------------------------------------------------------------------------------
# SwiGLU (the LLaMA MLP's activation)
# --------------------------------------------------------------------------------
class SwiGLUBench(KernelBench):
    name = "swiglu"
    title = "SwiGLU"
    error_label = "max |err|"
    intermediate = 14336  # LLaMA-3.1-8B

    def shapes(self, quick):
        if not ON_GPU:
            return [{"tokens": 64, "intermediate": 300}]
        tokens = (16384,) if quick else (4096, 16384)
        return [{"tokens": n, "intermediate": self.intermediate} for n in tokens]

    def make_inputs(self, shape):
        n, i = shape["tokens"], shape["intermediate"]
        gate = torch.randn(n, i, device=DEVICE, dtype=DTYPE).requires_grad_(True)
        up = torch.randn(n, i, device=DEVICE, dtype=DTYPE).requires_grad_(True)
        dy = torch.randn(n, i, device=DEVICE, dtype=DTYPE)
        return {"gate": gate, "up": up, "upstream": dy}

    def args(self, inputs):
        return inputs["gate"], inputs["up"]

    def wrt(self, inputs):
        return inputs["gate"], inputs["up"]

    def providers(self):
        def ours(shape):
            return swiglu

        def eager(shape):
            return swiglu_reference  # F.silu(gate) * up, as HF's LlamaMLP

        def compiled(shape):
            return _compiled(swiglu_reference)

        def liger(shape):
            _quiet_liger_logs()
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply

        return [
            Provider("ours (Triton)", ours),
            Provider("PyTorch eager (HF)", eager),
            Provider("torch.compile (HF)", compiled, _cuda_only),
            Provider("Liger-Kernel", liger, _liger_availability),
        ]

    def bytes_moved(self, shape):
        nbytes = shape["tokens"] * shape["intermediate"] * (torch.finfo(DTYPE).bits // 8)
        # fwd: read gate, read up, write y. fwd+bwd: that, then read dy, gate, up and
        # write dgate, dup: 8 passes over [N, I].
        return {"fwd": 3 * nbytes, "fwdbwd": 8 * nbytes}

    def error(self, out, inputs, truth):
        g, u = inputs["gate"].detach(), inputs["up"].detach()
        worst = 0.0
        for lo, hi in _chunks(g.shape[0], g.shape[1]):
            ref = swiglu_reference(g[lo:hi].double(), u[lo:hi].double())
            worst = max(worst, (out[lo:hi].double() - ref).abs().max().item())
        return worst

    def header(self, shapes):
        inter = ", ".join(f"{s['intermediate']:,}" for s in shapes[:1])
        return f"SwiGLU benchmark -- silu(gate) * up, intermediate size {inter}, {str(DTYPE).replace('torch.', '')}"

    def footnotes(self, shapes):
        lines = [
            "Bytes (N tokens, I intermediate, 2 B per bf16 element):",
            "  fwd     = read gate + read up + write y                                 = 3*N*I*2",
            "  fwd+bwd = fwd + read dy + read gate + read up + write dgate + write dup  = 8*N*I*2",
        ]
        lines += self.bytes_lines(shapes)
        lines += [
            "Peak extra memory (fwd+bwd): max_memory_allocated() during one forward + backward minus the memory",
            "  allocated just before it (gate, up and dy are the caller's). Floor: y + dgate + dup = 3*N*I*2.",
            "max |err|: forward output vs silu(gate) * up evaluated in float64, max over all elements.",
        ]
        return lines


# --------------------------------------------------------------------------------
# Fused linear cross-entropy (LM head + loss)
# --------------------------------------------------------------------------------
class FusedLinearCrossEntropyBench(KernelBench):
    name = "flce"
    title = "Linear + cross-entropy"
    error_label = "loss |err|"
    rate_unit = "TFLOP/s"
    hidden = 4096
    vocab = 128256

    def shapes(self, quick):
        if not ON_GPU:
            return [{"tokens": 32, "hidden": 64, "vocab": 1000}]
        tokens = (4096,) if quick else (4096, 16384)
        return [{"tokens": n, "hidden": self.hidden, "vocab": self.vocab} for n in tokens]

    def make_inputs(self, shape):
        n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
        hidden = torch.randn(n, h, device=DEVICE, dtype=DTYPE).requires_grad_(True)
        # Logits of a few units, like a trained LM head's.
        weight = (torch.randn(v, h, device=DEVICE) * (2.0 / h**0.5)).to(DTYPE).requires_grad_(True)
        targets = torch.randint(0, v, (n,), device=DEVICE)
        return {"hidden": hidden, "weight": weight, "targets": targets, "upstream": torch.ones((), device=DEVICE)}

    def args(self, inputs):
        return inputs["hidden"], inputs["weight"], inputs["targets"]

    def wrt(self, inputs):
        return inputs["hidden"], inputs["weight"]

    def providers(self):
        def ours(shape):
            return fused_linear_cross_entropy

        def eager(shape):
            return linear_cross_entropy_reference  # lm_head, then logits.float() and F.cross_entropy

        def compiled(shape):
            return _compiled(linear_cross_entropy_reference)

        def liger(shape):
            _quiet_liger_logs()
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")
            return lambda hidden, weight, targets: loss(weight, hidden, targets)

        def cce(shape):
            from cut_cross_entropy import linear_cross_entropy

            # Its defaults: the "cce" kernels, mean over non-ignored targets.
            return lambda hidden, weight, targets: linear_cross_entropy(hidden, weight, targets)

        return [
            Provider("ours (Triton + cuBLAS)", ours),
            Provider("PyTorch eager (HF)", eager),
            Provider("torch.compile (HF)", compiled, _cuda_only),
            Provider("Liger-Kernel FLCE", liger, _liger_availability),
            Provider("Apple cut-cross-entropy", cce, _cce_availability),
        ]

    def bytes_moved(self, shape):
        return None  # matmul-bound: reported as TFLOP/s

    def flops(self, shape):
        # One [N, H] x [H, V] matmul forward; two of the same size in backward
        # (d hidden and d weight). The softmax is negligible next to them.
        mm = 2 * shape["tokens"] * shape["hidden"] * shape["vocab"]
        return {"fwd": mm, "fwdbwd": 3 * mm}

    def counted_as_inputs_bytes(self, shape):
        # The returned d hidden [N, H] and d weight [V, H]: a training step holds
        # these anyway (as .grad), so they are not "extra".
        b = torch.finfo(DTYPE).bits // 8
        return (shape["tokens"] + shape["vocab"]) * shape["hidden"] * b

    def truth(self, inputs):
        hidden, weight, targets = inputs["hidden"].detach(), inputs["weight"].detach().double(), inputs["targets"]
        total = 0.0
        for lo, hi in _chunks(hidden.shape[0], weight.shape[0]):
            logits = hidden[lo:hi].double() @ weight.t()
            total += F.cross_entropy(logits, targets[lo:hi], reduction="sum").item()
        return total / max(int((targets != -100).sum().item()), 1)

    def error(self, out, inputs, truth):
        return abs(float(out.double().item()) - truth)

    def header(self, shapes):
        s = shapes[0]
        return (f"Linear + cross-entropy benchmark -- hidden {s['hidden']:,} -> vocabulary {s['vocab']:,}, "
                f"{str(DTYPE).replace('torch.', '')}, mean")

    def footnotes(self, shapes):
        lines = [
            "TFLOP/s = matmul FLOPs / latency: fwd = 2*N*H*V (the LM head), fwd+bwd = 3 x that (plus d hidden",
            "  and d weight). Providers that recompute the logits in backward do more work than counted.",
            "Peak extra memory (fwd+bwd): max_memory_allocated() during one forward + backward minus the memory",
            "  allocated just before it (hidden, weight, targets) minus the two returned gradients",
            "  (d hidden [N, H] + d weight [V, H], which training holds as .grad anyway). What remains is",
            "  logits, their gradient, copies and chunk buffers.",
        ]
        for shape in shapes:
            logits = shape["tokens"] * shape["vocab"] * (torch.finfo(DTYPE).bits // 8)
            lines.append(f"  N = {shape['tokens']:>6,}: the bf16 logits alone would be {logits / 1e6:,.0f} MB")
        lines += [
            "Apple cut-cross-entropy filters small gradient entries by default (filter_eps='auto'), an",
            "  approximation; the others compute the exact gradient.",
            "loss |err|: |loss - the same loss with hidden @ weight.T and the softmax in float64|.",
        ]
        return lines


# --------------------------------------------------------------------------------
# RoPE (rotary position embedding of queries and keys)
# --------------------------------------------------------------------------------
class RoPEBench(KernelBench):
    name = "rope"
    title = "RoPE"
    error_label = "max |err|"
    heads, kv_heads, head_dim, seq = 32, 8, 128, 2048  # LLaMA-3.1-8B

    def shapes(self, quick):
        if not ON_GPU:
            return [{"tokens": 2 * 16, "batch": 2, "seq": 16, "heads": 4, "kv_heads": 2, "head_dim": 16}]
        batches = (2,) if quick else (2, 8)
        return [{"tokens": b * self.seq, "batch": b, "seq": self.seq, "heads": self.heads,
                 "kv_heads": self.kv_heads, "head_dim": self.head_dim} for b in batches]

    def make_inputs(self, shape):
        b, t, d = shape["batch"], shape["seq"], shape["head_dim"]
        # As HF's attention makes them: [B, T, H*D] projections viewed as [B, H, T, D].
        q = torch.randn(b, t, shape["heads"], d, device=DEVICE, dtype=DTYPE).transpose(1, 2).requires_grad_(True)
        k = torch.randn(b, t, shape["kv_heads"], d, device=DEVICE, dtype=DTYPE).transpose(1, 2).requires_grad_(True)
        angles = torch.arange(t, device=DEVICE).float()[:, None] * (500000.0 ** (-torch.arange(0, d, 2, device=DEVICE) / d))
        emb = torch.cat((angles, angles), dim=-1).expand(b, t, d)
        cos, sin = emb.cos().to(DTYPE).contiguous(), emb.sin().to(DTYPE).contiguous()
        upstream = (torch.randn_like(q), torch.randn_like(k))
        return {"q": q, "k": k, "cos": cos, "sin": sin, "upstream": upstream}

    def args(self, inputs):
        return inputs["q"], inputs["k"], inputs["cos"], inputs["sin"]

    def wrt(self, inputs):
        return inputs["q"], inputs["k"]

    def providers(self):
        def ours(shape):
            return rope

        def eager(shape):
            return rope_reference  # HF's apply_rotary_pos_emb

        def compiled(shape):
            return _compiled(rope_reference)

        def liger(shape):
            _quiet_liger_logs()
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            return liger_rotary_pos_emb

        return [
            Provider("ours (Triton)", ours),
            Provider("PyTorch eager (HF)", eager),
            Provider("torch.compile (HF)", compiled, _cuda_only),
            Provider("Liger-Kernel", liger, _liger_availability),
        ]

    def bytes_moved(self, shape):
        b = torch.finfo(DTYPE).bits // 8
        qk = shape["tokens"] * (shape["heads"] + shape["kv_heads"]) * shape["head_dim"] * b
        table = 2 * shape["tokens"] * shape["head_dim"] * b  # cos and sin
        # fwd: read q, k, cos, sin; write q', k'. bwd: read dq', dk', cos, sin; write dq, dk.
        return {"fwd": 2 * qk + table, "fwdbwd": 4 * qk + 2 * table}

    def truth(self, inputs):
        # Before any provider runs: Liger rotates q and k in place.
        return rope_reference(*[t.detach().double() for t in self.args(inputs)])

    def error(self, out, inputs, truth):
        return max((o.double() - r).abs().max().item() for o, r in zip(out, truth))

    def header(self, shapes):
        s = shapes[0]
        return (f"RoPE benchmark -- {s['heads']} query + {s['kv_heads']} key heads of {s['head_dim']}, seq {s['seq']:,}, "
                f"{str(DTYPE).replace('torch.', '')}")

    def footnotes(self, shapes):
        lines = [
            "Bytes (tokens N, Hq query + Hk key heads of D, 2 B per bf16 element):",
            "  fwd     = read q, k + write q', k' + read cos, sin           = 2*N*(Hq+Hk)*D*2 + 2*N*D*2",
            "  fwd+bwd = fwd + read dq', dk' + write dq, dk + read cos, sin = 4*N*(Hq+Hk)*D*2 + 4*N*D*2",
            "q and k are the transposed [B, H, T, D] views HF's attention builds; cos, sin are [B, T, D].",
            "Peak extra memory (fwd+bwd): max_memory_allocated() during one forward + backward minus the memory",
            "  allocated just before it (q, k, cos, sin and the upstream gradients are the caller's).",
            "Liger-Kernel rotates q and k in place (its inputs are overwritten); the others return new tensors.",
            "max |err|: q' and k' vs HF's formula evaluated in float64 (on the inputs before any provider ran).",
        ]
        return lines


KERNELS = {
    bench.name: bench
    for bench in (RMSNormBench(), CrossEntropyBench(), SwiGLUBench(), RoPEBench(), FusedLinearCrossEntropyBench())
}


# --------------------------------------------------------------------------------
# Measuring one provider at one shape
# --------------------------------------------------------------------------------
def _guard(stage):
    """Run one measurement stage: (status, value, message)."""
    try:
        return "ok", stage(), None
    except OOM_ERRORS:
        return "OOM", None, None
    except Exception as exc:  # noqa: BLE001 - a failing peer must not stop the run
        if "out of memory" in str(exc).lower():
            return "OOM", None, None
        return "ERR", None, f"{type(exc).__name__}: {exc}".strip()


def _record_stage(rec, status_key, value_key, stage):
    """Run a guarded stage into rec: its status, its value, its message; free memory if it failed."""
    rec[status_key], rec[value_key], message = _guard(stage)
    if message:
        rec["messages"].append(message)
    if rec[status_key] != "ok":
        _free_memory()


def _empty_record(bench, provider, shape):
    return {
        "provider": provider.name,
        "shape": dict(shape),
        "label": bench.shape_label(shape),
        "bytes": bench.bytes_moved(shape),
        "flops": bench.flops(shape),
        "fwd_status": None,
        "fwdbwd_status": None,
        "memory_status": None,
        "fwd_ms": None,
        "fwdbwd_ms": None,
        "fwd_GBps": None,
        "fwdbwd_GBps": None,
        "fwd_pct_copy": None,
        "fwdbwd_pct_copy": None,
        "fwd_TFLOPs": None,
        "fwdbwd_TFLOPs": None,
        "speedup_fwd": None,
        "speedup_fwdbwd": None,
        "peak_extra_MB": None,
        "error": None,
        "first_fwd_s": None,
        "first_fwdbwd_s": None,
        "messages": [],
    }


def measure(bench, provider, shape, seed, bench_ms):
    """All numbers for one provider at one shape. Never raises for a failing provider."""
    rec = _empty_record(bench, provider, shape)

    def fail_all(status, message=None):
        for key in ("fwd_status", "fwdbwd_status", "memory_status"):
            rec[key] = rec[key] or status
        if message:
            rec["messages"].append(message)

    reason = provider.availability()
    if reason:
        fail_all(reason)
        return rec

    # Same seed for every provider of a shape: identical values, fresh buffers.
    torch.manual_seed(seed)
    status, state, message = _guard(lambda: _prepare(bench, provider, shape))
    if status != "ok":
        fail_all(status, message)
        _free_memory()
        return rec
    inputs, op, truth = state
    del state
    args = bench.args(inputs)
    # Forward-only calls see tensors that do not require grad (evaluation), so no
    # provider prepares a gradient there.
    fwd_args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    wrt = bench.wrt(inputs)
    upstream = bench.upstream(inputs)
    upstream_as = {}  # the upstream gradient cast to the output's dtype, made once

    def fwd():
        with torch.no_grad():
            return op(*fwd_args)

    def fwdbwd():
        out = op(*args)
        # An op may return several tensors (RoPE: q and k), each with its upstream gradient.
        outs = out if isinstance(out, tuple) else (out,)
        ups = upstream if isinstance(upstream, tuple) else (upstream,)
        grads_out = []
        for i, (o, u) in enumerate(zip(outs, ups)):
            g = upstream_as.get((i, o.dtype))
            if g is None:
                g = upstream_as[(i, o.dtype)] = u.to(o.dtype)
            grads_out.append(g)
        # autograd.grad returns the gradients instead of accumulating into .grad,
        # so repeated calls neither pile up nor need .grad cleared.
        return torch.autograd.grad(outs, wrt, grads_out)

    # Stage 1: the first forward (compilation / JIT happens here), its error, its timing.
    def forward_stage():
        t0 = time.perf_counter()
        out = fwd()
        _sync()
        rec["first_fwd_s"] = time.perf_counter() - t0
        rec["error"] = bench.error(out, inputs, truth)
        del out
        if not ON_GPU:
            return None
        warmup, rep = bench_ms
        return triton.testing.do_bench(fwd, warmup=warmup, rep=rep, return_mode="median")

    _record_stage(rec, "fwd_status", "fwd_ms", forward_stage)

    # Stage 2: the first forward+backward (compiles the backward), then memory, then timing.
    def first_fwdbwd():
        t0 = time.perf_counter()
        grads = fwdbwd()
        _sync()
        rec["first_fwdbwd_s"] = time.perf_counter() - t0
        del grads

    status, _, message = _guard(first_fwdbwd)
    if status != "ok":
        fail_all(status, message)
    else:

        def memory_stage():
            if not ON_GPU:
                return None
            _sync()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            grads = fwdbwd()
            _sync()
            peak = torch.cuda.max_memory_allocated()
            del grads
            return (peak - before - bench.counted_as_inputs_bytes(shape)) / 1e6

        def timing_stage():
            if not ON_GPU:
                return None
            warmup, rep = bench_ms
            return triton.testing.do_bench(fwdbwd, warmup=warmup, rep=rep, return_mode="median")

        _record_stage(rec, "memory_status", "peak_extra_MB", memory_stage)
        _record_stage(rec, "fwdbwd_status", "fwdbwd_ms", timing_stage)

    if not ON_GPU:
        # Nothing was timed or measured: say so instead of leaving an "ok" without a number.
        for key in ("fwd_status", "fwdbwd_status", "memory_status"):
            if rec[key] == "ok":
                rec[key] = NA_CPU
    del inputs, op, args, fwd_args, wrt, upstream, upstream_as, fwd, fwdbwd
    _free_memory()
    return rec


def _prepare(bench, provider, shape):
    """Inputs, the built op and the truth, in the order that keeps the truth honest."""
    inputs = bench.make_inputs(shape)
    truth = bench.truth(inputs)  # before any provider may overwrite the inputs
    op = provider.build(shape)
    return inputs, op, truth


def _derive(records, copy_bw, ours_name):
    """Bandwidth, share of the copy bandwidth and speedups, from the latencies."""
    ours = next((r for r in records if r["provider"] == ours_name), None)
    for rec in records:
        for p in PASSES:
            ms = rec[f"{p}_ms"]
            if ms is None:
                continue
            if rec.get("bytes"):
                gbps = rec["bytes"][p] / (ms * 1e-3) / 1e9
                rec[f"{p}_GBps"] = gbps
                if copy_bw:
                    rec[f"{p}_pct_copy"] = 100.0 * gbps / copy_bw
            if rec.get("flops"):
                rec[f"{p}_TFLOPs"] = rec["flops"][p] / (ms * 1e-3) / 1e12
            if ours is not None and ours[f"{p}_ms"] and rec is not ours:
                rec[f"speedup_{p}"] = ms / ours[f"{p}_ms"]


def _rate(rec, p):
    """The rate column: TFLOP/s for matmul-bound work, else effective bandwidth."""
    return rec[f"{p}_TFLOPs"] if rec.get("flops") else rec[f"{p}_GBps"]


def run_kernel(bench, quick, bench_ms, copy_bw, seed):
    shapes = bench.shapes(quick)
    providers = bench.providers()
    records = []
    for i, shape in enumerate(shapes):
        block = [measure(bench, prov, shape, seed + i, bench_ms) for prov in providers]
        _derive(block, copy_bw, providers[0].name)
        records.extend(block)
    return {
        "title": bench.title,
        "header": bench.header(shapes),
        "providers": [p.name for p in providers],
        "ours": providers[0].name,
        "shapes": shapes,
        "error_label": bench.error_label,
        "rate_unit": bench.rate_unit,
        "footnotes": bench.footnotes(shapes),
        "results": records,
    }


# --------------------------------------------------------------------------------
# Output: tables, JSON, plot
# --------------------------------------------------------------------------------
RULE = "=" * 100


def _fmt(value, status, spec):
    if status not in (None, "ok"):
        return status
    if value is None:
        return "-"
    return format(value, spec)


def _cells(rec, label, error_label):
    row = [label, rec["provider"]]
    for p in PASSES:
        status = rec[f"{p}_status"]
        row.append(_fmt(rec[f"{p}_ms"] * 1e3 if rec[f"{p}_ms"] is not None else None, status, ",.1f"))
        # A failed or skipped pass shows its status once, in the latency cell.
        row.append(_fmt(_rate(rec, p), None, ",.0f"))
        row.append(_fmt(rec[f"{p}_pct_copy"], None, ".0f") + ("%" if rec[f"{p}_pct_copy"] is not None else ""))
        row.append(_fmt(rec[f"speedup_{p}"], None, ".2f") + ("x" if rec[f"speedup_{p}"] is not None else ""))
    row.append(_fmt(rec["peak_extra_MB"], rec["memory_status"], ",.1f"))
    row.append(_fmt(rec["error"], None, ".1e"))
    return row


def format_table(kernel_result):
    """The aligned table of one kernel: one block of provider rows per shape."""
    error_label = kernel_result["error_label"]
    unit = kernel_result.get("rate_unit", "GB/s")
    headers = [
        "tokens", "provider",
        "fwd us", unit, "%copy", "ours x",
        "fwd+bwd us", unit, "%copy", "ours x",
        "peak MB", error_label,
    ]
    blocks = []
    by_label = {}
    for rec in kernel_result["results"]:
        by_label.setdefault(rec["label"], []).append(rec)
    for label, recs in by_label.items():
        blocks.append([_cells(rec, label if j == 0 else "", error_label) for j, rec in enumerate(recs)])
    widths = [len(h) for h in headers]
    for block in blocks:
        for row in block:
            widths = [max(w, len(c)) for w, c in zip(widths, row)]

    def line(cells):
        out = []
        for k, (c, w) in enumerate(zip(cells, widths)):
            out.append(c.ljust(w) if k < 2 else c.rjust(w))
        return "  ".join(out).rstrip()

    lines = [line(headers), line(["-" * w for w in widths])]
    for b, block in enumerate(blocks):
        if b:
            lines.append("")
        lines.extend(line(row) for row in block)
    return "\n".join(lines)


def _env_lines(env, copy_bw, bench_ms):
    versions = (
        f"Python {env.get('python')} | torch {env.get('torch')} | triton {env.get('triton')} | "
        f"transformers {env.get('transformers')} | CUDA {env.get('cuda')} | "
        f"Liger-Kernel {env.get('liger_kernel') or NOT_INSTALLED} | "
        f"cut-cross-entropy {env.get('cut_cross_entropy') or NOT_INSTALLED}"
    )
    if ON_GPU:
        warmup, rep = bench_ms
        return [
            f"GPU: {env.get('gpu')}",
            f"Versions: {versions}",
            f"Date: {env.get('date')}",
            f"Device copy bandwidth: {copy_bw:,.0f} GB/s (1 GiB device-to-device copy, bytes read + written)",
            f"Timing: triton.testing.do_bench median, warm-up {warmup} ms excluded, rep {rep} ms, L2 flushed",
        ]
    return [
        "GPU: none -- CPU run, kernels execute in the Triton interpreter (TRITON_INTERPRET=1)",
        f"Versions: {versions}",
        f"Date: {env.get('date')}",
        "Device copy bandwidth: n/a (CPU)",
        "Timing: NONE. This CPU run checks that every provider runs and reports numerical error;",
        "        it measures no time and makes no performance claim. torch.compile and Liger-Kernel",
        "        are skipped on CPU (compiling is slow there and needs a C++ toolchain; Liger needs CUDA).",
    ]


def print_kernel(kernel_result, env, copy_bw):
    print()
    print(RULE)
    print(kernel_result["header"])
    print(RULE)
    gpu = env.get("gpu") if ON_GPU else "CPU (Triton interpreter, no timings)"
    copy = f"{copy_bw:,.0f} GB/s" if copy_bw else "n/a"
    print(f"GPU: {gpu} | torch {env.get('torch')} | triton {env.get('triton')} | copy bandwidth {copy}")
    print()
    print(format_table(kernel_result))
    print()
    for note in kernel_result["footnotes"]:
        print(note)
    print("%copy: effective bandwidth / device copy bandwidth measured at the start of this run.")
    print("ours x: the peer's latency / ours (above 1.00x: ours is faster).")
    compile_lines = [
        f"{r['label']} tokens: {(r['first_fwd_s'] or 0) + (r['first_fwdbwd_s'] or 0):.1f} s"
        for r in kernel_result["results"]
        if r["provider"].startswith("torch.compile") and r["first_fwd_s"] is not None
    ]
    if compile_lines:
        print("torch.compile first calls (fwd graph + training graph compile, per shape): " + ", ".join(compile_lines))
    # Every distinct error message once, with where it happened.
    seen = {}
    for r in kernel_result["results"]:
        for m in r["messages"]:
            labels = seen.setdefault((r["provider"], m), [])
            if r["label"] not in labels:
                labels.append(r["label"])
    for (prov, m), labels in seen.items():
        text = m if len(m) <= 400 else m[:400] + " ..."
        print(f"ERR {prov} ({', '.join(labels)} tokens): {text}")


def plot_results(results, path):
    """Grouped bars of effective bandwidth: one panel per kernel and pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = list(results["kernels"].items())
    copy_bw = results["environment"].get("copy_bandwidth_GBps")
    fig, axes = plt.subplots(len(kernels), 2, figsize=(15, 4.8 * len(kernels)), squeeze=False)
    cmap = plt.get_cmap("tab10")
    # One color per kind of provider in every panel, whatever the panel's provider list.
    palette = {"ours (Triton": 0, "ours (in-place)": 9, "PyTorch eager": 1, "F.": 2, "torch.compile": 3,
               "Liger-Kernel": 4, "Apple cut-cross-entropy": 5}

    def color(prov, k):
        for prefix, index in palette.items():
            if prov.startswith(prefix):
                return cmap(index)
        return cmap((6 + k) % 10)

    for row, (_, kres) in enumerate(kernels):
        providers = kres["providers"]
        labels = []
        for rec in kres["results"]:
            if rec["label"] not in labels:
                labels.append(rec["label"])
        lookup = {(r["label"], r["provider"]): r for r in kres["results"]}
        width = 0.8 / max(len(providers), 1)
        unit = kres.get("rate_unit", "GB/s")
        line_at = copy_bw if unit == "GB/s" else None  # the copy bandwidth is a bandwidth
        for col, p in enumerate(PASSES):
            ax = axes[row][col]
            drawn = False
            top = max([line_at or 0.0] + [_rate(r, p) or 0.0 for r in kres["results"]])
            for k, prov in enumerate(providers):
                xs, ys = [], []
                for i, label in enumerate(labels):
                    rec = lookup.get((label, prov))
                    x = i - 0.4 + width * (k + 0.5)
                    value = rec and _rate(rec, p)
                    if value:
                        xs.append(x)
                        ys.append(value)
                    elif rec and top > 0:
                        # Say why there is no bar (OOM, ERR, not installed, ...).
                        ax.text(x, top * 0.02, str(rec[f"{p}_status"]), rotation=90, ha="center",
                                va="bottom", fontsize=7, color="dimgray")
                ax.bar(xs, ys, width, label=prov, color=color(prov, k))
                drawn = drawn or bool(ys)
            if line_at:
                ax.axhline(line_at, color="black", linestyle="--", linewidth=1,
                           label=f"device copy {line_at:,.0f} GB/s")
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels)
            ax.set_xlabel("tokens")
            ax.set_ylabel("effective bandwidth (GB/s)" if unit == "GB/s" else unit)
            ax.set_title(f"{kres['title']} {PASS_LABEL[p]}")
            if drawn:
                ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
                ax.legend(fontsize=7, loc="upper left", ncol=2)
            else:
                ax.set_yticks([])
                ax.text(0.5, 0.5, "no timings (CPU / Triton interpreter run)", transform=ax.transAxes,
                        ha="center", va="center", fontsize=11, color="dimgray")
    env = results["environment"]
    fig.suptitle(
        f"{env.get('gpu')} | torch {env.get('torch')} | triton {env.get('triton')} | {env.get('date')}"
        " -- higher is better"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # leave the top strip to the suptitle
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", nargs="+", choices=[*KERNELS, "all"], default=["all"],
                        help="which kernels to benchmark (one or more, or all)")
    parser.add_argument("--json", metavar="PATH", help="write every number and the environment to this file")
    parser.add_argument("--plot", metavar="PATH.png", help="draw effective bandwidth per provider and size")
    parser.add_argument("--quick", action="store_true",
                        help="short run: fewer shapes and repetitions (CPU: tiny shapes, no timings)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-from", metavar="JSON",
                        help="measure nothing: redraw --plot from the JSON of an earlier run")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.plot_from:
        if not args.plot:
            raise SystemExit("error: --plot-from needs --plot PATH.png (where to draw)")
        with open(args.plot_from) as f:
            results = json.load(f)
        plot_results(results, args.plot)
        print(f"Wrote {args.plot} from {args.plot_from}")
        return results
    started = time.perf_counter()
    bench_ms = QUICK_BENCH_MS if args.quick else FULL_BENCH_MS
    names = list(KERNELS) if "all" in args.kernel else list(dict.fromkeys(args.kernel))

    env = dict(environment_info())
    env["liger_kernel"] = _liger_version()
    env["cut_cross_entropy"] = _version("cut-cross-entropy")
    copy_bw = measure_copy_bandwidth(bench_ms) if ON_GPU else None
    env["copy_bandwidth_GBps"] = copy_bw

    print(RULE)
    print("Kernel benchmark -- ours (Triton) vs PyTorch eager, PyTorch native, torch.compile, Liger-Kernel, cut-cross-entropy")
    print(RULE)
    for line in _env_lines(env, copy_bw, bench_ms):
        print(line)

    results = {
        "environment": env,
        "settings": {
            "quick": args.quick,
            "dtype": str(DTYPE).replace("torch.", ""),
            "timing": "triton.testing.do_bench median" if ON_GPU else "none (CPU, Triton interpreter)",
            "warmup_ms": bench_ms[0] if ON_GPU else None,
            "rep_ms": bench_ms[1] if ON_GPU else None,
            "seed": args.seed,
            "fwd": "forward only, torch.no_grad(), inputs not requiring grad",
            "fwdbwd": "forward with autograd + torch.autograd.grad (upstream gradient: random for RMSNorm, 1.0 for the scalar loss)",
        },
        "kernels": {},
    }
    for name in names:
        kernel_result = run_kernel(KERNELS[name], args.quick, bench_ms, copy_bw, args.seed)
        results["kernels"][name] = kernel_result
        print_kernel(kernel_result, env, copy_bw)

    results["total_s"] = time.perf_counter() - started
    print()
    print(f"Total time: {results['total_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_json_safe(results), f, indent=2)
        print(f"Wrote {args.json}")
    if args.plot:
        plot_results(results, args.plot)
        print(f"Wrote {args.plot}")
    return results


def _json_safe(value):
    """Plain JSON: NaN/inf become strings, anything unknown its str()."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


if __name__ == "__main__":
    main()
