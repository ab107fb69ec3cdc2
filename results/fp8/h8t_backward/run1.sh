#!/bin/bash
# One GPU: 8B full fine-tuning 2 x 2,048 with --fp8 tensorwise, h8^T cast in backward (the default) against kept from
# forward (kept.py), alternating, and bf16 once; then benchmark_fp8.py --quick (MLP stack with the A/B row) and the GPU
# tests of the changed kernel files.
export PYTHONUNBUFFERED=1
R=/tmp/h8; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" > $R/versions.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Peak memory\|Final loss\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-120 | tr '\n' '|')" | tee -a $R/times.txt; }
one() { timeout 120 python3 $3 $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
for i in a b; do
  one new_$i "--fp8 tensorwise" finetune_optimized.py
  one kept_$i "--fp8 tensorwise" results/fp8/h8t_backward/kept.py
done
one bf16 "" finetune_optimized.py
timeout 170 python3 benchmark_fp8.py --quick --json $R/bench_fp8.json > $R/bench_fp8.txt 2>&1; echo "bench $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider fp8_test.py swiglu_test.py > $R/pytest.txt 2>&1; tail -3 $R/pytest.txt | tee -a $R/times.txt
tar -czf $OUT/h8.tgz -C /tmp h8
