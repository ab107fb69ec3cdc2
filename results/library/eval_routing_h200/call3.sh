#!/bin/bash
# One GPU, after call 2's one failure (a test assumption: its unmasked batch had rows of one document, which the
# measured choice sends to SDPA on this GPU; it uses packed rows now): that test, then 8B full fine-tuning
# 2 x 2,048 synthetic rows again, this change against the commit before it (ab_old/), alternating, old first.
R=$OUT/c3
source tools/device_env.sh $R
t0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/apply_test.py -k sequence_classifier > $R/pytest_apply_test.txt 2>&1
echo "apply_test -k sequence_classifier rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_apply_test.txt)" | tee -a $R/times.txt
run() {  # run NAME DIR FLAGS...
  local name=$1 dir=$2; shift 2
  (cd $dir && PYTHONPATH="$PWD:/tmp/site" timeout 100 python3 finetune_optimized.py "$@" --json $R/$name.json) \
    > $R/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Peak memory' $R/$name.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
}
full="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12"
run full_1_old ab_old $full; run full_2_new . $full; run full_3_old ab_old $full; run full_4_new . $full
tar -czf $OUT/c3.tgz -C $OUT c3 && rm -r $R
