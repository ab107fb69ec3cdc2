"""Where the GPU sat idle during a profiled training step.

Reads a Chrome trace written by profile_baseline.py (traces/<name>/*.json),
takes every kernel, memcpy and memset on the GPU timeline, and reports the
busy and idle time of the span they cover, the idle time by gap size, and the
longest gaps with the kernels on either side. Many small gaps mean the host
cannot launch work fast enough (launch-bound); a few long ones point at a
host synchronization or a data wait.

Usage (from the repository root):
    python tools/trace_gaps.py traces/custom/trace.json
    python tools/trace_gaps.py TRACE.json --top 20
"""

import argparse
import json
from collections import Counter

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
BUCKETS = ((5, "<5us"), (20, "5-20us"), (100, "20-100us"), (1000, "100us-1ms"), (float("inf"), ">1ms"))


def gpu_events(trace):
    """The GPU's complete events ('X'), in start order."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    return sorted(events, key=lambda e: e["ts"])


def idle_gaps(events):
    """(busy us, span us, [(gap us, kernel before, kernel after)]); overlapping kernels count once."""
    start = events[0]["ts"]
    cursor, busy, gaps, prev = start, 0.0, [], None
    for e in events:
        end = e["ts"] + e["dur"]
        if e["ts"] > cursor:
            gaps.append((e["ts"] - cursor, prev["name"] if prev else "-", e["name"]))
        if end > cursor:
            busy += end - max(cursor, e["ts"])
            cursor, prev = end, e
    return busy, cursor - start, gaps


def main(argv=None):
    parser = argparse.ArgumentParser(description="GPU idle gaps in a profile trace.")
    parser.add_argument("trace", help="Chrome trace JSON written by profile_baseline.py")
    parser.add_argument("--top", type=int, default=12, help="longest gaps to list (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        with open(args.trace) as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {args.trace}: cannot read a JSON trace ({e})") from None
    events = gpu_events(trace)
    if not events:
        raise SystemExit(f"error: {args.trace}: no GPU events (a CPU-only trace has none)")
    busy, span, gaps = idle_gaps(events)
    print(f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms "
          f"in {len(gaps)} gaps")
    by_size = Counter()
    for gap, _, _ in gaps:
        by_size[next(label for limit, label in BUCKETS if gap < limit)] += gap
    print("idle by gap size:", ", ".join(f"{label} {by_size[label] / 1e3:.2f} ms" for _, label in BUCKETS))
    for gap, before, after in sorted(gaps, reverse=True)[: args.top]:
        print(f"  {gap:9.1f} us  after {before[:60]}  before {after[:60]}")


if __name__ == "__main__":
    main()
