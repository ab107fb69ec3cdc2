#!/usr/bin/env bash
# H100: 8B LoRA r16, one 16,384-token document per row: the default against --no-use-custom-attention.
O=$OUT/lc16
source tools/device_env.sh $O >/dev/null
t0=$SECONDS
for a in default sdpa; do
  extra=""; [ $a = sdpa ] && extra="--no-use-custom-attention"
  timeout 150 python3 finetune_optimized.py --random-init --dataset synthetic --lora --batch-size 1 --seq-len 16384 --steps 6 \
     --log-every 2 $extra --json $O/lora_16k_$a.json > $O/lora_16k_$a.txt 2>&1
  echo "$a $((SECONDS-t0))s $(python3 -c "import json; d=json.load(open('$O/lora_16k_$a.json')); print('tok/s', round(d['tokens_per_sec']), 'GiB', round(d['peak_memory_bytes']/2**30, 2), [round(s['loss'],4) for s in d['steps']][-2:])" 2>&1 | tail -1) | $(grep -m1 '^Attention:' $O/lora_16k_$a.txt)"
done
cd $OUT && tar czf lc16.tgz lc16 && rm -rf lc16
