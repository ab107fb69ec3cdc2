#!/bin/bash
# 4 GPUs of one host: --ddp --ddp-shard-weights on 4, the committed code against two variants, alternating with one
# GPU alone: --ddp-gather-ahead 2, and 8 layers' whole gradients in flight instead of 2 (KFT_SW_IN_FLIGHT, a temporary
# environment switch of the code this call ran).
export PYTHONUNBUFFERED=1
R=/tmp/r5; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
cat $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-120 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r5.tgz -C /tmp r5; }
one() { CUDA_VISIBLE_DEVICES=0 timeout 110 python3 finetune_optimized.py $common --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
four() { timeout 170 torchrun --standalone --nproc-per-node 4 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one_a
four sw4 "--ddp --ddp-shard-weights"
KFT_SW_IN_FLIGHT=8 four sw4_if8 "--ddp --ddp-shard-weights"
save
four sw4_a2 "--ddp --ddp-shard-weights --ddp-gather-ahead 2"
one one_b
save
