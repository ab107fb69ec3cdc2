#!/bin/bash
# 2 GPUs: the gradient norm's sums of squares of the pieces made beside backward (GradientAverage._sum_beside)
# against after it (norm_after.py), 8B full fine-tuning 2 x 2,048 per GPU, alternating with one GPU alone; the
# NCCL test of the worker (its norms against one process, the sums taken from backward) first.
export PYTHONUNBUFFERED=1
R=/tmp/n1; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-120 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/n1.tgz -C /tmp n1; }
one() { CUDA_VISIBLE_DEVICES=0 timeout 110 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 150 torchrun --standalone --nproc-per-node 2 $3 $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "pieces_equal" > $R/pytest_nccl.txt 2>&1
tail -3 $R/pytest_nccl.txt; echo "pytest $(( $(date +%s) - t0 ))s"
save
one one_a
two beside_a "--ddp" finetune_optimized.py
two after_a "--ddp" results/ddp/norm_beside/norm_after.py
one one_b
two after_b "--ddp" results/ddp/norm_beside/norm_after.py
two beside_b "--ddp" finetune_optimized.py
save
two sw_beside "--ddp --ddp-shard-weights" finetune_optimized.py
two sw_after "--ddp --ddp-shard-weights" results/ddp/norm_beside/norm_after.py
one one_c
save
