#!/bin/bash
# One GPU, after the review's fixes: the library's GPU tests, the measured choice on the five head layouts
# (Phi-3's rows past its 2,047-token window now ours, unmeasured), and the default 8B LoRA 1 x 16,384 run.
export PYTHONUNBUFFERED=1
R=$OUT/c6; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH="$PWD:$PYTHONPATH"
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/apply_test.py > $R/pytest_apply_test.txt 2>&1
echo "apply_test rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_apply_test.txt)" | tee -a $R/times.txt
timeout 120 python3 tools/attention_choice.py --json $R/attention_choice.json > $R/attention_choice.txt 2>&1
echo "attention_choice rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
timeout 100 python3 finetune_optimized.py --random-init --dataset synthetic --lora --batch-size 1 --seq-len 16384 \
  --steps 6 --json $R/lora_16k_default.json > $R/lora_16k_default.txt 2>&1
echo "lora_16k_default rc=$? $(( $(date +%s) - t0 ))s $(grep -h 'Attention:\|Average throughput\|Peak memory' $R/lora_16k_default.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
