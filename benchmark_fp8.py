"""
Step 22's benchmark -- FP8 casts, FP8 GEMMs and an FP8 MLP stack, ours vs PyTorch and torchao.

Three tables, each printed and written to --json:

1. The casts (fp8_kernel.quantize): bf16 [M, K] -> float8_e4m3fn with dynamic
   scales, per tensor and per row, with and without the transposed copy. Bytes
   moved per element, as our kernels move them (fp8_kernel.cast_traffic): per
   tensor, and per row with the transposed copy, 2 read for the amax + 2 read for
   the cast + 1 written per fp8 copy (5 B, or 6 B with the transposed copy); per row
   without it, one pass (2 read + 1 written: 3 B); GB/s and the share of the
   device's copy bandwidth, the same bytes for every provider. Peer: the same
   recipe in PyTorch (quantize_reference), eager and compiled. Per tensor also
   "ours, amax produced": the cast alone, handed the amax by x's producer (one read).
1b. What that amax costs its producers: RMSNorm forward, SwiGLU forward and
   backward with and without it.
2. The GEMMs at LLaMA-3.1-8B's shapes (M = 8,192 tokens): bf16 torch.mm,
   torch._scaled_mm (cuBLASLt) per tensor and per row, and triton_scaled_mm (the
   lesson's Triton FP8 GEMM, fp8_gemm_kernel.py), in TFLOP/s.
3. A stack of four LLaMA-8B MLPs (4,096 -> 14,336 -> 4,096, SiLU gate), forward
   + backward, compiled (torch.compile, default mode) or, as the training step
   runs, our SwiGLU kernel between the projections and the whole step in one CUDA
   graph (per tensor with and without the produced amaxes): bf16, ours per recipe
   (fp8_kernel.replace_linears), torchao's float8 training per recipe
   (convert_to_float8_training, when torchao is installed). With each, the relative
   error of the output and of the gradients against a float32 run of the same
   weights: what FP8 costs in accuracy, beside what it buys in time.

Usage (a GPU with FP8 tensor cores: Ada, Hopper, Blackwell):
    python benchmark_fp8.py --json results/fp8/bench_fp8.json
    python benchmark_fp8.py --quick
On a CPU it refuses in one line (fp8_test.py checks the kernels there).
"""

import argparse
import time

import torch
import torch.nn as nn

from kernel_ft import flags  # first: it switches on the Triton interpreter when there is no GPU
from kernel_ft import cuda_graphs, files, reporting
from kernel_ft.benchmark_specs import bench, copy_bandwidth, free_memory, repair_capture_state
from kernel_ft.benchmark_peers import version
from fp8_gemm_kernel import triton_scaled_mm
import fp8_kernel
import kernel_common
from fp8_kernel import RECIPES, cast_traffic, fp8_supported, quantize, quantize_reference, replace_linears, scaled_mm
from rmsnorm_kernel import _forward as rmsnorm_launch
import swiglu_kernel
from swiglu_kernel import TritonLlamaMLP, _forward as swiglu_launch, swiglu_backward_and_hidden

M = 8192  # tokens per step: 4 x 2,048
GEMMS = {  # LLaMA-3.1-8B's linear layers as (N, K): y[M, N] = x[M, K] W^T
    "q_proj / o_proj": (4096, 4096), "k_proj / v_proj": (1024, 4096),
    "gate_proj / up_proj": (14336, 4096), "down_proj": (4096, 14336),
}
CAST_SHAPES = [(M, 4096), (M, 14336)]
HIDDEN, INTERMEDIATE, LAYERS = 4096, 14336, 4


def timed(fn, bench_ms):
    fn()  # compile / autotune / first-call work outside the timing
    torch.cuda.synchronize()
    return bench(fn, bench_ms)


# --------------------------------------------------------------------------------
# 1. Casts
# --------------------------------------------------------------------------------
def cast_rows(bench_ms, copy_bw):
    """Each cast twice: called from Python (eager: host time counts where it exceeds the
    GPU's) and replayed in a CUDA graph (GPU time only, as inside the training step's
    graph). %copy: the graph time's bandwidth over the device's copy bandwidth."""
    reference = torch.compile(quantize_reference)
    rows = []
    for m, k in CAST_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for recipe in RECIPES:
            for transpose in (False, True):
                providers = [("ours (Triton)", quantize), ("PyTorch eager", quantize_reference),
                             ("PyTorch compiled", reference)]
                if recipe == "tensorwise":  # x's producer measured its amax (Step 22's producers)
                    amax = x.abs().amax().float().expand(kernel_common.AMAX_SLOTS).contiguous()
                    providers.insert(1, ("ours, amax produced", lambda x, r, t: quantize(x, r, t, amax=amax)))
                for provider, fn in providers:
                    produced = provider == "ours, amax produced"
                    nbytes = m * k * cast_traffic(x, recipe, transpose, produced)
                    ms = timed(lambda: fn(x, recipe, transpose), bench_ms)
                    try:
                        graph_ms = bench(lambda: fn(x, recipe, transpose), bench_ms, graph=True)
                    except RuntimeError as e:  # a provider that cannot be captured: its row says so
                        print(f"{provider} {recipe}: no CUDA graph ({str(e).splitlines()[0][:100]})")
                        graph_ms = None
                        # The failed capture left the CUDA generator capturing: the next shape's
                        # torch.randn would raise (benchmark_kernels.py: repair_capture_state).
                        if (problem := repair_capture_state()) is not None:
                            raise SystemExit(f"error: after {provider}'s failed CUDA graph capture: {problem}")
                    gbps = nbytes / ((graph_ms or ms) * 1e-3) / 1e9
                    rows.append(dict(shape=[m, k], recipe=recipe, transpose=transpose, provider=provider, ms=ms,
                                     graph_ms=graph_ms, bytes_per_element=nbytes / (m * k), GBps=gbps,
                                     copy_fraction=gbps / copy_bw))
        x = None
        free_memory()
    return rows


def print_casts(rows):
    print(f"\n{'x [M, K]':<14} {'recipe':<11} {'copies':<12} {'provider':<20} {'eager us':>9} {'graph us':>9} "
          f"{'B/elem':>6} {'GB/s':>7} {'%copy':>6}")
    for r in rows:
        copies = "x and x^T" if r["transpose"] else "x"
        graph = "-" if r["graph_ms"] is None else f"{r['graph_ms'] * 1e3:.1f}"
        print(f"{r['shape'][0]:,} x {r['shape'][1]:<6,} {r['recipe']:<11} {copies:<12} {r['provider']:<20} "
              f"{r['ms'] * 1e3:9.1f} {graph:>9} {r['bytes_per_element']:6.0f} {r['GBps']:7,.0f} "
              f"{r['copy_fraction']:6.0%}")
    print("B/elem: bytes per element, as ours moves them: 2 read (amax) + 2 read (cast) + 1 written per fp8 copy; "
          "per row without x^T 2 read + 1 written (one pass); with the amax produced, one read. eager: called from "
          "Python; "
          "graph: replayed in a CUDA graph (GPU time); GB/s and %copy (of the device's copy bandwidth) from the "
          "graph time (eager where there is none).")


# --------------------------------------------------------------------------------
# 1b. What the amax costs the kernels that produce x
# --------------------------------------------------------------------------------
def producer_rows(bench_ms):
    """RMSNorm forward, SwiGLU forward and backward at LLaMA-8B's widths, replayed in a CUDA
    graph, without and with the amax they fold in for a per-tensor FP8 cast (one atomic per
    program into kernel_common.AMAX_SLOTS slots, plus the zeroed slots): the price of the read
    each cast saves."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, w = torch.randn(M, HIDDEN, **bf16), torch.rand(HIDDEN, **bf16) + 0.5
    gate, up, dy = (torch.randn(M, INTERMEDIATE, **bf16) for _ in range(3))

    def slots(n):
        return torch.zeros(n, kernel_common.AMAX_SLOTS, dtype=torch.float32, device="cuda")

    kernels = {
        f"RMSNorm forward {M:,} x {HIDDEN:,}": (
            lambda: rmsnorm_launch(x, w, 1e-5, 0.0, True, None),
            lambda: rmsnorm_launch(x, w, 1e-5, 0.0, True, slots(1)[0])),
        f"SwiGLU forward {M:,} x {INTERMEDIATE:,}": (
            lambda: swiglu_launch(gate, up, "silu", None),
            lambda: swiglu_launch(gate, up, "silu", slots(1)[0])),
        f"SwiGLU backward {M:,} x {INTERMEDIATE:,}": (
            lambda: swiglu_backward_and_hidden(dy, gate, up, True, True, store_h=False),
            lambda: swiglu_backward_and_hidden(dy, gate, up, True, True, store_h=False, amax=slots(2))),
    }
    rows = []
    for name, (plain, producing) in kernels.items():
        plain(), producing()
        rows.append(dict(kernel=name, plain_us=bench(plain, bench_ms, graph=True) * 1e3,
                         producing_us=bench(producing, bench_ms, graph=True) * 1e3))
    x = w = gate = up = dy = None
    free_memory()
    return rows


def print_producers(rows):
    print(f"\n{'producer (graph replay)':<36} {'plain us':>9} {'+ amax us':>10} {'cost':>6}")
    for r in rows:
        print(f"{r['kernel']:<36} {r['plain_us']:9.1f} {r['producing_us']:10.1f} "
              f"{r['producing_us'] / r['plain_us'] - 1:6.1%}")
    print("+ amax: the same kernel folding max |output| into zeroed slots (the zeroing included), which saves "
          "the per-tensor cast of that output a read (table 1, 'amax produced').")


# --------------------------------------------------------------------------------
# 2. GEMMs
# --------------------------------------------------------------------------------
def gemm_rows(bench_ms):
    rows = []
    for name, (n, k) in GEMMS.items():
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        flop = 2 * M * n * k
        ms = timed(lambda: x @ w.t(), bench_ms)
        rows.append(dict(layer=name, N=n, K=k, provider="bf16 torch.mm", ms=ms, TFLOPs=flop / ms / 1e9))
        for recipe in RECIPES:
            xq, wq = quantize(x, recipe), quantize(w, recipe)
            for provider, mm in (("FP8 torch._scaled_mm", scaled_mm), ("FP8 Triton (ours)", triton_scaled_mm)):
                ms = timed(lambda: mm(xq.data, xq.inv_scale, wq.data, wq.inv_scale, torch.bfloat16), bench_ms)
                rows.append(dict(layer=name, N=n, K=k, provider=f"{provider} {recipe}", ms=ms,
                                 TFLOPs=flop / ms / 1e9))
        x = w = None
        free_memory()
    return rows


def print_gemms(rows):
    print(f"\n{'layer (M = 8,192)':<22} {'N x K':<14} {'provider':<32} {'us':>8} {'TFLOP/s':>8} {'x bf16':>7}")
    base = {}
    for r in rows:
        base.setdefault(r["layer"], r["ms"])
        print(f"{r['layer']:<22} {r['N']:,} x {r['K']:<6,} {r['provider']:<32} {r['ms'] * 1e3:8.1f} "
              f"{r['TFLOPs']:8.0f} {base[r['layer']] / r['ms']:6.2f}x")
    print("Casts not included (table 1); the products only, output bf16.")


# --------------------------------------------------------------------------------
# 3. The MLP stack, forward + backward, compiled
# --------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def mlp_stack(state, variant):
    """Four MLPs with the weights ``state``, in bf16, converted as ``variant`` says: "bf16",
    "ours <recipe>" or "torchao <recipe>", and with ", graph" our SwiGLU kernel between the
    projections (TritonLlamaMLP), as in the training step."""
    model = nn.Sequential(*[MLP() for _ in range(LAYERS)]).to("cuda", torch.bfloat16)
    model.load_state_dict(state)
    kind, _, recipe = variant.split(",")[0].partition(" ")
    if kind == "ours":
        replace_linears(model, recipe)
    elif kind == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    if ", graph" in variant:
        model = nn.Sequential(*[TritonLlamaMLP.from_mlp(mlp) for mlp in model])
    return model


def graphed_step(model, xg, dy):
    """Forward + backward of ``model`` captured in one CUDA graph (warmed up on a side stream
    first, as PyTorch's whole-network capture recipe says); returns (graph, output)."""
    with cuda_graphs.side_stream(xg.device):
        for _ in range(3):
            model(xg).backward(dy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(xg)
        out.backward(dy)
    return graph, out


def relative_error(got, truth):
    return ((got.float() - truth).norm() / truth.norm()).item()


def mlp_rows(bench_ms):
    torch.manual_seed(0)
    reference = nn.Sequential(*[MLP() for _ in range(LAYERS)]).to("cuda", torch.float32)
    state = {k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()}
    reference.load_state_dict({k: v.float() for k, v in state.items()})  # the bf16 weights, in float32
    x = torch.randn(M, HIDDEN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, HIDDEN, device="cuda", dtype=torch.bfloat16)
    x32 = x.float().requires_grad_()
    out32 = reference(x32)
    out32.backward(dy.float())
    truth = {"out": out32.detach(), "dx": x32.grad, **{n: p.grad for n, p in reference.named_parameters()}}
    reference = out32 = x32 = None
    variants = ["bf16"] + [f"ours {r}" for r in RECIPES]
    if flags.installed("torchao"):
        variants += [f"torchao {r}" for r in RECIPES]
    # Our training step's way: eager kernels replayed in a CUDA graph; per tensor with and
    # without the amax handed over by SwiGLU forward and backward (kernel_common.FP8_PRODUCERS).
    # And with gate_proj and up_proj as two products each way, not one (fp8_kernel.STACK_PROJECTIONS);
    # per tensor with down_proj's h8^T kept from forward (swiglu_kernel.FP8_DOWN_IN_BACKWARD off).
    variants += (["bf16, graph"] + [f"ours {r}, graph" for r in RECIPES] + ["ours tensorwise, graph, no producers"]
                 + [f"ours {r}, graph, unstacked" for r in RECIPES] + ["ours tensorwise, graph, h8^T kept"])
    rows, flop = [], 3 * 2 * M * 3 * HIDDEN * INTERMEDIATE * LAYERS
    for variant in variants:
        model = mlp_stack(state, variant)
        xg = x.detach().requires_grad_()
        kernel_common.FP8_PRODUCERS = "no producers" not in variant
        fp8_kernel.STACK_PROJECTIONS = "unstacked" not in variant
        swiglu_kernel.FP8_DOWN_IN_BACKWARD = "h8^T kept" not in variant
        if ", graph" in variant:
            graph, out = graphed_step(model, xg, dy)
            ms = timed(graph.replay, bench_ms)
            for t in [xg, *model.parameters()]:
                t.grad.zero_()
            graph.replay()  # one forward and backward: the gradients of one step
        else:
            compiled = torch.compile(model)

            def step():
                compiled(xg).backward(dy)

            ms = timed(step, bench_ms)
            model.zero_grad(set_to_none=True)
            xg.grad = None
            out = compiled(xg)
            out.backward(dy)
        kernel_common.FP8_PRODUCERS = fp8_kernel.STACK_PROJECTIONS = swiglu_kernel.FP8_DOWN_IN_BACKWARD = True
        grads = {n: p.grad for n, p in model.named_parameters()}
        errors = {"out": relative_error(out.detach(), truth["out"]), "dx": relative_error(xg.grad, truth["dx"]),
                  "dW (worst layer)": max(relative_error(grads[n], truth[n]) for n in grads)}
        rows.append(dict(variant=variant, ms=ms, TFLOPs=flop / ms / 1e9, errors=errors))
        model = compiled = graph = out = grads = xg = None
        torch._dynamo.reset()
        free_memory()
    return rows


def print_mlp(rows):
    print(f"\n{'4 x LLaMA-8B MLP, 8,192 tokens':<32} {'fwd+bwd ms':>10} {'TFLOP/s':>8} {'x bf16':>7}   "
          f"relative error vs float32: {'out':>7} {'dx':>7} {'dW (worst)':>10}")
    base = rows[0]["ms"]
    for r in rows:
        e = r["errors"]
        print(f"{r['variant']:<32} {r['ms']:10.2f} {r['TFLOPs']:8.0f} {base / r['ms']:6.2f}x   "
              f"{'':>26} {e['out']:7.4f} {e['dx']:7.4f} {e['dW (worst layer)']:10.4f}")
    print("Compiled with torch.compile (default mode), or ', graph': our SwiGLU kernel between the projections and "
          "the whole step replayed in one CUDA graph (gate and up as one stacked product; ', unstacked': two); the "
          "casts are inside the timing. Relative error: "
          "||got - truth|| / ||truth|| against float32 with the same (bf16) weights.")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--json", metavar="PATH", help="write every number and the environment here")
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    args = parser.parse_args(argv)
    if args.json:
        args.json = files.check_output_path(args.json, "--json", suffix=".json")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    ok, why = fp8_supported(device)
    if not ok:
        raise SystemExit(f"error: benchmark_fp8.py times FP8 matmuls: {why}")
    started = time.perf_counter()
    bench_ms = (10, 40) if args.quick else (25, 100)
    env = dict(reporting.environment_info(), torchao=version("torchao"))
    env["copy_bandwidth_GBps"] = copy_bandwidth(bench_ms)
    print(f"FP8 benchmark -- GPU: {env['gpu']} | torch {env['torch']} | triton {env['triton']} | "
          f"torchao {env['torchao'] or 'not installed'} | {env['date']}")
    print(f"Device copy bandwidth: {env['copy_bandwidth_GBps']:,.0f} GB/s; timing: triton.testing.do_bench "
          "median (do_bench_cudagraph for graph replays)")
    results = {"environment": env}
    results["casts"] = cast_rows(bench_ms, env["copy_bandwidth_GBps"])
    print_casts(results["casts"])
    results["producers"] = producer_rows(bench_ms)
    print_producers(results["producers"])
    results["gemms"] = gemm_rows(bench_ms)
    print_gemms(results["gemms"])
    results["mlp_stack"] = mlp_rows(bench_ms)
    print_mlp(results["mlp_stack"])
    results["total_s"] = time.perf_counter() - started
    print(f"\nTotal time: {results['total_s']:.1f} s")
    if args.json:
        files.write_json_atomic(args.json, results)
        print(f"Wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
