#!/bin/bash
# 2 GPUs, the committed code (12255c6): the NCCL tests of --ddp, its pieces and --ddp-shard-weights (the uneven
# backward included), then 8B full fine-tuning 2 x 2,048 per GPU, alternating one GPU alone, --ddp --ddp-shard-weights
# and --ddp.
export PYTHONUNBUFFERED=1
R=/tmp/r7; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
cat $R/gpus.txt; git log --oneline -1 >> $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|shard-weights: ' $R/$1.txt | tr -s ' ' | cut -c1-120 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r7.tgz -C /tmp r7; }
one() { CUDA_VISIBLE_DEVICES=0 timeout 110 python3 finetune_optimized.py $common --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 150 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "pieces_equal or shard_weights or shard_optimizer_matches or in_place or nccl or gpus" > $R/pytest_nccl.txt 2>&1
tail -3 $R/pytest_nccl.txt; echo "pytest $(( $(date +%s) - t0 ))s"
save
one one_a
two sw_a "--ddp --ddp-shard-weights"
two ddp_a "--ddp"
one one_b
two sw_b "--ddp --ddp-shard-weights"
two ddp_b "--ddp"
save
