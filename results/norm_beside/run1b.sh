#!/bin/bash
# One GPU: the sums beside backward with fewer programs each (1 per 1, 8 or 32 SMs; run1.sh ran 8 per SM and lost
# 0.3-0.4%), against the norm after backward, 8B full fine-tuning 2 x 2,048, alternating.
export PYTHONUNBUFFERED=1
R=/tmp/n1b; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Peak memory\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-120 | tr '\n' '|')" | tee -a $R/times.txt; }
one() { timeout 110 python3 $3 $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
for i in a b; do
  one after_$i "" results/norm_beside/norm_after.py
  for k in 1 8 32; do one beside${k}_$i "" "results/norm_beside/sweep.py $k"; done
done
tar -czf $OUT/n1b.tgz -C /tmp n1b
