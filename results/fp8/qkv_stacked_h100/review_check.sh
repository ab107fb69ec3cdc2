#!/usr/bin/env bash
# After the review's refactors (ddp.new_window for the windows of --ddp's pieces and FSDP's copy-engine gathers;
# fp8_kernel._forward_mm): the GPU tests of fp8_test.py and projections_test.py, the pieces tests over NCCL, and the
# default --fsdp and --ddp on the tiny model (both gather by the copy engines from windows).
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R; t0=$SECONDS
stamp() { echo "$1 $((SECONDS-t0))s $(grep -h 'passed\|failed\|error\|Error\|copy engines\|Final loss' $R/$1.txt | tr -s ' ' | cut -c1-200 | tr '\n' '|')" | tee -a $R/times.txt; }
nvidia-smi --query-gpu=name --format=csv,noheader > $R/env.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider fp8_test.py projections_test.py > $R/pytest_fp8.txt 2>&1; stamp pytest_fp8
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/fsdp_test.py -k "pieces or shard_optimizer" > $R/pytest_pieces.txt 2>&1; stamp pytest_pieces
for mode in fsdp ddp; do
  timeout 90 torchrun --standalone --nproc-per-node 2 finetune_optimized.py --tiny --$mode --steps 6 > $R/tiny_$mode.txt 2>&1; stamp tiny_$mode
done
(cd $R && tar czf $OUT/review.tgz . && cp times.txt $OUT/)
