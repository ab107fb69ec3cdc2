#!/bin/bash
# 2 GPUs: the W8^T tile transpose (tests, speed), then 8B full --fsdp --fp8 tensorwise, FP8 gathers vs bf16 gathers alternating, and a profile.
OUT=${OUT:-/tmp/c4}; W=/tmp/c4w; mkdir -p $OUT $W
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"; date -u; } > $W/env.txt 2>&1
left() { echo $(( ${LIMIT:-570} - $(date +%s) + T0 )); }
losses() { python3 -c "import json;d=json.load(open('$W/$1.json'));print(' '.join('%.4f'%v for v in d['losses'][-3:]), 'tok/s/gpu', round(d.get('tokens_per_sec_per_gpu') or 0), 'GiB', round(d['peak_memory_bytes']/2**30,2))" 2>/dev/null; }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s $(losses $1)" | tee -a $W/times.txt; tar czf $OUT/c4.tgz -C $W .; }
two() { local n=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "transpose or gathered_fp8 or fp8_layers" > $W/pytest_gpu.txt 2>&1; echo "pytest $(tail -1 $W/pytest_gpu.txt)" | tee -a $W/times.txt
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 .lab/tbench.py > $W/transpose_bench.txt 2>&1; cat $W/transpose_bench.txt
E8="--random-init --fp8 tensorwise --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
two fp8gather_1 $E8
two bf16gather_1 $E8 --no-fsdp-fp8-gather
two fp8gather_2 $E8
two bf16gather_2 $E8 --no-fsdp-fp8-gather
K="--use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce --use-custom-adamw"
for g in fsdp-fp8-gather no-fsdp-fp8-gather; do
  timeout $(left) torchrun --standalone --nproc-per-node 2 profile_baseline.py --fsdp --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --fp8 tensorwise --$g $K --trace-dir /tmp/tr_$g > $W/profile_$g.txt 2>&1; stamp profile_$g
done
