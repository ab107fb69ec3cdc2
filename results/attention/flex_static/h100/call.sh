#!/usr/bin/env bash
# H100: FlexAttention compiled as before vs static per shape; the attention benchmark with the fixed peer.
O=$OUT/c2
source tools/device_env.sh $O
t0=$(date +%s)
timeout 200 python results/attention/flex_static/flex_compile_ab.py --json $O/flex_ab.json > $O/flex_ab.txt 2>&1
echo "ab rc=$? $(( $(date +%s) - t0 ))s" | tee -a $O/times.txt
grep -v "Warning\|warn_once\|leaked\|nanobind\|skipped remainder" $O/flex_ab.txt
t0=$(date +%s)
timeout 330 python benchmark_kernels.py --kernel attention --json $O/bench_attention.json > $O/bench_attention.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 ))s" | tee -a $O/times.txt
grep -A30 "Attention in packed rows benchmark" $O/bench_attention.txt | grep -v "Warning\|warn_once"
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
