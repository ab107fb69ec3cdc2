"""
Step 17 tests: the kernels inside torch.compile.

Every kernel is a custom operator (kernel_common.kernel_op), so torch.compile
traces a function or a decoder layer that calls them into ONE graph
(``fullgraph=True`` turns any graph break into an error) and differentiates it
with the formula registered on the operator. What is checked here:

* each functional kernel compiles with zero graph breaks, its operator is in
  the graph, and loss and gradients equal eager (on CPU the aot_eager backend
  runs the same kernels, so "equal" means bit for bit); a second shape works
  (dynamic shapes: the fake functions take symbolic sizes);
* ``torch.library.opcheck`` on every operator: schema, fake function,
  autograd registration, tracing with dynamic shapes;
* a LLaMA with every kernel, each decoder layer compiled as ``--compile`` does,
  trains with exactly the eager losses and gradients, also with gradient
  checkpointing and under autocast; the --compile flag too, with LoRA adapters
  and with packed real data (4-D mask, restarted positions);
* eager calls do not pass through the dispatcher (the operator path costs host
  time that eager training would pay for nothing);
* on a GPU: Inductor, and CUDA-graph replay (mode="reduce-overhead").

On CPU the backend is aot_eager: the graph is traced and differentiated like
Inductor's input, and runs eagerly (the kernels in the interpreter).
"""

if __name__ == "__main__":
    # `python tests/compile_test.py`: pytest runs this file. Its imports below need the
    # repository root on the path, which the root's conftest.py gives pytest.
    import sys

    import pytest

    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))


import argparse
import copy
import unittest.mock

import pytest
import torch

from conftest import DEVICE, ON_GPU, need_gpu  # first: the Triton interpreter switch

from kernel_ft import dataloader, flags, models
import projections_kernel as projections
from kernel_ft import run as run_setup
from cross_entropy_kernel import cross_entropy
from kernel_ft.run import apply_kernels
from linear_cross_entropy_kernel import fused_linear_cross_entropy
from rmsnorm_kernel import rmsnorm
from rope_kernel import rope
from swiglu_kernel import swiglu
from swiglu_kernel import swiglu_down_proj
from torch._dynamo.testing import CompileCounterWithBackend

BACKEND = "inductor" if ON_GPU else "aot_eager"


def compiled(fn, backend=BACKEND, **kwargs):
    """fn compiled with fullgraph=True, plus the counter that saw its graphs."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True, **kwargs), counter


def ops_in(counter):
    """Names of our operators in the graphs the counter saw (and their subgraphs,
    such as the body of a checkpoint)."""
    return {str(node.target).split(".")[1] for gm in counter.graphs for sub in gm.modules()
            if isinstance(sub, torch.fx.GraphModule) for node in sub.graph.nodes
            if str(node.target).startswith("llama_kernels.")}


def assert_same(a, b, what):
    """Bit for bit on CPU (aot_eager runs the very same kernels); on a GPU Inductor
    compiles the code around our operators, so PyTorch's default tolerances."""
    if ON_GPU:
        torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, b), f"{what}: max difference {(a.double() - b.double()).abs().max().item():.3e}"


def leaf(shape, dtype, scale=1.0):
    return (torch.randn(shape, device=DEVICE, dtype=torch.float32) * scale).to(dtype).requires_grad_()


# --------------------------------------------------------------------------------
# Each kernel on its own. A case builds (inputs that need gradients, other
# inputs) for a row count; its loss is a module-level function of all of them,
# compiled once and called again with another row count.
# --------------------------------------------------------------------------------
def _targets(rows, v):
    t = torch.randint(0, v, (rows,), device=DEVICE)
    t[::3] = -100  # ignored positions
    return t


def _rope_tables(rows, dtype):
    angle = torch.arange(rows, device=DEVICE, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1, 8, device=DEVICE)
    emb = torch.cat([angle, angle], dim=-1)[None].expand(2, rows, 16)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rmsnorm_loss(x, w):
    return (rmsnorm(x, w, 1e-6).float() ** 2).sum()


def swiglu_loss(g, u):
    return (swiglu(g, u).float() ** 2).sum()


def down_proj_loss(g, u, w):
    return (swiglu_down_proj(g, u, w).float() ** 2).sum()


def rope_loss(q, k, cos, sin):
    qe, ke = rope(q, k, cos, sin)
    return (qe.float() ** 2).sum() + (ke.float() * 3).sum()


def ce_mean_loss(z, t):
    return cross_entropy(z, t)


def ce_none_loss(z, t, weights):
    return (cross_entropy(z, t, reduction="none") * weights).sum()


def flce_mean_loss(h, w, t):
    return fused_linear_cross_entropy(h, w, t)


def flce_none_loss(h, w, t):
    return fused_linear_cross_entropy(h, w, t, reduction="none").sum() * 0.5


CASES = {
    # name: (inputs for (rows, dtype), loss, the operator the graph must hold)
    "rmsnorm": (lambda r, d: ((leaf((r, 41), d), leaf((41,), d)), ()), rmsnorm_loss, "rmsnorm_forward"),
    "swiglu": (lambda r, d: ((leaf((r, 123), d), leaf((r, 123), d)), ()), swiglu_loss, "swiglu_forward"),
    "swiglu_down_proj": (lambda r, d: ((leaf((r, 48), d), leaf((r, 48), d), leaf((24, 48), d, 0.2)), ()),
                         down_proj_loss, "swiglu_down_proj_forward"),
    "rope": (lambda r, d: ((leaf((2, 4, r, 16), d), leaf((2, 2, r, 16), d)), _rope_tables(r, d)),
             rope_loss, "rope_forward"),
    "cross_entropy_mean": (lambda r, d: ((leaf((r, 123), d, 3.0),), (_targets(r, 123),)),
                           ce_mean_loss, "cross_entropy_forward"),
    "cross_entropy_none": (lambda r, d: ((leaf((r, 123), d, 3.0),),
                                         (_targets(r, 123), torch.linspace(0.5, 2.0, r, device=DEVICE))),
                           ce_none_loss, "cross_entropy_forward"),
    "flce_mean": (lambda r, d: ((leaf((r, 32), d), leaf((77, 32), d, 0.3)), (_targets(r, 77),)),
                  flce_mean_loss, "linear_cross_entropy_forward"),
    "flce_none": (lambda r, d: ((leaf((r, 32), d), leaf((77, 32), d, 0.3)), (_targets(r, 77),)),
                  flce_none_loss, "linear_cross_entropy_forward"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_compiles_in_one_graph_and_matches_eager(name, dtype):
    make, loss_fn, expected_op = CASES[name]
    torch.manual_seed(0)
    fn, counter = compiled(loss_fn)
    for rows in (7, 12):  # the second size recompiles with symbolic shapes
        inputs, others = make(rows, dtype)
        loss = loss_fn(*inputs, *others)
        grads = torch.autograd.grad(loss, inputs)
        c_loss = fn(*inputs, *others)
        c_grads = torch.autograd.grad(c_loss, inputs)
        assert_same(c_loss, loss, f"{name} loss ({rows} rows)")
        for i, (a, b) in enumerate(zip(c_grads, grads)):
            assert_same(a, b, f"{name} gradient {i} ({rows} rows)")
    assert expected_op in ops_in(counter), f"{name}: the graphs hold {ops_in(counter)}, not {expected_op}"


def _opcheck_inputs():
    """One small call of every operator, with inputs that need gradients."""
    torch.manual_seed(1)
    f32 = torch.float32
    x, w = leaf((5, 41), f32), leaf((41,), f32)
    g, u, wd = leaf((5, 48), f32), leaf((5, 48), f32), leaf((24, 48), f32)
    q, k = leaf((1, 2, 5, 8), f32), leaf((1, 1, 5, 8), f32)
    cos, sin = torch.rand(1, 5, 8, device=DEVICE), torch.rand(1, 5, 8, device=DEVICE)
    z, t = leaf((5, 31), f32), _targets(5, 31)
    h, wh = leaf((5, 16), f32), leaf((31, 16), f32)
    nv = torch.tensor([3.0], device=DEVICE)
    up = torch.rand(5, device=DEVICE)
    ops = torch.ops.llama_kernels
    return {
        "rmsnorm_forward": (ops.rmsnorm_forward, (x, w, 1e-6)),
        "rmsnorm_backward": (ops.rmsnorm_backward, (torch.randn(5, 41, device=DEVICE), x.detach(), w.detach(),
                                                    torch.rand(5, device=DEVICE), True)),
        "swiglu_forward": (ops.swiglu_forward, (g, u)),
        "swiglu_backward": (ops.swiglu_backward, (torch.randn(5, 48, device=DEVICE), g.detach(), u.detach(),
                                                  True, False)),
        "swiglu_down_proj_forward": (ops.swiglu_down_proj_forward, (g, u, wd, f32)),
        "swiglu_down_proj_backward": (ops.swiglu_down_proj_backward, (torch.randn(5, 24, device=DEVICE), g.detach(),
                                                                      u.detach(), wd.detach(), True, True, True)),
        "rope_forward": (ops.rope_forward, (q, k, cos, sin)),
        "rope_backward": (ops.rope_backward, (torch.randn(1, 2, 5, 8, device=DEVICE), None, cos, sin,
                                              [1, 2, 5, 8], [80, 40, 8, 1], f32, [1, 1, 5, 8], [40, 40, 8, 1], f32)),
        "cross_entropy_forward": (ops.cross_entropy_forward, (z, t, -100, "mean", True, False)),
        "cross_entropy_forward_none": (ops.cross_entropy_forward, (z, t, -100, "none", True, False)),
        "cross_entropy_grad": (ops.cross_entropy_grad, (z.detach(), t, nv, up, -100, True)),
        "linear_cross_entropy_forward": (ops.linear_cross_entropy_forward,
                                         (h, wh, t, -100, "sum", True, True, 2, False, 0.0)),
        "linear_cross_entropy_forward_softcap": (ops.linear_cross_entropy_forward,
                                                 (h, wh, t, -100, "mean", True, True, 2, False, 30.0)),
        "linear_cross_entropy_grad": (ops.linear_cross_entropy_grad,
                                      (h.detach(), wh.detach(), t, nv, up, -100, False, True, True, 2, 0.0)),
    }


@pytest.mark.parametrize("name", list(_opcheck_inputs()))
def test_opcheck(name):
    op, args = _opcheck_inputs()[name]
    torch.library.opcheck(op, args)


# --------------------------------------------------------------------------------
# A LLaMA with every kernel, each decoder layer compiled as --compile does
# --------------------------------------------------------------------------------
def _model_and_batch(seq_len=24):
    torch.manual_seed(0)
    model = models.build_random(models.tiny_config(), DEVICE, torch.float32)
    model.config.use_cache = False
    ids = torch.randint(0, model.config.vocab_size, (2, seq_len), device=DEVICE)
    return model, ids


def _loss_and_grads(model, loss_fn, ids, autocast=None):
    with torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None):
        loss = loss_fn(model, dataloader.lm_batch(ids))  # labels = inputs (the loss shifts them)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("setting", ["plain", "checkpointing", "autocast-bf16"])
def test_compiled_decoder_with_every_kernel_matches_eager(setting):
    # 8 tokens a row, not 24: the check is compiled == eager bit for bit, which holds at any
    # length, and the interpreter's time grows with the tokens (RoPE and RMSNorm launch a
    # program per token); the model runs three times (eager, two compiled calls).
    model, ids = _model_and_batch(seq_len=8)
    # Every kernel but the projections' groups, which run in eager only (their sums round
    # once, Inductor's after each term): the next test.
    kernels = {name: name != "projections" for name in flags.KERNELS}
    loss_fn, _ = apply_kernels(model, kernels)
    if setting == "checkpointing":
        models.enable_checkpointing(model)
        model.train()
    autocast = torch.bfloat16 if setting == "autocast-bf16" else None
    eager = _loss_and_grads(model, loss_fn, ids, autocast)

    compiled_model = copy.deepcopy(model)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(BACKEND)
    args = argparse.Namespace(compile=True, compile_mode="default", gradient_checkpointing=setting == "checkpointing")
    with unittest.mock.patch.object(models, "BACKENDS", {"cuda": counter, "cpu": counter}):
        models.compile_decoder(compiled_model, args)
    for step in range(2):  # the second call runs the cached graphs
        loss, grads = _loss_and_grads(compiled_model, loss_fn, ids, autocast)
        assert_same(loss, eager[0], f"loss, call {step + 1}")
        for name, g in eager[1].items():
            assert_same(grads[name], g, f"gradient of {name}, call {step + 1}")
    assert {"rmsnorm_forward", "rope_forward", "swiglu_down_proj_forward"} <= ops_in(counter), ops_in(counter)


@pytest.mark.parametrize("setting", ["every kernel", "LoRA"])
def test_one_compilation_serves_every_layer(setting):
    """The kernels set a forward on modules inside each layer (the fused RoPE's attention,
    the fused LoRA layers). Compiled one layer at a time, every layer must pass the first
    one's guards: a recompilation per layer would stop at Dynamo's limit of 8, and a
    32-layer model under fullgraph=True would fail at its ninth layer."""
    config = models.tiny_config()
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    model = models.build_random(config, DEVICE, torch.float32)
    kernels = {name: name != "projections" for name in flags.KERNELS}
    if setting == "LoRA":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
        kernels["lora"] = True
    loss_fn, _ = apply_kernels(model, kernels)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(BACKEND)
    args = argparse.Namespace(compile=True, compile_mode="default", gradient_checkpointing=False)
    with unittest.mock.patch.object(models, "BACKENDS", {"cuda": counter, "cpu": counter}):
        models.compile_decoder(model.get_base_model() if setting == "LoRA" else model, args)
    ids = torch.randint(0, config.vocab_size, (1, 8), device=DEVICE)
    loss_fn(model, dataloader.lm_batch(ids)).backward()
    # LoRA: the first layer's input needs no gradient (the embedding is frozen), the
    # others' do: two compilations, for any number of layers.
    assert counter.frame_count == (2 if setting == "LoRA" else 1), counter.frame_count
    if setting == "every kernel":
        assert "rope_forward" in ops_in(counter), ops_in(counter)


def test_projection_groups_step_aside_under_compile():
    """projections_kernel.py groups only eager calls: a compiled layer runs each projection on
    its own (no grouped node in the graph, nothing kept between calls), and the
    gradients are eager's but for where the sums of dx round."""
    model, ids = _model_and_batch()
    loss_fn, _ = apply_kernels(model, {name: True for name in ("rmsnorm", "swiglu", "projections")})
    eager = _loss_and_grads(model, loss_fn, ids, None)
    compiled_model = copy.deepcopy(model)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(BACKEND)
    args = argparse.Namespace(compile=True, compile_mode="default", gradient_checkpointing=False)
    with unittest.mock.patch.object(models, "BACKENDS", {"cuda": counter, "cpu": counter}):
        models.compile_decoder(compiled_model, args)
    grouped = []
    real = projections.grouped_products
    with unittest.mock.patch.object(projections, "grouped_products", lambda *a: grouped.append(1) or real(*a)):
        loss, grads = _loss_and_grads(compiled_model, loss_fn, ids, None)
    assert counter.frame_count >= 1 and not grouped  # traced and run without a grouped product
    assert_same(loss, eager[0], "loss")  # the forward products are the same bits
    for name, g in eager[1].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("setting", ["synthetic", "lora", "packed data"])
def test_compile_flag_trains_with_the_eager_losses(setting, capsys):
    # --lora: the layers are compiled with PEFT's adapters in them; packed data:
    # with the block-diagonal 4-D mask and the restarted positions.
    data = {"synthetic": ["--dataset", "synthetic", "--seq-len", "16"],
            "lora": ["--dataset", "synthetic", "--seq-len", "16", "--lora"],
            "packed data": ["--batch-size", "1", "--seq-len", "64", "--packing"]}[setting]

    def run(*extra):
        parser = argparse.ArgumentParser()
        flags.add_model_args(parser, custom_kernels_default=True)
        flags.add_finetune_args(parser)
        args = parser.parse_args(["--tiny", "--steps", "2", "--warmup-steps", "0", *data, *extra])
        torch._dynamo.reset()
        return run_setup.run_finetune(args, "test", "finetune_optimized.py", apply_kernels)["losses"]

    # --compile turns the projections' groups off (their sums round once, Inductor's after
    # each term): the eager run without them is the one to match.
    eager, with_compile = run("--no-use-custom-projections"), run("--compile")
    out = capsys.readouterr().out
    assert "Compile:       2 decoder layers with torch.compile" in out
    assert "--use-custom-projections is off" in out
    if setting == "lora":
        assert "LoRA:          r 16" in out
    if ON_GPU:
        torch.testing.assert_close(torch.tensor(with_compile), torch.tensor(eager))
    else:
        assert with_compile == eager


def test_eager_calls_skip_the_dispatcher():
    """In eager mode the launchers are called directly: no llama_kernels:: operator
    appears in the profile (the operator path would add dispatcher time per call)."""
    torch.manual_seed(0)
    x, w = leaf((4, 32), torch.float32), leaf((32,), torch.float32)
    # RoPE with a frozen q: its launcher's first argument (dq) is None in backward.
    q, k = torch.randn(1, 2, 4, 16, device=DEVICE), leaf((1, 1, 4, 16), torch.float32)
    cos, sin = _rope_tables(4, torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rmsnorm(x, w).sum().backward()
        rope(q, k, cos[:1], sin[:1])[1].sum().backward()
    names = {e.name for e in prof.events()}
    assert "TritonRMSNormFunction" in names
    assert not [n for n in names if n.startswith("llama_kernels::")], sorted(names)


# --------------------------------------------------------------------------------
# GPU: Inductor, and CUDA graphs
# --------------------------------------------------------------------------------
def test_cuda_graph_mode_matches_eager():
    """mode="reduce-overhead": the compiled layers are captured into CUDA graphs and
    replayed; our kernels make no host synchronization, so capture works."""
    need_gpu()
    model, ids = _model_and_batch()
    loss_fn, _ = apply_kernels(model, {name: True for name in flags.KERNELS})
    eager = _loss_and_grads(model, loss_fn, ids)
    torch._dynamo.reset()
    for layer in model.get_decoder().layers:
        layer.compile(fullgraph=True, mode="reduce-overhead")
    for step in range(4):  # warm-up, capture, then replays
        torch.compiler.cudagraph_mark_step_begin()
        loss, grads = _loss_and_grads(model, loss_fn, ids)
        torch.testing.assert_close(loss, eager[0])
        for name, g in eager[1].items():
            torch.testing.assert_close(grads[name], g, msg=lambda m, name=name: f"{name}, step {step}: {m}")

