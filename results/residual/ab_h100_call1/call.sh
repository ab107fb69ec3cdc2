#!/bin/bash
# The residual adds inside the norms (residual_kernel.py): GPU tests, then 8B A/B alternating
# (--no-use-custom-residual against the default), FP8 tensorwise, bf16, LoRA r16 FP8.
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
t0=$(date +%s)
timeout 260 python3 -m pytest -q -p no:cacheprovider -n 3 residual_test.py rmsnorm_test.py lora_test.py fp8_test.py \
  tests/cuda_graphs_test.py > $R/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 ))s"; tail -5 $R/tests.txt
A="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 --warmup-steps 3 --log-every 4"
L="--random-init --dataset synthetic --batch-size 4 --seq-len 2048 --steps 12 --warmup-steps 3 --log-every 4 --lora --lora-r 16"
for spec in fp8:off fp8:on fp8:off fp8:on bf16:off bf16:on lora:off lora:on; do
  kind=${spec%%:*}; mode=${spec##*:}; args="$A --fp8 tensorwise"
  [ $kind = bf16 ] && args="$A"; [ $kind = lora ] && args="$L --fp8 tensorwise"
  flag=""; [ $mode = off ] && flag="--no-use-custom-residual"
  name=${kind}_${mode}_$(( $(date +%s) % 1000 ))
  timeout 80 python3 finetune_optimized.py $args $flag --json $R/$name.json > $R/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Residual adds|Average throughput|Peak memory|Final loss' $R/$name.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
done
