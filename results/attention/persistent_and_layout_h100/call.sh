#!/usr/bin/env bash
# Ran with persistent.patch and check_bench.patch applied: the forward's persistent grid as a launcher option (not
# kept: no faster) and its rows in check_bench.
# H100, one call: (1) the Gluon forward, one program per query tile against the persistent grid (check_bench);
# (2) the faster made the default in this copy; (3) benchmark_kernels attention; (4) the Hopper tests (the backward's
# gradients in the inputs' layout among them); between (1) and (3) the backward alone with its gradients in the
# inputs' layout and with key/value heads in groups of 2 and 4 (sweep.py).
O=$OUT/all
source tools/device_env.sh $O >/dev/null
t0=$SECONDS
el() { echo "$1 rc=$2 $((SECONDS-t0))s" | tee -a $O/times.txt; }
pack() { (cd $OUT && tar czf all.tgz all); }
timeout 170 python3 results/attention/gluon_forward/check_bench.py --json $O/check_bench.json > $O/check_bench.txt 2>&1
el check_bench $?
grep -E "correctness|FAIL|again" $O/check_bench.txt | tail -40; grep -A5 "^16,384 tokens" $O/check_bench.txt
python3 - $O/check_bench.json <<'PY' | tee -a $O/times.txt
import json, statistics, sys
t = {}
for r in json.load(open(sys.argv[1]))["timings"]:
    if r.get("T") and r["run"].startswith("again gluon"):
        t.setdefault((r["T"], r["D"], "persistent" in r["run"]), []).append(r["us"])
ratio = [statistics.median(t[(T, D, True)]) / statistics.median(t[(T, D, False)]) for (T, D, p) in t if p]
print("persistent / per tile, each shape:", [round(x, 4) for x in ratio])
if ratio and max(ratio) < 1.0:
    p = "attention_hopper_kernel.py"; s = open(p).read()
    s = s.replace("                             persistent=False):", "                             persistent=True):"); open(p, "w").write(s)
    print("persistent made the default in this copy")
PY
pack
timeout 150 python3 results/attention/gluon_backward/sweep.py --rounds 3 --json $O/sweep.json default= \
  hf=grads_like_inputs:1 kv2=kv_group:2 kv4=kv_group:4 > $O/sweep.txt 2>&1
el sweep $?; grep -c " ok$" $O/sweep.txt; grep -c FAIL $O/sweep.txt; tail -30 $O/sweep.txt | cut -c1-160
pack
timeout 110 python3 benchmark_kernels.py --kernel attention --json $O/bench_attention.json > $O/bench_attention.txt 2>&1
el bench $?; grep -A4 "^8,192 in 1 doc" $O/bench_attention.txt | cut -c1-150
pack
timeout 110 python3 -m pytest -q -x attention_test.py -k hopper > $O/hopper_tests.txt 2>&1; el hopper_tests $?
grep -a "passed\|failed" $O/hopper_tests.txt | tail -2
pack
rm -rf $O
