#!/bin/bash
# 2 GPUs: does --fsdp --fp8 tensorwise resume exactly (FP8 gathers and bf16 gathers)? Then the FP8 layer's host time.
OUT=${OUT:-/tmp/c1}; W=/tmp/c1w; mkdir -p $OUT $W
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"; git rev-parse --short HEAD; date -u; } > $W/env.txt 2>&1
left() { echo $(( ${LIMIT:-560} - $(date +%s) + T0 )); }
losses() { python3 -c "import json;print(' '.join('%.6f'%v for v in json.load(open('$W/$1.json'))['losses']))" 2>/dev/null; }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s losses $(losses $1) $(grep -h 'FSDP FP8\|rror' $W/$1.txt | cut -c1-80 | tr '\n' ' ')" | tee -a $W/times.txt; tar czf $OUT/c1.tgz -C $W --exclude='ck_*' .; }
two() { local n=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
BASE="--tiny --fp8 tensorwise --dataset synthetic --steps 7 --log-every 1"
two g_run $BASE --fsdp-fp8-gather --output-dir $W/ck_g --save-every 2
two g_resumed $BASE --fsdp-fp8-gather --output-dir $W/ck_g2 --resume $W/ck_g/checkpoint-2
two g_run2 $BASE --fsdp-fp8-gather
two b_run $BASE --output-dir $W/ck_b --save-every 2
two b_resumed $BASE --output-dir $W/ck_b2 --resume $W/ck_b/checkpoint-2
CUDA_VISIBLE_DEVICES=0 timeout $(left) python3 .lab/host2.py > $W/host2.txt 2>&1; echo "host2 $(( $(date +%s) - T0 ))s" >> $W/times.txt
export CUDA_LAUNCH_BLOCKING=1
two gblk_run $BASE --fsdp-fp8-gather --output-dir $W/ck_gk --save-every 2
two gblk_resumed $BASE --fsdp-fp8-gather --output-dir $W/ck_gk2 --resume $W/ck_gk/checkpoint-2
