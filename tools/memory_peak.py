"""
What holds the GPU's memory at a run's peak, by the line of code that allocated it.

The scripts report one figure, ``torch.cuda.max_memory_allocated``. To lower it you need
to know what was alive at that moment. This tool runs one of the project's scripts in
its own process (its flags after ``--``) with PyTorch's allocator recording every
allocation and free with its Python stack
(``torch.cuda.memory._record_memory_history``). At the end it replays that record: the
allocated bytes rise at each "alloc" and fall at each "free_requested" (when the tensor
lets its block go: that is when the allocator's own count, max_memory_allocated, falls,
though a block another stream still reads is reused only at its "free_completed"), so
the highest point is the run's peak, and the blocks alive then are what filled it. They
are grouped by where they were allocated: the innermost frame in this project's files (a
kernel's output, a saved activation, a gradient the optimizer keeps), with the frame
that called it. A table of the largest groups, all of them in --json. The record is read
however the script ends: after an out-of-memory error it is most wanted.

GPU only: the record is of the CUDA allocator. Record few steps: every event keeps its
stack (~1 KB of host memory each; --max-events caps them, and a record that overflowed
is refused, since its replay would be wrong).

Usage:
    python tools/memory_peak.py -- finetune_optimized.py --random-init --steps 4
    python tools/memory_peak.py --top 30 --json peak.json -- finetune_optimized.py --random-init --fp8 tensorwise \
        --steps 4
"""

import argparse
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv:
        raise SystemExit("error: name the script to run after --, e.g. tools/memory_peak.py -- finetune_optimized.py "
                         "--random-init --steps 4")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description="What holds the GPU's memory at a run's peak (GPU only).")
    parser.add_argument("--top", type=int, default=20, help="rows of the table (default: %(default)s)")
    parser.add_argument("--max-events", type=int, default=1_000_000,
                        help="allocations and frees kept; a run with more is refused (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="every group, the peak and the command, here")
    args = parser.parse_args(argv[:split])
    args.command = argv[split + 1:]
    if not args.command or not args.command[0].endswith(".py"):
        raise SystemExit("error: after -- comes a script of this project and its flags, e.g. finetune_optimized.py "
                         "--random-init --steps 4")
    return args


def live_at_peak(events):
    """(peak bytes, the alloc events of the blocks alive at the peak, its index) of one
    device's trace: allocated bytes rise at "alloc" and fall at "free_requested"."""
    current = peak = 0
    at = -1
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            current += event["size"]
        elif event["action"] == "free_requested":
            current -= event["size"]
        if current > peak:
            peak, at = current, i
    live = {}
    for event in events[:at + 1]:  # replayed again to the peak: cheaper than copying the live set at each new high
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    return peak, list(live.values()), at


def site(frames, root=ROOT):
    """Where a block was allocated: the innermost frame in ``root``'s files (this tool
    aside), "file:line function", and the frame that called it; else the innermost frame."""
    here = os.path.abspath(__file__)
    ours = [f for f in frames if os.path.abspath(f["filename"]).startswith(root + os.sep)
            and os.path.abspath(f["filename"]) != here]
    name = lambda f: f"{os.path.relpath(f['filename'], root)}:{f['line']} {f['name']}"  # noqa: E731 - a local format
    if not ours:
        return f"{os.path.basename(frames[0]['filename'])}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"
    caller = f" <- {name(ours[1])}" if len(ours) > 1 else ""
    return name(ours[0]) + caller


def by_site(blocks, root=ROOT):
    """The blocks grouped by site(): [(site, blocks, bytes)], largest first."""
    groups = {}
    for block in blocks:
        key = site(block.get("frames", []), root)
        count, size = groups.get(key, (0, 0))
        groups[key] = (count + 1, size + block["size"])
    return sorted(((k, c, s) for k, (c, s) in groups.items()), key=lambda row: -row[2])


def main(argv=None):
    args = parse_args(argv)
    import torch  # after parsing: --help needs no torch

    if not torch.cuda.is_available():
        raise SystemExit("error: tools/memory_peak.py records the CUDA allocator: it needs a GPU")
    script = args.command[0]
    torch.cuda.memory._record_memory_history(max_entries=args.max_events, stacks="python")
    sys.argv = list(args.command)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # the script's own exit (an out-of-memory error is one): read, then passed on
        ended = None if e.code in (None, 0) else e
    except BaseException as e:  # noqa: BLE001 - anything else too: the record first, then the error
        ended = e
    else:
        ended = None
    report(args)
    if ended is not None:
        raise ended


def report(args):
    """The record replayed to its peak: the table, and --json."""
    import torch

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][torch.cuda.current_device()]
    if len(events) >= args.max_events:
        raise SystemExit(f"error: the record holds {len(events):,} events, --max-events: the earliest were dropped "
                         f"and the replay would be wrong; run fewer steps or raise --max-events")
    peak, blocks, at = live_at_peak(events)
    groups = by_site(blocks)
    gib = 2**30
    print(f"\nPeak: {peak / gib:.2f} GiB allocated at event {at + 1:,} of {len(events):,} (the script's "
          f"max_memory_allocated, since its last reset: {torch.cuda.max_memory_allocated() / gib:.2f} GiB), "
          f"{len(blocks):,} blocks alive")
    print(f"{'GiB':>8} {'share':>6} {'blocks':>7}  allocated at (innermost line of this project <- its caller)")
    for key, count, size in groups[:args.top]:
        print(f"{size / gib:8.3f} {size / max(peak, 1):6.1%} {count:7,}  {key}")
    rest = groups[args.top:]
    if rest:
        size, count = sum(s for _, _, s in rest), sum(c for _, c, _ in rest)
        print(f"{size / gib:8.3f} {size / max(peak, 1):6.1%} {count:7,}  {len(rest)} other sites")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"command": args.command, "peak_bytes": peak, "events": len(events), "peak_event": at,
                       "max_memory_allocated": torch.cuda.max_memory_allocated(),
                       "sites": [{"site": k, "blocks": c, "bytes": s} for k, c, s in groups]}, f, indent=1)
        print(f"Wrote {args.json}")


if __name__ == "__main__":
    main()
