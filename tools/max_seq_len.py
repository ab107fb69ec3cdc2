"""
The longest sequence that trains at batch 1 without running out of GPU memory.

Loads the model once (same flags as the fine-tune scripts), then tries full
training steps (forward, loss, backward, AdamW) at growing sequence lengths:
steps of --step tokens until the first out-of-memory error, then a binary search
between the last length that trained and the first that did not, down to
--resolution tokens. The run is set up as the fine-tune scripts set theirs up
(kernel_ft/run.py), so the figure is the one the fine-tune script would reach.

Memory is what it measures, so it needs a GPU: on a CPU it says so and exits 2
(the process would swap, then be killed, long before it printed an answer).

Usage:
    python tools/max_seq_len.py --random-init                  # the HF baseline
    python tools/max_seq_len.py --random-init --all-kernels    # every --use-custom-* kernel
    python tools/max_seq_len.py --random-init --use-custom-flce --json maxseq.json
    python tools/max_seq_len.py --random-init --all-kernels --lora          # LoRA adapters only trained
"""

import argparse
import gc
import sys
import time

from kernel_ft import flags  # first: the Triton interpreter switch, then transformers
from kernel_ft import dataloader, files, reporting, run, training
from swap_common import vocabulary_size
import torch


ALL_KERNELS = (*flags.KERNELS, "lora")  # what --all-kernels switches on


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Longest trainable sequence at batch 1 (GPU only).")
    flags.add_model_args(parser)
    flags.add_lora_args(parser)  # --lora: the frozen model's longest sequence
    # None: not named on the command line, so --all-kernels may switch it on (with --lora, the fused LoRA too).
    parser.set_defaults(**{f"use_custom_{name}": None for name in ALL_KERNELS})
    g = parser.add_argument_group("search")
    g.add_argument("--all-kernels", action="store_true",
                   help="switch on every --use-custom-* kernel not switched off by name (--no-use-custom-attention: "
                        "SDPA's attention with every other kernel)")
    g.add_argument("--step", type=flags.positive_int, default=4096,
                   help="grow the length by this many tokens until the first OOM (default: %(default)s)")
    g.add_argument("--resolution", type=flags.positive_int, default=512,
                   help="stop the binary search when the bracket is this narrow (default: %(default)s)")
    g.add_argument("--json", metavar="PATH", help="write the lengths tried and the result here")
    args = parser.parse_args(argv)
    for name in ALL_KERNELS:
        flag = f"use_custom_{name}"
        if getattr(args, flag) is None:
            setattr(args, flag, args.all_kernels)
    return args


def try_len(model, optimizer, loss_fn, seq, vocab):
    """Two training steps at batch 1 x seq; returns the peak GiB, or None on OOM."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(2):  # the first step also allocates AdamW's state
            ids = torch.randint(0, vocab, (1, seq), device="cuda")
            training.train_step(model, optimizer, loss_fn, [dataloader.lm_batch(ids)])
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError:
        return None
    finally:
        # Whatever the failed step left (gradients, activations held by the
        # exception's frames) must go before the next, shorter attempt.
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("error: tools/max_seq_len.py measures GPU memory and needs a CUDA GPU; none is available",
              file=sys.stderr)
        sys.exit(2)
    args, _ = run.settle(args)  # --json and the rest checked before minutes of searching
    # Random token ids (synthetic data); load_model checks the length against the model's maximum.
    args = args.but(batch_size=1, seq_len=args.step, dataset=flags.SYNTHETIC)

    env = reporting.environment_info()
    reporting.print_banner("Longest trainable sequence at batch 1", env)
    flags.print_notes(args)
    t0 = time.perf_counter()
    model, info, _ = run.load(args)  # with --lora, the adapters too
    print(f"Model ready in {time.perf_counter() - t0:.0f} s", flush=True)
    # The fine-tune scripts' setup (run.assemble): the kernels, compile, the optimizer.
    kernels, loss_fn, optimizer, _ = run.assemble(args, model, None, run.apply_kernels, None)
    vocab = vocabulary_size(model)
    max_pos = model.config.max_position_embeddings

    tried = []

    def attempt(seq):
        peak = try_len(model, optimizer, loss_fn, seq, vocab)
        tried.append([seq, peak])  # [length, peak GiB or null for OOM], as in results/maxseq_*.json
        print(f"seq {seq:>7,}: " + (f"trains, peak {peak:.2f} GiB" if peak else "out of memory"), flush=True)
        return peak is not None

    # Grow in --step strides until the first OOM (or the model's maximum) ...
    ok, bad = 0, None
    seq = args.step
    while bad is None and seq <= max_pos:
        if attempt(seq):
            ok, seq = seq, seq + args.step
        else:
            bad = seq
    # ... then bisect the bracket (ok, bad] down to --resolution.
    while bad is not None and bad - ok > args.resolution:
        mid = (ok + bad) // 2 // args.resolution * args.resolution
        if mid <= ok:
            break
        if attempt(mid):
            ok = mid
        else:
            bad = mid

    active = [k for k, on in kernels.items() if on] or ["none"]
    first_oom = f"first OOM at {bad:,}" if bad else f"no OOM up to the model's maximum of {max_pos:,}"
    print(f"Result: kernels {', '.join(active)}: longest trainable sequence at batch 1 is {ok:,} tokens "
          f"({first_oom})", flush=True)
    if args.json:
        files.write_json_atomic(args.json, {
            "kernels": kernels, "longest_ok": ok, "first_oom": bad, "tried": tried,
            "config": flags.public_config(args), "environment": env, "model": info,
        })
        print(f"Wrote {args.json}")
    return ok


if __name__ == "__main__":
    main()
