#!/bin/bash
# 2 GPUs: the W8^T tile transpose (tests, speed), then 8B full --fsdp --fp8 tensorwise, FP8 gathers vs bf16 gathers alternating, and a profile.
NAME=c4 LIMIT=570 KEEP=3
source "$(dirname "$0")/lib.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "transpose or gathered_fp8 or fp8_layers" > $W/pytest_gpu.txt 2>&1; echo "pytest $(tail -1 $W/pytest_gpu.txt)" | tee -a $W/times.txt
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 results/fsdp/fp8_gather_fix_h200x2/tbench.py > $W/transpose_bench.txt 2>&1; cat $W/transpose_bench.txt
alternate_8b
K="--use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce --use-custom-adamw"
for g in fsdp-fp8-gather no-fsdp-fp8-gather; do
  timeout $(left) torchrun --standalone --nproc-per-node 2 profile_baseline.py --fsdp --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --fp8 tensorwise --$g $K --trace-dir /tmp/tr_$g > $W/profile_$g.txt 2>&1; stamp profile_$g
done
