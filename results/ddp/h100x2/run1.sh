#!/bin/bash
# 2 x H100 (asked for nvidia-h100-x2; stops at once if other GPUs came): 8B full fine-tuning 2 x 2,048 per GPU, one
# GPU alone against --ddp (the default for it) and --fsdp, then one GPU again.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
cat $R/gpus.txt
grep -q H100 $R/gpus.txt || { echo "not H100s: nothing run"; exit 0; }
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|FSDP: \|DDP: 2' $R/$1.txt | tr -s ' ' | cut -c1-160 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; }
one() { CUDA_VISIBLE_DEVICES=0 timeout 110 python3 finetune_optimized.py $common --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 130 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one_a
two ddp_a "--ddp"
save
two fsdp_a "--fsdp"
one one_b
save
