"""The committed Gluon backward compiled for sm_90 on a machine without a GPU (../ptxas_sm90/probe.py's
compile_backward, tools/sm90_offline.py), as its launcher launches it (BWD_PTXAS_OPTIONS included): the barriers of
all 256 compute threads in its PTX (`bar.sync 0, 256`: seven a step and one after the loop before the waits were the
warp group's own) and the registers, stack and local memory per thread.
python compile_sm90.py > compile_sm90.txt     (TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH: the wheel's binaries)"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ptxas_sm90"))
from probe import compile_backward  # noqa: E402 -- sets up the stand-in driver first

import attention_hopper_kernel as ah  # noqa: E402
import tools.sm90_offline as sm90  # noqa: E402
import triton  # noqa: E402

print(f"triton {triton.__version__}; {sm90.ptxas_version()}; ptx_options {ah.BWD_PTXAS_OPTIONS!r}")
for docs in (False, True):
    c = compile_backward(docs=docs, DQ_TMA=True, ptx_options=ah.BWD_PTXAS_OPTIONS)
    barriers = len(sm90.partition_barriers(c))
    print(f"packed rows {docs!s:<5}: {barriers} barriers of the compute partition; {sm90.resources(c)}", flush=True)
