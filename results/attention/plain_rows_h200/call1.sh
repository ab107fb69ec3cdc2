#!/bin/bash
# One GPU: the routing's GPU tests (gradient checkpointing of masked batches, the measured choice for rows of
# one document), the measured choice on five head layouts (tools/attention_choice.py), and 8B LoRA r16,
# 1 x 16,384 synthetic (one document per row): the default command (now measured) against --no-use-custom-attention.
export PYTHONUNBUFFERED=1
R=$OUT/c1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH="$PWD:$PYTHONPATH"
t0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null; date -u +%F; } > $R/env.txt 2>&1
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Attention:\|Average throughput\|Peak memory\|passed\|failed\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-300 | tr '\n' '|')" | tee -a $R/times.txt; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/apply_test.py -k "checkpointing or measured or measurement or nearest or times_both or padded or generate or packed_rows or refused_not" > $R/pytest_apply.txt 2>&1; stamp pytest_apply
timeout 120 python3 tools/attention_choice.py --json $R/attention_choice.json > $R/attention_choice.txt 2>&1; stamp attention_choice
common="--random-init --dataset synthetic --lora --batch-size 1 --seq-len 16384 --steps 6"
timeout 130 python3 finetune_optimized.py $common --json $R/lora_16k_default.json > $R/lora_16k_default.txt 2>&1; stamp lora_16k_default
timeout 130 python3 finetune_optimized.py $common --no-use-custom-attention --json $R/lora_16k_sdpa.json > $R/lora_16k_sdpa.txt 2>&1; stamp lora_16k_sdpa
