#!/bin/bash
# Today's transformers (5.25.0, with the `kernels` package it now requires) on a GPU, beside the pinned 5.17.0 of the
# machine's image: the GPU tests of the files that meet HF's model code, then the default 8B LoRA command once with
# each version in the same call. The wheels (transformers, kernels, huggingface_hub, tokenizers, ...) come in
# .whl/today/ and go to /tmp/today, which only the runs marked 5.25 put on the path.
R=$OUT/today
source tools/device_env.sh $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/today .whl/today/*.whl
PINNED=$PYTHONPATH
TODAY=$PWD:/tmp/today:${PYTHONPATH#$PWD:}
t0=$(date +%s)
PYTHONPATH=$TODAY python3 -c "import transformers, kernels, huggingface_hub, tokenizers, peft, accelerate; print('today: transformers', transformers.__version__, 'kernels', kernels.__version__, 'huggingface_hub', huggingface_hub.__version__, 'tokenizers', tokenizers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)" 2>&1 | tail -1 | tee -a $R/env.txt
grep -q "^today:" $R/env.txt || { tar -czf $OUT/today.tgz -C $OUT today; exit 1; }
PYTHONPATH=$TODAY timeout 330 python3 -m pytest -q -p no:cacheprovider rope_test.py tests/compile_test.py \
  tests/apply_test.py tests/cuda_graphs_test.py tests/families_test.py > $R/pytest_gpu_today.txt 2>&1
echo "pytest (5.25) rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_gpu_today.txt)" | tee -a $R/times.txt
grep -E "^(FAILED|ERROR)" $R/pytest_gpu_today.txt | head -20
common="--random-init --dataset synthetic --batch-size 4 --seq-len 2048 --steps 12 --log-every 4 --lora"
for v in pinned today; do
  [ $v = pinned ] && P=$PINNED || P=$TODAY
  PYTHONPATH=$P timeout 100 python3 finetune_optimized.py $common --json $R/lora_4x2048_$v.json > $R/lora_4x2048_$v.log 2>&1
  echo "$v rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'Versions|Average throughput|Peak memory' $R/lora_4x2048_$v.log | tr '\n' '|')" \
    | tee -a $R/times.txt
done
tar -czf $OUT/today.tgz -C $OUT today && rm -r $R
