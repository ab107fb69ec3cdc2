#!/bin/bash
# One GPU: tools/memory_peak.py as it is now (the replay at free_requested; the report after a failed run too):
# 8B full fine-tuning 2 x 2,048, bf16 and --fp8 tensorwise, 4 steps; then a run that runs out of memory (8B full,
# 8 x 4,096, eager), whose record is still read.
export PYTHONUNBUFFERED=1
R=/tmp/m2; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpus.txt
common="--random-init --dataset synthetic --steps 4 --log-every 1"
peak() {
  timeout 240 python3 tools/memory_peak.py --top 40 --json $R/peak_$1.json -- finetune_optimized.py $common $2 \
      --json $R/run_$1.json > $R/peak_$1.txt 2>&1
  echo "$1 rc=$? $(grep -h 'Peak\|error' $R/peak_$1.txt | cut -c1-200 | tr '\n' '|')"
  tar -czf $OUT/m2.tgz -C /tmp m2
}
peak bf16 "--batch-size 2 --seq-len 2048"
peak fp8 "--batch-size 2 --seq-len 2048 --fp8 tensorwise"
peak oom "--batch-size 8 --seq-len 4096 --no-cuda-graphs"
