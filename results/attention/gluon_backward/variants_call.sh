#!/bin/bash
# On an H100, from the checkout's root: variants of the Gluon backward side by side, then the fastest kept.
#
#   bash results/attention/gluon_backward/variants_call.sh NAME VARIANT...     (VARIANT as sweep.py takes it)
#
# sweep.py checks every variant against float64 and times it beside the Triton backward and cuDNN (three rounds);
# the variant with the least time over the rows, summed as a ratio to `default`'s, then has its options made the
# launcher's defaults in this copy (`option=False` -> `option=True`), and benchmark_kernels attention (BENCH=0:
# not) and the Hopper tests run with it. Everything goes to $OUT/NAME, returned as $OUT/NAME.tgz; env.txt adds the
# versions of the ptxas binaries Triton is pointed at. SWEEP_S: the sweep's time limit (240 s).
set -u
name=$1; shift
R=$OUT/$name; mkdir -p $R; t0=$(date +%s)
el() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt; }
source tools/device_env.sh $R >/dev/null
for p in "${TRITON_PTXAS_PATH:-}" "${TRITON_PTXAS_BLACKWELL_PATH:-}"; do
  [ -n "$p" ] && "$p" --version | tail -1 | tee -a $R/env.txt
done
timeout ${SWEEP_S:-240} python3 results/attention/gluon_backward/sweep.py --rounds 3 --json $R/sweep.json "$@" \
  > $R/sweep.txt 2>&1
el sweep $?
grep -c " ok$" $R/sweep.txt | tee -a $R/times.txt; grep -c "FAIL" $R/sweep.txt | tee -a $R/times.txt
python3 - $R/sweep.json <<'PY' | tee -a $R/times.txt
import json, statistics, sys
t, opts = {}, {}
for r in json.load(open(sys.argv[1]))["timings"]:
    t.setdefault((r["docs"], r["run"]), []).append(r["us"])
    if r.get("opts") is not None:  # ours; the Triton backward and cuDNN have none
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
names = {o for v in opts.values() for o in v}
for i, line in [(i, l) for i, l in enumerate(s.split("\n"), 1) if any(f"{o}=" in l for o in names)][:3]:
    print(f"{i}: {line}")  # the launcher's signature as this copy now has it
PY
if [ "${BENCH:-1}" = 1 ]; then
  timeout 150 python3 benchmark_kernels.py --kernel attention --json $R/bench_attention.json \
    > $R/bench_attention.txt 2>&1
  el bench $?
  grep -A12 "^8,192 in 1 doc" $R/bench_attention.txt | cut -c1-150
fi
timeout 150 python3 -m pytest -q -x attention_test.py -k hopper > $R/hopper_tests.txt 2>&1; el hopper_tests $?
grep -a "passed\|failed" $R/hopper_tests.txt | tail -2
cd $OUT && tar czf $name.tgz $name && rm -rf $name
