"""Compile attention_hopper_kernel.py's kernel for sm_90 (H100) on a machine without a GPU: a stand-in driver names
the target, JITFunction.warmup runs the whole pipeline (ptxas included); nothing is launched.
python compile_sm90.py [BLOCK_N,STAGES,SPLIT[,MAXNREG]] ..."""
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
import attention_hopper_kernel as ag
from triton.experimental.gluon import language as gl

B, Hq, Hkv, T = 1, 32, 8, 8192
for D in (128, 64):
    q = torch.empty(B, T, Hq, D, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.empty(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2)
    out = torch.empty(B, T, Hq, D, dtype=torch.bfloat16); lse = torch.empty(B, Hq, T); ds = torch.empty(B, T, dtype=torch.int32)
    docs = bool(os.environ.get("DOCS"))
    for cfg in [tuple(int(x) for x in c.split(",")) for c in (sys.argv[1:] or ["128,2,1"])]:
        bn, stages, split = cfg[:3]
        maxnreg = cfg[3] if len(cfg) > 3 else None
        q3, qa, qb, qc = ag._rows_view(q); k3, ka, kb, kc = ag._rows_view(k)
        lay = lambda r: gl.NVMMASharedLayout.get_default_for([1, r, D], gl.bfloat16)
        desc = lambda t, r: ag.TensorDescriptor(t, list(t.shape), list(t.stride()), [1, r, D], lay(r))
        t0 = time.time()
        try:
            extra = {} if maxnreg is None else {"maxnreg": maxnreg}
            c = ag._attn_fwd_hopper.warmup(desc(q3, 128 // split), desc(k3, bn), desc(k3, bn), out, lse, ds, T, Hq, Hq // Hkv,
                                           qa, qb, qc, ka, kb, kc, 0.1, BLOCK_M=128, BLOCK_N=bn, D=D, STAGES=stages, DOCS=docs, SPLIT=split,
                                           num_warps=8 // split, grid=(1,), **extra)
            ptx = c.asm["ptx"]
            open("/tmp/k.cubin", "wb").write(c.asm["cubin"])
            bin_dir = os.path.dirname(os.environ["TRITON_PTXAS_PATH"])
            usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", "/tmp/k.cubin"],
                                   capture_output=True, text=True).stdout
            regs = " ".join(re.findall(r"REG:\d+|STACK:\d+|LOCAL:\d+", usage))
            print(f"triton {triton.__version__} D={D} {cfg}: ok {time.time()-t0:.0f}s, wgmma {ptx.count('wgmma.mma_async')}, "
                  f"setmaxnreg {ptx.count('setmaxnreg')}, {regs}, shared {c.metadata.shared} B", flush=True)
            if os.environ.get("DUMP"):
                open(f"/tmp/gluon_{D}_{'_'.join(map(str, cfg))}.ptx", "w").write(ptx)
                open(f"/tmp/gluon_{D}_{'_'.join(map(str, cfg))}.ttgir", "w").write(c.asm["ttgir"])
        except Exception as e:
            msg = str(e)
            print(f"triton {triton.__version__} D={D} {cfg}: FAIL {type(e).__name__}: {msg[:3000]}", flush=True)
