"""
Steps 7 and 10 -- Benchmark the fused kernels against every peer.

What: a table per kernel (RMSNorm, cross-entropy, SwiGLU, RoPE, linear + cross-entropy; one ``Spec``
each, in benchmark_specs.py's ``KERNELS``), rows per shape (LLaMA-3.1-8B's, bf16) and provider: ours;
PyTorch eager in the HF formulation (each kernel module's ``*_reference``), the native op if any,
``torch.compile``; the peers of benchmark_peers.py (Liger-Kernel, cut-cross-entropy, the playbook's
design).

How: ``fwd`` is the forward under ``torch.no_grad()``; ``fwd+bwd`` adds ``torch.autograd.grad`` of an
upstream gradient made beforehand (1.0 for a loss): what training pays; ``graph`` replays that from a
CUDA graph: GPU time without the host's launch cost. Latency: median of ``triton.testing.do_bench``
(warm-up excluded, L2 flushed). Inputs: random, made untimed, the same for every provider. The notes
under a table give the formula behind GB/s, what peak MB counts, what |err| compares with; OOM / ERR:
that provider failed, the run goes on. No GPU: Triton's interpreter, tiny shapes, |err| only, no time.

Usage: python benchmark_kernels.py [--kernel rmsnorm cross_entropy swiglu rope flce | all] [--quick]
    [--json bench.json] [--plot bench.png]; kernel_ft/benchmark_plot.py redraws a figure from the JSON.
"""

import argparse
import importlib.util
import time

import torch

# The kernels' specs (and through them the kernel modules) first: without a GPU, kernel_common
# (which the kernel modules import first) switches on Triton's interpreter before triton loads.
from kernel_ft.benchmark_specs import (BYTES, KERNELS, NA_CPU, ON_GPU, NotApplicable, bench, copy_bandwidth,
                                      document_lengths, free_memory, repair_capture_state)
from kernel_ft.benchmark_peers import NOT_INSTALLED, unavailable, version
from kernel_ft import flags
from kernel_ft.files import PNG_METADATA, check_output_path, write_json_atomic
from kernel_ft.reporting import environment_info


BENCH_MS = {"full": (25, 100), "quick": (10, 40)}  # do_bench (warm-up, repetitions) in ms
# "graph" replays the fwd+bwd from a CUDA graph: every kernel launched from the GPU's side, with no
# Python, dispatcher or launch overhead. Eager minus graph is what the host costs per call, the part
# a compiled, graph-replayed training step does not pay.
PASSES = ("fwd", "fwdbwd", "graph")
WORK = {"fwd": "fwd", "fwdbwd": "fwdbwd", "graph": "fwdbwd"}  # which entry of bytes/flops a pass moves


def error(out, truth):
    """Loss: |loss - truth|. Tensors: max |out - truth| over all elements (and outputs)."""
    if isinstance(truth, float):
        return abs(out.double().item() - truth)
    outs, truths = (out, truth) if isinstance(out, tuple) else ((out,), (truth,))
    # out - truth promotes to float64 without a separate float64 copy of out.
    return max((o - t).abs_().max().item() for o, t in zip(outs, truths))


# --- Measuring: one provider at one shape, one JSON record ----------------------------
def guarded(stage, messages):
    """("ok", stage()), ("n/a ...", None) for a provider that does not apply, or
    ("OOM" / "ERR", None): a failing peer never stops the run."""
    try:
        return "ok", stage()
    except NotApplicable as exc:
        return str(exc), None
    except Exception as exc:  # noqa: BLE001 - OOM or anything else: a row, not a crash
        oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
        if not oom:
            messages.append(f"{type(exc).__name__}: {exc}".strip())
    free_memory()  # here, once the traceback (and the tensors its frames hold) is gone
    return ("OOM" if oom else "ERR"), None


def make_calls(spec, provider, shape, seed):
    """(fwd, fwdbwd): one provider's forward and training calls on fresh inputs of one shape."""
    torch.manual_seed(seed)  # the same values as the truth's and every other provider's
    inputs, op = spec.make_inputs(shape), spec.providers[provider]()
    args, wrt = inputs["args"], inputs["wrt"]
    # Forward-only calls get tensors that do not require grad: no provider prepares a gradient.
    fwd_args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    upstream = []  # cast to each output's dtype once, on the first fwd+bwd, outside any timing

    def fwd():
        with torch.no_grad():
            return op(*fwd_args)

    def fwdbwd():
        out = op(*args)
        outs = out if isinstance(out, tuple) else (out,)  # RoPE returns q' and k'
        if not upstream:
            upstream.extend(u.to(o.dtype) for u, o in zip(inputs["upstream"], outs))
        # autograd.grad returns the gradients instead of accumulating into .grad:
        # repeated calls neither pile up nor need .grad cleared.
        return torch.autograd.grad(outs, wrt, upstream)

    return fwd, fwdbwd


# A capture that fails (a peer that synchronizes with the host inside its call: Liger-Kernel's
# cross-entropy does) leaves PyTorch's CUDA random-number generator in the middle of a capture:
# every later random op in the process, ordinary work included, raises "Offset increment outside
# graph capture encountered unexpectedly". cuda_graphs.recover_from_failed_capture, the training
# loop's own repair, takes it out of that state (repair_capture_state). So the CUDA-graph timings
# run after every eager timing of a kernel, ours first; a provider whose capture failed is not
# captured again (its other shapes say "skipped"); and if the repair fails, no capture is
# attempted for the rest of the run.
CAPTURE = {"failed": {}, "broken": None}  # failed: provider -> where; broken: why captures stopped


def measure_graph(spec, provider, shape, seed, rec, bench_ms):
    """Fill rec's graph cells: fwd+bwd captured in a CUDA graph and replayed."""
    if not ON_GPU or rec["fwdbwd_status"] != "ok":
        rec["graph_status"] = NA_CPU if not ON_GPU else rec["fwdbwd_status"]
        return
    if CAPTURE["broken"] or provider in CAPTURE["failed"]:
        rec["graph_status"] = "skipped"
        return

    def stage():
        _, fwdbwd = make_calls(spec, provider, shape, seed)
        fwdbwd()  # first call outside the capture: compilation, autotuning, lazy allocations
        torch.cuda.synchronize()
        return bench(fwdbwd, bench_ms, graph=True)

    rec["graph_status"], rec["graph_ms"] = guarded(stage, rec["messages"])
    if rec["graph_status"] == "ERR":
        CAPTURE["failed"][provider] = f"{rec['label']} tokens"
        problem = repair_capture_state()
        if problem:
            CAPTURE["broken"] = f"after {provider}'s failed capture, CUDA stayed unusable ({problem})"
            rec["messages"].append(CAPTURE["broken"])


def shape_label(shape):
    """A table row's shape: the token count, and for attention how many documents share it."""
    if "docs" not in shape:
        return f"{shape['tokens']:,}"
    count = len(document_lengths(shape))
    return f"{shape['tokens']:,} in {count} doc{'s' if count > 1 else ''}"


def measure(spec, provider, shape, seed, truth, bench_ms):
    """Every number of one provider at one shape, as one JSON record. Never raises."""
    statuses = ("fwd_status", "fwdbwd_status", "graph_status", "memory_status")  # "ok", OOM, ERR, n/a (CPU), ...
    rec = {"provider": provider, "shape": dict(shape), "label": shape_label(shape),
           "bytes": spec.bytes and spec.bytes(shape), "flops": spec.flops and spec.flops(shape),
           **dict.fromkeys(statuses), "fwd_ms": None, "fwdbwd_ms": None, "graph_ms": None, "peak_extra_MB": None,
           "error": None, "first_fwd_s": None, "first_fwdbwd_s": None, "messages": []}
    for p in PASSES:  # filled in by derive()
        rec.update({f"{p}_GBps": None, f"{p}_pct_copy": None, f"{p}_TFLOPs": None, f"speedup_{p}": None})

    def give_up(status):  # every cell not yet filled says why
        rec.update({k: rec[k] or status for k in statuses})
        return rec

    if unavailable(provider):
        return give_up(unavailable(provider))

    status, built = guarded(lambda: make_calls(spec, provider, shape, seed), rec["messages"])
    if status != "ok":
        return give_up(status)
    fwd, fwdbwd = built

    def first_call(fn, key):
        """torch.compile compiles (and Triton JITs) here: timed once, kept out of do_bench."""
        t0 = time.perf_counter()
        out = fn()
        if ON_GPU:
            torch.cuda.synchronize()  # the GPU work is part of the first call
        rec[key] = time.perf_counter() - t0
        return out

    def fwd_stage():
        out = first_call(fwd, "first_fwd_s")
        rec["error"] = None if truth is None else error(out, truth)
        del out
        return bench(fwd, bench_ms)

    def memory_stage():
        if not ON_GPU:
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()  # the inputs, the upstream gradient, the truth
        grads = fwdbwd()
        torch.cuda.synchronize()
        del grads
        return (torch.cuda.max_memory_allocated() - before - spec.not_counted(shape)) / 1e6

    rec["fwd_status"], rec["fwd_ms"] = guarded(fwd_stage, rec["messages"])
    status, grads = guarded(lambda: first_call(fwdbwd, "first_fwdbwd_s"), rec["messages"])
    del grads  # freed before the memory stage
    if status != "ok":
        give_up(status)
    else:
        rec["memory_status"], rec["peak_extra_MB"] = guarded(memory_stage, rec["messages"])
        rec["fwdbwd_status"], rec["fwdbwd_ms"] = guarded(lambda: bench(fwdbwd, bench_ms), rec["messages"])
    if not ON_GPU:  # nothing was timed: every cell that ran says so, and no CPU time is kept
        rec.update({k: NA_CPU if rec[k] == "ok" else rec[k] for k in statuses}, first_fwd_s=None,
                   first_fwdbwd_s=None)
    return rec  # its tensors die with this frame; the caller frees the memory


def derive(records, copy_bw, ours):
    """Bandwidth, %copy, TFLOP/s and speedups over ours, from the latencies."""
    base = next((r for r in records if r["provider"] == ours), None)
    for rec in records:
        for p in PASSES:
            ms = rec.get(f"{p}_ms")
            if ms is None:
                continue
            if rec["bytes"]:
                rec[f"{p}_GBps"] = rec["bytes"][WORK[p]] / (ms * 1e-3) / 1e9
                if copy_bw:
                    rec[f"{p}_pct_copy"] = 100.0 * rec[f"{p}_GBps"] / copy_bw
            if rec["flops"]:
                rec[f"{p}_TFLOPs"] = rec["flops"][WORK[p]] / (ms * 1e-3) / 1e12
            if base is not None and base.get(f"{p}_ms") and rec is not base:
                rec[f"speedup_{p}"] = ms / base[f"{p}_ms"]


def run_kernel(spec, shapes, seed, bench_ms, copy_bw):
    """All providers at all shapes of one kernel: that kernel's block of the JSON."""
    providers = list(spec.providers)
    blocks = []  # one per shape: a record per provider, ours first
    for i, shape in enumerate(shapes):
        # The float64 truth, once per shape, on the values every provider gets (made
        # before any runs: Liger's RoPE and our in-place CE overwrite their inputs).
        def truth_of(shape=shape, seed=seed + i):
            torch.manual_seed(seed)
            return spec.truth(*[a.detach() for a in spec.make_inputs(shape)["args"]])

        failed = []
        status, truth = guarded(truth_of, failed)
        block = []
        for provider in providers:
            block.append(measure(spec, provider, shape, seed + i, truth, bench_ms))
            free_memory()  # the next provider starts clean
        if status != "ok":  # no truth, so no error column: say why, once
            block[0]["messages"].append(f"float64 truth: {status} {' '.join(failed)}".strip())
        del truth
        blocks.append(block)
    # CUDA graphs last (see CAPTURE), ours first: provider by provider, shape by shape.
    for k, provider in enumerate(providers):
        for i, shape in enumerate(shapes):
            measure_graph(spec, provider, shape, seed + i, blocks[i][k], bench_ms)
            free_memory()
    for block in blocks:
        derive(block, copy_bw, providers[0])
    return {"title": spec.title, "header": f"{spec.title} benchmark -- {spec.describe(shapes[0])}",
            "providers": providers, "ours": providers[0], "shapes": shapes,
            "error_label": spec.error_label, "rate_unit": "TFLOP/s" if spec.flops else "GB/s",
            "footnotes": footnotes(spec, shapes), "results": [rec for block in blocks for rec in block]}


def amount(x):
    return f"{x:,.1f}" if x >= 0.1 else f"{x:.2g}"  # 1,073.8 but also 0.0041 (CPU shapes)


def footnotes(spec, shapes):
    """The lines under a table: the formula, its value at each shape, then the notes."""
    lines = list(spec.formula)
    for s in shapes:
        if spec.bytes:
            b = spec.bytes(s)
            lines.append(f"  N = {s['tokens']:>6,}: fwd {amount(b['fwd'] / 1e6)} MB, "
                         f"fwd+bwd {amount(b['fwdbwd'] / 1e6)} MB")
        if spec.flops:
            f = spec.flops(s)
            logits = f"; the bf16 logits would be {amount(s['tokens'] * s['vocab'] * BYTES / 1e6)} MB" \
                if "vocab" in s else ""
            lines.append(f"  {shape_label(s)}: fwd {amount(f['fwd'] / 1e9)} GFLOP, fwd+bwd "
                         f"{amount(f['fwdbwd'] / 1e9)} GFLOP{logits}")
    return lines + [
        "Peak extra memory (fwd+bwd): max_memory_allocated() in one forward + backward minus what was",
        "  allocated just before it.",
    ] + spec.notes + [
        "%copy: effective bandwidth / device copy bandwidth measured at the start of this run.",
        "ours x: the peer's latency / ours (above 1.00x: ours is faster).",
    ]


# --- Output: one banner, one table per kernel ------------------------------------------
RULE = "=" * 100


def cell(value, fmt, suffix=""):
    return "-" if value is None else format(value, fmt) + suffix


def print_table(result, env):
    """The table of one kernel: one block of provider rows per shape, notes below."""
    rate = "TFLOPs" if result["rate_unit"] == "TFLOP/s" else "GBps"
    headers = ["tokens", "provider", "fwd us", result["rate_unit"], "%copy", "ours x",
               "fwd+bwd us", result["rate_unit"], "%copy", "ours x",
               "graph us", result["rate_unit"], "%copy", "ours x", "peak MB", result["error_label"]]
    rows, previous = [], None
    for rec in result["results"]:
        if previous is not None and rec["label"] != previous:
            rows.append(None)  # a blank line between shapes
        row = [rec["label"] if rec["label"] != previous else "", rec["provider"]]
        previous = rec["label"]
        for p in PASSES:  # a pass that has no latency shows its status once: OOM, ERR, n/a (CPU), ...
            ok = rec[f"{p}_status"] == "ok"
            row += [cell(rec[f"{p}_ms"] * 1e3, ",.1f") if ok else rec[f"{p}_status"],
                    cell(rec[f"{p}_{rate}"], ",.0f"), cell(rec[f"{p}_pct_copy"], ".0f", "%"),
                    cell(rec[f"speedup_{p}"], ".2f", "x")]
        row.append(cell(rec["peak_extra_MB"], ",.1f") if rec["memory_status"] == "ok" else rec["memory_status"])
        row.append(cell(rec["error"], ".1e"))
        rows.append(row)
    widths = [max([len(h)] + [len(r[k]) for r in rows if r]) for k, h in enumerate(headers)]

    def line(cells):  # text columns left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if k < 2 else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths))).rstrip()

    where = env["gpu"] if ON_GPU else "CPU (Triton interpreter, no timings)"
    copy = f"{env['copy_bandwidth_GBps']:,.0f} GB/s" if env["copy_bandwidth_GBps"] else "n/a"
    print(f"\n{RULE}\n{result['header']}\n{RULE}")
    print(f"GPU: {where} | torch {env['torch']} | triton {env['triton']} | copy bandwidth {copy}\n")
    print(line(headers) + "\n" + line(["-" * w for w in widths]))
    for row in rows:
        print(line(row) if row else "")
    print("\n" + "\n".join(result["footnotes"]))
    compile_times = [f"{r['label']} tokens: {r['first_fwd_s'] + (r['first_fwdbwd_s'] or 0):.1f} s"
                     for r in result["results"] if r["provider"].startswith("torch.compile") and r["first_fwd_s"]]
    if compile_times:
        print("torch.compile first calls (fwd graph + training graph compile, per shape): " + ", ".join(compile_times))
    if any(r["graph_status"] == "skipped" for r in result["results"]):
        failed = ", ".join(f"{p} at {where}" for p, where in CAPTURE["failed"].items())
        why = CAPTURE["broken"] or "a provider whose capture failed is not captured again"
        print(f"graph skipped: a CUDA-graph capture failed ({failed}); {why}")
    seen = {}  # every distinct error message once, with the shapes where it happened
    for r in result["results"]:
        for m in r["messages"]:
            seen.setdefault((r["provider"], m), []).append(r["label"])
    for (provider, m), labels in seen.items():
        m = m if len(m) <= 400 else m[:400] + " ..."
        print(f"ERR {provider} ({', '.join(dict.fromkeys(labels))} tokens): {m}")


def banner(env, bench_ms):
    versions = (f"Python {env['python']} | torch {env['torch']} | triton {env['triton']} | transformers "
                f"{env['transformers']} | CUDA {env['cuda']} | Liger-Kernel {env['liger_kernel'] or NOT_INSTALLED} | "
                f"cut-cross-entropy {env['cut_cross_entropy'] or NOT_INSTALLED}")
    print(f"{RULE}\nKernel benchmark -- ours (Triton) vs PyTorch eager, PyTorch native, torch.compile, "
          f"Liger-Kernel, cut-cross-entropy\n{RULE}")
    if ON_GPU:
        print(f"GPU: {env['gpu']}\nVersions: {versions}\nDate: {env['date']}")
        print(f"Device copy bandwidth: {env['copy_bandwidth_GBps']:,.0f} GB/s "
              "(1 GiB device-to-device copy, bytes read + written)")
        print(f"Timing: triton.testing.do_bench median, warm-up {bench_ms[0]} ms excluded, "
              f"rep {bench_ms[1]} ms, L2 flushed")
        return
    print("GPU: none -- CPU run, kernels execute in the Triton interpreter (TRITON_INTERPRET=1)")
    print(f"Versions: {versions}\nDate: {env['date']}\nDevice copy bandwidth: n/a (CPU)")
    print("Timing: NONE. This CPU run checks that every provider runs and reports numerical error;\n"
          "        it measures no time and makes no performance claim. torch.compile runs with\n"
          "        backend aot_eager; Liger-Kernel and cut-cross-entropy need CUDA and are skipped.")


# --- Main -------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", nargs="+", choices=[*KERNELS, "all"], default=["all"],
                        help="which kernels to benchmark (one or more, or all)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing loops (CPU: tiny shapes)")
    parser.add_argument("--json", metavar="PATH", help="write every number and the environment here")
    parser.add_argument("--plot", metavar="PATH.png", help="after measuring, draw kernel_ft/benchmark_plot.py's figure")
    parser.add_argument("--seed", type=flags.seed, default=0, help="0 .. 2**63 - 1")
    args = parser.parse_args(argv)
    CAPTURE.update(failed={}, broken=None)  # a fresh run tries every provider's capture again
    # Output paths are checked before anything is measured: a long run that cannot
    # write its results has lost them.
    if args.json:
        args.json = check_output_path(args.json, "--json", suffix=".json")
    if args.plot:
        args.plot = check_output_path(args.plot, "--plot", suffix=".png")
        if importlib.util.find_spec("matplotlib") is None:
            raise SystemExit("error: --plot needs matplotlib (pip install matplotlib)")
    started = time.perf_counter()
    bench_ms = BENCH_MS["quick" if args.quick else "full"]
    names = list(KERNELS) if "all" in args.kernel else list(dict.fromkeys(args.kernel))

    env = dict(environment_info(), liger_kernel=version("liger-kernel"), cut_cross_entropy=version("cut-cross-entropy"))
    env["copy_bandwidth_GBps"] = copy_bandwidth(bench_ms) if ON_GPU else None
    free_memory()
    banner(env, bench_ms)
    settings = {"quick": args.quick, "dtype": "bfloat16", "seed": args.seed,
                "timing": "triton.testing.do_bench median" if ON_GPU else "none (CPU, Triton interpreter)",
                "warmup_ms": bench_ms[0] if ON_GPU else None, "rep_ms": bench_ms[1] if ON_GPU else None,
                "fwd": "forward only, torch.no_grad(), inputs not requiring grad",
                "fwdbwd": "forward with autograd + torch.autograd.grad (upstream gradient: random for "
                          "tensor outputs, 1.0 for the scalar loss)",
                "graph": "fwdbwd captured in a CUDA graph and replayed: triton.testing.do_bench_cudagraph median"}
    results = {"environment": env, "settings": settings, "kernels": {}}
    for name in names:
        spec = KERNELS[name]
        shapes = spec.shapes["quick" if args.quick else "full"] if ON_GPU else spec.shapes["cpu"]
        results["kernels"][name] = run_kernel(spec, shapes, args.seed, bench_ms, env["copy_bandwidth_GBps"])
        print_table(results["kernels"][name], env)

    results["total_s"] = time.perf_counter() - started
    print(f"\nTotal time: {results['total_s']:.1f} s")
    if args.json:
        write_json_atomic(args.json, results)  # strict JSON (no NaN), never half a file
        print(f"Wrote {args.json}")
    if args.plot:
        # Imported here: matplotlib is needed only when a figure is asked for.
        from kernel_ft.benchmark_plot import plot_results

        plot_results(results, args.plot, metadata=PNG_METADATA)  # the mark: a later run may replace it
        print(f"Wrote {args.plot}")
    return results


if __name__ == "__main__":
    main()
