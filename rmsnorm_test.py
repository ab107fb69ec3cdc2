"""
Step 6 -- Correctness tests for the fused RMSNorm (rmsnorm_kernel.py).

Every comparison is against a float64 truth (the HF formula evaluated in
float64): our y, dx and dw must be no worse than about twice the error of the
PyTorch path (HF ``LlamaRMSNorm`` in eager mode) at the same dtype, for
irregular sizes, every dtype, strided inputs and the module swap in a LLaMA.
The Gemma variant (scale ``1 + weight``, float32 product, cast last) gets the
same checks against Gemma's formula and HF's ``GemmaRMSNorm`` itself, and the
swap is checked in a tiny Gemma; a norm that computes anything else is refused
(swap_common.SwapMismatch) and leaves the model as it was.
Without a GPU the kernels run in the Triton interpreter and the GPU-only tests
(64-bit offsets, CUDA graphs, determinism) are skipped.

Usage:
    python rmsnorm_test.py          # or: python -m pytest rmsnorm_test.py
"""

import copy
import sys

import pytest
import torch

from conftest import DEVICE, DTYPES, check_outputs, need_gpu, rel_err
from swap_common import SwapMismatch
from rmsnorm_kernel import (
    GEMMA,
    LLAMA,
    MAX_HIDDEN_SIZE,
    TritonRMSNorm,
    check_same_rmsnorm,
    rmsnorm,
    rmsnorm_reference,
    replace_rmsnorm,
)

EPS = 1e-6


def make_inputs(shape, dtype, seed=0, weight_dtype=None, formula=LLAMA):
    """Random input, random non-unit weight and a random upstream gradient.

    The weight is stored as the formula stores it: for Gemma the offset from 1
    (random around 0), so the scale 1 + w is as far from 1 as LLaMA's weight.
    """
    weight_offset, cast_first = formula
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    x = (torch.randn(shape, generator=g) * 2.0 + 0.3).to(dtype)
    w = (1.0 - weight_offset + 0.5 * torch.randn(hidden, generator=g)).to(weight_dtype or dtype)
    y_dtype = torch.promote_types(dtype, w.dtype) if cast_first else dtype
    dy = torch.randn(shape, generator=g).to(y_dtype)
    return x.to(DEVICE), w.to(DEVICE), dy.to(DEVICE)


def run_ours(x, w, dy, formula=LLAMA):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = rmsnorm(x, w, EPS, *formula)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def run_torch(x, w, dy, compute_dtype=torch.float32, formula=LLAMA):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = rmsnorm_reference(x, w, EPS, compute_dtype, *formula)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, w.grad


def compare_to_truth(x, w, dy, formula=LLAMA):
    """Ours and PyTorch against float64 for y, dx, dw: ours no worse than ~2x."""
    ours = run_ours(x, w, dy, formula)
    torch_path = run_torch(x, w, dy, formula=formula)
    truth = run_torch(x.double(), w.double(), dy.double(), torch.float64, formula)
    check_outputs(("y", "dx", "dw"), ours, torch_path, truth, x.dtype)


# (shape, dtype): irregular hidden sizes, 1 and 7 rows, every dtype, many short
# rows (several rows per program) and a 3-D [batch, seq, hidden] input.
CASES = [
    pytest.param((7, 41), "fp32", id="fp32 7x41"),
    pytest.param((1, 4097), "fp32", id="fp32 1x4097"),
    pytest.param((2, 3, 123), "fp32", id="fp32 2x3x123"),
    pytest.param((7, 123), "bf16", id="bf16 7x123"),
    pytest.param((1, 4097), "bf16", id="bf16 1x4097"),
    pytest.param((300, 64), "bf16", id="bf16 300x64 (many rows/program)"),
    pytest.param((4, 4096), "bf16", id="bf16 4x4096 (LLaMA hidden)"),
    # The backward steps over 4 rows at a time at this width: a last step of one row.
    pytest.param((9, 4096), "bf16", id="bf16 9x4096 (backward: partial last step)"),
    pytest.param((7, 4097), "fp16", id="fp16 7x4097"),
    pytest.param((5, 41), "fp16", id="fp16 5x41"),
]


@pytest.mark.parametrize("shape,dtype", CASES)
def test_matches_float64_truth(shape, dtype):
    compare_to_truth(*make_inputs(shape, DTYPES[dtype]))


def test_fp32_weight_on_bf16_input():
    # A float32 weight on bf16 activations: HF promotes the product to float32.
    x, w, dy = make_inputs((5, 123), torch.bfloat16, weight_dtype=torch.float32)
    compare_to_truth(x, w, dy)
    assert rmsnorm(x, w).dtype == torch.float32


def test_non_contiguous_input_and_grad():
    # Input and upstream gradient as strided views (every other row / a column slice).
    x, w, dy = make_inputs((14, 200), torch.bfloat16)
    xs = x[::2, :123]
    dys = dy[::2, :123].t().contiguous().t()  # column-major: stride(-1) != 1
    ws = w[:123].contiguous()
    assert not xs.is_contiguous() and not dys.is_contiguous()
    compare_to_truth(xs, ws, dys)


@pytest.mark.parametrize("layout", ["column of a matrix", "expanded scalar"])
def test_weight_of_any_layout(layout):
    x, w, dy = make_inputs((7, 123), torch.float32)
    if layout == "column of a matrix":
        w = torch.stack([w, -w, 2 * w], dim=1)[:, 0]  # stride 3
    else:
        w = w[:1].expand(123)  # stride 0: one value read 123 times
    assert not w.is_contiguous()
    compare_to_truth(x, w, dy)


def test_create_graph_is_refused():
    x, w, _ = make_inputs((3, 41), torch.float32)
    x.requires_grad_()
    y = rmsnorm(x, w, EPS)
    with pytest.raises(RuntimeError, match="rmsnorm: create_graph=True"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_forward_under_no_grad():
    x, w, _ = make_inputs((7, 123), torch.float32)
    with torch.no_grad():
        y = rmsnorm(x, w, EPS)
    assert not y.requires_grad
    ref = rmsnorm_reference(x.double(), w.double(), EPS, torch.float64)
    err = rel_err(y, ref)
    assert err < 1e-6, f"no_grad forward error {err:.2e}"


def test_frozen_weight_gives_dx_only():
    # Frozen weight (e.g. LoRA): dw is skipped, dx still right.
    x, w, dy = make_inputs((7, 123), torch.float32)
    xg = x.detach().requires_grad_()
    y = rmsnorm(xg, w, EPS)
    y.backward(dy)
    assert w.grad is None
    xr = x.double().requires_grad_()
    rmsnorm_reference(xr, w.double(), EPS, torch.float64).backward(dy.double())
    err = rel_err(xg.grad, xr.grad)
    assert err < 1e-5, f"dx error {err:.2e}"


def test_bad_inputs_raise():
    x, w, _ = make_inputs((4, 32), torch.float32)
    with pytest.raises(ValueError, match="does not match the hidden size"):
        rmsnorm(x, w[:31])
    with pytest.raises(TypeError, match="unsupported input dtype"):
        rmsnorm(x.double(), w)
    with pytest.raises(TypeError, match="unsupported input dtype"):
        rmsnorm(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="same device"):
        rmsnorm(x, w.to("meta"))
    with pytest.raises(ValueError, match="exceeds the supported maximum"):
        rmsnorm(torch.empty(1, MAX_HIDDEN_SIZE + 1, device=DEVICE), torch.empty(MAX_HIDDEN_SIZE + 1, device=DEVICE))
    with pytest.raises(ValueError, match="eps must be"):
        rmsnorm(x, w, eps=-1.0)


def test_from_llama_rmsnorm_shares_parameter():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(123, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        hf.weight.mul_(torch.linspace(0.5, 1.5, 123, device=DEVICE))
    ours = TritonRMSNorm.from_llama_rmsnorm(hf)
    assert ours.weight is hf.weight, "from_llama_rmsnorm must reuse the same Parameter object"
    assert ours.variance_epsilon == 1e-5
    x, _, _ = make_inputs((3, 123), torch.float32)
    err = rel_err(ours(x), hf(x))
    assert err < 1e-6, f"module output differs from LlamaRMSNorm by {err:.2e}"
    fresh = TritonRMSNorm(41, eps=1e-6)
    assert fresh.weight.shape == (41,) and fresh.variance_epsilon == 1e-6


def test_replace_rmsnorm_in_llama_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1.0 + 0.3 * torch.randn_like(p))
    ids = torch.randint(0, 257, (2, 16), device=DEVICE)
    with torch.no_grad():
        before = model(ids).logits
    count = replace_rmsnorm(model)
    assert count == 2 * 2 + 1, f"replaced {count}, expected 5 (2 per layer + final norm)"
    assert sum(isinstance(m, TritonRMSNorm) for m in model.modules()) == 5
    assert replace_rmsnorm(model) == 0, "a second pass must find nothing left to replace"
    with torch.no_grad():
        after = model(ids).logits
    err = rel_err(after, before)
    assert err < 1e-5, f"patched model output differs by {err:.2e}"


# ---------------------------------------------------------------- Gemma's formula
# GemmaRMSNorm: (h * (1 + weight.float())).to(x.dtype). The weight is an offset
# from 1 and the product stays float32 until the one cast at the end.
@pytest.mark.parametrize("shape,dtype", CASES)
def test_gemma_matches_float64_truth(shape, dtype):
    compare_to_truth(*make_inputs(shape, DTYPES[dtype], formula=GEMMA), formula=GEMMA)


def test_gemma_fp32_weight_on_bf16_input_returns_bf16():
    # Gemma casts to x's dtype (type_as(x)) whatever the weight's: no promotion.
    x, w, dy = make_inputs((5, 123), torch.bfloat16, weight_dtype=torch.float32, formula=GEMMA)
    compare_to_truth(x, w, dy, formula=GEMMA)
    assert rmsnorm(x, w, EPS, *GEMMA).dtype == torch.bfloat16


def test_gemma_non_contiguous_input_and_grad():
    x, w, dy = make_inputs((14, 200), torch.float16, formula=GEMMA)
    xs, dys = x[::2, :123], dy[::2, :123].t().contiguous().t()
    assert not xs.is_contiguous() and not dys.is_contiguous()
    compare_to_truth(xs, w[:123].contiguous(), dys, formula=GEMMA)


def test_gemma_forward_under_no_grad_and_frozen_weight():
    x, w, dy = make_inputs((7, 123), torch.float32, formula=GEMMA)
    with torch.no_grad():
        y = rmsnorm(x, w, EPS, *GEMMA)
    assert not y.requires_grad
    truth = rmsnorm_reference(x.double(), w.double(), EPS, torch.float64, *GEMMA)
    assert rel_err(y, truth) < 1e-6, f"no_grad forward error {rel_err(y, truth):.2e}"
    # Frozen weight: dx only, and it sees the scale 1 + w.
    xg = x.detach().requires_grad_()
    rmsnorm(xg, w, EPS, *GEMMA).backward(dy)
    assert w.grad is None
    xr = x.double().requires_grad_()
    rmsnorm_reference(xr, w.double(), EPS, torch.float64, *GEMMA).backward(dy.double())
    assert rel_err(xg.grad, xr.grad) < 1e-5, f"dx error {rel_err(xg.grad, xr.grad):.2e}"


def test_weight_offset_must_be_finite():
    x, w, _ = make_inputs((4, 32), torch.float32)
    with pytest.raises(ValueError, match="weight_offset must be a finite number"):
        rmsnorm(x, w, EPS, float("nan"), False)


def _gemma_norm_classes():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    return GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm


@pytest.mark.parametrize("shape,dtype", [("7x123", "fp32"), ("2x3x4097", "bf16"), ("5x41", "fp16")])
@pytest.mark.parametrize("cls", [0, 1, 2], ids=["GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"])
def test_gemma_module_matches_hf_module(cls, shape, dtype):
    # HF's module itself as the peer: y, dx and dw against the float64 truth.
    cls = _gemma_norm_classes()[cls]
    shape, dtype = tuple(int(n) for n in shape.split("x")), DTYPES[dtype]
    x, w, dy = make_inputs(shape, dtype, formula=GEMMA)
    hf = cls(shape[-1], eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
    ours = TritonRMSNorm.from_gemma_rmsnorm(hf)
    assert ours.weight is hf.weight, "from_gemma_rmsnorm must reuse the same Parameter object"
    assert ours.eps == ours.variance_epsilon == 1e-5
    outputs = []
    for module in (ours, hf):
        xg = x.detach().requires_grad_()
        y = module(xg)
        y.backward(dy)
        outputs.append((y.detach(), xg.grad, hf.weight.grad.clone()))
        hf.weight.grad = None
    xt, wt = x.double().requires_grad_(), w.double().requires_grad_()
    yt = rmsnorm_reference(xt, wt, 1e-5, torch.float64, *GEMMA)
    yt.backward(dy.double())
    check_outputs(("y", "dx", "dw"), outputs[0], outputs[1], (yt.detach(), xt.grad, wt.grad), dtype,
                  peer_name=cls.__name__)
    if dtype != torch.float32:
        # Rounded where HF rounds: the same y up to a rare last-bit difference. (The
        # error rule above cannot see the order of the roundings: LLaMA's cast-first
        # order is as accurate, and changes about a quarter of bf16 values.)
        differing = (outputs[0][0] != outputs[1][0]).double().mean().item()
        assert differing <= 0.01, f"{differing:.1%} of y differ from {cls.__name__}'s"
    with torch.no_grad():  # and under no_grad
        err = rel_err(ours(x), yt)
        assert err < {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype], err


def test_from_hf_rmsnorm_reads_the_formula():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    gemma_cls = _gemma_norm_classes()[0]
    llama, gemma = TritonRMSNorm.from_hf_rmsnorm(LlamaRMSNorm(41)), TritonRMSNorm.from_hf_rmsnorm(gemma_cls(41))
    assert (llama.weight_offset, llama.cast_first) == LLAMA and (gemma.weight_offset, gemma.cast_first) == GEMMA
    assert "weight_offset=1.0" in repr(gemma) and "weight_offset" not in repr(llama)
    fresh = TritonRMSNorm(41, eps=1e-6, weight_offset=1.0, cast_first=False)
    assert torch.equal(fresh.weight, torch.zeros(41)), "Gemma's identity scale is a zero weight"
    with pytest.raises(TypeError, match="not an RMSNorm module"):
        TritonRMSNorm.from_hf_rmsnorm(torch.nn.LayerNorm(41))


def _tiny_gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = GemmaForCausalLM(cfg).to(DEVICE)
    with torch.no_grad():  # Gemma's norms start at 0 (scale 1): give each its own scales
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    (logits.float() ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_replace_rmsnorm_in_gemma_model():
    model = _tiny_gemma()
    ids = torch.randint(0, 512, (2, 16), device=DEVICE)
    before, grads_before = _logits_and_grads(model, ids)
    weights = {n: p for n, p in model.named_parameters() if "norm" in n}
    count = replace_rmsnorm(model)
    assert count == 2 * 2 + 1, f"replaced {count}, expected 5 (2 per layer + final norm)"
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 5 and all(isinstance(m, TritonRMSNorm) for m in norms)
    assert all((m.weight_offset, m.cast_first) == GEMMA for m in norms)
    assert all(p is weights[n] for n, p in model.named_parameters() if "norm" in n), "Parameters must be shared"
    assert replace_rmsnorm(model) == 0, "a second pass must find nothing left to replace"
    after, grads_after = _logits_and_grads(model, ids)
    err = rel_err(after, before)
    assert err < 1e-5, f"patched model output differs by {err:.2e}"
    assert grads_after.keys() == grads_before.keys()
    for name, g in grads_before.items():
        err = rel_err(grads_after[name], g)
        assert err < 1e-5, f"gradient of {name} differs by {err:.2e}"


# ---------------------------------------------------------------- the swap check
def _tiny_llama(device=DEVICE):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def _plus_one_norm_class():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class PlusOneRMSNorm(LlamaRMSNorm):
        """Looks like LLaMA's (name, weight, variance_epsilon) and adds 1 to the result."""

        def forward(self, hidden_states):
            return super().forward(hidden_states) + 1.0

    return PlusOneRMSNorm


def test_norm_that_computes_something_else_is_refused():
    model = _tiny_llama()
    bad_cls = _plus_one_norm_class()
    layer = model.model.layers[1]
    bad = bad_cls(64, eps=layer.post_attention_layernorm.variance_epsilon).to(DEVICE)
    bad.weight = layer.post_attention_layernorm.weight
    layer.post_attention_layernorm = bad
    modules = dict(model.named_modules())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    with pytest.raises(SwapMismatch, match=r"^PlusOneRMSNorm computes something else than TritonRMSNorm "
                                           r"\(max difference .* on a random float32 input\)$"):
        replace_rmsnorm(model)
    # Nothing swapped (the good LlamaRMSNorms neither), no weight touched, no random number drawn.
    assert dict(model.named_modules()) == modules
    assert not any(isinstance(m, TritonRMSNorm) for m in model.modules())
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng), "the check must not advance the global random stream"


def test_check_catches_offset_and_cast_order():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    gemma_cls = _gemma_norm_classes()[0]

    # LLaMA's formula on Gemma's module: the scale w instead of 1 + w. The module
    # holds zeros: the check's own random weight shows the difference anyway.
    gemma = gemma_cls(123).to(DEVICE)
    with pytest.raises(SwapMismatch, match="GemmaRMSNorm computes something else"):
        check_same_rmsnorm(gemma, TritonRMSNorm.from_hf_rmsnorm(gemma, *LLAMA))
    check_same_rmsnorm(gemma, TritonRMSNorm.from_hf_rmsnorm(gemma, *GEMMA))
    # Gemma's formula on LLaMA's module, in bf16: another offset and another cast order.
    llama = LlamaRMSNorm(123).to(DEVICE, torch.bfloat16)
    check_same_rmsnorm(llama, TritonRMSNorm.from_hf_rmsnorm(llama, *LLAMA))
    with pytest.raises(SwapMismatch, match="LlamaRMSNorm computes something else"):
        check_same_rmsnorm(llama, TritonRMSNorm.from_hf_rmsnorm(llama, *GEMMA))
    # OLMo-2 names its epsilon as LLaMA does but casts last, as Gemma does, with no
    # offset: the same numbers in float32, a quarter of the values one unit apart
    # in bf16 -- the swap goes in for the first and is refused for the second.
    olmo = torch.nn.ModuleList([Olmo2RMSNorm(123)]).to(DEVICE)
    assert replace_rmsnorm(copy.deepcopy(olmo)) == 1
    with pytest.raises(SwapMismatch, match=r"Olmo2RMSNorm computes something else .* of the values on a random "
                                           r"bfloat16 input"):
        replace_rmsnorm(olmo.to(torch.bfloat16))
    # A float64 module: the kernel does not run it, the swap is refused.
    with pytest.raises(SwapMismatch, match="cannot stand in for LlamaRMSNorm: .*unsupported input dtype"):
        replace_rmsnorm(torch.nn.ModuleList([LlamaRMSNorm(41)]).to(DEVICE, torch.float64))


def test_meta_model_is_swapped_unchecked():
    # A model built on the meta device (--fsdp) has no values to run: the swap
    # goes in without the check, and nothing is launched.
    model = _tiny_llama("meta")
    assert replace_rmsnorm(model) == 5
    assert all(m.weight.is_meta for m in model.modules() if isinstance(m, TritonRMSNorm))


# ---------------------------------------------------------------- torch.compile
def test_gemma_operator_and_compiled_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    x, w, dy = make_inputs((7, 41), torch.bfloat16, formula=GEMMA)
    ops = torch.ops.llama_kernels
    x, w = x.requires_grad_(), w.requires_grad_()
    torch.library.opcheck(ops.rmsnorm_forward, (x, w, EPS, 1.0, False))
    torch.library.opcheck(ops.rmsnorm_backward, (dy, x.detach(), w.detach(), torch.rand(7, device=DEVICE), True, 1.0))

    def loss(x, w):
        return (rmsnorm(x, w, EPS, *GEMMA).float() * dy.float()).sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor" if DEVICE.type == "cuda" else "aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    eager = (loss(x, w), *torch.autograd.grad(loss(x, w), (x, w)))
    graph = (compiled(x, w), *torch.autograd.grad(compiled(x, w), (x, w)))
    for name, a, b in zip(("loss", "dx", "dw"), graph, eager):
        torch.testing.assert_close(a, b, msg=f"compiled {name} differs from eager")
    assert counter.frame_count == 1


# ---------------------------------------------------------------- GPU only
def test_int64_offsets():
    need_gpu()
    # 524,800 x 4,096 = 2.15e9 elements > 2**31: int32 offsets would wrap.
    rows, hidden = 524_800, 4096
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (1.0 + 0.5 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    y = rmsnorm(x, w, EPS)
    dy = torch.randn_like(y)
    y.backward(dy)
    tail = slice(rows - 1024, rows)  # the rows beyond 2**31 elements
    xt = x.detach()[tail].double().requires_grad_()
    wt = w.detach().double().requires_grad_()
    yt = rmsnorm_reference(xt, wt, EPS, torch.float64)
    yt.backward(dy[tail].double())
    e_y, e_dx = rel_err(y[tail], yt), rel_err(x.grad[tail], xt.grad)
    assert e_y < 1e-2 and e_dx < 1e-2, f"tail rows wrong: y {e_y:.2e} dx {e_dx:.2e}"
    # dw over all rows, against a float32 reduction done in PyTorch.
    x_hat = x.detach().float() * torch.rsqrt(x.detach().float().pow(2).mean(-1, keepdim=True) + EPS)
    dw_ref = (dy.float() * x_hat).sum(0)
    e_dw = rel_err(w.grad, dw_ref)
    assert e_dw < 1e-2, f"dw error {e_dw:.2e}"


def test_cuda_graph_capture():
    need_gpu()
    x, w, dy = make_inputs((256, 4096), torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up compiles the kernels outside the capture
        for _ in range(2):
            x.grad = w.grad = None
            rmsnorm(x, w, EPS).backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = rmsnorm(x, w, EPS)
        y.backward(dy)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    y_ref, dx_ref, dw_ref = run_ours(x, w, dy)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, dx_ref) and torch.equal(w.grad, dw_ref)


def test_bitwise_determinism():
    need_gpu()
    x, w, dy = make_inputs((16384, 4096), torch.bfloat16)
    a, b = run_ours(x, w, dy), run_ours(x, w, dy)
    assert all(torch.equal(p, q) for p, q in zip(a, b)), "two identical runs differ"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))
