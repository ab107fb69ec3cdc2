#!/bin/bash
# 2 x H100: 8B full 2 x 2,048 per GPU: one GPU, --ddp (in place), --fsdp; the same in FP8 tensorwise (one, --ddp);
# the DDP tests over NCCL. All files in one tarball.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/r
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|CUDA graphs:   on\|Parallel\|Error\|error\|passed\|failed' /tmp/r/$1.txt | tr -s ' ' | tr '\n' '|')" | tee -a /tmp/r/times.txt; }
save() { tar -czf $OUT/h100x2.tgz -C /tmp r; cp /tmp/r/times.txt $OUT/; }
nvidia-smi -L > /tmp/r/gpus.txt; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> /tmp/r/gpus.txt
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 finetune_optimized.py $common --json /tmp/r/one.json > /tmp/r/one.txt 2>&1; stamp one
timeout 130 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp $common --json /tmp/r/ddp.json > /tmp/r/ddp.txt 2>&1; stamp ddp; save
timeout 150 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp $common --json /tmp/r/fsdp.json > /tmp/r/fsdp.txt 2>&1; stamp fsdp; save
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 finetune_optimized.py $common --fp8 tensorwise --json /tmp/r/one_fp8.json > /tmp/r/one_fp8.txt 2>&1; stamp one_fp8; save
timeout 130 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp --fp8 tensorwise $common --json /tmp/r/ddp_fp8.json > /tmp/r/ddp_fp8.txt 2>&1; stamp ddp_fp8; save
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "ddp or averages or torchrun" > /tmp/r/pytest_ddp.txt 2>&1; stamp pytest_ddp; save
