#!/bin/bash
# 8B full 2 x 2048 per GPU on a pair: one GPU alone, --ddp (the pieces gathered by the copy engines, the default),
# all-reduced; then an eager profile of the default --ddp step (where the rest of the time goes).
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|DDP:\|NCCL  \|Wall time\|GPU busy' $R/$1.txt | tr -s ' ' | cut -c1-200 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi -L > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" > $R/versions.txt
one() { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 120 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one
two ce2 "--ddp"
two ar2 "--ddp --no-ddp-shard-optimizer"
save
timeout 150 torchrun --standalone --nproc-per-node 2 profile_baseline.py --ddp --random-init --dataset synthetic \
  --batch-size 2 --seq-len 2048 --use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce \
  --use-custom-adamw --trace-dir /tmp/tr > $R/profile_ce2.txt 2>&1; stamp profile_ce2
save
