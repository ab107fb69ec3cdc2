#!/bin/bash
# 2 GPUs, 8B full, --ddp --grad-accum 4 --batch-size 1 (4 x 2,048 tokens per GPU per step): this code (one average per
# step) against DistributedDataParallel (an all-reduce per micro-batch, the code before).
export PYTHONUNBUFFERED=1
mkdir -p /tmp/r
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 1 --grad-accum 4 --seq-len 2048 --steps 8 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error' /tmp/r/$1.txt | tr -s ' ' | tr '\n' '|')" | tee -a /tmp/r/times.txt; }
save() { tar -czf $OUT/accum.tgz -C /tmp r; cp /tmp/r/times.txt $OUT/; }
timeout 100 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp $common --json /tmp/r/new.json > /tmp/r/new.txt 2>&1; stamp new; save
(cd .lab/old && timeout 110 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp $common --json /tmp/r/old.json > /tmp/r/old.txt 2>&1); stamp old; save
