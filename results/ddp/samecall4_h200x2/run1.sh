#!/bin/bash
# Asked for 2 x H100 (never lent so far); 2 x H200 came. 8B full fine-tuning 2 x 2,048 per GPU, one GPU alone
# against --ddp (the default for it) and --fsdp (its auto reduction, then bf16 named), alternating.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed\|DDP:\|FSDP: \|Parallel:' $R/$1.txt | tr -s ' ' | cut -c1-180 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
cat $R/gpus.txt
one() { CUDA_VISIBLE_DEVICES=0 timeout 110 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 130 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one_a
two ddp_a "--ddp"
two fsdp_a "--fsdp"
save
two fsdp_bf16_a "--fsdp --fsdp-reduce-dtype bfloat16"
one one_b
two ddp_b "--ddp"
save
