#!/bin/bash
# One H200: the attention kernel's GPU tests and benchmark_kernels.py's attention rows with the current code
# (TMA loads, heaviest programs first), next to SDPA (its choice, flash only, cuDNN only) and FlexAttention.
export PYTHONUNBUFFERED=1
R=/tmp/a1; mkdir -p $R
(nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)") > $R/gpus.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider attention_test.py > $R/pytest_attention_h200.txt 2>&1; tail -2 $R/pytest_attention_h200.txt
tar -czf $OUT/a1.tgz -C /tmp a1
timeout 300 python3 benchmark_kernels.py --kernel attention --json $R/bench_attention_h200_tma.json > $R/bench_attention_h200_tma.txt 2>&1
grep -A3 "^8,192 in 1 doc\|^16,384 in" $R/bench_attention_h200_tma.txt | cut -c1-150
tar -czf $OUT/a1.tgz -C /tmp a1
