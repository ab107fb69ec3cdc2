#!/bin/bash
# After the fixes: the residual kernel's tests and the library's on the GPU.
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
t0=$(date +%s)
timeout 400 python3 -m pytest -q -p no:cacheprovider -n 3 residual_test.py tests/apply_test.py \
  "fp8_test.py::test_fine_tune_switches_fp8_in_with_every_kernel" > $R/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 ))s"; tail -4 $R/tests.txt
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
