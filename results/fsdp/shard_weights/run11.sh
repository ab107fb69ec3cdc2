#!/bin/bash
# 2 GPUs: the NCCL tests of the final --ddp-shard-weights code (the worker's uneven runs against the same MLP times 0,
# with --grad-accum; the checkpointed run; the script's runs).
export PYTHONUNBUFFERED=1
R=/tmp/r11; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.nccl.version())" >> $R/gpus.txt
cat $R/gpus.txt
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "pieces_equal or shard_weights or gpus" > $R/pytest_nccl.txt 2>&1
tail -3 $R/pytest_nccl.txt
tar -czf $OUT/r11.tgz -C /tmp r11
