"""
Tests of the FP8 linear layer and its scaling kernels (fp8_kernel.py, Step 22) and of
the Triton FP8 GEMM (fp8_gemm_kernel.py).

* quantize (Triton) equals quantize_reference bit for bit: both recipes, with and
  without the transposed copy, ragged shapes, bf16/fp16/fp32, a zero row, huge
  values, a transposed view; every bf16 value and every rounding tie of e4m3;
* the quantization error is within e4m3's rounding; the launch path never syncs
  with the host (CPU: Tensor.item and friends raise; GPU: a CUDA graph captures it);
* triton_scaled_mm and scaled_mm (torch._scaled_mm, which runs on CPU too) against
  the dequantized float32 product;
* fp8_linear forward and backward: equal to the product of the dequantized
  operands to float32 rounding, and within FP8 error of the float64 truth; frozen
  weights (no gradient, quantized once, re-quantized after an in-place update);
  torch.compile; refusals in one line;
* producers (RMSNorm, SwiGLU forward and backward) hand the casts their outputs' amax:
  the same bits as two-pass casts, never for a changed or partial output;
* replace_linears on a tiny LLaMA, with and without peft's LoRA;
* on a GPU: the same bits as PyTorch's cast, cuBLASLt vs the Triton GEMM, bf16
  layers of realistic size.

Usage:
    python -m pytest fp8_test.py -v
    python fp8_test.py
"""

import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, need_gpu, rel_err

import fp8_kernel
from fp8_kernel import (
    FP8_MAX, GRAD_FORMATS, RECIPES, FP8Linear, FP8LinearFunction, fp8_linear, fp8_supported, linears_to_cast, quantize,
    quantize_reference, quantize_side_by_side, quantize_stacked, replace_linears, scaled_mm, scaled_mm_reference,
)
from fp8_gemm_kernel import triton_scaled_mm

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Two float32 GEMMs of the same fp8 operands: on the CPU they differ only in the order of
# the float32 sums; the GPU's FP8 tensor cores accumulate with fewer bits than float32.
SAME_PRODUCT = 1e-6 if DEVICE.type == "cpu" else 2e-3


def bits(t):
    return None if t is None else (t.view(torch.uint8) if t.element_size() == 1 else t)


def assert_same(got, want):
    """Two Fp8Tensors hold the same bytes and the same scales (shapes and dtypes included)."""
    for name, a, b in zip(got._fields, got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{name}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
        assert torch.equal(bits(a), bits(b)), f"{name}: {(bits(a) != bits(b)).sum().item()} elements differ"


def sample(shape, dtype, seed=0):
    """Rows of random values over several magnitudes, one row of zeros, one of huge values
    (up to ~4e4: fp16 holds them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    rows = x.view(-1, shape[-1])
    if rows.shape[0] > 2:
        rows[1] = 0.0
        rows[2] = 1e4 * torch.randn(shape[-1], generator=g)
    return x.to(DEVICE, dtype)


# --------------------------------------------------------------------------------
# The scaling kernels
# --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(37, 80), (1, 16), (130, 48)], ids=str)
def test_quantize_is_the_reference_bit_for_bit(shape, dtype):
    x = sample(shape, dtype)
    for recipe in RECIPES:
        for transpose in (False, True):
            align = 16 if transpose else 1
            for fmt in GRAD_FORMATS:
                got = quantize(x, recipe, transpose, align, fmt)
                assert got.data.dtype == GRAD_FORMATS[fmt][0]
                assert_same(got, quantize_reference(x, recipe, transpose, align, fmt))


@pytest.mark.parametrize("fmt", GRAD_FORMATS)
def test_every_bf16_value_and_every_tie_rounds_as_pytorch(fmt):
    """The format's largest value in the tensor makes the tensorwise scale exactly 1: the
    cast sees the values themselves. Every finite bf16 value in range, every midpoint
    between neighbouring fp8 values (ties go to the even code) and the floats next to
    those midpoints."""
    dtype, top = GRAD_FORMATS[fmt]
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = codes[torch.isfinite(codes)].unique()
    ties = (values[1:] + values[:-1]) / 2
    up, down = torch.full_like(ties, 1e9), torch.full_like(ties, -1e9)
    bf16 = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf16 = bf16[torch.isfinite(bf16) & (bf16.abs() <= top)]
    x = torch.cat([torch.tensor([top, -0.0, 1e-30, -1e-40]), values, ties, torch.nextafter(ties, up),
                   torch.nextafter(ties, down), bf16])
    x = torch.cat([x, torch.zeros(-x.numel() % 256)]).reshape(-1, 256).to(DEVICE)
    got, want = quantize(x, "tensorwise", fmt=fmt), quantize_reference(x, "tensorwise", fmt=fmt)
    assert want.inv_scale.item() == 1.0
    assert_same(got, want)


def test_transposed_view_is_read_in_place():
    base = sample((48, 37), torch.bfloat16, seed=1)
    x = base.t()  # [37, 48] with strides (1, 37)
    for recipe in RECIPES:
        got = quantize(x, recipe, transpose=True)
        assert_same(got, quantize_reference(x, recipe, transpose=True))
        assert_same(got, quantize(x.contiguous(), recipe, transpose=True))


@pytest.mark.parametrize("where", [0, 1000, -1], ids=["first", "middle", "last"])
def test_per_tensor_amax_of_a_flat_or_a_strided_x(where):
    """Per tensor, a contiguous x or a transposed view is read flat by several programs and
    the cast reduces their maxima; a slice of a wider tensor takes the tiled kernel. The
    largest value first, in the middle or last: whichever program read it, it sets the scale."""
    wide = sample((40, 96), torch.float32, seed=3)
    wide.view(-1)[where] = 5e5
    for x in (wide, wide.t(), wide[:, 7:71], wide[3:, 7:71].t()):
        for transpose in (False, True):
            assert_same(quantize(x, "tensorwise", transpose), quantize_reference(x, "tensorwise", transpose))
    assert quantize(wide, "tensorwise").inv_scale.item() == pytest.approx(5e5 / FP8_MAX, rel=1e-6)


def test_all_zeros_give_zeros_and_finite_scales():
    x = torch.zeros(5, 32, device=DEVICE)
    for recipe in RECIPES:
        q = quantize(x, recipe, transpose=True)
        assert_same(q, quantize_reference(x, recipe, transpose=True))
        assert not bits(q.data).any() and not bits(q.data_t).any()
        assert torch.isfinite(q.inv_scale).all() and torch.isfinite(q.inv_scale_t).all()


def test_padding_of_the_transposed_copy():
    x = sample((37, 32), torch.bfloat16, seed=2)
    q = quantize(x, "rowwise", transpose=True, align=16)
    assert q.data_t.shape == (32, 48) and not bits(q.data_t[:, 37:]).any()
    assert torch.equal(bits(q.data_t[:, :37]), bits(quantize(x, "rowwise", transpose=True).data_t))


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantization_error_within_e4m3_rounding(recipe):
    # e4m3 keeps 3 mantissa bits: a normal value v = 1.m x 2^e is rounded to a multiple
    # of 2^(e-3), an error of at most half of it, 2^(e-4) <= 2^-4 |v|. Below 2^-6
    # (subnormals) the values are multiples of 2^-9: an absolute error of at most 2^-10.
    # Dequantizing multiplies by inv_scale ~ amax / 448, so in x's units:
    #     |q * inv_scale - x| <= 2^-4 |x| + 2^-10 amax / 448
    # plus float32's own roundings of scale and inverse (relative 2^-23: the 1e-6 below).
    x = sample((37, 80), torch.float32, seed=3)
    q = quantize(x, recipe, transpose=True)
    for data, inv, xs in ((q.data, q.inv_scale, x), (q.data_t, q.inv_scale_t, x.t())):
        amax = xs.abs().amax(dim=1, keepdim=True) if recipe == "rowwise" else xs.abs().amax()
        error = (data.float() * inv - xs).abs()
        bound = 2**-4 * xs.abs() + 2**-10 * amax / FP8_MAX
        assert (error <= bound * (1 + 1e-6)).all(), (error - bound).max().item()
        assert (error > 0).any()  # it did round (the test can fail)


def test_no_host_sync_in_the_launch_path(monkeypatch):
    """Reading a value on the host would block the CPU until the GPU is done (and break
    CUDA-graph capture). On the CPU we make every such read raise."""
    x = sample((20, 32), torch.bfloat16, seed=4).requires_grad_()
    w = sample((16, 32), torch.bfloat16, seed=5).requires_grad_()

    def sync(*args, **kwargs):
        raise AssertionError("host sync")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    for recipe in RECIPES:
        quantize(x.detach(), recipe, transpose=True)
        fp8_linear(x, w, None, recipe, emulate=True).sum().backward()
    with pytest.raises(AssertionError, match="host sync"):
        x.sum().item()  # the patch is in force


def test_cuda_graph_captures_quantize_and_the_layer():
    need_gpu()
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16) / 20
    for recipe in RECIPES:
        quantize(x, recipe, True, 16), fp8_linear(x, w, None, recipe)  # compile the kernels first
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q = quantize(x, recipe, True, 16)
            y = fp8_linear(x, w, None, recipe)
        x.copy_(torch.randn_like(x) * 3)  # new values, same memory: the replay must see them
        graph.replay()
        assert_same(q, quantize_reference(x, recipe, True, 16))
        assert rel_err(y, F.linear(x.double(), w.double())) < 0.1


def test_gpu_weight_amax_inside_the_captured_step():
    """The optimizer's weight amax in a captured step (forward, backward, update replayed):
    each replayed forward casts the weights with the slots the previous replay's update
    filled. Every loss and the final weights equal those of the run that measures."""
    need_fp8()
    from adamw_kernel import TritonAdamW
    from kernel_ft.cuda_graphs import side_stream
    from rmsnorm_kernel import TritonRMSNorm

    def run(measure_in_optimizer, replays=6):
        torch.manual_seed(7)
        norm = TritonRMSNorm(1024).to("cuda", torch.bfloat16)
        layer = FP8Linear(torch.nn.Linear(1024, 2048, bias=False), "tensorwise").to("cuda", torch.bfloat16)
        params = [norm.weight, layer.weight]
        optimizer = TritonAdamW(params, lr=1e-2, fp8_weight_amax=measure_in_optimizer)
        x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)

        def step():
            loss = layer(norm(x)).float().square().mean()
            loss.backward()
            optimizer.step()
            return loss

        with side_stream(x.device):
            for _ in range(2):  # eager steps first: the optimizer's state, the weights' slots
                step()
                optimizer.zero_grad(set_to_none=True)
        optimizer.prepare_capture()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = step()
        losses = []
        for _ in range(replays):
            optimizer.stage_graph_step()
            graph.replay()
            losses.append(loss.clone())
        return torch.stack(losses), [p.detach().clone() for p in params]

    losses, weights = run(True)
    want_losses, want_weights = run(False)
    assert torch.equal(losses, want_losses)
    assert all(torch.equal(a, b) for a, b in zip(weights, want_weights))
    assert not torch.equal(losses[0], losses[-1])  # the replays trained


# --------------------------------------------------------------------------------
# The scaled GEMMs
# --------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_gemms_match_the_dequantized_product(recipe):
    a = quantize(sample((48, 64), torch.float32, seed=6), recipe)
    b = quantize(sample((32, 64), torch.float32, seed=7), recipe)
    args = (a.data, a.inv_scale, b.data, b.inv_scale)
    want = scaled_mm_reference(*args, torch.float32)
    # Products of fp8 values are exact in float32; only the order of the sums differs.
    assert rel_err(triton_scaled_mm(*args, torch.float32), want) < SAME_PRODUCT
    got = triton_scaled_mm(*args, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 2**-8  # bf16's rounding: 2^-9 at most
    assert rel_err(scaled_mm(*args, torch.float32), want) < SAME_PRODUCT  # the arguments reach _scaled_mm right
    bias = torch.randn(32, device=DEVICE)
    assert rel_err(scaled_mm(*args, torch.float32, bias), scaled_mm_reference(*args, torch.float32, bias)) \
        < SAME_PRODUCT


# --------------------------------------------------------------------------------
# The linear layer
# --------------------------------------------------------------------------------
def run_linear(fn, x, w, b, dy):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(dy)
    return [y.detach(), x.grad, w.grad, b.grad]


@pytest.mark.parametrize("grads", GRAD_FORMATS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_is_the_product_of_its_fp8_operands(recipe, grads):
    """In float32 every GEMM equals the float32 product of the dequantized operands; the
    operands are quantize_reference's (bit for bit the kernels', tested above), the
    output's gradient in the asked format."""
    x, w, b = sample((2, 21, 64), torch.float32, 8), sample((48, 64), torch.float32, 9), torch.randn(48).to(DEVICE)
    dy = torch.randn(2, 21, 48) * torch.exp(2 * torch.randn(2, 21, 1))  # rows of many sizes: e4m3 != e5m2
    y, dx, dw, db = run_linear(lambda *a: fp8_linear(*a, recipe, emulate=True, grads=grads), x, w, b, dy.to(DEVICE))
    x2, dy2 = x.reshape(42, 64), dy.reshape(42, 48).to(DEVICE)
    xq, wq = quantize_reference(x2, recipe, True, 16), quantize_reference(w, recipe, True)
    dyq = quantize_reference(dy2, recipe, True, 16, grads)
    f32 = torch.float32
    want_y = scaled_mm_reference(xq.data, xq.inv_scale, wq.data, wq.inv_scale, f32, b)
    want_dx = scaled_mm_reference(dyq.data, dyq.inv_scale, wq.data_t, wq.inv_scale_t, f32)
    want_dw = scaled_mm_reference(dyq.data_t, dyq.inv_scale_t, xq.data_t, xq.inv_scale_t, f32)
    assert rel_err(y.reshape(42, 48), want_y) < SAME_PRODUCT
    assert rel_err(dx.reshape(42, 64), want_dx) < SAME_PRODUCT
    assert rel_err(dw, want_dw) < SAME_PRODUCT
    assert torch.allclose(db, dy2.sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grads", GRAD_FORMATS)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_linear_within_fp8_error_of_the_truth(recipe, dtype, grads):
    # Each operand carries e4m3's rounding, up to 2^-4 relative and about 2^-4/sqrt(3)
    # ~ 0.036 in RMS for values spread over the binade; a product of two has ~sqrt(2)
    # times that, and a sum of many such products keeps the relative RMS (the errors are
    # independent). We measure 0.025 - 0.04 on these shapes; 0.1 leaves room for the
    # randomness without letting a wrong scale (a factor of 2 or more: error >= 0.5) pass.
    # e5m2 gradients (2 mantissa bits) double dy's share in dx and dw: ~0.06, still < 0.1.
    x, w = sample((3, 17, 64), dtype, 10), (torch.randn(48, 64) / 8).to(DEVICE, dtype)
    b, dy = torch.randn(48).to(DEVICE, dtype), torch.randn(3, 17, 48).to(DEVICE, dtype)
    got = run_linear(lambda *a: fp8_linear(*a, recipe, emulate=True, grads=grads), x, w, b, dy)
    truth = run_linear(F.linear, x.double(), w.double(), b.double(), dy.double())
    for name, a, t in zip(["y", "dx", "dw", "db"], got, truth):
        assert a.dtype == dtype, name
        assert rel_err(a, t) < (0.1 if name != "db" else 1e-2), f"{name}: {rel_err(a, t):.3f}"


def count_casts(monkeypatch):
    """The shapes of the tensors fp8_kernel.quantize is called on from now on (a list that grows)."""
    calls = []
    real = fp8_kernel.quantize
    monkeypatch.setattr(fp8_kernel, "quantize", lambda t, *a, **k: calls.append(tuple(t.shape)) or real(t, *a, **k))
    return calls


def test_frozen_weight_is_quantized_once(monkeypatch):
    calls = count_casts(monkeypatch)
    w = torch.nn.Parameter(sample((32, 48), torch.float32, 11), requires_grad=False)
    x = sample((5, 48), torch.float32, 12).requires_grad_()
    y1 = FP8LinearFunction.apply(x, w, None, "rowwise", "e4m3")
    assert calls == [(5, 48), (32, 48)]  # x, then W (with its transposed copy: x needs a gradient)
    y1.sum().backward()
    assert w.grad is None and x.grad is not None
    calls.clear()
    y2 = FP8LinearFunction.apply(x, w, None, "rowwise", "e4m3")
    assert calls == [(5, 48)] and torch.equal(y1, y2)  # W from the cache
    with torch.no_grad():
        w.mul_(2)  # an in-place update: a new version of the weight
    calls.clear()
    y3 = FP8LinearFunction.apply(x, w, None, "rowwise", "e4m3")  # x is y2's: its cast is kept (test below)
    assert calls == [(32, 48)] and torch.allclose(y3, 2 * y1, rtol=1e-6)
    calls.clear()
    FP8LinearFunction.apply(x, w, None, "tensorwise", "e4m3")  # another recipe: another entry
    assert calls == [(5, 48), (32, 48)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_layers_that_read_one_x_share_its_cast(monkeypatch, recipe):
    """q, k and v read one x: it is cast once and its x^T saved once, and every output and
    gradient is what three layers give on three copies of x."""
    calls = count_casts(monkeypatch)
    x = sample((2, 9, 32), torch.float32, 20)
    ws = [sample((16, 32), torch.float32, 21 + i) for i in range(3)]
    dys = [torch.randn(2, 9, 16).to(DEVICE) for _ in ws]

    def run(xs):
        ws_ = [w.clone().requires_grad_() for w in ws]
        ys = [FP8LinearFunction.apply(xi, w, None, recipe, "e4m3") for xi, w in zip(xs, ws_)]
        saved = [y.grad_fn.saved_tensors[0] for y in ys]  # each layer's fp8 x^T
        torch.autograd.backward(ys, dys)
        return ys, [w.grad for w in ws_], saved

    copies = [x.clone().requires_grad_() for _ in ws]
    ys, dws, saved = run(copies)
    assert calls.count((18, 32)) == 3 and len({t.data_ptr() for t in saved}) == 3
    assert not fp8_kernel._LAST_INPUT  # backward dropped the last input's entry
    calls.clear()
    one = x.clone().requires_grad_()
    ys1, dws1, saved1 = run([one] * 3)
    assert calls.count((18, 32)) == 1 and len({t.data_ptr() for t in saved1}) == 1
    for a, b in zip(ys + dws, ys1 + dws1):
        assert torch.equal(a, b)
    assert rel_err(one.grad, sum(c.grad for c in copies)) < 1e-6  # the same terms, summed in another order


def test_a_written_or_new_x_is_cast_anew(monkeypatch):
    """The kept cast is never stale: an in-place write, or another tensor with the same
    shape (or the same address, once the first is freed), is cast again."""
    calls = count_casts(monkeypatch)
    w = sample((16, 32), torch.float32, 30).requires_grad_()

    def cast_count_and_check(x):
        calls.clear()
        y = FP8LinearFunction.apply(x, w, None, "rowwise", "e4m3")
        casts = calls.count(tuple(x.shape))
        with torch.no_grad():  # the operator, no kept cast: the truth for these values
            want = fp8_kernel.fp8_linear_forward(x, w, None, "rowwise", "e4m3", False, False, True)[0]
        assert torch.equal(y, want)
        return casts

    x = sample((6, 32), torch.float32, 31)
    assert cast_count_and_check(x) == 1
    assert cast_count_and_check(x) == 0  # the same x, unwritten: kept
    x.mul_(3)
    assert cast_count_and_check(x) == 1  # written in place: a new version
    assert cast_count_and_check(x.clone()) == 1  # equal values, another storage
    del x
    x = sample((6, 32), torch.float32, 32)
    assert cast_count_and_check(x) == 1  # a new storage, even where it reuses the freed address


def test_forward_without_gradients_quantizes_no_transposed_copy(monkeypatch):
    seen = []
    real = fp8_kernel.quantize

    def spy(t, recipe, transpose=False, align=1, fmt="e4m3", amax=None):
        seen.append(transpose)
        return real(t, recipe, transpose, align, fmt, amax)

    monkeypatch.setattr(fp8_kernel, "quantize", spy)
    x, w = sample((8, 32), torch.float32, 13), sample((16, 32), torch.float32, 14).requires_grad_()
    with torch.no_grad():
        fp8_linear(x, w, emulate=True)
    assert seen == [False, False]


# --------------------------------------------------------------------------------
# Producers that hand their output's amax to the cast (kernel_common, "FP8 producers")
# --------------------------------------------------------------------------------
def producer_block(x, dy, fused, grads, producers, seen):
    """RMSNorm -> gate/up (or one gate_up) -> SwiGLU -> down, per-tensor FP8 layers, forward
    and backward; ``producers`` False: no layer registered, so every cast measures its own
    amax. ``seen`` gets, per cast, whether it was handed the amax. Returns the outputs and
    every gradient."""
    import kernel_common
    from rmsnorm_kernel import TritonRMSNorm
    from swiglu_kernel import gated_activation

    torch.manual_seed(5)
    hidden, inter = x.shape[-1], 48
    norm = TritonRMSNorm(hidden).to(DEVICE, x.dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
    shapes = [(2 * inter, hidden)] if fused else [(inter, hidden), (inter, hidden)]
    linears = [torch.nn.Linear(k, n, bias=False).to(DEVICE, x.dtype) for n, k in shapes + [(hidden, inter)]]
    layers = [FP8Linear(m, "tensorwise", emulate=True, grads=grads) for m in linears]
    if not producers:
        kernel_common._WEIGHTS.clear()
    xx = x.clone().requires_grad_()
    h = norm(xx)
    gate, up = (layers[0](h), None) if fused else (layers[0](h), layers[1](h))
    y = layers[-1](gated_activation(gate, up, "silu"))
    y.backward(dy)
    return [y, xx.grad, norm.weight.grad] + [m.weight.grad for m in layers]


@pytest.mark.parametrize("fused", [False, True], ids=["gate,up", "gate_up"])
@pytest.mark.parametrize("grads", list(GRAD_FORMATS))
def test_producers_hand_the_amax_and_change_no_bit(monkeypatch, fused, grads):
    """The norm's and the SwiGLU's outputs (forward) and SwiGLU's gradients (backward) reach
    their per-tensor casts with the amax measured by the kernel that made them: the layer
    reads x once. Outputs and gradients are the two-pass casts' bit for bit."""
    import kernel_common

    taken = []
    real = fp8_kernel.take_amax
    monkeypatch.setattr(fp8_kernel, "take_amax", lambda t: taken.append(r := real(t)) or r)
    x = sample((3, 11, 32), torch.bfloat16, 40) * 4
    dy = torch.randn(3, 11, 32).to(DEVICE, torch.bfloat16)
    with_producers = producer_block(x, dy, fused, grads, True, taken)
    handed = [t is not None for t in taken]
    # Forward: the first projection's x (shared by the second), down's x; backward: down's dy
    # comes from outside (measured), then up's and gate's (or gate_up's one) from SwiGLU.
    assert handed == ([True, True, False, True] if fused else [True, True, False, True, True]), handed
    assert not kernel_common._PRODUCED  # each noted amax was taken
    taken.clear()
    without = producer_block(x, dy, fused, grads, False, taken)
    assert not any(t is not None for t in taken)
    for a, b in zip(with_producers, without):
        assert torch.equal(a, b)


def test_a_changed_or_partial_output_measures_its_own_amax():
    """Only the exact, unwritten output a producer noted gets its amax: after an in-place
    write, for a slice of it, and for a copy, the cast measures (and matches the reference)."""
    import kernel_common
    from rmsnorm_kernel import TritonRMSNorm

    layer = FP8Linear(torch.nn.Linear(32, 16, bias=False), "tensorwise", emulate=True).to(DEVICE)
    assert layer.weight in kernel_common._WEIGHTS  # a per-tensor layer: the producers note amaxes
    norm = TritonRMSNorm(32).to(DEVICE)
    x = sample((6, 32), torch.float32, 41).requires_grad_()
    y = norm(x)
    assert kernel_common.take_amax(y.reshape(-1, 32)) is not None  # the 2-D view of y: its elements
    for changed in (lambda y: y.detach().mul_(1e3), lambda y: y[:3], lambda y: y.clone(), lambda y: y[:, :16]):
        y = norm(x)
        t = changed(y)
        assert kernel_common.take_amax(t) is None
        assert_same(quantize(t, "tensorwise", True, 16), quantize_reference(t, "tensorwise", True, 16))
    with pytest.raises(ValueError, match="one maximum per tensor"):
        quantize(y, "rowwise", amax=torch.zeros(4, device=DEVICE))
    kernel_common._PRODUCED.clear()


def test_no_fp8_layer_no_producer_work():
    """Without a per-tensor FP8 layer alive, the kernels note nothing (no slots, no atomics)."""
    import gc
    import kernel_common
    from rmsnorm_kernel import TritonRMSNorm

    gc.collect()
    kernel_common._PRODUCED.clear()
    rowwise = FP8Linear(torch.nn.Linear(32, 16, bias=False), "rowwise", emulate=True)
    assert rowwise.weight not in kernel_common._WEIGHTS  # per row: a produced tensor maximum is no use
    kernel_common._WEIGHTS.clear()
    TritonRMSNorm(32).to(DEVICE)(sample((6, 32), torch.float32, 42).requires_grad_())
    assert not kernel_common._PRODUCED


def test_optimizer_hands_each_weight_its_amax_once(monkeypatch):
    """TritonAdamW(fp8_weight_amax=True) folds max |new W| into the weight's slots as it
    updates it; the next forward's cast takes them (one read of W), a second forward or a
    weight changed in place after the step measures again, and the run is the bits of the
    same run that measures every time."""
    import kernel_common
    from adamw_kernel import TritonAdamW

    taken = []
    real = fp8_kernel.take_weight_amax
    monkeypatch.setattr(fp8_kernel, "take_weight_amax", lambda w: taken.append(r := real(w)) or r)
    x = sample((4, 5, 32), torch.float32, 43)

    def train(measure_in_optimizer, steps=3):
        torch.manual_seed(6)
        layer = FP8Linear(torch.nn.Linear(32, 16, bias=False), "tensorwise", emulate=True).to(DEVICE)
        optimizer = TritonAdamW(layer.parameters(), lr=0.05, fp8_weight_amax=measure_in_optimizer)
        losses = []
        for _ in range(steps):
            loss = layer(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return layer, losses

    layer, losses = train(True)
    assert [t is not None for t in taken] == [False, True, True]  # the first step's cast: no update yet
    other, losses_measured = train(False)
    assert torch.equal(torch.stack(losses), torch.stack(losses_measured)) and torch.equal(layer.weight, other.weight)
    taken.clear()
    with torch.no_grad():
        y = layer(x)  # the cast after the last update: handed over
        assert torch.equal(layer(x), y)  # a second one measures, the same bits
        layer.weight.mul_(2)  # a write after the update: its own amax, and the right result
        assert torch.equal(layer(x), other(x) * 2)
    assert [t is not None for t in taken] == [True, False, False, False]  # (the last: the other layer's)
    assert kernel_common.weight_amax_slots(torch.nn.Parameter(torch.ones(3))) is None  # not an FP8 weight


def test_gpu_producers_inside_a_cuda_graph():
    """The default training step is one CUDA graph: producer and cast captured together
    hand the amax over in every replay (new input values, same memory)."""
    need_fp8()
    from rmsnorm_kernel import TritonRMSNorm

    norm = TritonRMSNorm(1024).to("cuda", torch.bfloat16)
    layer = FP8Linear(torch.nn.Linear(1024, 2048, bias=False), "tensorwise").to("cuda", torch.bfloat16)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)

    def step():
        return layer(norm(x))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = step()
    for scale in (1.0, 50.0, 1e-3):
        x.copy_(torch.randn_like(x) * scale)
        norm.weight.data.uniform_(0.1 * scale, 10.0 * scale)
        graph.replay()
        with torch.no_grad():
            h = norm(x).detach().clone()  # a copy: measured by the two-pass cast
            want = fp8_kernel._linear_forward(h, layer.weight, None, "tensorwise", False,
                                              quantize(h, "tensorwise", align=16))[0]
        assert torch.equal(y, want), scale


def test_inside_torch_compile():
    x, w = sample((2, 9, 32), torch.float32, 15), sample((16, 32), torch.float32, 16)
    b, dy = torch.randn(16).to(DEVICE), torch.randn(2, 9, 16).to(DEVICE)
    compiled = torch.compile(lambda x, w, b: fp8_linear(x, w, b, "rowwise", emulate=True), backend="aot_eager",
                             fullgraph=True)
    got = run_linear(compiled, x, w, b, dy)
    want = run_linear(lambda *a: fp8_linear(*a, "rowwise", emulate=True), x, w, b, dy)
    for a, c in zip(got, want):
        assert torch.equal(a, c)


def test_fast_accum_survives_torch_compile(monkeypatch):
    """Under torch.compile the layer is the fp8_linear_forward operator and its registered
    backward: fast_accum rides through the operator's arguments to both backward products."""
    x, w = sample((2, 16, 32), torch.float32, 15), sample((16, 32), torch.float32, 16)
    dy = torch.randn(2, 16, 16).to(DEVICE)
    calls = []
    real = fp8_kernel.scaled_mm

    def counted(*args, fast_accum=False, **kwargs):
        calls.append(fast_accum)
        return real(*args, fast_accum=fast_accum, **kwargs)

    monkeypatch.setattr(fp8_kernel, "scaled_mm", counted)
    for fast in (False, True):
        compiled = torch.compile(lambda x, w: fp8_linear(x, w, None, "tensorwise", emulate=True, fast_accum=fast),
                                 backend="aot_eager", fullgraph=True)
        calls.clear()
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        compiled(xg, wg).backward(dy)
        assert calls == [True, fast, fast]  # forward, then dx and dW
        torch._dynamo.reset()


def test_refusals_in_one_line():
    x, w = torch.randn(4, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="recipe must be one of"):
        fp8_linear(x, w, recipe="blockwise", emulate=True)
    with pytest.raises(ValueError, match=r"multiples of 16, got weight \[16, 24\]"):
        fp8_linear(x[:, :24], w[:, :24], emulate=True)
    with pytest.raises(ValueError, match=r"multiples of 16, got weight \[20, 32\]"):
        fp8_linear(x, torch.randn(20, 32, device=DEVICE), emulate=True)
    with pytest.raises(TypeError, match="unsupported x dtype torch.int32"):
        fp8_linear(x.int(), w, emulate=True)
    with pytest.raises(ValueError, match=r"weight \[N, K\]"):
        fp8_linear(x, w.t(), emulate=True)
    with pytest.raises(ValueError, match="recipe must be one of"):
        quantize(x, "per-block")
    ok, why = fp8_supported("cpu")
    assert not ok and why == ("FP8 matmuls need a CUDA GPU with FP8 tensor cores (compute capability 8.9+: "
                              "Ada, Hopper, Blackwell); this is a CPU")
    with pytest.raises(RuntimeError, match="this is a CPU") as e:
        fp8_linear(x.cpu(), w.cpu())
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------
# In a model
# --------------------------------------------------------------------------------
def test_the_command_line_knows_the_recipes():
    from kernel_ft import flags

    assert tuple(flags.FP8_RECIPES) == RECIPES
    assert tuple(flags.FP8_GRAD_FORMATS) == tuple(GRAD_FORMATS)


def test_gradient_format_without_fp8_is_noted_and_a_bad_one_refused():
    import finetune_optimized
    from kernel_ft import apply, flags

    notes = flags.settle(finetune_optimized.parse_args(["--tiny", "--fp8-grads", "e5m2"]))._notes
    assert "--fp8-grads e5m2 without --fp8 changes nothing" in notes
    for argv in (["--tiny"], ["--tiny", "--fsdp"]):  # the gather's default says nothing where it does nothing
        assert not any("fp8" in n for n in flags.settle(finetune_optimized.parse_args(argv))._notes), argv
    # Gathered in FP8: by default with --lora (which needs it), by choice for full fine-tuning.
    for argv, gathered in ((["--lora"], True), ([], False), (["--fsdp-fp8-gather"], True),
                           (["--lora", "--no-fsdp-fp8-gather"], False), (["--lora", "--compile"], False)):
        args = finetune_optimized.parse_args(["--tiny", "--fsdp", "--fp8", "tensorwise", *argv])
        assert flags.fp8_gathered(args) is gathered, argv
    for argv, note in ((["--fsdp"], "--fsdp-fp8-gather without --fp8 tensorwise changes nothing"),
                       (["--fsdp", "--fp8", "tensorwise", "--compile"], "--fsdp-fp8-gather with --compile changes nothing"),
                       ([], "--fsdp-fp8-gather without --fsdp changes nothing")):
        notes = flags.settle(finetune_optimized.parse_args(["--tiny", "--fsdp-fp8-gather", *argv]))._notes
        assert any(n.startswith(note) for n in notes), (argv, notes)
    with pytest.raises(ValueError, match="fp8_grads must be one of .'e4m3', 'e5m2'., got 'e5m3'"):
        apply(tiny_llama(), fp8="tensorwise", fp8_grads="e5m3")
    with pytest.raises(ValueError, match="fp8 format must be one of"):
        quantize(torch.ones(4, 16, device=DEVICE), "tensorwise", fmt="e3m4")


def test_fine_tune_refuses_fp8_in_one_line_before_loading(monkeypatch):
    import finetune_optimized

    for argv, expected in ((["--fp8", "rowwise"], "error: --fp8: FP8 matmuls need a CUDA GPU"),
                           (["--fp8", "tensorwise", "--lora-4bit"], "error: --fp8 with --lora-4bit"),
                           (["--fp8", "rowwise", "--fsdp", "--lora"], "error: --fp8 rowwise with --fsdp --lora: the "
                                                                      "fp8 copies of the frozen weights would be kept"),
                           (["--fp8", "tensorwise", "--fsdp", "--lora", "--no-fsdp-fp8-gather"],
                            "error: --fp8 tensorwise with --fsdp --lora"),
                           (["--fp8", "tensorwise", "--fsdp", "--lora", "--compile"],
                            "error: --fp8 tensorwise with --fsdp --lora"),
                           # Gathered in FP8 (the default with --lora), each process casts its own shard: past
                           # every FP8 check (the GPU's passes since the --lora-4bit case), to --fsdp's own.
                           (["--fp8", "tensorwise", "--fsdp", "--lora"], "error: --fsdp runs under torchrun"),
                           (["--fp8", "tensorwise", "--fsdp", "--lora", "--fsdp-fp8-gather"],
                            "error: --fsdp runs under torchrun")):
        monkeypatch.setattr("kernel_ft.flags.installed", lambda package: True)  # bitsandbytes' check passes
        monkeypatch.setattr("torch.cuda.is_available", lambda: False)
        monkeypatch.setattr("kernel_ft.models.load_model", lambda *a: pytest.fail("the model was built before the refusal"))
        if "--lora-4bit" in argv:
            monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # past --lora-4bit's GPU check
            monkeypatch.setattr("swap_common.fp8_supported", lambda device: (True, ""))
        with pytest.raises(SystemExit) as e:
            finetune_optimized.main(argv)
        assert str(e.value.code).startswith(expected) and "\n" not in str(e.value.code), argv


def test_baseline_torchao_peer_refused_in_one_line(monkeypatch):
    import finetune_baseline

    monkeypatch.setattr("kernel_ft.flags.installed", lambda package: package != "torchao")
    with pytest.raises(SystemExit, match=r"^error: --torchao-fp8 needs the torchao package \(pip install torchao\)$"):
        finetune_baseline.main(["--torchao-fp8", "rowwise"])
    monkeypatch.setattr("kernel_ft.flags.installed", lambda package: True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"^error: --torchao-fp8: FP8 matmuls need a CUDA GPU .*this is a CPU$"):
        finetune_baseline.main(["--torchao-fp8", "rowwise"])
    with pytest.raises(SystemExit, match=r"^error: --torchao-fp8 runs in one process .*; leave out --fsdp$"):
        finetune_baseline.main(["--torchao-fp8", "rowwise", "--fsdp"])


def test_baseline_torchao_peer_takes_our_layers():
    """torchao converts exactly the layers ours casts: not the LM head, not LoRA's adapters."""
    pytest.importorskip("torchao.float8")
    import finetune_baseline
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    ours = {name for name, _ in linears_to_cast(model)[0]}
    finetune_baseline.with_torchao_fp8(model, "tensorwise")
    theirs = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert theirs == ours and len(ours) == 14


def test_fine_tune_switches_fp8_in_with_every_kernel(monkeypatch, capsys):
    """apply_kernels with --fp8 (emulated here): the projections become FP8Linear before
    the MLP swap keeps them, q/k/v grouped; the loss stays within FP8's error of the plain model's."""
    from kernel_ft import dataloader
    from kernel_ft import flags
    from kernel_ft import training
    from kernel_ft.run import apply_kernels

    monkeypatch.setattr("kernel_ft.patching.replace_linears",
                        lambda model, recipe, **kw: replace_linears(model, recipe, emulate=True, **kw))
    model = tiny_llama()
    batch = dataloader.lm_batch(torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0)).to(DEVICE))
    want = training.hf_loss(model, batch).item()
    kernels = {**{name: True for name in flags.KERNELS}, "attention": False, "fp8": "tensorwise", "fp8_grads": "e5m2"}
    loss_fn, _ = apply_kernels(model, kernels)
    out = capsys.readouterr().out
    assert "FP8 matmuls:   14 linear layers in float8_e4m3fn (e5m2 gradients)" in out
    assert "Kernels:       rmsnorm, residual, swiglu, rope, flce, adamw, projections, fp8 (tensorwise, e5m2 gradients)" in out
    q_proj = model.model.layers[0].self_attn.q_proj  # grouped with k and v: one stacked product for dx
    assert isinstance(q_proj, FP8Linear) and q_proj.group.names == ("q_proj", "k_proj", "v_proj")
    mlp = model.model.layers[0].mlp
    assert type(mlp).__name__ == "TritonLlamaMLP" and isinstance(mlp.down_proj, FP8Linear)
    assert mlp.down_proj.grads == "e5m2"
    loss = loss_fn(model, batch)
    loss.backward()
    assert abs(loss.item() - want) < 0.02 * want  # e4m3's rounding through two layers, a few parts per thousand
    assert mlp.down_proj.weight.grad is not None


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("fast", [False, True], ids=["precise", "fast"])
def test_fp8_fast_accum_reaches_every_backward_product_and_only_those(monkeypatch, capsys, fast, lora):
    """--fp8-fast-accum: each FP8 product of a training step, counted where it is made,
    runs with use_fast_accum on in forward, and in backward as the flag says, through every
    path a decoder layer takes: q/k/v grouped (stacked backward), gate/up stacked, down_proj
    after SwiGLU (h8^T cast in backward), o_proj alone, and under LoRA the frozen base layers'
    input gradients. The CLI flag and apply's switch both get there."""
    import finetune_optimized
    from kernel_ft import dataloader, models, run
    from kernel_ft import flags

    monkeypatch.setattr("kernel_ft.patching.replace_linears",
                        lambda model, recipe, **kw: replace_linears(model, recipe, emulate=True, **kw))
    calls, phase = [], ["setup"]
    real = fp8_kernel.scaled_mm

    def counted(a8, inv_a, b8, inv_b, out_dtype, bias=None, fast_accum=False):
        calls.append((phase[0], fast_accum))
        return real(a8, inv_a, b8, inv_b, out_dtype, bias, fast_accum)

    monkeypatch.setattr(fp8_kernel, "scaled_mm", counted)
    argv = ["--tiny", "--fp8", "tensorwise"] + (["--fp8-fast-accum"] if fast else []) + (["--lora"] if lora else [])
    args = finetune_optimized.parse_args(argv)
    model = tiny_llama()
    if lora:
        model = models.apply_lora(model, args)
    kernels = {**flags.kernels_from_args(args), "attention": False}
    loss_fn, _ = run.apply_kernels(model, kernels)
    out = capsys.readouterr().out
    assert ("fast accumulation in backward too" in out) == fast
    layer = model.model.layers[0] if not lora else model.base_model.model.model.layers[0]
    down = layer.mlp.down_proj if not lora else layer.mlp.down_proj.base_layer
    assert isinstance(down, FP8Linear) and down.fast_accum == fast
    batch = dataloader.lm_batch(torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0)).to(DEVICE))
    phase[0] = "forward"
    loss = loss_fn(model, batch)
    phase[0] = "backward"
    loss.backward()
    forward = [f for when, f in calls if when == "forward"]
    backward = [f for when, f in calls if when == "backward"]
    # Per layer in forward: q, k, v (split), o, [gate | up] (under LoRA gate and up apart: frozen
    # weights do not stack), down. In backward, every weight trained: per layer dx of q/k/v
    # (stacked), o, [gate | up] and down, and dW of the 7 weights. Under LoRA the frozen base
    # layers' dx only, one product each: 7 in the second layer, 4 in the first (its attention's
    # input, the frozen embedding's output, needs none).
    assert len(forward) == 2 * (7 if lora else 6) and all(forward)
    assert len(backward) == (7 + 4 if lora else 2 * (4 + 7)) and all(f == fast for f in backward)


def test_a_second_apply_does_not_claim_fp8_settings_it_did_not_use(monkeypatch):
    """kernel_ft.apply on a model whose layers an earlier apply made FP8: the same settings
    are reported as in, other ones (recipe, gradients, accumulation) left out in one line,
    an error with strict=True, and the layers keep the first settings; FP8's settings
    without fp8 are said to change nothing."""
    import kernel_ft
    from kernel_ft.patching import KernelNotApplied

    monkeypatch.setattr("kernel_ft.patching.replace_linears",
                        lambda model, recipe, **kw: replace_linears(model, recipe, emulate=True, **kw))
    model = tiny_llama()
    first = kernel_ft.apply(model, fp8="tensorwise", attention=False)
    assert first["fp8"]["status"] == "applied" and first["fp8"]["count"] == 14
    again = kernel_ft.apply(model, fp8="tensorwise", attention=False)
    assert again["fp8"]["status"] == "applied" and again["fp8"]["count"] == 14
    for other in ({"fp8_fast_accum": True}, {"fp8_grads": "e5m2"}, {"fp8": "rowwise"}):
        switches = {"fp8": "tensorwise", "attention": False, **other}
        with pytest.warns(UserWarning, match="earlier kernel_ft.apply with other settings"):
            report = kernel_ft.apply(model, **switches)
        assert report["fp8"]["status"] == "left to PyTorch" and "tensorwise, e4m3 gradients" in report["fp8"]["detail"]
        with pytest.raises(KernelNotApplied, match="the first apply's settings hold"):
            kernel_ft.apply(model, strict=True, **switches)
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 14 and {(m.recipe, m.grads, m.fast_accum) for m in layers} == {("tensorwise", "e4m3", False)}
    report = kernel_ft.apply(tiny_llama(), fp8_fast_accum=True, fp8_grads="e5m2", attention=False)
    assert report["fp8"]["detail"].endswith("fp8_grads='e5m2', fp8_fast_accum=True change nothing without it")


def test_fine_tune_fp8_under_lora_in_bf16(monkeypatch, capsys):
    """--fp8 --lora on a bf16 model: the frozen base layers in FP8, the adapters computed
    in bf16 under autocast (adapters_compute_in); the adapters get finite gradients."""
    from kernel_ft import dataloader
    import finetune_optimized
    from kernel_ft import flags
    from kernel_ft import models, run
    from tools.family_matrix import family_config

    monkeypatch.setattr("kernel_ft.patching.replace_linears",
                        lambda model, recipe, **kw: replace_linears(model, recipe, emulate=True, **kw))
    torch.manual_seed(0)
    model = models.build_random(family_config("llama", {}), torch.device(DEVICE), torch.bfloat16)
    model = models.apply_lora(model, finetune_optimized.parse_args(["--tiny", "--lora", "--lora-r", "4"]))
    kernels = {**dict.fromkeys(flags.KERNELS, False), "fp8": "tensorwise"}
    loss_fn, _ = run.apply_kernels(model, kernels)
    assert "adapters kept in float32, their products in bfloat16" in capsys.readouterr().out
    batch = dataloader.lm_batch(torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(1)).to(DEVICE))
    loss_fn(model, batch).backward()
    grads = [p.grad for n, p in model.named_parameters() if p.grad is not None]
    assert grads and all("lora_" in n for n, p in model.named_parameters() if p.grad is not None)
    assert all(torch.isfinite(g).all() for g in grads)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(config).to(DEVICE, torch.float32)


def test_replace_linears_in_a_tiny_llama():
    model = tiny_llama()
    before = {name: p for name, p in model.named_parameters()}
    ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    want = model(input_ids=ids).logits
    count, skipped = replace_linears(model, "rowwise", emulate=True)
    assert count == 7 * 2 and skipped == []
    assert type(model.lm_head) is torch.nn.Linear
    assert isinstance(model.model.layers[1].mlp.down_proj, FP8Linear)
    assert "recipe=rowwise" in repr(model.model.layers[0].self_attn.q_proj)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)  # the same objects
    got = model(input_ids=ids).logits
    assert rel_err(got, want) < 0.1
    got.float().logsumexp(-1).sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert replace_linears(model, "rowwise") == (0, [])  # nothing left to swap


def test_replace_linears_skips_shapes_fp8_cannot_run():
    model = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.Linear(40, 32), torch.nn.Linear(32, 32))
    count, skipped = replace_linears(model, skip=())
    assert count == 1 and skipped == ["0", "1"] and isinstance(model[2], FP8Linear)


def test_replace_linears_under_lora():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    count, _ = replace_linears(model, "tensorwise", emulate=True)
    assert count == 7 * 2
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, FP8Linear) and not q_proj.base_layer.weight.requires_grad
    assert type(q_proj.lora_A["default"]) is torch.nn.Linear and type(q_proj.lora_B["default"]) is torch.nn.Linear
    ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    assert q_proj.lora_A["default"].weight.grad is not None and q_proj.base_layer.weight.grad is None


# --------------------------------------------------------------------------------
# Layers that read one x, stacked into one product (gate_proj and up_proj)
# --------------------------------------------------------------------------------
@pytest.mark.parametrize("transpose", [False, True], ids=["w", "w,w^T"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_stacked_quantize_is_the_concatenations_bit_for_bit(recipe, transpose):
    """quantize_stacked(parts) is quantize_reference(cat(parts)) without the cat: one scale over
    every part (per tensor), per-row scales of the transposed copy over every part (per row);
    parts whose rows are multiples of 4 (the transposed copy stored as words) or not; per
    tensor, a part's maxima handed over as a producer would."""
    parts = [sample((n, 48), torch.bfloat16, seed) for n, seed in ((32, 1), (20, 2), (13, 3))]
    for chosen in (parts[:2], parts):
        assert_same(quantize_stacked(chosen, recipe, transpose),
                    quantize_reference(torch.cat(chosen), recipe, transpose))
    if recipe == "tensorwise":
        handed = [None, parts[1].abs().amax().float().reshape(1), None]
        assert_same(quantize_stacked(parts, recipe, transpose, handed),
                    quantize_reference(torch.cat(parts), recipe, transpose))


def test_stacked_quantize_refuses_parts_that_do_not_stack():
    with pytest.raises(ValueError, match="one width, dtype and device"):
        quantize_stacked([torch.ones(16, 32, device=DEVICE), torch.ones(16, 48, device=DEVICE)], "tensorwise")
    with pytest.raises(ValueError, match="one amax"):
        quantize_stacked([torch.ones(16, 32, device=DEVICE)], "tensorwise", amaxes=[None, None])


def fp8_layers(weights, recipe, grads="e4m3"):
    """FP8Linear layers (emulated) holding copies of ``weights``, without bias."""
    layers = []
    for w in weights:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(DEVICE, w.dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
        layers.append(FP8Linear(linear, recipe, emulate=True, grads=grads))
    return layers


@pytest.mark.parametrize("grads", GRAD_FORMATS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_side_by_side_quantize_is_the_concatenations_bit_for_bit(recipe, grads):
    """quantize_side_by_side(parts) is quantize_reference(cat(parts, 1)) with its transposed copy,
    without the cat: the parts' columns side by side, one scale (per tensor) or per-row scales
    over every part; per tensor, maxima handed over as a producer would. Rows not a multiple of
    16 (which quantize would pad in the transposed copy) are refused."""
    parts = [sample((32, n), torch.bfloat16, seed) for n, seed in ((48, 1), (16, 2), (20, 3))]
    want = quantize_reference(torch.cat(parts, 1), recipe, True, 16, grads)
    assert_same(quantize_side_by_side(parts, recipe, grads), want)
    if recipe == "tensorwise":
        handed = [None, parts[1].abs().amax().float().reshape(1), None]
        assert_same(quantize_side_by_side(parts, recipe, grads, handed), want)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_side_by_side([p[:20] for p in parts], recipe, grads)


@pytest.mark.parametrize("split", [False, True], ids=["side-by-side", "split"])
@pytest.mark.parametrize("rows", [21, 24], ids=["42-tokens", "48-tokens"])
@pytest.mark.parametrize("grads", GRAD_FORMATS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_stacked_layers_are_the_product_of_the_stacked_operands(recipe, grads, rows, split):
    """FP8Linear.stacked_with: [x W1^T | x W2^T] from one product (``split``: x W1^T and x W2^T
    apart, each from its rows of the stacked weight), dx = [dy1 | dy2] [W1; W2] from one, each
    dW from its rows of dy^T: every GEMM the float32 product of the stacked weight's fp8
    operands (quantize_reference of the concatenation). 42 tokens: split's gradients are
    concatenated before their cast; 48: cast side by side in place."""
    x, ws = sample((2, rows, 64), torch.float32, 8), [sample((48, 64), torch.float32, 9),
                                                     sample((32, 64), torch.float32, 10)]
    M = 2 * rows
    dy = (torch.randn(2, rows, 80) * torch.exp(2 * torch.randn(2, rows, 1))).to(DEVICE)
    layers = fp8_layers(ws, recipe, grads)
    xx = x.clone().requires_grad_()
    y = layers[0].stacked_with(xx, layers[1], split=split)
    if split:
        assert [t.shape for t in y] == [(2, rows, 48), (2, rows, 32)] and all(t.is_contiguous() for t in y)
        torch.autograd.backward(y, dy.split([48, 32], -1))
        y = torch.cat(y, -1)
    else:
        y.backward(dy)
    x2, dy2, f32 = x.reshape(M, 64), dy.reshape(M, 80), torch.float32
    xq, wq = quantize_reference(x2, recipe, True, 16), quantize_reference(torch.cat(ws), recipe, True)
    dyq = quantize_reference(dy2, recipe, True, 16, grads)
    assert y.shape == (2, rows, 80)
    assert rel_err(y.reshape(M, 80), scaled_mm_reference(xq.data, xq.inv_scale, wq.data, wq.inv_scale, f32)) \
        < SAME_PRODUCT
    assert rel_err(xx.grad.reshape(M, 64),
                   scaled_mm_reference(dyq.data, dyq.inv_scale, wq.data_t, wq.inv_scale_t, f32)) < SAME_PRODUCT
    want_dw = scaled_mm_reference(dyq.data_t, dyq.inv_scale_t, xq.data_t, xq.inv_scale_t, f32)
    assert rel_err(torch.cat([m.weight.grad for m in layers]), want_dw) < SAME_PRODUCT


def test_layers_that_cannot_stack_say_so():
    """None (each layer runs alone) for: another recipe, a frozen weight, a bias, stacking off,
    no gradients, a forward hook."""
    ws = [sample((32, 64), torch.float32, 1), sample((16, 64), torch.float32, 2)]
    x = sample((5, 64), torch.float32, 3)
    a, b = fp8_layers(ws, "tensorwise")
    assert a.stacked_with(x, b) is not None
    assert a.stacked_with(x, fp8_layers(ws[1:], "rowwise")[0]) is None
    b.weight.requires_grad_(False)
    assert a.stacked_with(x, b) is None
    b.weight.requires_grad_(True)
    b.bias = torch.nn.Parameter(torch.zeros(16, device=DEVICE))
    assert a.stacked_with(x, b) is None
    b.bias = None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_kernel, "STACK_PROJECTIONS", False)
        assert a.stacked_with(x, b) is None
    with torch.no_grad():  # evaluation: each layer alone skips the transposed copies
        assert a.stacked_with(x, b) is None
    hook = b.register_forward_pre_hook(lambda *_: None)  # it would not run
    assert a.stacked_with(x, b) is None
    hook.remove()
    assert a.stacked_with(x, b) is not None


@pytest.mark.parametrize("recipe", RECIPES)
def test_mlp_runs_fp8_gate_and_up_as_one_gate_up_layer(monkeypatch, recipe):
    """TritonLlamaMLP with FP8 gate_proj and up_proj: one product for both (forward and dx),
    and what the fused layout's one gate_up_proj layer of the two weights stacked computes
    (Phi-3's): outputs and every gradient. Stacking off: each layer its own products."""
    from transformers import LlamaConfig
    from swiglu_kernel import TritonGateUpMLP, TritonLlamaMLP, replace_swiglu

    config = LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu")
    torch.manual_seed(3)
    mlp, fused = TritonLlamaMLP(config).to(DEVICE), TritonGateUpMLP(config).to(DEVICE)
    with torch.no_grad():
        fused.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        fused.down_proj.weight.copy_(mlp.down_proj.weight)
    for m in (mlp, fused):
        assert replace_linears(m, recipe, emulate=True)[0] == 3 - (m is fused)
    products = []
    real = fp8_kernel.scaled_mm
    monkeypatch.setattr(fp8_kernel, "scaled_mm", lambda *a, **k: products.append(a[0].shape) or real(*a, **k))
    x, dy = torch.randn(3, 7, 32).to(DEVICE), torch.randn(3, 7, 32).to(DEVICE)

    def run(module):
        products.clear()
        xx = x.clone().requires_grad_()
        y = module(xx)
        y.backward(dy)
        grads = [p.grad for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        return len(products), [y, xx.grad, torch.cat(grads[:-1]), grads[-1]]

    (stacked, got), (one_layer, want) = run(mlp), run(fused)
    assert (stacked, one_layer) == (2 + 2 + 3, 2 + 2 + 2)  # the dW of gate and up: two products
    for a, b in zip(got, want):
        assert rel_err(a, b) < SAME_PRODUCT
    monkeypatch.setattr(fp8_kernel, "STACK_PROJECTIONS", False)
    assert run(mlp)[0] == 3 + 6
    monkeypatch.setattr(fp8_kernel, "STACK_PROJECTIONS", True)
    # kernel_ft.apply's order: the FP8 layers first, then the MLP swap, whose probe compares
    # the fused activation with the model's own MLP (stacking would move the scales there).
    model = tiny_llama()
    replace_linears(model, recipe, emulate=True)
    assert replace_swiglu(model) == 2
    assert isinstance(model.model.layers[0].mlp, TritonLlamaMLP)
    assert all("stack_projections" not in m.__dict__ for m in model.modules())  # the probe's switch is gone


@pytest.mark.parametrize("layout", ["gate_up", "apart"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens", [21, 32])
def test_fp8_down_proj_casts_h_transposed_in_backward(monkeypatch, layout, activation, tokens):
    """A per-tensor FP8 down_proj after the gated activation: h8^T, written by SwiGLU's
    backward kernel with the forward's scale, instead of kept from forward. The same output
    and every gradient bit for bit as the layer called on h (FP8_DOWN_IN_BACKWARD off), no
    fp8 [I, tokens] copy saved for backward, and h8^T the bytes quantize keeps (padding
    columns zero where the tokens are not a multiple of 16). Both layouts: one [gate | up]
    tensor (Phi-3's gate_up_proj), and gate and up apart (two FP8 layers not stacked)."""
    import swiglu_kernel
    from transformers import LlamaConfig
    from swiglu_kernel import TritonGateUpMLP, TritonLlamaMLP

    config = LlamaConfig(hidden_size=64, intermediate_size=48, hidden_act="silu")  # W^T [48, 64]: not h^T's shape
    torch.manual_seed(5)
    mlp = (TritonGateUpMLP if layout == "gate_up" else TritonLlamaMLP)(config).to(DEVICE, torch.bfloat16)
    mlp.activation = activation
    replace_linears(mlp, "tensorwise", emulate=True)
    monkeypatch.setattr(fp8_kernel, "STACK_PROJECTIONS", False)  # "apart": gate and up reach the Function apart
    assert mlp.casts_fp8_hidden_in_backward()
    x = sample((1, tokens, 64), torch.bfloat16, seed=1)
    dy = sample((1, tokens, 64), torch.bfloat16, seed=2)
    ups = []
    apply = swiglu_kernel.TritonSwiGLUFP8DownFunction.apply
    monkeypatch.setattr(swiglu_kernel.TritonSwiGLUFP8DownFunction, "apply",
                        lambda gate, up, *rest: ups.append(up is not None) or apply(gate, up, *rest))

    def run():
        saved = []

        def pack(t):
            saved.append((t.dtype, tuple(t.shape)))
            return t

        xx = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = mlp(xx)
        y.backward(dy)
        grads = [p.grad for p in mlp.parameters()]
        mlp.zero_grad(set_to_none=True)
        return y.grad_fn.name(), saved, [y, xx.grad, *grads]

    name, saved, got = run()
    assert "TritonSwiGLUFP8DownFunction" in name and ups == [layout == "apart"]
    h_t = (fp8_kernel.FP8_DTYPE, (48, -(-tokens // 16) * 16))
    assert h_t not in saved
    monkeypatch.setattr(swiglu_kernel, "FP8_DOWN_IN_BACKWARD", False)
    assert not mlp.casts_fp8_hidden_in_backward()
    name, saved, want = run()
    assert "TritonSwiGLUFP8DownFunction" not in name and h_t in saved  # the layer alone keeps it
    for a, b in zip(got, want):
        assert torch.equal(a, b)

    # The kernel's h8^T against quantize's transposed copy of the forward's h, also without
    # the gradients (compute_dgate off: the kernel still reads up for h).
    gate = sample((tokens, 96 if layout == "gate_up" else 48), torch.bfloat16, seed=3)
    up = None if layout == "gate_up" else sample((tokens, 48), torch.bfloat16, seed=4)
    h = swiglu_kernel.swiglu_forward(gate, up, activation)
    maxima = fp8_kernel.tensor_maxima(h)
    want = quantize(h, "tensorwise", transpose=True, align=16, amax=maxima)
    for grads in (True, False):
        out = torch.full(want.data_t.shape, 7, dtype=torch.uint8, device=DEVICE)  # the padding must be written
        swiglu_kernel.swiglu_backward_and_hidden(torch.zeros_like(h), gate, up, grads, grads and up is not None,
                                                 activation, store_h=False, h8_t=(out, maxima))
        assert torch.equal(out, bits(want.data_t))


def test_fp8_down_proj_keeps_h8_transposed_where_it_must(monkeypatch):
    """Per row, with a bias, a frozen weight, a hook on the layer (forward or backward, its
    own or global), without gradients, under autocast, with up frozen or of another dtype:
    the layer is called on h (swiglu_fp8_down_proj declines); a bad input is refused."""
    import swiglu_kernel
    from transformers import LlamaConfig
    from swiglu_kernel import TritonLlamaMLP

    config = LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu")
    x = torch.randn(1, 16, 32).to(DEVICE).requires_grad_()
    calls = []
    real = swiglu_kernel.swiglu_fp8_down_proj
    monkeypatch.setattr(swiglu_kernel, "swiglu_fp8_down_proj", lambda *a: calls.append(real(*a)) or calls[-1])

    def mlp_with(change):
        mlp = TritonLlamaMLP(config).to(DEVICE)
        if change == "bias":
            mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(32, device=DEVICE))
        replace_linears(mlp, "rowwise" if change == "rowwise" else "tensorwise", emulate=True)
        if change == "frozen":
            mlp.down_proj.weight.requires_grad_(False)
        return mlp

    for change in ("none", "rowwise", "bias", "frozen", "hook", "backward_hook", "global_hook", "no_grad", "autocast"):
        mlp, calls[:] = mlp_with(change), []
        handle = (mlp.down_proj.register_forward_pre_hook(lambda *_: None) if change == "hook" else
                  mlp.down_proj.register_full_backward_hook(lambda *_: None) if change == "backward_hook" else
                  torch.nn.modules.module.register_module_forward_hook(lambda *_: None) if change == "global_hook"
                  else None)
        assert mlp.casts_fp8_hidden_in_backward() == (change in ("none", "no_grad", "autocast")), change
        with torch.set_grad_enabled(change != "no_grad"), torch.autocast(DEVICE.type, enabled=change == "autocast"):
            mlp(x)
        if handle is not None:
            handle.remove()
        assert len(calls) == 1 and (calls[0] is None) == (change != "none"), change

    mlp = mlp_with("none")
    gate = torch.randn(16, 48).to(DEVICE).requires_grad_()
    assert real(gate, torch.randn(16, 48).to(DEVICE), mlp.down_proj) is None  # up frozen
    assert real(gate, torch.randn(16, 48).to(DEVICE, torch.float64).requires_grad_(), mlp.down_proj) is None
    with pytest.raises(ValueError, match="gate shape"):
        real(gate, torch.randn(16, 40).to(DEVICE).requires_grad_(), mlp.down_proj)


# --------------------------------------------------------------------------------
# On a GPU with FP8 tensor cores
# --------------------------------------------------------------------------------
def need_fp8():
    need_gpu()
    ok, why = fp8_supported(DEVICE)
    if not ok:
        pytest.skip(why)


def test_gpu_cast_is_pytorchs_bit_for_bit():
    need_fp8()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    for recipe in RECIPES:
        for fmt in GRAD_FORMATS:
            assert_same(quantize(x, recipe, True, 16, fmt), quantize_reference(x, recipe, True, 16, fmt))
    # Per row at LLaMA's widths: without x^T the one-pass kernel (whole rows in registers,
    # several rows or many warps per program) and past its limit the two kernels, which
    # also cast every width with x^T.
    for k in (4096, 14336, fp8_kernel.ROW_CAST_MAX_K + 8):
        x = torch.randn(300, k, device="cuda", generator=g, dtype=torch.bfloat16)
        for fmt in GRAD_FORMATS:
            assert_same(quantize(x, "rowwise", fmt=fmt), quantize_reference(x, "rowwise", fmt=fmt))
            assert_same(quantize(x, "rowwise", True, 16, fmt), quantize_reference(x, "rowwise", True, 16, fmt))


def test_gpu_triton_gemm_matches_cublaslt():
    need_fp8()
    a = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(768, 4096, device="cuda", dtype=torch.bfloat16)
    for recipe in RECIPES:
        qa, qb = quantize(a, recipe), quantize(b, recipe)
        args = (qa.data, qa.inv_scale, qb.data, qb.inv_scale)
        want = scaled_mm_reference(*args, torch.float32)
        assert rel_err(scaled_mm(*args, torch.bfloat16), want) < 4e-3
        assert rel_err(triton_scaled_mm(*args, torch.bfloat16), want) < 4e-3
        assert rel_err(triton_scaled_mm(*args, torch.bfloat16, fast_accum=True), want) < 4e-3


@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_bf16_layer(recipe):
    need_fp8()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 999, 1024, device="cuda", generator=g).bfloat16()  # 1998 rows: padded for dW
    w = (torch.randn(2048, 1024, device="cuda", generator=g) / 32).bfloat16()
    b = torch.randn(2048, device="cuda", generator=g).bfloat16()
    dy = torch.randn(2, 999, 2048, device="cuda", generator=g).bfloat16()
    got = run_linear(lambda *a: fp8_linear(*a, recipe), x, w, b, dy)
    truth = run_linear(F.linear, x.double(), w.double(), b.double(), dy.double())
    for name, a, t in zip(["y", "dx", "dw", "db"], got, truth):
        assert a.dtype == torch.bfloat16 and rel_err(a, t) < (0.1 if name != "db" else 1e-2), name


def test_gpu_cast_benchmark_goes_on_after_a_failed_capture(monkeypatch):
    """benchmark_fp8.cast_rows: a provider whose CUDA-graph capture fails (a random op and a
    host sync inside its call) gets no graph time; the next shape's random input and every
    other provider's capture still work, and so does random work after the run."""
    need_fp8()
    import benchmark_fp8

    def syncing_reference(x, recipe, transpose=False):
        torch.rand(1, device=x.device).item()
        return quantize_reference(x, recipe, transpose)

    monkeypatch.setattr(benchmark_fp8, "CAST_SHAPES", [(256, 512), (256, 1024)])
    monkeypatch.setattr(benchmark_fp8, "quantize_reference", syncing_reference)
    rows = benchmark_fp8.cast_rows((1, 5), copy_bw=1e12)
    # shapes x (with, without x^T) x providers: three per row, four per tensor ("amax produced")
    assert len(rows) == 2 * 2 * (3 + 4)
    assert {tuple(r["shape"]) for r in rows} == {(256, 512), (256, 1024)}
    for r in rows:
        if r["provider"] == "ours (Triton)":
            assert r["graph_ms"] is not None, r
        if r["provider"] == "PyTorch eager":
            assert r["graph_ms"] is None, r
    torch.rand(4, device="cuda")
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
