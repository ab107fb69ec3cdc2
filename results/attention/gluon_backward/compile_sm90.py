"""Compile attention_bwd_gluon.py's kernel for sm_90 (H100) on a machine without a GPU (a stand-in driver names the
target, JITFunction.warmup runs the whole pipeline, ptxas included; nothing is launched).
python compile_sm90.py [BLOCK_M,BLOCK_N,STAGES] ...   (DOCS=1 in the environment: packed rows)"""
import sys, os, time, re, subprocess
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class StandIn:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")
    def is_active(self): return True
driver.set_active(StandIn())
torch.cuda.is_available = lambda: True  # kernel_common: a GPU, so no interpreter
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_bwd_gluon as bg
from triton.experimental.gluon import language as gl

B, Hq, Hkv, T, D = 1, 32, 8, 8192, 128
docs = bool(os.environ.get("DOCS"))
q = torch.empty(B, T, Hq, D, dtype=torch.bfloat16).transpose(1, 2)
k = torch.empty(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2)
dout = torch.empty(B, T, Hq, D, dtype=torch.bfloat16)
lse = torch.empty(B, Hq, T); delta = torch.empty(B, Hq, T); ds = torch.empty(B, T, dtype=torch.int32)
dq = torch.empty(B, Hq, T, D); dk = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
for cfg in [tuple(int(x) for x in c.split(",")) for c in (sys.argv[1:] or ["64,128,2"])]:
    bm, bn, stages = cfg
    k3, ka, kb, kc = bg._rows_view(k); q3, qa, qb, qc = bg._rows_view(q); d3, da, db, dc = bg._rows_view(dout.transpose(1, 2))
    desc = lambda t, r: bg.TensorDescriptor(t, list(t.shape), list(t.stride()), [1, r, D],
                                            gl.NVMMASharedLayout.get_default_for([1, r, D], gl.bfloat16))
    t0 = time.time()
    try:
        c = bg._attn_bwd_hopper.warmup(desc(k3, bn), desc(k3, bn), desc(q3, bm), desc(d3, bm), lse, delta, ds, ds,
                                       dq, dk, dk, T, Hq, Hkv, ka, kb, kc, qa, qb, qc, da, db, dc, 0.1, 0.1,
                                       GROUP=Hq // Hkv, BLOCK_M=bm, BLOCK_N=bn, D=D, STAGES=stages, DOCS=docs,
                                       num_warps=8, grid=(1,), **bg.LAUNCH_OPTIONS)
        open("/tmp/kb.cubin", "wb").write(c.asm["cubin"])
        usage = subprocess.run([os.path.join(os.path.dirname(os.environ["TRITON_PTXAS_PATH"]), "cuobjdump"),
                                "--dump-resource-usage", "/tmp/kb.cubin"], capture_output=True, text=True).stdout
        ptx = c.asm["ptx"]
        print(f"triton {triton.__version__} D={D} docs={docs} {cfg}: ok {time.time()-t0:.0f}s, wgmma "
              f"{ptx.count('wgmma.mma_async')}, atomic adds {ptx.count('atom.global') + ptx.count('red.global')}, setmaxnreg {ptx.count('setmaxnreg')}, "
              f"{' '.join(re.findall(r'REG:[0-9]+|STACK:[0-9]+|LOCAL:[0-9]+', usage))}, shared {c.metadata.shared} B",
              flush=True)
        if os.environ.get("DUMP"):
            open(f"/tmp/bwd_{'_'.join(map(str, cfg))}.ptx", "w").write(ptx)
    except Exception as e:
        print(f"triton {triton.__version__} D={D} docs={docs} {cfg}: FAIL {type(e).__name__}: {str(e)[:3000]}", flush=True)
