#!/bin/bash
# Can FSDP2's step be one CUDA graph? --fsdp 8B full 2 x 2048 per GPU, eager (the default) against the step
# captured (KFT_FSDP_GRAPHS=1 lifts the refusal), one GPU alone first; the losses of both printed every 4 steps.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|CUDA graphs\|FSDP: \|note' $R/$1.txt | tr -s ' ' | cut -c1-200 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi -L > $R/gpus.txt
one() { CUDA_VISIBLE_DEVICES=0 timeout 90 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 120 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one_a
KFT_FSDP_GRAPHS=1 two graphs_a "--fsdp"
two eager_a "--fsdp"
save
KFT_FSDP_GRAPHS=1 two graphs_b "--fsdp"
one one_b
save
