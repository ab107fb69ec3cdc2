#!/usr/bin/env bash
# Call 1: GPU tests of the changed files, then 8B full fine-tuning FP8 stacked (this tree) vs
# unstacked (.lab/old: the commit before), alternating.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers, torchao; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'torchao', torchao.__version__)"
  date -u +%F; } > $R/env.txt
cat $R/env.txt
t0=$SECONDS
ft() {  # ft NAME DIR FLAGS...
  local name=$1 dir=$2; shift 2
  (cd $dir && python3 finetune_optimized.py --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 \
     --log-every 4 "$@" --json $R/$name.json) > $R/$name.txt 2>&1
  echo "$name $((SECONDS-t0))s $(python3 -c "import json,sys; d=json.load(open('$R/$name.json')); print('tok/s', round(d.get('tokens_per_sec',0)), 'GiB', round(d['peak_memory_bytes']/2**30, 2), 'losses', [round(s['loss'],4) for s in d.get('steps',[])][-4:])" 2>&1 | tail -1)" | tee -a $R/times.txt
}
python3 -m pytest -q -p no:cacheprovider fp8_test.py swiglu_test.py projections_test.py lora_test.py > $R/pytest_gpu.txt 2>&1
echo "pytest $((SECONDS-t0))s $(tail -1 $R/pytest_gpu.txt)" | tee -a $R/times.txt
ft new_tw_1 . --fp8 tensorwise
ft old_tw_1 .lab/old --fp8 tensorwise
ft new_tw_2 . --fp8 tensorwise
ft old_tw_2 .lab/old --fp8 tensorwise
ft new_rw_1 . --fp8 rowwise
ft old_rw_1 .lab/old --fp8 rowwise
cd $R && tar czf $OUT/call1.tgz . && cp times.txt $OUT/
