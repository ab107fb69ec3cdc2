"""Developer tool (GPU): the longest sequence at batch 1 that trains without running out of memory.

Loads the model once (same flags as the fine-tune scripts), then tries full
training steps (forward, loss, backward, AdamW) at growing sequence lengths:
steps of --step tokens until the first OOM, then bisection down to --resolution.

    python .ci/max_seq_len.py --random-init                      # HF baseline
    python .ci/max_seq_len.py --random-init --all-kernels        # finetune_optimized.py's kernels
"""
import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import llama_common as common  # noqa: E402  (first: it sets up the Triton interpreter on CPU)
import torch  # noqa: E402


def try_len(model, optimizer, loss_fn, seq, vocab):
    """Two training steps at batch 1 x seq; returns peak GiB or None on OOM."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(2):  # the first step also allocates AdamW's state
            ids = torch.randint(0, vocab, (1, seq), device="cuda")
            common.train_step(model, optimizer, loss_fn, ids, ids)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError:
        return None
    finally:
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    common.add_model_args(parser)
    parser.add_argument("--all-kernels", action="store_true", help="every --use-custom-* kernel on")
    parser.add_argument("--step", type=int, default=4096)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--json")
    args = common.resolve_defaults(parser.parse_args())
    if args.all_kernels:
        for name in common.KERNELS:
            setattr(args, f"use_custom_{name}", True)
    args.seq_len = args.step
    t0 = time.perf_counter()
    model, info = common.load_model(args)
    print(f"model ready in {time.perf_counter() - t0:.0f} s", flush=True)
    kernels = common.kernels_from_args(args)
    loss_fn = common.apply_kernels(model, kernels)
    optimizer = common.make_optimizer(model, 1e-5, use_triton=args.use_custom_adamw)
    vocab = model.config.vocab_size
    tried = []
    ok, bad = 0, None
    seq = args.step
    while bad is None and seq <= model.config.max_position_embeddings:
        peak = try_len(model, optimizer, loss_fn, seq, vocab)
        tried.append((seq, peak))
        print(f"seq {seq:>7,}: " + (f"trains, peak {peak:.2f} GiB" if peak else "OOM"), flush=True)
        if peak:
            ok, seq = seq, seq + args.step
        else:
            bad = seq
    while bad is not None and bad - ok > args.resolution:
        mid = (ok + bad) // 2 // args.resolution * args.resolution
        peak = try_len(model, optimizer, loss_fn, mid, vocab)
        tried.append((mid, peak))
        print(f"seq {mid:>7,}: " + (f"trains, peak {peak:.2f} GiB" if peak else "OOM"), flush=True)
        if peak:
            ok = mid
        else:
            bad = mid
    print(f"RESULT kernels={[k for k, on in kernels.items() if on] or 'none'} longest trainable seq at batch 1: "
          f"{ok:,} tokens (first OOM at {bad})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": kernels, "longest_ok": ok, "first_oom": bad, "tried": tried,
                       "environment": common.environment_info(), "model": info}, f, indent=2)


if __name__ == "__main__":
    main()
