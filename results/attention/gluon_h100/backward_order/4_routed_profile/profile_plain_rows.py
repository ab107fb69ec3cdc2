# What one routed fwd+bwd of plain causal rows costs, ours against SDPA's, kernel by kernel (torch.profiler).
import os, sys, torch
sys.path.insert(0, os.getcwd())
import attention_routing as ar
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention
cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_hidden_layers=1)
cfg._attn_implementation = "sdpa"
layer = LlamaAttention(cfg, 0)
for T in (8192, 16384):
    key = ("cuda", torch.bfloat16, 1, T, 32, 8, 128, "sdpa")
    print(f"T={T} time_plain_rows (ours, sdpa) ms:", ar.time_plain_rows(layer, key), flush=True)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        ar.time_plain_rows(layer, key, repeats=2)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70), flush=True)
