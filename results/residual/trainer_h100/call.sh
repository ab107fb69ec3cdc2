#!/bin/bash
# The residual kernel through the library in TRL's SFTTrainer (eager steps), with and without:
# Qwen2.5-1.5B LoRA 4 x 512 (host-bound eager: the fused forward's Python counts), 8B LoRA 4 x 2,048.
R=$OUT/run
source tools/device_env.sh $R
echo "commit $COMMIT (local)" | tee -a $R/env.txt
t0=$(date +%s)
S="--model Qwen/Qwen2.5-1.5B --random-init --lora --lr 2e-4 --batch-size 4 --seq-len 512 --steps 40"
B="--random-init --lora --batch-size 4 --seq-len 2048 --steps 30"
for spec in small:off small:on big:off big:on small:off small:on; do
  kind=${spec%%:*}; mode=${spec##*:}; args="$S"; [ $kind = big ] && args="$B"
  flag=""; [ $mode = off ] && flag="--no-use-custom-residual"
  name=trainer_${kind}_${mode}_$(( $(date +%s) % 1000 ))
  timeout 150 python3 finetune_trainer.py $args $flag --json $R/$name.json > $R/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s $(grep -E '  residual|Average|real tokens|Peak memory|Final loss' $R/$name.txt | tr -s ' ' | tr '\n' '|')" | tee -a $R/times.txt
done
tar -czf $OUT/run.tgz -C $OUT run && rm -r $R
