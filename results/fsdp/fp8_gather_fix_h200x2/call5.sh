#!/bin/bash
# 2 GPUs, FP8Shard without its Python layer: resume + bits (tiny), 8B FP8 vs bf16 gathers alternating, a profile, the FP8 GPU tests.
OUT=${OUT:-/tmp/c5}; W=/tmp/c5w; mkdir -p $OUT $W
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"; date -u; } > $W/env.txt 2>&1
left() { echo $(( ${LIMIT:-570} - $(date +%s) + T0 )); }
losses() { python3 -c "import json;d=json.load(open('$W/$1.json'));print(' '.join('%.6f'%v for v in d['losses'][-4:]), 'tok/s/gpu', round(d.get('tokens_per_sec_per_gpu') or 0), 'GiB', round(d['peak_memory_bytes']/2**30,2))" 2>/dev/null; }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s $(losses $1)" | tee -a $W/times.txt; tar czf $OUT/c5.tgz -C $W --exclude='ck_*' .; }
two() { local n=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
BASE="--tiny --fp8 tensorwise --dataset synthetic --steps 7 --log-every 1"
two tiny_fp8gather $BASE --output-dir $W/ck_g --save-every 2
two tiny_fp8gather_resumed $BASE --output-dir $W/ck_g2 --resume $W/ck_g/checkpoint-2
two tiny_bf16gather $BASE --no-fsdp-fp8-gather
rm -rf $W/ck_*
E8="--random-init --fp8 tensorwise --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
two fp8gather_1 $E8
two bf16gather_1 $E8 --no-fsdp-fp8-gather
two fp8gather_2 $E8
two bf16gather_2 $E8 --no-fsdp-fp8-gather
K="--use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce --use-custom-adamw"
timeout $(left) torchrun --standalone --nproc-per-node 2 profile_baseline.py --fsdp --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --fp8 tensorwise $K --trace-dir /tmp/tr_g > $W/profile_fp8gather.txt 2>&1; stamp profile_fp8gather
CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider fp8_test.py > $W/pytest_fp8_gpu.txt 2>&1; echo "pytest fp8_test $(tail -1 $W/pytest_fp8_gpu.txt)" | tee -a $W/times.txt; tar czf $OUT/c5.tgz -C $W --exclude='ck_*' .
