#!/bin/bash
# One GPU, after the routed rows of one document moved to ours-with-no-mask (HF built a dense mask for SDPA
# inside the CUDA graph capture in call 1): the routing's GPU tests, 8B LoRA r16 1 x 16,384 synthetic default
# against --no-use-custom-attention, and 8B full 2 x 2,048 synthetic (README's main row) the same two ways.
export PYTHONUNBUFFERED=1
R=$OUT/c2; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH="$PWD:$PYTHONPATH"
t0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null; date -u +%F; } > $R/env.txt 2>&1
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Attention:\|CUDA graphs\|Average throughput\|Peak memory\|passed\|failed\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-300 | tr '\n' '|')" | tee -a $R/times.txt; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/apply_test.py -k "checkpointing or measured or measurement or nearest or times_both or padded or generate or packed_rows or refused_not" > $R/pytest_apply.txt 2>&1; stamp pytest_apply
lora="--random-init --dataset synthetic --lora --batch-size 1 --seq-len 16384 --steps 6"
full="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 8"
timeout 110 python3 finetune_optimized.py $lora --json $R/lora_16k_default.json > $R/lora_16k_default.txt 2>&1; stamp lora_16k_default
timeout 110 python3 finetune_optimized.py $lora --no-use-custom-attention --json $R/lora_16k_sdpa.json > $R/lora_16k_sdpa.txt 2>&1; stamp lora_16k_sdpa
timeout 110 python3 finetune_optimized.py $full --json $R/full_2x2048_default.json > $R/full_2x2048_default.txt 2>&1; stamp full_2x2048_default
timeout 110 python3 finetune_optimized.py $full --no-use-custom-attention --json $R/full_2x2048_sdpa.json > $R/full_2x2048_sdpa.txt 2>&1; stamp full_2x2048_sdpa
