#!/bin/bash
# One GPU, the code after review: the GPU tests of the changed kernel files, and one 8B --fp8 tensorwise run.
export PYTHONUNBUFFERED=1
R=/tmp/h8d; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.txt
timeout 220 python3 -m pytest -q -p no:cacheprovider fp8_test.py swiglu_test.py projections_test.py > $R/pytest.txt 2>&1; tail -2 $R/pytest.txt
timeout 120 python3 finetune_optimized.py --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 \
  --log-every 4 --fp8 tensorwise --json $R/fp8.json > $R/fp8.txt 2>&1
grep -h 'Custom swiglu\|Average throughput\|Peak memory' $R/fp8.txt
tar -czf $OUT/h8d.tgz -C /tmp h8d
