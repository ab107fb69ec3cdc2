#!/bin/bash
# One H200, after call 2's three failures (kernel_ft/cuda_graphs.py still read plain_causal_attention from
# kernel_ft.models, which no longer imports it; now from swap_common): those tests, and the GPU suite's files
# neither call ran (tests/fsdp_test.py's gloo pairs left out: their code only changed its imports).
R=$OUT/c3
source tools/device_env.sh $R
t0=$(date +%s)
timeout 330 python3 -m pytest -v -p no:cacheprovider tests/cuda_graphs_test.py tests/profile_test.py \
  tests/memory_peak_test.py tests/benchmark_test.py tests/data_test.py > $R/pytest_gpu.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_gpu.txt)" | tee -a $R/times.txt
grep -E "FAILED|ERROR" $R/pytest_gpu.txt | head -20
tar -czf $OUT/c3.tgz -C $OUT c3 && rm -r $R
