#!/bin/bash
# 2 GPUs: --ddp-shard-weights with the eager steps' whole gradients capped again (a gradient a backward did not make is
# made as zeros two layers later) and with --gradient-checkpointing. The NCCL tests first (the uneven backward with one
# layer in flight, the script with checkpointing), then 8B full fine-tuning 2 x 2,048 per GPU, alternating one GPU
# alone, --ddp --ddp-shard-weights and --ddp; the same eagerly (peak memory); then with --gradient-checkpointing: one
# GPU alone, --ddp-shard-weights and --fsdp.
export PYTHONUNBUFFERED=1
R=/tmp/r8; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
cat $R/gpus.txt; git log --oneline -1 >> $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|shard-weights: ' $R/$1.txt | tr -s ' ' | cut -c1-120 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r8.tgz -C /tmp r8; }
one() { CUDA_VISIBLE_DEVICES=0 timeout 110 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 150 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "pieces_equal or shard_weights or gpus" > $R/pytest_nccl.txt 2>&1
tail -3 $R/pytest_nccl.txt; echo "pytest $(( $(date +%s) - t0 ))s"
save
one one_a
two sw_a "--ddp --ddp-shard-weights"
two ddp_a "--ddp"
one one_b
two sw_b "--ddp --ddp-shard-weights"
save
two sw_eager "--ddp --ddp-shard-weights --no-cuda-graphs"
save
one one_ckpt "--gradient-checkpointing"
two sw_ckpt "--ddp --ddp-shard-weights --gradient-checkpointing"
two fsdp_ckpt "--fsdp --gradient-checkpointing"
save
