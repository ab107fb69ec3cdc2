#!/bin/bash
# Two GPUs of another kind: 8B full 2 x 2048 per GPU, one GPU alone against --ddp with the pieces gathered by the copy
# engines (the default), by NCCL's kernels, all-reduced; NCCL_MAX_CTAS for the reduce-scatters; --fp8 tensorwise;
# torchrun with neither flag.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed\|DDP:\|Parallel:\|graphs: step' $R/$1.txt | tr -s ' ' | cut -c1-200 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi -L > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" > $R/versions.txt
one() { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { env $3 timeout 120 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one
two ce2 "--ddp"
two sm2 "--ddp --no-ddp-copy-engines"
two ar2 "--ddp --no-ddp-shard-optimizer"
save
two ce2_ctas16 "--ddp" NCCL_MAX_CTAS=16
two ce2_ctas8 "--ddp" NCCL_MAX_CTAS=8
two chosen ""
save
one one_fp8 "--fp8 tensorwise"
two ce2_fp8 "--ddp --fp8 tensorwise"
two ce2_again "--ddp"
save
