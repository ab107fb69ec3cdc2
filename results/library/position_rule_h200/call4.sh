#!/bin/bash
# One GPU, after the attention-dropout refusal and HF's packed-row rule in document_starts: the GPU tests of the
# library and of the kernel's document rule, then 8B LoRA r16 on the bundled data (packed, 4 x 2,048), the new rule
# against the old one (t - position) patched in, alternating in this call.
R=$OUT/c4
source tools/device_env.sh $R
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/apply_test.py > $R/pytest_apply_test.txt 2>&1
echo "apply_test rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_apply_test.txt)" | tee -a $R/times.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider attention_test.py -k "document or packed or model or bad" > $R/pytest_attention.txt 2>&1
echo "attention_test rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/pytest_attention.txt)" | tee -a $R/times.txt
cat > /tmp/old_rule.py <<'PY'
import runpy, sys, torch
import attention_routing
def old_rule(position_ids):  # the rule before: t - position, right for restarts at 0 only
    t = torch.arange(position_ids.shape[-1], device=position_ids.device)
    return (t - position_ids).clamp(min=0).minimum(t).to(torch.int32)
attention_routing.document_starts = old_rule
sys.argv = ["finetune_optimized.py", *sys.argv[1:]]
runpy.run_path("finetune_optimized.py", run_name="__main__")
PY
common="--random-init --lora --batch-size 4 --seq-len 2048 --steps 12"
i=0
for run in new old new old; do
  i=$((i + 1))
  if [ $run = new ]; then cmd="finetune_optimized.py"; else cmd="/tmp/old_rule.py"; fi
  timeout 150 python3 $cmd $common --json $R/lora_$run.json > $R/lora_$run.txt 2>&1
  echo "lora $run rc=$? $(( $(date +%s) - t0 ))s $(grep -h 'Attention:\|Average throughput\|Real tokens\|Peak memory' $R/lora_$run.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
  mv $R/lora_$run.txt $R/lora_${i}_$run.txt; mv $R/lora_$run.json $R/lora_${i}_$run.json 2>/dev/null
done
