#!/bin/bash
# 2 GPUs, after the fix (a trained weight's FP8 cast was kept across gathers): resume and bits, tiny; the GPU tests; 8B bits and memory.
NAME=c2 LIMIT=570 KEEP=0
source "$(dirname "$0")/lib.sh"
resumed g_run g_resumed
two b_run $TINY --no-fsdp-fp8-gather
resumed l_run l_resumed --lora
rm -rf $W/ck_*
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "fp8" > $W/pytest_fp8_gather.txt 2>&1; echo "pytest fp8 $(tail -1 $W/pytest_fp8_gather.txt)" | tee -a $W/times.txt
E8="--random-init --fp8 tensorwise --dataset synthetic --batch-size 2 --seq-len 2048 --steps 10 --log-every 2"
two e8_gather $E8
two e8_bf16gather $E8 --no-fsdp-fp8-gather
