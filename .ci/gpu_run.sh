#!/usr/bin/env bash
# Developer tool: GPU verification runs through the device tool.
#   bash .ci/gpu_run.sh tests|tune|bench|e2e ...
# Logs go to $OUT/logs.tgz (one file: the device tool returns at most 8).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/logs
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee /tmp/logs/env.txt
python3 -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a /tmp/logs/env.txt
for what in "$@"; do
  case $what in
    tests)
      python3 -m pytest -q -p no:cacheprovider 2>&1 | tee /tmp/logs/pytest.log | tail -8
      python3 rmsnorm_test.py > /tmp/logs/rmsnorm_test.log 2>&1; tail -3 /tmp/logs/rmsnorm_test.log
      python3 cross_entropy_test.py > /tmp/logs/ce_test.log 2>&1; tail -12 /tmp/logs/ce_test.log ;;
    tune)
      python3 .ci/tune_kernels.py --only overhead 2>&1 | tee /tmp/logs/overhead.log ;;
    probe)
      python3 .ci/host_probe.py 2>&1 | tee /tmp/logs/probe.log | head -60 ;;
    bench1)
      python3 benchmark_kernels.py --kernel $BENCH_KERNELS --json "$OUT/bench_$BENCH_NAME.json" --plot "$OUT/bench_$BENCH_NAME.png" 2>&1 | tee /tmp/logs/bench_$BENCH_NAME.log | tail -80 ;;
    bench)
      python3 benchmark_kernels.py --kernel all --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee /tmp/logs/bench.log | tail -60 ;;
    e2e)
      for cfg in "1 512" "2 2048"; do
        set -- $cfg
        for s in baseline optimized; do
          python3 finetune_$s.py --random-init --batch-size $1 --seq-len $2 --steps 12 --json "/tmp/logs/ft_${s}_$1x$2.json" 2>&1 | tee "/tmp/logs/ft_${s}_$1x$2.log" | tail -8
        done
      done ;;
    maxseq)
      python3 .ci/max_seq_len.py --random-init --json /tmp/logs/maxseq_baseline.json 2>&1 | tee /tmp/logs/maxseq_baseline.log | grep -v Warning | tail -14
      python3 .ci/max_seq_len.py --random-init --all-kernels --json /tmp/logs/maxseq_optimized.json 2>&1 | tee /tmp/logs/maxseq_optimized.log | grep -v Warning | tail -14 ;;
    e2e2k)
      for s in baseline optimized; do
        python3 finetune_$s.py --random-init --batch-size 2 --seq-len 2048 --steps 12 --json "/tmp/logs/ft_${s}_2x2048.json" 2>&1 | tee "/tmp/logs/ft_${s}_2x2048.log" | tail -9
      done ;;
    profile)
      python3 profile_baseline.py --random-init --batch-size 1 --seq-len 512 2>&1 | tee /tmp/logs/profile_baseline.log | tail -45
      python3 profile_baseline.py --random-init --batch-size 1 --seq-len 512 --use-custom-rmsnorm --use-custom-ce 2>&1 | tee /tmp/logs/profile_custom.log | tail -45
      cp traces/*.json /tmp/logs/ 2>/dev/null; find traces -name "*summary*" -exec cp {} /tmp/logs/ \; ;;
  esac
done
tar czf "$OUT/logs.tgz" -C /tmp logs
