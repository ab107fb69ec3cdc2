#!/bin/bash
# 4 GPUs, four 500-step runs side by side (8B full, bundled data, 2 x 2,048): bf16; --fp8 tensorwise;
# the same with the weight gradient in bf16 (FP8_GW_HP=1, .lab/gw_hp.patch); the same with the forward
# product's fast accumulation off (a copy of the code, sed). Then the mean losses.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/r
patch -p1 -s < .lab/gw_hp.patch || exit 1
rm -rf /tmp/nofa && mkdir /tmp/nofa && cp -r $(ls -A | grep -v '^.lab$') /tmp/nofa/ && sed -i 's/fast_accum=True)/fast_accum=False)/' /tmp/nofa/fp8_kernel.py
grep -c "fast_accum=False)" /tmp/nofa/fp8_kernel.py > /tmp/r/nofa_check.txt
nvidia-smi -L > /tmp/r/gpus.txt
common="--random-init --batch-size 2 --seq-len 2048 --steps 500 --log-every 50"
CUDA_VISIBLE_DEVICES=0 timeout 560 python3 finetune_optimized.py $common --json /tmp/r/bf16.json > /tmp/r/bf16.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 560 python3 finetune_optimized.py $common --fp8 tensorwise --json /tmp/r/fp8.json > /tmp/r/fp8.txt 2>&1 &
CUDA_VISIBLE_DEVICES=2 FP8_GW_HP=1 timeout 560 python3 finetune_optimized.py $common --fp8 tensorwise --json /tmp/r/fp8_gwhp.json > /tmp/r/fp8_gwhp.txt 2>&1 &
(cd /tmp/nofa && CUDA_VISIBLE_DEVICES=3 timeout 560 python3 finetune_optimized.py $common --fp8 tensorwise --json /tmp/r/fp8_nofastaccum.json > /tmp/r/fp8_nofastaccum.txt 2>&1) &
wait
python3 - <<'PY' | tee /tmp/r/summary.txt
import json
for name in ("bf16", "fp8", "fp8_gwhp", "fp8_nofastaccum"):
    try:
        d = json.load(open(f"/tmp/r/{name}.json"))
    except Exception as e:
        print(name, "no json", e); continue
    L = d["losses"]
    m = lambda a, b: sum(L[a:b]) / len(L[a:b])
    print(f"{name:18s} steps {len(L)}  51-100 {m(50,100):.3f}  201-250 {m(200,250):.3f}  351-400 {m(350,400):.3f}  last50 {m(-50,None):.3f}  tok/s {d.get('tokens_per_sec', 0):,.0f}  peak {d.get('peak_memory_bytes', 0)/2**30:.2f} GiB")
PY
tar -czf $OUT/loss.tgz -C /tmp r
