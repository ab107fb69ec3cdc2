"""Compile attention_hopper_kernel.py's kernel for sm_90 (H100) on a machine without a GPU: a stand-in driver names
the target, JITFunction.warmup runs the whole pipeline (ptxas included); nothing is launched.
python compile_sm90.py [BLOCK_N,STAGES] ...   (DOCS=1 in the environment: packed rows)"""
import sys, os, time
import torch, triton
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
import tools.sm90_offline as sm90
sm90.stand_in()
import attention_hopper_kernel as ag

B, Hq, Hkv, T = 1, 32, 8, 8192
for D in (128, 64):
    q = torch.empty(B, T, Hq, D, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.empty(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2)
    out = torch.empty(B, T, Hq, D, dtype=torch.bfloat16); lse = torch.empty(B, Hq, T); ds = torch.empty(B, T, dtype=torch.int32)
    docs = bool(os.environ.get("DOCS"))
    for cfg in [tuple(int(x) for x in c.split(",")) for c in (sys.argv[1:] or ["128,2"])]:
        bn, stages = cfg
        q3, qa, qb, qc = ag._rows_view(q); k3, ka, kb, kc = ag._rows_view(k)
        t0 = time.time()
        try:
            kd = ag._descriptor(k3, bn, D)
            c = ag._attn_fwd_hopper.warmup(ag._descriptor(q3, 64, D), kd, kd, out, lse, ds, T, Hq, Hq // Hkv,
                                           qa, qb, qc, ka, kb, kc, 0.1, BLOCK_M=128, BLOCK_N=bn, D=D, STAGES=stages,
                                           DOCS=docs, num_warps=4, grid=(1,), **ag.LAUNCH_OPTIONS)
            ptx = c.asm["ptx"]
            regs = sm90.resources(c)
            print(f"triton {triton.__version__} D={D} {cfg}: ok {time.time()-t0:.0f}s, wgmma {ptx.count('wgmma.mma_async')}, "
                  f"setmaxnreg {ptx.count('setmaxnreg')}, {regs}, shared {c.metadata.shared} B", flush=True)
            if os.environ.get("DUMP"):
                open(f"/tmp/gluon_{D}_{'_'.join(map(str, cfg))}.ptx", "w").write(ptx)
                open(f"/tmp/gluon_{D}_{'_'.join(map(str, cfg))}.ttgir", "w").write(c.asm["ttgir"])
        except Exception as e:
            msg = str(e)
            print(f"triton {triton.__version__} D={D} {cfg}: FAIL {type(e).__name__}: {msg[:3000]}", flush=True)
