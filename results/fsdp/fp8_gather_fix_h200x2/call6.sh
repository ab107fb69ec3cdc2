#!/bin/bash
# 2 GPUs: 8B LoRA r16 under FSDP, --fp8 tensorwise (gathered in FP8: the default with --lora) against bf16, alternating.
OUT=${OUT:-/tmp/c6}; W=/tmp/c6w; mkdir -p $OUT $W
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"; date -u; } > $W/env.txt 2>&1
left() { echo $(( ${LIMIT:-240} - $(date +%s) + T0 )); }
losses() { python3 -c "import json;d=json.load(open('$W/$1.json'));print(' '.join('%.4f'%v for v in d['losses'][-3:]), 'tok/s/gpu', round(d.get('tokens_per_sec_per_gpu') or 0), 'GiB', round(d['peak_memory_bytes']/2**30,2))" 2>/dev/null; }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s $(losses $1) $(grep -h 'FSDP FP8' $W/$1.txt | cut -c1-60)" | tee -a $W/times.txt; tar czf $OUT/c6.tgz -C $W .; }
two() { local n=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
L="--random-init --lora --dataset synthetic --batch-size 4 --seq-len 2048 --steps 12 --log-every 4"
two lora_fp8 $L --fp8 tensorwise
two lora_bf16 $L
two lora_fp8_2 $L --fp8 tensorwise
