"""
How far each FP8 tensor's max |x| moves from one step to the next, and what delayed
scaling would make of it.

Per tensor, Step 22 scales every cast by the tensor's own max |x| of this step
("current" scaling): the largest value lands on e4m3's 448, nothing clips, and the
maximum must be known before the first element is cast, so the bf16 tensor is written
by its producer and read again by the cast. Delayed scaling (Transformer Engine's
recipe) takes the maximum from earlier steps instead, the largest over a history of
the last H steps: a producer could then write the FP8 copy itself, in the same pass,
and the bf16 copy would be neither written nor read again. The price: a tensor whose
maximum grows past its history is clamped at 448 that step (its largest values lose
their size, not just precision), and one whose maximum shrinks leaves the top of
e4m3's range unused (its smallest values move toward the subnormals, then to zero).

How often, and by how much, is measured here: the tool runs one of the project's
scripts (its flags after ``--``) with ``--fp8 tensorwise`` and without CUDA graphs
(a replayed graph runs no Python), records the scale of every per-tensor cast of every
step, in the order the step makes them (the weights, the layers' inputs, the output
gradients), and replays delayed scaling over that record for each history length:

* per kind, how much each cast's maximum changes from one step to the next;
* how many casts would clip (their maximum above the delayed one), how many by more than
  the rounding of e4m3's largest value costs under current scaling (x1.036), and the worst
  factor;
* how much of the range the others would leave unused (log2 of delayed over current,
  in bits; e4m3 spans ~17 bits from its smallest subnormal to 448).

``--skip N`` counts only the steps from N on, which still look back at the first N as
their history. ``--replay`` reads an earlier ``--json`` and counts it again, with other
histories or another --skip. No bytes are saved by this tool and no training changes: it
reads the scales the run computes anyway (one copy of a float32 scalar per cast; the
record is read once, at the end).

Usage:
    python tools/fp8_amax_history.py -- finetune_optimized.py --random-init --fp8 tensorwise --steps 40
    python tools/fp8_amax_history.py --history 1 16 1024 --skip 20 --json amax.json -- finetune_optimized.py \
        --random-init --fp8 tensorwise --steps 200
    python tools/fp8_amax_history.py --replay amax.json --skip 50      # the same record, counted otherwise
"""

import argparse
import functools
import math
import os
import runpy
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a file: the project's modules beside tools/
    sys.path.insert(0, ROOT)

KINDS = ("weight", "input", "gradient")


# Runs whose casts the record would get wrong: a weight gathered by FSDP is cast as its shards
# (and a frozen one only once), a checkpointed layer casts its forward's inputs again in backward.
UNRECORDABLE = {"--fsdp": "FSDP casts each weight's shards, not the weight",
                "--fsdp-fp8-gather": "FSDP casts each weight's shards, not the weight",
                "--gradient-checkpointing": "the recomputed forward would cast each input a second time",
                "--compile": "under --compile the casts run inside compiled code and are not recorded",
                "--cuda-graphs": "a replayed CUDA graph runs no Python, so its casts cannot be recorded (the tool "
                                 "adds --no-cuda-graphs)"}


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv and not any(a == "--replay" or a.startswith("--replay=") for a in argv):
        raise SystemExit("error: name the script to run after --, e.g. tools/fp8_amax_history.py -- "
                         "finetune_optimized.py --random-init --fp8 tensorwise --steps 40")
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description="How each FP8 cast's max |x| moves between steps, and what "
                                                 "delayed scaling would clip (per tensor, eager).")
    parser.add_argument("--history", type=int, nargs="+", default=[1, 16, 1024],
                        help="history lengths H to replay: the delayed maximum is the largest of the last H "
                             "steps (default: %(default)s; Transformer Engine's default is 1024)")
    parser.add_argument("--skip", type=int, default=0,
                        help="count only steps from N on (they still look back at the first N as history; from "
                             "random weights the maxima move most at the start; default: %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="the summary and every cast's maximum per step, here")
    parser.add_argument("--replay", metavar="PATH",
                        help="replay the record of an earlier --json (.json or .json.gz) instead of running a script")
    args = parser.parse_args(argv[:split])
    if args.skip < 0:
        raise SystemExit(f"error: --skip is a number of steps, at least 0, got {args.skip}")
    if any(h < 1 for h in args.history):
        raise SystemExit(f"error: --history lengths are at least 1 step, got {args.history}")
    command = argv[split + 1:]
    if args.replay:
        if command:
            raise SystemExit("error: --replay reads a record; it runs no script (leave out what follows --)")
        args.command = None
        return args
    if not command or not command[0].endswith(".py"):
        raise SystemExit("error: after -- comes a script of this project and its flags, e.g. finetune_optimized.py "
                         "--random-init --fp8 tensorwise --steps 40")
    if not _asks_tensorwise(command[1:]):
        raise SystemExit("error: the script must run --fp8 tensorwise: per row there is no one maximum per tensor "
                         "to delay")
    for flag, why in UNRECORDABLE.items():
        if flag in command:
            raise SystemExit(f"error: leave out {flag}: {why}")
    if "--no-cuda-graphs" not in command:
        command.append("--no-cuda-graphs")
    args.command = command
    return args


def _asks_tensorwise(flags):
    for i, flag in enumerate(flags):
        if flag == "--fp8=tensorwise" or (flag == "--fp8" and i + 1 < len(flags) and flags[i + 1] == "tensorwise"):
            return True
    return False


# --------------------------------------------------------------------------------
# The record: every per-tensor cast of every step, in order
# --------------------------------------------------------------------------------
class Recorder:
    """Wraps fp8_kernel's cast entry points (module attributes, looked up at each call)
    and training.train_step (a step's boundary). ``steps``: per step, a list of
    (kind, shape, inverse scale tensor, format's largest value) of the casts made while
    ``_in_step`` (inside train_step)."""

    def __init__(self):
        self.steps = []
        self._in_step = False
        self._kinds = []  # the kind the innermost wrapper being run says, for the casts inside it

    def install(self):
        import fp8_kernel
        from kernel_ft import training

        self._undo = []
        self._largest = {dtype: top for dtype, top in fp8_kernel.GRAD_FORMATS.values()}  # e4m3: 448
        # Where every per-tensor cast ends: the cast kernels over stacked parts, or side by side.
        self._wrap(fp8_kernel, "_quantize_parts", functools.partial(self._recorded, rows_stacked=True))
        self._wrap(fp8_kernel, "quantize_side_by_side", functools.partial(self._recorded, rows_stacked=False))
        # Whose casts are which (wrapped around the recording, so the kind holds while it records):
        # weights (a layer's own, or a group's stacked), gradients (an output gradient, alone or
        # side by side); anything else is a layer's input.
        for name, kind in (("quantize_stacked", "weight"), ("_output_grad_fp8", "gradient"),
                           ("quantize_side_by_side", "gradient")):
            self._wrap(fp8_kernel, name, functools.partial(self._as_kind, kind))
        self._wrap(fp8_kernel, "_weight_fp8", self._weight)
        self._wrap(training, "train_step", self._step)
        return self

    def uninstall(self):
        for module, name, original in reversed(self._undo):
            setattr(module, name, original)
        self._undo = []

    def _wrap(self, module, name, wrapper):
        original = getattr(module, name)
        self._undo.append((module, name, original))
        setattr(module, name, functools.wraps(original)(functools.partial(wrapper, original)))

    def _as_kind(self, kind, original, *args, **kwargs):
        self._kinds.append(kind)
        try:
            return original(*args, **kwargs)
        finally:
            self._kinds.pop()

    def _weight(self, original, weight, *args, **kwargs):
        # A frozen weight (LoRA's base layers) is cast once and kept: nothing to delay (kind None).
        return self._as_kind("weight" if weight.requires_grad else None, original, weight, *args, **kwargs)

    def _recorded(self, original, parts, *args, rows_stacked, **kwargs):
        q = original(parts, *args, **kwargs)
        kind = self._kinds[-1] if self._kinds else "input"
        if self._in_step and kind is not None and q.inv_scale.numel() == 1:  # per tensor, in a training step
            shape = ((sum(p.shape[0] for p in parts), parts[0].shape[1]) if rows_stacked
                     else (parts[0].shape[0], sum(p.shape[1] for p in parts)))
            self.steps[-1].append((kind, shape, q.inv_scale.detach().reshape(1).clone(), self._largest[q.data.dtype]))
        return q

    def _step(self, original, *args, **kwargs):
        self.steps.append([])
        self._in_step = True  # an evaluation between steps casts too: not part of the record
        try:
            return original(*args, **kwargs)
        finally:
            self._in_step = False

    def maxima(self):
        """The record as floats: per step [(kind, shape, max |x|)], one device read."""
        import torch

        flat = [inv for step in self.steps for _, _, inv, _ in step]
        values = torch.cat(flat).double().tolist() if flat else []
        out, i = [], 0
        for step in self.steps:
            out.append([(kind, list(shape), values[i + j] * top) for j, (kind, shape, _, top) in enumerate(step)])
            i += len(step)
        return out


# --------------------------------------------------------------------------------
# Delayed scaling, replayed over the record
# --------------------------------------------------------------------------------
def cast_sites(steps):
    """Per cast site (the i-th cast of every step), its (kind, shape) and max |x| per step.
    Every step must make the same casts in the same order (one batch shape)."""
    steps = [s for s in steps if s]
    if len(steps) < 2:
        raise ValueError(f"delayed scaling needs at least 2 steps with FP8 casts, got {len(steps)}")
    layout = [(kind, tuple(shape)) for kind, shape, _ in steps[0]]
    for t, step in enumerate(steps[1:], 2):
        if [(kind, tuple(shape)) for kind, shape, _ in step] != layout:
            raise ValueError(f"step {t} made other casts than step 1 ({len(step)} against {len(layout)}, or other "
                             f"shapes): run batches of one shape (packing, or synthetic rows)")
    return [(kind, shape, [step[i][2] for step in steps]) for i, (kind, shape) in enumerate(layout)]


def delayed(series, history, start=1):
    """[(current max, delayed max)] for steps ``start``.. of one site: the delayed maximum is
    the largest of the ``history`` steps before (step 0 has none: current scaling). Steps
    before ``start`` still count as history."""
    return [(series[t], max(series[max(0, t - history):t])) for t in range(max(1, start), len(series))]


def _percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# A cast whose maximum was all zeros (an empty or zero tensor) stores the floor of
# fp8_kernel.AMAX_FLOOR, 1e-12, as its maximum: no scale to compare, left out of the ratios.
ZERO = 1e-12 * (1 + 1e-6)
# e4m3's two largest values are 416 and 448: a value that would land up to half that gap
# above 448 rounds to 448 with current scaling too. Delayed scaling's clip of x <= 1 + 16/448
# costs no more than that rounding; CLEAR counts only the clips past it.
CLEAR = 1 + 16 / 448


def summarize(steps, histories, skip=0):
    """{kind: {...}} over the record (see the module docstring): every step serves as history,
    only steps from ``skip`` on are counted. A maximum of 0 is left out of the ratios."""
    sites = cast_sites(steps)
    summary = {}
    start = max(1, skip)
    for kind in KINDS:
        mine = [series for k, _, series in sites if k == kind]
        if not mine:
            continue
        steps_seen = [(s[t - 1], s[t]) for s in mine for t in range(start, len(s)) if min(s[t - 1], s[t]) > ZERO]
        changes = [abs(math.log2(b / a)) for a, b in steps_seen]
        entry = {"sites": len(mine), "steps": max(0, len(mine[0]) - start),  # steps counted (each after another)
                 "change_bits_median": statistics.median(changes) if changes else 0.0,
                 "change_bits_p99": _percentile(changes, 0.99) if changes else 0.0,
                 "largest_growth": max((b / a for a, b in steps_seen), default=1.0), "delayed": {}}
        for history in histories:
            pairs = [p for s in mine for p in delayed(s, history, start) if min(p) > ZERO]
            clipped = [cur / old for cur, old in pairs if cur > old]
            unused = [math.log2(old / cur) for cur, old in pairs if cur <= old]
            entry["delayed"][history] = {
                "casts": len(pairs), "clipped": len(clipped),
                "clipped_fraction": len(clipped) / len(pairs) if pairs else 0.0,
                "clipped_past_rounding": sum(c > CLEAR for c in clipped),
                "worst_clip": max(clipped, default=1.0),
                "unused_bits_median": statistics.median(unused) if unused else 0.0,
                "unused_bits_p99": _percentile(unused, 0.99) if unused else 0.0}
        summary[kind] = entry
    return summary


def print_summary(summary):
    print("\nmax |x| of each per-tensor cast, from one step to the next (|log2 of the ratio|, bits)")
    print(f"{'kind':<9} {'casts/step':>10} {'steps':>6} {'median':>9} {'99th pct':>9} {'largest growth':>15}")
    for kind, e in summary.items():
        print(f"{kind:<9} {e['sites']:>10,} {e['steps']:>6} {e['change_bits_median']:>9.4f} "
              f"{e['change_bits_p99']:>9.4f} {'x%.4f' % e['largest_growth']:>15}")
    print("\nDelayed scaling, the largest max |x| of the last H steps, replayed over the same casts")
    print(f"(clipped past rounding: by more than x{CLEAR:.4f}, the rounding of e4m3's top value under current scaling)")
    print(f"{'kind':<9} {'H':>5} {'casts':>8} {'clipped':>8} {'share':>7} {'past rounding':>14} {'worst clip':>11} "
          f"{'unused bits: median':>20} {'99th pct':>9}")
    for kind, e in summary.items():
        for history, d in e["delayed"].items():
            past = d["clipped_past_rounding"] / d["casts"] if d["casts"] else 0.0
            print(f"{kind:<9} {history:>5} {d['casts']:>8,} {d['clipped']:>8,} {d['clipped_fraction']:>7.2%} "
                  f"{past:>14.2%} {'x%.4f' % d['worst_clip']:>11} {d['unused_bits_median']:>20.4f} "
                  f"{d['unused_bits_p99']:>9.4f}")


def record_run(command):
    """Run ``command`` (a script and its flags) with the recorder installed: the record."""
    print(f"Recording the scale of every per-tensor FP8 cast: {' '.join(command)}")
    recorder = Recorder().install()
    sys.argv = list(command)
    sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
    try:
        runpy.run_path(command[0], run_name="__main__")
    except SystemExit as e:  # the script's own exit: a failed run has no record worth replaying
        if e.code not in (None, 0):
            raise
    finally:
        recorder.uninstall()
    return recorder.maxima()


def read_record(path):
    """The "command" and "steps" of an earlier --json."""
    import gzip
    import json

    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            saved = json.load(f)
        return saved["command"], saved["steps"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: --replay {path}: not a record this tool wrote ({type(e).__name__}: {e})") from None


def main(argv=None):
    args = parse_args(argv)
    if args.replay:
        command, steps = read_record(args.replay)
        print(f"Replaying the record of: {' '.join(command)}")
    else:
        command, steps = args.command, record_run(args.command)
    try:
        summary = summarize(steps, args.history, args.skip)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print_summary(summary)
    if args.json:
        from kernel_ft import files

        files.write_json_atomic(args.json, {"command": command, "histories": args.history, "skip": args.skip,
                                            "summary": summary, "steps": steps})
        print(f"Wrote {args.json}")
    return summary


if __name__ == "__main__":
    main()
