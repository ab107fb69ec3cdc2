#!/bin/bash
# The GPU checks of the Gluon attention kernels, in one call on an H100 / H200 (at most 9 minutes):
#   bash results/attention/gluon_gpu_check.sh OUTDIR
# If .triton/ holds a packed Triton 3.8 or newer (tools/pack_triton.sh), under it: the backward's variants (TMA
# reductions from the compute warps or a writer warp; lse and delta loaded a step ahead or not; dQ's product before
# dK's or after) against float64 and timed beside the Triton backward and cuDNN (sweep.py), the whole of
# attention_test.py (the Gluon backward is the default there), and benchmark_kernels.py --kernel attention. Then
# under the machine's own Triton: attention_test.py's Hopper tests (the forward alone: gluon_forward/check_bench.py).
set -u
R=${1:?OUTDIR}
t0=$(date +%s)
el() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s"; }
if [ -d .triton ]; then
  ( source tools/device_env.sh $R/packed_triton >/dev/null
    timeout 240 python3 results/attention/gluon_backward/sweep.py --json $R/packed_triton/sweep.json inline=dq_tma:1 \
      first=dq_tma:1,dq_first:1 writer=dq_tma:1,dq_writer:1 writer_first=dq_tma:1,dq_writer:1,dq_first:1 \
      prefetch=dq_tma:1,prefetch:1 prefetch_first=dq_tma:1,prefetch:1,dq_first:1 \
      both=dq_tma:1,dq_writer:1,prefetch:1 all=dq_tma:1,dq_writer:1,prefetch:1,dq_first:1 \
      > $R/packed_triton/sweep.txt 2>&1; el sweep $?
    timeout 140 python3 -m pytest -q -p no:cacheprovider -n 4 attention_test.py > $R/packed_triton/attention_test.txt 2>&1
    el "attention_test $(tail -1 $R/packed_triton/attention_test.txt)" $?
    timeout 100 python3 benchmark_kernels.py --kernel attention --json $R/packed_triton/bench_attention.json \
      > $R/packed_triton/bench_attention.txt 2>&1; el bench $?
  ) | tee -a $R/times.txt
  mv .triton .triton_off
fi
( source tools/device_env.sh $R/machine_triton >/dev/null
  timeout 80 python3 -m pytest -q -p no:cacheprovider -n 4 attention_test.py -k "hopper or one_document" \
    > $R/machine_triton/attention_test.txt 2>&1; el "hopper tests $(tail -1 $R/machine_triton/attention_test.txt)" $?
) | tee -a $R/times.txt
if [ -d .triton_off ]; then mv .triton_off .triton; fi
