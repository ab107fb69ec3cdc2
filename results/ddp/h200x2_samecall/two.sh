#!/bin/bash
# 2 (or N) GPUs: 8B full FSDP default / symm-mem / pg-memory against one GPU; 8B LoRA chosen (DDP) and --ddp --compile
# against one GPU; the trainer under torchrun; tests/fsdp_test.py over NCCL. SMALL=1: tiny model on the CPU.
OUT=${OUT:-/tmp/two_out}; mkdir -p $OUT
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
N=${N:-2}
if [ -n "$SMALL" ]; then M="--tiny"; SEQ=16; Q="--tiny"; else M="--random-init"; SEQ=2048; Q="--model Qwen/Qwen2.5-1.5B --random-init"; fi
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpus.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version() if torch.cuda.is_available() else '')" >> $OUT/gpus.txt 2>&1
T0=$(date +%s)
left() { echo $(( ${LIMIT:-585} - $(date +%s) + T0 )); }
stamp() { echo "$1 $(( $(date +%s) - T0 ))s $(grep -h 'per GPU\|Average throughput\|Peak memory\|Parallel:' $OUT/$1.txt 2>/dev/null | tr '\n' ' ')" | tee -a $OUT/times.txt; }
one() { local name=$1; shift; CUDA_VISIBLE_DEVICES=0 timeout $(left) python3 finetune_optimized.py "$@" --json $OUT/$name.json > $OUT/$name.txt 2>&1; stamp $name; }
multi() { local name=$1; shift; timeout $(left) torchrun --standalone --nproc-per-node $N finetune_optimized.py "$@" --json $OUT/$name.json > $OUT/$name.txt 2>&1; stamp $name; }
FULL="$M --dataset synthetic --batch-size 2 --seq-len $SEQ --warmup-steps 3 --steps 8"
LORA="$M --lora --dataset synthetic --batch-size 4 --seq-len $SEQ --warmup-steps 3 --steps 8"
one full_one $FULL
multi full_fsdp$N $FULL --fsdp
multi full_fsdp${N}_symm $FULL --fsdp --fsdp-comm symm-mem
multi full_fsdp${N}_pgmem $FULL --fsdp --fsdp-comm pg-memory
one lora_one $LORA
multi lora_chosen$N $LORA
multi lora_ddp${N}_compile $LORA --ddp --compile
timeout $(left) torchrun --standalone --nproc-per-node $N finetune_trainer.py $Q --lora --batch-size 4 --seq-len 512 --steps 12 --json $OUT/trainer_qwen_lora$N.json > $OUT/trainer_qwen_lora$N.txt 2>&1; stamp trainer_qwen_lora$N
timeout $(left) python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py > $OUT/pytest_fsdp$N.txt 2>&1; stamp pytest_fsdp$N
tail -3 $OUT/pytest_fsdp$N.txt
