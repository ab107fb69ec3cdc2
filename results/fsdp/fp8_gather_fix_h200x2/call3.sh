#!/bin/bash
# 2 GPUs, 8B full --fsdp --fp8 tensorwise: FP8 gathers against bf16 gathers, alternating, then a profile of each.
OUT=${OUT:-/tmp/c3}; W=/tmp/c3w; mkdir -p $OUT $W
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"; date -u; } > $W/env.txt 2>&1
left() { echo $(( ${LIMIT:-570} - $(date +%s) + T0 )); }
losses() { python3 -c "import json;d=json.load(open('$W/$1.json'));print(' '.join('%.4f'%v for v in d['losses'][-3:]), 'tok/s/gpu', round(d.get('tokens_per_sec_per_gpu') or 0), 'GiB', round(d['peak_memory_bytes']/2**30,2))" 2>/dev/null; }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s $(losses $1)" | tee -a $W/times.txt; tar czf $OUT/c3.tgz -C $W .; }
two() { local n=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
E8="--random-init --fp8 tensorwise --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
two fp8gather_1 $E8
two bf16gather_1 $E8 --no-fsdp-fp8-gather
two fp8gather_2 $E8
two bf16gather_2 $E8 --no-fsdp-fp8-gather
K="--use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce --use-custom-adamw"
for g in fsdp-fp8-gather no-fsdp-fp8-gather; do
  timeout $(left) torchrun --standalone --nproc-per-node 2 profile_baseline.py --fsdp --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --fp8 tensorwise --$g $K > $W/profile_$g.txt 2>&1; stamp profile_$g
done
