#!/bin/bash
# FSDP + FP8 gathered in FP8: a tiny smoke run, then 8B full (gather on / off, alternating) and 8B LoRA (fp8 gathered vs bf16).
OUT=${OUT:-/tmp/fp8g}; W=/tmp/fp8gw; mkdir -p $OUT $W
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'nccl', torch.cuda.nccl.version())"
  date -u +%F; } > $W/env.txt 2>&1
T0=$(date +%s)
left() { echo $(( ${LIMIT:-570} - $(date +%s) + T0 )); }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s $(grep -h 'Per GPU\|Average throughput\|Peak memory\|FSDP FP8\|rror' $W/$1.txt 2>/dev/null | cut -c1-160 | tr '\n' ' ')" | tee -a $W/times.txt; tar czf $OUT/fp8g.tgz -C $W .; }
two() { local n=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
two tiny_gather --tiny --fp8 tensorwise --dataset synthetic --steps 4
grep -q "FSDP FP8" $W/tiny_gather.txt || { tail -30 $W/tiny_gather.txt; exit 1; }
FULL="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --warmup-steps 4 --steps 12 --log-every 1 --fp8 tensorwise"
LORA="--random-init --lora --dataset synthetic --batch-size 4 --seq-len 2048 --warmup-steps 4 --steps 12 --log-every 4"
two full_gather $FULL
two full_bf16gather $FULL --no-fsdp-fp8-gather
two lora_fp8_gather $LORA --fp8 tensorwise
two full_gather2 $FULL
two lora_bf16 $LORA
two full_bf16gather2 $FULL --no-fsdp-fp8-gather
