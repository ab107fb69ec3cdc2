#!/bin/bash
# The GPU checks of the Gluon attention kernels, in one call on an H100 / H200 (at most 9 minutes):
#   bash results/attention/gluon_gpu_check.sh OUTDIR
# Under the machine's Triton: the forward (attention_hopper_kernel.py) against float64 and timed against the Triton
# forward and cuDNN, the backward the same way (dQ by atomics before Triton 3.8), attention_test.py's Hopper tests.
# Then, if .triton/ holds a packed Triton 3.9 (tools/pack_triton.sh), the backward with TMA reductions against
# atomics (sweep.py) and the Hopper tests again under it.
set -u
R=${1:?OUTDIR}
t0=$(date +%s)
packed=0; if [ -d .triton ]; then mv .triton .triton_off; packed=1; fi
( source tools/device_env.sh $R/machine_triton >/dev/null
  timeout 130 python3 results/attention/gluon_forward/check_bench.py --json $R/machine_triton/gluon_forward.json \
    > $R/machine_triton/gluon_forward.txt 2>&1
  echo "forward rc=$? $(( $(date +%s) - t0 ))s"
  timeout 80 python3 results/attention/gluon_backward/sweep.py --json $R/machine_triton/gluon_backward.json gluon= \
    > $R/machine_triton/gluon_backward.txt 2>&1
  echo "backward rc=$? $(( $(date +%s) - t0 ))s"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -n 4 attention_test.py -k "hopper or one_document" \
    > $R/machine_triton/attention_test.txt 2>&1
  echo "attention_test rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/machine_triton/attention_test.txt)"
) | tee -a $R/times.txt
if [ $packed = 1 ]; then
  mv .triton_off .triton
  ( source tools/device_env.sh $R/triton39 >/dev/null
    timeout 120 python3 results/attention/gluon_backward/sweep.py --json $R/triton39/sweep.json tma=dq_tma:1 \
      atomics=dq_tma:0 > $R/triton39/sweep.txt 2>&1
    echo "sweep 3.9 rc=$? $(( $(date +%s) - t0 ))s"
    timeout 90 python3 -m pytest -q -p no:cacheprovider -n 4 attention_test.py -k "hopper or one_document" \
      > $R/triton39/attention_test.txt 2>&1
    echo "attention_test 3.9 rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/triton39/attention_test.txt)"
  ) | tee -a $R/times.txt
fi
