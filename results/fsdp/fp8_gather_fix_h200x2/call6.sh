#!/bin/bash
# 2 GPUs: 8B LoRA r16 under FSDP, --fp8 tensorwise (gathered in FP8: the default with --lora) against bf16, alternating.
NAME=c6 LIMIT=240 KEEP=3
source "$(dirname "$0")/lib.sh"
L="--random-init --lora --dataset synthetic --batch-size 4 --seq-len 2048 --steps 12 --log-every 4"
two lora_fp8 $L --fp8 tensorwise
two lora_bf16 $L
two lora_fp8_2 $L --fp8 tensorwise
