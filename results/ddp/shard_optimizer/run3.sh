#!/bin/bash
# 2 GPUs, the third call (the same machine, warm, after run2.sh): the pieces gathered one or two layers ahead, in
# the step's CUDA graph and eagerly (--no-cuda-graphs), against --ddp both ways and one GPU alone.
export PYTHONUNBUFFERED=1; mkdir -p /tmp/r; t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error' /tmp/r/$1.txt | tr -s ' ' | tr '\n' '|')" | tee -a /tmp/r/times3.txt; }
one() { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 finetune_optimized.py $common $2 --json /tmp/r/$1.json > /tmp/r/$1.txt 2>&1; stamp $1; }
two() { timeout 120 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp $common $2 --json /tmp/r/$1.json > /tmp/r/$1.txt 2>&1; stamp $1; }
one c3_one
two c3_ahead1_eager "--ddp-shard-optimizer --ddp-gather-ahead 1 --no-cuda-graphs"
two c3_ahead1 "--ddp-shard-optimizer --ddp-gather-ahead 1"
two c3_ddp_eager "--no-cuda-graphs"
two c3_ahead2_eager "--ddp-shard-optimizer --ddp-gather-ahead 2 --no-cuda-graphs"
two c3_ddp
cd /tmp && tar -czf $OUT/call3.tgz r/c3_* r/times3.txt
