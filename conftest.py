"""Shared pieces of the correctness tests (pytest loads this file first).

* Without CUDA, kernels run through the Triton interpreter on CPU tensors;
  kernel_common sets the variable before triton is imported, so it comes first.
* ``rel_err`` and ``no_worse`` implement the project's definition of correct:
  compare with a float64 truth, and require the kernel's error to be no worse
  than about twice the error of the PyTorch path at the same dtype.
* ``check_outputs`` applies that rule to several outputs at once; every test
  file's comparison with the truth goes through it.
* ``peak_extra_mb`` measures the extra GPU memory of one call (GPU-only tests).
* ``narrow_tiny_config`` is the tiny LLaMA for the emulated FP8 model tests.
* ``pytest_collection_modifyitems`` puts the longest files first (``-n N`` balance).
"""

import os

import pytest
import torch

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# Under `pytest -n N` (pytest-xdist: PYTEST_XDIST_WORKER set) N workers share the cores.
# PyTorch's CPU operators would each start as many threads as there are cores, and
# with every core busy those threads wait on one another: a tiny linear layer then took
# ~15 ms instead of ~4 us. One thread per worker; the workers are the parallelism.
if not ON_GPU and os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# An absolute floor on relative error, a tenth of the dtype's unit roundoff: when
# the PyTorch path happens to be nearly exact, "2x its error" alone would demand
# more than the dtype can represent.
ERROR_FLOOR = {torch.float32: 1.2e-8, torch.float16: 9.8e-5, torch.bfloat16: 7.8e-4}


def narrow_tiny_config():
    """The tiny LLaMA (kernel_ft.models.tiny_config), narrower: hidden 64, MLP 128, heads of 16.
    The interpreter casts FP8 weights element by element at every forward (most of an
    emulated FP8 test's time), and what those tests check does not depend on the width;
    still 2 layers of 7 linear layers."""
    from kernel_ft import models

    config = models.tiny_config()
    config.hidden_size, config.intermediate_size, config.head_dim = 64, 128, 16
    return config


# Under `pytest -n N --dist loadfile` (pytest.ini) each file runs whole on one worker, and
# xdist hands the files out in collection order (pytest.ini's --no-loadscope-reorder: its own
# order, by number of tests, started tests/fsdp_test.py ~11th, ~500 s of torchrun pairs that then
# ran alone at the end). The longest files first, on different workers, then the rest as
# collected: the workers finish together. Worker seconds on 2 CPU cores, 2026-12-06 (apply 556,
# fsdp 532, fp8 190, families 154, compile 98, attention 72, finetune 70, train 58, projections
# 51; every other file under 30). Only the order changes: each file's tests keep theirs.
LONGEST_FILES_FIRST = ("tests/apply_test.py", "tests/fsdp_test.py", "fp8_test.py", "tests/families_test.py",
                       "tests/compile_test.py", "attention_test.py", "tests/finetune_test.py", "tests/train_test.py",
                       "projections_test.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FILES_FIRST.index(path) if path in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)

    items.sort(key=rank)  # stable: the other files, and every file's tests, in collection order


def need_gpu():
    """Skip the calling test without CUDA."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")


def rel_err(x, ref):
    """||x - ref|| / ||ref|| in float64; NaN anywhere gives inf (never passes)."""
    x = x.detach().double()
    ref = ref.detach().double()
    if torch.isnan(x).any():
        return float("inf")
    num = (x - ref).norm().item()
    den = ref.norm().item()
    return num / den if den > 0 else num


def no_worse(err_ours, err_torch, dtype, factor=2.0):
    return err_ours <= factor * err_torch + ERROR_FLOOR[dtype]


def check_outputs(names, ours, peer, truth, dtypes=None, factor=2.0, peer_name="PyTorch"):
    """The correctness rule over several outputs at once.

    For each named output: the same dtype and shape as the peer's (the PyTorch
    path at the same dtype), and an error against the float64 truth ``no_worse``
    than ``factor`` x the peer's. ``dtypes`` is the error budget's dtype: one for
    all outputs, one per output, or None for each output's own dtype.
    """
    if dtypes is None or isinstance(dtypes, torch.dtype):
        dtypes = [dtypes] * len(names)
    for name, a, b, t, dtype in zip(names, ours, peer, truth, dtypes):
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype}, {peer_name} gives {b.dtype}"
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)}, {peer_name} gives {tuple(b.shape)}"
        e_ours, e_peer = rel_err(a, t), rel_err(b, t)
        assert no_worse(e_ours, e_peer, dtype or a.dtype, factor), (
            f"{name}: error {e_ours:.2e} vs {peer_name} {e_peer:.2e}"
        )


def saved_bytes(run):
    """(run(), the bytes of the storages autograd keeps from forward to backward while run()
    builds the graph): what a recomputation in backward saves, counted on any device."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def peak_extra_mb(fn):
    """Peak GPU memory during fn() above what was allocated before it, in MB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


@pytest.fixture(autouse=True)
def give_back_cached_gpu_memory():
    """After each GPU test, return PyTorch's cached blocks to the driver: with
    ``-n N`` several test processes share one GPU, and one process's cache of a
    64-bit-offset test (tens of GiB) must not starve the others."""
    yield
    if ON_GPU:
        torch.cuda.empty_cache()
