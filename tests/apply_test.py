"""
Tests of ``kernel_ft.apply`` (kernel_ft/patching.py) as a user's training script meets
it: tiny random LLaMA, Qwen2, Gemma-2 and Phi-3 models (CPU, the Triton interpreter),
trained by transformers' Trainer, TRL's SFTTrainer and PEFT, with and without apply.

* Trainer, 3 steps, same seed: the per-step losses (and the gradient norms Trainer
  logs) of the applied model equal the model's own to 1e-4 in float32, with the
  fused AdamW against torch.optim.AdamW, with gradient accumulation (Trainer passes
  num_items_in_batch) and with gradient checkpointing; under bf16 autocast (fp32
  weights) no further from the float32 run than twice the model's own bf16 run;
* TRL's SFTTrainer: padding-free packing and completion-only loss, same losses;
* PEFT LoRA (all-linear, r=8): every layer fused, with lora_dropout 0 and 0.05 (PEFT's
  dropout module draws the masks), no warning, PEFT's loss and gradients; under bf16
  autocast within bf16 rounding; adapters added after apply (get_peft_model after it,
  SFTTrainer's peft_config) warned of, then fused by a second apply;
* with labels the LM head never runs and ``.logits`` is None; without labels the
  logits, a padded batch (left or right: the model's own attention runs), packed rows
  (position ids restarting per document: each document's logits, the model's loss;
  with use_cache on, the model's attention across documents, as transformers gives it)
  and greedy ``generate()`` (also left-padded) give what the model gives without
  apply (logits by conftest.check_outputs: float64 truth, no worse than 2x PyTorch);
  labels without a target give the model's NaN and zero gradients, labels with
  logits_to_keep the model's error;
* a config with attention dropout keeps the model's attention (dropout set after apply
  too), position ids split into documents as transformers splits them, return_dict=False
  gives HF's tuple, PEFT's copy of the head (modules_to_save) runs the fused loss; a
  sequence classifier keeps its own loss (flce and ce not used) and runs our attention;
* an evaluation (eval mode, no_grad) returns the logits for Trainer's compute_metrics
  (skip_logits / kernel_ft.loss_only skip them); TRL's fused_lm_head calls reach TRL's
  forward; a static cache, a cache passed by either name (5.24 renamed it), output_attentions
  and an implementation set after apply run the model's attention; an MoE config asking
  for the router loss is probed without it and keeps it; DoRA and LoRA with a bias are
  reported as PEFT's; a PEFT model without LoRA layers is no refusal;
* the report (one line per kernel, JSON-ready), Cohere's LayerNorm and interleaved RoPE
  left to PyTorch (warning; strict=True raises KernelNotApplied), a torch.compile'd model
  refused in one line; a second apply wraps nothing twice and reports the kernels the
  model runs (no warning, strict=True passes); a model after apply pickles (torch.save) and
  deep-copies with every kernel in place; what save_pretrained writes after training loads
  in plain transformers (PEFT: the adapters on a fresh base), and merge_and_unload works;
* ``pip install`` of the repository into a folder: ``import kernel_ft`` from another
  directory that holds a user's own models.py, flags.py and training.py;
* Step 23's script, finetune_trainer.py: the same losses with and without the kernels, and
  under torchrun (2 processes of batch 1 as one of batch 2),
  its JSON, and a one-line refusal of what it cannot do.

Usage:
    python -m pytest tests/apply_test.py -v
    python tests/apply_test.py
"""

if __name__ == "__main__":
    # `python tests/apply_test.py`: pytest runs this file. Its imports below need the
    # repository root on the path, which the root's conftest.py gives pytest.
    import sys

    import pytest

    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))


import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

# First: the Triton interpreter switch.
from conftest import DEVICE, check_outputs, need_gpu, no_worse, rel_err, saved_bytes

import attention_routing
import kernel_ft
import linear_cross_entropy_kernel
import swap_common
from kernel_ft import models
from tools.family_matrix import FAMILIES, TINY, family_config

import datasets
import transformers

ROOT = Path(__file__).resolve().parent.parent  # the repository
FAMILY = {label: (model_type, extra) for label, model_type, extra in FAMILIES}
TESTED = ["Llama", "Qwen2", "Gemma-2", "Phi-3"]
ON_CPU = DEVICE.type == "cpu"  # Trainer's use_cpu (with a GPU, the kernels run on it)
VOCAB = 128
SEQ = 16
LR = 1e-3
STEPS = 3
LOSS_TOL = 1e-4  # float32 losses, with and without apply
GRAD_TOL = 1e-5  # float32 gradients of one step (tests/families_test.py's bound)


# --------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------
def tiny_config(label):
    """tools/family_matrix.py's tiny config of the family, with a small vocabulary."""
    model_type, extra = FAMILY[label]
    config = family_config(model_type, extra)
    config.vocab_size = VOCAB
    # Weights ten times HF's default: attention and logits far from uniform, so that the
    # loss depends on every kernel (with 0.02 the logits are nearly uniform: the loss is
    # log(V) to within 1%, whatever the attention computes).
    config.initializer_range = 0.2
    config.pad_token_id = 0
    config.eos_token_id = None  # generate() runs all max_new_tokens
    return config


def tiny_model(label="Llama", seed=0):
    torch.manual_seed(seed)
    model = models.build_random(tiny_config(label), torch.device(DEVICE), torch.float32)
    model.config.use_cache = True  # as a user's model comes (build_random turns it off for training)
    return model.train()


def apply_and_warnings(model, **switches):
    """kernel_ft.apply; returns (report, the messages of the warnings apply emitted)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kernel_ft.apply(model, **switches)
    return report, [str(w.message) for w in caught if str(w.message).startswith("kernel_ft")]


def applied(model, **switches):
    """The model after kernel_ft.apply (its report checked elsewhere)."""
    apply_and_warnings(model, **switches)
    return model


def token_ids(rows, length=SEQ, seed=1, low=1):
    return torch.randint(low, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def masked_prompts(ids, prompt_lengths):
    """Labels: the ids, with each row's prompt (of its length) at -100."""
    labels = ids.clone()
    for row, n in enumerate(prompt_lengths):
        labels[row, :n] = -100
    return labels


def assert_close(what, ours, theirs, tol):
    """max |ours - theirs| <= tol * max(|theirs|, 1) (tests/families_test.py's rule)."""
    ours, theirs = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    diff = (ours - theirs).abs().max().item()
    values = f"{ours.tolist()} vs {theirs.tolist()} " if ours.numel() <= 8 else ""
    assert diff <= tol * max(theirs.abs().max().item(), 1.0), f"{what}: {values}(max difference {diff:.2g})"


def assert_logits_match(names, ours, plain_model, run):
    """Our logits (a list of tensors) against ``run`` (a list too) of the model without
    apply in float32 and of its float64 copy (the truth): conftest.check_outputs, the
    project's rule (no further from the truth than twice the model's own error)."""
    truth_model = copy.deepcopy(plain_model).to(torch.float64)
    with torch.no_grad():
        peer, truth = run(plain_model), run(truth_model)
    assert len(ours) == len(peer) == len(truth) == len(names)
    check_outputs(names, ours, peer, truth, peer_name="the model without apply")


def spy_on(monkeypatch, module, name):
    """Count the calls of ``module.name`` (a function our patched forwards look up in
    their module at each call); returns the list of calls, one entry each."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.fixture
def attention_calls(monkeypatch):
    """Calls of our flash attention (attention_routing.hf_packed_attention calls it)."""
    return spy_on(monkeypatch, attention_routing, "packed_attention")


@pytest.fixture
def fused_loss_calls(monkeypatch):
    """Calls of the fused linear cross-entropy (the flce forward calls it)."""
    return spy_on(monkeypatch, linear_cross_entropy_kernel, "fused_linear_cross_entropy")


# --------------------------------------------------------------------------------
# 1. transformers.Trainer
# --------------------------------------------------------------------------------
def lm_dataset(rows=12):
    """Token ids with labels whose prompts (of uneven lengths) are masked: the micro-batches
    (one row each) of a step hold different numbers of targets, so num_items_in_batch matters."""
    ids = token_ids(rows, seed=2).cpu()
    labels = masked_prompts(ids, [(3 * r) % 13 for r in range(rows)])
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def trainer_run(label, kernels, optimizer=None, steps=STEPS, **arguments):
    """(losses, gradient norms) per step of ``steps`` Trainer steps, from the same seed."""
    model = tiny_model(label)
    if kernels:
        applied(model)
    optimizers = (None, None) if optimizer is None else (optimizer(model.parameters(), lr=LR), None)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=1, learning_rate=LR, logging_steps=1,
            report_to="none", use_cpu=ON_CPU, save_strategy="no", seed=0, disable_tqdm=True, **arguments)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=lm_dataset(), optimizers=optimizers)
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == list(range(1, steps + 1))
    return torch.tensor([e["loss"] for e in logs]), torch.tensor([e["grad_norm"] for e in logs])


def assert_same_run(ours, theirs):
    assert_close("losses", ours[0], theirs[0], LOSS_TOL)
    assert_close("gradient norms", ours[1], theirs[1], LOSS_TOL)


@pytest.mark.parametrize("label", TESTED)
def test_trainer_losses_fp32(label):
    assert_same_run(trainer_run(label, kernels=True), trainer_run(label, kernels=False))


def test_trainer_fused_adamw_against_torch_adamw():
    ours = trainer_run("Llama", kernels=True, optimizer=kernel_ft.AdamW)
    assert_same_run(ours, trainer_run("Llama", kernels=False, optimizer=torch.optim.AdamW))


# The tests below train SHORT_STEPS, not STEPS: a step's logged gradient norm already checks
# its gradients (their scaling by num_items_in_batch, the recomputation of checkpointing),
# and the second step's loss checks the first update. The interpreter's time is in the steps.
SHORT_STEPS = 2


def test_trainer_gradient_accumulation_passes_num_items_in_batch():
    ours = trainer_run("Llama", kernels=True, steps=SHORT_STEPS, gradient_accumulation_steps=2)
    assert_same_run(ours, trainer_run("Llama", kernels=False, steps=SHORT_STEPS, gradient_accumulation_steps=2))


def test_trainer_gradient_checkpointing():
    ours = trainer_run("Llama", kernels=True, steps=SHORT_STEPS, gradient_checkpointing=True)
    assert_same_run(ours, trainer_run("Llama", kernels=False, steps=SHORT_STEPS, gradient_checkpointing=True))


def test_trainer_bf16_autocast_is_within_bf16_rounding():
    """Trainer's bf16=True on the CPU: autocast over float32 weights. bf16 rounding moves
    the model's own run away from its float32 run; ours may move as far, twice at most
    (conftest.no_worse over the losses and gradient norms of the SHORT_STEPS steps)."""
    fp32 = torch.cat(trainer_run("Llama", kernels=False, steps=SHORT_STEPS))
    theirs = torch.cat(trainer_run("Llama", kernels=False, steps=SHORT_STEPS, bf16=True))
    ours = torch.cat(trainer_run("Llama", kernels=True, steps=SHORT_STEPS, bf16=True))
    err_theirs, err_ours = rel_err(theirs, fp32), rel_err(ours, fp32)
    assert err_theirs > 0, "bf16=True changed nothing: the run was not under autocast"
    assert no_worse(err_ours, err_theirs, torch.bfloat16), \
        f"bf16: {err_ours:.2e} from the float32 run, the model's own bf16 run {err_theirs:.2e}"


# --------------------------------------------------------------------------------
# 2. TRL's SFTTrainer
# --------------------------------------------------------------------------------
WORDS = [f"w{i}" for i in range(VOCAB - 3)]


def word_tokenizer():
    """A word-level tokenizer built here (no hub): <pad> 0, <eos> 1, <unk> 2, w0 ... ."""
    from tokenizers import Tokenizer, models as token_models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(token_models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def sentences(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist()) for n in lengths]


LENGTHS = [4, 7, 3, 6, 5, 3, 6, 4, 5, 6, 3, 4]  # words per document (or prompt)
SFT_CASES = {
    # BFD packing: rows of several documents, position ids restarting at 0, no attention mask.
    "packing, padding-free": (lambda: {"text": sentences(LENGTHS, 3)},
                              dict(packing=True, max_length=16, per_device_train_batch_size=1)),
    # Loss on the completions only; padding-free batches (max_length=None: TRL does not truncate them).
    "completion only, padding-free": (
        lambda: {"prompt": sentences(LENGTHS, 4),  # TRL joins the strings: the completion's leading space
                 "completion": [" " + c for c in sentences([n // 2 + 1 for n in LENGTHS], 5)]},
        dict(completion_only_loss=True, padding_free=True, max_length=None, per_device_train_batch_size=2)),
}


def sft_run(case, kernels, peft_config=None, after=None):
    """SFTTrainer's batch and (losses, gradient norms) per step; ``peft_config`` is handed
    to the trainer (which wraps the model), ``after(trainer)`` runs before training."""
    pytest.importorskip("trl")
    import trl

    columns, options = SFT_CASES[case]
    model = tiny_model("Llama")
    if kernels:
        applied(model)
    with tempfile.TemporaryDirectory() as out:
        args = trl.SFTConfig(output_dir=out, max_steps=STEPS, learning_rate=LR,
                             logging_steps=1, report_to="none", use_cpu=ON_CPU, save_strategy="no", seed=0,
                             bf16=False, gradient_checkpointing=False, disable_tqdm=True, **options)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict(columns()),
                                 processing_class=word_tokenizer(), peft_config=peft_config)
        if after is not None:
            after(trainer)
        batch = next(iter(trainer.get_train_dataloader()))
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return batch, torch.tensor([e["loss"] for e in logs]), torch.tensor([e["grad_norm"] for e in logs])


@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_trainer_losses(case):
    batch, *ours = sft_run(case, kernels=True)
    # What the case is about reached the model: packed rows without a mask, masked prompts.
    assert "attention_mask" not in batch and (batch["position_ids"] == 0).sum() > 1
    if "completion" in case:
        assert (batch["labels"] == -100).sum() > (batch["position_ids"] == 0).sum()
    _, *theirs = sft_run(case, kernels=False)
    assert len(ours[0]) == STEPS
    assert_same_run(ours, theirs)


# --------------------------------------------------------------------------------
# 3. PEFT LoRA
# --------------------------------------------------------------------------------
def lora_config(dropout, **options):
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=dropout, **options)


def lora_model(dropout, model=None, **options):
    """A PEFT LoRA model around ``model`` (a tiny LLaMA by default), B not zero."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("Llama") if model is None else model, lora_config(dropout, **options))
    torch.manual_seed(3)
    return nonzero_lora_b(model).train()


def nonzero_lora_b(model):
    """``model`` with every LoRA B drawn from N(0, 0.1): PEFT starts B at zero, where A's
    gradient path would go untested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def loss_and_grads(model, ids, labels, autocast=False, seed=4):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both models
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dropout", [0.0, 0.05], ids=["dropout 0", "dropout 0.05"])
def test_peft_lora(dropout):
    """Every LoRA layer fused, lora_dropout included (PEFT's own dropout module draws the
    mask: same seed, same mask), with PEFT's loss and gradients."""
    ours = lora_model(dropout)
    theirs = copy.deepcopy(ours)
    report, warned = apply_and_warnings(ours)
    layers = sum(1 for name, _ in ours.named_modules() if name.endswith("lora_A"))
    assert layers == 14  # q, k, v, o, gate, up, down in 2 layers
    assert report["lora"]["status"] == "applied" and report["lora"]["count"] == layers, report["lora"]
    assert warned == []
    ids = token_ids(2)
    labels = masked_prompts(ids, [3, 6])
    loss, grads = loss_and_grads(ours, ids, labels)
    want_loss, want_grads = loss_and_grads(theirs, ids, labels)
    if dropout:  # the masks matter: another seed, another loss
        assert loss_and_grads(theirs, ids, labels, seed=5)[0] != want_loss
    assert_close("loss", loss, want_loss, LOSS_TOL)
    assert grads.keys() == want_grads.keys() and all("lora_" in name for name in grads)
    for name in grads:
        assert_close(f"gradient of {name}", grads[name], want_grads[name], GRAD_TOL)


@pytest.mark.parametrize("forward_before", [False, True])
def test_lora_added_after_apply_is_said_then_fused_by_a_second_apply(monkeypatch, forward_before):
    """apply before get_peft_model: the groups it made hold the projections PEFT then wraps,
    so their adapters run PEFT's forward. That is right (PEFT's loss and gradients) but
    slow, and said once in a warning, also where the model ran a forward between apply
    and get_peft_model; a second apply undoes those groups and makes them again with the
    adapters fused, as an apply after get_peft_model would."""
    import projections_kernel
    from lora_kernel import unfused_layers

    monkeypatch.setattr(swap_common, "SAID", set())
    ids = token_ids(2)
    theirs = lora_model(0.05)
    base = applied(tiny_model("Llama"))
    if forward_before:  # a sanity step before the adapters: the groups' first calls come before any wrap
        loss_and_grads(base, ids, ids)
    ours = lora_model(0.05, model=base)
    ours.load_state_dict(theirs.state_dict())  # apply's probes draw random numbers: the same adapters
    labels = masked_prompts(ids, [3, 6])
    want_loss, want_grads = loss_and_grads(theirs, ids, labels)

    def check(model):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, grads = loss_and_grads(model, ids, labels)
        assert_close("loss", loss, want_loss, LOSS_TOL)
        assert grads.keys() == want_grads.keys()
        for name in grads:
            assert_close(f"gradient of {name}", grads[name], want_grads[name], GRAD_TOL)
        return [str(w.message) for w in caught if str(w.message).startswith("kernel_ft")]

    wrapped = [m for m in ours.modules() if isinstance(getattr(m, "base_layer", None), projections_kernel.Grouped)]
    assert len(wrapped) == 10  # q, k, v, gate, up in 2 layers
    warned = check(ours)
    assert len(warned) == 1 and "after kernel_ft.apply" in warned[0] and "apply(model) again" in warned[0], warned

    report, warned = apply_and_warnings(ours)
    assert warned == []
    assert report["lora"]["status"] == "applied" and report["lora"]["count"] == 14, report["lora"]
    assert report["projections"]["count"] == 4 and "4 made again" in report["projections"]["detail"], report
    assert unfused_layers(ours) == {}
    lora_layers = [m for m in ours.modules() if hasattr(m, "lora_A")]
    assert all(type(m.base_layer) is torch.nn.Linear for m in lora_layers)
    assert sum("projection_group" in m.__dict__ for m in lora_layers) == 10  # grouped, adapters and all
    assert check(ours) == []


def test_an_adapter_added_beside_grouped_ones_joins_their_group_after_a_second_apply():
    """LoRA on q and v, apply (q, k and v grouped, q and v routed), then a second adapter on
    k made active: a second apply undoes the whole group, the routed q and v too, and
    makes one group of the three again, with PEFT's loss and gradients."""
    peft = pytest.importorskip("peft")
    import projections_kernel

    def two_adapters(model):
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        return model, lambda: (model.add_adapter("second", peft.LoraConfig(r=4, target_modules=["k_proj"])),
                               model.set_adapter("second"))

    ids = token_ids(2)
    model, add_second = two_adapters(tiny_model("Llama"))
    applied(model)
    add_second()
    nonzero_lora_b(model)
    theirs, add_second = two_adapters(tiny_model("Llama"))  # PEFT's own forward, the same weights
    add_second()
    theirs.load_state_dict(model.state_dict())
    applied(model)
    for layer in model.get_base_model().model.layers:
        attention = layer.self_attn
        groups = {id(getattr(attention, n).__dict__.get("projection_group")) for n in ("q_proj", "k_proj", "v_proj")}
        assert len(groups) == 1 and id(None) not in groups  # one group, every member in it
    assert projections_kernel.groups_in(model) == 4
    want_loss, want_grads = loss_and_grads(theirs, ids, ids)
    loss, grads = loss_and_grads(model, ids, ids)
    assert_close("loss", loss, want_loss, LOSS_TOL)
    assert grads and grads.keys() == want_grads.keys()
    for name in grads:
        assert_close(f"gradient of {name}", grads[name], want_grads[name], GRAD_TOL)


def test_sft_trainer_given_a_peft_config_after_apply_fuses_lora_with_a_second_apply():
    """TRL's SFTTrainer(peft_config=...) wraps the model itself, after apply: the warning's
    advice, apply(trainer.model) before train(), gives every LoRA layer fused and the losses
    of the same run without the kernels."""
    reports = []
    ours = sft_run("packing, padding-free", kernels=True, peft_config=lora_config(0.0),
                   after=lambda trainer: reports.append(apply_and_warnings(trainer.model)))
    (report, warned), = reports
    assert warned == [] and report["lora"]["status"] == "applied" and report["lora"]["count"] == 14, report
    assert "PEFT's forward" not in report["lora"]["detail"], report["lora"]  # none left unfused
    _, *theirs = sft_run("packing, padding-free", kernels=False, peft_config=lora_config(0.0))
    assert_same_run(ours[1:], theirs)


@pytest.mark.parametrize("case", ["LoRA", "LoRA, float32 weights under bf16 autocast", "full fine-tuning"])
def test_what_backward_makes_again_gives_the_same_bits(case, monkeypatch):
    """The q/k/v and gate/up groups keep their RMSNorm's recipe instead of its output
    (rmsnorm_kernel.remade_later), and a LoRA down_proj makes its input h again
    (swiglu_kernel.TritonSwiGLULoRADownFunction): the loss and every gradient are the bits
    of the same model keeping both, with a [tokens, hidden] tensor per norm fewer kept
    (and, with LoRA, one [tokens, intermediate] per layer)."""
    import lora_kernel
    import swiglu_kernel

    lora = case.startswith("LoRA")
    autocast = "autocast" in case
    ids = token_ids(2)
    labels = masked_prompts(ids, [3, 6])
    runs = {}
    for remake in (True, False):
        monkeypatch.setattr(lora_kernel, "REMAKE_NORMS", remake)
        monkeypatch.setattr(swiglu_kernel.TritonLlamaMLP, "recompute_hidden", remake or not lora)
        model = applied(lora_model(0.0) if lora else tiny_model("Llama"))
        runs[remake] = saved_bytes(lambda: loss_and_grads(model, ids, labels, autocast))
    (loss, grads), kept = runs[True]
    (want_loss, want_grads), want_kept = runs[False]
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys() and len(grads) == (28 if lora else len(list(model.parameters())))
    for name in grads:
        assert torch.equal(grads[name], want_grads[name]), f"gradient of {name}"
    config = model.config
    tokens, item, layers = ids.numel(), 2 if autocast else 4, config.num_hidden_layers
    # Under LoRA the first norm reads the frozen embedding's output: with no gradient to
    # pass, it keeps no input to remake its output from, and the group keeps the output.
    norms = 2 * layers - lora
    expected = tokens * item * (norms * config.hidden_size + lora * layers * config.intermediate_size)
    assert want_kept - kept == expected, f"kept {kept} against {want_kept} bytes, expected {expected} fewer"


@pytest.mark.parametrize("option", ["use_dora", "lora_bias"])
def test_lora_layers_beyond_the_kernel_are_reported_left_to_peft(option, monkeypatch):
    """DoRA and adapters with a bias are PEFT's to compute: the report says so (a warning;
    no "applied" for layers that never run fused), they are not grouped, and the model
    keeps PEFT's loss and gradients."""
    import lora_kernel

    fused = spy_on(monkeypatch, lora_kernel, "lora_linear")
    ours = lora_model(0.0, **{option: True})
    theirs = copy.deepcopy(ours)
    report, warned = apply_and_warnings(ours)
    detail = report["lora"]["detail"]
    assert report["lora"]["status"] == "left to PyTorch" and detail.startswith("every LoRA layer keeps PEFT's"), detail
    assert "14 with " + ("a LoRA variant" if option == "use_dora" else "an adapter with a bias") in detail, detail
    assert len(warned) == 1 and "lora (" in warned[0], warned
    assert report["projections"]["status"] == "not used", report["projections"]
    ids = token_ids(2)
    loss, grads = loss_and_grads(ours, ids, ids)
    want_loss, want_grads = loss_and_grads(theirs, ids, ids)
    assert not fused
    assert_close("loss", loss, want_loss, LOSS_TOL)
    for name in want_grads:
        assert_close(f"gradient of {name}", grads[name], want_grads[name], GRAD_TOL)


def test_a_peft_model_without_lora_layers_is_not_a_lora_refusal():
    """Prompt tuning (or IA3, LoHa, ...) has no LoRA layers: lora is "not used", with no
    warning and strict=True passing, and the other kernels keep PEFT's loss."""
    peft = pytest.importorskip("peft")
    theirs = peft.get_peft_model(tiny_model("Llama"), peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                                               num_virtual_tokens=4))
    ours = copy.deepcopy(theirs)
    report = kernel_ft.apply(ours, strict=True)
    assert report["lora"]["status"] == "not used" and "PROMPT_TUNING" in report["lora"]["detail"], report["lora"]
    ids = token_ids(2)
    assert_close("loss", ours(input_ids=ids, labels=ids).loss.detach(), theirs(input_ids=ids, labels=ids).loss.detach(),
                 LOSS_TOL)


def test_peft_lm_head_trained_as_a_copy_runs_the_fused_loss_on_it(fused_loss_calls):
    """modules_to_save=["lm_head"] (new tokens' rows trained with LoRA): PEFT wraps the
    head and trains a copy per adapter. The fused loss multiplies by the copy the
    wrapper's forward would (the original with adapters off), with PEFT's loss and
    gradients; a call with an adapter per row (adapter_names) runs PEFT's own forward."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    theirs = peft.get_peft_model(tiny_model("Llama"), config)
    theirs.add_adapter("other", config)
    with torch.no_grad():  # each copy its own weights: which one is multiplied shows in the loss
        for name, p in theirs.named_parameters():
            if "modules_to_save" in name or "lora_B" in name:
                p.normal_(0, 0.2)
    ours = copy.deepcopy(theirs)
    report, _ = apply_and_warnings(ours)
    assert report["flce"]["status"] == "applied", report["flce"]
    ids = token_ids(2)
    labels = masked_prompts(ids, [3, 6])
    fused_loss_calls.clear()
    loss, grads = loss_and_grads(ours, ids, labels)
    want_loss, want_grads = loss_and_grads(theirs, ids, labels)
    assert fused_loss_calls and any("modules_to_save.default" in name for name in grads)
    assert_close("loss", loss, want_loss, LOSS_TOL)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        assert_close(f"gradient of {name}", grads[name], want_grads[name], GRAD_TOL)
    for model in (ours, theirs):
        model.eval()
    with torch.no_grad():
        with ours.disable_adapter(), theirs.disable_adapter():  # the original head
            assert_close("loss without adapters", ours(input_ids=ids, labels=labels).loss,
                         theirs(input_ids=ids, labels=labels).loss, LOSS_TOL)
        fused_loss_calls.clear()
        rows = ["default", "other"]
        got = ours(input_ids=ids, labels=labels, adapter_names=rows).loss
        assert not fused_loss_calls
        assert_close("loss with an adapter per row", got, theirs(input_ids=ids, labels=labels, adapter_names=rows).loss,
                     LOSS_TOL)


def test_peft_lora_under_bf16_autocast_is_within_bf16_rounding():
    """Fused LoRA layers under bf16 autocast over float32 weights (Trainer's bf16=True):
    the adapters' gradients no further from the float32 run than twice PEFT's own under
    the same autocast (check_outputs, the float32 run as truth: its rounding is 2^16
    times finer than bf16's); the loss, one scalar, within one bf16 rounding (2^-8,
    relative) of the float32 loss: a single scalar's rounding error is one random draw,
    too few for a ratio of two of them."""
    ours = lora_model(0.0)
    theirs = copy.deepcopy(ours)
    ids = token_ids(2)
    labels = masked_prompts(ids, [3, 6])
    truth_loss, truth_grads = loss_and_grads(theirs, ids, labels)
    report, _ = apply_and_warnings(ours)
    assert report["lora"]["status"] == "applied"
    loss, grads = loss_and_grads(ours, ids, labels, autocast=True)
    want_loss, want_grads = loss_and_grads(theirs, ids, labels, autocast=True)
    assert grads.keys() == want_grads.keys() == truth_grads.keys()
    assert want_loss != truth_loss, "autocast changed nothing"
    assert abs(loss - truth_loss) <= 2**-8 * abs(truth_loss), f"loss {loss.item()} vs {truth_loss.item()} in float32"
    check_outputs(list(grads), list(grads.values()), list(want_grads.values()), list(truth_grads.values()),
                  dtypes=torch.bfloat16, peer_name="PEFT under autocast")


# --------------------------------------------------------------------------------
# 4. No logits with labels; the model's logits without
# --------------------------------------------------------------------------------
@pytest.mark.parametrize("label", TESTED)
def test_labels_give_the_loss_without_running_the_lm_head(label):
    plain = tiny_model(label)
    ours = applied(copy.deepcopy(plain))
    calls = []
    for model in (plain, ours):
        model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    ids = token_ids(2)  # one training step: forward with labels, backward
    labels = masked_prompts(ids, [2, 5])
    want = plain(input_ids=ids, labels=labels)
    assert calls == [1], "the hook does not see the model's own LM head"
    got = ours(input_ids=ids, labels=labels)
    got.loss.backward()
    assert calls == [1], "the LM head ran in a training step after apply"
    assert got.logits is None
    assert_close("loss", got.loss.detach(), want.loss.detach(), LOSS_TOL)
    want.loss.backward()
    grads = {name: p.grad for name, p in ours.named_parameters()}
    for name, p in plain.named_parameters():
        assert_close(f"gradient of {name}", grads[name], p.grad, GRAD_TOL)


@pytest.mark.parametrize("loss", ["flce", "ce"])
def test_labels_without_targets_give_the_models_nan_and_zero_gradients(loss):
    """No target in the batch: transformers' mean is 0 / 0, NaN, and its gradients are 0;
    the fused loss (inside the forward, or on the logits) gives the same."""
    plain = tiny_model("Llama")
    ours = applied(copy.deepcopy(plain), flce=loss == "flce")
    ids = token_ids(2)
    labels = torch.full_like(ids, -100)
    for model in (plain, ours):
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        assert torch.isnan(out.loss), f"{model is ours and 'ours' or 'plain'}: {out.loss}"
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_labels_with_logits_to_keep_get_the_models_own_answer():
    """transformers refuses labels with the logits of some positions only (logits_to_keep):
    after apply the same error, not a loss over every position."""
    plain = tiny_model("Llama")
    ours = applied(copy.deepcopy(plain))
    ids = token_ids(2)
    for keep in (1, torch.tensor([2, 5])):
        errors = []
        for model in (plain, ours):
            with pytest.raises(Exception) as caught:
                model(input_ids=ids, labels=ids, logits_to_keep=keep)
            errors.append((type(caught.value), str(caught.value)))
        assert errors[0] == errors[1], errors
    got, want = (model(input_ids=ids, labels=ids, logits_to_keep=0).loss for model in (ours, plain))
    assert_close("loss, logits_to_keep=0", got.detach(), want.detach(), LOSS_TOL)


def test_return_dict_false_gives_the_models_tuple_with_no_logits():
    """return_dict=False: HF's tuple, the loss first and None where the logits would
    be, every other output at its own position."""
    plain = tiny_model("Llama")
    ours = applied(copy.deepcopy(plain))
    ids = token_ids(2)
    with torch.no_grad():
        want = plain(input_ids=ids, labels=ids, use_cache=True, return_dict=False)
        got = ours(input_ids=ids, labels=ids, use_cache=True, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want) == 3
    assert_close("loss", got[0], want[0], LOSS_TOL)
    assert got[1] is None and type(got[2]) is type(want[2])


def test_an_moe_call_asking_for_the_router_loss_runs_the_models_own_forward():
    """Mixtral given output_router_logits=True adds its router's auxiliary loss to the loss:
    that call runs the model's own forward (logits and all), the same loss as without apply."""
    plain = tiny_model("Mixtral")
    ours = applied(copy.deepcopy(plain))
    ids = token_ids(2)
    want = plain(input_ids=ids, labels=ids, output_router_logits=True)
    got = ours(input_ids=ids, labels=ids, output_router_logits=True)
    assert want.aux_loss is not None and got.aux_loss is not None and got.logits is not None
    assert_close("loss", got.loss.detach(), want.loss.detach(), LOSS_TOL)
    # Without it the fused loss runs (no logits) and equals the model's plain loss.
    assert ours(input_ids=ids, labels=ids).logits is None


def test_an_moe_config_asking_for_the_router_loss_is_probed_without_it_and_keeps_it():
    """output_router_logits=True in the config: apply's probes compare attention and loss
    without the router's term (it is neither), so both kernels go in, and the fused loss
    leaves such a model's calls to its own forward, also when the flag is set after apply."""
    plain = tiny_model("Mixtral")
    before = copy.deepcopy(plain)
    before.config.output_router_logits = True
    report, _ = apply_and_warnings(before)
    assert report["attention"]["status"] == report["ce"]["status"] == "applied", str(report)
    assert "output_router_logits" in report["flce"]["detail"]
    assert before.config.output_router_logits is True
    after = applied(copy.deepcopy(plain))
    after.config.output_router_logits = True
    plain.config.output_router_logits = True
    ids = token_ids(2)
    want = plain(input_ids=ids, labels=ids)
    for ours in (before, after):
        got = ours(input_ids=ids, labels=ids)
        assert got.aux_loss is not None
        assert_close("aux loss", got.aux_loss.detach(), want.aux_loss.detach(), LOSS_TOL)
        assert_close("loss", got.loss.detach(), want.loss.detach(), LOSS_TOL)


def test_an_evaluation_without_gradients_returns_the_logits_unless_told_not_to():
    """Trainer's evaluation (eval mode, no_grad) hands the logits to compute_metrics: there
    the model's own forward runs. skip_logits=True, or kernel_ft.loss_only() around the
    calls, keeps the fused loss; in training the logits are skipped as before."""
    plain = tiny_model("Llama").eval()
    ours = applied(copy.deepcopy(plain))
    ids = token_ids(2)
    with torch.no_grad():
        want = plain(input_ids=ids, labels=ids)
        got = ours(input_ids=ids, labels=ids)
        assert got.logits is not None
        assert_close("logits", got.logits, want.logits, LOSS_TOL)
        assert_close("loss", got.loss, want.loss, LOSS_TOL)
        for lean in (ours(input_ids=ids, labels=ids, skip_logits=True), None):
            if lean is None:
                with kernel_ft.loss_only():
                    lean = ours(input_ids=ids, labels=ids)
            assert lean.logits is None
            assert_close("loss without logits", lean.loss, want.loss, LOSS_TOL)
        with pytest.raises(ValueError, match="skip_logits=True needs labels"):
            ours(input_ids=ids, skip_logits=True)
    ours.train()
    assert ours(input_ids=ids, labels=ids).logits is None
    assert ours(input_ids=ids, labels=ids, skip_logits=False).logits is not None

    def accuracy(prediction):
        predicted, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
        return {"accuracy": float((predicted == labels).mean())}

    def evaluation(model):
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(output_dir=out, per_device_eval_batch_size=2, report_to="none",
                                                  use_cpu=ON_CPU, disable_tqdm=True)
            trainer = transformers.Trainer(model=model, args=args, eval_dataset=lm_dataset(4),
                                           compute_metrics=accuracy,
                                           preprocess_logits_for_metrics=lambda logits, _: logits.argmax(-1))
            return trainer.evaluate()

    theirs, mine = evaluation(plain), evaluation(ours)
    assert_close("eval loss", mine["eval_loss"], theirs["eval_loss"], LOSS_TOL)
    assert mine["eval_accuracy"] == theirs["eval_accuracy"]


def test_trls_fused_head_wrapped_before_apply_still_gives_its_log_probabilities():
    """TRL's trainers give the model a forward of their own (add_fused_lm_head) and call it
    with fused_lm_head=True for per-token log-probabilities. apply after it (on
    trainer.model) must hand those calls to TRL's forward, not compute a loss instead."""
    add_fused_lm_head = pytest.importorskip("trl.trainer.utils").__dict__.get("add_fused_lm_head")
    if add_fused_lm_head is None:
        pytest.skip("this TRL has no add_fused_lm_head")
    plain = tiny_model("Llama")
    add_fused_lm_head(plain)
    ours = applied(copy.deepcopy(plain))
    ids = token_ids(2)
    want = plain(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
    got = ours(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
    assert_close("log-probabilities", got.detach(), want.detach(), LOSS_TOL)
    assert ours(input_ids=ids, labels=ids).logits is None  # the fused loss still serves the plain calls


@pytest.mark.parametrize("label", TESTED)
def test_without_labels_the_logits_are_the_models(label):
    plain = tiny_model(label).eval()
    ours = applied(copy.deepcopy(plain))
    ids = token_ids(2)
    with torch.no_grad():
        logits = ours(input_ids=ids).logits
    assert_logits_match(["logits"], [logits], plain, lambda m: [m(input_ids=ids).logits])


# --------------------------------------------------------------------------------
# 5.-7. generate(), padded batches, packed rows
# --------------------------------------------------------------------------------
def left_padded(ids, pads):
    """ids with the first pads[row] tokens of each row replaced by padding, and its mask."""
    ids, mask = ids.clone(), torch.ones_like(ids)
    for row, n in enumerate(pads):
        ids[row, :n], mask[row, :n] = 0, 0
    return ids, mask


@pytest.mark.parametrize("label", ["Llama", "Gemma-2"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_generate_gives_the_same_greedy_tokens(label, padding):
    plain = tiny_model(label).eval()
    ours = applied(copy.deepcopy(plain))
    ids, mask = left_padded(token_ids(2, 6), [0, 2])
    kwargs = dict(max_new_tokens=8, do_sample=False, **({"attention_mask": mask} if padding == "left" else {}))
    want = plain.generate(ids, **kwargs)
    got = ours.generate(ids, **kwargs)
    assert want.shape == (2, 14)
    assert torch.equal(got, want), f"{got.tolist()} vs {want.tolist()}"


def test_a_static_cache_runs_the_models_attention():
    """A StaticCache hands each layer keys as long as its capacity, the prefill included:
    those calls go to the model's own attention, as a filled cache's do."""
    plain = tiny_model("Llama").eval()
    ours = applied(copy.deepcopy(plain))
    ids = token_ids(2, 6)
    kwargs = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    want, got = plain.generate(ids, **kwargs), ours.generate(ids, **kwargs)
    assert torch.equal(got, want), f"{got.tolist()} vs {want.tolist()}"


def test_a_cache_passed_by_either_name_runs_the_models_attention():
    """A filled cache passed by hand, under the name of either transformers (5.24 calls it
    ``cache`` and still takes ``past_key_values`` through **kwargs): the next tokens' keys
    include the cached ones, so those calls go to the model's own attention."""
    import inspect

    plain = tiny_model("Llama").eval()
    ours = applied(copy.deepcopy(plain))
    ids = token_ids(2, 9)
    renamed = "cache" in inspect.signature(type(plain).forward).parameters
    names = ["past_key_values", "cache"] if renamed else ["past_key_values"]
    with torch.no_grad():
        for name in names:
            want = plain(ids[:, 6:], **{name: plain(ids[:, :6], use_cache=True)[1]}).logits
            got = ours(ids[:, 6:], **{name: ours(ids[:, :6], use_cache=True)[1]}).logits
            torch.testing.assert_close(got, want, msg=lambda m: f"{name}=: {m}")


def test_attention_weights_asked_for_come_from_the_models_attention(attention_calls):
    """output_attentions=True needs the weights, which ours never forms: the model's own
    attention runs; and an implementation set after apply is kept."""
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(tiny_config("Llama"), attn_implementation="eager")
    plain = plain.to(DEVICE).eval()
    ours = applied(copy.deepcopy(plain))
    ids = token_ids(2)
    want = plain(input_ids=ids, output_attentions=True).attentions
    attention_calls.clear()
    got = ours(input_ids=ids, output_attentions=True).attentions
    assert len(got) == len(want) == 2 and not attention_calls
    for a, b in zip(got, want):
        assert_close("attention weights", a, b, LOSS_TOL)
    ours.set_attn_implementation("eager")  # the user's choice after apply: kept, also after a padded call
    ours(input_ids=ids, attention_mask=torch.ones_like(ids))
    ours(input_ids=ids)
    assert ours.config._attn_implementation == "eager" and not attention_calls


@pytest.mark.parametrize("label", ["Llama", "Phi-3"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_runs_the_models_attention(label, side, attention_calls):
    plain = tiny_model(label).eval()
    ours = applied(copy.deepcopy(plain))
    attention_calls.clear()  # (apply's own check ran it)
    ids, mask = token_ids(2), torch.ones(2, SEQ, dtype=torch.long, device=DEVICE)
    pads = {1: 5}  # row 1: 5 padding tokens
    for row, n in pads.items():
        where = slice(SEQ - n, SEQ) if side == "right" else slice(0, n)
        ids[row, where], mask[row, where] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    real = mask.bool()
    with torch.no_grad():
        logits = ours(input_ids=ids, attention_mask=mask).logits
        loss = ours(input_ids=ids, attention_mask=mask, labels=labels).loss
        want_loss = plain(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert attention_calls == [], "a padded batch ran our attention"
    assert_logits_match(["logits of the real tokens"], [logits[real]], plain,
                        lambda m: [m(input_ids=ids, attention_mask=mask).logits[real]])
    assert_close("loss", loss, want_loss, LOSS_TOL)


def loss_and_gradients(model, **inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def checkpointed_pair(reentrant, label="Llama"):
    """A tiny model and its applied copy, both with gradient checkpointing (reentrant or not)."""
    plain = tiny_model(label)
    ours = applied(copy.deepcopy(plain))
    for model in (plain, ours):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.config.use_cache = False
    return plain, ours


# Gradient checkpointing recomputes each layer in backward, after the decoder's forward
# has set the model back to our attention. A masked batch's layers must recompute with
# the model's own attention and the same mask (attention_routing.ROUTED): without that,
# the reentrant recomputation ran ours without the padding mask (gradients silently
# wrong) and the non-reentrant one stopped at CheckpointError, mask of ones included.
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("pads", [[0, 4], [0, 0]], ids=["left-padded", "mask of ones"])
@pytest.mark.parametrize("label", ["Llama", "Gemma-2"])  # Gemma-2's own: the eager attention (not registered)
def test_gradient_checkpointing_recomputes_a_masked_batch_with_the_models_attention(label, reentrant, pads,
                                                                                     attention_calls):
    plain, ours = checkpointed_pair(reentrant, label)
    ids, mask = left_padded(token_ids(2, 12), pads)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    attention_calls.clear()
    loss, grads = loss_and_gradients(ours, **inputs)
    assert attention_calls == [], "a masked batch ran our attention (in its recomputation)"
    want_loss, want_grads = loss_and_gradients(plain, **inputs)
    assert_close("loss", loss, want_loss, LOSS_TOL)
    assert_close("gradients", grads, want_grads, GRAD_TOL)


def test_a_mask_reaching_our_attention_is_refused_not_ignored():
    model = tiny_model("Llama")
    layer = next(attention_routing._attention_layers(model))
    q = torch.randn(1, model.config.num_attention_heads, 4, layer.head_dim, device=DEVICE)
    k = torch.randn(1, model.config.num_key_value_heads, 4, layer.head_dim, device=DEVICE)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="attention mask .* cannot apply"):
        attention_routing.hf_packed_attention(layer, q, k, k, mask)


def dropout_loss_and_gradients(model, ids, seed=5):
    """A training step's loss and gradients with the dropout masks of ``seed``."""
    torch.manual_seed(seed)
    return loss_and_gradients(model, input_ids=ids, labels=ids)


def test_attention_dropout_leaves_the_attention_to_the_model_and_keeps_its_loss(attention_calls):
    plain = tiny_model("Llama")
    plain.config.attention_dropout = 0.3
    for layer in attention_routing._attention_layers(plain):
        layer.attention_dropout = 0.3
    ours = copy.deepcopy(plain)
    report, warned = apply_and_warnings(ours)
    assert report["attention"]["status"] == "left to PyTorch", report["attention"]
    assert "attention_dropout = 0.3" in report["attention"]["detail"] and len(warned) == 1, warned
    ids = token_ids(2)
    want_loss, want_grads = dropout_loss_and_gradients(plain, ids)
    attention_calls.clear()  # the probes' calls
    loss, grads = dropout_loss_and_gradients(ours, ids)
    assert not attention_calls
    assert abs(loss - want_loss) <= LOSS_TOL and rel_err(grads, want_grads) <= GRAD_TOL
    # The masks differ with the seed: the dropout is drawn, not skipped.
    assert abs(dropout_loss_and_gradients(plain, ids, seed=6)[0] - want_loss) > 10 * LOSS_TOL


def test_attention_dropout_set_after_apply_runs_the_models_attention(attention_calls):
    plain = tiny_model("Llama")
    ours = applied(copy.deepcopy(plain))
    for model in (plain, ours):
        for layer in attention_routing._attention_layers(model):
            layer.attention_dropout = 0.3
    ids = token_ids(2)
    want_loss, want_grads = dropout_loss_and_gradients(plain, ids)
    attention_calls.clear()  # the probes' calls
    loss, grads = dropout_loss_and_gradients(ours, ids)
    assert not attention_calls  # every call dropped, so every call ran the model's own attention
    assert abs(loss - want_loss) <= LOSS_TOL and rel_err(grads, want_grads) <= GRAD_TOL
    ours.eval()  # no dropout in eval: ours again (packed rows without a cache: ours on any device, never measured)
    positions = torch.arange(SEQ // 2, device=DEVICE).repeat(2)[None].expand(2, SEQ)
    with torch.no_grad():
        ours(input_ids=ids, position_ids=positions, use_cache=False)
    assert attention_calls


# Rows of one document (no position ids): the faster of ours and the model's own SDPA,
# measured per shape on a GPU (attention_routing.plain_rows_to_theirs). On the CPU
# nothing is measured; these tests make the CPU a measured device and give the timings.
@pytest.fixture
def measured_here(monkeypatch):
    """The CPU as a measured device, an empty table of choices, and the timings the
    measurement returns set by the test: ``timings["ms"] = (ours, theirs)``."""
    timings = {"ms": (1.0, 2.0), "calls": 0}

    def fake_timing(layer, key):
        timings["calls"] += 1
        return timings["ms"]

    monkeypatch.setattr(attention_routing, "MEASURED_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(attention_routing, "PLAIN_ROW_CHOICES", {})
    monkeypatch.setattr(attention_routing, "time_plain_rows", fake_timing)
    lines = []
    monkeypatch.setattr(attention_routing, "CHOICE_LISTENERS", [lines.append])
    timings["lines"] = lines
    return timings


@pytest.mark.parametrize("faster", ["ours", "theirs"])
def test_rows_of_one_document_run_the_attention_measured_faster(faster, measured_here, attention_calls):
    plain = tiny_model("Llama")
    ours = applied(copy.deepcopy(plain))
    measured_here["ms"] = (1.0, 2.0) if faster == "ours" else (2.0, 1.0)
    ids = token_ids(2, 12)
    attention_calls.clear()
    loss, grads = loss_and_gradients(ours, input_ids=ids, labels=ids)
    loss_and_gradients(ours, input_ids=ids, labels=ids)  # the same shape again: measured once
    want_loss, want_grads = loss_and_gradients(plain, input_ids=ids, labels=ids)
    assert measured_here["calls"] == 1
    layers = plain.config.num_hidden_layers
    assert len(attention_calls) == (2 * layers if faster == "ours" else 0)
    assert_close("loss", loss, want_loss, LOSS_TOL)
    assert_close("gradients", grads, want_grads, GRAD_TOL)
    (line,) = measured_here["lines"]
    assert line.startswith("rows of one document, 2 x 12 tokens") and ("sdpa)" in line) == (faster == "theirs")
    # Packed rows (position ids) are ours without a measurement, whatever was measured.
    positions = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12).to(DEVICE)
    attention_calls.clear()
    loss_and_gradients(ours, input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    assert len(attention_calls) == layers and measured_here["calls"] == 1


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_rows_routed_by_the_measurement_recompute_with_the_models_attention(reentrant, measured_here,
                                                                            attention_calls):
    plain, ours = checkpointed_pair(reentrant)
    measured_here["ms"] = (2.0, 1.0)
    ids = token_ids(2, 12)
    attention_calls.clear()
    loss, grads = loss_and_gradients(ours, input_ids=ids, labels=ids)
    assert attention_calls == []
    want_loss, want_grads = loss_and_gradients(plain, input_ids=ids, labels=ids)
    assert_close("loss", loss, want_loss, LOSS_TOL)
    assert_close("gradients", grads, want_grads, GRAD_TOL)


def test_no_measurement_without_gradients_or_for_a_sliding_window_shorter_than_the_row(measured_here,
                                                                                      attention_calls):
    ours = applied(tiny_model("Llama"))
    measured_here["ms"] = (2.0, 1.0)
    ids = token_ids(1, 12)
    attention_calls.clear()
    with torch.no_grad():  # generate()'s calls: a shape not measured yet runs ours
        ours(input_ids=ids, use_cache=False)
    assert measured_here["calls"] == 0 and len(attention_calls) == ours.config.num_hidden_layers
    ours.config.sliding_window = 8  # shorter than the row: SDPA would need a dense mask
    decoder = attention_routing.decoder_of(ours)
    assert attention_routing._plain_row_key(decoder, {"input_ids": ids}) is None
    ours.config.sliding_window = 12
    key, _ = attention_routing._plain_row_key(decoder, {"input_ids": ids})
    assert key[2:] == (1, 12, ours.config.num_attention_heads, ours.config.num_key_value_heads,
                       next(attention_routing._attention_layers(ours)).head_dim, "sdpa")


def test_a_window_shorter_than_the_row_keeps_ours_unmeasured(measured_here, attention_calls):
    """Mistral keeps its window on the config, not on its layers: rows longer than it
    are ours (SDPA would need a dense mask; given none it would drop the window)."""
    config = tiny_config("Mistral")
    config.sliding_window = 6
    torch.manual_seed(0)
    plain = models.build_random(config, torch.device(DEVICE), torch.float32).eval()
    ours = applied(copy.deepcopy(plain))
    measured_here["ms"] = (2.0, 1.0)
    ids = token_ids(2, 12)
    attention_calls.clear()
    logits = ours(input_ids=ids, use_cache=False).logits  # with gradients: a measured choice would apply
    assert measured_here["calls"] == 0 and len(attention_calls) == config.num_hidden_layers
    assert_logits_match(["logits"], [logits.detach()], plain, lambda m: [m(input_ids=ids, use_cache=False).logits])


def test_a_measurement_out_of_memory_keeps_ours_and_says_so(measured_here, monkeypatch, attention_calls):
    def no_room(layer, key):
        raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(attention_routing, "time_plain_rows", no_room)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    ours = applied(tiny_model("Llama"))
    ids = token_ids(1, 12)
    attention_calls.clear()
    loss_and_gradients(ours, input_ids=ids, labels=ids)
    assert len(attention_calls) == ours.config.num_hidden_layers
    (line,) = measured_here["lines"]
    assert line.endswith(": ours, not measured (OutOfMemoryError: CUDA out of memory (a stand-in))"), line


def test_past_the_measured_shapes_a_new_one_takes_the_nearest_choice(measured_here, monkeypatch):
    monkeypatch.setattr(attention_routing, "MAX_MEASURED_SHAPES", 2)
    ours = applied(tiny_model("Llama"))
    decoder = attention_routing.decoder_of(ours)
    for length, ms in ((4, (1.0, 2.0)), (16, (2.0, 1.0))):
        measured_here["ms"] = ms
        assert attention_routing.plain_rows_to_theirs(decoder, {"input_ids": token_ids(1, length)}) == (length == 16)
    assert attention_routing.plain_rows_to_theirs(decoder, {"input_ids": token_ids(1, 6)}) is False  # nearest: 4
    assert attention_routing.plain_rows_to_theirs(decoder, {"input_ids": token_ids(1, 13)}) is True  # nearest: 16
    assert measured_here["calls"] == 2


def test_on_a_gpu_rows_of_one_document_are_measured_and_keep_the_models_loss(monkeypatch, attention_calls):
    """The real measurement (CUDA events) on a GPU: the first plain call records both
    times and the faster, and the loss and gradients are the model's own in bf16."""
    need_gpu()
    monkeypatch.setattr(attention_routing, "PLAIN_ROW_CHOICES", {})
    plain = tiny_model("Llama").to(torch.bfloat16)
    ours = applied(copy.deepcopy(plain))
    ids = token_ids(2, 256)
    loss, grads = loss_and_gradients(ours, input_ids=ids, labels=ids)
    (key, (theirs_faster, ours_ms, theirs_ms, failed)), = attention_routing.PLAIN_ROW_CHOICES.items()
    assert key[1:4] == (torch.bfloat16, 2, 256) and ours_ms > 0 and theirs_ms > 0 and failed is None
    # The second call runs what was kept, every layer.
    attention_calls.clear()
    loss_and_gradients(ours, input_ids=ids, labels=ids)
    assert len(attention_calls) == (0 if theirs_faster else plain.config.num_hidden_layers)
    want_loss, want_grads = loss_and_gradients(plain, input_ids=ids, labels=ids)
    assert_close("loss", loss.float(), want_loss.float(), 1e-2)
    assert rel_err(grads, want_grads) < 5e-2, rel_err(grads, want_grads)


def test_the_measurement_times_both_attentions_on_rows_of_the_shape(monkeypatch):
    """time_plain_rows itself, with a host clock on the CPU: after a first call each,
    ours and theirs run fwd+bwd in turn, ``repeats`` timed calls each, on rows of the
    key's shape through the layer (its scaling, heads and causality) and in its layout,
    out of the sight of the caller's saved-tensor hooks."""
    import time

    model = tiny_model("Llama")
    layer = next(attention_routing._attention_layers(model))
    key = (str(DEVICE), torch.float32, 2, 12, model.config.num_attention_heads, model.config.num_key_value_heads,
           layer.head_dim, "sdpa")
    clocked = []

    def clock(call):
        start = time.perf_counter()
        call()
        clocked.append(1)
        return (time.perf_counter() - start) * 1e3

    # The rows in the layout the layer's projections give: [B, h, T, D] views of [B, T, h, D].
    layouts = []
    ours = attention_routing.hf_packed_attention

    def recorded(module, q, k, v, *args, **kwargs):
        layouts.append([t.transpose(1, 2).is_contiguous() for t in (q, k, v)])
        return ours(module, q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention_routing, "hf_packed_attention", recorded)
    # It runs inside the user's forward: saved-tensor hooks around that (offloading, a
    # memory count) see none of its tensors.
    (ours_ms, theirs_ms), kept = saved_bytes(lambda: attention_routing.time_plain_rows(layer, key, repeats=3,
                                                                                      clock=clock))
    assert len(clocked) == 6 and ours_ms > 0 and theirs_ms > 0
    assert kept == 0
    assert layouts == [[True] * 3] * 4, layouts


@pytest.mark.parametrize("label", TESTED)
def test_packed_rows_give_each_documents_logits_and_the_loss(label, attention_calls):
    """DataCollatorWithFlattening's rows: documents one after another, position ids
    restarting at 0, no attention mask; each document's logits are its own, and the
    loss with the collator's labels is the model's."""
    plain = tiny_model(label).eval()
    ours = applied(copy.deepcopy(plain))
    attention_calls.clear()
    documents = [token_ids(1, n, seed=10 + n)[0].tolist() for n in (5, 7, 4)]
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": d} for d in documents])
    assert "attention_mask" not in batch and batch["position_ids"].tolist() == [
        list(range(5)) + list(range(7)) + list(range(4))]
    # use_cache=False, as in training: with a cache HF's own attention does not look for
    # documents in the position ids.
    with torch.no_grad():
        logits = ours(input_ids=batch["input_ids"].to(DEVICE), position_ids=batch["position_ids"].to(DEVICE),
                      use_cache=False).logits
    pieces = logits[0].split([len(d) for d in documents])
    layers = plain.config.num_hidden_layers
    assert len(attention_calls) == layers  # Gemma-2's soft-capped scores too

    def each_alone(model):
        return [model(input_ids=torch.tensor([d], device=DEVICE)).logits[0] for d in documents]

    assert_logits_match([f"document {i}" for i in range(len(documents))], list(pieces), plain, each_alone)
    inputs = {k: batch[k].to(DEVICE) for k in ("input_ids", "position_ids", "labels")}
    with torch.no_grad():
        assert_close("loss", ours(**inputs, use_cache=False).loss, plain(**inputs, use_cache=False).loss, LOSS_TOL)


def test_packed_rows_with_use_cache_on_get_the_models_attention_across_documents(attention_calls, monkeypatch):
    """With use_cache on (a config's default, in training too) a decoder keeps a cache and
    transformers then reads no documents from the position ids: each row attends across
    its documents. The model's own attention runs such calls (its loss and gradients), and
    a training call says once how to get ours; use_cache=False gives each document alone."""
    monkeypatch.setattr(swap_common, "SAID", set())
    plain = tiny_model("Llama")
    ours = applied(copy.deepcopy(plain))
    ids = token_ids(2, 12)
    positions = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12).to(DEVICE)
    assert plain.config.use_cache
    for cache in ({}, {"use_cache": True}):
        attention_calls.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, grads = loss_and_gradients(ours, input_ids=ids, position_ids=positions, labels=ids, **cache)
        warned = [str(w.message) for w in caught if "use_cache" in str(w.message)]
        assert len(warned) == (0 if cache else 1), warned  # once
        want_loss, want_grads = loss_and_gradients(plain, input_ids=ids, position_ids=positions, labels=ids, **cache)
        assert not attention_calls
        assert_close("loss", loss, want_loss, LOSS_TOL)
        assert_close("gradients", grads, want_grads, GRAD_TOL)
    attention_calls.clear()
    loss, _ = loss_and_gradients(ours, input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    want_loss, _ = loss_and_gradients(plain, input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    assert len(attention_calls) == plain.config.num_hidden_layers
    assert_close("loss, use_cache=False", loss, want_loss, LOSS_TOL)
    assert abs(loss - want_loss) < abs(loss - loss_and_gradients(plain, input_ids=ids, position_ids=positions,
                                                                  labels=ids)[0])  # the two differ


def test_packed_rows_under_gradient_checkpointing_run_ours_with_use_cache_on(attention_calls, monkeypatch):
    """Under gradient checkpointing transformers turns use_cache off itself for a training
    call with gradients, so packed rows are split into documents even with use_cache on
    in the config: ours runs them (no warning), with the model's loss and gradients."""
    monkeypatch.setattr(swap_common, "SAID", set())
    plain = tiny_model("Llama")
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ours = applied(copy.deepcopy(plain))
    assert ours.config.use_cache
    ids = token_ids(2, 12)
    positions = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12).to(DEVICE)
    attention_calls.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads = loss_and_gradients(ours, input_ids=ids, position_ids=positions, labels=ids)
    assert not [str(w.message) for w in caught if "use_cache" in str(w.message)]
    assert len(attention_calls) >= plain.config.num_hidden_layers
    want_loss, want_grads = loss_and_gradients(plain, input_ids=ids, position_ids=positions, labels=ids)
    assert_close("loss", loss, want_loss, LOSS_TOL)
    assert_close("gradients", grads, want_grads, GRAD_TOL)


def test_a_second_apply_after_set_attn_implementation_keeps_ours_with_use_cache_on():
    """apply, then the model's attention set to SDPA by hand, then apply again: the check
    of the attention kernel probes packed rows through the routing the first apply left,
    with the config's use_cache on; the probes run without a cache (as training does), so
    the kernel is found to compute the model's function and goes in again."""
    model = applied(tiny_model("Llama"))
    assert model.config.use_cache
    model.set_attn_implementation("sdpa")
    report, _ = apply_and_warnings(model)
    assert report["attention"]["status"] == "applied", report["attention"]
    assert model.config.use_cache  # put back after the probes


@pytest.mark.parametrize("positions", [[0, 1, 2, 3, 1, 2, 3, 4, 5, 9, 10, 11, 4, 5, 6, 7],  # restarts not at 0
                                       list(range(40, 56))])  # one document from an offset
def test_position_ids_split_documents_as_transformers_does(positions, attention_calls):
    """A document begins wherever a position does not follow the one before by 1,
    as transformers' own packed-row mask has it (use_cache=False, as in training):
    the same logits as the model's own attention with that mask."""
    plain = tiny_model("Llama").eval()
    ours = applied(copy.deepcopy(plain))
    attention_calls.clear()
    inputs = {"input_ids": token_ids(1, len(positions)), "position_ids": torch.tensor([positions], device=DEVICE),
              "use_cache": False}
    with torch.no_grad():
        logits = ours(**inputs).logits[0]
    assert len(attention_calls) == plain.config.num_hidden_layers
    assert_logits_match(["logits"], [logits], plain, lambda model: [model(**inputs).logits[0]])


# --------------------------------------------------------------------------------
# 7b. Multimodal models: the kernels in the text decoder, the other towers as they were
# --------------------------------------------------------------------------------
# An image-text-to-text model runs its vision tower (bidirectional attention over the
# patches, its own rotations) only when given an image, and merges the image features into
# the text in its base model before the decoder. No probe of apply feeds it an image, so
# these runs do: one image beside the text, its loss and every gradient.
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, initializer_range=0.2)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)  # a 28 x 28 image: 2 x 2 patches, 4 image tokens in the text
IMAGE_TOKEN, IMAGE_TOKENS = VOCAB - 1, 4
# family -> (the kernels apply leaves to PyTorch there, and why)
MULTIMODAL = {
    "LLaVA": (),
    "Mistral-3": (),
    "Gemma-3": ("attention", "residual"),  # its base model builds the text's masks (a padded row would not reach
    # theirs); four norms per layer
    "Qwen2-VL": ("attention",),  # 3-D positions (M-RoPE): no documents to read from them
    "Qwen3-VL": (),  # its layers get the text's positions (or none, beside an image): causal rows
}


def multimodal(family):
    """(a tiny random model of the family in float32, the keyword arguments of one image for ids)."""
    t = transformers
    gen = torch.Generator().manual_seed(2)
    if family == "LLaVA":
        config = t.LlavaConfig(text_config=t.LlamaConfig(**TEXT), vision_config=t.CLIPVisionConfig(**VISION),
                               image_token_index=IMAGE_TOKEN)
        cls = t.LlavaForConditionalGeneration

        def image(ids):
            return {"pixel_values": torch.randn(1, 3, 28, 28, generator=gen)}
    elif family == "Mistral-3":
        config = t.Mistral3Config(text_config={**TEXT, "head_dim": 16}, vision_config={**VISION, "head_dim": 16},
                                  image_token_index=IMAGE_TOKEN, spatial_merge_size=1)
        cls = t.Mistral3ForConditionalGeneration

        def image(ids):
            return {"pixel_values": torch.randn(1, 3, 28, 28, generator=gen), "image_sizes": torch.tensor([[28, 28]])}
    elif family == "Gemma-3":
        config = t.Gemma3Config(text_config={**TEXT, "head_dim": 16, "sliding_window": 8}, vision_config=VISION,
                                mm_tokens_per_image=IMAGE_TOKENS, image_token_index=IMAGE_TOKEN)
        cls = t.Gemma3ForConditionalGeneration

        def image(ids):  # the image's tokens see each other both ways (token_type_ids)
            return {"pixel_values": torch.randn(1, 3, 28, 28, generator=gen),
                    "token_type_ids": (ids == IMAGE_TOKEN).long()}
    elif family == "Qwen2-VL":
        config = t.Qwen2VLConfig(text_config={**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]}},
                                 vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14,
                                                    spatial_merge_size=2, temporal_patch_size=2),
                                 image_token_id=IMAGE_TOKEN)
        cls = t.Qwen2VLForConditionalGeneration
    else:
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
        config = t.Qwen3VLConfig(text_config={**TEXT, "head_dim": 16, "rope_parameters": rope},
                                 vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                                    out_hidden_size=64, num_position_embeddings=16,
                                                    deepstack_visual_indexes=[0]),
                                 image_token_id=IMAGE_TOKEN)
        cls = t.Qwen3VLForConditionalGeneration

    if family.startswith("Qwen"):
        def image(ids):  # 4 x 4 patches of 14 (2 frames of 3 channels each), merged 2 x 2: 4 tokens
            return {"pixel_values": torch.randn(16, 2 * 3 * 14 * 14, generator=gen),
                    "image_grid_thw": torch.tensor([[1, 4, 4]]), "mm_token_type_ids": (ids == IMAGE_TOKEN).long()}
    torch.manual_seed(0)
    model = cls(config).float().to(DEVICE).eval()
    return model, lambda ids: {k: v.to(DEVICE) for k, v in image(ids).items()}


@pytest.mark.parametrize("family", MULTIMODAL)
def test_a_multimodal_model_with_an_image_gives_its_own_loss_and_gradients(family):
    """apply swaps the text decoder's kernels only (the vision tower keeps its attention),
    and the fused loss runs the model's base model, which merges the image into the text."""
    plain, image = multimodal(family)
    ours = copy.deepcopy(plain)
    report, _ = apply_and_warnings(ours)
    assert sorted(report.left_out) == sorted(MULTIMODAL[family]), report.left_out
    assert "flce" in report.applied and "rope" in report.applied  # rope: the text config's head_dim
    if "attention" in report.applied:  # the two text layers only, not the vision tower's
        assert report["attention"]["count"] == TEXT["num_hidden_layers"]
    towers = [key for key in plain.config.sub_configs if key != "text_config"]
    assert [getattr(ours.config, k)._attn_implementation for k in towers] == \
           [getattr(plain.config, k)._attn_implementation for k in towers]
    ids = token_ids(1, 12)
    ids[0, 2:2 + IMAGE_TOKENS] = IMAGE_TOKEN
    inputs = image(ids)
    their_loss, theirs = loss_and_gradients(plain, input_ids=ids, labels=ids, **inputs)
    our_loss, grads = loss_and_gradients(ours, input_ids=ids, labels=ids, **inputs)
    assert_close("loss", our_loss, their_loss, LOSS_TOL)
    assert_close("gradients", grads, theirs, GRAD_TOL)


def test_a_multimodal_model_that_merges_the_images_in_its_own_forward_keeps_its_loss():
    """Llama-4's image-text model has no base model: its forward merges the images, then
    calls a causal LM of its own. The fused loss cannot see them there: refused in one line
    (HF's loss on the logits by the fused cross-entropy instead), and apply does not raise."""
    from tools.family_sweep import tiny_image_text_config

    torch.manual_seed(0)
    config = tiny_image_text_config("llama4")
    plain = transformers.AutoModelForImageTextToText.from_config(config).float().to(DEVICE).eval()
    ours = copy.deepcopy(plain)
    ids = token_ids(2, 12)
    try:
        their_loss, theirs = loss_and_gradients(plain, input_ids=ids, labels=ids)
    except AttributeError as e:  # transformers 5.24's own forward reads an output field its language model lacks
        report, _ = apply_and_warnings(ours)  # then the loss's probe refuses, nothing raises
        assert "merges the images into the text" in report.left_out["flce"]
        assert "own forward fails on a probe" in report.left_out["ce"]
        pytest.skip(f"Llama-4's image-text model does not run by itself under transformers "
                    f"{transformers.__version__} ({e})")
    report, _ = apply_and_warnings(ours)
    assert "merges the images into the text" in report.left_out["flce"]
    assert "ce" in report.applied
    our_loss, grads = loss_and_gradients(ours, input_ids=ids, labels=ids)
    assert_close("loss", our_loss, their_loss, LOSS_TOL)
    assert_close("gradients", grads, theirs, GRAD_TOL)


# --------------------------------------------------------------------------------
# 8. The report and the refusals
# --------------------------------------------------------------------------------
def test_report_has_one_line_per_kernel_and_is_json():
    model = tiny_model("Llama")
    report, warned = apply_and_warnings(model)
    assert warned == [] and report.left_out == {}
    assert list(report) == list(kernel_ft.KERNELS)
    lines = str(report).splitlines()
    assert [line.split()[0] for line in lines] == list(kernel_ft.KERNELS)
    for line, (kernel, entry) in zip(lines, report.items()):
        assert entry["status"] in line and entry["detail"] in line
    assert json.loads(json.dumps(dict(report))) == dict(report)
    assert report.applied == ["rmsnorm", "residual", "swiglu", "flce", "rope", "attention", "projections"]
    assert report["fp8"]["status"] == report["ce"]["status"] == report["lora"]["status"] == "not used"


def test_what_a_family_cannot_run_is_left_to_pytorch_with_one_warning():
    model = tiny_model("Cohere")  # LayerNorm, not RMSNorm; RoPE on interleaved pairs
    report, warned = apply_and_warnings(model)
    assert list(report.left_out) == ["rmsnorm", "residual", "rope"], report.left_out
    for name in report.left_out:
        assert report[name]["status"] == "left to PyTorch" and "\n" not in report[name]["detail"]
    assert "RMSNorm" in report["rmsnorm"]["detail"]
    assert len(warned) == 1 and all(f"{k} (" in warned[0] for k in report.left_out), warned
    assert report["attention"]["status"] == "applied"


def test_a_sequence_classifier_keeps_its_loss_and_runs_our_attention(attention_calls):
    """A classifier's loss is over one pooled row of logits, not the next token: flce and
    ce are not used (said, no warning), and the attention's probes compare the decoder's
    last hidden states, so the kernel goes in and gives the model's own loss and gradients."""
    torch.manual_seed(0)
    config = tiny_config("Llama")
    config.num_labels = 3
    theirs = transformers.AutoModelForSequenceClassification.from_config(config).to(DEVICE).train()
    ours = copy.deepcopy(theirs)
    report, warned = apply_and_warnings(ours)
    assert warned == [], warned
    assert report.applied == ["rmsnorm", "residual", "swiglu", "rope", "attention", "projections"], str(report)
    for kernel in ("flce", "ce"):
        assert report[kernel]["status"] == "not used" and "ForSequenceClassification" in report[kernel]["detail"]
    ids, labels = token_ids(2), torch.tensor([0, 2], device=DEVICE)
    padded = ids.clone()
    padded[1, -5:] = config.pad_token_id  # right padding: the classifier pools each row's last real token
    # Packed rows (two documents each): ours, also on a GPU, where rows of one document may be measured faster in
    # SDPA and routed there (without a cache, as in training, HF splits its own attention by the positions too);
    # a padded batch: the model's own attention.
    positions = torch.cat([torch.arange(10), torch.arange(SEQ - 10)]).expand(2, SEQ).to(DEVICE)
    for inputs in ({"input_ids": ids, "position_ids": positions, "use_cache": False},
                   {"input_ids": padded, "attention_mask": (padded != 0).long()}):
        calls = len(attention_calls)
        losses = []
        for model in (ours, theirs):
            model.zero_grad()
            loss = model(**inputs, labels=labels).loss
            loss.backward()
            losses.append(loss)
        assert_close(f"loss {list(inputs)}", losses[0], losses[1], LOSS_TOL)
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert_close(f"{name}.grad {list(inputs)}", a.grad, b.grad, GRAD_TOL)
        ran_ours = len(attention_calls) > calls
        assert ran_ours == ("attention_mask" not in inputs), "the padded batch goes to the model's attention"


def test_strict_raises_kernel_not_applied_on_cohere():
    with pytest.raises(kernel_ft.KernelNotApplied) as raised:
        kernel_ft.apply(tiny_model("Cohere"), strict=True)
    assert isinstance(raised.value, ValueError)
    assert raised.value.kernel == "rmsnorm" and "RMSNorm" in raised.value.reason
    assert "rmsnorm" in str(raised.value) and "\n" not in str(raised.value)


def test_compiled_model_is_refused_in_one_line():
    compiled = torch.compile(tiny_model("Llama"))
    with pytest.raises(TypeError) as raised:
        kernel_ft.apply(compiled)
    message = str(raised.value)
    assert "OptimizedModule" in message and "call apply on the model before" in message, message
    assert "torch.compile" in message and "\n" not in message


def test_second_apply_does_not_wrap_twice(fused_loss_calls):
    model = tiny_model("Llama")
    ids = token_ids(2)
    applied(model)
    with torch.no_grad():
        first = model(input_ids=ids, labels=ids).loss
        logits = model(input_ids=ids).logits
    assert len(fused_loss_calls) == 1
    apply_and_warnings(model)  # (what it reports: the next test)
    with torch.no_grad():
        second = model(input_ids=ids, labels=ids).loss
        assert torch.equal(model(input_ids=ids).logits, logits)
    assert len(fused_loss_calls) == 2, "the fused loss ran twice in one forward"
    assert torch.equal(second, first)
    # HF's own forwards under ours, once: the causal LM's (flce) and the decoder's (attention routing).
    assert model._kernel_ft_forward.__func__ is type(model).forward
    decoder = model.get_decoder()
    assert decoder._kernel_ft_attention_forward.__func__ is type(decoder).forward


def test_second_apply_reports_what_the_model_runs():
    """A second call finds every kernel in place: same report, no warning (and so
    strict=True must not raise)."""
    model = tiny_model("Llama")
    first, _ = apply_and_warnings(model)
    second, warned = apply_and_warnings(model)
    assert warned == [], warned
    assert {k: v["status"] for k, v in second.items()} == {k: v["status"] for k, v in first.items()}, str(second)
    kernel_ft.apply(model, strict=True)


def our_forwards(model):
    """{(module name, attribute): (its function, whether bound to that module)} of every
    forward apply set on an instance."""
    from swap_common import our_forward

    return {(name, attribute): (ours.function, ours.module is module)
            for name, module in model.named_modules() for attribute, value in vars(module).items()
            if (ours := our_forward(value)) is not None}


@pytest.mark.parametrize("label", ["Llama", "LoRA", "Mixtral"])
def test_a_model_after_apply_pickles_and_copies_with_its_kernels(label, fused_loss_calls):
    """torch.save(model) / torch.load and copy.deepcopy keep every kernel apply put in,
    each bound to its own copy of the module: the same loss and gradients, the fused loss
    running, the forward's signature (Trainer reads it), also where accelerate binds its
    __func__ again. A bound method would pickle as a name lookup that finds nothing, or
    the class's own forward (the kernel silently gone)."""
    import inspect
    import io
    import types

    model = applied(lora_model(0.0) if label == "LoRA" else tiny_model(label))
    ids = token_ids(2)
    want_loss, want_grads = loss_and_grads(model, ids, ids)
    causal_lm = model.get_base_model() if label == "LoRA" else model  # (PEFT's own forward shows *args, **kwargs)
    # As accelerate's mixed precision and compile_regions rebind a forward: its __func__ bound again.
    rebound = types.MethodType(causal_lm.forward.__func__, causal_lm)
    assert inspect.signature(rebound) == inspect.signature(causal_lm.forward)
    assert "labels" in inspect.signature(rebound).parameters
    with torch.no_grad():
        assert torch.equal(rebound(input_ids=ids, labels=ids).loss, causal_lm(input_ids=ids, labels=ids).loss)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert our_forwards(copied).keys() == our_forwards(model).keys() and our_forwards(model)
        assert all(own for _, own in our_forwards(copied).values()), "a forward bound to the original's module"
        assert [f for f, _ in our_forwards(copied).values()] == [f for f, _ in our_forwards(model).values()]
        copied_lm = copied.get_base_model() if label == "LoRA" else copied
        assert inspect.signature(copied_lm.forward) == inspect.signature(causal_lm.forward)
        calls = len(fused_loss_calls)
        loss, grads = loss_and_grads(copied, ids, ids)
        assert len(fused_loss_calls) == calls + 1, "the copy did not run the fused loss"
        assert torch.equal(loss, want_loss)
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, want_grads[name]), name


def test_a_model_unwrapped_from_accelerate_mixed_precision_saves_and_loads(fused_loss_calls):
    """accelerate's ``unwrap_model(keep_fp32_wrapper=False)`` strips its autocast wrappers by
    binding the innermost function of their chain to the model as a plain method, which
    pickles by its name. The unwrapped model keeps the fused loss; ``torch.save(model)`` of
    it loads, with the class's forward (as an HF model's own would: the same loss, which
    the layers' kernels, kept, still compute), not an AttributeError at ``torch.load``."""
    import io

    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    model = applied(tiny_model())
    ids = token_ids(2)
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss
    AcceleratorState._reset_state(True)  # this test's settings, whatever a Trainer test left
    try:
        accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=ON_CPU)
        unwrapped = accelerator.unwrap_model(accelerator.prepare_model(model), keep_fp32_wrapper=False)
    finally:
        AcceleratorState._reset_state(True)
    calls = len(fused_loss_calls)
    with torch.no_grad():
        assert torch.equal(unwrapped(input_ids=ids, labels=ids).loss, want)  # no autocast left
    assert len(fused_loss_calls) == calls + 1, "the unwrapped model lost the fused loss"
    buffer = io.BytesIO()
    torch.save(unwrapped, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert_close("loss of the loaded model", loaded(input_ids=ids, labels=ids).loss, want, LOSS_TOL)


def test_accelerate_compile_regions_runs_the_compiled_layers_with_our_kernels(fused_loss_calls):
    """accelerate's regional compilation copies the model and its decoder shallowly, binds
    their forwards to the copies (1.15 through ``__func__``, 1.16 through a partial's
    arguments) and compiles each decoder layer. The copy must run those compiled layers
    with our kernels in them, one compilation serving every layer, with the loss and
    gradients of the model before."""
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from torch._dynamo.testing import CompileCounterWithBackend

    config = tiny_config("Llama")
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    model = applied(models.build_random(config, torch.device(DEVICE), torch.float32).train())
    ids = token_ids(2)
    want_loss, want_grads = loss_and_grads(model, ids, ids)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor" if DEVICE.type == "cuda" else "aot_eager")
    compiled = accelerate_utils.compile_regions(model, backend=counter)
    calls = len(fused_loss_calls)
    loss, grads = loss_and_grads(compiled, ids, ids)
    assert len(fused_loss_calls) == calls + 1, "the copy did not run the fused loss"
    # The layers (one compilation for all four) and each leaf module beside them: the
    # embedding, the final norm, the rotary table, the LM head (a frame each, traced or not).
    layer_frames = [f for f in counter.graphs if any("rope_forward" in str(n.target) for n in f.graph.nodes)]
    assert len(layer_frames) == 1, f"{len(layer_frames)} compilations of the decoder layer"
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    grads = {name.replace("_orig_mod.", ""): grad for name, grad in grads.items()}  # the compiled modules' names
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_accelerate_hooks_on_layers_run_and_offloaded_weights_are_read_where_they_are():
    """accelerate's hooks set their own forward on a module (``add_hook_to_module``; its CPU
    offloading moves each leaf's weights in at the call): a kernel that computes a layer
    without calling it would skip them. Hooks on an attention module before apply, on the
    fused LoRA down_proj and on an attention's base layer after apply all run in a training
    step, and a LoRA model offloaded after apply gives its own loss."""
    hooks = pytest.importorskip("accelerate.hooks")
    accelerate = pytest.importorskip("accelerate")

    class Count(hooks.ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            self.calls += 1
            return args, kwargs

    ids = token_ids(2)

    def step_calls(model, module, apply_after=False):
        counter = Count()
        hooks.add_hook_to_module(module, counter)
        if apply_after:
            kernel_ft.apply(model)
            counter.calls = 0  # apply's probes call the model
        model(input_ids=ids, labels=ids).loss.backward()
        return counter.calls

    model = tiny_model("Llama")  # a hook before apply: fuse_rope leaves the attention's forward to it
    assert step_calls(model, model.model.layers[0].self_attn, apply_after=True) == 1
    model = applied(tiny_model("Llama"))  # after apply, and apply again
    assert step_calls(model, model.model.layers[0].self_attn, apply_after=True) == 1
    model = applied(lora_model(0.0))  # the SwiGLU kernel's fused LoRA down_proj calls its hook
    assert step_calls(model, model.base_model.model.model.layers[0].mlp.down_proj) == 1
    model = applied(lora_model(0.0))  # the fused LoRA layer calls its base layer's hook
    assert step_calls(model, model.base_model.model.model.layers[0].self_attn.o_proj.base_layer) == 1
    model = applied(lora_model(0.0))  # ... in a projection group too (q, k, v)
    assert step_calls(model, model.base_model.model.model.layers[1].self_attn.k_proj.base_layer) == 1

    theirs = lora_model(0.0)
    ours = applied(copy.deepcopy(theirs))
    for model in (theirs, ours):
        accelerate.cpu_offload(model, execution_device=DEVICE)  # every weight on the meta device between calls
    # (Offloaded weights live on the meta device between calls: nothing to train, the loss to compare.)
    want = theirs(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(ours(input_ids=ids, labels=ids).loss, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("label", ["Llama", "LoRA"])
def test_what_save_pretrained_writes_loads_without_kernel_ft(label, tmp_path):
    """After apply and a training step, save_pretrained writes what the model's own
    classes read: plain transformers loads the same tensors under the same names (PEFT:
    the adapters onto a fresh base model) and gives the trained model's loss; PEFT's
    merge_and_unload leaves plain Linear layers with the adapters' outputs. A kernel that
    renamed, stacked or re-registered a weight would save a checkpoint that loads as
    random or missing weights elsewhere."""
    ids = token_ids(2)
    model = lora_model(0.0) if label == "LoRA" else tiny_model("Llama")
    names = set(model.state_dict())
    applied(model)
    loss_and_grads(model, ids, ids)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    assert set(model.state_dict()) == names, "apply changed the state dict's names"
    model.save_pretrained(tmp_path)
    if label == "LoRA":
        peft = pytest.importorskip("peft")
        loaded = peft.PeftModel.from_pretrained(tiny_model("Llama"), tmp_path)
    else:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).to(DEVICE)
    saved, back = model.state_dict(), loaded.state_dict()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(torch.equal(saved[n], back[n]) for n in trained), "a trained weight did not come back"
    for m in (model, loaded):
        m.eval()
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss
        assert_close("loss of the reloaded model", loaded(input_ids=ids, labels=ids).loss, want, LOSS_TOL)
        if label == "LoRA":
            logits = model(input_ids=ids).logits
            merged = model.merge_and_unload()
            assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
            assert_close("logits after merge_and_unload", merged(input_ids=ids).logits, logits, LOSS_TOL)


# --------------------------------------------------------------------------------
# 9. The installed package
# --------------------------------------------------------------------------------
USER_SCRIPT = """
import copy, json, sys
import kernel_ft
import kernel_common
import torch, transformers

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
config = transformers.LlamaConfig(**json.loads(sys.argv[1]))
model = transformers.AutoModelForCausalLM.from_config(config).to(device)
plain = copy.deepcopy(model)
report = kernel_ft.apply(model, strict=True)
ids = torch.randint(0, config.vocab_size, (2, 16), device=device)
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
print(json.dumps({"kernel_ft": kernel_ft.__file__, "kernel_common": kernel_common.__file__, "loss": loss.item(),
                  "plain": plain(input_ids=ids, labels=ids).loss.item(), "applied": report.applied,
                  "user modules": [m for m in ("models", "flags", "training") if m in sys.modules]}))
"""
NO_INDEX = ("Could not find a version", "No matching distribution", "Failed to establish a new connection",
            "Temporary failure in name resolution", "Network is unreachable", "ConnectTimeout", "ReadTimeout")


def test_installed_package_imports_from_another_directory(tmp_path):
    """pip install --no-deps --target DIR <the repository>; then, from a folder with a
    user's own models.py, flags.py and training.py (each raising ImportError) and only
    DIR on PYTHONPATH, import kernel_ft and apply it to a tiny LLaMA."""
    # pip builds in the source tree (build/, *.egg-info): build from a copy of it.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "build",
                                                                "*.egg-info"))
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(source)],
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        if any(s in pip.stdout + pip.stderr for s in NO_INDEX):
            pytest.skip("pip could not reach a package index for the build backend: "
                        + (pip.stderr.strip().splitlines() or ["?"])[-1])
        pytest.fail(f"pip install failed:\n{pip.stdout[-3000:]}\n{pip.stderr[-3000:]}")

    user = tmp_path / "user"
    user.mkdir()
    for name in ("models", "flags", "training"):
        (user / f"{name}.py").write_text(f"raise ImportError(\"the user's own {name}.py was imported\")\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(target)
    config = {**TINY, "vocab_size": VOCAB, "initializer_range": 0.2}
    run = subprocess.run([sys.executable, "-c", USER_SCRIPT, json.dumps(config)], cwd=user, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for module in ("kernel_ft", "kernel_common"):
        assert Path(result[module]).resolve().is_relative_to(target.resolve()), result[module]
    assert result["user modules"] == []
    assert result["applied"] == ["rmsnorm", "residual", "swiglu", "flce", "rope", "attention", "projections"]
    assert torch.isfinite(torch.tensor(result["loss"])).item()
    assert_close("loss", result["loss"], result["plain"], LOSS_TOL)



# --------------------------------------------------------------------------------
# Step 23's script: finetune_trainer.py
# --------------------------------------------------------------------------------
TRAINER_ARGS = ["--tiny", "--seq-len", "64", "--batch-size", "2", "--warmup-steps", "1", "--steps", "1"]


@pytest.mark.parametrize("argv, message", [
    (["--compile"], "error: --compile is not supported by finetune_trainer.py"),
    (["--dataset", "synthetic"], "error: finetune_trainer.py trains on instruction data"),
    (["--lora-4bit"], "error: --lora-4bit is not supported by finetune_trainer.py"),
])
def test_trainer_script_refuses_what_it_cannot_do_in_one_line(argv, message, monkeypatch):
    import finetune_trainer

    monkeypatch.setattr("kernel_ft.models.load_model", lambda *a: pytest.fail("the model was built before the refusal"))
    with pytest.raises(SystemExit) as e:
        finetune_trainer.main([*TRAINER_ARGS, *argv])
    assert str(e.value.code).startswith(message)


def test_trainer_script_with_and_without_the_kernels(tmp_path, capsys):
    """The step script's two runs: the same losses (float32), the report printed, the JSON
    with the loop's fields; a packed row holds no padding. On the CPU also under torchrun."""
    import finetune_trainer

    ours = finetune_trainer.main([*TRAINER_ARGS, "--json", str(tmp_path / "ours.json")])
    out = capsys.readouterr().out
    assert "kernel_ft.apply:" in out and "rmsnorm      applied" in out
    plain = finetune_trainer.main([*TRAINER_ARGS, "--no-kernels"])
    assert "Kernels:       none (PyTorch / HF)" in capsys.readouterr().out
    assert len(ours["losses"]) == len(plain["losses"]) == 2
    for a, b in zip(ours["losses"], plain["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b), (ours["losses"], plain["losses"])
    doc = json.loads((tmp_path / "ours.json").read_text())
    assert doc["script"] == "finetune_trainer.py" and doc["kernels"]["flce"]["status"] == "applied"
    assert doc["timed_steps"] == 1 and doc["warmup_steps"] == 1 and doc["real_tokens_per_sec"] > 0
    assert doc["tokens_per_step"][0] <= 2 * 64
    if not torch.cuda.is_available():  # two processes of the CPU (gloo), as CI runs them
        under_torchrun_as_one_process(ours, tmp_path)


def under_torchrun_as_one_process(one, tmp_path):
    """torchrun with 2 processes of batch 1: the trainer's own DistributedDataParallel,
    the kernels in each process, the losses of ``one`` process at batch 2; rank 0 alone
    prints and writes, the tokens counted over both."""
    out = tmp_path / "two.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "finetune_trainer.py"), *TRAINER_ARGS, "--batch-size", "1", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("Wrote ") == 1 and proc.stdout.count("kernel_ft.apply:") == 1, proc.stdout
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2 and doc["tokens_per_step"] == one["tokens_per_step"]
    for a, b in zip(doc["losses"], one["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (doc["losses"], one["losses"])
