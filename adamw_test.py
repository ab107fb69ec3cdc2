"""
Step 15 (tests) -- Correctness tests for the fused AdamW step (adamw_kernel.py).

The truth is the same update evaluated in float64 (``adamw_reference`` on float64
copies of the parameters, gradients and moments); "PyTorch" is
``torch.optim.AdamW(fused=False, foreach=False)`` at the parameters' dtype, run
side by side on identical copies with identical gradients. After 1 and after 5
steps our error in p, m and v must be no worse than about twice PyTorch's, and
``TritonAdamW`` must behave as a ``torch.optim`` optimizer (param groups,
state_dict, closures). Without a GPU the kernel runs in the Triton interpreter
and the GPU-only tests (64-bit offsets, determinism, CPU tensors on the GPU
path) are skipped.

Usage:
    python adamw_test.py           # or: python -m pytest adamw_test.py
"""

import copy
import sys

import pytest
import torch
import torch.nn as nn

import adamw_kernel
from adamw_kernel import TritonAdamW, adamw_reference, adamw_step
from conftest import DEVICE, DTYPES, check_outputs, need_gpu, rel_err

# Non-trivial hyperparameters: every term of the update matters (a large decay,
# short memories, an eps that is not negligible next to sqrt(v) for small grads).
HP = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)

# Irregular sizes: one element, a partial block, one element past a full block
# (4097 = 4096 + 1: the masked tail of a second program), a 3-D tensor, and one large
# enough for the interpreter's larger blocks (100,003: two of 65,536, the second masked).
SHAPES = [(1,), (7,), (4097,), (3, 41, 5), (100_003,)]

# Per tensor, a loose bound on the error against the truth after the steps. The
# "no worse than PyTorch" criterion is taken over all tensors of a case together
# (a 1-element tensor alone would make it a coin toss between two roundings);
# this bound makes sure that none of the small tensors was skipped or garbled.
# The error is the tensor's root-mean-square error over the root-mean-square of
# the whole case's truth: a moment that happens to cancel to ~0 in a 1-element
# tensor must not count as a 100% error. Parameters start at a scale of 0.1, so
# a missed update (lr = 1e-2 per step) is an error of 10% or more, far above these.
PER_TENSOR_TOL = {torch.float32: 1e-6, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def make_params(shapes, dtype, seed=0):
    """Random parameters of scale 0.1 (not unit: the update is then ~10% per step)."""
    g = _generator(seed)
    return [(torch.randn(s, generator=g) * 0.1 + 0.01).to(DEVICE, dtype) for s in shapes]


def make_grads(shapes, dtype, seed):
    """Fresh gradients; magnitudes spread over decades, so that eps matters for some.

    float16 is the exception: its smallest normal number is 6e-5, so the state
    v = (1 - beta2) * g**2 loses precision for |g| < 0.04 and becomes 0 below
    |g| ~ 1e-3, where m / (sqrt(v) + eps) then explodes (by ~1/eps). That is a
    property of float16 optimizer state, the same in PyTorch, not of the kernel
    (mixed-precision training keeps float32 state for this reason). So float16
    gradients stay at magnitudes of 0.05 and above.
    """
    g = _generator(1000 + seed)
    grads = []
    for s in shapes:
        x = torch.randn(s, generator=g)
        if dtype == torch.float16:
            x = torch.where(x < 0, -1.0, 1.0) * (0.05 + x.abs())
        else:
            x = x * torch.rand(s, generator=g) ** 4
        grads.append(x.to(DEVICE, dtype))
    return grads


class Truth:
    """The float64 trajectory: adamw_reference on float64 copies, one step at a time."""

    def __init__(self, params, groups):
        self.p = [t.detach().double() for t in params]
        self.m = [torch.zeros_like(t) for t in self.p]
        self.v = [torch.zeros_like(t) for t in self.p]
        self.groups = groups  # per tensor: its hyperparameters
        self.t = 0

    def step(self, grads):
        self.t += 1
        for i, (g, hp) in enumerate(zip(grads, self.groups)):
            if g is None:
                continue
            self.p[i], self.m[i], self.v[i] = adamw_reference(
                self.p[i], g.double(), self.m[i], self.v[i], self.t,
                hp["lr"], hp["betas"][0], hp["betas"][1], hp["eps"], hp["weight_decay"],
            )


def run_side_by_side(shapes, dtype, n_steps, group_hps=None, seed=0):
    """Ours, PyTorch's AdamW and the float64 truth from the same start with the same grads.

    group_hps: hyperparameters per tensor (one param group per tensor); default
    HP for all tensors in one group. Returns (ours, theirs, truth, opt_ours, opt_torch).
    """
    init = make_params(shapes, dtype, seed)
    ours = [nn.Parameter(t.clone()) for t in init]
    theirs = [nn.Parameter(t.clone()) for t in init]
    if group_hps is None:
        opt_ours = TritonAdamW(ours, **HP)
        opt_torch = torch.optim.AdamW(theirs, **HP, fused=False, foreach=False)
        hps = [HP] * len(shapes)
    else:
        opt_ours = TritonAdamW([{"params": [p], **hp} for p, hp in zip(ours, group_hps)], **HP)
        opt_torch = torch.optim.AdamW(
            [{"params": [p], **hp} for p, hp in zip(theirs, group_hps)], **HP, fused=False, foreach=False
        )
        hps = [{**HP, **hp} for hp in group_hps]
    truth = Truth(init, hps)
    for t in range(1, n_steps + 1):
        grads = make_grads(shapes, dtype, seed * 100 + t)
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_torch.step()
        truth.step(grads)
    return ours, theirs, truth, opt_ours, opt_torch


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])


def _rms(t):
    t = t.detach().double()
    return (t.norm() / max(1, t.numel()) ** 0.5).item()


def compare_to_truth(shapes, dtype, n_steps, group_hps=None):
    """Our p, m, v against the truth, no worse than twice PyTorch's error."""
    ours, theirs, truth, opt_ours, opt_torch = run_side_by_side(shapes, dtype, n_steps, group_hps)
    tol = PER_TENSOR_TOL[dtype]
    for name, key, true in (("p", None, truth.p), ("m", "exp_avg", truth.m), ("v", "exp_avg_sq", truth.v)):
        a = [p if key is None else opt_ours.state[p][key] for p in ours]
        b = [q if key is None else opt_torch.state[q][key] for q in theirs]
        scale = _rms(_flat(true))
        for x, y, t in zip(a, b, true):
            assert x.dtype == y.dtype == dtype and x.shape == y.shape, f"{name}: {x.dtype} {tuple(x.shape)}"
            e = _rms(x.double() - t) / scale
            assert e <= tol, f"{name} of a {tuple(x.shape)} tensor: error {e:.2e} > {tol:.0e}"
        check_outputs([name], [_flat(a)], [_flat(b)], [_flat(true)], dtype)
    for p in ours:
        assert opt_ours.state[p]["step"] == n_steps and isinstance(opt_ours.state[p]["step"], int)


# (dtype, steps): every dtype after one step and after five, all SHAPES at once.
CASES = [
    pytest.param(dt, n, id=f"{dt} {n} step{'s' if n > 1 else ''}, sizes 1/7/4097/3x41x5")
    for dt in DTYPES for n in (1, 5)
]


@pytest.mark.parametrize("dtype,steps", CASES)
def test_matches_float64_truth(dtype, steps):
    compare_to_truth(SHAPES, DTYPES[dtype], steps)


# ---------------------------------------------------------------- edge cases and API
def test_param_groups():
    # One group per tensor: different lr, decay, betas, eps; lr = 0 leaves p alone
    # (but still advances m and v, as in PyTorch).
    groups = [
        {"lr": 1e-2},
        {"lr": 3e-3, "weight_decay": 0.0},
        {"lr": 1e-2, "betas": (0.5, 0.9), "eps": 1e-3},
        {"lr": 0.0},
    ]
    shapes = [(7,), (4097,), (3, 41, 5), (41,)]
    compare_to_truth(shapes, torch.float32, 3, group_hps=groups)
    ours, _, _, opt, _ = run_side_by_side(shapes, torch.float32, 2, group_hps=groups)
    assert torch.equal(ours[3].detach(), make_params(shapes, torch.float32)[3]), "lr = 0 must not move p"
    assert opt.state[ours[3]]["exp_avg"].abs().sum() > 0, "lr = 0 still updates the moments"


def _count_launches(fn):
    """Wrap adamw_kernel.adamw_step (which TritonAdamW calls) to count launches."""
    calls = []
    original = adamw_kernel.adamw_step

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    adamw_kernel.adamw_step = counting
    try:
        fn()
    finally:
        adamw_kernel.adamw_step = original
    return calls


def test_param_without_grad_and_zero_grad():
    params = [nn.Parameter(t) for t in make_params([(7,), (4097,), (5, 3)], torch.float32)]
    before = [p.detach().clone() for p in params]
    opt = TritonAdamW(params, **HP)
    params[0].grad = torch.randn(7, device=DEVICE)
    params[2].grad = torch.randn(5, 3, device=DEVICE)
    calls = _count_launches(opt.step)
    assert calls == [(7,), (5, 3)], f"launches for shapes {calls}, expected one per parameter with a gradient"
    assert params[1] not in opt.state, "no state for a parameter that never had a gradient"
    assert torch.equal(params[1].detach(), before[1]), "a parameter without gradient must not move"
    assert not torch.equal(params[0].detach(), before[0]) and not torch.equal(params[2].detach(), before[2])
    # zero_grad (from the base class) sets grads to None: the next step skips everything.
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    snap = [p.detach().clone() for p in params]
    assert _count_launches(opt.step) == []
    assert all(torch.equal(p.detach(), s) for p, s in zip(params, snap))
    assert opt.state[params[0]]["step"] == 1


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_state_dict_round_trip(dtype):
    shapes, dtype = [(7,), (4097,), (3, 41, 5)], DTYPES[dtype]
    a = [nn.Parameter(t) for t in make_params(shapes, dtype)]
    opt_a = TritonAdamW([{"params": a[:2]}, {"params": a[2:], "lr": 3e-3}], **HP)
    for t in (1, 2):
        for p, g in zip(a, make_grads(shapes, dtype, t)):
            p.grad = g
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())
    assert saved["state"][0]["step"] == 2 and saved["param_groups"][1]["lr"] == 3e-3
    # A fresh optimizer on copies of the parameters, loaded from the saved state.
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_b = TritonAdamW([{"params": b[:2]}, {"params": b[2:]}], lr=1.0)
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[1]["lr"] == 3e-3 and opt_b.state[b[0]]["step"] == 2
    for t in (3, 4):
        for p, q, g in zip(a, b, make_grads(shapes, dtype, t)):
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q), "parameters differ after the round trip"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key]), f"{key} differs after the round trip"
        assert opt_b.state[q]["step"] == 4


def test_load_torch_adamw_state_dict():
    # A checkpoint of torch.optim.AdamW (tensor steps, extra group options) loads
    # into ours and continues like PyTorch would.
    shapes = [(7,), (4097,)]
    theirs = [nn.Parameter(t) for t in make_params(shapes, torch.float32)]
    opt_torch = torch.optim.AdamW(theirs, **HP, foreach=False)
    for t in (1, 2):
        for p, g in zip(theirs, make_grads(shapes, torch.float32, t)):
            p.grad = g
        opt_torch.step()
    ours = [nn.Parameter(p.detach().clone()) for p in theirs]
    opt = TritonAdamW(ours)
    opt.load_state_dict(copy.deepcopy(opt_torch.state_dict()))
    assert opt.state[ours[0]]["step"] == 2 and isinstance(opt.state[ours[0]]["step"], int)
    for t in (3, 4, 5):
        for p, q, g in zip(ours, theirs, make_grads(shapes, torch.float32, t)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt_torch.step()
    err = max(rel_err(p, q) for p, q in zip(ours, theirs))
    assert err < 1e-6, f"after loading PyTorch's state: {err:.2e} from PyTorch"
    bad = copy.deepcopy(opt_torch.state_dict())
    bad["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad=True"):
        TritonAdamW(ours).load_state_dict(bad)


@pytest.mark.parametrize("option", adamw_kernel.UNSUPPORTED_OPTIONS)
def test_unsupported_options_refused_wherever_they_enter(option):
    w = nn.Parameter(torch.randn(3, device=DEVICE))
    v = nn.Parameter(torch.randn(3, device=DEVICE))
    with pytest.raises(ValueError, match=f"{option}=True"):
        TritonAdamW([{"params": [w], option: True}])
    opt = TritonAdamW([w])
    with pytest.raises(ValueError, match=f"{option}=True"):
        opt.add_param_group({"params": [v], option: True})
    # Set on a group after construction: refused at the step, before any update.
    w.grad = torch.ones_like(w)
    before = w.detach().clone()
    opt.param_groups[0][option] = True
    with pytest.raises(ValueError, match=f"{option}=True"):
        opt.step()
    assert torch.equal(w.detach(), before) and len(opt.state) == 0
    opt.param_groups[0][option] = False  # off is what the kernel does: accepted
    opt.step()
    assert not torch.equal(w.detach(), before)


def test_closure_and_empty_parameter():
    w = nn.Parameter(torch.randn(4, 3, device=DEVICE))
    empty = nn.Parameter(torch.zeros(0, 5, device=DEVICE))
    opt = TritonAdamW([w, empty], **HP)
    x = torch.randn(6, 4, device=DEVICE)

    def closure():
        opt.zero_grad()
        loss = (x @ w).pow(2).sum()
        loss.backward()  # the optimizer runs the closure with grad enabled
        empty.grad = torch.zeros(0, 5, device=DEVICE)
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and w.grad is not None
    assert opt.state[empty]["step"] == 1 and opt.state[empty]["exp_avg"].shape == (0, 5)


def test_bad_inputs_raise():
    def p_and_grad(t):
        p = nn.Parameter(t)
        p.grad = torch.randn_like(p)
        return p

    # Not contiguous: the message names the parameter's shape; no state, no change.
    p = p_and_grad(torch.randn(6, 8, device=DEVICE).t())
    opt = TritonAdamW([p])
    with pytest.raises(ValueError, match=r"shape \(8, 6\).*not contiguous"):
        opt.step()
    assert p not in opt.state
    # Gradient dtype differs from the parameter's (allowed by autograd via grad_dtype).
    p = nn.Parameter(torch.randn(5, device=DEVICE))
    p.grad_dtype = None
    p.grad = torch.randn(5, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="gradient dtype torch.bfloat16 differs"):
        TritonAdamW([p]).step()
    # Sparse gradients, from an embedding with sparse=True.
    emb = nn.Embedding(10, 4, sparse=True).to(DEVICE)
    emb(torch.tensor([1, 3], device=DEVICE)).sum().backward()
    assert emb.weight.grad.is_sparse
    with pytest.raises(RuntimeError, match="sparse gradients are not supported"):
        TritonAdamW(emb.parameters()).step()
    # Unsupported parameter dtype.
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        TritonAdamW([p_and_grad(torch.randn(3, device=DEVICE, dtype=torch.float64))]).step()
    # Hyperparameters, in the constructor and in a param group.
    good = [nn.Parameter(torch.randn(3, device=DEVICE))]
    for kwargs, match in (
        (dict(lr=-1e-3), "invalid learning rate"),
        (dict(eps=-1.0), "invalid eps"),
        (dict(betas=(1.0, 0.999)), "invalid beta1"),
        (dict(betas=(0.9, -0.1)), "invalid beta2"),
        (dict(betas=0.9), "betas must be a pair"),
        (dict(weight_decay=-0.1), "invalid weight_decay"),
    ):
        with pytest.raises(ValueError, match=match):
            TritonAdamW(good, **kwargs)
    with pytest.raises(ValueError, match="invalid learning rate"):
        TritonAdamW([{"params": good, "lr": -1.0}])
    with pytest.raises(TypeError, match="Python number"):
        TritonAdamW(good, lr=torch.tensor(1e-3))
    # The functional form: state of the wrong dtype, bad step count, mixed devices.
    q, g = torch.randn(5, device=DEVICE), torch.randn(5, device=DEVICE)
    with pytest.raises(ValueError, match="state exp_avg must be a torch.float32"):
        adamw_step(q, g, torch.zeros(5, device=DEVICE, dtype=torch.bfloat16), torch.zeros_like(q), 1, **_flat_hp())
    with pytest.raises(ValueError, match="step must be a Python int >= 1"):
        adamw_step(q, g, torch.zeros_like(q), torch.zeros_like(q), 0, **_flat_hp())
    with pytest.raises(ValueError, match="same device"):
        adamw_step(q, g.to("meta"), torch.zeros_like(q), torch.zeros_like(q), 1, **_flat_hp())


def _flat_hp():
    return dict(lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"])


def test_non_contiguous_gradient():
    # The gradient is only read: a non-contiguous one is copied, same result.
    shape = (41, 5)
    init = make_params([shape], torch.float32)[0]
    g = make_grads([(5, 41)], torch.float32, 1)[0].t()
    assert not g.is_contiguous()
    a, b = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    a.grad, b.grad = g, g.contiguous()
    TritonAdamW([a], **HP).step()
    TritonAdamW([b], **HP).step()
    assert torch.equal(a, b)


def _tiny_llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(DEVICE)


def test_tiny_llama_training_steps():
    # Three full training steps of a tiny LLaMA, float32: ours and PyTorch's AdamW
    # must keep the models together (the gradients depend on the parameters, so
    # any difference in an update would feed back).
    ours, theirs = _tiny_llama(0), _tiny_llama(0)
    opt = TritonAdamW(ours.parameters(), **HP)
    opt_torch = torch.optim.AdamW(theirs.parameters(), **HP)
    g = _generator(7)
    for _ in range(3):
        ids = torch.randint(0, 257, (2, 16), generator=g).to(DEVICE)
        for model, o in ((ours, opt), (theirs, opt_torch)):
            o.zero_grad()
            model(ids, labels=ids).loss.backward()
            o.step()
    n_tensors = sum(1 for _ in ours.parameters())
    assert len(opt.state) == n_tensors
    err = max(rel_err(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
    moved = min(rel_err(p, q) for p, q in zip(ours.parameters(), _tiny_llama(0).parameters()))
    assert moved > 1e-3, "the parameters did not move"
    assert err < 1e-6, f"parameters differ from PyTorch's AdamW by up to {err:.2e} (relative)"


@pytest.mark.parametrize("max_norm", [0.05, 1e3], ids=["clipped", "norm below the limit"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_clip_grad_norm_folded_into_the_step(dtype, max_norm):
    """clip_grad_norm_ + step == torch's clip_grad_norm_ + torch.optim.AdamW: the same
    norm returned; the parameters as close to the float64 truth as PyTorch's; the
    gradients untouched until the step; the coefficient used by one step only."""
    dt = DTYPES[dtype]
    shapes = [(7,), (4097,), (3, 41, 5)]
    ours = [nn.Parameter(t) for t in make_params(shapes, dt)]
    theirs = [nn.Parameter(t) for t in make_params(shapes, dt)]
    opt, opt_torch = TritonAdamW(ours, **HP), torch.optim.AdamW(theirs, foreach=False, **HP)
    truth = Truth(make_params(shapes, dt), [HP] * len(shapes))
    for t in (1, 2):
        grads = make_grads(shapes, dt, 40 + t)
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if t == 1:  # clip the first step only
            norm = opt.clip_grad_norm_(max_norm)
            norm_torch = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
            assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads)), "gradients changed before the step"
            true_norm = torch.cat([g.double().reshape(-1) for g in grads]).norm().item()
            check_outputs(["norm"], [norm], [norm_torch], [torch.tensor(true_norm, dtype=torch.float64)], dt)
            scale = min(1.0, max_norm / (true_norm + 1e-6))
            grads = [g.double() * scale for g in grads]
        opt.step()
        opt_torch.step()
        truth.step(grads)
        if t == 1:
            assert (scale < 0.1) == (max_norm < 1), "the clipped case must clip hard, the other not at all"
    check_outputs(["p"], [_flat(ours)], [_flat(theirs)], [_flat(truth.p)], dt)
    # m carries the scale directly (the update m / sqrt(v) is nearly scale-free).
    m_ours, m_torch = [opt.state[p]["exp_avg"] for p in ours], [opt_torch.state[q]["exp_avg"] for q in theirs]
    check_outputs(["m"], [_flat(m_ours)], [_flat(m_torch)], [_flat(truth.m)], dt)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gradient_norm_is_get_total_norm(dtype):
    """adamw_kernel.gradient_norm against a float64 truth, no worse than PyTorch's
    get_total_norm and in its dtype: tensors of one element, of a masked tail, of
    more blocks than programs (each program then walks several: 4097 elements, 1024
    per block, 4 programs in the interpreter; 100,003 in the interpreter's larger
    blocks of 8,192), empty, non-contiguous; and mixed dtypes."""
    dt = DTYPES[dtype]
    shapes = [(1,), (7,), (4097,), (3, 41, 5), (100_003,), (0,), (123, 41)]
    grads = make_grads(shapes, dt, 7)
    grads[-1] = grads[-1].t()  # a transposed view
    assert not grads[-1].is_contiguous()
    truth = torch.cat([g.double().reshape(-1) for g in grads]).norm()
    ours, theirs = adamw_kernel.gradient_norm(grads), torch.nn.utils.get_total_norm(grads)
    check_outputs(["norm"], [ours], [theirs], [truth], dt)
    assert rel_err(ours, truth) < 2 * torch.finfo(dt).eps, "the norm is not the norm of these gradients"
    # The sum of squares of one tensor counted twice, or one left out, is far off:
    assert rel_err(adamw_kernel.gradient_norm(grads[:-1]), truth) > 1e-2


def test_gradient_norm_of_mixed_dtypes_and_nothing():
    grads = make_grads([(4097,)], torch.float32, 3) + make_grads([(300,)], torch.bfloat16, 4)
    ours, theirs = adamw_kernel.gradient_norm(grads), torch.nn.utils.get_total_norm(grads)
    assert ours.dtype == theirs.dtype == torch.float32  # stacked with type promotion, as PyTorch does
    truth = torch.cat([g.double().reshape(-1) for g in grads]).norm()
    assert rel_err(ours, truth) < 1e-2 and rel_err(ours, theirs) < 1e-6
    assert adamw_kernel.gradient_norm([]).item() == 0.0


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.SiLU(), nn.Linear(40, 8)).to(DEVICE)


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def test_update_in_backward_is_the_step():
    """--optimizer-in-backward: each parameter updated by its hook during backward, its
    gradient then freed, gives step()'s parameters bit for bit, with the schedule's rate."""
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    plain, inside = _mlp(), _mlp()
    opt_plain, opt_inside = TritonAdamW(plain.parameters(), **HP), TritonAdamW(inside.parameters(), **HP)
    sched_plain, sched_inside = _schedule(opt_plain), _schedule(opt_inside)
    handles = opt_inside.update_in_backward()
    for _ in range(3):
        plain(x).square().mean().backward()
        opt_plain.step()
        opt_plain.zero_grad(set_to_none=True)
        sched_plain.step()
        inside(x).square().mean().backward()
        assert all(p.grad is None for p in inside.parameters())  # freed inside backward
        opt_inside.step()  # nothing left to do
        sched_inside.step()
        for a, b in zip(plain.parameters(), inside.parameters()):
            assert torch.equal(a, b)
    assert [opt_inside.state[p]["step"] for p in inside.parameters()] == [3] * 4
    for handle in handles:
        handle.remove()


def test_update_in_backward_after_load_state_dict():
    """The hooks find the groups that load_state_dict put in place (and their rate)."""
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    model, twin = _mlp(), _mlp()
    opt, opt_twin = TritonAdamW(model.parameters(), **HP), TritonAdamW(twin.parameters(), **HP)
    opt.update_in_backward()
    model(x).sum().backward()
    twin(x).sum().backward()
    opt_twin.step()
    opt_twin.zero_grad(set_to_none=True)
    saved = copy.deepcopy(opt_twin.state_dict())
    saved["param_groups"][0]["lr"] = 0.5 * HP["lr"]
    opt.load_state_dict(copy.deepcopy(saved))  # each its own tensors: loading does not copy them
    opt_twin.load_state_dict(saved)
    model(x).sum().backward()
    twin(x).sum().backward()
    opt_twin.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_optimizer_in_backward_run_is_the_plain_run(tmp_path, capsys):
    """The whole loop, every kernel, tiny model: the same losses, step by step."""
    import json

    import finetune_optimized

    tiny = ["--tiny", "--dataset", "synthetic", "--warmup-steps", "0", "--seq-len", "16", "--steps", "3",
            "--max-grad-norm", "0"]
    losses = []
    for extra in ([], ["--optimizer-in-backward"]):
        out = tmp_path / f"run{len(losses)}.json"
        finetune_optimized.main([*tiny, *extra, "--json", str(out)])
        losses.append(json.loads(out.read_text())["losses"])
    assert "each weight updated inside backward" in capsys.readouterr().out
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_optimizer_in_backward_flags_refused_in_one_line():
    import finetune_optimized

    for extra, words in (([], "clipping cannot run; add --max-grad-norm 0"),
                         (["--max-grad-norm", "0", "--grad-accum", "2"], "use --grad-accum 1"),
                         (["--max-grad-norm", "0", "--skip-nonfinite-steps"], "--skip-nonfinite-steps cannot"),
                         (["--max-grad-norm", "0", "--no-use-custom-adamw"], "add --use-custom-adamw")):
        with pytest.raises(SystemExit) as e:
            finetune_optimized.main(["--optimizer-in-backward", *extra])
        message = str(e.value.code)
        assert message.startswith("error: --optimizer-in-backward") and words in message and "\n" not in message


def test_grad_scale_must_be_one_float32_element():
    p, g = torch.zeros(8, device=DEVICE), torch.ones(8, device=DEVICE)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for bad in (torch.ones(2, device=DEVICE), torch.ones(1, dtype=torch.float64, device=DEVICE), 0.5):
        with pytest.raises(ValueError, match="grad_scale must be a one-element float32 tensor"):
            adamw_step(p, g, m, v, 1, 1e-2, 0.9, 0.999, 1e-8, 0.0, grad_scale=bad)
    assert torch.equal(p, torch.zeros(8, device=DEVICE)), "a refused call changed the parameter"


# ---------------------------------------------------------------- GPU only
def test_int64_offsets():
    need_gpu()
    # 2**31 + 5 bf16 elements per tensor (4.3 GB; p, g, m, v: 17 GB): the last
    # programs address elements beyond 2**31, where int32 offsets would wrap.
    n = 2**31 + 5
    dtype = torch.bfloat16
    torch.manual_seed(0)
    p = torch.empty(n, device="cuda", dtype=dtype).normal_(0.0, 0.1)
    g = torch.empty(n, device="cuda", dtype=dtype).normal_()
    m = torch.empty(n, device="cuda", dtype=dtype).normal_(0.0, 0.1)
    v = torch.empty(n, device="cuda", dtype=dtype).uniform_(0.0, 0.1)
    # The first elements, and the last 10,000: they straddle element 2**31 and
    # end with the partial last block (the masked tail).
    sample = torch.cat([torch.arange(0, 3, device="cuda"), torch.arange(n - 10_000, n, device="cuda")])
    before = [t[sample].clone() for t in (p, g, m, v)]
    step = 3
    hp = _flat_hp()
    adamw_step(p, g, m, v, step, **hp)
    torch.cuda.synchronize()
    args = (step, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"])
    truth = adamw_reference(*[t.double() for t in before], *args)
    peer = adamw_reference(*before, *args)
    # The reference on the sampled elements (at the dtype) is the peer.
    check_outputs("pmv", (p[sample], m[sample], v[sample]), peer, truth, dtype)


def test_deterministic():
    need_gpu()
    shapes = [(4096, 4096), (1024, 4096), (4097,)]
    results = []
    for _ in range(2):
        params = [nn.Parameter(t) for t in make_params(shapes, torch.bfloat16)]
        opt = TritonAdamW(params, **HP)
        for t in range(1, 4):
            for p, g in zip(params, make_grads(shapes, torch.bfloat16, t)):
                p.grad = g
            opt.step()
        state = [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
        results.append([p.detach() for p in params] + state)
    assert all(torch.equal(a, b) for a, b in zip(*results)), "two identical runs differ"


def test_cpu_tensors_on_gpu_path():
    need_gpu()
    p = nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    with pytest.raises(RuntimeError, match="Triton interpreter"):
        TritonAdamW([p]).step()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))
