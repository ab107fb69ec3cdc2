#!/bin/bash
# 2 GPUs, the second call: --ddp-shard-optimizer with its gathers paced (--ddp-gather-ahead), against --ddp and
# one GPU alone; then eager profiles of --ddp and of the pieces.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/r
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed\|NCCL  \|Wall time\|GPU busy' /tmp/r/$1.txt | tr -s ' ' | tr '\n' '|')" | tee -a /tmp/r/times.txt; }
save() { tar -czf $OUT/runs2.tgz -C /tmp r; cp /tmp/r/times.txt $OUT/; }
nvidia-smi -L > /tmp/r/gpus.txt
one() { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 finetune_optimized.py $common $2 --json /tmp/r/$1.json > /tmp/r/$1.txt 2>&1; stamp $1; }
two() { timeout 120 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp $common $2 --json /tmp/r/$1.json > /tmp/r/$1.txt 2>&1; stamp $1; }
one one
two ddp
two ahead1 "--ddp-shard-optimizer --ddp-gather-ahead 1"
two ahead2 "--ddp-shard-optimizer --ddp-gather-ahead 2"
two ahead4 "--ddp-shard-optimizer --ddp-gather-ahead 4"
two ahead0 "--ddp-shard-optimizer"
save
prof="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce --use-custom-adamw"
timeout 120 torchrun --standalone --nproc-per-node 2 profile_baseline.py --ddp $prof > /tmp/r/profile_ddp.txt 2>&1; stamp profile_ddp; save
timeout 120 torchrun --standalone --nproc-per-node 2 profile_baseline.py --ddp --ddp-shard-optimizer --ddp-gather-ahead 1 $prof > /tmp/r/profile_pieces.txt 2>&1; stamp profile_pieces; save
# The last profile stopped on its --trace-dir (the first profile's folder, other settings); it was rerun at once on
# the same machine with --trace-dir /tmp/tr: call2/profile_pieces.txt.
