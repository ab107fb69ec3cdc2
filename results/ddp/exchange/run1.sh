#!/bin/bash
# Call 1: the reduce-scatter's movement by the copy engines? tools/comm_overlap.py in ordinary memory and in NCCL
# windows with the zero-CTA policy (its all-to-all + sum rows); then the mended default --ddp (pieces, copy engines,
# embedding rows) against one GPU, alternating; then the pieces tests over NCCL.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed\|DDP:\|graphs: step\|Parallel' $R/$1.txt | tr -s ' ' | cut -c1-160 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi -L > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" > $R/versions.txt
timeout 80 torchrun --standalone --nproc-per-node 2 tools/comm_overlap.py --memory plain --json $R/ov_plain.json > $R/ov_plain.txt 2>&1; stamp ov_plain
NCCL_CTA_POLICY=2 timeout 80 torchrun --standalone --nproc-per-node 2 tools/comm_overlap.py --memory window --json $R/ov_window_cta0.json > $R/ov_window_cta0.txt 2>&1; stamp ov_window_cta0
save
one() { CUDA_VISIBLE_DEVICES=0 timeout 90 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 90 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one_a
two ddp_a "--ddp"
one one_b
two ddp_b "--ddp"
save
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "pieces or shard_optimizer or rows" > $R/pytest_pieces.txt 2>&1; stamp pytest_pieces
save
