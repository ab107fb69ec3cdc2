#!/bin/bash
# One H200: benchmark_fp8.py with torchao 0.17 installed from the carried wheel (.whl/), so the MLP stack has torchao's
# tensorwise and rowwise rows beside ours (the code after review).
export PYTHONUNBUFFERED=1
R=/tmp/h8e; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers, torchao; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'torchao', torchao.__version__)"
  date -u +%F; } > $R/env.txt
cat $R/env.txt
timeout 330 python3 benchmark_fp8.py --quick --json $R/bench_fp8.json > $R/bench_fp8.txt 2>&1
grep -A13 "4 x LLaMA-8B MLP" $R/bench_fp8.txt | cut -c1-70
tar -czf $OUT/h8e.tgz -C /tmp h8e
