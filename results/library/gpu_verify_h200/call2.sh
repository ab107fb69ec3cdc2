#!/bin/bash
# One H200: the default command, this code ("new") against 62612be ("old", ab_old/: before the forwards became
# InstanceForward objects), alternating; then the rest of the GPU suite's files that call 1 did not reach.
R=$OUT/c2
source tools/device_env.sh $R
t0=$(date +%s)
run() {  # run NAME DIR FLAGS...
  local name=$1 dir=$2; shift 2
  (cd $dir && PYTHONPATH="$PWD:/tmp/site" timeout 120 python3 finetune_optimized.py "$@" --json $R/$name.json) \
    > $R/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Real tokens\|Peak memory' $R/$name.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
}
lora="--random-init --lora --batch-size 4 --seq-len 2048 --steps 12"
full="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12"
run lora_1_new . $lora; run lora_2_old ab_old $lora; run lora_3_new . $lora; run lora_4_old ab_old $lora
run full_1_new . $full; run full_2_old ab_old $full; run full_3_new . $full; run full_4_old ab_old $full
left=$(( 560 - ($(date +%s) - t0) ))
timeout $left python3 -m pytest -v -p no:cacheprovider tests/cuda_graphs_test.py tests/train_test.py tests/compile_test.py \
  tests/families_test.py tests/finetune_test.py > $R/pytest_gpu_rest.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_gpu_rest.txt)" | tee -a $R/times.txt
grep -E "FAILED|ERROR" $R/pytest_gpu_rest.txt | head -20
tar -czf $OUT/c2.tgz -C $OUT c2 && rm -r $R
