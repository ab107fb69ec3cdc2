#!/bin/bash
# EXPERIMENT: the residual adds inside the norms (KFT_FUSED_RESIDUAL=1), checked on a small LLaMA, then
# 8B full 2 x 2,048 synthetic: --fp8 tensorwise and bf16, without and with it, alternating.
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local) + the experiment (fused_residual.patch)" | tee -a $R/env.txt
t0=$(date +%s)
timeout 90 python3 results/fp8/fused_residual_h100/check.py > $R/check.txt 2>&1
echo "check rc=$? $(( $(date +%s) - t0 ))s"; cat $R/check.txt | tail -4
A="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 --warmup-steps 3 --log-every 4"
for spec in fp8:0 fp8:1 fp8:0 fp8:1 bf16:0 bf16:1; do
  kind=${spec%%:*}; on=${spec##*:}; extra=""; [ $kind = fp8 ] && extra="--fp8 tensorwise"
  name=${kind}_${on}_$(( $(date +%s) % 1000 ))
  KFT_FUSED_RESIDUAL=$on timeout 80 python3 finetune_optimized.py $A $extra --json $R/$name.json > $R/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'EXPERIMENT|Average throughput|Peak memory|Final loss' $R/$name.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
done
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
