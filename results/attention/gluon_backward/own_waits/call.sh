#!/bin/bash
# From commit 1eebb44 with own_waits.patch applied (the two settings as launcher options).
# On an H100: the Gluon backward with its tensor-core waits for the issuing warp group only (own_waits: no barrier
# of both warp groups after each), with and without ptxas's default register allocation (regalloc_default), checked
# against float64 and timed beside the Triton backward and cuDNN (sweep.py); the fastest over the rows is then made
# the launcher's default in this copy, and benchmark_kernels attention and the Hopper tests run with it
# (../variants_call.sh). VARIANTS="default= own=own_waits:1" narrows the sweep. Records which ptxas assembled
# (tools/device_env.sh; with a Triton packed --with-ptxas, the release's own).
bash results/attention/gluon_backward/variants_call.sh own_waits \
  ${VARIANTS:-default= own=own_waits:1 regalloc=regalloc_default:1 both=own_waits:1,regalloc_default:1}
