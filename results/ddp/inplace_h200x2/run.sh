#!/bin/bash
# 2 GPUs: 8B full 2 x 2,048 per GPU, one GPU alone, then --ddp new / old (DistributedDataParallel) / new,
# 8B LoRA new, a profile of the new --ddp step, the DDP tests over NCCL. All files in one tarball.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/r
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|CUDA graphs:   on\|Parallel\|Error\|error' /tmp/r/$1.txt | tr -s ' ' | tr '\n' '|')" | tee -a /tmp/r/times.txt; }
save() { tar -czf $OUT/ddp.tgz -C /tmp r; cp /tmp/r/times.txt $OUT/; }
nvidia-smi -L > /tmp/r/gpus.txt; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> /tmp/r/gpus.txt
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 finetune_optimized.py $common --json /tmp/r/one.json > /tmp/r/one.txt 2>&1; stamp one
timeout 150 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp $common --json /tmp/r/new1.json > /tmp/r/new1.txt 2>&1; stamp new1; save
(cd .lab/old && timeout 170 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp $common --json /tmp/r/old.json > /tmp/r/old.txt 2>&1); stamp old; save
timeout 150 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp $common --json /tmp/r/new2.json > /tmp/r/new2.txt 2>&1; stamp new2; save
timeout 150 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp --random-init --dataset synthetic --lora --batch-size 4 --seq-len 2048 --steps 12 --log-every 4 --json /tmp/r/lora_new.json > /tmp/r/lora_new.txt 2>&1; stamp lora_new; save
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "ddp or averages or torchrun" > /tmp/r/pytest_ddp.txt 2>&1; stamp pytest_ddp; save
timeout 120 torchrun --standalone --nproc-per-node 2 profile_baseline.py --ddp --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce --use-custom-adamw > /tmp/r/profile_ddp.txt 2>&1; stamp profile_ddp; save
