#!/bin/bash
# 4 GPUs: 8B full fine-tuning 2 x 2,048 per GPU, one GPU alone against --ddp --ddp-shard-weights over 4 (the eager
# steps' cap, the checkpointing support); then a model --ddp cannot hold whole on each GPU: the Qwen2 architecture
# at 32B's shape (hidden 5,120, 64 layers, MLP 27,648, 40 / 8 heads, vocabulary 152,064; random weights), full
# fine-tuning with --gradient-checkpointing, 2 x 2,048 per GPU: --ddp --ddp-shard-weights against --fsdp.
export PYTHONUNBUFFERED=1
R=/tmp/r9; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
cat $R/gpus.txt; git log --oneline -1 >> $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Parallel:\|Average throughput\|Per GPU\|Peak memory\|Error\|error\|shard-weights: ' $R/$1.txt | tr -s ' ' | cut -c1-160 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r9.tgz -C /tmp r9; }
one() { CUDA_VISIBLE_DEVICES=0 timeout 110 python3 finetune_optimized.py $common --steps 16 $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
four() { timeout $3 torchrun --standalone --nproc-per-node 4 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one_a
four sw4 "--steps 16 --ddp --ddp-shard-weights" 150
one one_b
save
mkdir -p /tmp/qwen2-32b-shape
python3 - <<'PY'
from transformers import Qwen2Config
Qwen2Config(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
            num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16").save_pretrained("/tmp/qwen2-32b-shape")
PY
four q32_sw "--model /tmp/qwen2-32b-shape --steps 8 --gradient-checkpointing --ddp --ddp-shard-weights" 200
save
four q32_fsdp "--model /tmp/qwen2-32b-shape --steps 8 --gradient-checkpointing --fsdp" 200
save
