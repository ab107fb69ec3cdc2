#!/bin/bash
# The whole test suite on the GPU at this checkout (4 workers), then the tests that
# failed once more alone (workers beside each other share one GPU's memory).
R=$OUT/run
source tools/device_env.sh $R
t0=$(date +%s)
timeout 420 python3 -m pytest -v -p no:cacheprovider -n 4 --durations=15 . tests > $R/pytest.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest.txt)" | tee -a $R/times.txt
grep -E "^(FAILED|ERROR)" $R/pytest.txt | head -40
mapfile -t ids < <(grep -E "^(FAILED|ERROR) " $R/pytest.txt | sed -E 's/^(FAILED|ERROR) //; s/ - .*//' | sort -u)
if [ ${#ids[@]} -gt 0 ]; then
  timeout $(( 540 - ($(date +%s) - t0) )) python3 -m pytest -q -p no:cacheprovider "${ids[@]}" > $R/pytest_rerun.txt 2>&1
  echo "rerun alone [${ids[*]}] rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_rerun.txt)" | tee -a $R/times.txt
  grep -E "^(FAILED|ERROR)" $R/pytest_rerun.txt | head -20
fi
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
