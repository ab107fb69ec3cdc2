"""
Tests of lora_kernel.py (CPU; no Triton in it, the products are PyTorch's):

* a fused LoRA layer computes PEFT's output and the gradients of x, A and B, with
  and without a bias, to float64 rounding; in bf16 with float32 adapters under
  autocast, within bf16 rounding of the float64 truth, gradients in float32;
* every case it does not cover (dropout, DoRA, disabled or merged adapters, a
  trainable base weight, two active adapters) runs PEFT's own forward, bit for bit;
* fuse_lora routes each PEFT layer once, keeps the state dict, and the fine-tuning
  run with it has the losses of the run without it and of HF + PEFT.

Usage:
    python -m pytest lora_test.py -v
"""

import contextlib
import io

import pytest
import torch
import torch.nn as nn

from conftest import DEVICE  # first: the Triton interpreter switch

import finetune_baseline
import finetune_optimized
from lora_kernel import LoRALinearFunction, fuse_lora

peft = pytest.importorskip("peft")

K, N, R = 48, 40, 8
SMALL = ["--tiny", "--dataset", "synthetic", "--batch-size", "2", "--seq-len", "16", "--warmup-steps", "0",
         "--steps", "4", "--lora", "--lora-dropout", "0"]


class Block(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.proj = nn.Linear(K, N, bias=bias)

    def forward(self, x):
        return self.proj(x)


def lora_block(dtype=torch.float64, bias=True, seed=0, **config):
    """A PEFT model around one linear layer, B random (PEFT starts it at zero, where its
    gradient path would go untested)."""
    torch.manual_seed(seed)
    base = Block(bias).to(DEVICE, dtype)
    model = peft.get_peft_model(base, peft.LoraConfig(r=R, lora_alpha=16, target_modules=["proj"], **config))
    layer = model.base_model.model.proj
    with torch.no_grad():
        for p in layer.lora_B.default.parameters():
            p.normal_(0, 0.3)
    return model, layer


def run(model, x, autocast=None):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    ctx = torch.autocast(torch.device(DEVICE).type, dtype=autocast) if autocast else contextlib.nullcontext()
    with ctx:
        y = model(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE, y.dtype)
    y.backward(dy)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


@pytest.fixture
def calls(monkeypatch):
    """The projections of each call of the fused function (one for a single layer,
    several for projections_kernel.py's groups; one for a LoRA down_proj run by the MLP
    with its input made again in backward, swiglu_kernel.TritonSwiGLULoRADownFunction)."""
    import swiglu_kernel

    count = []
    real = LoRALinearFunction.forward
    real_down = swiglu_kernel.TritonSwiGLULoRADownFunction.forward

    def spy(ctx, x, dtype, scalings, fp8s, *params):
        count.append(len(scalings))
        return real(ctx, x, dtype, scalings, fp8s, *params)

    def spy_down(ctx, *args):
        count.append(1)
        return real_down(ctx, *args)

    monkeypatch.setattr(LoRALinearFunction, "forward", staticmethod(spy))
    monkeypatch.setattr(swiglu_kernel.TritonSwiGLULoRADownFunction, "forward", staticmethod(spy_down))
    return count


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_fused_layer_is_peft_in_float64(bias, calls):
    x = torch.randn(2, 5, K, dtype=torch.float64, device=DEVICE)
    model, _ = lora_block(bias=bias)
    want = run(model, x)
    assert fuse_lora(model) == 1
    got = run(model, x)
    assert calls == [1]
    for w, g in zip(want[:2], got[:2]):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert got[2].keys() == want[2].keys() == {"base_model.model.proj.lora_A.default.weight",
                                               "base_model.model.proj.lora_B.default.weight"}
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-12, atol=1e-12)


def test_bf16_with_float32_adapters_is_within_bf16_rounding():
    """The optimized script's setting: bf16 model, float32 adapters, autocast."""
    x = torch.randn(64, K, dtype=torch.float64, device=DEVICE)
    truth_model, _ = lora_block(torch.float64)
    truth = run(truth_model, x)
    model, layer = lora_block(torch.bfloat16)
    for p in layer.lora_A.default.parameters():
        p.data = p.data.to(torch.float32)
    for p in layer.lora_B.default.parameters():
        p.data = p.data.to(torch.float32)
    layer.lora_B.default.weight.data = truth_model.base_model.model.proj.lora_B.default.weight.data.float()
    layer.lora_A.default.weight.data = truth_model.base_model.model.proj.lora_A.default.weight.data.float()
    fuse_lora(model)
    y, dx, grads = run(model, x.to(torch.bfloat16), autocast=torch.bfloat16)
    assert y.dtype == dx.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads.values())
    # bf16 keeps 8 significant bits: each stored value within 2^-8 relative; the sums
    # over K = 48 products add independent roundings, so 2^-6 of the norm is the bound.
    for what, ours, want in (("y", y, truth[0]), ("dx", dx, truth[1]),
                             *((n, grads[n], truth[2][n]) for n in truth[2])):
        err = ((ours.double() - want).norm() / want.norm()).item()
        assert err <= 2**-6, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_is_fused_with_peft_own_random_draws(p, calls):
    """LoRA dropout: PEFT's own dropout module makes the adapter's input (same draws, same
    order), the fused products do the rest; float64 equal to PEFT's forward and backward."""
    x = torch.randn(2, 5, K, dtype=torch.float64, device=DEVICE)
    model, _ = lora_block(lora_dropout=p)
    torch.manual_seed(7)
    want = run(model, x)
    assert fuse_lora(model) == 1
    torch.manual_seed(7)
    got = run(model, x)
    assert calls == [1]
    for w, g in zip(want[:2], got[:2]):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert got[2].keys() == want[2].keys() and len(want[2]) == 2
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-12, atol=1e-12)
    # Another draw gives another output: the dropout really ran inside the fused layer.
    torch.manual_seed(8)
    assert not torch.equal(run(model, x)[0], got[0])


@pytest.mark.parametrize("case", ["dora", "disabled", "merged", "trainable base", "two adapters"])
def test_what_it_does_not_cover_runs_peft(case, calls):
    config = {"use_dora": True} if case == "dora" else {}
    x = torch.randn(3, K, dtype=torch.float64, device=DEVICE)
    model, layer = lora_block(**config)
    if case == "trainable base":
        layer.base_layer.weight.requires_grad_(True)
    if case == "two adapters":
        model.add_adapter("second", peft.LoraConfig(r=R, lora_alpha=16, target_modules=["proj"]))
        layer.set_adapter(["default", "second"])
    stack = contextlib.ExitStack()
    if case == "disabled":
        stack.enter_context(model.disable_adapter())
    if case == "merged":
        model.merge_adapter()
    with stack:
        torch.manual_seed(1)
        want = run(model, x)
        fuse_lora(model)
        torch.manual_seed(1)
        got = run(model, x)
    assert calls == []
    for w, g in zip(want, got):
        if isinstance(w, dict):
            assert w.keys() == g.keys() and all(torch.equal(w[k], g[k]) for k in w)
        else:
            assert torch.equal(w, g)


def test_fuse_lora_routes_each_layer_once_and_keeps_the_state_dict(calls):
    model, layer = lora_block()
    keys = list(model.state_dict())
    assert fuse_lora(model) == 1 and fuse_lora(model) == 1
    assert layer._peft_forward.__func__ is type(layer).forward  # PEFT's own, not a wrapper of ours
    assert list(model.state_dict()) == keys
    model(torch.randn(2, K, dtype=torch.float64, device=DEVICE))
    assert calls == [1]
    plain, _ = lora_block()
    assert fuse_lora(plain.base_model.model.proj.base_layer) == 0  # no PEFT layer inside


def test_finetune_with_fused_lora_has_the_losses_of_peft(calls):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        fused = finetune_optimized.main(SMALL)
    assert "Custom lora:   14 LoRA layers" in out.getvalue() and "lora" in out.getvalue().split("Kernels:")[1]
    # Every layer, each forward that ran in Python (not CUDA graph replays), alone or in a group.
    assert calls and sum(calls) % 14 == 0 and max(calls) > 1
    with contextlib.redirect_stdout(io.StringIO()):
        plain = finetune_optimized.main(SMALL + ["--no-use-custom-lora"])
        hf = finetune_baseline.main(SMALL)
    for ours, theirs in ((fused, plain), (fused, hf)):
        for a, b in zip(ours["losses"], theirs["losses"]):
            assert abs(a - b) <= 1e-5, (ours["losses"], theirs["losses"])

