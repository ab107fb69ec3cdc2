#!/bin/bash
# One GPU, the final code: the GPU test files the change touches (the routing and its measured choice, the
# scripts' default, CUDA graphs, the attention kernel), each under its own time limit.
# Call 4: FILES="tests/finetune_test.py:150 attention_test.py:330" CALL=c4 after the finetune_test fix (and
# attention_test under a limit it fits); call 5: FILES="tests/finetune_test.py:150" CALL=c5 after the second fix.
export PYTHONUNBUFFERED=1
R=$OUT/${CALL:-c3}; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH="$PWD:$PYTHONPATH"
t0=$(date +%s)
for f in ${FILES:-tests/apply_test.py:230 tests/finetune_test.py:150 tests/cuda_graphs_test.py:100 attention_test.py:70}; do
  timeout ${f#*:} python3 -m pytest -q -p no:cacheprovider ${f%:*} > $R/pytest_$(basename ${f%:*} .py).txt 2>&1
  echo "${f%:*} rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_$(basename ${f%:*} .py).txt)" | tee -a $R/times.txt
done
