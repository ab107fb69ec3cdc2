#!/bin/bash
# One call if only one comes: the GPU tests of the changed files (capped at 260 s), then 8B full
# fine-tuning 2 x 2,048: ours --fp8 tensorwise, torchao 0.18 tensorwise, ours with fast accumulation
# in the backward products (an experiment, patched copy).
R=$OUT/run
source tools/device_env.sh $R
python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tee -a $R/env.txt
t0=$(date +%s)
timeout 260 python3 -m pytest -q -p no:cacheprovider --durations=15 tests/apply_test.py projections_test.py lora_test.py \
  cross_entropy_test.py linear_cross_entropy_test.py tests/cuda_graphs_test.py tests/finetune_test.py > $R/pytest.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest.txt)" | tee -a $R/times.txt
ft() {  # ft NAME SCRIPT FLAGS...  (skipped past 500 s so the archive is still written)
  local name=$1 script=$2; shift 2
  [ $(( $(date +%s) - t0 )) -gt 420 ] && { echo "$name skipped (time)" | tee -a $R/times.txt; return; }
  timeout ${LIMIT:-110} python3 $script --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 \
    --warmup-steps 3 --log-every 4 "$@" --json $R/$name.json > $R/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Average throughput|Peak memory' $R/$name.txt | tr -s ' ' | tr '\n' '|')" \
    | tee -a $R/times.txt
}
rm -rf /tmp/fastacc && cp -r . /tmp/fastacc && \
  sed -i 's/out_dtype, bias=None, fast_accum=False)/out_dtype, bias=None, fast_accum=True)/' /tmp/fastacc/fp8_kernel.py
grep -n "def scaled_mm" /tmp/fastacc/fp8_kernel.py | tee -a $R/times.txt
ft tw finetune_optimized.py --fp8 tensorwise
(cd /tmp/fastacc && ft tw_fastacc finetune_optimized.py --fp8 tensorwise)
LIMIT=170 ft torchao_tw finetune_baseline.py --compile --use-custom-rmsnorm --use-custom-swiglu --use-custom-rope \
  --use-custom-flce --use-custom-adamw --torchao-fp8 tensorwise
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
