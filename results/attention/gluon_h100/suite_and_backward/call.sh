#!/bin/bash
# The backward variants under the machine's Triton, then the whole suite, then its failures alone.
set -u
R=$OUT/run; mkdir -p $R
source tools/device_env.sh $R
t0=$(date +%s)
timeout 60 python3 results/attention/gluon_backward/sweep.py --json $R/sweep36.json base= heavy=heavy_first:1 \
  noatom=heavy_first:1,dq_mode:1 > $R/sweep36.txt 2>&1
echo "sweep rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
left=$(( 560 - ($(date +%s) - t0) ))
timeout $(( left - 90 )) python3 -m pytest -v -p no:cacheprovider -n 4 --durations=15 . tests > $R/pytest.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest.txt)" | tee -a $R/times.txt
mapfile -t ids < <(grep -E "^(FAILED|ERROR) " $R/pytest.txt | sed -E 's/^(FAILED|ERROR) //; s/ - .*//' | sort -u)
if [ ${#ids[@]} -gt 0 ]; then
  timeout $(( 565 - ($(date +%s) - t0) )) python3 -m pytest -q -p no:cacheprovider "${ids[@]}" > $R/pytest_rerun.txt 2>&1
  echo "rerun alone [${ids[*]}] rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_rerun.txt)" | tee -a $R/times.txt
fi
grep -h "TFLOP\|FAIL" $R/sweep36.txt | head -40
grep -hE "^(FAILED|ERROR)" $R/pytest.txt $R/pytest_rerun.txt 2>/dev/null | head -30
