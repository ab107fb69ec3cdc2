#!/bin/bash
# The backward's program order: key/value heads in groups filling one wave (default) against the earlier order (all
# heads interleaved, kv_group = B * Hkv) and fixed groups; Hopper tests; ncu of the two orders; benchmark; 16K LoRA.
set -u
R=$1; t0=$(date +%s)
el() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s"; }
source tools/device_env.sh $R >/dev/null
timeout 150 python3 results/attention/gluon_backward/sweep.py --timings-only --rounds 2 --json $R/sweep_order.json \
  default= interleaved=kv_group:1024 group1=kv_group:1 group2=kv_group:2 group4=kv_group:4 > /tmp/sweep.txt 2>&1
el sweep $?; grep "us " /tmp/sweep.txt
timeout 60 ncu --clock-control none -k regex:"attn_bwd_hopper|cudnn|sdpa|fort" --launch-count 8 --section SpeedOfLight \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
  python3 results/attention/gluon_backward/ncu_bwd.py default= interleaved=kv_group:1024 > $R/ncu_order.txt 2>&1
el ncu $?; grep -E "dram__bytes|Duration|hit_rate" $R/ncu_order.txt
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 6 attention_test.py -k "hopper_backward or one_document" \
  > $R/attention_test.txt 2>&1; rc=$?; el "tests $(grep -E 'passed|failed' $R/attention_test.txt | tail -1)" $rc
timeout 100 python3 benchmark_kernels.py --kernel attention --json $R/bench_attention.json > $R/bench_attention.txt 2>&1
el bench $?; grep -A4 "^8,192 in 1 doc" $R/bench_attention.txt | cut -c1-110
for a in ours sdpa; do
  timeout 90 python3 finetune_optimized.py --random-init --dataset synthetic --lora --batch-size 1 --steps 8 \
    --seq-len 16384 $([ $a = sdpa ] && echo --no-use-custom-attention) --json /tmp/l_$a.json > /tmp/l_$a.txt 2>&1; rc=$?
  el "lora_16k_$a $(grep -h 'measured fwd+bwd\|Real tokens\|Peak' /tmp/l_$a.txt | tr -s ' ' | tr '\n' ' ')" $rc
  cat /tmp/l_$a.txt >> $R/lora_16k.txt
done
