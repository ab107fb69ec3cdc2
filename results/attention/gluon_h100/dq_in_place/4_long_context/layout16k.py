"""fwd+bwd of ours and SDPA at 1 x T, 32/8 heads of 128, with q/k/v contiguous [B,H,T,D] and in HF's layout
(views of [B,T,H,D]), and the leaf gradient's strides. From the checkout (PYTHONPATH=.): python .../layout16k.py [T]"""
import sys, torch, attention_routing as ar, attention_kernel as ak
from swap_common import gpu_clock
import torch.nn.functional as F
T = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
dev, dt = "cuda", torch.bfloat16
B, Hq, Hkv, D = 1, 32, 8, 128
g = torch.Generator(device=dev).manual_seed(0)
def mk(h, hf):
    if hf:
        return torch.randn(B, T, h, D, generator=g, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
    return torch.randn(B, h, T, D, generator=g, device=dev, dtype=dt).requires_grad_()
up = torch.randn(B, T, Hq, D, generator=g, device=dev, dtype=dt)
class L: scaling = D ** -0.5; is_causal = True; num_key_value_groups = 4; training = True
layer = L()
for hf in (False, True):
    q, k, v = mk(Hq, hf).detach().requires_grad_(), mk(Hkv, hf).detach().requires_grad_(), mk(Hkv, hf).detach().requires_grad_()
    if hf:  # leafs in HF layout: make non-leaf views
        q0, k0, v0 = (torch.randn(B, T, h, D, generator=g, device=dev, dtype=dt, requires_grad=True) for h in (Hq, Hkv, Hkv))
    def ours():
        if hf:
            a, b, c = q0.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2)
        else:
            a, b, c = q, k, v
        o = ar.hf_packed_attention(layer, a, b, c, None, scaling=layer.scaling)[0]
        o.backward(up)
    def sdpa():
        if hf:
            a, b, c = q0.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2)
        else:
            a, b, c = q, k, v
        o = F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=layer.scaling, enable_gqa=True).transpose(1, 2)
        o.backward(up)
    for name, f in (("ours", ours), ("sdpa", sdpa)):
        f(); torch.cuda.synchronize()
        ts = sorted(gpu_clock(f)[1] for _ in range(7))
        grad = (q0 if hf else q).grad
        print(f"T={T} {'HF layout' if hf else 'contiguous'} {name}: {ts[3]:.3f} ms (min {ts[0]:.3f}); leaf grad strides {grad.stride()}")
        for t in (q, k, v):
            t.grad = None
        if hf:
            for t in (q0, k0, v0):
                t.grad = None
