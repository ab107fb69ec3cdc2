#!/bin/bash
# 1. The two test files that ran out of memory beside five other workers, again with two workers.
# 2. Experiment: the gradient norm's sums of squares launched in backward on a side stream
#    (results/fp8/norm_overlap_h100/norm_overlap.patch), 8B full 2 x 2,048 --fp8 tensorwise, alternating.
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 2 tests/benchmark_test.py attention_test.py > $R/pytest.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest.txt)" | tee -a $R/times.txt
rm -rf /tmp/ab && mkdir /tmp/ab && cp -r $(git ls-files | cut -d/ -f1 | sort -u) /tmp/ab/ && (cd /tmp/ab && git init -q && git apply $OLDPWD/results/fp8/norm_overlap_h100/norm_overlap.patch) && echo patched
for spec in off:0 on:8 off:0 on:8 on:1; do
  mode=${spec%%:*}; per=${spec##*:}; dir=$PWD; env=""
  if [ $mode = on ]; then dir=/tmp/ab; env="KFT_NORM_OVERLAP=$per"; fi
  name=${mode}${per}_$(( $(date +%s) % 1000 ))
  (cd $dir && env $env PYTHONPATH=$dir:/tmp/site timeout 80 python3 finetune_optimized.py --random-init --dataset synthetic \
    --batch-size 2 --seq-len 2048 --steps 12 --warmup-steps 3 --log-every 4 --fp8 tensorwise --json $R/$name.json) > $R/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'EXPERIMENT|Average throughput|Peak memory' $R/$name.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
done
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
