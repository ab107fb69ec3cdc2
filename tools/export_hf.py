"""
Export a --fsdp checkpoint as a normal Hugging Face folder.

A run with --fsdp saves each checkpoint (DIR/checkpoint-K) as DCP shards: every
process wrote its own pieces of each weight, and only a run with the same number
of processes can resume from them. This tool makes the one folder everything
else reads: it rebuilds the model the checkpoint describes (its
trainer_state.json holds the model's config and the LoRA settings), reads the
shards into that whole model in one process (no torchrun, no GPU; the memory of
the weights in the dtype they were trained in), and writes it with
save_pretrained:

* full fine-tuning: config.json + model.safetensors, for
  ``AutoModelForCausalLM.from_pretrained(OUT_DIR)``;
* --lora: the PEFT adapter folder (adapter_config.json +
  adapter_model.safetensors), for ``PeftModel.from_pretrained(base, OUT_DIR)``
  on the base model the run started from (the checkpoint holds the adapters only).

The tokenizer is not part of a checkpoint: it is the base model's.
Checkpoints of a run without --fsdp need no export: they already hold
save_pretrained's output.

Usage:
    torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp --output-dir runs/fsdp --save-every 100
    python tools/export_hf.py runs/fsdp/checkpoint-100 runs/fsdp-hf
"""

import argparse
import os

from kernel_ft import checkpoints, files, models  # first: the Triton interpreter switch, then transformers
import torch
from transformers import AutoConfig

CHECKPOINT = "CHECKPOINT_DIR"
OUT = "OUT_DIR"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Write a --fsdp (sharded) checkpoint as a save_pretrained folder.")
    parser.add_argument("checkpoint", metavar=CHECKPOINT, help="a checkpoint-K folder written by a --fsdp run")
    parser.add_argument("out_dir", metavar=OUT, help="the folder to write (new, or empty)")
    return parser.parse_args(argv)


def check_sharded(state):
    """Only the shards need exporting: say what a single-process checkpoint already is."""
    if state.get("sharded"):
        return
    what = ("the PEFT adapter folder (adapter_config.json, adapter_model.safetensors)" if state["lora_config"]
            else "config.json and model.safetensors")
    raise SystemExit(f"error: {CHECKPOINT} {state['path']}: written by one process without --fsdp, so it "
                     f"already is save_pretrained's output ({what}); load it with from_pretrained as it is")


def check_out_dir(path, checkpoint):
    path = files.check_output_path(path, OUT, directory=True, inputs=[(CHECKPOINT, os.path.realpath(checkpoint))])
    if os.path.isdir(path) and os.listdir(path):
        raise SystemExit(f"error: {OUT} {path}: exists and is not empty; name a new folder")
    return path


def rebuild_model(state):
    """The run's model as it was sharded, on the meta device (shapes, no memory):
    its config from the checkpoint, and with LoRA the same adapters (apply_lora with
    the run's own --lora-* flags)."""
    config = AutoConfig.for_model(**state["model_config"])  # model_type is one of its keys
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, config.dtype or "float32")
    model = models.build_random(config, torch.device("meta"), dtype)
    if state["lora_config"]:
        model = models.apply_lora(model, argparse.Namespace(**state["flags"]))
        # Where PeftModel.from_pretrained will look for the base (the tiny model has none on the hub).
        model.peft_config["default"].base_model_name_or_path = None if state["flags"]["tiny"] else state["model_name"]
    checkpoints.check_same_model(state, model, flag=CHECKPOINT)
    return model


def main(argv=None):
    args = parse_args(argv)
    state = checkpoints.read_checkpoint_state(args.checkpoint, flag=CHECKPOINT)
    check_sharded(state)
    out = check_out_dir(args.out_dir, state["path"])
    model = rebuild_model(state)
    checkpoints.load_sharded_model(state["path"], model, flag=CHECKPOINT)
    if not state["lora_config"]:
        model.tie_weights()  # a tied LM head is one tensor again (the shards hold both names)
    model.save_pretrained(out)
    kind = "LoRA adapters (PeftModel.from_pretrained on the base model)" if state["lora_config"] else \
        "the model (from_pretrained)"
    print(f"Exported      {state['path']} (step {state['step']}, {state['world_size']} processes) -> {out}: {kind}")
    return out


if __name__ == "__main__":
    main()
