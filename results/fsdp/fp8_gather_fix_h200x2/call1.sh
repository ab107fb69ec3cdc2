#!/bin/bash
# 2 GPUs: does --fsdp --fp8 tensorwise resume exactly (FP8 gathers and bf16 gathers)? Then the FP8 layer's host time.
NAME=c1 LIMIT=560 KEEP=0
source "$(dirname "$0")/lib.sh"
BASE="--tiny --fp8 tensorwise --dataset synthetic --steps 7 --log-every 1"
two g_run $BASE --fsdp-fp8-gather --output-dir $W/ck_g --save-every 2
two g_resumed $BASE --fsdp-fp8-gather --output-dir $W/ck_g2 --resume $W/ck_g/checkpoint-2
two g_run2 $BASE --fsdp-fp8-gather
two b_run $BASE --output-dir $W/ck_b --save-every 2
two b_resumed $BASE --output-dir $W/ck_b2 --resume $W/ck_b/checkpoint-2
# (here a scratch timing of one FP8 layer ran on GPU 0; not kept: its loop timed the GPU, not the host)
export CUDA_LAUNCH_BLOCKING=1
two gblk_run $BASE --fsdp-fp8-gather --output-dir $W/ck_gk --save-every 2
two gblk_resumed $BASE --fsdp-fp8-gather --output-dir $W/ck_gk2 --resume $W/ck_gk/checkpoint-2
