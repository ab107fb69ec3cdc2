"""The Triton attention kernels (attention_kernel.py: forward, delta, dK/dV, dQ) compiled for sm_90 on a machine
without a GPU, as a packed 4,096-token row of 32 / 8 heads of 128 launches them (the Triton backward, as under
torch.compile or without TMA reductions), and assembled again by the ptxas Triton uses for Hopper with the flags
Triton 3.8+ passes (--regAllocOptLevel=2) and with ptxas's default allocation: spills and registers of each.
A stand-in driver (tools/sm90_offline.py) and stand-ins for the CUDA queries the launchers make; every launch is
turned into Triton's warm-up (compile, no launch), so the outputs are never computed.
python triton_kernels.py > triton_kernels_<triton version>.txt   (TRITON_PTXAS_PATH, and from Triton 3.9 on
TRITON_PTXAS_BLACKWELL_PATH: the wheel's binaries)"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))  # the checkout
import tools.sm90_offline as sm90
sm90.stand_in()
import torch
# What the launchers ask of the GPU (a CPU build of torch answers none of it): an H100's.
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.current_device = lambda: 0
class _P:
    multi_processor_count = 132; name = "stand-in H100"; total_memory = 80 * 2**30
torch.cuda.get_device_properties = lambda *a, **k: _P()
import kernel_common
kernel_common.FAST_LAUNCH = False  # Triton's own launch path, which the patch below turns into a warm-up
import triton
from triton.runtime.jit import JITFunction
print(f"triton {triton.__version__}")
compiled = []  # (kernel name, CompiledKernel) in launch order
_run = JITFunction.run
def run(self, *args, grid, warmup, **kwargs):
    k = _run(self, *args, grid=grid, warmup=True, **kwargs)
    compiled.append((self.fn.__name__, k))
    return k
JITFunction.run = run
import attention_kernel as ak
ak.USE_HOPPER_BACKWARD = False
B, Hq, Hkv, T, D = 1, 32, 8, 4096, 128
q = torch.zeros(B, T, Hq, D, dtype=torch.bfloat16).transpose(1, 2)
k = torch.zeros(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2)
v = torch.zeros(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2)
pos = torch.arange(T).remainder(512).view(1, T)  # documents of 512 tokens
ds = (torch.arange(T) - pos).to(torch.int32).view(1, T)
scale = D ** -0.5
out, lse = ak.attention_forward(q, k, v, ds, scale, 0, 0.0)
ak.attention_backward(torch.zeros(B, T, Hq, D, dtype=torch.bfloat16), q, k, v, out, lse, ds, scale, 0, 0.0)
print(sm90.ptxas_version(),
      "| level 2: the flag Triton 3.8+ passes; default: ptxas's own allocation (Triton 3.6 passes no flag)")
for name, c in compiled:
    res = []
    for extra in ([], ["--regAllocOptLevel=4"]):
        log, spill, regs = sm90.reassemble(c, "--regAllocOptLevel=2", *extra)
        res.append(f"spill {'?' if spill is None else spill} B regs {'?' if regs is None else regs}"
                   f"{' C7517' if 'C7517' in log else ''}")
    print(f"{name:<28} warps {c.metadata.num_warps} stages {c.metadata.num_stages}: level 2: {res[0]}; default: {res[1]}")
