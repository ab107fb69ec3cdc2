#!/bin/bash
# From commit 1eebb44 with own_waits.patch applied (the two settings as launcher options).
# On an H100: the Gluon backward with its tensor-core waits for the issuing warp group only (own_waits: no barrier
# of both warp groups after each), with and without ptxas's default register allocation (regalloc_default), checked
# against float64 and timed beside the Triton backward and cuDNN (sweep.py); the fastest over the rows is then made
# the launcher's default in this copy, and benchmark_kernels attention and the Hopper tests run with it.
# VARIANTS="default= own=own_waits:1" narrows the sweep. Records which ptxas assembled (tools/device_env.sh; with
# a Triton packed --with-ptxas, the release's own).
set -u
R=$OUT/own_waits; mkdir -p $R; t0=$(date +%s)
el() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt; }
source tools/device_env.sh $R >/dev/null
VARIANTS=${VARIANTS:-default= own=own_waits:1 regalloc=regalloc_default:1 both=own_waits:1,regalloc_default:1}
timeout ${SWEEP_S:-240} python3 results/attention/gluon_backward/sweep.py --rounds 3 --json $R/sweep.json $VARIANTS \
  > $R/sweep.txt 2>&1
el sweep $?
grep -c " ok$" $R/sweep.txt | tee -a $R/times.txt; grep -c "FAIL" $R/sweep.txt | tee -a $R/times.txt
python3 - $R/sweep.json <<'PY' | tee -a $R/times.txt
import json, statistics, sys
t, opts = {}, {}
for r in json.load(open(sys.argv[1]))["timings"]:
    t.setdefault((r["docs"], r["run"]), []).append(r["us"])
    if r.get("opts") is not None:
        opts[r["run"]] = tuple(r["opts"])
for k, v in t.items(): print(k, "median", round(statistics.median(v), 1), [round(x) for x in v])
score = {n: sum(statistics.median(v) / statistics.median(t[(d, "default")]) for (d, m), v in t.items() if m == n)
         for n in opts}
best = min(score, key=score.get)
print("sum over rows of time / default's", {n: round(x, 3) for n, x in score.items()}, "best", best)
p = "attention_hopper_kernel.py"; s = open(p).read()
for o in opts[best]:
    s = s.replace(f"{o}=False", f"{o}=True")
open(p, "w").write(s)
PY
grep -n "own_waits=\|regalloc_default=" attention_hopper_kernel.py | head -3 | tee -a $R/times.txt
if [ "${BENCH:-1}" = 1 ]; then
  timeout 150 python3 benchmark_kernels.py --kernel attention --json $R/bench_attention.json > $R/bench_attention.txt 2>&1
  el bench $?
  grep -A12 "^8,192 in 1 doc" $R/bench_attention.txt | cut -c1-150
fi
timeout 150 python3 -m pytest -q -x attention_test.py -k hopper > $R/hopper_tests.txt 2>&1; el hopper_tests $?
grep -a "passed\|failed" $R/hopper_tests.txt | tail -2
cd $OUT && tar czf own_waits.tgz own_waits && rm -rf own_waits
