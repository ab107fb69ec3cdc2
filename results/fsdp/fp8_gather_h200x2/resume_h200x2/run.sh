#!/bin/bash
# GPUs: --fsdp --fp8 tensorwise (weights gathered in FP8) saves and resumes exactly, full and LoRA; then tests/fsdp_test.py over NCCL.
OUT=${OUT:-/tmp/res}; W=/tmp/resw; mkdir -p $OUT $W
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( ${LIMIT:-570} - $(date +%s) + T0 )); }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s losses $(python3 -c "import json;print(json.load(open('$W/$1.json'))['losses'])" 2>&1 | tail -1) $(grep -h 'FSDP FP8\|rror' $W/$1.txt | cut -c1-100 | tr '\n' ' ')" | tee -a $W/times.txt; tar czf $OUT/res.tgz -C $W .; }
two() { local n=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
BASE="--tiny --fp8 tensorwise --dataset synthetic --steps 4 --log-every 1"
two full_run $BASE --output-dir $W/full --save-every 2
two full_resumed $BASE --output-dir $W/full_again --resume $W/full/checkpoint-2
two lora_run $BASE --lora --output-dir $W/lora --save-every 2
two lora_resumed $BASE --lora --output-dir $W/lora_again --resume $W/lora/checkpoint-2
timeout $(left) python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py > $W/pytest_fsdp.txt 2>&1; echo "pytest $(tail -1 $W/pytest_fsdp.txt)" | tee -a $W/times.txt
rm -rf $W/full $W/full_again $W/lora $W/lora_again; tar czf $OUT/res.tgz -C $W .
