#!/bin/bash
# On an H100 (Triton 3.8+ carried), from the checkout with ptxas_sm90.patch applied: the Gluon backward with the
# two changes found offline (probe.txt), each alone and both, checked against float64 and timed beside the Triton
# backward and cuDNN; then the fastest made the default in this copy, benchmark_kernels attention and the Hopper
# tests run with it (BENCH=0: without the benchmark, as h100/ ran it). Records the ptxas versions Triton is pointed at.
set -u
R=$OUT/ptxas_sm90; mkdir -p $R; t0=$(date +%s)
el() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt; }
source tools/device_env.sh $R >/dev/null
for p in "${TRITON_PTXAS_PATH:-}" "${TRITON_PTXAS_BLACKWELL_PATH:-}"; do [ -n "$p" ] && "$p" --version | tail -1 | tee -a $R/env.txt; done
timeout 240 python3 results/attention/gluon_backward/sweep.py --rounds 3 --json $R/sweep.json default= \
  distinct=distinct_acc:1 regalloc=regalloc_default:1 both=distinct_acc:1,regalloc_default:1 > $R/sweep.txt 2>&1
el sweep $?
python3 - $R/sweep.json <<'PY' | tee -a $R/times.txt
import json, statistics, sys
rec = json.load(open(sys.argv[1])); t = {}
for r in rec["timings"]:
    t.setdefault((r["docs"], r["run"]), []).append(r["us"])
for k, v in t.items(): print(k, "median", round(statistics.median(v), 1), [round(x) for x in v])
names = ("default", "distinct", "regalloc", "both")
score = {n: sum(statistics.median(v) / statistics.median(t[(d, "default")]) for (d, m), v in t.items() if m == n)
         for n in names}
best = min(score, key=score.get)
print("sum over rows of time / default's", {n: round(x, 3) for n, x in score.items()}, "best", best)
opts = {"default": (), "distinct": ("distinct_acc",), "regalloc": ("regalloc_default",),
        "both": ("distinct_acc", "regalloc_default")}[best]
p = "attention_hopper_kernel.py"; s = open(p).read()
for o in opts:
    s = s.replace(f"{o}=False", f"{o}=True")
open(p, "w").write(s)
PY
grep -n "distinct_acc=\|regalloc_default=" attention_hopper_kernel.py | head -2 | tee -a $R/times.txt
if [ "${BENCH:-1}" = 1 ]; then
  timeout 150 python3 benchmark_kernels.py --kernel attention --json $R/bench_attention.json > $R/bench_attention.txt 2>&1
  el bench $?
  grep -A12 "^8,192 in 1 doc" $R/bench_attention.txt | cut -c1-150
fi
timeout 150 python3 -m pytest -q -x attention_test.py -k hopper > $R/hopper_tests.txt 2>&1; el hopper_tests $?
grep -a "passed\|failed" $R/hopper_tests.txt | tail -2
cd $OUT && tar czf ptxas_sm90.tgz ptxas_sm90 && rm -rf ptxas_sm90
