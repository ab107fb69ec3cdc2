#!/bin/bash
# One GPU: the gradient norm's sums of squares made beside backward (TritonAdamW.sum_in_backward, the default)
# against after it (norm_after.py), 8B full fine-tuning 2 x 2,048, bf16 and --fp8 tensorwise, alternating; the
# GPU tests of adamw_test.py first (the sums on their own stream against the norm after backward).
export PYTHONUNBUFFERED=1
R=/tmp/n1; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Peak memory\|CUDA graphs\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-120 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/n1.tgz -C /tmp n1; }
one() { timeout 110 python3 $3 $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
timeout 120 python3 -m pytest -q -p no:cacheprovider adamw_test.py > $R/pytest_adamw.txt 2>&1
tail -2 $R/pytest_adamw.txt; echo "pytest $(( $(date +%s) - t0 ))s"
save
for i in a b c; do
  one beside_$i "" finetune_optimized.py
  one after_$i "" results/norm_beside/norm_after.py
done
save
for i in a b; do
  one fp8_beside_$i "--fp8 tensorwise" finetune_optimized.py
  one fp8_after_$i "--fp8 tensorwise" results/norm_beside/norm_after.py
done
save
