#!/bin/bash
# 4 x H100: what a collective beside the matmuls costs per kind of memory (plain, NCCL symmetric windows, zero-CTA
# policy), then 8B full on 1 / 2 / 4 GPUs with --ddp and --ddp-shard-optimizer, then the pieces tests over NCCL.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed\|DDP:\|Parallel:' $R/$1.txt | tr -s ' ' | cut -c1-160 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi -L > $R/gpus.txt; nvidia-smi topo -m > $R/topo.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" > $R/versions.txt
env | grep -i "nccl\|symm\|nvshmem" > $R/env_nccl.txt
ov() { local n=$1 name=$2 mem=$3; shift 3
  env "$@" timeout 100 torchrun --standalone --nproc-per-node $n tools/comm_overlap.py --memory $mem --json $R/$name.json > $R/$name.txt 2>&1
  echo "$name $(( $(date +%s) - t0 ))s" >> $R/times.txt; cat $R/$name.txt | grep -v "^W11\|\*\*\*\|OMP" | tail -4 >> $R/times.txt; }
ov 2 ov2_plain plain CUDA_VISIBLE_DEVICES=0,1
ov 2 ov2_window window CUDA_VISIBLE_DEVICES=0,1
ov 2 ov2_window_zero window CUDA_VISIBLE_DEVICES=0,1 NCCL_CTA_POLICY=2
ov 4 ov4_plain plain
ov 4 ov4_window_zero window NCCL_CTA_POLICY=2
save
one() { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
many() { local n=$1; shift; env $3 timeout 120 torchrun --standalone --nproc-per-node $n finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one
CUDA_VISIBLE_DEVICES=0,1 many 2 pieces2 "--ddp --ddp-shard-optimizer --eval-every 4"
many 4 ddp4 "--ddp"
many 4 pieces4 "--ddp --ddp-shard-optimizer"
save
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "pieces or shard_optimizer" > $R/pytest_pieces.txt 2>&1; stamp pytest_pieces
save
