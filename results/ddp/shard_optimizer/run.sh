#!/bin/bash
# 2 GPUs: 8B full fine-tuning, 2 x 2,048 tokens per GPU: one GPU alone, --ddp, --ddp --ddp-shard-optimizer,
# alternating; then FP8 with the pieces; then the DDP tests over NCCL and the FP8 / SwiGLU tests on GPU 0.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/r
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed' /tmp/r/$1.txt | tr -s ' ' | tr '\n' '|')" | tee -a /tmp/r/times.txt; }
save() { tar -czf $OUT/runs.tgz -C /tmp r; cp /tmp/r/times.txt $OUT/; }
nvidia-smi -L > /tmp/r/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" > /tmp/r/versions.txt
one() { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 finetune_optimized.py $common $2 --json /tmp/r/$1.json > /tmp/r/$1.txt 2>&1; stamp $1; }
two() { timeout 120 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp $common $2 --json /tmp/r/$1.json > /tmp/r/$1.txt 2>&1; stamp $1; }
one one_a
two ddp_a
two shard_a --ddp-shard-optimizer
save
one one_b
two shard_b --ddp-shard-optimizer
two ddp_b
save
two shard_fp8 "--ddp-shard-optimizer --fp8 tensorwise"
save
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "ddp or averages or pieces" > /tmp/r/pytest_ddp.txt 2>&1; stamp pytest_ddp; save
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -p no:cacheprovider fp8_test.py swiglu_test.py adamw_test.py > /tmp/r/pytest_fp8.txt 2>&1; stamp pytest_fp8; save
