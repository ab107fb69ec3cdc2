"""
The benchmark's peers that are not PyTorch itself: what our kernels are measured against.

What a peer is
--------------
A kernel is fast only compared to something. benchmark_kernels.py runs every kernel of this
project next to the other ways of computing the same thing, its *peers*, on the same inputs.
PyTorch's own peers (eager in the Hugging Face formulation, the native op, ``torch.compile``)
come with PyTorch and are built in benchmark_kernels.py. The others live here:

* Liger-Kernel (package ``liger-kernel``): Triton kernels for the same LLaMA operations
  (RMSNorm, cross-entropy, SwiGLU, RoPE, linear + cross-entropy), the library a fine-tuning
  run would install instead of writing its own (finetune_baseline.py --liger). If ours are not
  at least as good, the lesson is "install Liger".
* Apple's cut-cross-entropy (package ``cut-cross-entropy``): the LM head and the loss without
  ever materializing the logits, the other published answer to their memory. It is the peer
  of our linear + cross-entropy.
* The playbook design: the one-row-per-program RMSNorm and cross-entropy the playbook starts
  from. Its code is not a package to import, so it is written out below from the playbook's
  description. It shows what our kernels' design choices are worth over the first working
  Triton version (rmsnorm_kernel.py and cross_entropy_kernel.py say what they change).

Optional packages, declared as data
-----------------------------------
``NEEDS`` maps each provider to the package it needs. ``unavailable(provider)`` says why a row
cannot run here (``not installed``; or ``skipped (CPU)``, since their kernels are Triton kernels
for CUDA), and the benchmark prints that word in the row's cells instead of failing. The
packages are imported only when their row runs (``liger``), so the benchmark runs without them;
``version`` records which version was measured.

Triton concepts the playbook design shows (see rmsnorm_kernel.py for the basics)
--------------------------------------------------------------------------------
* One program per row: the grid is ``(rows,)``, ``tl.program_id(0)`` picks the row, and the
  whole row sits in registers (``BLOCK`` = the next power of two >= the row, tail masked).
* A reduction across rows done outside the kernel: the RMSNorm backward stores every row's
  weight-gradient term to a [rows, H] float32 buffer, and torch sums it (ours keeps per-program
  partial sums instead).
* A loop inside one program carrying state (online softmax: a running maximum and a rescaled
  sum), for rows too long for registers; 64-bit row offsets (rows x V passes 2**31).
* A device value steering a kernel without the host: the upstream gradient's scale is read with
  ``tl.load``, so the backward needs no ``.item()`` and can be captured in a CUDA graph.
* ``torch.autograd.Function``: forward launches one kernel and saves what backward needs;
  backward launches the other (here the cross-entropy backward streams the logits again,
  where ours writes the gradient in the forward launch).

Nothing runs on import.
"""

import importlib
import importlib.metadata
import logging

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)

import torch
import triton
import triton.language as tl

SKIPPED_CPU, NOT_INSTALLED = "skipped (CPU)", "not installed"
# Peers that need a package besides PyTorch: provider -> package. Their kernels are Triton
# kernels for CUDA, so on CPU they are skipped even when installed.
NEEDS = {"Liger-Kernel": "liger-kernel", "Liger-Kernel FLCE": "liger-kernel",
         "Apple cut-cross-entropy": "cut-cross-entropy"}


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# Peers in PyTorch itself that need a GPU here (FlexAttention compiles to Triton kernels for CUDA).
CUDA_ONLY = {"FlexAttention (compiled)"}


def unavailable(provider):
    """None when ``provider`` can run here, else the word its cells show instead."""
    if provider in CUDA_ONLY:
        return None if torch.cuda.is_available() else SKIPPED_CPU
    if provider not in NEEDS:
        return None
    if version(NEEDS[provider]) is None:
        return NOT_INSTALLED
    return None if torch.cuda.is_available() else SKIPPED_CPU


# --- Liger-Kernel and cut-cross-entropy: each a make_op() -> op(*args) -----------------
def liger(module, name):
    """A Liger-Kernel op, imported only when its row runs (the package is optional)."""
    # Liger logs a warning for every optional backend it cannot import: noise here.
    logging.getLogger("liger_kernel").setLevel(logging.ERROR)
    return getattr(importlib.import_module(module), name)


def liger_rmsnorm(eps):
    fn = liger("liger_kernel.ops.rms_norm", "LigerRMSNormFunction").apply
    # X, W, eps, offset, casting_mode, in_place: the defaults of LigerRMSNorm, the module
    # Liger's LLaMA patch installs (HF's casting order; dx written into the dy buffer).
    return lambda x, w: fn(x, w, eps, 0.0, "llama", True)


def liger_cross_entropy():
    return liger("liger_kernel.transformers", "LigerCrossEntropyLoss")(reduction="mean")


def liger_swiglu():
    return liger("liger_kernel.ops.swiglu", "LigerSiLUMulFunction").apply


def liger_rope():
    return liger("liger_kernel.transformers.rope", "liger_rotary_pos_emb")


def liger_flce():
    loss = liger("liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss")(ignore_index=-100, reduction="mean")
    return lambda hidden, weight, targets: loss(weight, hidden, targets)  # Liger takes the weight first


def cut_cross_entropy():
    # (hidden, weight, targets) with its defaults: the "cce" kernels, mean.
    return importlib.import_module("cut_cross_entropy").linear_cross_entropy


# --- Compiled peers ---------------------------------------------------------------------
def compiled(fn, backend=None):
    """torch.compile of ``fn``, built afresh for every shape (dynamic=False: one static graph per
    shape, and the compile time printed under the table is that shape's). Without the reset and
    dynamic=False, the second shape a compiled function meets is compiled again with dynamic
    shapes (torch.compile's automatic dynamic), slower code than a training run of fixed shapes
    gets. backend: on CPU "aot_eager" by default (traced and differentiated, no C++ toolchain
    needed), else "inductor"."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, backend=backend or ("inductor" if torch.cuda.is_available()
                                                                  else "aot_eager"))


# --- FlexAttention: PyTorch's compiled attention with a block mask ---------------------
def flex_document_attention():
    """op(q, k, v, doc_start) -> [B, T, Hq, D]: FlexAttention with a document mask. Its
    BlockMask (which key tiles each query tile needs) is built on the first call for that
    doc_start and reused, as a training loop would reuse it for a batch. Compiled for each
    shape on its own (``compiled``), always by Inductor (FlexAttention's kernels are its own)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend = compiled(flex_attention, backend="inductor")
    cache = {}

    def op(q, k, v, doc_start):
        if id(doc_start) not in cache:
            B, T = doc_start.shape
            start = doc_start.long()

            def document_causal(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) & (kv_idx >= start[b, q_idx])
            cache[id(doc_start)] = create_block_mask(document_causal, B, None, T, T, device=q.device)
        return attend(q, k, v, block_mask=cache[id(doc_start)], enable_gqa=True).transpose(1, 2)
    return op


# --- The playbook's design, as a peer --------------------------------------------------
# The kernels the playbook starts from, written here from its description (its own code is not
# a package to import): one program per row, forward and backward; the RMSNorm backward writes
# every row's weight-gradient term to a [N, H] float32 buffer and sums it with torch; the
# cross-entropy forward streams the vocabulary in chunks with an online softmax, and its backward
# streams it again to write the gradient. Python-launched like ours, so the eager columns compare
# launch paths too.
@triton.jit
def _playbook_rmsnorm_fwd(X, W, Y, RSTD, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = (x * rstd).to(X.dtype.element_ty).to(tl.float32) * w
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _playbook_rmsnorm_bwd(DY, X, W, RSTD, DX, DW_ROWS, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    x_hat = x * rstd
    g = dy * w
    dx = (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols)) * rstd
    tl.store(DX + row * n_cols + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_ROWS + row * n_cols + cols, dy * x_hat, mask=mask)


class PlaybookRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y, rstd = torch.empty_like(x2), torch.empty(x2.shape[0], device=x.device, dtype=torch.float32)
        block = triton.next_power_of_2(x2.shape[1])
        _playbook_rmsnorm_fwd[(x2.shape[0],)](x2, w, y, rstd, x2.shape[1], eps, BLOCK=block)
        ctx.save_for_backward(x2, w, rstd)
        return y.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).contiguous()
        dx, dw_rows = torch.empty_like(x2), torch.empty(x2.shape, device=x2.device, dtype=torch.float32)
        block = triton.next_power_of_2(x2.shape[1])
        _playbook_rmsnorm_bwd[(x2.shape[0],)](dy2, x2, w, rstd, dx, dw_rows, x2.shape[1], BLOCK=block)
        return dx.view_as(dy), dw_rows.sum(0).to(w.dtype), None


def playbook_rmsnorm(eps):
    return lambda x, w: PlaybookRMSNorm.apply(x, w, eps)


@triton.jit
def _playbook_ce_fwd(LOGITS, TARGETS, LOSS, LSE, n_vocab, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * n_vocab
    m = -float("inf")
    total = 0.0
    for start in range(0, n_vocab, BLOCK):  # online softmax: running max and rescaled sum
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_vocab, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(total)
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    x_t = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
    tl.store(LSE + row, lse)


@triton.jit
def _playbook_ce_bwd(LOGITS, TARGETS, LSE, GRAD, SCALE, n_vocab, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * n_vocab
    target = tl.load(TARGETS + row)
    lse = tl.load(LSE + row)
    g = tl.where(target != ignore_index, tl.load(SCALE), 0.0)
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_vocab
        x = tl.load(LOGITS + base + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
        tl.store(GRAD + base + cols, (p * g).to(GRAD.dtype.element_ty), mask=mask)


class PlaybookCrossEntropy(torch.autograd.Function):
    BLOCK = 4096

    @staticmethod
    def forward(ctx, logits, targets):
        n, v = logits.shape
        loss, lse = (torch.empty(n, device=logits.device, dtype=torch.float32) for _ in range(2))
        _playbook_ce_fwd[(n,)](logits, targets, loss, lse, v, -100, BLOCK=PlaybookCrossEntropy.BLOCK)
        n_valid = (targets != -100).sum()
        ctx.save_for_backward(logits, targets, lse, n_valid)
        return loss.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, lse, n_valid = ctx.saved_tensors
        grad = torch.empty_like(logits)
        scale = (grad_loss.float() / n_valid).reshape(1)  # read on the device: no host sync
        _playbook_ce_bwd[(logits.shape[0],)](logits, targets, lse, grad, scale, logits.shape[1], -100,
                                              BLOCK=PlaybookCrossEntropy.BLOCK)
        return grad, None
