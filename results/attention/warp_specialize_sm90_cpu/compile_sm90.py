"""Compile the attention forward for sm_90 (H100) on a machine without a GPU, through the whole pipeline of the
Triton imported (ptxas included): python compile_sm90.py KERNEL_FILE BM,BN,WARPS,STAGES ... (a copy of
attention_kernel.py, with or without warp_specialize.patch). A stand-in driver names the target; nothing is launched."""
import sys, time, importlib.util, os
import torch, triton
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
import tools.sm90_offline as sm90
sm90.stand_in()
path = sys.argv[1]
spec = importlib.util.spec_from_file_location("attn_variant", path)
ak = importlib.util.module_from_spec(spec); spec.loader.exec_module(ak)
from triton.tools.tensor_descriptor import TensorDescriptor
B, Hq, Hkv, T, D = 1, 32, 8, 8192, 128
q = torch.empty(B, Hq, T, D, dtype=torch.bfloat16); k = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16); v = torch.empty_like(k)
out = torch.empty(B, T, Hq, D, dtype=torch.bfloat16); lse = torch.empty(B, Hq, T); ds = torch.zeros(B, T, dtype=torch.int32)
for cfg in [tuple(int(x) for x in c.split(",")) for c in sys.argv[2:]]:
    bm, bn, w, s = cfg
    desc = lambda t, r: TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, r, D])
    t0 = time.time()
    try:
        kern = ak._attn_fwd_kernel.fn if hasattr(ak._attn_fwd_kernel, "fn") else ak._attn_fwd_kernel
        c = kern.warmup(desc(q, bm), desc(k, bn), desc(v, bn), out, lse, ds, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                        T, Hq, Hq // Hkv, T, 0.1, 0.0, D=D, DP=D, BLOCK_M=bm, BLOCK_N=bn, DOT_PRECISION="tf32",
                        PRECISE=False, SOFTCAP=False, TMA=True, num_warps=w, num_stages=s, grid=(1,))
        ptx, ttgir = c.asm["ptx"], c.asm["ttgir"]
        print(f"{triton.__version__} {os.path.basename(path)} {cfg}: ok, ttg.warp_specialize ops "
              f"{ttgir.count('ttg.warp_specialize')}, setmaxnreg {ptx.count('setmaxnreg')}, "
              f"wgmma {ptx.count('wgmma.mma_async')}, shared memory {c.metadata.shared} B", flush=True)
    except Exception as e:
        print(f"{triton.__version__} {os.path.basename(path)} {cfg}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
