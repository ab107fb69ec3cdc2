#!/bin/bash
# h8^T by TMA copies: the kernel sweep and the MLP stack (sweep.py), then 8B full --fp8 tensorwise alternating.
R=$OUT/run
D=results/fp8/h8t_tma_h100
source tools/device_env.sh $R
echo "commit $COMMIT (local, + the TMA store uncommitted)" | tee -a $R/env.txt
t0=$(date +%s)
timeout 240 python3 $D/sweep.py --best $R/best.json > $R/sweep.txt 2>&1
echo "sweep rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
for i in 1 2; do for mode in tma pointer; do
  timeout 90 python3 $D/ab.py $mode $R/best.json --random-init --dataset synthetic --batch-size 2 --seq-len 2048 \
    --steps 12 --warmup-steps 3 --log-every 4 --fp8 tensorwise --json $R/${mode}_$i.json > $R/${mode}_$i.txt 2>&1
  echo "$mode $i rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'h8|Average throughput|Peak memory' $R/${mode}_$i.txt | tr -s ' ' | tr '\n' '|')" \
    | tee -a $R/times.txt
done; done
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
