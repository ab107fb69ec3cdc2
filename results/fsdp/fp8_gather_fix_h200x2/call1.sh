#!/bin/bash
# 2 GPUs: does --fsdp --fp8 tensorwise resume exactly (FP8 gathers and bf16 gathers)? Then the FP8 layer's host time.
NAME=c1 LIMIT=560 KEEP=0
source "$(dirname "$0")/lib.sh"
resumed g_run g_resumed --fsdp-fp8-gather
two g_run2 $TINY --fsdp-fp8-gather
resumed b_run b_resumed
# (here a scratch timing of one FP8 layer ran on GPU 0; not kept: its loop timed the GPU, not the host)
export CUDA_LAUNCH_BLOCKING=1
resumed gblk_run gblk_resumed --fsdp-fp8-gather
