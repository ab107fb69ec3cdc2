#!/bin/bash
# The GPU checks of the Gluon attention kernels, in one call on an H100 / H200 (at most 10 minutes):
#   bash results/attention/gluon_gpu_check.sh OUTDIR
# Needs .triton/ with a packed Triton 3.8 or newer (tools/pack_triton.sh). Under it: the backward (dQ by TMA
# reductions, the default; by atomics; dQ cast into its own float32 buffer) against float64 on six rows
# and timed beside the Triton backward and cuDNN's on four (sweep.py); one launch of it and of cuDNN's backward read by
# Nsight Compute (ncu_bwd.py: memory, pipes, warp stall reasons); benchmark_kernels.py --kernel attention (packed rows
# through the Gluon backward: USE_HOPPER_BACKWARD_PACKED); attention_test.py's Hopper tests (compiling them takes
# most of their time); 8B LoRA on one 16,384-token document, the default command (which measures both attentions and
# takes the faster) against --no-use-custom-attention.
set -u
R=${1:?OUTDIR}
t0=$(date +%s)
el() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s"; }
if [ -d .triton ]; then
  ( source tools/device_env.sh $R/packed_triton >/dev/null
    timeout 120 python3 results/attention/gluon_backward/sweep.py --json $R/packed_triton/sweep.json default= \
      atomics=dq_tma:0 inplace=dq_in_place:1 > $R/packed_triton/sweep.txt 2>&1; el sweep $?
    # benchmark_kernels.py's attention rows: packed ones through the Gluon backward, dQ cast in place; their
    # fwd+bwd and extra memory against FlexAttention's.
    timeout 100 python3 benchmark_kernels.py --kernel attention --json $R/packed_triton/bench_attention.json \
      > $R/packed_triton/bench_attention.txt 2>&1; el bench $?
    timeout 60 ncu --clock-control none -k regex:"attn_bwd_hopper|cudnn|sdpa|fort" --launch-count 8 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --metrics \
      dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
      python3 results/attention/gluon_backward/ncu_bwd.py default= > $R/packed_triton/ncu_bwd.txt 2>&1; el ncu $?
    timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 attention_test.py -k "hopper or one_document or cast_in_place" \
      > $R/packed_triton/attention_test.txt 2>&1; rc=$?; el "hopper tests $(tail -1 $R/packed_triton/attention_test.txt)" $rc
    for a in ours sdpa; do
      timeout 60 python3 finetune_optimized.py --random-init --dataset synthetic --lora --batch-size 1 --steps 8 \
        --seq-len 16384 $([ $a = sdpa ] && echo --no-use-custom-attention) --json /tmp/lora_16k_$a.json \
        > /tmp/lora_16k_$a.txt 2>&1; rc=$?
      el "lora_16k_$a $(grep -h 'measured fwd+bwd\|Real tokens\|Peak' /tmp/lora_16k_$a.txt | tr -s ' ' | tr '\n' ' ')" $rc
      cat /tmp/lora_16k_$a.txt >> $R/packed_triton/lora_16k.txt
    done
  ) 2>&1 | tee /tmp/gluon_gpu_check_times.txt
fi
