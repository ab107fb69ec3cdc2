#!/bin/bash
# One GPU: what lives at the peak of 8B full fine-tuning, 2 x 2,048, bf16 and --fp8 tensorwise
# (tools/memory_peak.py, 4 steps: 2 eager, the capture, a replay).
export PYTHONUNBUFFERED=1
R=/tmp/m1; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 4 --log-every 1"
for mode in bf16 fp8; do
  extra=""; [ $mode = fp8 ] && extra="--fp8 tensorwise"
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 tools/memory_peak.py --top 40 --json $R/peak_$mode.json -- \
      finetune_optimized.py $common $extra --json $R/run_$mode.json > $R/peak_$mode.txt 2>&1
  echo "$mode rc=$? $(grep -h 'Peak' $R/peak_$mode.txt | tr '\n' '|')"
  tar -czf $OUT/m1.tgz -C /tmp m1
done
