#!/bin/bash
# 2 GPUs, FP8Shard without its Python layer: resume + bits (tiny), 8B FP8 vs bf16 gathers alternating, a profile, the FP8 GPU tests.
NAME=c5 LIMIT=570 KEEP=4
source "$(dirname "$0")/lib.sh"
resumed tiny_fp8gather tiny_fp8gather_resumed
two tiny_bf16gather $TINY --no-fsdp-fp8-gather
rm -rf $W/ck_*
alternate_8b
K="--use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce --use-custom-adamw"
timeout $(left) torchrun --standalone --nproc-per-node 2 profile_baseline.py --fsdp --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --fp8 tensorwise $K --trace-dir /tmp/tr_g > $W/profile_fp8gather.txt 2>&1; stamp profile_fp8gather
CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider fp8_test.py > $W/pytest_fp8_gpu.txt 2>&1; echo "pytest fp8_test $(tail -1 $W/pytest_fp8_gpu.txt)" | tee -a $W/times.txt; tar czf $OUT/c5.tgz -C $W --exclude='ck_*' .
