#!/bin/bash
# 2 GPUs, the final code: --ddp now splits by default (gathers one layer ahead, the first ones during the
# optimizer step); against --no-ddp-shard-optimizer and one GPU alone, alternating; torchrun with neither flag;
# FP8 with and without the pieces; then the script-level pieces test over NCCL.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/r
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed\|DDP:\|Parallel:' /tmp/r/$1.txt | tr -s ' ' | cut -c1-160 | tr '\n' '|')" | tee -a /tmp/r/times.txt; }
save() { tar -czf $OUT/runs4.tgz -C /tmp r; cp /tmp/r/times.txt $OUT/; }
nvidia-smi -L > /tmp/r/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" > /tmp/r/versions.txt
one() { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 finetune_optimized.py $common $2 --json /tmp/r/$1.json > /tmp/r/$1.txt 2>&1; stamp $1; }
two() { timeout 120 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json /tmp/r/$1.json > /tmp/r/$1.txt 2>&1; stamp $1; }
one one
two pieces_a --ddp
two whole_a "--ddp --no-ddp-shard-optimizer"
two chosen ""
two whole_b "--ddp --no-ddp-shard-optimizer"
two pieces_b --ddp
save
two fp8_whole "--ddp --fp8 tensorwise"
two fp8_pieces "--ddp --fp8 tensorwise --ddp-shard-optimizer"
save
timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:xdist tests/fsdp_test.py -k "shard_optimizer_matches" > /tmp/r/pytest_pieces.txt 2>&1; stamp pytest_pieces; save
# The pytest line stopped on `-p no:xdist` (pytest.ini passes --dist); rerun at once on the same machine without it
# and with the worker test: the worker failed there (its CPU model needed the Triton interpreter; it now runs over
# NCCL on two GPUs: call4/pytest_pieces_first_try.txt), the script test passed; after the fix, on a fresh 2 x H200
# machine: `pytest tests/fsdp_test.py -k pieces_equal`, 1 passed (call4/pytest_pieces_worker.txt).
