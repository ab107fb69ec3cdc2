#!/bin/bash
# After the dw fix (a frozen LoRA norm reduced dw for nothing): the residual and training tests on the
# GPU, then 8B LoRA r16 --fp8 tensorwise 4 x 2,048 with and without, alternating twice.
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 3 residual_test.py tests/train_test.py > $R/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 ))s"; tail -3 $R/tests.txt
L="--random-init --dataset synthetic --batch-size 4 --seq-len 2048 --steps 12 --warmup-steps 3 --log-every 4 --lora --lora-r 16"
for mode in off on off on; do
  flag=""; [ $mode = off ] && flag="--no-use-custom-residual"
  name=lora_${mode}_$(( $(date +%s) % 1000 ))
  timeout 80 python3 finetune_optimized.py $L --fp8 tensorwise $flag --json $R/$name.json > $R/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Residual adds|Average throughput|Peak memory|Final loss' $R/$name.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
done
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
