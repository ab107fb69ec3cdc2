"""
Step 3 -- Profile a LLaMA training step and find where the time goes.

Runs one warm-up training step (forward, loss, backward, AdamW), times the next
--steps steps without the profiler, then profiles as many with torch.profiler and
prints:

1. the top-20 operations by self device time (self CPU time without a GPU), with
   the rows that are not work filtered out (profiler step markers, our
   forward/backward/optimizer ranges, autograd bookkeeping, CUDA runtime calls,
   memcpy/memset rows already counted in the op that issued them);
2. a summary by category -- RMSNorm, attention, SwiGLU (silu * up), RoPE,
   cross-entropy/softmax, matrix multiply, optimizer, communication (--fsdp),
   memory copies, other elementwise, other --
   with each category's share of the time and its number of calls;
3. when the plain baseline was profiled before, the change per category;
4. on a GPU, where the step waits (profile_timeline.py): GPU busy time over the
   wall time, the host's time to queue the step, kernel launches, the longest
   idle gaps and what the host did then, MFU, and a one-line verdict
   (host-bound, GPU-bound, waiting on allocation, synchronization or communication).

It writes, under ``traces/<name>/`` (``<name>`` from the flags: ``baseline``,
``custom-rmsnorm``, ``custom-rmsnorm-ce``, ``custom-rmsnorm-swiglu-rope-flce-adamw``, ...):

* ``trace.json``          Chrome / Perfetto trace (open in https://ui.perfetto.dev)
* ``tensorboard/``        the same trace for TensorBoard (``tensorboard_trace_handler``)
* ``summary.json``        the category summary and every operator row

A new profile is written into a temporary folder beside ``<name>/`` and swapped
in only when it is complete: a failed or interrupted run leaves the previous
profile as it was.

The forward, backward and optimizer phases are NVTX ranges on a GPU, so an Nsight
Systems capture is readable too::

    nsys profile -t cuda,nvtx -o traces/nsys_baseline python profile_baseline.py

Usage:
    python profile_baseline.py                                    # Step 3: the baseline
    python profile_baseline.py --use-custom-rmsnorm               # Step 7: re-profile
    python profile_baseline.py --use-custom-rmsnorm --use-custom-ce   # Step 10
    python profile_baseline.py --use-custom-rmsnorm --use-custom-swiglu --use-custom-rope \
        --use-custom-flce --use-custom-adamw                       # Step 16: every kernel
    python profile_baseline.py --compile --use-custom-rmsnorm ...   # Step 17: inside torch.compile
    python profile_baseline.py --no-pin-memory                    # Step 18: batches from pageable memory
    python profile_baseline.py --lora --use-custom-rmsnorm ... --cuda-graphs   # Step 20: the step replayed
    python profile_baseline.py --use-custom-rmsnorm ... --use-custom-projections   # Step 20: q/k/v, gate/up
    torchrun --standalone --nproc-per-node 2 profile_baseline.py --fsdp --random-init   # Step 19: rank 0's GPU
    python profile_baseline.py --tiny --seq-len 64                # CPU, Triton interpreter

How the categories are assigned. Every RMSNorm module, HF's loss function and the
MLPs' SiLU run inside a profiler range named "category: RMSNorm" /
"category: cross-entropy/softmax" / "category: SwiGLU (silu * up)" (see
label_model), so all their operators count there: PyTorch's casts and
multiplies too, which by name look like any other. Their backward operators are
found through autograd's sequence numbers (a backward node carries the number of
the forward operator that made it). The optimizer step is a range too. Everything
else is classified by operator or kernel name (aten::mm, flash attention, ...).
"""

import argparse
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict

from kernel_ft import flags  # first: flags switches on the Triton interpreter before triton loads
from kernel_ft import dataloader, files, fsdp, reporting, run, training
from swap_common import vocabulary_size
import profile_timeline

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler


CATEGORIES = [
    # (category, lower-case substrings of operator / kernel / autograd-node names)
    # --compile: the kernels Inductor generated (it names them triton_poi_fused_*
    # for pointwise work, triton_red_/triton_per_ for reductions) and the compiled
    # graphs' own bookkeeping. Our kernels keep their categories: inside a graph
    # they are the operators llama_kernels::<name>.
    ("compiled (Inductor-fused)", ("triton_poi_", "triton_red_", "triton_per_", "triton_tem_", "compiledfunction")),
    ("RMSNorm", ("rmsnorm", "aten::pow", "aten::rsqrt", "aten::mean", "powbackward", "rsqrtbackward", "meanbackward")),
    ("attention", ("attention", "flash", "fmha", "sdpa", "scaled_dot_product", "_attn_")),  # _attn_: ours
    ("SwiGLU (silu * up)", ("swiglu", "aten::silu", "silubackward")),
    ("RoPE", ("_rope_", "ropefunction", "::rope_")),
    ("FP8 casts", ("_amax_kernel", "_amax_flat_kernel", "_cast_kernel")),  # --fp8: fp8_kernel's amax and cast passes
    ("cross-entropy/softmax", ("cross_entropy", "crossentropy", "_ce_", "softmax", "nll_loss", "nllloss")),
    ("matrix multiply", ("aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear", "mmbackward",
                         "gemm", "cutlass", "nvjet", "cublas", "scaled_mm")),
    ("optimizer", ("adam", "optimizer", "_foreach_")),
    # --fsdp: gathering the weights, reducing the gradients (NCCL kernels on a GPU,
    # gloo's c10d ops on a CPU), and FSDP's copies into and out of their buffers.
    ("communication", ("nccl", "c10d::", "all_gather", "reduce_scatter", "allreduce", "all_reduce", "fsdp::")),
    ("memory copies", ("copy", "aten::to", "aten::clone", "aten::contiguous", "aten::cat", "memcpy", "memset",
                       "aten::fill_", "aten::zero_", "aten::empty")),
    ("other elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::neg",
                           "aten::sigmoid", "aten::cos", "aten::sin", "aten::exp", "aten::sqrt", "aten::sum",
                           "aten::where", "elementwise", "reduce_kernel")),
]
CATEGORY_NAMES = [name for name, _ in CATEGORIES] + ["other"]
GENERIC = ("memory copies", "other elementwise", "other")  # categories a context may refine
PHASES = ("forward", "backward", "optimizer")  # the record_function ranges of training.train_step
LABEL = "category: "  # prefix of the ranges label_model puts around modules
NODE = "autograd::engine::evaluate_function: "  # prefix of a backward node's range
BASELINE = "baseline"


# --------------------------------------------------------------------------------
# Flags and names
# --------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Profile LLaMA training steps; summarize by category.")
    flags.add_model_args(parser, custom_kernels_default=False)
    g = parser.add_argument_group("profiling")
    g.add_argument("--steps", type=flags.positive_int, default=1, help="profiled steps, after 1 warm-up (default: 1)")
    g.add_argument("--trace-dir", default="traces", help="where <name>/ is written (default: traces)")
    g.add_argument("--top", type=flags.positive_int, default=20, help="rows of the operator table (default: 20)")
    g.add_argument("--max-grad-norm", type=flags.non_negative_float, default=1.0,
                   help="clip the gradients to this global norm, as the fine-tune scripts do; 0: off "
                        "(default: %(default)s)")
    flags.add_fsdp_arg(g)
    flags.add_cuda_graphs_arg(g, default=False)
    flags.add_fp8_arg(g)
    flags.add_lora_args(parser)
    return parser.parse_args(argv)


def profile_name(args):
    """traces/<name>: 'baseline', or 'custom-' plus the kernels in use; '-compiled' with
    --compile, '-pageable' with --no-pin-memory, '-fsdp' with --fsdp."""
    switches = flags.kernels_from_args(args)
    # The gradients' format: below; whether FSDP gathers FP8 weights in FP8: the settings the folder keeps.
    kernels = [k for k, on in switches.items() if on and k not in ("fp8_grads", "fp8_fast_accum", "fp8_gathered")]
    name = "custom-" + "-".join(kernels) if kernels else BASELINE
    if switches.get("fp8_grads", "e4m3") != "e4m3":
        name += "-" + switches["fp8_grads"]
    if switches.get("fp8_fast_accum"):
        name += "-fastaccum"
    if getattr(args, "lora", False):
        name += "-lora"
    if getattr(args, "compile", False):
        name += "-compiled"
    if not getattr(args, "pin_memory", True):
        name += "-pageable"
    if getattr(args, "fsdp", False):
        name += "-fsdp"
    if getattr(args, "cuda_graphs", False):
        name += "-graphs"
    return name


# --------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------
def category_of_name(name):
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def label_model(model):
    """Wrap every RMSNorm module and HF's loss function in a named profiler range.

    PyTorch's RMSNorm is pow, mean, add, rsqrt, two multiplies and two casts; by
    name, the multiplies and casts look like any other. Inside a range called
    "category: RMSNorm" they are unmistakable, in the trace and in the summary.
    The ranges cost one record_function per call, the same with or without the
    custom kernels.
    """
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _in_range(LABEL + "RMSNorm", module.forward)
        # HF's MLP: silu is a module of its own (its multiply by up is not).
        act = getattr(module, "act_fn", None)
        if type(module).__name__.endswith("MLP") and isinstance(act, torch.nn.Module):
            act.forward = _in_range(LABEL + "SwiGLU (silu * up)", act.forward)
    if hasattr(model, "loss_function"):  # HF's loss: float32 copy of the logits, log-softmax, NLL
        model.loss_function = _in_range(LABEL + "cross-entropy/softmax", model.loss_function)


def _in_range(name, fn):
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return wrapped


def labelled_forward_ops(events):
    """{sequence number: category} of the forward operators inside a category range.

    Autograd tags each backward node with the sequence number of the forward
    operator that created it: that is how backward work finds its category.
    """
    labels = {}
    for evt in events:
        if evt.sequence_nr >= 0:
            parent = evt.cpu_parent
            while parent is not None and not parent.name.startswith(LABEL):
                parent = parent.cpu_parent
            if parent is not None:
                labels[evt.sequence_nr] = parent.name[len(LABEL):]
    return labels


def classify(evt, labels, name=None):
    """Category of an operator event; ``name`` overrides the name used (kernel rows).

    In order: inside a category range; inside the optimizer step; inside one of
    FSDP's ranges (its buffer copies, e.g. aten::_foreach_copy_); in the backward
    of a labelled forward operator; by name, refined by the backward node's name
    (aten::mul inside PowBackward0 is RMSNorm's).
    """
    node = None
    parent = evt.cpu_parent
    while parent is not None:
        if parent.name.startswith(LABEL):
            return parent.name[len(LABEL):]
        if parent.name == "optimizer" or parent.name.startswith("Optimizer."):
            return "optimizer"
        if parent.name.startswith("FSDP::"):  # FSDP2's hooks: copies into and out of its comm buffers
            return "communication"
        if node is None and parent.name.startswith(NODE):
            node = parent
        parent = parent.cpu_parent
    if node is not None and node.sequence_nr in labels:
        return labels[node.sequence_nr]
    category = category_of_name(name or evt.name)
    if category in GENERIC and node is not None:
        refined = category_of_name(node.name[len(NODE):])
        if refined not in GENERIC:
            return refined
    return category


def is_noise(name, user_annotations):
    """Rows that are markers or bookkeeping, not work of their own."""
    return (
        name in user_annotations  # forward / backward / optimizer / Optimizer.step#...
        or name.startswith("ProfilerStep")
        or name.startswith(NODE)
        or name == "[memory]"
        or name.startswith("cuda")  # runtime API: cudaLaunchKernel, cudaDeviceSynchronize, ...
        or name.startswith("cuLaunch")
        or name.startswith("Memcpy")  # device rows already counted in aten::copy_ etc.
        or name.startswith("Memset")
        # Emitted by the CUDA runtime when the host has queued so many launches
        # that it must wait (e.g. fused AdamW's hundreds of launches at a large
        # batch). It lists the kernels it waited behind, which are not its own.
        or name == "Command Buffer Full"
    )


def short_kernel_name(name):
    """'void at::native::foo_kernel<...>(...)' -> 'at::native::foo_kernel'."""
    name = name.removeprefix("void ")
    for sep in ("<", "("):
        name = name.split(sep, 1)[0]
    return name.strip()


# --------------------------------------------------------------------------------
# Rows: (name, category) -> time and calls, every unit of work counted once
# --------------------------------------------------------------------------------
def _add(rows, name, category, us, calls):
    row = rows[(name, category)]
    row[0] += us
    row[1] += calls


def cpu_rows(events):
    """Without a GPU: self CPU time of each operator (the Triton interpreter's time
    lands in the autograd Function that launched the kernel)."""
    annotations = {e.name for e in events if e.is_user_annotation}
    labels = labelled_forward_ops(events)
    rows = defaultdict(lambda: [0.0, 0])
    for evt in events:
        if evt.device_type != DeviceType.CPU or is_noise(evt.name, annotations):
            continue
        _add(rows, evt.name, classify(evt, labels), evt.self_cpu_time_total, 1)
    return rows


def gpu_rows(events):
    """With a GPU: device time of the kernels, named after the aten operator that
    launched them (readable: aten::mm, not a 200-character cuBLAS kernel name), or
    after the kernel itself when no aten operator did (our Triton kernels)."""
    annotations = {e.name for e in events if e.is_user_annotation}
    labels = labelled_forward_ops(events)
    rows = defaultdict(lambda: [0.0, 0])
    attributed = defaultdict(lambda: [0.0, 0])  # kernel name -> time, launches seen through an operator
    counted = set()  # a kernel event is counted once, whatever lists it
    for evt in events:
        if evt.device_type != DeviceType.CPU or not evt.kernels or is_noise(evt.name, annotations):
            continue
        kernels = [k for k in evt.kernels if id(k) not in counted]
        counted.update(id(k) for k in kernels)
        if not kernels:
            continue
        if evt.name.startswith("aten::"):
            _add(rows, evt.name, classify(evt, labels), sum(k.duration for k in kernels), 1)
        else:
            for k in kernels:
                name = short_kernel_name(k.name)
                _add(rows, name, classify(evt, labels, name), k.duration, 1)
        for k in kernels:
            attributed[k.name][0] += k.duration
            attributed[k.name][1] += 1
    # Device work that no CPU operator claimed: count it under its own name, so the
    # rows add up to the whole device time.
    device = defaultdict(lambda: [0.0, 0])
    for evt in events:
        if evt.device_type == DeviceType.CUDA and not evt.is_user_annotation and evt.name not in annotations:
            device[evt.name][0] += evt.time_range.elapsed_us()
            device[evt.name][1] += 1
    for name, (us, n) in device.items():
        rest = us - attributed[name][0]
        if rest > 0.5:
            short = short_kernel_name(name)
            _add(rows, short, category_of_name(short), rest, max(n - attributed[name][1], 0))
    return rows


def host_to_device(events, steps):
    """The batch's trip to the GPU, per step: the host-to-device copies by the kind of
    host memory they read (the CUDA trace names them "Memcpy HtoD (Pageable -> Device)"
    or "(Pinned -> Device)"), and the host time spent inside the CUDA runtime's copy
    calls, next to all the host time spent in CUDA API calls.

    The device rows above count a copy's GPU time; what a pageable copy costs is the
    host's: cudaMemcpyAsync does not return until the driver has staged the data, and
    the CPU queues no kernel meanwhile. Pinned copies return at once.
    """
    copies = {"pageable": [0, 0.0], "pinned": [0, 0.0]}  # kind -> [copies, device us]
    api_us = copy_api_us = 0.0
    for evt in events:
        if evt.device_type == DeviceType.CUDA and evt.name.startswith("Memcpy HtoD"):
            kind = "pinned" if "Pinned" in evt.name else "pageable"
            copies[kind][0] += 1
            copies[kind][1] += evt.time_range.elapsed_us()
        elif evt.device_type == DeviceType.CPU and evt.name.startswith("cuda"):
            api_us += evt.self_cpu_time_total
            if evt.name.startswith("cudaMemcpy"):
                copy_api_us += evt.self_cpu_time_total
    per_step = {kind: {"copies": n / steps, "device_ms": us / 1000 / steps} for kind, (n, us) in copies.items()}
    per_step["copy_api_ms"] = copy_api_us / 1000 / steps
    per_step["cuda_api_ms"] = api_us / 1000 / steps
    return per_step


def summarize(rows, steps):
    """Category totals and the sorted operator list, times in ms per profiled step."""
    total = sum(us for us, _ in rows.values()) or 1.0
    categories = {c: {"ms_per_step": 0.0, "share": 0.0, "calls_per_step": 0.0} for c in CATEGORY_NAMES}
    ops = []
    for (name, category), (us, calls) in rows.items():
        categories[category]["ms_per_step"] += us / 1000 / steps
        categories[category]["share"] += us / total
        categories[category]["calls_per_step"] += calls / steps
        ops.append({"name": name, "category": category, "ms_per_step": us / 1000 / steps,
                    "share": us / total, "calls_per_step": calls / steps})
    ops.sort(key=lambda op: -op["ms_per_step"])
    return total / 1000 / steps, categories, ops


# --------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------
def print_top(ops, top, time_kind):
    print()
    print("=" * 96)
    print(f"Top {top} operations by {time_kind} (per step; noise rows filtered)")
    print("=" * 96)
    print(f"{'Name':<52} {'Category':<22} {time_kind.split()[1] + ' ms':>9} {'%':>6} {'Calls':>6}")
    print("-" * 96)
    for op in ops[:top]:
        name = op["name"] if len(op["name"]) <= 52 else op["name"][:49] + "..."
        print(
            f"{name:<52} {op['category']:<22} {op['ms_per_step']:9.3f} "
            f"{op['share'] * 100:5.1f}% {op['calls_per_step']:6.0f}"
        )


def print_categories(categories, total_ms, time_kind):
    print()
    print("=" * 72)
    print(f"Summary by category ({time_kind}, per step)")
    print("=" * 72)
    print(f"{'Category':<24} {'ms':>10} {'share':>8} {'calls':>8}")
    print("-" * 72)
    for name in CATEGORY_NAMES:
        c = categories[name]
        print(f"{name:<24} {c['ms_per_step']:10.3f} {c['share'] * 100:7.1f}% {c['calls_per_step']:8.0f}")
    print("-" * 72)
    print(f"{'total':<24} {total_ms:10.3f} {100.0:7.1f}%")


def print_host_to_device(h2d):
    print()
    print("Host-to-device copies per step (the batch):")
    for kind in ("pageable", "pinned"):
        c = h2d[kind]
        print(f"  from {kind + ' memory:':<17} {c['copies']:5.0f} copies, {c['device_ms']:8.3f} ms on the GPU")
    share = h2d["copy_api_ms"] / h2d["cuda_api_ms"] if h2d["cuda_api_ms"] else 0.0
    print(f"  host time in cudaMemcpy*: {h2d['copy_api_ms']:.3f} ms ({share:.0%} of the "
          f"{h2d['cuda_api_ms']:.3f} ms spent in CUDA API calls)")


def print_comparison(before, after):
    """Before (plain baseline) / after (this run), per category."""
    print()
    print("=" * 72)
    print(f"Change per category: {before['name']} -> {after['name']} (ms per step)")
    print("=" * 72)
    keys = ("device", "model", "batch_size", "seq_len", "dataset", "packing", "pin_memory")
    differ = [k for k in keys if before["setup"].get(k) != after["setup"].get(k)]
    if differ:
        print(f"Note: the baseline summary was taken with a different {', '.join(differ)}; the comparison may mislead.")
    if after["environment"].get("triton_interpreter"):
        print("Note: CPU run; the Triton interpreter executes kernels in Python, so custom kernels look slow here.")
    print(f"{'Category':<24} {'before':>10} {'after':>10} {'change':>10}")
    print("-" * 72)
    rows = [(n, before["categories"][n]["ms_per_step"], after["categories"][n]["ms_per_step"]) for n in CATEGORY_NAMES]
    rows.append(("total", before["total_ms_per_step"], after["total_ms_per_step"]))
    for name, b, a in rows:
        change = f"{(a - b) / b * 100:+9.1f}%" if b > 0 else ("      new" if a > 0 else "        -")
        print(f"{name:<24} {b:10.3f} {a:10.3f} {change:>10}")


# --------------------------------------------------------------------------------
# Writing a profile: into a temporary folder, swapped in when complete
# --------------------------------------------------------------------------------
def swap_in(new_dir, out_dir):
    """Replace ``out_dir`` with the complete ``new_dir``; the old profile goes last.

    A directory cannot be renamed over a non-empty one, so the old one is first
    renamed aside, then the new one takes its name, then the old one is deleted.
    """
    parent, name = os.path.split(out_dir)
    old_dir = os.path.join(parent, f".{name}.old-{os.getpid()}")  # hidden, like the new one
    if os.path.exists(out_dir):
        os.rename(out_dir, old_dir)
    os.rename(new_dir, out_dir)
    shutil.rmtree(old_dir, ignore_errors=True)


def warmup_steps(args):
    """Unprofiled steps first: one (compilation, AdamW's state), or with --cuda-graphs on a
    GPU the eager steps and the capture; with --fsdp-keep-gathered auto on a GPU at least
    the steps it decides after (the profile then measures the fine-tune script's choice)."""
    steps = flags.GPU_WARMUP_STEPS if getattr(args, "cuda_graphs", False) and torch.cuda.is_available() else 1
    return max(steps, fsdp.KEEP_DECIDED_AFTER) if fsdp.keep_gathered_is_decided(args) else steps


def profile_steps(args, model, step, batches, work_dir, name):
    """Warm-up steps (1; with --cuda-graphs, the eager steps and the capture), then
    ``args.steps`` steps timed without the profiler, then ``args.steps`` profiled
    steps; the traces go into ``work_dir``. ``step``: training.step_function's.
    ``batches``: dataloader.training_batches (each item is one step's micro-batches),
    the fine-tune scripts' data path.

    Returns (the profiler (its events) after the traces are written, timings):
    timings holds a step's wall time and the host's time to queue it, means over
    the unprofiled steps, and the micro-batches of the last step.
    """
    on_gpu = torch.cuda.is_available()
    warmup = warmup_steps(args)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()  # the peak of training, warm-up included (keep-gathered auto reads it)
    if work_dir is None:  # --fsdp, ranks other than 0: train in step with rank 0, nothing recorded
        for i in range(warmup + 2 * args.steps):
            step(next(batches))
            if i + 1 == warmup:
                fsdp.decide_keep_gathered(args, model)
        training.sync()
        return None, None
    tb_dir = os.path.join(work_dir, "tensorboard")
    tb_handler = tensorboard_trace_handler(tb_dir, worker_name=name)

    def save_traces(prof):
        # A profile can be exported once; the TensorBoard file is a Chrome trace
        # too, so the Perfetto copy is that same file.
        tb_handler(prof)
        newest = max((os.path.join(tb_dir, f) for f in os.listdir(tb_dir)), key=os.path.getmtime)
        shutil.copyfile(newest, os.path.join(work_dir, "trace.json"))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with training.exit_on_oom(args, "profiling", model):
        return _timed_and_profiled(args, model, step, batches, warmup, activities, save_traces)


def _timed_and_profiled(args, model, step, batches, warmup, activities, save_traces):
    # Warm-up: the first step pays for cuBLAS/Triton compilation and for the
    # optimizer's state allocation; profiling it would blame the wrong ops.
    for _ in range(warmup):
        step(next(batches))
    training.sync()
    decision = fsdp.decide_keep_gathered(args, model)  # every process, after the same steps
    if decision:
        print(fsdp.keep_gathered_line(decision))
    # No reset of the peak here: with --cuda-graphs the step's activations are allocated
    # once, in the warm-up's capture, and a replay allocates nothing, so a peak measured
    # from now on would leave them out (the peak stays that of training, as the loop's).
    # The step's own times: the profiler adds its cost to every operation the host
    # issues, so the wall and host times of a step are taken without it.
    wall = host = 0.0
    for _ in range(args.steps):
        micro_batches = next(batches)
        begin = time.perf_counter()
        step(micro_batches)
        queued = time.perf_counter()
        training.sync()
        wall += time.perf_counter() - begin
        host += queued - begin
    timings = {"wall_s": wall / args.steps, "host_s": host / args.steps, "micro_batches": micro_batches}
    profiler = profile(activities=activities, record_shapes=True, profile_memory=True, on_trace_ready=save_traces)
    with profiler as prof:
        for _ in range(args.steps):
            step(next(batches))
            training.sync()
            prof.step()
    return prof, timings


PRINT_ONLY = ("trace_dir", "top")  # flags that change where and how much is printed, not the profile


def check_replaceable(out_dir, args):
    """A profile folder is replaced only by a rerun of the same settings: another
    run's profile (or a folder that holds none) is refused now, in one line."""
    if not os.path.exists(out_dir):
        return
    summary = os.path.join(out_dir, "summary.json")
    if not files.written_here(summary):
        raise SystemExit(f"error: --trace-dir {args.trace_dir}: {out_dir} exists and holds no profile of this "
                         f"project; pass another --trace-dir or remove that folder")
    then = {k: v for k, v in read_baseline(summary).get("config", {}).items() if k not in PRINT_ONLY}
    now = {k: v for k, v in json.loads(json.dumps(flags.public_config(args))).items() if k not in PRINT_ONLY}
    if then != now:
        raise SystemExit(f"error: --trace-dir {args.trace_dir}: {out_dir} holds a profile made with other settings "
                         f"({flags.differences(then, now)}); pass another --trace-dir or remove that folder")


def read_baseline(path):
    """The saved baseline summary, or None if there is none (or it is unreadable)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------
def main(argv=None):
    # Checked now, in one line each, not after the model is built and profiled.
    args, _ = run.settle(parse_args(argv))
    # --fsdp: every process trains (the collectives need them all); rank 0 alone
    # profiles its GPU, prints and writes (init_distributed silences the others).
    world = fsdp.init_distributed(args)
    name = profile_name(args)
    out_dir = os.path.join(args.trace_dir, name)
    env = reporting.environment_info()
    reporting.print_banner(f"Profile: {name}", env)
    flags.print_notes(args)
    run.print_parallel_choice(args)
    if not world or world.rank == 0:
        check_replaceable(out_dir, args)  # before the model: a refusal costs a second

    # The run as the fine-tune scripts set it up (run.py), the modules labelled for the trace.
    model, model_info, data = run.load(args, world)
    print(f"Batch:         {args.batch_size} x {args.seq_len} tokens; {warmup_steps(args)} warm-up steps, "
          f"{args.steps} timed without the profiler, {args.steps} profiled")
    _, loss_fn, optimizer, graphs = run.assemble(args, model, data, run.apply_kernels, world, after_kernels=label_model)
    step = training.step_function(args, model, optimizer, loss_fn, None, graphs)
    device = world.device if world else next(model.parameters()).device
    # The fine-tune scripts' data path: DataLoader workers, pinned memory, non-blocking copies.
    batches = dataloader.training_batches(args, data, device, vocabulary_size(model))

    if world and world.rank != 0:
        profile_steps(args, model, step, batches, None, name)  # the same steps, not profiled
        fsdp.reduce_over_ranks([training.peak_memory()[0]], op="max")
        fsdp.close_distributed()
        return None
    summary = profile_and_write(args, name, out_dir, env, model, model_info, step, batches, world)
    print_after(args, name, out_dir, summary)
    fsdp.close_distributed()
    return summary


def profile_and_write(args, name, out_dir, env, model, model_info, step, batches, world):
    """Profile the steps and write the summary. The new profile is written beside the
    old one and swapped in when complete (a fresh folder also matters for TensorBoard,
    which would read an older file in it as part of this profile)."""
    on_gpu = torch.cuda.is_available()
    time_kind = "self device time" if on_gpu else "self CPU time"
    os.makedirs(args.trace_dir, exist_ok=True)
    work_dir = tempfile.mkdtemp(dir=args.trace_dir, prefix=f".{name}.new-")
    try:
        prof, timings = profile_steps(args, model, step, batches, work_dir, name)
        peak_bytes, peak_kind = training.peak_memory()
        if world:  # what each GPU must hold: the largest peak of the processes
            peak_bytes = int(fsdp.reduce_over_ranks([peak_bytes], op="max")[0])
            peak_kind += f", the largest of {world.size} processes"

        events = prof.events()
        rows = gpu_rows(events) if on_gpu else cpu_rows(events)
        total_ms, categories, ops = summarize(rows, args.steps)
        print_top(ops, args.top, time_kind)
        print_categories(categories, total_ms, time_kind)
        h2d = host_to_device(events, args.steps) if on_gpu else None
        if h2d:
            print_host_to_device(h2d)
        print(f"\nPeak memory: {peak_bytes / 2**30:.2f} GiB ({peak_kind})")
        timeline = None
        if on_gpu:
            with open(os.path.join(work_dir, "trace.json")) as f:
                trace = json.load(f)
            dtype = next(model.parameters()).dtype
            timeline = profile_timeline.analyze(
                trace, args.steps, timings["wall_s"], timings["host_s"],
                flops=profile_timeline.step_flops(model, timings["micro_batches"]),
                peak=profile_timeline.matmul_peak_flops(dtype))
            profile_timeline.print_timeline(timeline)

        summary = {
            "name": name,
            "time_kind": time_kind,
            "profiled_steps": args.steps,
            "total_ms_per_step": total_ms,
            "categories": categories,
            "ops": ops,  # every row, largest first
            "host_to_device": h2d,  # None without a GPU
            "timeline": timeline,  # profile_timeline.analyze; None without a GPU
            "peak_memory_bytes": peak_bytes,
            "peak_memory_kind": peak_kind,
            # What must match for a before/after comparison to mean anything.
            "setup": {
                "device": env["gpu"],
                "model": model_info["name"],
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "dataset": dataloader.dataset_name(args.dataset),
                "packing": args.packing,
                "pin_memory": args.pin_memory,
                "world_size": world.size if world else 1,
            },
            "config": flags.public_config(args),
            "environment": env,
            "model": model_info,
            # Where they will be once swapped in.
            "traces": {"chrome": os.path.join(out_dir, "trace.json"), "tensorboard": os.path.join(out_dir, "tensorboard")},
        }
        files.write_json_atomic(os.path.join(work_dir, "summary.json"), summary)
        swap_in(work_dir, out_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)  # gone already when swapped in
    return summary


def print_after(args, name, out_dir, summary):
    """The before/after table against the baseline profile, and where the files are."""
    baseline_path = os.path.join(args.trace_dir, BASELINE, "summary.json")
    baseline = read_baseline(baseline_path) if name != BASELINE else None
    if baseline is not None:
        print_comparison(baseline, summary)
    elif name != BASELINE:
        print(f"\n(No {baseline_path} yet: run without --use-custom-* flags first to get a before/after table.)")

    print(f"\nChrome/Perfetto trace: {summary['traces']['chrome']}  (open in https://ui.perfetto.dev)")
    print(f"TensorBoard trace:     {summary['traces']['tensorboard']}/")
    print(f"Summary:               {os.path.join(out_dir, 'summary.json')}")

if __name__ == "__main__":
    main()
