#!/bin/bash
# 2 GPUs, the final choice code: the NCCL test of the pieces' worker (the first layers kept whole through
# ddp.first_released), then the 20B-shaped LLaMA of run1.sh with neither flag and a checkpoint at step 2 (the choice
# counts every weight gathered whole for it; the checkpoint must fit beside the rest).
export PYTHONUNBUFFERED=1
R=/tmp/c2; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "pieces_equal" > $R/pytest_nccl.txt 2>&1
tail -2 $R/pytest_nccl.txt; echo "pytest $(( $(date +%s) - t0 ))s"
tar -czf $OUT/c2.tgz -C /tmp c2
mkdir -p /tmp/llama-20b-shape
python3 - <<'PY'
from transformers import LlamaConfig
LlamaConfig(hidden_size=6144, intermediate_size=16384, num_hidden_layers=48, num_attention_heads=48,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16").save_pretrained("/tmp/llama-20b-shape")
PY
timeout 280 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --random-init --dataset synthetic \
    --batch-size 2 --seq-len 2048 --log-every 1 --model /tmp/llama-20b-shape --steps 2 --gradient-checkpointing \
    --output-dir /tmp/ck20 --save-every 2 --json $R/chosen_ckpt.json > $R/chosen_ckpt.txt 2>&1
echo "rc=$? $(( $(date +%s) - t0 ))s"; grep -h 'Parallel:\|Peak memory\|Saved\|checkpoint\|rror' $R/chosen_ckpt.txt | cut -c1-300
du -sh /tmp/ck20/* >> $R/chosen_ckpt.txt 2>&1
tar -czf $OUT/c2.tgz -C /tmp c2
