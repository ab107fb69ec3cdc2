#!/usr/bin/env bash
# H200: long single-document rows, 8B LoRA r16: default vs --no-use-custom-attention at 16K and 32K.
O=$OUT/lc1
source tools/device_env.sh $O
nvidia-smi --query-gpu=name,memory.total --format=csv >> $O/env.txt
t0=$SECONDS
ft() {  # ft NAME SEQ FLAGS...
  local name=$1 seq=$2; shift 2
  timeout 200 python3 finetune_optimized.py --random-init --dataset synthetic --lora --batch-size 1 --seq-len $seq --steps 6 \
     --log-every 2 "$@" --json $O/$name.json > $O/$name.txt 2>&1
  echo "$name $((SECONDS-t0))s $(python3 -c "import json; d=json.load(open('$O/$name.json')); print('tok/s', round(d['tokens_per_sec']), 'real', round(d['real_tokens_per_sec'] or 0), 'GiB', round(d['peak_memory_bytes']/2**30, 2), 'losses', [round(s['loss'],4) for s in d['steps']][-3:])" 2>&1 | tail -1) | $(grep -m1 '^Attention:' $O/$name.txt)" | tee -a $O/times.txt
}
ft lora_16k_default 16384
ft lora_16k_sdpa 16384 --no-use-custom-attention
ft lora_32k_default 32768
ft lora_32k_sdpa 32768 --no-use-custom-attention
cd $OUT && tar czf lc1.tgz lc1 && rm -rf lc1
