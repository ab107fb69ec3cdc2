#!/bin/bash
# 2 GPUs, after the fix (a trained weight's FP8 cast was kept across gathers): resume and bits, tiny; the GPU tests; 8B bits and memory.
OUT=${OUT:-/tmp/c2}; W=/tmp/c2w; mkdir -p $OUT $W
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"; git rev-parse --short HEAD; date -u; } > $W/env.txt 2>&1
left() { echo $(( ${LIMIT:-570} - $(date +%s) + T0 )); }
losses() { python3 -c "import json;d=json.load(open('$W/$1.json'));print(' '.join('%.6f'%v for v in d['losses']), 'tok/s/gpu', round(d.get('tokens_per_sec_per_gpu') or 0), 'GiB', round(d['peak_memory_bytes']/2**30,2))" 2>/dev/null; }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s losses $(losses $1) $(grep -h 'FSDP FP8\|rror' $W/$1.txt | cut -c1-70 | tr '\n' ' ')" | tee -a $W/times.txt; tar czf $OUT/c2.tgz -C $W --exclude='ck_*' .; }
two() { local n=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
BASE="--tiny --fp8 tensorwise --dataset synthetic --steps 7 --log-every 1"
two g_run $BASE --output-dir $W/ck_g --save-every 2
two g_resumed $BASE --output-dir $W/ck_g2 --resume $W/ck_g/checkpoint-2
two b_run $BASE --no-fsdp-fp8-gather
two l_run $BASE --lora --output-dir $W/ck_l --save-every 2
two l_resumed $BASE --lora --output-dir $W/ck_l2 --resume $W/ck_l/checkpoint-2
rm -rf $W/ck_*
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "fp8" > $W/pytest_fp8_gather.txt 2>&1; echo "pytest fp8 $(tail -1 $W/pytest_fp8_gather.txt)" | tee -a $W/times.txt
E8="--random-init --fp8 tensorwise --dataset synthetic --batch-size 2 --seq-len 2048 --steps 10 --log-every 2"
two e8_gather $E8
two e8_bf16gather $E8 --no-fsdp-fp8-gather
