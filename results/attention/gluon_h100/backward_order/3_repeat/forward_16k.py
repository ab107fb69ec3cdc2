# Forward alone, ours (the Gluon forward via attention_kernel) against cuDNN's, one causal document of 8K and 16K.
import os, sys, torch, triton
import torch.nn.functional as F
sys.path.insert(0, os.getcwd())
import attention_kernel as ak
from kernel_ft import benchmark_specs as bs
for T in (8192, 16384):
    spec = {"tokens": T, "batch": 1, "seq": T, "heads": 32, "kv_heads": 8, "head_dim": 128, "docs": "one"}
    q, k, v, ds = (t.detach() for t in bs.attention_inputs(spec)["args"])
    scale = 128 ** -0.5
    flop = 4 * 32 * 128 * bs.visible_pairs(spec)
    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for rep in range(2):
        for name, fn in (("ours", lambda: ak.attention_forward(q, k, v, ds, scale, 0, 0.0)), ("cuDNN", cudnn)):
            ms = triton.testing.do_bench(fn, warmup=10, rep=80)
            print(f"T={T} forward {name:<6} {ms * 1e3:8.1f} us {flop / ms / 1e9:5.0f} TFLOP/s", flush=True)
