#!/bin/bash
# The eager FP8 step's host time: 8B full 2 x 2,048 --fp8 tensorwise --no-cuda-graphs, plain, then under cProfile.
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
t0=$(date +%s)
A="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --warmup-steps 3 --log-every 4 --fp8 tensorwise --no-cuda-graphs"
timeout 120 python3 finetune_optimized.py $A --steps 12 --json $R/eager.json > $R/eager.txt 2>&1
echo "eager rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Average throughput|Peak memory' $R/eager.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
timeout 120 python3 finetune_optimized.py $A --steps 12 --cuda-graphs > $R/graphs.txt 2>&1
echo "graphs rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Average throughput|Peak memory' $R/graphs.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
timeout 200 python3 -m cProfile -o $R/eager.prof finetune_optimized.py $A --steps 8 > $R/cprofile_run.txt 2>&1
echo "cprofile rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
python3 - $R <<'PY' > $R/cprofile_top.txt 2>&1
import pstats, sys
p = pstats.Stats(sys.argv[1] + "/eager.prof")
p.sort_stats("tottime").print_stats(45)
p.sort_stats("cumtime").print_stats(70)
PY
head -80 $R/cprofile_top.txt | tail -60
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
