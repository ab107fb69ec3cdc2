"""
Step 23 -- The kernels in your own training script: TRL's SFTTrainer with one call.

Steps 11-22 train with this project's own loop. Most people fine-tune with
transformers' Trainer or TRL's SFTTrainer (a Trainer), with PEFT for LoRA. This
script is such a script, on the bundled data, and the kernels go in the way they go
into yours: three lines,

    import kernel_ft
    kernel_ft.apply(model)                                   # after get_peft_model, before the trainer
    trainer = SFTTrainer(model, ..., optimizers=(kernel_ft.AdamW(params, lr=...), None))

``kernel_ft.apply`` (kernel_ft/patching.py) swaps in every kernel that computes the
model's own function and prints what it did; the model's forward then computes HF's
loss without the logits (the trainer sees a normal ``loss``), packed rows run the
document-aware attention, and everything else (padding masks, generate()) runs as
before. ``--no-kernels`` is the same script without those lines; ``--liger`` asks
TRL for Liger-Kernel instead (``use_liger_kernel=True``), the production peer.

The data: each example's prompt and response tokens (the same tokenization as the
other steps, loss on the response only: TRL's completion_only_loss), packed by TRL
into rows of --seq-len tokens (best-fit decreasing) and trained padding-free: the
rows of a step are one flat sequence whose position ids restart at every example,
so no slot is padding and no example attends to another.

Usage:
    python finetune_trainer.py                         # SFTTrainer + kernel_ft.apply (LLaMA-3.1-8B on a GPU)
    python finetune_trainer.py --no-kernels            # plain SFTTrainer
    python finetune_trainer.py --liger                 # SFTTrainer(use_liger_kernel=True)
    python finetune_trainer.py --lora --batch-size 4   # PEFT LoRA r16 on every projection
    python finetune_trainer.py --no-use-custom-attention --json trainer.json   # switches map onto apply's
    torchrun --nproc-per-node 2 finetune_trainer.py    # the trainer's own DDP, the kernels in every process

Prints the kernels' report, a line per step and a table (tokens/s over the steps
after the warm-up, which compiles the kernels; peak memory); --json writes them.
"""

import argparse
import os
import time

import torch

from kernel_ft import dataloader, flags, fsdp, models, reporting, run
from swap_common import vocabulary_size
import kernel_ft

TITLE = "Fine-tuning in TRL's SFTTrainer"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="TRL SFTTrainer fine-tuning with or without kernel_ft.apply.")
    flags.add_model_args(parser, custom_kernels_default=True, packing_default=True)
    flags.add_lora_args(parser)
    g = parser.add_argument_group("the trainer")
    g.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="kernel_ft.apply(model) with the --use-custom-* switches, and kernel_ft.AdamW with "
                        "--use-custom-adamw (default: %(default)s)")
    g.add_argument("--liger", action="store_true",
                   help="TRL's use_liger_kernel=True instead of our kernels (pip install liger-kernel)")
    g.add_argument("--steps", type=flags.positive_int,
                   help="timed optimizer steps (default: 20, or 3 without a GPU)")
    g.add_argument("--warmup-steps", type=flags.non_negative_int,
                   help=f"untimed steps first: kernel compilation, cuBLAS heuristics (default: "
                        f"{flags.GPU_WARMUP_STEPS}, or {flags.CPU_WARMUP_STEPS} without a GPU)")
    g.add_argument("--grad-accum", type=flags.positive_int, default=1,
                   help="micro-batches per optimizer step (TRL passes num_items_in_batch) (default: %(default)s)")
    g.add_argument("--json", metavar="PATH", help="write config, environment, losses, times and memory here")
    return parser.parse_args(argv)


def check_flags(args):
    """Everything that needs no model, before anything is loaded."""
    if not flags.installed("trl"):
        raise SystemExit("error: finetune_trainer.py needs TRL: pip install -r requirements.txt")
    if args.liger and not flags.installed("liger_kernel"):
        raise SystemExit("error: --liger needs Liger-Kernel: pip install liger-kernel==0.8.5")
    if args.liger and args.kernels:  # one set of kernels at a time: Liger's replaces ours (uses_ours)
        flags.note("--liger: Liger-Kernel's kernels instead of ours (--no-kernels)")
    if args.compile:
        raise SystemExit("error: --compile is not supported by finetune_trainer.py (Trainer's torch_compile "
                         "compiles the whole model); use finetune_optimized.py --compile")
    if args.dataset == flags.SYNTHETIC:
        raise SystemExit("error: finetune_trainer.py trains on instruction data (prompt and response); "
                         "--dataset synthetic has none")
    if args.lora_4bit:
        raise SystemExit("error: --lora-4bit is not supported by finetune_trainer.py; use finetune_optimized.py")
    return run.settle(args)[0]  # --json, --lora, --fp8: as the other scripts check them


# --------------------------------------------------------------------------------
# The data: the project's tokenization, handed to TRL already tokenized
# --------------------------------------------------------------------------------
def sft_dataset(data):
    """The training examples as TRL's tokenized format: input_ids and completion_mask
    (1 on the response tokens: the only ones with a loss)."""
    import datasets

    datasets.disable_progress_bars()  # TRL's packing of a few hundred examples takes no time to watch
    ids = [example for example, _ in data.train]
    masks = [[int(label != dataloader.IGNORE_INDEX) for label in labels] for _, labels in data.train]
    return datasets.Dataset.from_dict({"input_ids": ids, "completion_mask": masks})


def trl_tokenizer(data):
    """The tokenizer TRL is given. The data is tokenized already, so TRL only needs its
    padding and end-of-text tokens: the model's own tokenizer when the run has one,
    else (the byte-level tokenizer of --tiny or offline runs) a vocabulary of those
    special tokens with the byte tokenizer's ids."""
    if not isinstance(data.tokenizer, dataloader.ByteTokenizer):
        return data.tokenizer
    from tokenizers import Tokenizer, models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    byte = data.tokenizer
    vocab = {"<pad>": byte.pad_token_id, "<s>": byte.bos_token_id, "</s>": byte.eos_token_id}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", bos_token="<s>", eos_token="</s>")


# --------------------------------------------------------------------------------
# Timing: a callback, since the trainer owns the loop
# --------------------------------------------------------------------------------
class StepClock:
    """Time, tokens and loss of each optimizer step, read at the end of each step
    (the GPU synchronized first, so a step's time is its own)."""

    def __init__(self, warmup, total):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock.start(state)

            def on_step_end(self, args, state, control, **kwargs):
                clock.step_end(state)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    clock.losses.append(float(logs["loss"]))
                    clock.print_step(state.global_step)

        self.callback, self.warmup, self.total = Callback(), warmup, total
        self.times, self.tokens, self.losses = [], [], []

    def start(self, state):
        training_sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.last, self.seen = time.perf_counter(), state.num_input_tokens_seen

    def step_end(self, state):
        training_sync()
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.tokens.append(state.num_input_tokens_seen - self.seen)
        self.last, self.seen = now, state.num_input_tokens_seen

    def print_step(self, step):
        note = ("  (warm-up, not timed)" if step <= self.warmup
                else f"  {self.tokens[-1] / self.times[-1]:>10,.0f} tokens/s")
        print(f"step {step:>4}/{self.total}  loss {self.losses[-1]:.4f}  {self.times[-1]:8.3f} s{note}", flush=True)


def training_sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------
def uses_ours(args):
    """Whether this run trains with our kernels: --kernels (the default), not --liger."""
    return args.kernels and not args.liger


def build_trainer(args, model, data, clock):
    """TRL's SFTTrainer as a user writes it: packed, padding-free, completion-only loss."""
    from transformers import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    on_gpu = torch.cuda.is_available()
    config = SFTConfig(
        output_dir="/tmp/finetune_trainer", report_to="none", save_strategy="no", disable_tqdm=True,
        max_steps=args.warmup_steps + args.steps, per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=0, logging_steps=1, seed=args.seed,
        max_length=args.seq_len, packing=args.packing, padding_free=args.packing, completion_only_loss=True,
        bf16=on_gpu and next(model.parameters()).dtype == torch.bfloat16, use_cpu=not on_gpu,
        gradient_checkpointing=args.gradient_checkpointing, use_liger_kernel=args.liger,
        include_num_input_tokens_seen="all" if args.packing else "non_padding",
        dataloader_num_workers=args.num_workers or 0, dataloader_pin_memory=args.pin_memory and on_gpu,
        # Under torchrun: every trained parameter takes part in each step, so DDP need not walk the
        # autograd graph looking for unused ones (Trainer's default for a PEFT model).
        ddp_find_unused_parameters=False,
    )
    optimizers = (None, None)
    if uses_ours(args) and flags.kernels_from_args(args)["adamw"]:
        params = models.trainable_parameters(model)
        optimizers = (kernel_ft.AdamW(params, lr=args.lr, weight_decay=config.weight_decay), None)
    trainer = SFTTrainer(model=model, args=config, train_dataset=sft_dataset(data),
                         processing_class=trl_tokenizer(data), optimizers=optimizers, callbacks=[clock.callback])
    trainer.remove_callback(PrinterCallback)  # its dict per step: the clock prints one line instead
    return trainer


def switch_in(args, model):
    """The kernels (or not), printed as a user of the library sees them."""
    if args.liger:
        print("Kernels:       Liger-Kernel through TRL (use_liger_kernel=True)")
        return None
    if not uses_ours(args):
        print("Kernels:       none (PyTorch / HF)")
        return None
    report = kernel_ft.apply(model, **run.apply_switches(flags.kernels_from_args(args)))
    print("kernel_ft.apply:\n" + "\n".join(f"  {line}" for line in str(report).splitlines()))
    return dict(report)


def main(argv=None):
    # Under torchrun the trainer runs DistributedDataParallel itself (accelerate): every
    # process trains, rank 0 alone prints and writes (the token counts are the sum over all).
    rank, processes = int(os.environ.get("RANK", "0")), flags.processes_started()
    fsdp.print_on_rank0_only(rank)
    args = check_flags(parse_args(argv))
    env = reporting.environment_info()
    reporting.print_banner(TITLE, env)
    flags.print_notes(args)
    records = dataloader.load_records(args.dataset)
    model, model_info = models.load_model(args)
    data = dataloader.prepare_data(args, records, vocabulary_size(model))
    if args.lora:
        model = models.apply_lora(model, args)
    report = switch_in(args, model)
    clock = StepClock(args.warmup_steps, args.warmup_steps + args.steps)
    trainer = build_trainer(args, model, data, clock)
    trainer.train()
    results = summarize(clock, args)
    results["kernels"] = report
    results["world_size"] = processes
    results["tokens_per_sec_per_gpu"] = results["tokens_per_sec"] / processes
    reporting.print_results(f"{TITLE}: results", results)
    if args.json and rank == 0:
        reporting.write_json(args.json, "finetune_trainer.py", args, env, model_info, results)
        print(f"Wrote {args.json}")
    return results


def summarize(clock, args):
    """The loop's result fields (reporting.print_results): the warm-up steps are not timed."""
    timed = len(clock.times) - args.warmup_steps
    timed_time, timed_tokens = sum(clock.times[args.warmup_steps:]), sum(clock.tokens[args.warmup_steps:])
    rate = timed_tokens / timed_time if timed_time > 0 else 0.0
    slots = args.batch_size * args.seq_len * args.grad_accum * timed
    on_gpu = torch.cuda.is_available()
    return {
        "losses": clock.losses,
        "step_times_s": clock.times,
        "tokens_per_step": clock.tokens,
        "warmup_steps": args.warmup_steps,
        "timed_steps": timed,
        "time_per_step_s": timed_time / max(timed, 1),
        # Padding-free rows: every token the trainer counted is a real one; padded rows count
        # their attention mask. Slots: the --batch-size x --seq-len rows a step could hold.
        "tokens_per_sec": rate,
        "real_tokens_per_sec": rate,
        "padding_fraction": max(0.0, 1 - timed_tokens / slots) if slots else 0.0,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if on_gpu else 0,
        "peak_memory_kind": "torch.cuda.max_memory_allocated, the whole training" if on_gpu else "not measured (CPU)",
        "final_loss": clock.losses[-1] if clock.losses else float("nan"),
    }


if __name__ == "__main__":
    main()
