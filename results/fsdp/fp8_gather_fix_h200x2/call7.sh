#!/bin/bash
# 2 GPUs: the FP8-gathered weight saved for backward (W8^T made there): 8B LoRA (default) and 8B full --fsdp-fp8-gather, memory and speed.
NAME=c7 LIMIT=200 KEEP=3
source "$(dirname "$0")/lib.sh"
two lora_fp8 --random-init --lora --dataset synthetic --batch-size 4 --seq-len 2048 --steps 12 --log-every 4 --fp8 tensorwise
two full_fp8gather --random-init --fp8 tensorwise --fsdp-fp8-gather --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4
