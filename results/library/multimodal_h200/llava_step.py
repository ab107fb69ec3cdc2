"""
A LLaVA-1.5-7B-shaped image-text model (random weights: no hub here) on one GPU: the
training step's forward and backward with one 336 x 336 image per row, without and then
with ``kernel_ft.apply``, on the same weights and inputs. Prints a table, writes JSON.

    python results/library/multimodal_h200/llava_step.py --json OUT.json [--batch-size 2 --seq-len 2048]

Timed: fwd+bwd (no optimizer step), after warm-up steps, CUDA-synchronized wall time per
step; tokens/s counts every position of the rows (the 576 image tokens included). Peak:
torch.cuda.max_memory_allocated() during the timed steps.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import kernel_ft  # noqa: E402 - first: the interpreter switch (no effect on a GPU)
import torch  # noqa: E402
import transformers  # noqa: E402

IMAGE_TOKEN = 32000


def build():
    text = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                                    max_position_embeddings=4096)
    vision = transformers.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                           num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlavaForConditionalGeneration(config).to(torch.bfloat16)
    return model.train(), (336 // 14) ** 2


def batch(rows, seq_len, image_tokens):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, IMAGE_TOKEN, (rows, seq_len), generator=gen)
    ids[:, 1:1 + image_tokens] = IMAGE_TOKEN  # the image after the first token, as LLaVA's prompt puts it
    labels = ids.clone()
    labels[:, :1 + image_tokens] = -100
    pixels = torch.randn(rows, 3, 336, 336, generator=gen).to(torch.bfloat16)
    return {"input_ids": ids.cuda(), "labels": labels.cuda(), "pixel_values": pixels.cuda()}


def step(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach().float().item()


def timed(model, inputs, warmup, steps):
    first = step(model, inputs)
    for _ in range(warmup - 1):
        step(model, inputs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step(model, inputs)
    torch.cuda.synchronize()
    return first, (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json")
    args = parser.parse_args()
    model, image_tokens = build()
    inputs = batch(args.batch_size, args.seq_len, image_tokens)
    tokens = args.batch_size * args.seq_len
    rows = {}
    rows["HF (SDPA)"] = timed(model, inputs, args.warmup, args.steps)
    report = kernel_ft.apply(model)
    print(report)
    rows["kernel_ft.apply"] = timed(model, inputs, args.warmup, args.steps)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"LLaVA-1.5-7B shapes, random weights, bf16, {args.batch_size} x {args.seq_len} tokens "
          f"({image_tokens} of each row an image's), fwd+bwd")
    print(f"{'':<18} {'first loss':>10} {'s/step':>8} {'tokens/s':>9} {'peak GiB':>9}")
    for name, (loss, seconds, peak) in rows.items():
        print(f"{name:<18} {loss:>10.4f} {seconds:>8.3f} {tokens / seconds:>9,.0f} {peak / 2**30:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "transformers": transformers.__version__, "batch_size": args.batch_size,
                       "seq_len": args.seq_len, "image_tokens": image_tokens, "applied": report.applied,
                       "rows": {name: {"first_loss": loss, "seconds_per_step": s, "tokens_per_sec": tokens / s,
                                       "peak_memory_bytes": peak} for name, (loss, s, peak) in rows.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
