#!/bin/bash
# The FP8 peer again with its newest release (torchao 0.18.0), on one H100, with this tree:
# 1. benchmark_fp8.py --quick: casts, products, the four-MLP stack;
# 2. 8B full fine-tuning 2 x 2,048 synthetic rows: bf16, --fp8 tensorwise, --fp8 rowwise;
# 3. an experiment not in the code: the backward's products with the tensor cores' fast accumulation
#    (fp8_kernel.scaled_mm's default patched to fast_accum=True in a copy of the tree), to see what it would buy;
# 4. tensorwise again, then torchao tensorwise (finetune_baseline.py --compile with our other kernels).
R=$OUT/run
source tools/device_env.sh $R
python3 -c "import torchao; print('torchao', torchao.__version__)" | tee -a $R/env.txt
t0=$(date +%s)
python3 benchmark_fp8.py --quick --json $R/bench_fp8.json > $R/bench_fp8.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
ft() {  # ft NAME SCRIPT FLAGS...  (skipped once the call has run 480 s: the archive must still be written)
  local name=$1 script=$2; shift 2
  [ $(( $(date +%s) - t0 )) -gt 480 ] && { echo "$name skipped (time)" | tee -a $R/times.txt; return; }
  timeout 240 python3 $script --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 \
    --warmup-steps 3 --log-every 4 "$@" --json $R/$name.json > $R/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Average throughput|Peak memory' $R/$name.txt | tr -s ' ' | tr '\n' '|')" \
    | tee -a $R/times.txt
}
ft full_bf16 finetune_optimized.py
ft full_fp8_tw_1 finetune_optimized.py --fp8 tensorwise
ft full_fp8_rw finetune_optimized.py --fp8 rowwise
cp -r . /tmp/fastacc && sed -i 's/out_dtype, bias=None, fast_accum=False)/out_dtype, bias=None, fast_accum=True)/' /tmp/fastacc/fp8_kernel.py
grep -n "def scaled_mm" /tmp/fastacc/fp8_kernel.py | tee -a $R/times.txt
(cd /tmp/fastacc && ft full_fp8_tw_fastacc finetune_optimized.py --fp8 tensorwise)
ft full_fp8_tw_2 finetune_optimized.py --fp8 tensorwise
ft full_torchao_tw finetune_baseline.py --compile --use-custom-rmsnorm --use-custom-swiglu --use-custom-rope \
  --use-custom-flce --use-custom-adamw --torchao-fp8 tensorwise
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
