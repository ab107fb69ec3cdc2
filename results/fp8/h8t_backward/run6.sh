#!/bin/bash
# One H200, the code after the reread (host-side changes only): the FP8 MLP, stacking and down_proj tests (the -k
# selects in swiglu_test.py too: 49 passed, 151 deselected).
timeout 170 python3 -m pytest -q -p no:cacheprovider fp8_test.py -k "down_proj or mlp or stack" swiglu_test.py > $OUT/pytest.txt 2>&1
tail -2 $OUT/pytest.txt; nvidia-smi --query-gpu=name --format=csv,noheader
