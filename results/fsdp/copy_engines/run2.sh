#!/bin/bash
# --fsdp-comm auto (now the default: copy engines where NCCL 2.28 and torch allow): the FSDP tests over NCCL
# (every kernel, LoRA, prefetch and kept weights, FP8 gathers, compiled, the bf16 reduction, export), then 8B full
# 2 x 2048 per GPU with the default command against one GPU alone.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|FSDP: \|passed\|failed' $R/$1.txt | tr -s ' ' | cut -c1-200 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi -L > $R/gpus.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "two_ranks_match_one_process_every_kernel or prefetch_and_kept or lora_two_ranks_match or fp8_gather_over_two or baseline_packed or bfloat16_reduction_over_two or two_ranks_compiled_match or export_gives_the_model or fsdp_comm" > $R/pytest_fsdp.txt 2>&1; stamp pytest_fsdp
save
one() { CUDA_VISIBLE_DEVICES=0 timeout 90 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
two() { timeout 120 torchrun --standalone --nproc-per-node 2 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
one one
two fsdp_auto "--fsdp"
save
