#!/usr/bin/env bash
# H200: long single-document rows, 8B LoRA r16: the default command, --no-use-custom-attention (SDPA's
# default backend), --use-custom-attention (ours forced); then the longest LoRA row at batch 1 both ways.
O=$OUT/c3
source tools/device_env.sh $O
t0=$SECONDS
ft() {  # ft NAME SEQ FLAGS...
  local name=$1 seq=$2; shift 2
  timeout 150 python3 finetune_optimized.py --random-init --dataset synthetic --lora --batch-size 1 --seq-len $seq --steps 6 \
     --log-every 2 "$@" --json $O/$name.json > $O/$name.txt 2>&1
  echo "$name $((SECONDS-t0))s $(python3 -c "import json; d=json.load(open('$O/$name.json')); print('tok/s', round(d['tokens_per_sec']), 'real', round(d['real_tokens_per_sec'] or 0), 'GiB', round(d['peak_memory_bytes']/2**30, 2), 'losses', [round(s['loss'],4) for s in d['steps']][-3:])" 2>&1 | tail -1) | $(grep -m1 '^Attention:' $O/$name.txt)" | tee -a $O/times.txt
}
ft lora_16k_default 16384
ft lora_16k_sdpa 16384 --no-use-custom-attention
ft lora_16k_ours 16384 --use-custom-attention
ft lora_32k_default 32768
ft lora_32k_sdpa 32768 --no-use-custom-attention
for a in default sdpa; do
  extra=""; [ $a = sdpa ] && extra="--no-use-custom-attention"
  timeout 170 python3 tools/max_seq_len.py --random-init --all-kernels --lora $extra --step 8192 --resolution 1024 --json $O/maxseq_lora_$a.json > $O/maxseq_lora_$a.txt 2>&1
  echo "maxseq_lora_$a $((SECONDS-t0))s $(grep Result $O/maxseq_lora_$a.txt || tail -2 $O/maxseq_lora_$a.txt | tr '\n' ' ')" | tee -a $O/times.txt
done
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
