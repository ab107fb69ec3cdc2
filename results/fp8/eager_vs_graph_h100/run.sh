#!/bin/bash
# One GPU, 8B full 2 x 2048: FP8 tensorwise and bf16, CUDA graph vs eager (what the eager FSDP step pays).
OUT=${OUT:-/tmp/eag}; W=/tmp/eagw; mkdir -p $OUT $W
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  date -u +%F; } > $W/env.txt 2>&1
T0=$(date +%s)
left() { echo $(( ${LIMIT:-570} - $(date +%s) + T0 )); }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s $(grep -h 'Average throughput\|Peak memory\|CUDA graphs:\|rror' $W/$1.txt 2>/dev/null | cut -c1-160 | tr '\n' ' ')" | tee -a $W/times.txt; tar czf $OUT/eag.tgz -C $W .; }
one() { local n=$1; shift; timeout $(left) python3 finetune_optimized.py "$@" --json $W/$n.json > $W/$n.txt 2>&1; stamp $n; }
FULL="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --warmup-steps 4 --steps 12 --log-every 4"
one fp8_graph $FULL --fp8 tensorwise
one fp8_eager $FULL --fp8 tensorwise --no-cuda-graphs
one bf16_eager $FULL --no-cuda-graphs
one bf16_graph $FULL
