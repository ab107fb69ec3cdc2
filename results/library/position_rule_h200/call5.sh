#!/bin/bash
# One GPU, call 4's test step again with the wheels in .whl/ (call 4 ran without .whl/: apply_test could not import
# datasets): tests/apply_test.py and the whole attention_test.py; the outputs in one archive.
R=$OUT/c5
source tools/device_env.sh $R
t0=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/apply_test.py > $R/pytest_apply_test.txt 2>&1
echo "apply_test rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_apply_test.txt)" | tee -a $R/times.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider attention_test.py > $R/pytest_attention.txt 2>&1
echo "attention_test rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_attention.txt)" | tee -a $R/times.txt
tar -czf $OUT/c5.tgz -C $OUT c5 && rm -r $R
