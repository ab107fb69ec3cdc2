#!/bin/bash
# tools/fp8_amax_history.py: its GPU test, then the record of every per-tensor cast's scale over
# 8B full fine-tuning (bundled data, packed, 2 x 2,048, 200 steps) and 8B LoRA r16 (4 x 2,048, 100 steps).
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
t0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/fp8_amax_history_test.py > $R/pytest.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest.txt)" | tee -a $R/times.txt
timeout 230 python3 tools/fp8_amax_history.py --history 1 16 1024 --skip 20 --json $R/full.json -- finetune_optimized.py \
  --random-init --batch-size 2 --seq-len 2048 --steps 198 --warmup-steps 2 --log-every 20 --fp8 tensorwise > $R/full.txt 2>&1
echo "full rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
left=$(( 545 - ($(date +%s) - t0) ))
timeout $left python3 tools/fp8_amax_history.py --history 1 16 1024 --skip 10 --json $R/lora.json -- finetune_optimized.py \
  --random-init --lora --batch-size 4 --seq-len 2048 --steps 98 --warmup-steps 2 --log-every 20 --fp8 tensorwise > $R/lora.txt 2>&1
echo "lora rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
tail -22 $R/full.txt; tail -16 $R/lora.txt
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
