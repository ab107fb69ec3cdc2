#!/bin/bash
# After the review's changes (the auto rule checked before NCCL starts): does the default still take the copy
# engines? The tiny model under --fsdp and --ddp on 2 GPUs, their FSDP / DDP lines and losses.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
for mode in fsdp ddp; do
  timeout 80 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --tiny --steps 6 --log-every 1 --$mode \
    --json $R/tiny_$mode.json > $R/tiny_$mode.txt 2>&1
  grep -h "FSDP:  \|DDP:  \|Final loss\|rror" $R/tiny_$mode.txt | cut -c1-260
done
tar -czf $OUT/r.tgz -C /tmp r
