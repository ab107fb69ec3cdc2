#!/bin/bash
# One GPU: the GPU tests of the files this change touches (with .whl/ present): the library's tests, the fused LoRA,
# the projection groups, both losses, the CUDA-graph step and the loop (its held-out loss runs under loss_only).
R=$OUT/c1
source tools/device_env.sh $R
t0=$(date +%s)
for f in tests/apply_test.py lora_test.py projections_test.py linear_cross_entropy_test.py cross_entropy_test.py \
         tests/cuda_graphs_test.py tests/train_test.py; do
  name=$(basename $f .py)
  timeout 200 python3 -m pytest -q -p no:cacheprovider $f > $R/pytest_$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_$name.txt)" | tee -a $R/times.txt
done
tar -czf $OUT/c1.tgz -C $OUT c1 && rm -r $R
