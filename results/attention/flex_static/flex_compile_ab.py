"""FlexAttention as benchmark_kernels.py compiled it before and as it compiles it now (GPU only).

Before, the FlexAttention peer was `torch.compile(flex_attention)` with nothing reset between rows: the
8,192-token row compiled it for its shape, and the 16,384-token rows that follow made torch.compile
compile it again with dynamic shapes (its "automatic dynamic" after a shape changes), code a training run
of fixed shapes would not get. Now it is compiled afresh and static for each shape (benchmark_peers.compiled),
as the other compiled peers already were. This times fwd+bwd of benchmark_kernels.py's three attention rows,
in that order, both ways in one process, eager and replayed from a CUDA graph, with ours beside them.

    python results/attention/flex_static/flex_compile_ab.py [--json PATH]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
import attention_kernel  # noqa: E402,F401  (first: kernel_common's import rule)
from benchmark_kernels import BENCH_MS, make_calls  # noqa: E402
from kernel_ft.benchmark_specs import ATTENTION, bench  # noqa: E402


def flex_as_before():
    # The provider's earlier body, kept here for this comparison only.
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    attend = torch.compile(flex_attention)
    cache = {}

    def op(q, k, v, doc_start):
        if id(doc_start) not in cache:
            B, T = doc_start.shape
            start = doc_start.long()
            cache[id(doc_start)] = create_block_mask(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx)
                                                     & (kv_idx >= start[b, q_idx]), B, None, T, T, device=q.device)
        return attend(q, k, v, block_mask=cache[id(doc_start)], enable_gqa=True).transpose(1, 2)
    return op


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}")
    now = ATTENTION.providers["FlexAttention (compiled)"]
    record = []
    for way, provider in (("as before", flex_as_before), ("static, per shape", now), ("ours", None)):
        ATTENTION.providers["FlexAttention (compiled)"] = provider or now
        name = "ours (Triton)" if provider is None else "FlexAttention (compiled)"
        torch._dynamo.reset()
        for spec in ATTENTION.shapes["full"]:
            _, call = make_calls(ATTENTION, name, spec, seed=0)
            call()
            r = {"row": f"{spec['seq']:,} tokens, documents {spec['docs']}", "way": way,
                 "eager_us": 1e3 * bench(call, BENCH_MS["full"]), "graph_us": 1e3 * bench(call, BENCH_MS["full"], graph=True)}
            record.append(r)
            print(f"{r['row']:<40} {way:<18} fwd+bwd eager {r['eager_us']:9,.1f} us  graph {r['graph_us']:9,.1f} us",
                  flush=True)
    ATTENTION.providers["FlexAttention (compiled)"] = now
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
