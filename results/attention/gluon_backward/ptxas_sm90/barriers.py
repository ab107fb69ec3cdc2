"""Where the Gluon backward's compute partition (8 warps, two warpgroups) waits for all 256 of its threads: the source
line of every `bar.sync 0, 256` in the PTX, for dQ by TMA reductions and by atomics; and, for the first, the LLVM IR
around each barrier. Compiled for sm_90 without a GPU (tools/sm90_offline.py).
python barriers.py > barriers.txt"""
from probe import compile_backward  # this folder's: the backward compiled as its launcher launches it
import tools.sm90_offline as sm90

for tma in (True, False):
    c = compile_backward(DQ_TMA=tma)
    locs = sm90.partition_barriers(c)
    print("DQ_TMA", tma, "partition barriers at source lines", locs)
    if tma:
        llir = c.asm["llir"]
        lines = llir.split("\n")
        for i, l in enumerate(lines):
            if "barrier" in l and ("256" in l or "cta.sync" in l):
                prev = [x.strip()[:110] for x in lines[max(0, i-3):i]]
                nxt = [x.strip()[:110] for x in lines[i+1:i+3]]
                print("----", l.strip()[:120]); print("  before:", prev); print("  after:", nxt)
