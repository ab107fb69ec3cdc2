#!/bin/bash
# Combinations of the backward's options timed (8K and 16K documents, two rounds), the fastest on 8K made the
# default in this copy, then benchmark_kernels attention and the 16K LoRA row, ours against SDPA.
set -u
R=$1; t0=$(date +%s)
el() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt; }
source tools/device_env.sh $R >/dev/null
timeout 200 python3 results/attention/gluon_backward/sweep.py --timings-only --rounds 2 --json $R/sweep.json \
  inline=dq_tma:1 first=dq_tma:1,dq_first:1 writer_prefetch_first=dq_tma:1,dq_writer:1,prefetch:1,dq_first:1 \
  end_all=dq_tma:1,dq_writer:1,prefetch:1,dq_first:1,from_end:1 writer_first=dq_tma:1,dq_writer:1,dq_first:1 \
  prefetch_first=dq_tma:1,prefetch:1,dq_first:1 end_prefetch_first=dq_tma:1,prefetch:1,dq_first:1,from_end:1 \
  end_writer_prefetch=dq_tma:1,dq_writer:1,prefetch:1,from_end:1 > $R/sweep.txt 2>&1; el sweep $?
grep -v "^ *$\|leaked\|nanobind" $R/sweep.txt | tail -24
python3 - $R/sweep.json <<'PY' | tee -a $R/times.txt
import json, re, sys, statistics
rec = json.load(open(sys.argv[1]))
t = {}
for r in rec["timings"]:
    if r["docs"] == "one" and r["opts"] is not None and r["run"] not in ("SDPA (cuDNN)",):
        t.setdefault(r["run"], []).append(r["us"])
# the 8K rows come first in the record: the first two of each variant
best = min(t, key=lambda n: statistics.median(t[n][:2]))
o = rec["timings"][[r["run"] for r in rec["timings"]].index(best)]["opts"]
line = "BWD_OPTIONS = dict(" + ", ".join(f"{k}={bool(o[k])}" for k in ("dq_writer", "prefetch", "dq_first", "from_end")) + ")"
print("chosen", best, line)
p = "attention_hopper_kernel.py"; s = open(p).read()
s = re.sub(r"BWD_OPTIONS = dict\([^)]*\)", line, s); open(p, "w").write(s)
PY
grep -n "^BWD_OPTIONS" attention_hopper_kernel.py | tee -a $R/times.txt
timeout 110 python3 benchmark_kernels.py --kernel attention --json $R/bench_attention.json > $R/bench_attention.txt 2>&1
el bench $?
grep -A4 "^8,192 in 1 doc" $R/bench_attention.txt | cut -c1-120
run() {  # run NAME FLAGS...
  timeout 115 python3 finetune_optimized.py --random-init --dataset synthetic --lora --batch-size 1 --steps 8 "${@:2}" \
    --json $R/$1.json > $R/$1.txt 2>&1
  el "$1 $(grep -h 'Attention:\|Real tokens\|Peak' $R/$1.txt | tr -s ' ' | tr '\n' ' ')" $?
}
run lora_16k_ours --seq-len 16384
run lora_16k_sdpa --seq-len 16384 --no-use-custom-attention
