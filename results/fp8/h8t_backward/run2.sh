#!/bin/bash
# One GPU: the h8^T tiles (sweep.py), then 8B full fine-tuning 2 x 2,048 --fp8 tensorwise with the fastest tile
# (tile.py) against h8^T kept from forward (kept.py), alternating, and the committed default once.
export PYTHONUNBUFFERED=1
R=/tmp/h8b; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.txt
timeout 150 python3 results/fp8/h8t_backward/sweep.py --best $R/best.json > $R/sweep.txt 2>&1; tail -1 $R/sweep.txt
export H8T=$(python3 -c "import json; b = json.load(open('$R/best.json'))['best']; print(','.join(map(str, [*b['tile'], int(b['pack'])])))")
echo "H8T=$H8T" | tee -a $R/times.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4 --fp8 tensorwise"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Peak memory\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-120 | tr '\n' '|')" | tee -a $R/times.txt; }
one() { timeout 120 python3 $2 $common --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
for i in a b; do
  one best_$i results/fp8/h8t_backward/tile.py
  one kept_$i results/fp8/h8t_backward/kept.py
done
one default finetune_optimized.py
tar -czf $OUT/h8b.tgz -C /tmp h8b
