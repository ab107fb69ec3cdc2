#!/bin/bash
# One H200: the GPU tests of the files the recomputations and the swap_common.py move touched, then the longest
# LoRA sequence that trains at batch 1 with every kernel (tools/max_seq_len.py; 27,648 tokens before).
R=$OUT/c2
source tools/device_env.sh $R
t0=$(date +%s)
timeout 420 python3 -m pytest -q -p no:cacheprovider swiglu_test.py lora_test.py rmsnorm_test.py projections_test.py \
  swap_common_test.py tests/apply_test.py tests/cuda_graphs_test.py tests/compile_test.py tests/profile_test.py \
  > $R/pytest_gpu.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_gpu.txt)" | tee -a $R/times.txt
grep -E "FAILED|ERROR" $R/pytest_gpu.txt | head -20
left=$(( 570 - ($(date +%s) - t0) ))
timeout $left python3 tools/max_seq_len.py --random-init --all-kernels --lora --json $R/maxseq_lora.json \
  > $R/maxseq_lora.txt 2>&1
echo "maxseq rc=$? $(( $(date +%s) - t0 ))s $(tail -2 $R/maxseq_lora.txt | tr '\n' '|')" | tee -a $R/times.txt
tar -czf $OUT/c2.tgz -C $OUT c2 && rm -r $R
