"""
Step 21, continued -- The packed attention in Hugging Face's models.

attention_kernel.py is the lesson of the kernels: the reference, the forward and
backward kernels, their launchers and ``packed_attention``. This file holds how a
model is made to call it, a concern of its own: transformers looks each layer's
attention function up by name (AttentionInterface), so nothing is swapped; ours
is registered under ``NAME`` and the model's config switched to it. Here:

* ``hf_packed_attention``: the function transformers calls, with HF's signature;
  it reads the document starts from the position ids and ignores the mask.
* ``check_same_attention``: before the switch, a packed probe row must give the
  same logits with ours as with the model's own attention (``SwapMismatch``
  otherwise).
* ``use_packed_attention(model)``: registration, check and switch.

``from attention_kernel import use_packed_attention`` keeps working: the kernel
file finds these names here on first use.

Nothing runs on import. See attention_test.py for the checks.
"""

import torch

# First: it switches on the Triton interpreter when there is no GPU (kernel_common.py).
from kernel_common import SwapMismatch
from attention_kernel import document_starts, packed_attention, visible_keys


# --------------------------------------------------------------------------------
# In a model: an attention function HF's layers call by name
# --------------------------------------------------------------------------------
# transformers looks each layer's attention up in AttentionInterface by the
# config's _attn_implementation; "sdpa" is torch's. We register ours under NAME:
# it takes what HF passes (q, k, v after RoPE, in [B, H, T, D]; the position ids
# among the keyword arguments) and ignores the mask, which for a name with no mask
# function registered HF does not build at all.
NAME = "triton_packed"


def hf_packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function transformers calls under NAME (sdpa_attention_forward's signature)."""
    if dropout:
        raise ValueError(f"{NAME} attention has no dropout (attention_dropout {dropout}); set it to 0")
    B, _, T, _ = query.shape
    if kwargs.get("softcap"):
        raise ValueError(f"{NAME} attention does not implement soft-capped scores (softcap {kwargs['softcap']})")
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as autocast runs SDPA: all three in its lower-precision dtype
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    positions = kwargs.get("position_ids")
    if positions is None:
        doc_start = torch.zeros(B, T, dtype=torch.int32, device=query.device)
    else:
        doc_start = document_starts(positions.expand(B, T))
    return packed_attention(query, key, value, doc_start, scaling, kwargs.get("sliding_window")), None


# A family's attention may do more than softmax(scale q k^T) v (soft-capped scores,
# sliding windows, sink tokens, extra keyword arguments). So before the switch the
# model runs a packed probe row both ways: two examples of 5 and 3 tokens, with its
# own attention and the dense block mask, then with ours and only the position
# ids. The logits must agree to one rounding of the model's dtype; anything else,
# an error included, is a refusal in one line. In 16-bit weights two correct
# attentions drift apart through a deep model (a random 8B LLaMA's logits differ by
# ~0.1 between SDPA and eager): there the bound is also 4x the model's own drift,
# measured as the distance between its attention and HF's eager one on the same
# probe (eager is the reference implementation of every family).
PROBE_LENGTHS = (5, 3)


@torch.no_grad()
def check_same_attention(model, theirs_name):
    """Raise SwapMismatch unless the model computes the same logits with NAME as with
    ``theirs_name`` (its attention before the switch) on the packed probe row."""
    weight = next(model.parameters())
    if weight.is_meta:
        return
    positions = torch.cat([torch.arange(n) for n in PROBE_LENGTHS])[None].to(weight.device)
    ids = (torch.arange(positions.shape[1], device=weight.device)[None] * 7 + 1) % model.config.vocab_size
    mask = visible_keys(document_starts(positions))[:, None]
    additive = torch.zeros(mask.shape, dtype=weight.dtype, device=mask.device)  # eager adds its mask to the scores
    additive.masked_fill_(~mask, torch.finfo(weight.dtype).min)

    def logits(implementation, attention_mask):
        model.set_attn_implementation(implementation)
        return model(input_ids=ids, position_ids=positions, attention_mask=attention_mask).logits.float()

    was_training = model.training
    model.eval()
    drift = 0.0
    try:
        expected = logits(theirs_name, additive if theirs_name == "eager" else mask)
        if weight.dtype != torch.float32 and theirs_name != "eager":
            drift = (logits("eager", additive) - expected).abs().max().item()
        model.set_attn_implementation(NAME)
        try:
            got = model(input_ids=ids, position_ids=positions).logits.float()
        except (ValueError, TypeError, RuntimeError) as e:
            raise SwapMismatch(f"{type(model).__name__}'s attention cannot run as {NAME} "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    except SwapMismatch:
        model.set_attn_implementation(theirs_name)
        raise
    finally:
        model.train(was_training)
    rounding = 1e-4 if weight.dtype == torch.float32 else 2**-6
    if not torch.allclose(got, expected, rtol=rounding, atol=max(rounding * expected.abs().max().item(), 4 * drift)):
        model.set_attn_implementation(theirs_name)
        raise SwapMismatch(f"{type(model).__name__}'s attention computes something else than softmax(scale q k^T) v "
                           f"within each example (max logit difference {(got - expected).abs().max().item():.2g}, "
                           f"its own two implementations differ by {drift:.2g})")


def use_packed_attention(model):
    """Make ``model``'s attention layers call ours (registered once under NAME), after
    checking that it computes what theirs does (check_same_attention); return the
    number of attention layers. Without a mask function registered for NAME, HF
    builds no mask: the batch's position ids say where examples start."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, hf_packed_attention)
    theirs = model.config._attn_implementation
    check_same_attention(model, theirs)
    model.set_attn_implementation(NAME)
    return sum(1 for m in model.modules() if type(m).__name__.endswith("Attention"))
