#!/bin/bash
# --ddp-embedding-rows: 8B full 2 x 2048 per GPU, one GPU alone, the default (rows only) against the whole gradient,
# alternating; then the pieces tests over NCCL (the worker's rows outside a graph, the script's in the step's graph).
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed\|DDP:\|graphs: step' $R/$1.txt | tr -s ' ' | cut -c1-160 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi -L > $R/gpus.txt
one() { CUDA_VISIBLE_DEVICES=0 timeout 90 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 90 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one
two rows_a "--ddp"
two whole_a "--ddp --no-ddp-embedding-rows"
two rows_b "--ddp"
save
timeout 140 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "pieces_equal or shard_optimizer_matches" > $R/pytest_rows.txt 2>&1; stamp pytest_rows
save
