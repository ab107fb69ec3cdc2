#!/bin/bash
# As it ran at commit e850eea (the sums ahead were removed after this call: no gain).
# 2 GPUs of one host: 8B full fine-tuning 2 x 2,048 per GPU, --ddp (pieces, copy engines), the norm's sums launched as
# each reduce-scatter ends (the default) against after the last one (after.py), alternating, around one GPU alone;
# then the pieces' NCCL test.
export PYTHONUNBUFFERED=1
R=/tmp/sa; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" > $R/versions.txt
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Parallel\|Error\|error' $R/$1.txt | tr -s ' ' | cut -c1-110 | tr '\n' '|')" | tee -a $R/times.txt; }
one() { CUDA_VISIBLE_DEVICES=0 timeout 110 python3 finetune_optimized.py $common --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 140 torchrun --standalone --nproc-per-node 2 $2 $common --ddp --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one_a
for i in a b; do
  two ahead_$i finetune_optimized.py
  two after_$i results/ddp/sums_ahead/after.py
done
one one_b
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "pieces_equal" > $R/pytest_nccl.txt 2>&1; tail -3 $R/pytest_nccl.txt | tee -a $R/times.txt
tar -czf $OUT/sa.tgz -C /tmp sa
