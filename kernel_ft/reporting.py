"""
What a run reports: the banner with its environment (device and versions, quoted
with every figure), a line per step or a progress bar, an estimate of the time
left after the first step, the result block at the end, the --json file and the
loss curve (--output-dir).

A file of its own because none of it changes what is trained: training.py decides
what happened at each step and calls these to say it, so the loop reads in one
sitting and the look of the output is changed here alone.

Nothing runs on import.
"""

import datetime
import os
import platform
import sys
import tempfile

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)

import torch
import transformers
import triton

from kernel_ft import files, flags


# --------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------
def environment_info():
    """Return the device and library versions as a dict (quoted with every figure)."""
    on_gpu = torch.cuda.is_available()
    return {
        "device": "cuda" if on_gpu else "cpu",
        "gpu": torch.cuda.get_device_name(0) if on_gpu else "CPU",
        "triton_interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
    }


def print_banner(title, env):
    print("=" * 72)
    print(title)
    print("=" * 72)
    device = env["gpu"] if env["device"] == "cuda" else "CPU"
    if env["triton_interpreter"]:
        device += " (Triton kernels run in the interpreter: correct but slow)"
    print(f"Device:        {device}")
    print(
        f"Versions:      python {env['python']}, torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}, CUDA {env['cuda'] or '-'}"
    )
    print(f"Date:          {env['date']}")


# --------------------------------------------------------------------------------
# While the run goes: the first step's estimate, a line per step or a progress bar
# --------------------------------------------------------------------------------
LONG_RUN_S = 120  # a run that will take longer than this says so after its first step


def print_estimate(first_step_s, steps_left):
    """After the first step: how long the rest will take, when that is long.

    The first step is the slowest (Triton compilation on a GPU, AdamW's state
    allocation everywhere), so the figure is an upper bound.
    """
    left_s = first_step_s * steps_left
    if left_s > LONG_RUN_S:
        print(
            f"Estimate:      up to {duration(left_s)} for the remaining {steps_left} steps at the first "
            f"step's pace; fewer --steps or a shorter --seq-len finish sooner (Ctrl-C keeps the steps done)",
            flush=True,
        )


def duration(seconds):
    """'45 s', '7 min', '2.5 h': a human reading of a rough estimate."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def report_step(args, bar, record, total):
    """A step's loss and speed: on the progress bar, or as a line every --log-every steps."""
    step, seconds, tokens = record["step"], record["time_s"], record["tokens"]
    speed = "warm-up" if record["warmup"] else f"{tokens / seconds:,.0f} tok/s"
    if bar:
        bar.set_postfix_str(f"loss {record['loss']:.4f}, {speed}", refresh=False)
        bar.update(1)
        return
    if step % (args.log_every or 1) == 0 or step == total or record["warmup"]:
        tag = "  (warm-up, not timed)" if record["warmup"] else f"  {tokens / seconds:>10,.0f} tokens/s"
        print(f"step {step:>4}/{total}  loss {record['loss']:.4f}  {seconds:8.3f} s{tag}", flush=True)


def progress_bar(args, total, start):
    """A tqdm bar (loss, tokens/s, ETA) on a terminal when --log-every is not given;
    otherwise None, and each step prints a line (logs, pipes, tests)."""
    if args.log_every is not None or not sys.stdout.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stdout)


# --------------------------------------------------------------------------------
# At the end: the result block and the --json file
# --------------------------------------------------------------------------------
def print_results(title, results):
    """The playbook's result block: time per step, throughput, peak memory."""
    print("=" * 72)
    print(title)
    print("=" * 72)
    print(f"Timed steps:                {results['timed_steps']} (after {results['warmup_steps']} warm-up)")
    print(f"Average time per step:      {results['time_per_step_s']:.3f} s")
    print(f"Average throughput:         {results['tokens_per_sec']:,.0f} tokens/sec")
    if results.get("world_size", 1) > 1:
        label = f"Per GPU ({results['world_size']} processes):"
        print(f"{label:<28}{results['tokens_per_sec_per_gpu']:,.0f} tokens/sec")
    print(f"Real tokens (no padding):   {results['real_tokens_per_sec']:,.0f} tokens/sec "
          f"(padding: {results['padding_fraction'] * 100:.1f}% of the token slots)")
    print(f"Peak memory:                {results['peak_memory_bytes'] / 2**30:.2f} GiB ({results['peak_memory_kind']})")
    print(f"Final loss:                 {results['final_loss']:.4f}")
    if results.get("eval"):
        last = results["eval"][-1]
        print(f"Held-out loss:              {last['loss']:.4f} (step {last['step']})")


def write_json(path, script, args, env, model_info, results):
    """--json: everything needed to compare two runs later, in one file (strict JSON,
    NaN as null, written atomically)."""
    doc = {
        "script": script,
        "config": flags.public_config(args),
        "environment": env,
        "model": model_info,
        **results,
    }
    files.write_json_atomic(path, doc)


# --------------------------------------------------------------------------------
# The loss curve
# --------------------------------------------------------------------------------
def plot_loss_curve(path, history):
    """Train (every step) and held-out losses against the step, as a PNG; returns the path.
    matplotlib's Agg canvas directly: no display, no pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for points, style, label in ((history["train"], "-", "train"), (history["eval"], "o-", "held-out")):
        points = [(step, loss) for step, loss in points if loss is not None]  # NaN was saved as null
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".", suffix=".png")  # a new name, never a user's
    with os.fdopen(fd, "wb") as f:
        fig.savefig(f, format="png", metadata=files.PNG_METADATA)  # the mark: a later run may replace it
    os.replace(tmp, path)
    return path
