#!/bin/bash
# 2 GPUs of one host, the final code: the GPU tests of the changed kernel files, then 8B full fine-tuning 2 x 2,048
# per GPU with --fp8 tensorwise under --ddp (pieces), --ddp --ddp-shard-weights --gradient-checkpointing and --fsdp
# (FP8 gathers off: the fused down_proj runs on the gathered weights), 8 steps each.
export PYTHONUNBUFFERED=1
R=/tmp/h8c; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" > $R/versions.txt
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -p no:cacheprovider fp8_test.py swiglu_test.py > $R/pytest.txt 2>&1; tail -2 $R/pytest.txt | tee -a $R/times.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 8 --log-every 2 --fp8 tensorwise"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Custom swiglu\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-220 | tr '\n' '|')" | tee -a $R/times.txt; }
two() { timeout 150 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two ddp "--ddp"
two sw_gc "--ddp --ddp-shard-weights --gradient-checkpointing"
two fsdp "--fsdp --no-fsdp-fp8-gather"
tar -czf $OUT/h8c.tgz -C /tmp h8c
