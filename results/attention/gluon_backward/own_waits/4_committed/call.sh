#!/bin/bash
# H100, Triton 3.9.0 + its ptxas 13.4: the committed backward (own waits, ptxas's allocation, packed rows interleaved):
# checked and timed by sweep.py (default only), benchmark_kernels attention, the Hopper tests.
set -u
R=$OUT/final; mkdir -p $R; t0=$(date +%s)
el() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt; }
source tools/device_env.sh $R >/dev/null
timeout 100 python3 results/attention/gluon_backward/sweep.py --rounds 3 --json $R/sweep.json default= > $R/sweep.txt 2>&1
el sweep $?; grep -c " ok$" $R/sweep.txt; grep -c FAIL $R/sweep.txt
grep -A4 "^T=" $R/sweep.txt | grep -v "^--" | head -40
timeout 170 python3 benchmark_kernels.py --kernel attention --json $R/bench_attention.json > $R/bench_attention.txt 2>&1
el bench $?
grep -A22 "^8,192 in 1 doc" $R/bench_attention.txt | grep -v "n/a (mask)" | cut -c1-175
timeout 120 python3 -m pytest -q -x attention_test.py -k hopper > $R/hopper_tests.txt 2>&1; el hopper_tests $?
grep -a "passed\|failed" $R/hopper_tests.txt | tail -2
cd $OUT && tar czf final.tgz final && rm -rf final
