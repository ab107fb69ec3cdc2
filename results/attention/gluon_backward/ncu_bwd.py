"""One launch of the Gluon backward per variant given (as in sweep.py: NAME=opt:value,...) and one of cuDNN's backward
on the 8K document, to be read by Nsight Compute: where the time goes (DRAM bytes, L2 hit rate, tensor-pipe load).
ncu --clock-control none -k regex:"attn_bwd_hopper|cudnn|sdpa|fort" --section SpeedOfLight ... python ncu_bwd.py NAME=...
(the launches come in the order of the arguments, cuDNN's forward and backward last)"""
import os, sys
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
import attention_kernel as ak  # first: kernel_common's import rule
from attention_hopper_kernel import attention_backward_hopper
from kernel_ft import benchmark_specs as bs

variants = [{k: int(v) for k, v in (o.split(":") for o in a.partition("=")[2].split(",") if o)} for a in sys.argv[1:]]
spec = {"tokens": 8192, "batch": 1, "seq": 8192, "heads": 32, "kv_heads": 8, "head_dim": 128, "docs": "one"}
inputs = bs.attention_inputs(spec)
q, k, v, ds = (t.detach() for t in inputs["args"])
dout = inputs["upstream"][0]
scale = 128 ** -0.5
out, lse = ak.attention_forward(q, k, v, ds, scale, 0, 0.0)
delta = ak.backward_delta(out, dout)
for opts in variants:
    attention_backward_hopper(dout, q, k, v, lse, delta, None, scale, **opts)
qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
torch.autograd.grad(o, (qq, kk, vv), dout.transpose(1, 2))
torch.cuda.synchronize()
print("done", sys.argv[1:])
