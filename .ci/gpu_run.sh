#!/usr/bin/env bash
# Developer tool: the GPU verification run (device tool). Usage: bash .ci/gpu_run.sh [tests|tune|bench|all]
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -p no:cacheprovider rmsnorm_test.py cross_entropy_test.py 2>&1 | tee "$OUT/pytest.log" | tail -15
  python3 rmsnorm_test.py > "$OUT/rmsnorm_test.log" 2>&1; tail -8 "$OUT/rmsnorm_test.log"
  python3 cross_entropy_test.py > "$OUT/ce_test.log" 2>&1; tail -14 "$OUT/ce_test.log"
fi
if [[ $what == tune || $what == all ]]; then
  python3 .ci/tune_kernels.py --quick --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log"
fi
