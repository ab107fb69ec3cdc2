#!/bin/bash
# 4 GPUs: 8B full 2 x 2,048 per GPU: one GPU alone, --ddp (in place), --fsdp (float32 reduction, the default over 4),
# --fsdp --fsdp-reduce-dtype bfloat16. All files in one tarball.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/r
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|CUDA graphs:   on\|Parallel\|FSDP:  \|Error\|error\|passed\|failed' /tmp/r/$1.txt | tr -s ' ' | tr '\n' '|')" | tee -a /tmp/r/times.txt; }
save() { tar -czf $OUT/four.tgz -C /tmp r; cp /tmp/r/times.txt $OUT/; }
nvidia-smi -L > /tmp/r/gpus.txt; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> /tmp/r/gpus.txt
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 finetune_optimized.py $common --json /tmp/r/one.json > /tmp/r/one.txt 2>&1; stamp one
timeout 150 torchrun --standalone --nproc-per-node 4 finetune_optimized.py --ddp $common --json /tmp/r/ddp4.json > /tmp/r/ddp4.txt 2>&1; stamp ddp4; save
timeout 170 torchrun --standalone --nproc-per-node 4 finetune_optimized.py --fsdp $common --json /tmp/r/fsdp4.json > /tmp/r/fsdp4.txt 2>&1; stamp fsdp4; save
timeout 170 torchrun --standalone --nproc-per-node 4 finetune_optimized.py --fsdp --fsdp-reduce-dtype bfloat16 $common --json /tmp/r/fsdp4_bf16.json > /tmp/r/fsdp4_bf16.txt 2>&1; stamp fsdp4_bf16; save
