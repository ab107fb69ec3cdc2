#!/bin/bash
# FSDP2's all-gathers by the copy engines (--fsdp-comm auto, the default) on 4 GPUs, never measured there; the same
# on 2 of the GPUs (--fsdp and --ddp), and 70B LoRA r16 on 4 with them. 8B full 2 x 2,048 per GPU against GPU 0 alone.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$(date +%s)
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 16 --log-every 4"
stamp() { echo "$1 $(( $(date +%s) - t0 ))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|FSDP: \|Parallel:' $R/$1.txt | tr -s ' ' | cut -c1-220 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { tar -czf $OUT/r.tgz -C /tmp r; cp $R/times.txt $OUT/ 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
one() { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 finetune_optimized.py $common $2 --json $R/$1.json > $R/$1.txt 2>&1; stamp $1; }
multi() { n=$1; name=$2; shift 2; timeout 150 torchrun --standalone --nproc-per-node $n finetune_optimized.py "$@" --json $R/$name.json > $R/$name.txt 2>&1; stamp $name; }
one one
multi 4 fsdp4 --fsdp $common; save
multi 4 fsdp4_bf16 --fsdp --fsdp-reduce-dtype bfloat16 $common; save
multi 4 fsdp4_pytorch --fsdp --fsdp-comm pytorch $common; save
export CUDA_VISIBLE_DEVICES=0,1
multi 2 fsdp2 --fsdp $common; save
unset CUDA_VISIBLE_DEVICES
multi 4 lora70b_fsdp4 --fsdp --model meta-llama/Llama-3.1-70B --random-init --lora --lora-r 16 --gradient-checkpointing --dataset synthetic --batch-size 1 --seq-len 2048 --warmup-steps 1 --steps 4; save
export CUDA_VISIBLE_DEVICES=0,1
multi 2 ddp2 --ddp $common; save
unset CUDA_VISIBLE_DEVICES
multi 4 ddp4 --ddp $common; save
