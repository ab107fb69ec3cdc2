#!/bin/bash
# The whole test suite on the GPU, the code as committed (6 workers, one file each).
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
python3 -c "import accelerate, peft, trl, datasets; print('accelerate', accelerate.__version__, 'peft', peft.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__)" 2>&1 | tail -1 | tee -a $R/env.txt
t0=$(date +%s)
timeout 500 python3 -m pytest -v -p no:cacheprovider -n 6 --durations=20 . tests > $R/pytest.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest.txt)" | tee -a $R/times.txt
grep -E "FAILED|ERROR" $R/pytest.txt | head -40
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
