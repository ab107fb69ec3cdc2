"""
Tests of the fused kernels on every decoder family of tools/family_matrix.py (CPU,
tiny random models built from transformers' config classes, float32):

* each kernel that goes into a family, alone and all of them together, gives the
  baseline's loss and gradients (HF's loss, PyTorch's AdamW step) to 1e-5, or is no
  further from their float64 values than twice the baseline's own float32 error;
* each family gets at least the kernels listed in EXPECTED: a kernel that stops
  going in is a regression, and one that is refused is refused in one line;
* the README's support matrix is this matrix (tools/family_matrix.py writes it);
* causal LMs that are not such decoders (an encoder, another loss rule, ALiBi) get a
  one-line refusal for the kernel that would change their numbers, and their own loss.

Usage:
    python -m pytest tests/families_test.py -v
    python tests/families_test.py
"""

if __name__ == "__main__":
    # `python tests/families_test.py`: pytest runs this file. Its imports below need the
    # repository root on the path, which the root's conftest.py gives pytest.
    import sys

    import pytest

    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))


import contextlib
import copy
import functools
import io
import os
import sys

import pytest
import torch

from conftest import DEVICE  # first: the Triton interpreter switch

from kernel_ft import dataloader, flags, models, training
from swap_common import vocabulary_size
from kernel_ft.run import apply_kernels
from tools.family_matrix import FAMILIES, family_config

# The kernels each family must get (every other one may be refused, in one line).
ALL = set(flags.KERNELS)
EXPECTED = {
    "Llama": ALL, "Mistral": ALL, "Qwen2": ALL, "Qwen3": ALL, "Granite": ALL,
    "Cohere": ALL - {"rmsnorm", "residual", "rope"},  # LayerNorm, one norm per layer; RoPE on interleaved pairs
    "Gemma": ALL, "Gemma-2": ALL - {"residual"}, "Gemma-3": ALL - {"residual"},  # four norms per layer
    "Phi-3": ALL - {"residual"}, "Phi-3, partial rotary": ALL - {"residual"},  # residual dropout modules
    "Mixtral": ALL, "Qwen3-MoE": ALL,  # swiglu: the experts' fused gate
}
TOL = 1e-5


def loss_and_grads(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def quiet_apply(model, kernels):
    """apply_kernels without its report; None if a kernel is refused (SystemExit)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return apply_kernels(model, kernels)
    except SystemExit as e:
        assert str(e.code).startswith("error: --use-custom-") and "\n" not in str(e.code), e.code
        return None


def float64_truth(model, loss_fn, batch):
    """The model's own loss and gradients in float64, what both float32 runs are measured
    against where they differ by more than TOL: a function that computes them once, from a
    copy taken now (some models, e.g. MoE's grouped matmuls, have no float64 path)."""
    model = copy.deepcopy(model)

    @functools.cache
    def truth():
        loss, grads = loss_and_grads(model.double(), loss_fn, batch)
        return {"loss": loss.float(), **{name: g.float() for name, g in grads.items()}}
    return lambda name: truth()[name]


def assert_close(what, ours, theirs, truth=None):
    """ours within TOL (relative to the largest value, at least 1) of the model's own float32
    numbers, or, where a float64 truth is given, no further from it than twice the model's
    own float32 error (the GPU's float32 math rounds otherwise than the CPU's)."""
    scale = max(theirs.abs().max().item(), 1.0)
    error = (ours - theirs).abs().max().item()
    if error <= TOL * scale or truth is None:
        assert error <= TOL * scale, f"{what}: {error:.3g}"
        return
    truth = truth()
    ours_off, theirs_off = (ours - truth).abs().max().item(), (theirs - truth).abs().max().item()
    assert ours_off <= 2 * theirs_off, \
        f"{what}: {error:.3g} from the model's float32 numbers; from float64 {ours_off:.3g} against its {theirs_off:.3g}"


@pytest.mark.parametrize("label, model_type, extra", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_family_kernels_compute_the_baseline(label, model_type, extra):
    torch.manual_seed(0)
    model = models.build_random(family_config(model_type, extra), torch.device(DEVICE), torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = dataloader.lm_batch(ids.to(DEVICE))
    ref_loss, ref_grads = loss_and_grads(model, training.hf_loss, batch)
    truth = float64_truth(model, training.hf_loss, batch)

    went_in = []
    for kernels in [{k: True} for k in flags.KERNELS] + ["together"]:
        if kernels == "together":
            kernels = dict.fromkeys(went_in, True)
        ours = copy.deepcopy(model)
        switched = quiet_apply(ours, kernels)
        if switched is None:
            continue
        if len(kernels) == 1:
            went_in.append(next(iter(kernels)))
        loss_fn, make_optimizer = switched
        loss, grads = loss_and_grads(ours, loss_fn, batch)
        assert_close(f"{label} {list(kernels)} loss", loss, ref_loss, lambda: truth("loss"))
        assert grads.keys() == ref_grads.keys(), f"{label} {list(kernels)}: other parameters got gradients"
        for name in grads:
            assert_close(f"{label} {list(kernels)} grad {name}", grads[name], ref_grads[name], lambda: truth(name))
        # One optimizer step from the same gradients (Adam's first step is about the
        # sign of each gradient, so it would amplify their rounding differences).
        base = copy.deepcopy(model)
        ours_params = dict(ours.named_parameters())
        for name, p in base.named_parameters():
            grad = ref_grads.get(name)
            p.grad, ours_params[name].grad = (None, None) if grad is None else (grad.clone(), grad.clone())
        training.pytorch_adamw(list(base.parameters()), lr=1e-2).step()
        make_optimizer(list(ours_params.values()), lr=1e-2).step()
        for name, p in base.named_parameters():
            assert_close(f"{label} {list(kernels)} after a step: {name}", ours_params[name].detach(), p.detach())
    assert EXPECTED[label] <= set(went_in), f"{label}: {sorted(EXPECTED[label] - set(went_in))} no longer go in"



# Causal LMs in transformers' list that are not the decoders the kernels are for: what each
# must refuse (a kernel that went in would give other numbers), and the one line it says.
OUTSIDE = [
    ("bert", "attention", "own attention on a row without a mask is not causal"),  # an encoder: bidirectional
    # Its own learned mask: handed to the attention function, which refuses a mask; or not
    # causal on a plain row, or (transformers >= 5.24, the mask flat at its zero start) its
    # parameters would get no gradient through the kernel.
    ("doge", "attention", ("got an attention mask", "own attention on a row without a mask is not causal",
                           "reach the loss through its own attention and not through the kernel")),
    ("cpmant", "flce", "own loss is not HF's causal LM loss"),  # scores each position against its own label
    ("cpmant", "ce", "computes its loss without calling loss_function"),
    ("bloom", "attention", "own attention does not run a packed row"),  # ALiBi, no position ids
    ("deepseek_v4", "rope", "does not take (q, k, cos, sin)"),  # its rotary table wants the layer type
    # Chunked attention; its get_decoder() returns the causal LM itself (swap_common.decoder_of).
    ("llama4_text", "attention", "computes something else than softmax(scale q k^T) v"),
    ("openai-gpt", "flce", None),  # goes in: a decoder whose output has no past_key_values
    # Goes in: a multimodal causal LM run on text alone; from transformers 5.24 its config has
    # no vocab_size of its own, only its text config's (swap_common.vocabulary_size).
    ("fuyu", "flce", None),
    ("gemma4_unified_text", "rope", "config has no single head_dim"),  # it varies per layer
    # Its causal LM does not call the module get_decoder() returns: a padding mask would miss the routing.
    ("modernbert-decoder", "attention", "a row with a padding mask does not reach the model's own attention"),
]


@pytest.mark.parametrize("model_type, kernel, refusal", OUTSIDE, ids=[f"{t}-{k}" for t, k, _ in OUTSIDE])
def test_models_outside_the_families_get_a_refusal_not_other_numbers(model_type, kernel, refusal):
    """kernel_ft.apply on a model the kernels do not fit: the kernel is left to PyTorch
    with one line saying why (or, refusal None, goes in), and the model computes the loss
    and gradients it did (tools/family_sweep.py runs every model type this way)."""
    import transformers

    import kernel_ft

    if model_type not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(family_config(model_type, {"pad_token_id": 0}))  # as a user
    model = model.to(DEVICE, torch.float32).eval()  # eval: no dropout (by any name) in either run
    ids = torch.randint(3, vocabulary_size(model), (2, 12), generator=torch.Generator().manual_seed(1))
    batch = dataloader.lm_batch(ids.to(DEVICE))
    ref_loss, ref_grads = loss_and_grads(model, training.hf_loss, batch)
    truth = float64_truth(model, training.hf_loss, batch)
    switches = {"flce": False} if kernel == "ce" else {}  # ce is tried only where flce is not used
    report = kernel_ft.apply(model, **switches)
    if refusal is None:
        assert report[kernel]["status"] == "applied", report[kernel]
    else:
        refusals = refusal if isinstance(refusal, tuple) else (refusal,)  # one of them, by transformers' version
        assert report[kernel]["status"] == "left to PyTorch" and \
            any(line in report[kernel]["detail"] for line in refusals), report[kernel]
    assert "\n" not in report[kernel]["detail"]
    loss, grads = loss_and_grads(model, training.hf_loss, batch)
    assert_close(f"{model_type} loss", loss, ref_loss, lambda: truth("loss"))
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_close(f"{model_type} grad {name}", grads[name], ref_grads[name], lambda: truth(name))


def test_a_model_whose_own_attention_cannot_take_padding_keeps_it(monkeypatch):
    """The attention switch is checked on a left-padded row run by the model's own
    attention first: where that fails, one line says so and nothing is switched."""
    import kernel_ft

    torch.manual_seed(0)
    model = models.build_random(family_config("llama", {}), torch.device(DEVICE), torch.float32)
    decoder = type(model.model)
    real = decoder.forward

    def no_padding(self, input_ids=None, attention_mask=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("this model takes no padding")
        return real(self, input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    monkeypatch.setattr(decoder, "forward", no_padding)
    report = kernel_ft.apply(model, flce=False)
    assert report["attention"]["status"] == "left to PyTorch", report["attention"]
    assert "own attention does not run a left-padded row (ValueError: this model takes no padding)" in \
        report["attention"]["detail"]
    assert model.config._attn_implementation != "triton_packed"


def test_an_attention_with_a_learned_mask_of_its_own_keeps_it():
    """A mask parameter that starts at zero leaves the logits as the kernel's (the mask is
    flat), but the kernel does not take it, and it would never train (Doge on
    transformers >= 5.24): the gradient check refuses the switch in one line."""
    from transformers import AttentionInterface

    import kernel_ft

    def learned_mask_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = query @ key.transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)
        n = scores.shape[-1]
        if attention_mask is None:
            attention_mask = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril()
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
        scores = scores + module.mask_slope * torch.arange(n, device=scores.device)  # zero at the start: flat
        return (scores.softmax(-1) @ value).transpose(1, 2).contiguous(), None

    AttentionInterface.register("learned_mask_test", learned_mask_attention)
    torch.manual_seed(0)
    model = models.build_random(family_config("llama", {}), torch.device(DEVICE), torch.float32)
    for layer in model.model.layers:
        layer.self_attn.mask_slope = torch.nn.Parameter(torch.zeros((), device=DEVICE))
    model.set_attn_implementation("learned_mask_test")
    report = kernel_ft.apply(model, flce=False)
    assert report["attention"]["status"] == "left to PyTorch", report["attention"]
    assert "attention parameters mask_slope reach the loss through its own attention and not through the kernel" in \
        report["attention"]["detail"] and "\n" not in report["attention"]["detail"], report["attention"]
    assert model.config._attn_implementation == "learned_mask_test"


def test_readme_holds_the_generated_matrix():
    from tools.family_matrix import matrix, readme_matrix, summary

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        text = f.read()
    assert readme_matrix(text) == summary(matrix()), \
        "README's family table is not what the code does now: run python tools/family_matrix.py --readme"

