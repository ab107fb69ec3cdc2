#!/bin/bash
# 4 GPUs: 70B LoRA r16 (FSDP), 8B LoRA one GPU vs the chosen mode (DDP) on 4, the DDP tests over NCCL. SMALL=1: CPU.
OUT=${OUT:-/tmp/four2_out}; W=/tmp/four2_work; mkdir -p $OUT $W
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
N=${N:-4}
if [ -n "$SMALL" ]; then M="--tiny"; M70="--tiny"; SEQ=16; else M="--random-init"; M70="--model meta-llama/Llama-3.1-70B --random-init"; SEQ=2048; fi
nvidia-smi --query-gpu=name,memory.total --format=csv > $W/gpus.txt 2>&1
T0=$(date +%s)
left() { echo $(( ${LIMIT:-300} - $(date +%s) + T0 )); }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s $(grep -h 'Per GPU\|Average throughput\|Peak memory\|Parallel:' $W/$1.txt 2>/dev/null | tr '\n' ' ')" | tee -a $OUT/times.txt; }
multi() { local name=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node $N finetune_optimized.py "$@" --json $W/$name.json > $W/$name.txt 2>&1; stamp $name; }
multi lora70b_fsdp$N --fsdp $M70 --lora --lora-r 16 --gradient-checkpointing --dataset synthetic --batch-size 1 --seq-len $SEQ --warmup-steps 1 --steps 4
LORA="$M --lora --dataset synthetic --batch-size 4 --seq-len $SEQ --warmup-steps 3 --steps 8"
CUDA_VISIBLE_DEVICES=0 timeout $(left) python3 finetune_optimized.py $LORA --json $W/lora_one.json > $W/lora_one.txt 2>&1; stamp lora_one
multi lora_chosen$N $LORA
timeout $(left) python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "ddp or chooses" > $W/pytest_fsdp_ddp.txt 2>&1; stamp pytest_fsdp_ddp
tail -3 $W/pytest_fsdp_ddp.txt
tar czf $OUT/all.tgz -C $W .
