#!/usr/bin/env bash
# Call 5 (H200): the longest trainable sequence at batch 1, every kernel, our attention vs SDPA's: 8B LoRA r16 (SDPA; ours
# in call 4) and 8B full fine-tuning both ways.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R; export PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  date -u +%F; } > $R/env.txt
t0=$SECONDS
ms() {  # ms NAME FLAGS...
  local name=$1; shift
  python3 tools/max_seq_len.py --random-init --all-kernels --step 8192 --resolution 1024 "$@" --json $R/$name.json > $R/$name.txt 2>&1
  echo "$name $((SECONDS-t0))s $(grep Result $R/$name.txt || tail -2 $R/$name.txt | tr '\n' ' ')" >> $R/times.txt
}
ms maxseq_lora_sdpa --lora --no-use-custom-attention
ms maxseq_full_ours
ms maxseq_full_sdpa --no-use-custom-attention
