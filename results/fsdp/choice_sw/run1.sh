#!/bin/bash
# 2 GPUs: torchrun with neither --fsdp nor --ddp on a model whose whole copy does not fit 80% of an H200
# (a LLaMA of ~20B's shape: hidden 6,144, 48 layers, MLP 16,384, 48 / 8 heads; random weights), full
# fine-tuning with --gradient-checkpointing, 2 x 2,048 per GPU: the choice (--ddp --ddp-shard-weights) against --fsdp.
export PYTHONUNBUFFERED=1
R=/tmp/c1; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
mkdir -p /tmp/llama-20b-shape
python3 - <<'PY'
from transformers import LlamaConfig
LlamaConfig(hidden_size=6144, intermediate_size=16384, num_hidden_layers=48, num_attention_heads=48,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16").save_pretrained("/tmp/llama-20b-shape")
PY
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --log-every 4 --model /tmp/llama-20b-shape --steps 8 --gradient-checkpointing"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Parallel:\|Average throughput\|Per GPU\|Peak memory\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-400 | tr '\n' '|')" | tee -a $R/times.txt; }
two() { timeout $3 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; tar -czf $OUT/c1.tgz -C /tmp c1; }
two chosen "" 170
two fsdp "--fsdp --fsdp-reduce-dtype bfloat16" 170
