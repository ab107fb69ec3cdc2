#!/bin/bash
# Call 2: NCCL's streams at high priority (TORCH_NCCL_HIGH_PRIORITY=1), so that a reduce-scatter's blocks are
# scheduled before the next matmul's when SMs free up: tools/comm_overlap.py both ways, then the default --ddp on
# 8B both ways against one GPU, alternating.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed\|graphs: step' $R/$1.txt | tr -s ' ' | cut -c1-160 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi -L > $R/gpus.txt
timeout 80 torchrun --standalone --nproc-per-node 2 tools/comm_overlap.py --memory plain --json $R/ov_plain.json > $R/ov_plain.txt 2>&1; stamp ov_plain
TORCH_NCCL_HIGH_PRIORITY=1 timeout 80 torchrun --standalone --nproc-per-node 2 tools/comm_overlap.py --memory plain --json $R/ov_plain_hp.json > $R/ov_plain_hp.txt 2>&1; stamp ov_plain_hp
save
one() { CUDA_VISIBLE_DEVICES=0 timeout 90 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 90 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one_a
two ddp_a "--ddp"
TORCH_NCCL_HIGH_PRIORITY=1 two hp_a "--ddp"
one one_b
TORCH_NCCL_HIGH_PRIORITY=1 two hp_b "--ddp"
two ddp_b "--ddp"
save
