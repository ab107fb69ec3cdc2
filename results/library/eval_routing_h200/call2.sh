#!/bin/bash
# One GPU, after call 1's failure was fixed (the gradient probe's walk now keeps its output referenced): the whole
# tests/apply_test.py again; then the default command with this change against the commit before it (ab_old/, that
# commit's files), alternating in one call: 8B LoRA r16 on the bundled data (packed, 4 x 2,048) and 8B full
# fine-tuning 2 x 2,048 synthetic rows, 12 steps each.
R=$OUT/c2
source tools/device_env.sh $R
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/apply_test.py > $R/pytest_apply_test.txt 2>&1
echo "apply_test rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_apply_test.txt)" | tee -a $R/times.txt
run() {  # run NAME DIR FLAGS...
  local name=$1 dir=$2; shift 2
  # that checkout first on the path, then the wheels device_env.sh installed
  (cd $dir && PYTHONPATH="$PWD:/tmp/site" timeout 120 python3 finetune_optimized.py "$@" --json $R/$name.json) \
    > $R/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(grep -h 'Attention:\|Average throughput\|Real tokens\|Peak memory' $R/$name.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
}
lora="--random-init --lora --batch-size 4 --seq-len 2048 --steps 12"
full="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12"
run lora_1_new . $lora; run lora_2_old ab_old $lora; run lora_3_new . $lora; run lora_4_old ab_old $lora
run full_1_new . $full; run full_2_old ab_old $full; run full_3_new . $full; run full_4_old ab_old $full
tar -czf $OUT/c2.tgz -C $OUT c2 && rm -r $R
