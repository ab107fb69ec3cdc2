#!/bin/bash
# 2 GPUs, the final --ddp code: 8B full 2 x 2,048 per GPU, one GPU alone then --ddp; the DDP tests over NCCL and the
# vocabulary tests on the GPU.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/r
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed' /tmp/r/$1.txt | tr -s ' ' | tr '\n' '|')" | tee -a /tmp/r/times.txt; }
save() { tar -czf $OUT/final.tgz -C /tmp r; cp /tmp/r/times.txt $OUT/; }
nvidia-smi -L > /tmp/r/gpus.txt
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 finetune_optimized.py $common --json /tmp/r/one.json > /tmp/r/one.txt 2>&1; stamp one
timeout 100 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp $common --json /tmp/r/ddp.json > /tmp/r/ddp.txt 2>&1; stamp ddp; save
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "ddp or averages" tests/families_test.py kernel_common_test.py -k "ddp or averages or fuyu or vocabulary" > /tmp/r/pytest.txt 2>&1; stamp pytest; save
