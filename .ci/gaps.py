"""Developer tool: GPU idle gaps in a Chrome trace written by profile_baseline.py."""
import json
import sys
from collections import Counter

path = sys.argv[1]
with open(path) as f:
    trace = json.load(f)
kernels = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
start, end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
busy = 0.0
gaps = []
cursor = start
prev = None
for e in kernels:
    if e["ts"] > cursor:
        gaps.append((e["ts"] - cursor, prev["name"][:70] if prev else "-", e["name"][:70]))
    if e["ts"] + e["dur"] > cursor:
        busy += e["ts"] + e["dur"] - max(cursor, e["ts"])
        cursor = e["ts"] + e["dur"]
        prev = e
span = end - start
print(f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms in {len(gaps)} gaps")
hist = Counter()
for g, _, _ in gaps:
    hist["<5us" if g < 5 else "5-20us" if g < 20 else "20-100us" if g < 100 else "100us-1ms" if g < 1000 else ">1ms"] += g
print("idle by gap size (ms):", {k: round(v / 1e3, 2) for k, v in hist.items()})
for g, a, b in sorted(gaps, reverse=True)[:12]:
    print(f"  {g:9.1f} us  after {a}  before {b}")
