#!/usr/bin/env bash
# q/k/v as one FP8 group (projections_kernel: FP8Linear layers stacked, dx one product): the GPU tests of the
# changed files, then 8B full fine-tuning FP8 with the groups (the default) against --no-use-custom-projections
# (q, k and v three FP8 layers, as before), alternating; then the default step's profile.
# Run again as CALL=call2 after the side-by-side cast read its parts in their own layout (call2/).
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  date -u +%F; } > $R/env.txt
cat $R/env.txt
t0=$SECONDS
ft() {  # ft NAME FLAGS...
  local name=$1; shift
  timeout 100 python3 finetune_optimized.py --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 \
     --log-every 4 "$@" --json $R/$name.json > $R/$name.txt 2>&1
  echo "$name $((SECONDS-t0))s $(python3 -c "import json,sys; d=json.load(open('$R/$name.json')); print('tok/s', round(d.get('tokens_per_sec',0)), 'GiB', round(d['peak_memory_bytes']/2**30, 2), 'losses', [round(s['loss'],4) for s in d.get('steps',[])][-4:])" 2>&1 | tail -1)" | tee -a $R/times.txt
}
save() { (cd $R && tar czf $OUT/${CALL:-call1}.tgz . && cp times.txt $OUT/); }
timeout 240 python3 -m pytest -q -p no:cacheprovider fp8_test.py projections_test.py > $R/pytest_gpu.txt 2>&1
echo "pytest $((SECONDS-t0))s $(tail -1 $R/pytest_gpu.txt)" | tee -a $R/times.txt
save
ft new_tw_1 --fp8 tensorwise
ft old_tw_1 --fp8 tensorwise --no-use-custom-projections
ft new_tw_2 --fp8 tensorwise
ft old_tw_2 --fp8 tensorwise --no-use-custom-projections
save
ft new_rw_1 --fp8 rowwise
ft old_rw_1 --fp8 rowwise --no-use-custom-projections
save
timeout 60 python3 - > $R/cast_times.txt 2>&1 <<'PY'
# dq, dk, dv of one 8B layer (4,096 tokens, bf16): cast side by side into [dq | dk | dv] and its transpose, against
# the three casts of separate layers (each with its transposed copy), per tensor; microseconds, median of 200.
import torch, fp8_kernel
def us(fn):
    for _ in range(10): fn()
    times = []
    for _ in range(200):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[100]
parts = [torch.randn(4096, n, device="cuda", dtype=torch.bfloat16) for n in (4096, 1024, 1024)]
for recipe in ("tensorwise", "rowwise"):
    side = us(lambda: fp8_kernel.quantize_side_by_side(parts, recipe))
    apart = us(lambda: [fp8_kernel.quantize(p, recipe, transpose=True, align=16) for p in parts])
    print(f"{recipe}: side by side {side:.1f} us, three casts {apart:.1f} us")
PY
echo "casts $((SECONDS-t0))s $(tr '\n' '|' < $R/cast_times.txt)" | tee -a $R/times.txt
timeout 120 python3 profile_baseline.py --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --cuda-graphs \
  --fp8 tensorwise --use-custom-{rmsnorm,swiglu,rope,flce,adamw,projections} > $R/profile_tw.txt 2>&1
echo "profile $((SECONDS-t0))s $(grep -h 'FP8 casts\|other elementwise\|matrix multiply  \|total  ' $R/profile_tw.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
save
