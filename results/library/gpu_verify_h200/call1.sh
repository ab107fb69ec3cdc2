#!/bin/bash
# One H200: every GPU test of the suite (ab_old/, the A/B's older copy, left out), after the forwards became
# InstanceForward objects, the cache's two names, and the model-patching helpers' move to swap_common.py.
R=$OUT/c1
source tools/device_env.sh $R
t0=$(date +%s)
timeout 540 python3 -m pytest -q -p no:cacheprovider --ignore=ab_old --maxfail=20 > $R/pytest_gpu.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_gpu.txt)" | tee -a $R/times.txt
grep -E "FAILED|ERROR" $R/pytest_gpu.txt | head -20
tar -czf $OUT/c1.tgz -C $OUT c1 && rm -r $R
