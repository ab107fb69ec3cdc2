#!/bin/bash
# 4 GPUs: the 32B-shaped Qwen2 of run9.sh again, --fsdp with its gradients averaged in bf16 as --ddp's are (FSDP's
# default over 4 processes is float32), against --ddp --ddp-shard-weights, alternating.
export PYTHONUNBUFFERED=1
R=/tmp/r10; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
cat $R/gpus.txt; git log --oneline -1 >> $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --log-every 4 --model /tmp/qwen2-32b-shape --steps 8 --gradient-checkpointing"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-160 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r10.tgz -C /tmp r10; }
four() { timeout 200 torchrun --standalone --nproc-per-node 4 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
mkdir -p /tmp/qwen2-32b-shape
python3 - <<'PY'
from transformers import Qwen2Config
Qwen2Config(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
            num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16").save_pretrained("/tmp/qwen2-32b-shape")
PY
four q32_fsdp_bf16 "--fsdp --fsdp-reduce-dtype bfloat16"
save
four q32_sw_b "--ddp --ddp-shard-weights"
save
