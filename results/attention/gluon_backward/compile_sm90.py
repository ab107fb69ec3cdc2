"""Compile attention_bwd_gluon.py's kernel for sm_90 (H100) on a machine without a GPU (a stand-in driver names the
target, JITFunction.warmup runs the whole pipeline, ptxas included; nothing is launched).
python compile_sm90.py [BLOCK_M,BLOCK_N,STAGES[,DQ_MODE]] ...   (DOCS=1 in the environment: packed rows)"""
import sys, os, time
import torch, triton
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
import tools.sm90_offline as sm90
sm90.stand_in()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_bwd_gluon as bg

B, Hq, Hkv, T, D = 1, 32, 8, 8192, 128
docs = bool(os.environ.get("DOCS"))
q = torch.empty(B, T, Hq, D, dtype=torch.bfloat16).transpose(1, 2)
k = torch.empty(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2)
dout = torch.empty(B, T, Hq, D, dtype=torch.bfloat16)
lse = torch.empty(B, Hq, T); delta = torch.empty(B, Hq, T); ds = torch.empty(B, T, dtype=torch.int32)
dq = torch.empty(B, Hq, T, D); dk = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
for cfg in [tuple(int(x) for x in c.split(",")) for c in (sys.argv[1:] or ["64,128,2"])]:
    bm, bn, stages, dq_mode = (cfg + (0,))[:4]
    dq3 = dq.view(B * Hq, T, D)
    dq_desc = bg.TensorDescriptor(dq3, list(dq3.shape), list(dq3.stride()), [1, bm, D],
                                  bg.gl.NVMMASharedLayout.get_default_for([1, bm, D], bg.gl.float32))
    k3, ka, kb, kc = bg._rows_view(k); q3, qa, qb, qc = bg._rows_view(q); d3, da, db, dc = bg._rows_view(dout.transpose(1, 2))
    desc = lambda t, r: bg._descriptor(t, r, D)
    t0 = time.time()
    try:
        c = bg._attn_bwd_hopper.warmup(desc(k3, bn), desc(k3, bn), desc(q3, bm), desc(d3, bm), dq_desc, lse, delta, ds, ds,
                                       dq, dk, dk, T, Hq, Hkv, ka, kb, kc, qa, qb, qc, da, db, dc, 0.1, 0.1,
                                       GROUP=Hq // Hkv, BLOCK_M=bm, BLOCK_N=bn, D=D, STAGES=stages, DOCS=docs,
                                       DQ_MODE=dq_mode, HEAVY_FIRST=True,
                                       num_warps=8, grid=(1,), **bg.LAUNCH_OPTIONS)
        ptx = c.asm["ptx"]
        print(f"triton {triton.__version__} D={D} docs={docs} {cfg}: ok {time.time()-t0:.0f}s, wgmma "
              f"{ptx.count('wgmma.mma_async')}, atomic adds {ptx.count('atom.global') + ptx.count('red.global')}, TMA reductions {ptx.count('cp.reduce.async.bulk')}, setmaxnreg {ptx.count('setmaxnreg')}, "
              f"{sm90.resources(c)}, shared {c.metadata.shared} B",
              flush=True)
        if os.environ.get("DUMP"):
            open(f"/tmp/bwd_{'_'.join(map(str, cfg))}.ptx", "w").write(ptx)
    except Exception as e:
        print(f"triton {triton.__version__} D={D} docs={docs} {cfg}: FAIL {type(e).__name__}: {str(e)[:3000]}", flush=True)
