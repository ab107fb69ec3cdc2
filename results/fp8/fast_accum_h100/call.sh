#!/bin/bash
# --fp8-fast-accum: GPU tests of fp8_test.py, then 8B full 2 x 2,048 --fp8 tensorwise without and with it, alternating.
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider fp8_test.py > $R/pytest.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest.txt)" | tee -a $R/times.txt
for i in 1 2; do for mode in precise fast; do
  extra=""; [ $mode = fast ] && extra="--fp8-fast-accum"
  timeout 75 python3 finetune_optimized.py --random-init --dataset synthetic --batch-size 2 --seq-len 2048 \
    --steps 12 --warmup-steps 3 --log-every 4 --fp8 tensorwise $extra --json $R/${mode}_$i.json > $R/${mode}_$i.txt 2>&1
  echo "$mode $i rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Average throughput|Peak memory' $R/${mode}_$i.txt | tr -s ' ' | tr '\n' '|')" \
    | tee -a $R/times.txt
done; done
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
