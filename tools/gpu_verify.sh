#!/usr/bin/env bash
# Re-measure what README.md and results/ report, on a CUDA machine, in one go.
#
#   bash tools/gpu_verify.sh [OUTDIR] [WHAT...]
#     WHAT: tests bench e2e compile profile maxseq graphs families attention longcontext fp8 fp8e2e fp8loss fp8producers
#           remake inbackward fsdp gpus residual
#           trainer trainer-full trainer-small
#           (default: tests bench e2e)
#
# Each step's full output goes to OUTDIR (default gpu_logs/), together with the
# JSON the scripts write, and OUTDIR/logs.tgz bundles them. Wheels placed in
# .whl/ (e.g. liger-kernel, cut-cross-entropy for the benchmark's peers) are
# installed first into /tmp/site, without touching the system's packages.
# The throughput runs (e2e, compile, profile) use --dataset synthetic: every row
# is --seq-len real tokens, the fixed shapes results/ reports.
set -o pipefail
OUTDIR=${1:-gpu_logs}; shift || true
WHAT=${*:-tests bench e2e}
source "$(dirname "$0")/device_env.sh" "$OUTDIR"
# Our fine-tune script once per precision, bf16 then --fp8 tensorwise and rowwise:
# recipes NAME LINES FLAGS... writes OUTDIR/NAME_{bf16,tensorwise,rowwise}.{json,log}, shows LINES of each.
recipes() {
  local name=$1 lines=$2 recipe extra; shift 2
  for recipe in bf16 tensorwise rowwise; do
    extra=""; [ "$recipe" = bf16 ] || extra="--fp8 $recipe"
    python3 finetune_optimized.py "$@" $extra --json "$OUTDIR/${name}_$recipe.json" 2>&1 \
      | tee "$OUTDIR/${name}_$recipe.log" | tail -"$lines"
  done
}
# torchao's float8 training instead of ours (needs torchao in .whl/), our other kernels around it:
# torchao NAME LINES FLAGS... writes OUTDIR/NAME.{json,log}.
# The five kernels the profile and torchao runs switch on by flag (the baseline scripts' defaults are off).
KERNELS="--use-custom-rmsnorm --use-custom-swiglu --use-custom-rope --use-custom-flce --use-custom-adamw"
torchao() {
  local name=$1 lines=$2; shift 2
  python3 finetune_baseline.py "$@" $KERNELS --json "$OUTDIR/$name.json" 2>&1 | tee "$OUTDIR/$name.log" | tail -"$lines"
}
for what in $WHAT; do
  case $what in
    tests)
      python3 -m pytest -v -p no:cacheprovider 2>&1 | tee "$OUTDIR/pytest_gpu.log" | tail -6 ;;
    bench)
      python3 benchmark_kernels.py --kernel all --json "$OUTDIR/bench.json" 2>&1 | tee "$OUTDIR/bench.log" | tail -40 ;;
    e2e)
      for shape in "1 512" "2 2048"; do
        set -- $shape
        for script in baseline optimized; do
          python3 finetune_$script.py --random-init --dataset synthetic --batch-size "$1" --seq-len "$2" --steps 12 \
            --json "$OUTDIR/ft_${script}_$1x$2.json" 2>&1 | tee "$OUTDIR/ft_${script}_$1x$2.log" | tail -7
        done
      done ;;
    compile)
      for shape in "1 512" "2 2048"; do
        set -- $shape
        for script in baseline optimized; do
          python3 finetune_$script.py --random-init --dataset synthetic --batch-size "$1" --seq-len "$2" --steps 12 --compile \
            --json "$OUTDIR/ft_${script}_compile_$1x$2.json" 2>&1 | tee "$OUTDIR/ft_${script}_compile_$1x$2.log" | tail -7
        done
      done ;;
    profile)
      python3 profile_baseline.py --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --trace-dir "$OUTDIR/traces" 2>&1 \
        | tee "$OUTDIR/profile_baseline.log" | tail -30
      python3 profile_baseline.py --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --trace-dir "$OUTDIR/traces" \
        $KERNELS 2>&1 | tee "$OUTDIR/profile_optimized.log" | tail -30 ;;
    maxseq)
      python3 tools/max_seq_len.py --random-init --json "$OUTDIR/maxseq_baseline.json" 2>&1 | tee "$OUTDIR/maxseq_baseline.log" | tail -5
      python3 tools/max_seq_len.py --random-init --all-kernels --json "$OUTDIR/maxseq_optimized.json" 2>&1 | tee "$OUTDIR/maxseq_optimized.log" | tail -5 ;;
    graphs)
      # Step 20's workload: Qwen2.5-1.5B architecture, LoRA, 4 x 512 packed rows of the bundled data:
      # the default (fused LoRA, CUDA graphs), PEFT's LoRA, eager; the profile's verdicts; then 8B LoRA, whose
      # default keeps the eager step when a replay is slower.
      common="--model Qwen/Qwen2.5-1.5B --random-init --lora --lr 2e-4 --batch-size 4 --seq-len 512"
      for extra in "" "--no-use-custom-lora" "--no-cuda-graphs"; do
        tag=${extra:-default}; tag=${tag#--}
        python3 finetune_optimized.py $common --steps 30 --log-every 10 $extra \
          --json "$OUTDIR/lora1.5b_$tag.json" 2>&1 | tee "$OUTDIR/lora1.5b_$tag.log" | tail -9
      done
      for mode in cuda-graphs no-cuda-graphs; do
        python3 profile_baseline.py $common --packing --steps 3 --trace-dir "$OUTDIR/traces" --$mode \
          $KERNELS --use-custom-attention --use-custom-lora 2>&1 | tee "$OUTDIR/profile_lora1.5b_$mode.log" | tail -22
      done
      python3 finetune_optimized.py --random-init --lora --dataset synthetic --batch-size 4 --seq-len 2048 --steps 16 \
        --log-every 4 --json "$OUTDIR/lora8b_synth_4x2048.json" 2>&1 | tee "$OUTDIR/lora8b_synth_4x2048.log" | tail -8
      # Padded (the baseline's batches): no 3 s steps now that cuDNN's attention is off for them.
      python3 finetune_optimized.py $common --no-packing --steps 25 --log-every 1 \
        --json "$OUTDIR/padded_optimized.json" 2>&1 | tee "$OUTDIR/padded_optimized.log" | tail -7
      python3 finetune_baseline.py $common --steps 25 --log-every 1 \
        --json "$OUTDIR/padded_baseline.json" 2>&1 | tee "$OUTDIR/padded_baseline.log" | tail -7 ;;
    families)
      # Step 16's family rows: published architectures, random weights, full fine-tuning, one shape each;
      # HF, HF with Liger's own patch for the family (needs liger-kernel in .whl/), ours.
      for spec in "google/gemma-2-2b 4 1024" "microsoft/Phi-3-mini-4k-instruct 4 2048"; do
        set -- $spec
        tag=$(basename "$1")
        for run in baseline: baseline:--liger optimized:; do
          script=${run%%:*}; extra=${run#*:}; name=$script${extra#--}
          python3 finetune_$script.py $extra --model "$1" --random-init --dataset synthetic --batch-size "$2" \
            --seq-len "$3" --steps 8 --log-every 4 --json "$OUTDIR/family_${tag}_$name.json" 2>&1 \
            | tee "$OUTDIR/family_${tag}_$name.log" | tail -6
        done
      done ;;
    attention)
      # Step 21: the kernel's GPU tests, its benchmark rows, and 8B LoRA on the bundled data, packed,
      # with ours and with the dense block mask (--no-use-custom-attention), at 4 x 2,048 and 1 x 16,384.
      timeout 300 python3 -m pytest -q -p no:cacheprovider attention_test.py 2>&1 | tee "$OUTDIR/pytest_attention.log" | tail -4
      python3 benchmark_kernels.py --kernel attention --json "$OUTDIR/bench_attention.json" 2>&1 \
        | tee "$OUTDIR/bench_attention.log" | tail -32
      for shape in "4 2048" "1 16384"; do
        set -- $shape
        for attn in use-custom-attention no-use-custom-attention; do
          python3 finetune_optimized.py --random-init --lora --batch-size "$1" --seq-len "$2" --steps 16 --log-every 4 \
            --$attn --json "$OUTDIR/lora8b_$1x$2_$attn.json" 2>&1 | tee "$OUTDIR/lora8b_$1x$2_$attn.log" | tail -8
        done
      done ;;
    longcontext)
      # Step 21 on one long document per row: 8B LoRA r16, synthetic rows of 1 x 16,384 and 1 x 32,768 tokens, the
      # default (plain rows take the faster of ours and SDPA, measured per shape: its Attention line says which)
      # against --no-use-custom-attention (SDPA's default backend); then the longest LoRA row at batch 1 both ways.
      # 32,768 needs more than an 80 GB card (an H200 trains it).
      for seq in 16384 32768; do
        for attn in default no-use-custom-attention; do
          extra=""; [ $attn = default ] || extra="--$attn"
          python3 finetune_optimized.py --random-init --dataset synthetic --lora --batch-size 1 --seq-len $seq --steps 6 \
            --log-every 2 $extra --json "$OUTDIR/lora8b_1x${seq}_$attn.json" 2>&1 \
            | tee "$OUTDIR/lora8b_1x${seq}_$attn.log" | grep -a "Attention:\|Real tokens\|Peak memory\|^error:"
        done
      done
      for attn in default no-use-custom-attention; do
        extra=""; [ $attn = default ] || extra="--$attn"
        python3 tools/max_seq_len.py --random-init --all-kernels --lora $extra --step 8192 --resolution 1024 \
          --json "$OUTDIR/maxseq_lora_$attn.json" 2>&1 | tee "$OUTDIR/maxseq_lora_$attn.log" | tail -2
      done ;;
    fp8)
      # Step 22: the GPU tests, the benchmark (torchao as the peer when its wheel is in .whl/), and the
      # accuracy cost: 200 steps of full fine-tuning on the bundled data, bf16 and each recipe, one seed.
      timeout 300 python3 -m pytest -q -p no:cacheprovider fp8_test.py 2>&1 | tee "$OUTDIR/pytest_fp8.log" | tail -4
      python3 benchmark_fp8.py --json "$OUTDIR/bench_fp8.json" 2>&1 | tee "$OUTDIR/bench_fp8.log" | tail -42
      recipes curve 6 --model Qwen/Qwen2.5-1.5B --random-init --batch-size 4 --seq-len 512 --lr 1e-4 --steps 200 \
        --log-every 50 ;;
    fp8e2e)
      # Step 22: 8B full fine-tuning, 2 x 2,048 synthetic rows, the default command with and without --fp8,
      # and the same run with torchao's float8 training instead of ours (needs torchao in .whl/).
      common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 --log-every 4"
      recipes ft8b 8 $common
      for recipe in tensorwise rowwise; do
        torchao "ft8b_torchao_$recipe" 8 $common --torchao-fp8 $recipe --cuda-graphs
      done
      # The same with --compile: torchao's casts are PyTorch ops that Inductor fuses.
      python3 finetune_optimized.py $common --compile --json "$OUTDIR/ft8b_compile_bf16.json" 2>&1 \
        | tee "$OUTDIR/ft8b_compile_bf16.log" | tail -8
      for recipe in tensorwise rowwise; do
        python3 finetune_optimized.py $common --compile --fp8 $recipe --json "$OUTDIR/ft8b_compile_ours_$recipe.json" \
          2>&1 | tee "$OUTDIR/ft8b_compile_ours_$recipe.log" | tail -8
        torchao "ft8b_compile_torchao_$recipe" 8 $common --compile --torchao-fp8 $recipe
      done
      # LoRA r16, 4 x 2,048: the default command with and without --fp8 (per row: the one-pass cast).
      recipes lora8b 8 --random-init --lora --dataset synthetic --batch-size 4 --seq-len 2048 --steps 12 --log-every 4 ;;
    fp8loss)
      # Step 22's loss parity: 500 steps of 8B (random weights) on the bundled data, the held-out loss every
      # 100: bf16 and ours (both recipes), ours with e5m2 gradients, and torchao's tensorwise recipe (e5m2
      # gradients; needs torchao in .whl/) compiled, with the same kernels around it, attention included.
      common="--random-init --batch-size 2 --seq-len 2048 --steps 500 --log-every 50 --eval-every 100"
      recipes loss500 4 $common
      for recipe in tensorwise rowwise; do
        python3 finetune_optimized.py $common --fp8 $recipe --fp8-grads e5m2 \
          --json "$OUTDIR/loss500_${recipe}_e5m2.json" 2>&1 | tee "$OUTDIR/loss500_${recipe}_e5m2.log" | tail -4
      done
      torchao loss500_torchao_tensorwise 4 $common --packing --compile --torchao-fp8 tensorwise \
        --use-custom-attention ;;
    fp8producers)
      # Step 22's producers (the amax handed to the casts): the same run with them on and off, alternating,
      # off by kernel_common.FP8_PRODUCERS = False; 8B full fine-tuning, then a Qwen2.5-1.5B loop whose losses
      # must be the same bits both ways (the 8B rows are unpacked: cuDNN's backward is not deterministic).
      common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 --log-every 4 --fp8 tensorwise"
      loop="--model Qwen/Qwen2.5-1.5B --random-init --batch-size 4 --seq-len 1024 --steps 30 --log-every 1 --fp8 tensorwise"
      off="import runpy, sys, kernel_common; kernel_common.FP8_PRODUCERS = False; sys.argv = sys.argv[1:];"
      off="$off runpy.run_path(sys.argv[0], run_name='__main__')"
      for run in 1 2; do
        python3 finetune_optimized.py $common 2>&1 | tee "$OUTDIR/ft8b_producers_on_$run.log" | grep Average
        python3 -c "$off" finetune_optimized.py $common 2>&1 | tee "$OUTDIR/ft8b_producers_off_$run.log" | grep Average
      done
      python3 finetune_optimized.py $loop > "$OUTDIR/loop_producers_on.log" 2>&1
      python3 -c "$off" finetune_optimized.py $loop > "$OUTDIR/loop_producers_off.log" 2>&1
      diff <(grep "^step" "$OUTDIR/loop_producers_on.log" | awk '{print $2, $4}') \
           <(grep "^step" "$OUTDIR/loop_producers_off.log" | awk '{print $2, $4}') && echo "losses: the same" ;;
    residual)
      # Step 24: the residual adds inside the norms, the default against --no-use-custom-residual, alternating:
      # 8B full 2 x 2,048 --fp8 tensorwise twice and bf16, 8B LoRA r16 --fp8 tensorwise 4 x 2,048 twice.
      full="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 --warmup-steps 3 --log-every 4"
      lora="--random-init --dataset synthetic --batch-size 4 --seq-len 2048 --steps 12 --warmup-steps 3 --log-every 4"
      lora="$lora --lora --lora-r 16 --fp8 tensorwise"
      for run in fp8:1 fp8:2 bf16:1 lora:1 lora:2; do
        kind=${run%%:*}; args="$full --fp8 tensorwise"; [ $kind = bf16 ] && args="$full"; [ $kind = lora ] && args="$lora"
        for mode in off on; do
          flag=""; [ $mode = off ] && flag="--no-use-custom-residual"
          python3 finetune_optimized.py $args $flag --json "$OUTDIR/residual_${kind}_${mode}_${run#*:}.json" 2>&1 \
            | tee "$OUTDIR/residual_${kind}_${mode}_${run#*:}.log" | grep -E "Average throughput|Peak memory"
        done
      done ;;
    remake)
      # Step 20: what backward makes again instead of keeping (the norms' outputs: lora_kernel.REMAKE_NORMS; a
      # LoRA down_proj's input h: TritonLlamaMLP.recompute_hidden), on and off alternating: 8B LoRA r16 4 x 2,048
      # and 1 x 16,384 tokens, 8B full 2 x 2,048 (norms only: there h is recomputed either way); then LoRA
      # 1 x 32,768, which did not fit on an H200 before.
      off="import runpy, sys, lora_kernel, swiglu_kernel; lora_kernel.REMAKE_NORMS = False;"
      lora_off="$off swiglu_kernel.TritonLlamaMLP.recompute_hidden = False;"
      run="sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
      for spec in "lora 4 2048" "lora 1 16384" "full 2 2048"; do
        set -- $spec
        common="--random-init --dataset synthetic --batch-size $2 --seq-len $3 --steps 12 --log-every 4"
        [ "$1" = lora ] && common="$common --lora"
        [ "$1" = lora ] && undo="$lora_off" || undo="$off"
        for round in 1 2; do
          python3 finetune_optimized.py $common --json "$OUTDIR/remake_$1_$2x$3_on_$round.json" 2>&1 \
            | tee "$OUTDIR/remake_$1_$2x$3_on_$round.log" | grep "Average\|Peak"
          python3 -c "$undo $run" finetune_optimized.py $common --json "$OUTDIR/remake_$1_$2x$3_off_$round.json" 2>&1 \
            | tee "$OUTDIR/remake_$1_$2x$3_off_$round.log" | grep "Average\|Peak"
        done
      done
      python3 finetune_optimized.py --random-init --dataset synthetic --lora --batch-size 1 --seq-len 32768 --steps 6 \
        --json "$OUTDIR/remake_lora_1x32768.json" 2>&1 | tee "$OUTDIR/remake_lora_1x32768.log" | tail -4 ;;
    inbackward)
      # Step 20: 8B full fine-tuning 2 x 2,048, the plain loop without clipping against --optimizer-in-backward.
      for extra in "" "--optimizer-in-backward"; do
        python3 finetune_optimized.py --random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 \
          --log-every 4 --max-grad-norm 0 $extra --json "$OUTDIR/ft8b_noclip${extra:+_inbackward}.json" 2>&1 \
          | tee "$OUTDIR/ft8b_noclip${extra:+_inbackward}.log" | tail -8
      done ;;
    fsdp)
      # Step 19 on 2 GPUs: 8B full 2 x 2,048 per GPU; prefetch 0 / 1, the gradient reduction in float32 / bf16,
      # the weights kept gathered from forward to backward,
      # and one GPU alone (the per-GPU ratio).
      CUDA_VISIBLE_DEVICES=0 python3 finetune_optimized.py --random-init --dataset synthetic --batch-size 2 \
        --seq-len 2048 --steps 12 --log-every 4 --json "$OUTDIR/single.json" 2>&1 | tee "$OUTDIR/single.log" | tail -8
      for extra in "" "--fsdp-prefetch 1" "--fsdp-reduce-dtype bfloat16" "--fsdp-keep-gathered" \
                   "--fsdp-keep-gathered --fsdp-reduce-dtype bfloat16"; do
        tag=${extra:-default}; tag=${tag//--/}; tag=${tag// /_}
        torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp --random-init --dataset synthetic \
          --batch-size 2 --seq-len 2048 --steps 12 --log-every 4 $extra --json "$OUTDIR/fsdp_$tag.json" 2>&1 \
          | tee "$OUTDIR/fsdp_$tag.log" | tail -8
      done
      torchrun --standalone --nproc-per-node 2 profile_baseline.py --fsdp --random-init --dataset synthetic \
        --batch-size 2 --seq-len 2048 --trace-dir "$OUTDIR/traces" $KERNELS 2>&1 \
        | tee "$OUTDIR/profile_fsdp.log" | tail -24 ;;
    gpus)
      # Step 19 on every visible GPU (2 or 4): a collective beside matmuls per kind of memory (tools/comm_overlap.py),
      # one GPU alone, then all of them with the run's own choice between --ddp and --fsdp, each named, FSDP with bf16
      # reduction, --ddp --compile, --ddp with a held-out evaluation every 4 steps (between the graph's replays), its
      # pieces gathered by NCCL's kernels, every gradient all-reduced, FSDP's all-gathers in FSDP2's own buffers
      # (NCCL's kernels; the default is the copy engines) and in NCCL's allocator, FSDP with FP8; tests/fsdp_test.py over NCCL (DDP's
      # checkpoints, the pieces' graph path and the choice included); on 4 GPUs, 70B LoRA r16 too.
      n=$(nvidia-smi -L | wc -l)
      common="--random-init --dataset synthetic --batch-size 2 --seq-len 2048 --steps 12 --log-every 4"
      for memory in plain window; do
        policy=""; [ $memory = window ] && policy=NCCL_CTA_POLICY=2  # zero CTAs: the copy engines' all-gathers
        env $policy torchrun --standalone --nproc-per-node "$n" tools/comm_overlap.py --memory $memory \
          --json "$OUTDIR/overlap_${n}_$memory.json" 2>&1 | tee "$OUTDIR/overlap_${n}_$memory.log" | tail -3
      done
      CUDA_VISIBLE_DEVICES=0 python3 finetune_optimized.py $common --json "$OUTDIR/gpus_one.json" 2>&1 \
        | tee "$OUTDIR/gpus_one.log" | tail -8
      for extra in "" "--fsdp" "--ddp" "--fsdp --fsdp-reduce-dtype bfloat16" "--ddp --compile" \
                   "--ddp --eval-every 4" "--ddp --no-ddp-copy-engines" "--ddp --no-ddp-shard-optimizer" \
                   "--fsdp --fsdp-comm pytorch" "--fsdp --fsdp-comm pg-memory" "--fsdp --fp8 tensorwise"; do
        tag=${extra:-chosen}; tag=${tag//--/}; tag=${tag// /_}
        torchrun --standalone --nproc-per-node "$n" finetune_optimized.py $common $extra \
          --json "$OUTDIR/gpus_${n}_$tag.json" 2>&1 | tee "$OUTDIR/gpus_${n}_$tag.log" | tail -8
      done
      python3 -m pytest -q tests/fsdp_test.py 2>&1 | tee "$OUTDIR/pytest_fsdp_$n.log" | tail -3
      if [ "$n" -ge 4 ]; then
        torchrun --standalone --nproc-per-node "$n" finetune_optimized.py --fsdp --model meta-llama/Llama-3.1-70B \
          --random-init --lora --gradient-checkpointing --dataset synthetic --batch-size 1 --seq-len 2048 \
          --warmup-steps 1 --steps 4 --json "$OUTDIR/gpus_${n}_lora70b.json" 2>&1 \
          | tee "$OUTDIR/gpus_${n}_lora70b.log" | tail -8
      fi ;;
    trainer|trainer-full|trainer-small)
      # Step 23: TRL's SFTTrainer on the bundled data, packed and padding-free, with kernel_ft.apply
      # (the default), with Liger-Kernel (TRL's use_liger_kernel=True), plain. One run per row; a run
      # that runs out of memory says so in its log and the next one runs.
      row() {  # row NAME FLAGS...
        local name=$1; shift
        python3 finetune_trainer.py $common "$@" --json "$OUTDIR/${what}_$name.json" 2>&1 \
          | tee "$OUTDIR/${what}_$name.log" | tail -9
      }
      case $what in
        trainer)  # 8B LoRA r16 on every projection, 4 x 2,048 tokens per step
          common="--random-init --lora --batch-size 4 --seq-len 2048 --steps 30"
          row kernels; row liger --liger; row plain-ckpt --no-kernels --gradient-checkpointing; row plain --no-kernels ;;
        trainer-full)  # 8B full fine-tuning, 2 x 2,048 tokens per step
          common="--random-init --batch-size 2 --seq-len 2048 --steps 30"
          row kernels; row plain --no-kernels; row plain-ckpt --no-kernels --gradient-checkpointing ;;
        trainer-small)  # Qwen2.5-1.5B LoRA r16, 4 x 512
          common="--model Qwen/Qwen2.5-1.5B --random-init --lora --lr 2e-4 --batch-size 4 --seq-len 512 --steps 40"
          row kernels; row liger --liger; row plain --no-kernels ;;
      esac ;;
    *) echo "unknown step: $what (tests bench e2e compile profile maxseq graphs families attention longcontext fp8 fp8e2e"\
         "fp8loss fp8producers"\
         "remake inbackward fsdp gpus residual trainer trainer-full trainer-small)"; exit 2 ;;
  esac
done
tar czf "$OUTDIR/logs.tgz" --exclude=logs.tgz --exclude=traces -C "$OUTDIR" .
