"""Compile the Gluon backward for sm_90 on a machine without a GPU (tools/sm90_offline.py) with ptxas_sm90.patch
applied, and ask ptxas what it did with each variant: the PTX Triton made, assembled again by the ptxas Triton calls
for Hopper (ptxas-blackwell from Triton 3.9 on) with the flags Triton passes (-lineinfo -v --regAllocOptLevel=2, then
--regAllocOptLevel=4 where the variant asks for ptxas's default), reporting its spills and its note C7517 (a
wgmma.wait_group injected), and the loop's tensor-core waits in the SASS.
python probe.py > probe.txt     (TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH: the wheel's binaries)"""
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))  # the checkout
import tools.sm90_offline as sm90
sm90.stand_in()
import attention_hopper_kernel as ah
import triton



def compile_backward(D=128, docs=False, ptx_options=None, **meta):
    """_attn_bwd_hopper compiled for sm_90 (nothing launched) as attention_backward_hopper launches it on an 8K row of
    32 / 8 heads (BWD_TILE, two key/value heads side by side); meta: its other constexprs (DQ_TMA, DISTINCT_ACC;
    GRADS_HF, False unless given)."""
    meta = {"GRADS_HF": False, **meta}
    B, Hq, Hkv, T = 1, 32, 8, 8192
    q = torch.empty(B, T, Hq, D, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.empty(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2)
    dout = torch.empty(B, T, Hq, D, dtype=torch.bfloat16)
    lse, delta = torch.empty(B, Hq, T), torch.empty(B, Hq, T)
    ends = torch.empty(B, T, dtype=torch.int32)
    dq, dk = torch.empty(B, Hq, T, D), torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
    k3, ka, kb, kc = ah._rows_view(k)
    q3, qa, qb, qc = ah._rows_view(q)
    d3, da, db, dc = ah._rows_view(dout.transpose(1, 2))
    return ah._attn_bwd_hopper.warmup(
        ah._descriptor(k3, 128, D), ah._descriptor(k3, 128, D), ah._descriptor(q3, 64, D),
        ah._descriptor(d3, 64, D), ah._descriptor(dq.view(B * Hq, T, D), 64, D), lse, delta, ends, dq, dk, dk,
        T, Hq, Hkv, ka, kb, kc, qa, qb, qc, da, db, dc, 0.1, 0.1, GROUP=Hq // Hkv, BLOCK_M=64, BLOCK_N=128,
        D=D, KV_GROUP=2, STAGES=2, DOCS=docs, num_warps=8, grid=(1,), **ah.LAUNCH_OPTIONS, **meta,
        **({"ptx_options": ptx_options} if ptx_options else {}))


if __name__ == "__main__":
    cuobjdump = os.path.join(os.path.dirname(sm90.ptxas()), "cuobjdump")
    print(f"triton {triton.__version__}; {sm90.ptxas_version()}")
    for D, docs in [(128, False), (128, True), (64, False)]:
        for distinct in (False, True):
            for regalloc in (False, True):
                c = compile_backward(D, docs, "--regAllocOptLevel=4" if regalloc else None, DQ_TMA=True,
                                     DISTINCT_ACC=distinct)
                log, spill, _ = sm90.reassemble(c, "--regAllocOptLevel=2",
                                                *(["--regAllocOptLevel=4"] if regalloc else []))
                with tempfile.TemporaryDirectory() as tmp:
                    open(f"{tmp}/t.cubin", "wb").write(c.asm["cubin"])
                    sass = subprocess.run([cuobjdump, "-sass", f"{tmp}/t.cubin"], capture_output=True, text=True).stdout
                waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", sass)
                print(f"D={D} docs={docs!s:<5} distinct_acc={distinct!s:<5} regalloc_default={regalloc!s:<5}: "
                      f"{sm90.resources(c)}; ptxas: spill stores {'?' if spill is None else spill} B, "
                      f"C7517 {'yes' if 'C7517' in log else 'no'}; wgmma waits in order {' '.join(waits)}; "
                      f"local loads/stores {len(re.findall(r'LDL|STL', sass))}", flush=True)
