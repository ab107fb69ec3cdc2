#!/bin/bash
# One call: the 8K attention row under the image's Triton and under Triton 3.9 (carried, stripped: no AMD backend,
# no profiler, the image's ptxas); the whole GPU suite under 3.9; its failures alone under 3.9, then under 3.6.
R=$OUT/run
source tools/device_env.sh $R
t0=$(date +%s)
P36=$PYTHONPATH
timeout 60 python3 results/triton39_h100/attn_bench.py --one > $R/attn_t36.txt 2>&1; echo "attn 3.6 rc=$? $(( $(date +%s) - t0 ))s"
mkdir -p /tmp/t39site && tar -xJf .t39/t39.tar.xz -C /tmp/t39site
export TRITON_PTXAS_PATH=$(python3 -c 'import os, triton; print(os.path.dirname(triton.__file__))')/backends/nvidia/bin/ptxas
P39=/tmp/t39site:$P36
PYTHONPATH=$P39 TRITON_BACKENDS_IN_TREE=1 timeout 80 python3 results/triton39_h100/attn_bench.py --one > $R/attn_t39.txt 2>&1
echo "attn 3.9 rc=$? $(( $(date +%s) - t0 ))s"; cat $R/attn_t36.txt $R/attn_t39.txt | grep -v Warn | cut -c1-160
PYTHONPATH=$P39 TRITON_BACKENDS_IN_TREE=1 timeout $(( 470 - ($(date +%s) - t0) )) python3 -m pytest -v -p no:cacheprovider -n 4 --durations=10 . tests > $R/pytest39.txt 2>&1
echo "pytest 3.9 rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest39.txt)" | tee -a $R/times.txt
grep -E "^(FAILED|ERROR)" $R/pytest39.txt | cut -c1-250 | head -30
mapfile -t ids < <(grep -E "^(FAILED|ERROR) " $R/pytest39.txt | sed -E 's/^(FAILED|ERROR) //; s/ - .*//' | sort -u)
if [ ${#ids[@]} -gt 0 ]; then
  PYTHONPATH=$P39 TRITON_BACKENDS_IN_TREE=1 timeout $(( 530 - ($(date +%s) - t0) )) python3 -m pytest -q -p no:cacheprovider "${ids[@]}" > $R/pytest39_rerun.txt 2>&1
  echo "3.9 alone rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest39_rerun.txt)" | tee -a $R/times.txt
  grep -E "^(FAILED|ERROR)" $R/pytest39_rerun.txt | cut -c1-250 | head -20
  mapfile -t ids2 < <(grep -E "^(FAILED|ERROR) " $R/pytest39_rerun.txt | sed -E 's/^(FAILED|ERROR) //; s/ - .*//' | sort -u)
  if [ ${#ids2[@]} -gt 0 ]; then
    timeout $(( 585 - ($(date +%s) - t0) )) python3 -m pytest -q -p no:cacheprovider "${ids2[@]}" > $R/pytest36_rerun.txt 2>&1
    echo "3.6 alone rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest36_rerun.txt)" | tee -a $R/times.txt
    grep -E "^(FAILED|ERROR)" $R/pytest36_rerun.txt | cut -c1-250 | head -20
  fi
fi
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
