#!/bin/bash
# The FP8 commands of the headline table again with today's code, on one H100: 8B LoRA r16 4 x 2,048 and 8B full
# fine-tuning 2 x 2,048, `--fp8 tensorwise`, synthetic rows, 15 timed steps after 3 warm-up, as in
# results/fp8/lora_fused_h100/ and results/fp8/qkv_stacked_h100/.
R=$OUT/recheck
source tools/device_env.sh $R
t0=$(date +%s)
for spec in "lora 4" "full 2"; do
  set -- $spec
  common="--random-init --dataset synthetic --batch-size $2 --seq-len 2048 --steps 15 --warmup-steps 3 --log-every 5 --fp8 tensorwise"
  [ "$1" = lora ] && common="$common --lora"
  timeout 150 python3 finetune_optimized.py $common --json $R/fp8_$1_$2x2048.json > $R/fp8_$1_$2x2048.txt 2>&1
  echo "$spec rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Average throughput|Peak memory' $R/fp8_$1_$2x2048.txt | tr '\n' '|')" \
    | tee -a $R/times.txt
done
tar -czf $OUT/recheck.tgz -C $OUT recheck && rm -r $R
