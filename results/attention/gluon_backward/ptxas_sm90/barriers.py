"""Where the Gluon backward's compute partition (8 warps, two warpgroups) waits for all 256 of its threads: the source
line of every `bar.sync 0, 256` in the PTX, for dQ by TMA reductions and by atomics; and, for the first, the LLVM IR
around each barrier. Compiled for sm_90 without a GPU (tools/sm90_offline.py).
python barriers.py > barriers.txt"""
import os, sys, re
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))  # the checkout
import tools.sm90_offline as sm90
sm90.stand_in()
import torch
import attention_hopper_kernel as ah
B, Hq, Hkv, T, D = 1, 32, 8, 8192, 128
q = torch.empty(B, T, Hq, D, dtype=torch.bfloat16).transpose(1, 2)
k = torch.empty(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2)
dout = torch.empty(B, T, Hq, D, dtype=torch.bfloat16)
lse = torch.empty(B, Hq, T); delta = torch.empty(B, Hq, T); ends = torch.empty(B, T, dtype=torch.int32)
dq = torch.empty(B, Hq, T, D); dk = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
k3, ka, kb, kc = ah._rows_view(k); q3, qa, qb, qc = ah._rows_view(q); d3, da, db, dc = ah._rows_view(dout.transpose(1, 2))
desc = lambda t, r: ah._descriptor(t, r, D)
for tma in (True, False):
    c = ah._attn_bwd_hopper.warmup(desc(k3, 128), desc(k3, 128), desc(q3, 64), desc(d3, 64), desc(dq.view(B * Hq, T, D), 64),
        lse, delta, ends, dq, dk, dk, T, Hq, Hkv, ka, kb, kc, qa, qb, qc, da, db, dc, 0.1, 0.1, GROUP=4, BLOCK_M=64,
        BLOCK_N=128, D=D, KV_GROUP=2, STAGES=2, DOCS=False, DQ_TMA=tma, num_warps=8, grid=(1,), **ah.LAUNCH_OPTIONS)
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
