#!/bin/bash
set -u
R=$1; t0=$(date +%s)
source tools/device_env.sh $R >/dev/null
timeout 60 python3 results/attention/gluon_h100/backward_order/3_repeat/forward_16k.py 2>&1 | grep "^T=" | tee $R/forward_16k.txt
timeout 100 python3 benchmark_kernels.py --kernel attention --json $R/bench_attention.json > $R/bench_attention.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 ))s"; grep -A4 "^8,192 in 1 doc" $R/bench_attention.txt | cut -c1-110
