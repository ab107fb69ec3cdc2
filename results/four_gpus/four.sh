#!/bin/bash
# Four GPUs: 70B LoRA r16 (FSDP), then 8B full 2 x 2048 per GPU on 4, 1 and 2 GPUs.
# SMALL=1: the tiny model on the CPU, to check the commands.
OUT=${OUT:-/tmp/four_out}; mkdir -p $OUT
N=${N:-4}
if [ -n "$SMALL" ]; then M8="--tiny"; M70="--tiny"; SEQ=16; else M8="--random-init"; M70="--model meta-llama/Llama-3.1-70B --random-init"; SEQ=2048; fi
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpus.txt 2>&1
T0=$(date +%s)
stamp() { echo "$1 $(( $(date +%s) - T0 ))s" >> $OUT/times.txt; }
tr() { torchrun --standalone --nproc-per-node $1 finetune_optimized.py --fsdp "${@:2}"; }
COMMON="--dataset synthetic --seq-len $SEQ --warmup-steps 3 --steps 6"
tr $N $M70 --lora --lora-r 16 --gradient-checkpointing --dataset synthetic --batch-size 1 --seq-len $SEQ --warmup-steps 1 --steps 4 --json $OUT/lora70b_fsdp$N.json > $OUT/lora70b_fsdp$N.txt 2>&1; stamp lora70b
tr $N $M8 $COMMON --batch-size 2 --json $OUT/full8b_fsdp$N.json > $OUT/full8b_fsdp$N.txt 2>&1; stamp fsdp$N
CUDA_VISIBLE_DEVICES=0 python finetune_optimized.py $M8 $COMMON --batch-size 2 --json $OUT/full8b_one.json > $OUT/full8b_one.txt 2>&1; stamp one
CUDA_VISIBLE_DEVICES=0,1 tr 2 $M8 $COMMON --batch-size 2 --json $OUT/full8b_fsdp2.json > $OUT/full8b_fsdp2.txt 2>&1; stamp fsdp2
