#!/bin/bash
# 4 GPUs of one host: 8B full fine-tuning 2 x 2,048 per GPU, alternating one GPU alone, --ddp --ddp-shard-weights
# on 4 and --ddp on 4.
export PYTHONUNBUFFERED=1
R=/tmp/r4; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
cat $R/gpus.txt; git log --oneline -1 >> $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|shard-weights: ' $R/$1.txt | tr -s ' ' | cut -c1-120 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r4.tgz -C /tmp r4; }
one() { CUDA_VISIBLE_DEVICES=0 timeout 110 python3 finetune_optimized.py $common --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
four() { timeout 170 torchrun --standalone --nproc-per-node 4 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one_a
four sw4_a "--ddp --ddp-shard-weights"
save
four ddp4_a "--ddp"
one one_b
four sw4_b "--ddp --ddp-shard-weights"
save
