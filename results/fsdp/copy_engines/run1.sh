#!/bin/bash
# --fsdp-comm copy-engines (FSDP2's all-gathers from NCCL windows, zero-CTA policy): 8B full 2 x 2048 per GPU
# against the default --fsdp and one GPU alone, alternating; then the same with the weights gathered again in
# backward (--fsdp-keep-gathered off), where twice as many gathers run; the tiny model's losses both ways.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|FSDP: \|Final loss' $R/$1.txt | tr -s ' ' | cut -c1-200 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi -L > $R/gpus.txt
one() { CUDA_VISIBLE_DEVICES=0 timeout 90 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 120 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $3 $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
tiny="--tiny --steps 6 --log-every 1"
two tiny_default "--fsdp" "$tiny"
two tiny_ce "--fsdp --fsdp-comm copy-engines" "$tiny"
one one_a
two ce_a "--fsdp --fsdp-comm copy-engines" "$common"
two default_a "--fsdp" "$common"
save
two ce_b "--fsdp --fsdp-comm copy-engines" "$common"
one one_b
two ce_off "--fsdp --fsdp-comm copy-engines --fsdp-keep-gathered off" "$common"
two default_off "--fsdp --fsdp-keep-gathered off" "$common"
save
