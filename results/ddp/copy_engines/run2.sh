#!/bin/bash
# The pieces' all-gathers by the copy engines (the split weights in NCCL's symmetric windows, zero-CTA policy):
# the GPU tests of the pieces, then 8B full 2 x 2048 per GPU on 1, 2 and 4 GPUs, with and without the copy engines.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed\|DDP:\|CUDA graphs:' $R/$1.txt | tr -s ' ' | cut -c1-200 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi -L > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" > $R/versions.txt
git rev-parse --short HEAD > $R/commit.txt 2>&1
one() { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
many() { local n=$1; shift; timeout 120 torchrun --standalone --nproc-per-node $n finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "pieces or shard_optimizer" > $R/pytest_pieces.txt 2>&1; stamp pytest_pieces
save
one one
CUDA_VISIBLE_DEVICES=0,1 many 2 ce2 "--ddp"
CUDA_VISIBLE_DEVICES=0,1 many 2 sm2 "--ddp --no-ddp-copy-engines"
many 4 ce4 "--ddp"
many 4 sm4 "--ddp --no-ddp-copy-engines"
save
many 4 ce4_ahead0 "--ddp --ddp-gather-ahead 0"
CUDA_VISIBLE_DEVICES=0,1 many 2 ce2_b "--ddp"
save
# Evaluations between the steps (the step after each was slower in the first call): every step's time, both ways.
CUDA_VISIBLE_DEVICES=0,1 many 2 ce2_eval "--ddp --eval-every 4 --log-every 1"
CUDA_VISIBLE_DEVICES=0,1 many 2 ar2_eval "--ddp --no-ddp-shard-optimizer --eval-every 4 --log-every 1"
save
