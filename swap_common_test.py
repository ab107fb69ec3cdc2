"""
Tests for what the kernels' model patching shares (swap_common.py).

``swap_modules`` replaces submodules, never the root, and only the outer one of
nested matches; ``evaluating`` restores a model's mode also when a probe raises;
``vocabulary_size`` and ``probe_ids`` read a multimodal config's text part;
``decoder_of`` finds the decoder where ``get_decoder()`` answers with the model
itself or with a causal LM of its own. (``InstanceForward`` and the rest are
tested through the models they patch: tests/apply_test.py.)

Usage:
    python swap_common_test.py   # or: python -m pytest swap_common_test.py
"""

import sys

import pytest
import torch
import torch.nn as nn

import swap_common
from swap_common import evaluating, swap_modules


def test_swap_modules_replaces_submodules_never_the_root():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)), nn.ReLU())
    inner = model[1]
    count = swap_modules(model, lambda m: isinstance(m, nn.Linear), lambda m: nn.Identity())
    assert count == 2
    assert isinstance(model[0], nn.Identity) and isinstance(model[1][1], nn.Identity)
    assert model[1] is inner and isinstance(model[1][0], nn.ReLU) and isinstance(model[2], nn.ReLU)
    # The root matches too, but has no parent to hold a replacement: it stays.
    assert swap_modules(model, lambda m: isinstance(m, nn.Sequential), lambda m: nn.Tanh()) == 1
    assert isinstance(model, nn.Sequential) and isinstance(model[1], nn.Tanh)
    assert swap_modules(nn.Linear(2, 2), lambda m: True, lambda m: nn.Tanh()) == 0


def test_swap_modules_nested_matches_replace_the_outer_one():
    model = nn.Sequential(nn.Sequential(nn.Sequential(nn.ReLU())), nn.Sequential(nn.ReLU()))
    count = swap_modules(model, lambda m: isinstance(m, nn.Sequential), lambda m: nn.Tanh())
    assert count == 2
    assert isinstance(model[0], nn.Tanh) and isinstance(model[1], nn.Tanh)


def test_evaluating_restores_the_mode_also_when_the_block_raises():
    for training in (True, False):
        model = torch.nn.Sequential(torch.nn.Dropout(0.5)).train(training)
        with pytest.raises(RuntimeError), evaluating(model):
            assert not model.training and not model[0].training
            raise RuntimeError("a probe failed")
        assert model.training == training and model[0].training == training


def test_vocabulary_size_reads_a_text_config_where_the_config_has_none():
    """A multimodal config (Fuyu's from transformers 5.24) keeps vocab_size in its text
    config only; the probes and the data read it there."""
    import transformers

    class Composite(transformers.PretrainedConfig):
        model_type = "kernel_ft_composite_probe"
        sub_configs = {"text_config": transformers.LlamaConfig}

        def __init__(self, text_config=None, **kwargs):
            self.text_config = text_config if text_config is not None else transformers.LlamaConfig(vocab_size=77)
            super().__init__(**kwargs)

    assert not hasattr(Composite(), "vocab_size") and swap_common.vocabulary_size(Composite()) == 77
    assert swap_common.vocabulary_size(transformers.LlamaConfig(vocab_size=5)) == 5
    model = nn.Module()
    model.config = transformers.LlamaConfig(vocab_size=9)
    assert swap_common.vocabulary_size(model) == 9
    model.config = Composite(text_config=transformers.LlamaConfig(vocab_size=3))  # the probes' tokens wrap
    assert swap_common.probe_ids(model, "cpu").tolist() == [[1, 2, 0]]


def test_decoder_of_finds_the_decoder_where_get_decoder_returns_the_model():
    """transformers' get_decoder(); where a causal LM answers with itself (Llama-4's text
    model in transformers 5.17), the submodule its base_model_prefix names, else its
    ``model``; a refusal if there is neither."""
    class CausalLM(nn.Module):
        base_model_prefix = "model"

        def __init__(self, own):
            super().__init__()
            self.model, self.own = nn.Linear(2, 2), own

        def get_decoder(self):
            return self.model if self.own else self

    assert swap_common.decoder_of(good := CausalLM(True)) is good.model
    assert swap_common.decoder_of(quirk := CausalLM(False)) is quirk.model
    quirk.base_model_prefix = "language_model"  # Llama-4's: absent, ``model`` is the decoder
    assert swap_common.decoder_of(quirk) is quirk.model
    del quirk.model
    with pytest.raises(swap_common.SwapMismatch, match="returns the model itself"):
        swap_common.decoder_of(quirk)

    class ImageTextModel(nn.Module):  # Llama-4's: get_decoder() answers with a causal LM of its own
        def __init__(self):
            super().__init__()
            self.language_model = CausalLM(False)
            self.language_model.get_output_embeddings = lambda: nn.Linear(2, 5)

        def get_decoder(self):
            return self.language_model

    image_text = ImageTextModel()
    assert swap_common.decoder_of(image_text) is image_text.language_model.model


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))
