#!/bin/bash
# The final code of the recomputations (164ee87's shared LoRA products, the measurement of plain rows kept out of the
# caller's saved-tensor hooks, the compiled RoPE copy's own globals): the GPU tests of the files they touch, then the default
# commands of c1 once each (8B LoRA r16 4 x 2,048 and 1 x 16,384, 8B full 2 x 2,048) to compare with c1 on the same kind of GPU.
R=$OUT/c3
source tools/device_env.sh $R
t0=$(date +%s)
timeout 300 python3 -m pytest -q -p no:cacheprovider swiglu_test.py lora_test.py projections_test.py rope_test.py tests/compile_test.py \
  tests/apply_test.py > $R/pytest_gpu.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_gpu.txt)" | tee -a $R/times.txt
grep -E "FAILED|ERROR" $R/pytest_gpu.txt | head -20
for spec in "lora 4 2048" "lora 1 16384" "full 2 2048"; do
  set -- $spec
  common="--random-init --dataset synthetic --batch-size $2 --seq-len $3 --steps 12 --log-every 4"
  [ "$1" = lora ] && common="$common --lora"
  timeout 95 python3 finetune_optimized.py $common --json $R/default_$1_$2x$3.json > $R/default_$1_$2x$3.log 2>&1
  echo "$spec rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Average throughput|Peak memory' $R/default_$1_$2x$3.log | tr '\n' '|')" \
    | tee -a $R/times.txt
done
tar -czf $OUT/c3.tgz -C $OUT c3 && rm -r $R
