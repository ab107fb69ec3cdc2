#!/bin/bash
# The backward with dK's wait deferred to the next step (defer_dk) against the default: checked against float64
# on six rows, timed on the 8K / packed / 16K rows beside the Triton backward and cuDNN; then, with the faster one
# as the default in this copy, benchmark_kernels attention.
set -u
# Run from the checkout with defer_dk.patch applied.
R=$OUT/k1; mkdir -p $R; t0=$(date +%s)
el() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt; }
source tools/device_env.sh $R >/dev/null
timeout 240 python3 results/attention/gluon_backward/sweep.py --rounds 3 --json $R/sweep.json \
  default= defer=defer_dk:1 defer_kv4=defer_dk:1,kv_group:4 > $R/sweep.txt 2>&1; el sweep $?
grep -v "^ *$\|leaked\|nanobind" $R/sweep.txt | tail -40
python3 - $R/sweep.json <<'PY' | tee -a $R/times.txt
import json, statistics, sys
rec = json.load(open(sys.argv[1])); t = {}
for r in rec["timings"]:
    t.setdefault((r["docs"], r["run"]), []).append(r["us"])
for k, v in t.items(): print(k, "median", round(statistics.median(v), 1), [round(x) for x in v])
PY
if [ "${BENCH_DEFER:-1}" = 1 ]; then
  sed -i 's/dq_in_place=False, defer_dk=False)/dq_in_place=False, defer_dk=True)/' attention_hopper_kernel.py
  grep -c "defer_dk=True)" attention_hopper_kernel.py | tee -a $R/times.txt
fi
timeout 150 python3 benchmark_kernels.py --kernel attention --json $R/bench_attention.json > $R/bench_attention.txt 2>&1
el bench $?
grep -B2 -A12 "8,192" $R/bench_attention.txt | cut -c1-160 | head -40
timeout 150 python3 -m pytest -q -x attention_test.py -k "hopper or gluon" > $R/hopper_tests.txt 2>&1; el hopper_tests $?
tail -3 $R/hopper_tests.txt
cd $OUT && tar czf k1.tgz k1 && rm -rf k1
