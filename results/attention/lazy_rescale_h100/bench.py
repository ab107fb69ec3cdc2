"""Not kept (NOTES.md, Step 21): it ran against a patch that is not in the code. The forward's lazy rescale
(attention_kernel.LAZY_RESCALE then: the running sums keep a stale row maximum until one grows by more than 2^8, one
branch per tile) on and off, alternating, on the benchmark's three rows
(one causal 8,192-token document; 16,384 tokens in 133 short / 7 long documents), bf16, 32 query / 8 key-value heads
of 128: the forward alone and fwd+bwd in ms (CUDA events, median of 30 after 5), and the largest difference of the
outputs between the two ways."""
import json, os, sys
sys.path.insert(0, os.getcwd())
import torch
import attention_kernel
from attention_kernel import document_starts, packed_attention


def rows_of(lengths, T):
    pos = torch.cat([torch.arange(n) for n in lengths])
    return pos[:T].view(1, T)


def timed(fn, n=30):
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[n // 2]


g = torch.Generator().manual_seed(0)
short = [int(x) for x in torch.randint(40, 201, (400,), generator=g)]
long_docs = [512, 4096, 1024, 3000, 2048, 4096, 1608]
cases = {"one causal 8,192": (8192, [8192]), "16,384 in short documents": (16384, short),
         "16,384 in 7 long documents": (16384, long_docs)}
results = {}
for name, (T, lengths) in cases.items():
    doc_start = document_starts(rows_of(lengths, T)).cuda()
    q = torch.randn(1, 32, T, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, T, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn(1, T, 32, 128, device="cuda", dtype=torch.bfloat16)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    row, outs = {}, {}
    for rep in range(2):
        for lazy in (True, False):
            attention_kernel.LAZY_RESCALE = lazy
            with torch.no_grad():
                fwd = timed(lambda: packed_attention(q, k, v, doc_start))
            both = timed(lambda: packed_attention(qg, kg, vg, doc_start).backward(dout))
            row.setdefault(f"lazy={lazy}", []).append((round(fwd, 4), round(both, 4)))
            with torch.no_grad():
                outs[lazy] = packed_attention(q, k, v, doc_start).float()
    row["max |out difference|"] = (outs[True] - outs[False]).abs().max().item()
    results[name] = row
    print(name, row, flush=True)
print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}))
