#!/bin/bash
# 1. GPU tests of what changed last: compile tests, compile_regions, pickles, the pad-token refusal.
# 2. benchmark_fp8.py --quick with torchao 0.18.0: the MLP stack on this GPU.
# 3. The 8B FP8 tensorwise step's profile, 60 rows.
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
python3 -c "import torchao, accelerate; print('torchao', torchao.__version__, 'accelerate', accelerate.__version__)" 2>&1 | tee -a $R/env.txt
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider --durations=10 tests/compile_test.py swap_common_test.py \
  tests/apply_test.py tests/finetune_test.py -k "compile or pickles or pad_token or recomputes_a_masked or one_compilation" \
  > $R/pytest.txt 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest.txt)" | tee -a $R/times.txt
timeout 230 python3 benchmark_fp8.py --quick --json $R/bench_fp8.json > $R/bench_fp8.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
left=$(( 560 - ($(date +%s) - t0) ))
timeout $left python3 profile_baseline.py --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --cuda-graphs \
  --fp8 tensorwise --use-custom-{rmsnorm,swiglu,rope,flce,adamw,projections} --top 60 --trace-dir /tmp/traces > $R/profile_tw.txt 2>&1
echo "profile rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/times.txt
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
