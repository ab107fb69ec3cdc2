"""Where the Gluon backward's compute partition (8 warps, two warpgroups) waits for all 256 of its threads: the source
line of every `bar.sync 0, 256` in the PTX, for dQ by TMA reductions and by atomics; and, for the first, the LLVM IR
around each barrier. Compiled for sm_90 without a GPU (tools/sm90_offline.py).
python barriers.py > barriers.txt"""
import re

from probe import compile_backward  # this folder's: the backward compiled as its launcher launches it

for tma in (True, False):
    c = compile_backward(DQ_TMA=tma)
    ptx = c.asm["ptx"]
    locs = []
    loc = None
    for line in ptx.split("\n"):
        m = re.search(r"\.loc\s+1 (\d+) ", line)
        if m: loc = m.group(1)
        if re.search(r"\bbar\.sync\s+0, 256|barrier\.sync\s+0, 256", line): locs.append(loc)
    print("DQ_TMA", tma, "partition barriers at source lines", locs)
    if tma:
        llir = c.asm["llir"]
        lines = llir.split("\n")
        for i, l in enumerate(lines):
            if "barrier" in l and ("256" in l or "cta.sync" in l):
                prev = [x.strip()[:110] for x in lines[max(0, i-3):i]]
                nxt = [x.strip()[:110] for x in lines[i+1:i+3]]
                print("----", l.strip()[:120]); print("  before:", prev); print("  after:", nxt)
