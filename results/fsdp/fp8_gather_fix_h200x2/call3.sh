#!/bin/bash
# 2 GPUs, 8B full --fsdp --fp8 tensorwise: FP8 gathers against bf16 gathers, alternating, then a profile of each.
NAME=c3 LIMIT=570 KEEP=3
source "$(dirname "$0")/lib.sh"
alternate_8b
K="--use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce --use-custom-adamw"
for g in fsdp-fp8-gather no-fsdp-fp8-gather; do
  timeout $(left) torchrun --standalone --nproc-per-node 2 profile_baseline.py --fsdp --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --fp8 tensorwise --$g $K > $W/profile_$g.txt 2>&1; stamp profile_$g
done
