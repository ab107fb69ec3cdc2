#!/bin/bash
# 8B full fine-tuning, 500 steps on the bundled data, --fp8 tensorwise: the code as it is, then the same with
# fast accumulation in the backward products too (torch._scaled_mm use_fast_accum=True; a patched copy).
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
t0=$(date +%s)
run() {  # NAME: 500 steps, the loss500 command of results/fp8/
  timeout 260 python3 finetune_optimized.py --random-init --batch-size 2 --seq-len 2048 --steps 500 --log-every 50 \
    --fp8 tensorwise --json $R/$1.json > $R/$1.txt 2>&1
  echo "$1 rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Average throughput|Peak memory' $R/$1.txt | tr -s ' ' | tr '\n' '|')" \
    | tee -a $R/times.txt
}
run loss500_tw
sed -i 's/out_dtype, bias=None, fast_accum=False):/out_dtype, bias=None, fast_accum=True):/' fp8_kernel.py
grep -c "bias=None, fast_accum=True):" fp8_kernel.py | tee -a $R/times.txt
run loss500_tw_fastacc
git checkout fp8_kernel.py 2>/dev/null
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
