#!/usr/bin/env bash
# Call 2: benchmark_fp8.py (the MLP stack, gate/up stacked and not; torchao beside it).
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers, torchao; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'torchao', torchao.__version__)"
  date -u +%F; } > $R/env.txt
python3 benchmark_fp8.py --json $R/bench_fp8.json > $R/bench_fp8.txt 2>&1
echo "rc $?"
cd $R && tar czf $OUT/call2.tgz . && cp bench_fp8.txt $OUT/
