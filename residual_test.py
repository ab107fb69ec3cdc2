"""
Step 24 -- Tests of the residual adds inside the norms (residual_kernel.py).

* ``add_rmsnorm`` (the sum and its norm in one pass) and ``norm_keep`` (the norm that
  hands its input on as the residual) against a float64 truth of PyTorch's formulation
  (``x + delta`` then the norm; autograd's sum of the two gradients): no worse than
  twice PyTorch's own error, LLaMA's and Gemma's formulas, irregular sizes, every
  dtype, strided inputs; the forward's sum and norm the same bits as PyTorch's add
  followed by TritonRMSNorm.
* The FP8 producers: max |dx| measured in backward is exactly the gradient's; the
  norms' outputs are remade exactly for the LoRA groups.
* Decoder layers: the fused forward gives the model's loss and gradients (tiny LLaMA,
  Gemma, MoE), under gradient checkpointing, torch.compile and autocast, after a deep
  copy and a second apply; each layer that is not of the plain pre-norm form
  (Granite's multiplier, dropout, other norms, another attention call) is refused in
  one line, and the model is left as it was.

Usage:
    python residual_test.py          # or: python -m pytest residual_test.py
"""

import copy
import sys

import pytest
import torch

from conftest import DEVICE, DTYPES, check_outputs
import kernel_common
import kernel_ft
import residual_kernel
import rmsnorm_kernel
from residual_kernel import add_rmsnorm, fuse_residuals, fused_layers, norm_keep
from rmsnorm_kernel import GEMMA, LLAMA, TritonRMSNorm, rmsnorm, rmsnorm_reference
from swap_common import SwapMismatch

EPS = 1e-6
FORMULAS = {"llama": LLAMA, "gemma": GEMMA}


def inputs(shape, dtype, formula=LLAMA, seed=0, strided=False):
    """x, delta, weight and the two upstream gradients (of the norm's output and of the sum)."""
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    x = torch.randn(shape, generator=g) * 2.0 + 0.3
    delta = torch.randn(shape, generator=g) * 1.5
    if strided:  # every other column of a wider tensor: rows not contiguous in memory
        x = torch.stack([x, torch.randn(shape, generator=g)], -1)[..., 0]
    w = 1.0 - formula[0] + 0.5 * torch.randn(hidden, generator=g)
    dy, ds = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (x, delta, w, dy, ds)]


def pytorch_add_norm(x, delta, w, dy, ds, formula, compute_dtype=torch.float32, fused=False):
    """(y, s, dx, ddelta, dw) of s = x + delta, y = norm(s) with upstream dy, ds: PyTorch's
    formulation (or ours with ``fused``)."""
    x, delta, w = (t.detach().requires_grad_() for t in (x, delta, w))
    if fused:
        y, s = add_rmsnorm(x, delta, w, EPS, *formula)
    else:
        s = x + delta
        y = rmsnorm_reference(s, w, EPS, compute_dtype, *formula)
    torch.autograd.backward([y, s], [dy.to(y.dtype), ds])
    return y.detach(), s.detach(), x.grad, delta.grad, w.grad


def pytorch_norm_keep(x, w, dy, ds, formula, compute_dtype=torch.float32, fused=False):
    """(y, dx, dw) of y = norm(x) where x also goes on as the residual with gradient ds."""
    x, w = (t.detach().requires_grad_() for t in (x, w))
    if fused:
        y, residual = norm_keep(x, w, EPS, *formula)
    else:
        y, residual = rmsnorm_reference(x, w, EPS, compute_dtype, *formula), x
    torch.autograd.backward([y, residual], [dy.to(y.dtype), ds])
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("formula", FORMULAS, ids=list(FORMULAS))
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("shape, strided", [((1, 41), False), ((7, 123), True), ((2, 3, 256), False)])
def test_add_rmsnorm_against_float64(shape, strided, dtype, formula):
    args = inputs(shape, DTYPES[dtype], FORMULAS[formula], strided=strided)
    ours = pytorch_add_norm(*args, FORMULAS[formula], fused=True)
    theirs = pytorch_add_norm(*args, FORMULAS[formula])
    truth = pytorch_add_norm(*(t.double() for t in args), FORMULAS[formula], torch.float64)
    check_outputs(("y", "s", "dx", "ddelta", "dw"), ours, theirs, truth, DTYPES[dtype])
    assert torch.equal(ours[2], ours[3]), "the gradient of a sum is the same for both terms"


@pytest.mark.parametrize("formula", FORMULAS, ids=list(FORMULAS))
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("shape, strided", [((1, 41), False), ((7, 123), True)])
def test_norm_keep_against_float64(shape, strided, dtype, formula):
    x, _, w, dy, ds = inputs(shape, DTYPES[dtype], FORMULAS[formula], strided=strided)
    ours = pytorch_norm_keep(x, w, dy, ds, FORMULAS[formula], fused=True)
    theirs = pytorch_norm_keep(x, w, dy, ds, FORMULAS[formula])
    truth = pytorch_norm_keep(x.double(), w.double(), dy.double(), ds.double(), FORMULAS[formula], torch.float64)
    check_outputs(("y", "dx", "dw"), ours, theirs, truth, DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
def test_forward_is_pytorchs_add_then_our_norm_bit_for_bit(dtype):
    x, delta, w, _, _ = inputs((5, 123), DTYPES[dtype])
    y, s = add_rmsnorm(x, delta, w, EPS)
    assert torch.equal(s, x + delta)
    assert torch.equal(y, rmsnorm(x + delta, w, EPS))
    y_keep, residual = norm_keep(x, w, EPS)
    assert torch.equal(y_keep, rmsnorm(x, w, EPS)) and residual is not x and torch.equal(residual, x)


def test_one_gradient_only_and_frozen_weight():
    """Only the sum reaches the loss (dy is None), or only the norm's output; a frozen
    weight gets no gradient and costs none."""
    x, delta, w, dy, ds = inputs((4, 64), torch.float32)
    x.requires_grad_()
    y, s = add_rmsnorm(x, delta, w, EPS)
    s.backward(ds)
    assert torch.equal(x.grad, ds)
    x.grad = None
    y, residual = norm_keep(x, w, EPS)
    y.backward(dy)
    expected = torch.autograd.grad(rmsnorm(x, w, EPS), x, dy)[0]
    assert torch.allclose(x.grad, expected, rtol=1e-6, atol=1e-7) and w.grad is None


@pytest.mark.parametrize("trained", ["weight", "x", "delta"])
def test_only_what_needs_a_gradient_gets_one(trained, monkeypatch):
    """A frozen norm weight (LoRA) costs no dw reduction; a trained one gets its dw whichever
    of x and delta needs a gradient too."""
    made = []
    launch = residual_kernel._backward_launch
    monkeypatch.setattr(residual_kernel, "_backward_launch", lambda *a: made.append(a[4]) or launch(*a))
    x, delta, w, dy, ds = inputs((4, 64), torch.float32)
    leaf = {"weight": w, "x": x, "delta": delta}[trained].requires_grad_()
    y, s = add_rmsnorm(x, delta, w, EPS)
    torch.autograd.backward([y, s], [dy, ds])
    truth = pytorch_add_norm(x, delta, w, dy, ds, LLAMA)[{"x": 2, "delta": 3, "weight": 4}[trained]]
    assert leaf.grad is not None and torch.allclose(leaf.grad, truth, rtol=1e-5, atol=1e-6)
    leaf.grad = None
    y, residual = norm_keep(x, w, EPS)
    if trained != "delta":
        torch.autograd.backward([y, residual], [dy, ds])
        assert leaf.grad is not None
    assert made == [trained == "weight"] * len(made) and made


def test_bad_input_is_refused():
    x, delta, w, _, _ = inputs((4, 64), torch.float32)
    with pytest.raises(ValueError, match="delta must have x's shape"):
        add_rmsnorm(x, delta[:, :32], w, EPS)
    with pytest.raises(ValueError, match="delta must have x's shape, dtype"):
        add_rmsnorm(x, delta.double(), w, EPS)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        add_rmsnorm(x, delta, w, -1.0)


def test_gradient_maximum_for_fp8_and_remade_outputs(monkeypatch):
    """With a per-tensor FP8 layer alive, backward notes max |dx| for exactly dx (what
    the output-gradient cast takes), and both norms' outputs are remade to the bit."""
    weight = torch.nn.Parameter(torch.ones(1, device=DEVICE))
    monkeypatch.setattr(kernel_common, "_WEIGHTS", kernel_common.WeakIdKeyDictionary())
    kernel_common.register_fp8_weight(weight)
    x, delta, w, dy, ds = inputs((6, 96), torch.bfloat16)
    delta.requires_grad_()
    taken = []
    delta.register_hook(lambda g: taken.append((g, kernel_common.take_amax(g))))
    x.requires_grad_()
    y, s = add_rmsnorm(x, delta, w, EPS)
    for made, source in ((y, s), (norm_keep(x, w, EPS)[0], x)):
        recipe = rmsnorm_kernel.remade_later(made)
        assert recipe is not None and recipe[0][0] is source
        assert torch.equal(rmsnorm_kernel.remake(*recipe[0], recipe[1]), made)
    torch.autograd.backward([y, s], [dy, ds])
    (grad, slots), = taken
    assert slots is not None, "no maximum noted for the gradient"
    assert slots.max().item() == grad.float().abs().max().item()


# --------------------------------------------------------------------------------
# Decoder layers
# --------------------------------------------------------------------------------
def tiny(label="Llama", **config_changes):
    from kernel_ft import models
    from tools.family_matrix import FAMILIES, family_config

    model_type, extra = next((t, e) for name, t, e in FAMILIES if name == label)
    config = family_config(model_type, extra)
    for key, value in config_changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = models.build_random(config, DEVICE, torch.float32)
    with torch.no_grad():  # norms that are not the identity
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def loss_and_grads(model, ids, run=None):
    """Loss and gradients of ``model``, called through ``run`` (a compiled model) if given."""
    model.zero_grad(set_to_none=True)
    loss = (model if run is None else run)(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(theirs, ours, tol=1e-5):
    (loss_a, grads_a), (loss_b, grads_b) = theirs, ours
    assert torch.allclose(loss_a, loss_b, rtol=tol, atol=0), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        scale = grads_a[name].abs().max().item()
        assert (grads_a[name] - grads_b[name]).abs().max().item() <= tol * max(scale, 1e-6), name


def ids_for(model, rows=2, length=12):
    return torch.randint(1, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(1),
                         ).to(DEVICE)


@pytest.mark.parametrize("label", ["Llama", "Gemma", "Qwen3-MoE"])
def test_fused_layers_give_the_models_loss_and_gradients(label):
    """Against the same model with TritonRMSNorm alone: the forward the same bits, the
    gradients within float32 rounding (the sums of gradients happen in other places)."""
    model = tiny(label)
    ids = ids_for(model)
    plain = copy.deepcopy(model)
    rmsnorm_kernel.replace_rmsnorm(plain)
    count = fuse_residuals(model)
    assert count == model.config.num_hidden_layers == len(fused_layers(model))
    theirs, ours = loss_and_grads(plain, ids), loss_and_grads(model, ids)
    assert torch.equal(theirs[0], ours[0])
    assert_same(theirs, ours)


def test_gradient_checkpointing_compile_and_copies():
    model = tiny()
    ids = ids_for(model)
    reference = loss_and_grads(model, ids)
    fuse_residuals(model)
    assert_same(reference, loss_and_grads(model, ids))
    copied = copy.deepcopy(model)  # its layers run their own modules
    assert fused_layers(copied) and all(m.forward.__self__.module is m for m in fused_layers(copied))
    assert_same(reference, loss_and_grads(copied, ids))
    model.gradient_checkpointing_enable()
    model.train()
    assert_same(reference, loss_and_grads(model, ids))
    model.gradient_checkpointing_disable()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert_same(reference, loss_and_grads(model, ids, compiled))


def test_autocast_on_a_float32_stream_keeps_pytorchs_add(monkeypatch):
    """bf16 products on float32 weights: the attention's output is bf16, the stream float32;
    the layer adds them as HF does (the fused add needs one dtype). The float32 sums of
    the gradients happen in other places (and the CPU's products round a little
    differently from call to call), so the bf16 products' gradients may differ by one
    bf16 unit of their largest value."""
    model = tiny()
    ids = ids_for(model)
    plain = copy.deepcopy(model)
    rmsnorm_kernel.replace_rmsnorm(plain)
    fuse_residuals(model)
    fused_adds = []
    monkeypatch.setattr(residual_kernel, "add_rmsnorm", lambda *a: fused_adds.append(a) or add_rmsnorm(*a))
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        theirs, ours = loss_and_grads(plain, ids), loss_and_grads(model, ids)
    assert_same(theirs, ours, tol=2**-8)
    assert not fused_adds
    loss_and_grads(model, ids)  # the check itself: without autocast the fused add runs
    assert len(fused_adds) == model.config.num_hidden_layers


def test_generate_and_padding_mask_unchanged():
    model = tiny().eval()
    ids = ids_for(model, length=6)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    plain = copy.deepcopy(model)
    fuse_residuals(model)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(plain.generate(ids, **kwargs), model.generate(ids, **kwargs))
    with torch.no_grad():
        assert torch.allclose(plain(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits,
                              rtol=1e-5, atol=1e-5)


class ScaledResidualLayer(torch.nn.Module):
    """A layer with the four children whose forward scales what it adds."""

    def __init__(self, layer):
        super().__init__()
        for name, child in layer.named_children():
            setattr(self, name, child)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        attended = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                  position_ids=position_ids, position_embeddings=position_embeddings, **kwargs)[0]
        hidden_states = hidden_states + 0.5 * attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MaskDroppingLayer(ScaledResidualLayer):
    """The plain form, but the attention never gets the mask."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        attended = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=None,
                                  position_ids=position_ids, position_embeddings=position_embeddings, **kwargs)[0]
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class PostNormLayer(ScaledResidualLayer):
    """Normalizes after the attention (OLMo-2's order), with the same four children."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        attended = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                  position_ids=position_ids, position_embeddings=position_embeddings, **kwargs)[0]
        hidden_states = hidden_states + self.input_layernorm(attended)
        return hidden_states + self.post_attention_layernorm(self.mlp(hidden_states))


@pytest.mark.parametrize("kind, expected", [
    (ScaledResidualLayer, "computes something else"),
    (MaskDroppingLayer, "passes its attention other arguments"),
    (PostNormLayer, "computes something else"),
])
def test_other_layer_forms_are_refused_and_nothing_changes(kind, expected):
    model = tiny()
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = type(kind.__name__.replace("Layer", "DecoderLayer"), (kind,), {})(layers[i])
    before = [type(m) for m in model.modules()]
    with pytest.raises(SwapMismatch, match=expected) as refused:
        fuse_residuals(model)
    assert "\n" not in str(refused.value)
    assert [type(m) for m in model.modules()] == before and not fused_layers(model)


RESIDUAL_ONLY = dict.fromkeys(("rmsnorm", "swiglu", "flce", "ce", "rope", "attention", "lora", "projections"), False)


@pytest.mark.parametrize("label, changes, expected", [
    ("Granite", {"residual_multiplier": 0.22}, "computes something else"),
    ("Phi-3", {}, "resid_attn_dropout"),
    ("Gemma-2", {}, "pre_feedforward_layernorm"),
    ("Cohere", {}, "they have no post_attention_layernorm"),
])
def test_families_of_another_form_are_refused_in_one_line(label, changes, expected):
    model = tiny(label, **changes)
    with pytest.warns(UserWarning, match=f"residual \\(.*{expected}"):
        report = kernel_ft.apply(model, **RESIDUAL_ONLY)
    assert report["residual"]["status"] == "left to PyTorch" and expected in report["residual"]["detail"]
    assert not fused_layers(model)


def test_apply_reports_the_layers_and_a_second_apply_keeps_them():
    model = tiny()
    report = kernel_ft.apply(model, **RESIDUAL_ONLY)
    assert report["residual"]["status"] == "applied" and report["residual"]["count"] == 2, report
    again = kernel_ft.apply(model, **RESIDUAL_ONLY)
    assert again["residual"]["count"] == 2 and "earlier kernel_ft.apply" in again["residual"]["detail"]
    assert all(isinstance(m.input_layernorm, TritonRMSNorm) for m in fused_layers(model))
    assert not isinstance(model.model.norm, TritonRMSNorm), "rmsnorm=False: the final norm stays HF's"
    off = tiny()
    assert kernel_ft.apply(off, residual=False)["residual"]["status"] == "not used" and not fused_layers(off)


def test_the_scripts_default_is_decided_per_model(capsys):
    """--use-custom-residual left at its default: on for LLaMA, for Gemma-2 off with a line
    (finetune_optimized.py's strict apply does not stop); apply's own default in a Trainer script."""
    from kernel_ft import flags, run

    for label, expected in (("Llama", True), ("Gemma-2", False)):
        kernels = {**dict.fromkeys(flags.KERNELS, False), "rmsnorm": True, "residual": None}
        run.apply_kernels(tiny(label), kernels)
        assert kernels["residual"] is expected
    assert "Residual adds: left to PyTorch: the decoder layers are no plain pre-norm ones" in capsys.readouterr().out
    assert [run.apply_switches({"residual": value})["residual"] for value in (None, True, False)] == [True, True, False]
    assert run.apply_switches({})["residual"] is False  # a caller that names other kernels only


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
