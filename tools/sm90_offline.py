"""Compiling kernels for an H100 (sm_90) on a machine without a GPU.

Triton compiles through its whole pipeline, ptxas included, for whatever target its
active driver names; nothing is launched by ``JITFunction.warmup``. So a stand-in driver
that names sm_90 is enough to see what a kernel becomes on Hopper (its IR, PTX, registers,
shared memory) from a CPU machine:

    import tools.sm90_offline as sm90
    sm90.stand_in()                      # before the kernel modules are imported
    compiled = kernel.warmup(*args, grid=(1,), **meta)
    sm90.resources(compiled)             # 'REG:168 STACK:0 LOCAL:0' (cuobjdump's count)
    log, spill, regs = sm90.reassemble(compiled, "--regAllocOptLevel=2")   # ptxas's own report
    sm90.partition_barriers(compiled)    # ['455', ...]: the source line of each 256-thread barrier

TRITON_PTXAS_PATH must name a ptxas (the one Triton's wheel ships, beside cuobjdump).
Used by results/attention/*/compile_sm90.py.
"""
import os
import re
import subprocess
import tempfile

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class _StandInDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def stand_in():
    """Make Triton compile for sm_90, and kernel_common see a GPU (so it does not switch
    the interpreter on); call before importing the kernel modules."""
    driver.set_active(_StandInDriver())
    torch.cuda.is_available = lambda: True


def resources(compiled):
    """The registers, stack and local memory per thread of a compiled kernel, as cuobjdump
    reads them from its cubin (spills show as stack or local bytes)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        cuobjdump = os.path.join(os.path.dirname(os.environ["TRITON_PTXAS_PATH"]), "cuobjdump")
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(re.findall(r"REG:\d+|STACK:\d+|LOCAL:\d+", usage))


def ptxas():
    """The ptxas Triton assembles Hopper code with: the one it names ptxas-blackwell from Triton 3.9
    on, ptxas before."""
    return os.environ.get("TRITON_PTXAS_BLACKWELL_PATH") or os.environ["TRITON_PTXAS_PATH"]


def ptxas_version():
    return subprocess.run([ptxas(), "--version"], capture_output=True, text=True).stdout.split("\n")[-2]


def reassemble(compiled, *flags):
    """A compiled kernel's PTX assembled again for sm_90a by ptxas() with -lineinfo -v and ``flags``
    (Triton 3.8+ itself passes --regAllocOptLevel=2), to read ptxas's report, which Triton keeps to
    itself: (log, spill store bytes, registers), each number None where the log has none."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([ptxas(), "-lineinfo", "-v", *flags, "--gpu-name=sm_90a", f"{tmp}/k.ptx",
                              "-o", f"{tmp}/k.cubin"], capture_output=True, text=True).stderr
    spill = re.search(r"(\d+) bytes spill stores", log)
    regs = re.search(r"Used (\d+) registers", log)
    return log, spill and int(spill.group(1)), regs and int(regs.group(1))


def partition_barriers(compiled, threads=256):
    """The source line (of the kernel's own file) of every barrier of ``threads`` threads with id 0 in a compiled
    kernel's PTX (`bar.sync 0, 256`: all the compute warps of an 8-warp partition meeting), in PTX order."""
    lines, loc = [], None
    for line in compiled.asm["ptx"].split("\n"):
        m = re.search(r"\.loc\s+1 (\d+) ", line)
        if m:
            loc = m.group(1)
        if re.search(rf"\bbar\.sync\s+0, {threads}|barrier\.sync\s+0, {threads}", line):
            lines.append(loc)
    return lines
