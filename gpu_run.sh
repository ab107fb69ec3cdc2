#!/usr/bin/env bash
# Scratch (untracked): one group of GPU measurements per call; logs + JSON into $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
GROUP=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
O=$OUT/$GROUP; mkdir -p $O
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers, peft; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  python3 -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))"
  date -u +%F; } | tee $O/env.txt
R="--random-init --steps 8 --warmup-steps 2"
run() { name=$1; shift; echo "=== $name: $*"; timeout ${T:-300} python3 "$@" --json $O/$name.json > $O/$name.log 2>&1; echo "rc $?"; grep -E "tokens/s|Peak|padding|real tok|error|Error" $O/$name.log | tail -8; }
case $GROUP in
  A)
    timeout 240 python3 -m pytest -q -p no:cacheprovider adamw_test.py profile_test.py finetune_test.py -k "clip or grad_scale or liger or pin or host or same_losses" 2>&1 | tail -5
    run full_opt_syn_2x2048 finetune_optimized.py $R --dataset synthetic --batch-size 2 --seq-len 2048
    run full_opt_syn_noclip_2x2048 finetune_optimized.py $R --dataset synthetic --batch-size 2 --seq-len 2048 --max-grad-norm 0
    T=400 run full_opt_syn_compile_2x2048 finetune_optimized.py $R --dataset synthetic --batch-size 2 --seq-len 2048 --compile
    T=400 run full_base_syn_compile_2x2048 finetune_baseline.py $R --dataset synthetic --batch-size 2 --seq-len 2048 --compile ;;
  B)
    T=400 run lora_opt_syn_compile_4x2048 finetune_optimized.py $R --dataset synthetic --batch-size 4 --seq-len 2048 --lora --compile
    T=400 run lora_base_syn_compile_4x2048 finetune_baseline.py $R --dataset synthetic --batch-size 4 --seq-len 2048 --lora --compile
    run lora_liger_data_4x2048 finetune_baseline.py $R --batch-size 4 --seq-len 2048 --lora --liger
    run lora_liger_packed_data_4x2048 finetune_baseline.py $R --batch-size 4 --seq-len 2048 --lora --liger --packing ;;
  C)
    run lora_base_data_4x2048 finetune_baseline.py $R --batch-size 4 --seq-len 2048 --lora
    run lora_opt_data_4x2048 finetune_optimized.py $R --batch-size 4 --seq-len 2048 --lora
    run lora_base_data_gc_4x2048 finetune_baseline.py $R --batch-size 4 --seq-len 2048 --lora --gradient-checkpointing
    run lora_opt_data_gc_4x2048 finetune_optimized.py $R --batch-size 4 --seq-len 2048 --lora --gradient-checkpointing
    for pin in pin-memory no-pin-memory; do
      echo "=== profile $pin"
      timeout 300 python3 profile_baseline.py --random-init --batch-size 2 --seq-len 2048 --packing --use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce --use-custom-adamw --$pin --trace-dir $O/traces > $O/profile_$pin.log 2>&1; echo "rc $?"
      grep -A5 "Host-to-device" $O/profile_$pin.log
    done
    rm -rf $O/traces/*/tensorboard $O/traces/*/trace.json ;;
  D)
    K="--no-use-custom-rmsnorm --no-use-custom-swiglu --no-use-custom-rope"
    T=400 run lora_opt_compile_flce_adamw finetune_optimized.py $R --dataset synthetic --batch-size 4 --seq-len 2048 --lora --compile $K
    T=400 run lora_opt_compile_noswiglu finetune_optimized.py $R --dataset synthetic --batch-size 4 --seq-len 2048 --lora --compile --no-use-custom-swiglu
    T=400 run full_opt_compile_flce_adamw finetune_optimized.py $R --dataset synthetic --batch-size 2 --seq-len 2048 --compile $K ;;
  E)
    K="--no-use-custom-rmsnorm --no-use-custom-swiglu --no-use-custom-rope"
    for i in 1 2; do
      T=400 run lora_base_compile_$i finetune_baseline.py $R --dataset synthetic --batch-size 4 --seq-len 2048 --lora --compile
      T=400 run lora_opt_compile_flce_adamw_$i finetune_optimized.py $R --dataset synthetic --batch-size 4 --seq-len 2048 --lora --compile $K
    done ;;
  F)
    S="$R --dataset synthetic --batch-size 1 --seq-len 512"
    run ft_optimized_1x512 finetune_optimized.py $S
    T=400 run ft_baseline_compile_1x512 finetune_baseline.py $S --compile
    T=400 run ft_optimized_compile_1x512 finetune_optimized.py $S --compile
    T=400 run ft_baseline_compile_ro_1x512 finetune_baseline.py $S --compile --compile-mode reduce-overhead
    T=400 run ft_optimized_compile_ro_1x512 finetune_optimized.py $S --compile --compile-mode reduce-overhead ;;
  G)
    S="$R --dataset synthetic --batch-size 1 --seq-len 512 --max-grad-norm 0"
    T=400 run ft_baseline_compile_ro_noclip_1x512 finetune_baseline.py $S --compile --compile-mode reduce-overhead
    T=400 run ft_optimized_compile_ro_noclip_1x512 finetune_optimized.py $S --compile --compile-mode reduce-overhead ;;
  H1)
    TR="torchrun --standalone --nproc-per-node 2"
    run70() { name=$1; shift; echo "=== $name: $*"; timeout ${T:-300} $TR "$@" --json $O/$name.json > $O/$name.log 2>&1; echo "rc $?"; grep -E "tokens/s|Peak|per GPU|FSDP|error|Error" $O/$name.log | tail -8; }
    T=330 run70 fsdp_lora_70b_1x2048_gc finetune_optimized.py --fsdp --random-init --model meta-llama/Llama-3.1-70B --dataset synthetic --lora --gradient-checkpointing --batch-size 1 --seq-len 2048 --steps 5 --warmup-steps 1
    T=200 run70 fsdp_lora_8b_4x2048 finetune_optimized.py --fsdp $R --dataset synthetic --lora --batch-size 4 --seq-len 2048
    timeout 200 python3 -m pytest -q -p no:cacheprovider fsdp_test.py 2>&1 | tail -5 ;;
  H2)
    TR="torchrun --standalone --nproc-per-node 2"
    runt() { name=$1; shift; echo "=== $name: $*"; timeout ${T:-300} $TR "$@" --json $O/$name.json > $O/$name.log 2>&1; echo "rc $?"; grep -E "tokens/s|Peak|per GPU|error|Error" $O/$name.log | tail -6; }
    T=130 runt fsdp_opt_2x2048 finetune_optimized.py --fsdp $R --dataset synthetic --batch-size 2 --seq-len 2048
    CUDA_VISIBLE_DEVICES=0 run single_opt_2x2048 finetune_optimized.py $R --dataset synthetic --batch-size 2 --seq-len 2048
    T=250 runt fsdp_opt_compile_2x2048 finetune_optimized.py --fsdp $R --dataset synthetic --batch-size 2 --seq-len 2048 --compile ;;
  I)
    K="--no-use-custom-rmsnorm --no-use-custom-swiglu --no-use-custom-rope"
    run lora_opt_syn_4x2048 finetune_optimized.py $R --dataset synthetic --batch-size 4 --seq-len 2048 --lora
    T=400 run lora_base_compile finetune_baseline.py $R --dataset synthetic --batch-size 4 --seq-len 2048 --lora --compile
    T=400 run lora_opt_compile_flce_adamw finetune_optimized.py $R --dataset synthetic --batch-size 4 --seq-len 2048 --lora --compile $K
    run lora_opt_data_4x2048 finetune_optimized.py $R --batch-size 4 --seq-len 2048 --lora
    run lora_opt_data_gc_4x2048 finetune_optimized.py $R --batch-size 4 --seq-len 2048 --lora --gradient-checkpointing ;;
  P)
    timeout 560 python3 -m pytest -q -p no:cacheprovider --ignore=fsdp_test.py 2>&1 | tee $O/pytest_gpu.log | tail -8 ;;
  J)
    python3 gpu_capture_probe.py 2>&1 | tail -8
    timeout 400 python3 benchmark_kernels.py --quick --kernel all 2>&1 | tee $O/bench_quick.log | grep -E "^ERR|graph skipped|Error" | cut -c1-400 ;;
  V)
    timeout 500 python3 -m pytest -q -p no:cacheprovider benchmark_test.py compile_test.py cross_entropy_test.py 2>&1 | tee $O/pytest_gpu_v.log | tail -6 ;;
  K)
    TR="torchrun --standalone --nproc-per-node 2"
    runt() { name=$1; shift; echo "=== $name: $*"; timeout ${T:-300} $TR "$@" --json $O/$name.json > $O/$name.log 2>&1; echo "rc $?"; grep -E "tokens/s|Peak|per GPU|error|Error" $O/$name.log | tail -6; }
    timeout 250 python3 -m pytest -q -p no:cacheprovider fsdp_test.py -k "export or meta or one_line" 2>&1 | tee $O/pytest_fsdp.log | tail -6
    T=130 runt fsdp_opt_2x2048 finetune_optimized.py --fsdp $R --dataset synthetic --batch-size 2 --seq-len 2048 ;;
esac
tar czf $OUT/$GROUP.tgz -C $OUT $GROUP && rm -rf $O
