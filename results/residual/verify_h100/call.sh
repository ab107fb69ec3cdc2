#!/bin/bash
# One H100 call: GPU import check of kernel_common, then Step 24's A/B through tools/gpu_verify.sh,
# then --fp8-fast-accum against the default, alternating. Everything lands in $OUT/r, tarred at the end.
R=$OUT/r; mkdir -p $R
source tools/device_env.sh $R
start=$(date +%s)
python3 -m pytest -q -p no:cacheprovider kernel_common_test.py 2>&1 | tail -3 | tee $R/pytest_kernel_common.txt
bash tools/gpu_verify.sh $R/residual residual 2>&1 | tee $R/residual.txt
echo "residual step: $(( $(date +%s) - start )) s" | tee -a $R/times.txt
full="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 --warmup-steps 3 --log-every 4 --fp8 tensorwise"
for i in 1 2; do
  for mode in precise fast; do
    flag=""; [ $mode = fast ] && flag="--fp8-fast-accum"
    python3 finetune_optimized.py $full $flag --json $R/fastaccum_${mode}_$i.json > $R/fastaccum_${mode}_$i.log 2>&1
    echo "$mode $i: $(grep -E 'Average throughput|Peak memory' $R/fastaccum_${mode}_$i.log | tr '\n' ' ')" | tee -a $R/times.txt
  done
done
echo "total: $(( $(date +%s) - start )) s" | tee -a $R/times.txt
cd $OUT && tar czf all.tgz r && rm -rf r
