#!/bin/bash
# The same warm 2-GPU machine as run1.sh: variants of --ddp-shard-weights, alternating with one GPU and --ddp.
# KFT_SW_KEEP_FIRST (1: the first ahead + 1 layers kept whole, gathered in the optimizer step as --ddp's pieces are;
# 0: every layer released) and KFT_SW_IN_FLIGHT (whole gradients alive, in layers) were temporary switches of the
# code this call ran; then an eager profile of rank 0.
export PYTHONUNBUFFERED=1
R=/tmp/r2; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv > $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|shard-weights: ' $R/$1.txt | tr -s ' ' | cut -c1-120 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r2.tgz -C /tmp r2; }
one() { CUDA_VISIBLE_DEVICES=0 timeout 110 python3 finetune_optimized.py $common --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 150 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one_c
KFT_SW_KEEP_FIRST=1 two sw_keep "--ddp --ddp-shard-weights"
KFT_SW_KEEP_FIRST=0 two sw_nokeep "--ddp --ddp-shard-weights"
KFT_SW_IN_FLIGHT=4 two sw_keep_if4 "--ddp --ddp-shard-weights"
two sw_keep_a2 "--ddp --ddp-shard-weights --ddp-gather-ahead 2"
save
two ddp_b "--ddp"
one one_d
save
timeout 150 torchrun --standalone --nproc-per-node 2 profile_baseline.py --ddp --ddp-shard-weights --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce --use-custom-adamw > $R/profile_sw.txt 2>&1
echo "profile $(( $(date +%s) - t0 ))s"; tail -2 $R/profile_sw.txt
save
