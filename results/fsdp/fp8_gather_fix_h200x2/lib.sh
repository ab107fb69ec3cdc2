#!/bin/bash
# What the six calls share (each callN.sh sources it): NAME (c1..c6) names the work folder /tmp/NAME and the tgz
# under $OUT; LIMIT the seconds the call may run; KEEP how many of each run's last losses times.txt shows (all: 0).
# (The calls printed the losses with 6 or 4 decimals; the JSON files hold them whole.)
OUT=${OUT:-/tmp/$NAME}; W=/tmp/${NAME}w; mkdir -p $OUT $W
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"
  date -u; } > $W/env.txt 2>&1
left() { echo $(( ${LIMIT:-570} - $(date +%s) + T0 )); }
losses() { python3 -c "import json;d=json.load(open('$W/$1.json'));print(' '.join('%.6f'%v for v in d['losses'][-${KEEP:-0}:]), 'tok/s/gpu', round(d.get('tokens_per_sec_per_gpu') or 0), 'GiB', round(d['peak_memory_bytes']/2**30,2))" 2>/dev/null; }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s $(losses $1) $(grep -h 'FSDP FP8\|rror' $W/$1.txt 2>/dev/null | cut -c1-70 | tr '\n' ' ')" | tee -a $W/times.txt; tar czf $OUT/$NAME.tgz -C $W --exclude='ck_*' .; }
two() { local n=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
# 8B full fine-tuning under FSDP, --fp8 tensorwise, FP8 gathers (the default in calls 2-5) and bf16 gathers alternating.
alternate_8b() {
  local E8="--random-init --fp8 tensorwise --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
  two fp8gather_1 $E8
  two bf16gather_1 $E8 --no-fsdp-fp8-gather
  two fp8gather_2 $E8
  two bf16gather_2 $E8 --no-fsdp-fp8-gather
}
# The tiny model under FSDP with FP8 layers, 7 steps; a run saved at step 2 and the run resumed from there
# (its losses must be the first run's steps 3-7): resumed RUN RESUMED FLAGS...
TINY="--tiny --fp8 tensorwise --dataset synthetic --steps 7 --log-every 1"
resumed() {
  local run=$1 again=$2; shift 2
  two $run $TINY "$@" --output-dir $W/ck_$run --save-every 2
  two $again $TINY "$@" --output-dir $W/ck_$again --resume $W/ck_$run/checkpoint-2
}
