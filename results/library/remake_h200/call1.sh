#!/bin/bash
# One H200: Step 20's recomputations (the norms' outputs, a LoRA down_proj's input h), on and off alternating
# (tools/gpu_verify.sh remake): 8B LoRA r16 4 x 2,048 and 1 x 16,384, 8B full 2 x 2,048, then LoRA 1 x 32,768.
R=$OUT/c1
t0=$(date +%s)
timeout 570 bash tools/gpu_verify.sh $R remake > $R.log 2>&1
echo "remake rc=$? $(( $(date +%s) - t0 ))s" >> $R.log
mv $R.log $R/remake.log
tar -czf $OUT/c1.tgz -C $OUT c1 && rm -r $R
