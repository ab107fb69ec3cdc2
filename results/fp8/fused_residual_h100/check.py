"""The fused residual experiment on a small LLaMA: loss and gradients with and without it (float32: the same
loss, gradients within float32 rounding; bf16 and FP8 within theirs). From the repository root with fused_residual.patch (beside this file)
applied: python results/fp8/fused_residual_h100/check.py"""
import copy
import sys

sys.path.insert(0, ".")
import kernel_common  # noqa: F401
import torch
from transformers import LlamaForCausalLM

import kernel_ft
import rmsnorm_kernel
from kernel_ft import models

device = "cuda" if torch.cuda.is_available() else "cpu"
cfg = models.tiny_config()
cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 256, 512, 2
cases = [(torch.float32, None), (torch.bfloat16, None)] + ([(torch.bfloat16, "tensorwise")] if device == "cuda" else [])
for dtype, fp8 in cases:
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(device, dtype)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    kernel_ft.apply(m, flce=False, **({"fp8": fp8} if fp8 else {}))
    m2 = copy.deepcopy(m)
    fused = rmsnorm_kernel.fuse_residuals(m2)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), device=device)
    out = []
    for mod in (m, m2):
        mod.zero_grad()
        loss = mod(input_ids=ids, labels=ids).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in mod.named_parameters()}))
    worst = max(((a - out[1][1][n]).float().abs().max() / (a.float().abs().max() + 1e-30)).item()
                for n, a in out[0][1].items())
    print(f"{str(dtype):15} fp8={fp8}: {fused} layers fused; loss {out[0][0].item():.6f} / {out[1][0].item():.6f}; "
          f"largest gradient difference {worst:.2e} of the tensor's max")
