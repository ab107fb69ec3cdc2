#!/usr/bin/env bash
# Call 4 (H200): 8B LoRA r16, one 32,768-token document with --gradient-checkpointing, SDPA's default backend vs
# our attention kernel, same call; the longest trainable LoRA sequence at batch 1 both ways (tools/max_seq_len.py).
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R; export PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  date -u +%F; } > $R/env.txt
t0=$SECONDS
ft() {  # ft NAME SEQ FLAGS...
  local name=$1 seq=$2; shift 2
  python3 finetune_optimized.py --random-init --dataset synthetic --lora --batch-size 1 --seq-len $seq --steps 6 \
     --log-every 2 "$@" --json $R/$name.json > $R/$name.txt 2>&1
  echo "$name $((SECONDS-t0))s $(python3 -c "import json; d=json.load(open('$R/$name.json')); print('tok/s', round(d['tokens_per_sec']), 'GiB', round(d['peak_memory_bytes']/2**30, 2), 'losses', [round(s['loss'],4) for s in d['steps']][-3:])" 2>&1 | tail -1) $(grep -m1 'Custom attn' $R/$name.txt)" >> $R/times.txt
}
ft lora_32k_ckpt_sdpa 32768 --gradient-checkpointing
ft lora_32k_ckpt_ours 32768 --gradient-checkpointing --use-custom-attention
for a in ours sdpa; do
  extra=""; [ $a = sdpa ] && extra="--no-use-custom-attention"
  python3 tools/max_seq_len.py --random-init --lora --all-kernels $extra --step 8192 --resolution 1024 --json $R/maxseq_lora_$a.json > $R/maxseq_lora_$a.txt 2>&1
  echo "maxseq_lora_$a $((SECONDS-t0))s $(grep Result $R/maxseq_lora_$a.txt || tail -2 $R/maxseq_lora_$a.txt | tr '\n' ' ')" >> $R/times.txt
done
