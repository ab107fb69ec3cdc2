#!/bin/bash
# One GPU: the GPU tests of the files this change touches (the attention routing moved to attention_routing.py;
# multimodal models: the text decoder's attention and RoPE only, the fused loss through the base model), each file
# under its own time limit. Call 2: FILES="tests/families_test.py:120 tests/finetune_test.py:150" CALL=c2, then
# E2E=1: the default 8B full fine-tuning command against --no-use-custom-attention (README Step 16's row).
export PYTHONUNBUFFERED=1
R=$OUT/${CALL:-c1}; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH="$PWD:$PYTHONPATH"
t0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null; date -u +%F; } > $R/env.txt 2>&1
for f in ${FILES:-tests/apply_test.py:200 attention_test.py:90 rope_test.py:60 linear_cross_entropy_test.py:90 kernel_common_test.py:40}; do
  timeout ${f#*:} python3 -m pytest -q -p no:cacheprovider ${f%:*} > $R/pytest_$(basename ${f%:*} .py).txt 2>&1
  echo "${f%:*} rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_$(basename ${f%:*} .py).txt)" | tee -a $R/times.txt
done
if [ -n "$E2E" ]; then
  full="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 8"
  for run in default:"" sdpa:"--no-use-custom-attention"; do
    timeout 110 python3 finetune_optimized.py $full ${run#*:} --json $R/full_2x2048_${run%%:*}.json > $R/full_2x2048_${run%%:*}.txt 2>&1
    echo "full_2x2048_${run%%:*} rc=$? $(( $(date +%s) - t0 ))s $(grep -h 'Attention:\|Average throughput\|Peak memory' $R/full_2x2048_${run%%:*}.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
  done
fi
