#!/bin/bash
source tools/device_env.sh $OUT
timeout 500 python3 results/attention/kernel_probes_h200/bench_t.py 2>&1 | tee $OUT/bench_t.txt
