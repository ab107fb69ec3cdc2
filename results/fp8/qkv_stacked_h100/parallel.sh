#!/usr/bin/env bash
# FP8 q/k/v groups under --ddp and --fsdp on 2 GPUs: 8B full fine-tuning --fp8 tensorwise, 2 x 2,048 per GPU,
# against GPU 0 alone; then the FP8 gather test over NCCL and the --ddp pieces tests.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
t0=$SECONDS
common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 --log-every 4 --fp8 tensorwise"
stamp() { echo "$1 $((SECONDS-t0))s $(grep -h 'Average throughput\|Per GPU\|Peak memory\|Error\|error\|passed\|failed\|Final loss' $R/$1.txt | tr -s ' ' | cut -c1-160 | tr '\n' '|')" | tee -a $R/times.txt; }
save() { (cd $R && tar czf $OUT/parallel.tgz . && cp times.txt $OUT/); }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())"
  date -u +%F; } > $R/env.txt
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 finetune_optimized.py $common --json $R/one.json > $R/one.txt 2>&1; stamp one
timeout 130 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --ddp $common --json $R/ddp2.json > $R/ddp2.txt 2>&1; stamp ddp2; save
timeout 150 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp $common --json $R/fsdp2.json > $R/fsdp2.txt 2>&1; stamp fsdp2; save
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "fp8_gather_over_two or pieces or shard_optimizer" > $R/pytest_fsdp.txt 2>&1; stamp pytest_fsdp; save
