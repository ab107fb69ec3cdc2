#!/bin/bash
# --fp8 under --fsdp (8B full) and --ddp (8B LoRA) on 2 GPUs, and --fsdp in bf16 for the ratio. SMALL=1: CPU (refused).
OUT=${OUT:-/tmp/fp8par_out}; mkdir -p $OUT
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
N=${N:-2}
T0=$(date +%s)
left() { echo $(( ${LIMIT:-170} - $(date +%s) + T0 )); }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s $(grep -h 'Per GPU\|Average throughput\|Peak memory\|^error\|Error:' $OUT/$1.txt 2>/dev/null | head -6 | tr '\n' ' ')" | tee -a $OUT/times.txt; }
multi() { local name=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node $N finetune_optimized.py "$@" --json $OUT/$name.json > $OUT/$name.txt 2>&1; stamp $name; }
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpus.txt 2>&1
FULL="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --warmup-steps 3 --steps 6"
multi full_fsdp${N}_fp8 $FULL --fsdp --fp8 tensorwise
multi lora_ddp${N}_fp8 --random-init --lora --dataset synthetic --batch-size 4 --seq-len 2048 --warmup-steps 3 --steps 6 --ddp --fp8 rowwise
multi full_fsdp${N}_bf16 $FULL --fsdp
