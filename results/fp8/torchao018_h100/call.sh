#!/bin/bash
# Short: GPU tests of what changed (compile per layer, compile_regions, pickles, pad token), then the
# torchao 0.18 peer with --compile (8B, failed at layer 9 before), then ours if time is left.
R=$OUT/run
source tools/device_env.sh $R
t0=$(date +%s)
timeout 60 python3 -m pytest -q -p no:cacheprovider -x tests/compile_test.py tests/apply_test.py tests/finetune_test.py \
  -k "one_compilation or compile_regions or pickles or pad_token_is_past or compiled_decoder" > $R/pytest.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest.txt)" | tee -a $R/times.txt
ft() {  # ft NAME SCRIPT FLAGS...
  local name=$1 script=$2; shift 2
  timeout ${LIMIT:-45} python3 $script --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 \
    --warmup-steps 3 --log-every 4 "$@" --json $R/$name.json > $R/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Average throughput|Peak memory' $R/$name.txt | tr -s ' ' | tr '\n' '|')" \
    | tee -a $R/times.txt
}
LIMIT=$(( 215 - ($(date +%s) - t0) )) ft torchao_tw finetune_baseline.py --compile --use-custom-rmsnorm --use-custom-swiglu --use-custom-rope \
  --use-custom-flce --use-custom-adamw --torchao-fp8 tensorwise
[ $(( $(date +%s) - t0 )) -lt 180 ] && ft tw finetune_optimized.py --fp8 tensorwise
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
