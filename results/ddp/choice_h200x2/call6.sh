#!/usr/bin/env bash
# Call 6 (2 x H100): 8B full fine-tuning under torchrun with neither --fsdp nor --ddp (REPLICA_SHARE 0.8: --ddp on an
# 80 GB H100) against GPU 0 alone, same call; then the GPU tests of fp8_test.py and swiglu_test.py on GPU 0.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R; export PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  date -u +%F; } > $R/env.txt
t0=$SECONDS
F="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 --log-every 4"
summary() { python3 -c "import json; d=json.load(open('$R/$1.json')); print('tok/s', round(d['tokens_per_sec']), 'per GPU', round(d.get('tokens_per_sec_per_gpu') or d['tokens_per_sec']), 'GiB', round(d['peak_memory_bytes']/2**30, 2), 'losses', [round(s['loss'],4) for s in d['steps']][-3:])" 2>&1 | tail -1; }
CUDA_VISIBLE_DEVICES=0 python3 finetune_optimized.py $F --json $R/one_gpu.json > $R/one_gpu.txt 2>&1
echo "one_gpu $((SECONDS-t0))s $(summary one_gpu)" >> $R/times.txt
torchrun --standalone --nproc-per-node 2 finetune_optimized.py $F --json $R/two_gpus_default.json > $R/two_gpus_default.txt 2>&1
echo "two_gpus_default $((SECONDS-t0))s $(summary two_gpus_default) $(grep -m1 'Parallel:' $R/two_gpus_default.txt)" >> $R/times.txt
CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider fp8_test.py swiglu_test.py > $R/pytest_gpu.txt 2>&1
echo "pytest $((SECONDS-t0))s $(tail -1 $R/pytest_gpu.txt)" >> $R/times.txt
