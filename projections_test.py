"""
Tests of projections_kernel.py: the projections that read one input as one autograd
node (CPU, float32 and bf16 autocast; Triton only in the FP8 casts).

* ``shared_input_linear`` gives F.linear's outputs and gradients, with and
  without biases, frozen weights, unused outputs;
* its backward sums the input gradient with addmm_ (no add kernel);
* ``group_projections`` on a tiny LLaMA: same loss and gradients, same
  Parameters and state-dict names, nothing held after the forward;
* the fallbacks: no gradients, an input modified in place, a forward that does
  not call the projections on one input (a one-line note, then separate products);
* LoRA layers routed by lora_kernel.fuse_lora join the groups: PEFT's loss and
  gradients, no add kernel left in the backward of a group of adapted layers; over
  FP8 base layers (emulated) PEFT's loss and gradients over the same FP8 layers;
* FP8 layers (emulated) group by stacking: the loss and gradients of the same model
  built as Phi-3, whose fused qkv_proj and gate_up_proj are FP8 layers.

Usage:
    python -m pytest projections_test.py -v
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import DEVICE, narrow_tiny_config  # first: the Triton interpreter switch

from kernel_ft import dataloader, models, training
import projections_kernel as projections
from lora_kernel import fuse_lora
from projections_kernel import GroupedLinear, group_projections, shared_input_linear


def linears(widths, k=32, bias=False, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(k, n, bias=bias, device=DEVICE) for n in widths]


def separate(x, mods):
    return tuple(F.linear(x, m.weight, m.bias) for m in mods)


def grads_of(fn, x, mods, weights_of_outputs):
    """Outputs, dx and every parameter's gradient of sum(w_i * out_i)."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    for m in mods:
        for p in m.parameters():
            p.grad = None
    outs = fn(x, mods)
    loss = sum((o * w).sum() for o, w in zip(outs, weights_of_outputs) if w is not None)
    loss.backward()
    params = [None if p.grad is None else p.grad.clone() for m in mods for p in m.parameters()]
    return [o.detach() for o in outs], x.grad, params


@pytest.mark.parametrize("bias", [False, True])
def test_same_outputs_and_gradients_as_separate_linears(bias):
    mods = linears((48, 16, 16), bias=bias)
    x = torch.randn(2, 5, 32, device=DEVICE, requires_grad=True)
    upstream = [torch.randn(2, 5, n, device=DEVICE) for n in (48, 16, 16)]
    ours = grads_of(shared_input_linear, x, mods, upstream)
    ref = grads_of(separate, x, mods, upstream)
    for a, b in zip(ours[0], ref[0]):
        assert torch.equal(a, b)  # the same products
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(ours[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_frozen_weights_and_an_unused_output():
    mods = linears((24, 8, 8), bias=True)
    mods[1].weight.requires_grad_(False)
    x = torch.randn(7, 32, device=DEVICE, requires_grad=True)
    upstream = [torch.randn(7, 24, device=DEVICE), torch.randn(7, 8, device=DEVICE), None]  # v unused
    ours = grads_of(shared_input_linear, x, mods, upstream)
    ref = grads_of(separate, x, mods, upstream)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(ours[2], ref[2]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def backward_ops(fn):
    mods = linears((16, 8, 8))
    x = torch.randn(4, 32, device=DEVICE, requires_grad=True)
    outs = fn(x, mods)
    loss = sum(o.sum() for o in outs)
    with OpLog() as log:
        loss.backward()
    return log.ops


def test_the_input_gradient_is_summed_in_the_products():
    ops = backward_ops(shared_input_linear)
    assert ops.count("addmm_") == 2 and "add" not in ops and "add_" not in ops, ops
    ref = backward_ops(separate)  # what autograd does on its own: products, then adds
    assert "addmm_" not in ref and ref.count("add") + ref.count("add_") == 2, ref


def test_bf16_autocast_computes_like_f_linear():
    mods = linears((16, 8))
    x = torch.randn(3, 32, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        ours = shared_input_linear(x, mods)
        ref = separate(x, mods)
    assert all(o.dtype == torch.bfloat16 for o in ours)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    sum(o.float().sum() for o in ours).backward()
    assert x.grad.dtype == torch.float32 and mods[0].weight.grad.dtype == torch.float32


def tiny_llama():
    torch.manual_seed(0)
    return models.build_random(models.tiny_config(), torch.device(DEVICE), torch.float32)


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = training.hf_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_grouped_llama_trains_like_the_original():
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = dataloader.lm_batch(ids.to(DEVICE))
    ref_loss, ref_grads = loss_and_grads(model, batch)
    params_before = dict(model.named_parameters())
    keys_before = list(model.state_dict())

    n_layers = model.config.num_hidden_layers
    assert group_projections(model) == 2 * n_layers  # q/k/v and gate/up in every layer
    assert sum(isinstance(m, GroupedLinear) for m in model.modules()) == 5 * n_layers
    assert list(model.state_dict()) == keys_before
    assert all(p is params_before[n] for n, p in model.named_parameters())

    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    groups = {m.group for m in model.modules() if isinstance(m, GroupedLinear)}
    assert all(g.enabled and not g._pending and g._source is None for g in groups)  # nothing held


# Phi-3's fused layers, and the LLaMA projections stacked in each.
PHI3_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def as_phi3(name, tensors):
    """A Phi-3 parameter's value from the LLaMA ones, ``tensors`` by LLaMA name: a fused
    layer's the concatenation of its projections'."""
    fused = next((f for f in PHI3_FUSED if f".{f}." in name), None)
    return torch.cat([tensors[name.replace(fused, n)] for n in PHI3_FUSED[fused]]) if fused else tensors[name]


def phi3_twin(llama):
    """A Phi-3 model computing what ``llama`` computes, its q/k/v and gate/up stacked into
    Phi-3's fused qkv_proj and gate_up_proj (the other weights shared copies)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    c = llama.config
    config = Phi3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, hidden_act=c.hidden_act,
                        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                        rope_parameters=dict(c.rope_parameters), sliding_window=None, tie_word_embeddings=False,
                        pad_token_id=None, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    config._attn_implementation = llama.config._attn_implementation
    twin = Phi3ForCausalLM(config).to(DEVICE)
    ours = dict(llama.named_parameters())
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(as_phi3(name, ours))
    return twin


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_projections_compute_phi3s_fused_layers(recipe, monkeypatch):
    """FP8Linear q/k/v and gate/up (emulated on the CPU) group as GroupedFP8Linear: each group's
    forward is one FP8StackedFunction with split outputs, its output gradients cast side by side
    into one [dq | dk | dv] (counted). That is what one FP8 layer of the stacked weights
    computes: the same tiny model as Phi-3, whose qkv_proj and gate_up_proj are those layers,
    gives the same loss and gradients, bit for bit on the CPU (as separate FP8 layers, with a
    scale each for dq, dk and dv, the gradients part by ~6e-2)."""
    import fp8_kernel

    torch.manual_seed(0)  # narrow: the interpreter casts FP8 element by element (conftest)
    model = models.build_random(narrow_tiny_config(), torch.device(DEVICE), torch.float32)
    twin = phi3_twin(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = dataloader.lm_batch(ids.to(DEVICE))
    torch.testing.assert_close(loss_and_grads(twin, batch)[0], loss_and_grads(model, batch)[0])  # the same model
    n_layers = model.config.num_hidden_layers
    for m in (model, twin):
        assert fp8_kernel.replace_linears(m, recipe, emulate=True)[0] == (7 if m is model else 4) * n_layers
    ref_loss, ref_grads = loss_and_grads(twin, batch)

    assert group_projections(model) == 2 * n_layers
    assert sum(isinstance(m, projections.GroupedFP8Linear) for m in model.modules()) == 5 * n_layers
    cast = []
    real = fp8_kernel.quantize_side_by_side
    monkeypatch.setattr(fp8_kernel, "quantize_side_by_side",
                        lambda parts, *a: cast.append(len(parts)) or real(parts, *a))
    loss, grads = loss_and_grads(model, batch)
    assert cast == [2, 3] * n_layers  # backward: each layer's gate/up, then its q/k/v
    torch.testing.assert_close(loss, ref_loss, rtol=0 if DEVICE == "cpu" else 1e-5, atol=0)
    grads = {name: as_phi3(name, grads) for name in ref_grads}
    for name in ref_grads:
        if DEVICE == "cpu":  # float32 products in one algorithm whatever their shape: the same bits
            assert torch.equal(grads[name], ref_grads[name]), name
        else:  # cuBLASLt picks its kernel by shape: three products and one round apart in float32,
            # which can move a value across an e4m3 boundary in a later cast (~1e-4, as for LoRA above)
            err = ((grads[name] - ref_grads[name]).norm() / ref_grads[name].norm()).item()
            assert err < 1e-3, f"{name}: relative error {err:.1e}"


def test_deepcopy_keeps_each_copy_to_its_own_modules():
    model = tiny_llama()
    group_projections(model)
    twin = copy.deepcopy(model)
    attn = twin.model.layers[0].self_attn
    assert all(m.group is attn.q_proj.group for m in (attn.k_proj, attn.v_proj))
    assert attn.q_proj.group.members[1] is attn.k_proj


def test_without_gradients_nothing_is_kept():
    model = tiny_llama()
    group_projections(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), device=DEVICE)
    with torch.no_grad():
        model(ids)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.group._pending == {}


class TwoInputs(nn.Module):
    """q from one tensor, k and v from another (cross-attention's shape of call)."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = linears((8, 8, 8))

    def forward(self, x, memory):
        return self.q_proj(x).sum() + self.k_proj(memory).sum() + self.v_proj(memory).sum()


def test_a_forward_that_calls_on_other_inputs_falls_back_with_a_note(capsys):
    ref = TwoInputs()
    model = copy.deepcopy(ref)
    assert group_projections(model) == 1
    x = torch.randn(3, 32, device=DEVICE, requires_grad=True)
    memory = torch.randn(3, 32, device=DEVICE, requires_grad=True)
    for step in range(2):
        out = model(x, memory)
        torch.testing.assert_close(out, ref(x, memory))
    assert "not called in turn on one unchanged input" in capsys.readouterr().out
    assert not model.q_proj.group.enabled
    out.backward()
    grad_x, grad_memory = x.grad.clone(), memory.grad.clone()
    x.grad = memory.grad = None
    ref(x, memory).backward()
    torch.testing.assert_close(grad_x, x.grad)
    torch.testing.assert_close(grad_memory, memory.grad)


def test_an_input_changed_in_place_is_multiplied_again():
    module = TwoInputs()
    group_projections(module)
    x = torch.randn(3, 32, device=DEVICE, requires_grad=True)
    h = x * 1.0
    q = module.q_proj(h)
    h.mul_(2.0)  # k must see the new values, not the ones q was computed from
    k = module.k_proj(h)
    torch.testing.assert_close(k, F.linear(h, module.k_proj.weight))
    torch.testing.assert_close(q, F.linear(h / 2.0, module.q_proj.weight))


def test_activation_checkpointing_recomputes_through_the_groups(capsys):
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = dataloader.lm_batch(ids.to(DEVICE))
    ref_loss, ref_grads = loss_and_grads(model, batch)
    model.train()
    models.enable_checkpointing(model)
    group_projections(model)
    for _ in range(2):  # the second step runs on groups the first one's recomputation went through
        loss, grads = loss_and_grads(model, batch)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert "note:" not in capsys.readouterr().out
    assert all(m.group.enabled for m in model.modules() if isinstance(m, GroupedLinear))


# --------------------------------------------------------------------------------
# LoRA layers in the groups
# --------------------------------------------------------------------------------
def peft_llama(targets, dropout=0.0):
    peft = pytest.importorskip("peft")
    model = tiny_llama().double()
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets))
    with torch.no_grad():  # B random: PEFT starts it at zero, where its gradient path would go untested
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     ["q_proj", "v_proj"]])  # mixed groups: k_proj, gate_proj, up_proj plain
def test_lora_layers_in_groups_give_pefts_loss_and_gradients(targets, dropout):
    # With dropout: each adapter's own draws, in the order PEFT makes them (same seed, same loss).
    model = peft_llama(targets, dropout)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = dataloader.lm_batch(ids.to(DEVICE))
    torch.manual_seed(5)
    ref_loss, ref_grads = loss_and_grads_of_trainable(model, batch)
    fuse_lora(model)
    torch.manual_seed(5)
    n_layers = model.config.num_hidden_layers
    assert group_projections(model) == 2 * n_layers
    grouped = []
    real = projections.grouped_products
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(projections, "grouped_products", lambda *a: grouped.append(1) or real(*a))
        loss, grads = loss_and_grads_of_trainable(model, batch)
    # Layer 0's attention reads the frozen embedding's output: no gradient of x to sum
    # there, its projections run alone (its MLP reads the adapters' work: grouped).
    assert len(grouped) == 2 * n_layers - 1
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("recipe, dropout", [("tensorwise", 0.0), ("rowwise", 0.2)],
                         ids=["tensorwise", "rowwise-dropout"])
def test_lora_over_fp8_base_layers_in_groups_gives_pefts_loss_and_gradients(recipe, dropout, monkeypatch):
    """LoRA over FP8 base layers (fp8_kernel.FP8Linear, emulated on the CPU): fused and
    grouped, the base products are FP8Linear's own casts and products (fp8_kernel's
    frozen_linear_forward / _input_grad, counted), so the loss and the adapters'
    gradients are PEFT's over the same FP8 layers up to float32 rounding (below)."""
    import fp8_kernel
    import lora_kernel

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = models.build_random(narrow_tiny_config(), torch.device(DEVICE), torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():  # B random: PEFT starts it at zero, where its gradient path would go untested
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    assert fp8_kernel.replace_linears(model, recipe, emulate=True)[0] == 7 * model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = dataloader.lm_batch(ids.to(DEVICE))
    torch.manual_seed(5)
    ref_loss, ref_grads = loss_and_grads_of_trainable(model, batch)  # PEFT's path over FP8Linear
    fuse_lora(model)
    assert group_projections(model) == 2 * model.config.num_hidden_layers
    products = []
    for name in ("frozen_linear_forward", "frozen_linear_input_grad"):
        real = getattr(fp8_kernel, name)
        monkeypatch.setattr(lora_kernel, name, lambda *a, real=real, name=name: products.append(name) or real(*a))
    torch.manual_seed(5)
    loss, grads = loss_and_grads_of_trainable(model, batch)
    # Every base layer's forward product, and its input gradient's but for layer 0's q, k
    # and v (they read the frozen embedding's output: no gradient of x there).
    n_layers = model.config.num_hidden_layers
    assert products.count("frozen_linear_forward") == 7 * n_layers
    assert products.count("frozen_linear_input_grad") == 7 * n_layers - 3
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * n_layers
    # The fused layers add and sum in float32 in another order (1e-7); where that moves a
    # value across an e4m3 rounding boundary in a later cast, the two paths part by up to
    # ~1e-4 (most gradients 1e-6). Float32 products instead of FP8 would part by 3e-2 to 0.2.
    for name in ref_grads:
        err = ((grads[name] - ref_grads[name]).norm() / ref_grads[name].norm()).item()
        assert err < 1e-3, f"{name}: relative error {err:.1e}"


def test_lora_over_an_fp8_layer_without_fp8_tensor_cores_is_refused():
    """Fused or not, an FP8 layer that may not emulate refuses a device without FP8 tensor
    cores in fp8_linear's words."""
    import fp8_kernel

    peft = pytest.importorskip("peft")
    if fp8_kernel.fp8_supported(torch.device(DEVICE))[0]:
        pytest.skip("this device has FP8 tensor cores")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]))
    fp8_kernel.replace_linears(model, "tensorwise")
    fuse_lora(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), device=DEVICE)
    with pytest.raises(RuntimeError, match="fp8_linear: "):
        training.hf_loss(model, dataloader.lm_batch(ids)).backward()


def loss_and_grads_of_trainable(model, batch):
    model.zero_grad(set_to_none=True)
    loss = training.hf_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_group_of_lora_layers_sums_every_gradient_of_x_in_the_products():
    model = peft_llama(["q_proj", "k_proj", "v_proj"])
    fuse_lora(model)
    group_projections(model)
    attn = model.base_model.model.model.layers[1].self_attn
    x = torch.randn(5, model.config.hidden_size, device=DEVICE, dtype=torch.float64, requires_grad=True)
    with OpLog() as forward:
        loss = sum(attn.__getattr__(n)(x).sum() for n in ("q_proj", "k_proj", "v_proj"))
    # Three base products and one for the three adapters' x A^T (x read once), then B in the epilogues.
    assert forward.ops.count("mm") == 4 and forward.ops.count("addmm_") == 3, forward.ops
    with OpLog() as backward:
        loss.backward()
    # dx = dq Wq + dk Wk + dv Wv + [g_q | g_k | g_v] [A_q; A_k; A_v]: one mm, three addmm_, no add.
    assert backward.ops.count("addmm_") == 3 and "add" not in backward.ops and "add_" not in backward.ops, \
        backward.ops


def test_a_lora_group_with_an_unused_output():
    ref = peft_llama(["q_proj", "k_proj", "v_proj"])
    ours = copy.deepcopy(ref)
    fuse_lora(ours)
    group_projections(ours)
    x = torch.randn(5, ref.config.hidden_size, device=DEVICE, dtype=torch.float64)

    def grads(model):
        attn = model.base_model.model.model.layers[1].self_attn
        xi = x.clone().requires_grad_()
        q, k, v = (attn.__getattr__(n)(xi) for n in ("q_proj", "k_proj", "v_proj"))
        (q.sum() + (v * v).sum()).backward()  # k unused: no gradient for its adapter
        return xi.grad, {n: p.grad for n, p in attn.named_parameters() if p.grad is not None}

    (dx, got), (ref_dx, want) = grads(ours), grads(ref)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
    assert got.keys() == want.keys() and not [n for n in got if "k_proj" in n], sorted(got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)


# --------------------------------------------------------------------------------
# What an nn.Linear allows stays allowed
# --------------------------------------------------------------------------------
def test_grouped_outputs_can_be_changed_in_place():
    module = TwoInputs()
    group_projections(module)
    x = torch.randn(3, 32, device=DEVICE, requires_grad=True)
    q = module.q_proj(x).mul_(2.0)  # an output of its own, not a view of another
    k = module.k_proj(x)
    (q.sum() + k.sum()).backward()
    ref = x.detach().clone().requires_grad_()
    (F.linear(ref, module.q_proj.weight).mul(2.0).sum() + F.linear(ref, module.k_proj.weight).sum()).backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_a_frozen_group_keeps_no_copy_of_its_input():
    mods = linears((16, 8, 8))
    for m in mods:
        m.weight.requires_grad_(False)
    x = torch.randn(6, 32, device=DEVICE, requires_grad=True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        outs = shared_input_linear(x, mods)
    assert (6, 32) not in shapes, shapes  # F.linear with a frozen weight saves no input either
    sum(o.sum() for o in outs).backward()
    torch.testing.assert_close(x.grad, sum(m.weight.sum(0) for m in mods).expand(6, 32))


def test_second_derivatives_are_refused():
    mods = linears((16, 8))
    x = torch.randn(4, 32, device=DEVICE, requires_grad=True)
    loss = sum((o * o).sum() for o in shared_input_linear(x, mods))
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, x, create_graph=True)


def test_float64_stays_float64_under_autocast():
    mods = [m.double() for m in linears((16, 8))]
    x = torch.randn(4, 32, device=DEVICE, dtype=torch.float64, requires_grad=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        outs = shared_input_linear(x, mods)
    assert all(o.dtype == torch.float64 for o in outs)


def test_hooks_and_the_training_flag_survive_grouping():
    module = TwoInputs().eval()
    seen = []
    module.k_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    group_projections(module)
    assert not module.k_proj.training
    x = torch.randn(3, 32, device=DEVICE, requires_grad=True)
    module.q_proj(x), module.k_proj(x)
    assert seen == [torch.Size([3, 8])]


def test_one_forward_cut_short_does_not_switch_a_group_off(capsys):
    module = TwoInputs()
    group_projections(module)
    x = torch.randn(3, 32, device=DEVICE, requires_grad=True)
    module.q_proj(x)  # then an exception, say: k and v never asked for
    for _ in range(2):
        x = torch.randn(3, 32, device=DEVICE, requires_grad=True)
        module.q_proj(x), module.k_proj(x), module.v_proj(x)
    assert module.q_proj.group.enabled and "note:" not in capsys.readouterr().out
    assert module.q_proj.group._pending == {}


def test_a_group_whose_adapters_train_only_b_with_an_unused_output():
    """No weight or A needs x: it is not kept, and an unused output still gets its zero share."""
    ref = peft_llama(["q_proj", "k_proj", "v_proj"])
    for name, p in ref.named_parameters():
        if "lora_A" in name:
            p.requires_grad_(False)
    ours = copy.deepcopy(ref)
    fuse_lora(ours)
    group_projections(ours)
    x = torch.randn(2, 5, ref.config.hidden_size, device=DEVICE, dtype=torch.float64)

    def grads(model):
        attn = model.base_model.model.model.layers[1].self_attn
        xi = x.clone().requires_grad_()
        q, k, v = (attn.__getattr__(n)(xi) for n in ("q_proj", "k_proj", "v_proj"))
        (q.sum() + (v * v).sum()).backward()
        return xi.grad, {n: p.grad for n, p in attn.named_parameters() if p.grad is not None}

    (dx, got), (ref_dx, want) = grads(ours), grads(ref)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)
