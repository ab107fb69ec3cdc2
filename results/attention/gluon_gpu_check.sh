#!/bin/bash
# The GPU checks of the Gluon attention kernels, in one call on an H100 / H200 (about 6 minutes):
#   bash results/attention/gluon_gpu_check.sh OUTDIR
# the forward (attention_hopper_kernel.py) against float64 and timed against the Triton forward and cuDNN, the
# backward probe (gluon_backward/) the same way, then attention_test.py (its Hopper test switches the forward on).
set -u
R=${1:?OUTDIR}
source tools/device_env.sh $R
t0=$(date +%s)
timeout 170 python3 results/attention/gluon_forward/check_bench.py --json $R/gluon_forward.json > $R/gluon_forward.txt 2>&1
echo "forward rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
timeout 150 python3 results/attention/gluon_backward/check_bench.py --json $R/gluon_backward.json > $R/gluon_backward.txt 2>&1
echo "backward rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 4 attention_test.py > $R/attention_test.txt 2>&1
echo "attention_test rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/attention_test.txt)" | tee -a $R/times.txt
