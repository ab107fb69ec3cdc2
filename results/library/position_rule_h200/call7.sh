#!/bin/bash
# One GPU, on the final code (with .whl/ present): the whole tests/apply_test.py (the attention-dropout, position-id,
# return_dict=False and modules_to_save tests among it) and linear_cross_entropy_test.py.
R=$OUT/c7
source tools/device_env.sh $R
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/apply_test.py > $R/pytest_apply_test.txt 2>&1
echo "apply_test rc=$? $(tail -1 $R/pytest_apply_test.txt)" | tee -a $R/times.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider linear_cross_entropy_test.py > $R/pytest_flce.txt 2>&1
echo "linear_cross_entropy_test rc=$? $(tail -1 $R/pytest_flce.txt)" | tee -a $R/times.txt
