#!/bin/bash
# One call: the TMA-reduction backward under a packed Triton 3.9, then the Hopper tests under the machine's Triton.
set -u
R=$1; t0=$(date +%s)
el() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s"; }
( source tools/device_env.sh $R/triton39 >/dev/null
  timeout 130 python3 results/attention/gluon_backward/sweep.py --json $R/triton39/sweep.json tma=dq_tma:1 \
    atomics=dq_tma:0 > $R/triton39/sweep.txt 2>&1; el sweep $?
  timeout 100 python3 -m pytest -q -p no:cacheprovider -n 4 attention_test.py -k "hopper or one_document" \
    > $R/triton39/attention_test.txt 2>&1; el "hopper tests $(tail -1 $R/triton39/attention_test.txt)" $?
  timeout 200 python3 -c "
import sys, attention_kernel as a, benchmark_kernels as b
a.USE_HOPPER_BACKWARD = True
b.main(['--kernel', 'attention', '--json', '$R/triton39/bench_attention_bwd_on.json'])
" > $R/triton39/bench_attention_bwd_on.txt 2>&1; el bench $?
) | tee -a $R/times.txt
mv .triton .triton_off
( source tools/device_env.sh $R/machine_triton >/dev/null
  timeout 90 python3 -m pytest -q -p no:cacheprovider -n 4 attention_test.py -k "hopper or one_document" \
    > $R/machine_triton/attention_test.txt 2>&1; el "hopper tests 3.6 $(tail -1 $R/machine_triton/attention_test.txt)" $?
) | tee -a $R/times.txt
mv .triton_off .triton
