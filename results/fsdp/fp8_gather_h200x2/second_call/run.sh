#!/bin/bash
# FSDP + FP8 slower than at 9d811cc? Same call, alternating: the old tree, HEAD (gather off / on), HEAD without producers.
OUT=${OUT:-/tmp/reg}; W=/tmp/regw; mkdir -p $OUT $W
export PYTHONUNBUFFERED=1
R=$PWD
T0=$(date +%s)
left() { echo $(( ${LIMIT:-570} - $(date +%s) + T0 )); }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s $(grep -h 'Per GPU\|Peak memory\|rror' $W/$1.txt 2>/dev/null | cut -c1-120 | tr '\n' ' ') losses $(grep -h '^step ' $W/$1.txt | awk '{print $4}' | head -4 | tr '\n' ' ')" | tee -a $W/times.txt; tar czf $OUT/reg.tgz -C $W .; }
FULL="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --warmup-steps 3 --steps 9 --fp8 tensorwise --fsdp"
old() { local n=$1; shift; (cd $R/.lab/old && PYTHONPATH=$R/.lab/old timeout $(left) torchrun --standalone --nproc-per-node 2 finetune_optimized.py $FULL "$@" --json $W/$n.json > $W/$n.txt 2>&1); stamp $n; }
new() { local n=$1; shift; PYTHONPATH=$R timeout $(left) torchrun --standalone --nproc-per-node 2 finetune_optimized.py $FULL "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
noprod() { local n=$1; shift; PYTHONPATH=$R timeout $(left) torchrun --standalone --nproc-per-node 2 .lab/noprod.py finetune_optimized.py $FULL "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
old old1
new head_nogather --no-fsdp-fp8-gather
noprod head_noprod_nogather --no-fsdp-fp8-gather
new head_gather
old old2
noprod head_noprod_gather
