#!/bin/bash
# GPU tests of the hook fixes (lora, projections, rope, swiglu, fused loss, apply).
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
python3 -c "import accelerate, peft; print('accelerate', accelerate.__version__, 'peft', peft.__version__)" 2>&1 | tee -a $R/env.txt
t0=$(date +%s)
timeout 480 python3 -m pytest -q -p no:cacheprovider -n 4 --durations=15 tests/apply_test.py lora_test.py projections_test.py \
  swiglu_test.py linear_cross_entropy_test.py rope_test.py > $R/pytest.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest.txt)" | tee -a $R/times.txt
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
