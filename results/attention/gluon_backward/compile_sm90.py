"""Compile attention_hopper_kernel.py's backward for sm_90 (H100) on a machine without a GPU (a stand-in driver names
the target, JITFunction.warmup runs the whole pipeline, ptxas included; nothing is launched).
python compile_sm90.py [BLOCK_M,BLOCK_N,STAGES,DQ_TMA] ...   (DOCS=1 in the environment: packed rows; HEAD_DIM=64;
GRADS_HF=1: the gradients in HF's layout)"""
import sys, os, time
import torch, triton
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
import tools.sm90_offline as sm90
sm90.stand_in()
import attention_hopper_kernel as ah

B, Hq, Hkv, T, D = 1, 32, 8, 8192, int(os.environ.get("HEAD_DIM", 128))
docs = bool(os.environ.get("DOCS"))
hf = bool(os.environ.get("GRADS_HF"))  # gradients in HF's [B, T, H, D] layout
q = torch.empty(B, T, Hq, D, dtype=torch.bfloat16).transpose(1, 2)
k = torch.empty(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2)
dout = torch.empty(B, T, Hq, D, dtype=torch.bfloat16)
lse = torch.empty(B, Hq, T); delta = torch.empty(B, Hq, T); ends = torch.empty(B, T, dtype=torch.int32)
dq = torch.empty(B, Hq, T, D); dk = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
for cfg in [tuple(int(x) for x in c.split(",")) for c in (sys.argv[1:] or ["64,128,2,1"])]:
    bm, bn, stages, dq_tma = cfg
    k3, ka, kb, kc = ah._rows_view(k); q3, qa, qb, qc = ah._rows_view(q); d3, da, db, dc = ah._rows_view(dout.transpose(1, 2))
    desc = lambda t, r: ah._descriptor(t, r, D)
    t0 = time.time()
    try:
        c = ah._attn_bwd_hopper.warmup(desc(k3, bn), desc(k3, bn), desc(q3, bm), desc(d3, bm),
                                       desc(dq.view(B * Hq, T, D), bm), lse, delta, ends, dq, dk, dk, T, Hq, Hkv,
                                       ka, kb, kc, qa, qb, qc, da, db, dc, 0.1, 0.1, GROUP=Hq // Hkv, BLOCK_M=bm,
                                       BLOCK_N=bn, D=D, KV_GROUP=2, STAGES=stages, DOCS=docs, DQ_TMA=bool(dq_tma),
                                       GRADS_HF=hf, num_warps=8,
                                       grid=(1,), **ah.LAUNCH_OPTIONS)
        ptx = c.asm["ptx"]
        print(f"triton {triton.__version__} D={D} docs={docs} {cfg}: ok {time.time()-t0:.0f}s, wgmma "
              f"{ptx.count('wgmma.mma_async')}, atomic adds {ptx.count('atom.global') + ptx.count('red.global')}, "
              f"TMA reductions {ptx.count('cp.reduce.async.bulk')}, setmaxnreg {ptx.count('setmaxnreg')}, "
              f"{sm90.resources(c)}, shared {c.metadata.shared} B", flush=True)
        if os.environ.get("DUMP"):
            open(f"/tmp/bwd_{'_'.join(map(str, cfg))}.ptx", "w").write(ptx)
    except Exception as e:
        print(f"triton {triton.__version__} D={D} docs={docs} {cfg}: FAIL {type(e).__name__}: {str(e)[:3000]}", flush=True)
