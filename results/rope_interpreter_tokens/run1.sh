#!/bin/bash
# RoPE's tiles made 3-D ([tokens, heads, D/2]; one token per program on a GPU, up to 64 in the CPU interpreter):
# the GPU tests of rope_test.py, then the RoPE benchmark with the kernel before the change (.lab/rope_before,
# carried) and after, alternating, on one GPU.
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/env.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/env.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider rope_test.py > $R/pytest_rope.txt 2>&1; tail -3 $R/pytest_rope.txt
cp rope_kernel.py /tmp/after.py
bench() { cp $2 rope_kernel.py; timeout 150 python3 benchmark_kernels.py --kernel rope --json $R/$1.json > $R/$1.txt 2>&1; grep -A3 "^tokens" $R/$1.txt | head -4; grep -A1 "^16,384" $R/$1.txt | head -1; }
bench before_1 .lab/rope_before/rope_kernel.py
bench after_1 /tmp/after.py
bench before_2 .lab/rope_before/rope_kernel.py
bench after_2 /tmp/after.py
cp /tmp/after.py rope_kernel.py
tar -czf $OUT/r.tgz -C /tmp r
