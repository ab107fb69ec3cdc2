#!/bin/bash
# One GPU: the dropout tests again after the fix of call 5's failure (its last check used rows of one document, which
# the measured choice had sent to SDPA on this GPU; it now uses packed rows), and the packed-rows tests beside them.
R=$OUT/c6
source tools/device_env.sh $R
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/apply_test.py -k "dropout or split_documents or packed_rows" > $R/pytest_apply_test.txt 2>&1
echo "apply_test rc=$? $(tail -1 $R/pytest_apply_test.txt)" | tee -a $R/times.txt
