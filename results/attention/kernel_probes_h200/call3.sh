#!/bin/bash
source tools/device_env.sh $OUT
timeout 400 python3 results/attention/kernel_probes_h200/sweep.py 2>&1 | grep -v Warn | tee $OUT/sweep.txt
