"""
Tests for what every kernel shares (kernel_common.py).

The version check refuses the Triton / NumPy combinations known to fail with one
line that says what to install and lets the good ones through; importing triton
before the kernels on a machine without a GPU stops with one clear line; and the
host-side helpers (``as_rows``, ``check_kernel_device``, the grid arithmetic) do
what the launchers rely on. ``@fast_launch`` reuses a
compiled kernel only for arguments Triton itself would reuse it for, gives the
same results as Triton's own launch, and steps aside for launch hooks (GPU).

Usage:
    python kernel_common_test.py   # or: python -m pytest kernel_common_test.py
"""

import os
import subprocess
import sys

import pytest
import torch

import kernel_common
from conftest import DEVICE, ON_GPU, need_gpu
from kernel_common import as_rows, cdiv, check_kernel_device, check_versions, next_power_of_2

HERE = os.path.dirname(os.path.abspath(__file__))


# (triton, numpy, interpret, what the message must say)
REFUSED = [
    pytest.param("3.5.0", "2.3.5", False, "triton>=3.6", id="triton 3.5"),
    pytest.param("3.6.0", "2.4.1", True, "numpy<2.4", id="triton 3.6 + numpy 2.4 in the interpreter"),
]


@pytest.mark.parametrize("triton_version,numpy_version,interpret,fix", REFUSED)
def test_check_versions_refuses(triton_version, numpy_version, interpret, fix):
    with pytest.raises(ImportError) as info:
        check_versions(triton_version, numpy_version, interpret)
    message = str(info.value)
    assert "\n" not in message, f"the message must be one line: {message!r}"
    assert triton_version in message and fix in message, message


@pytest.mark.parametrize("triton_version,numpy_version,interpret", [
    pytest.param("3.6.0", "2.3.5", True, id="triton 3.6 + numpy 2.3"),
    pytest.param("3.9.0", "2.4.6", True, id="triton 3.9 + numpy 2.4"),
    pytest.param("3.6.0", "2.5.2", False, id="triton 3.6 + numpy 2.5 on GPU"),
])
def test_check_versions_accepts(triton_version, numpy_version, interpret):
    check_versions(triton_version, numpy_version, interpret)


@pytest.mark.skipif(ON_GPU, reason="the interpreter switch only acts without CUDA")
def test_triton_imported_first_fails_with_one_line():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", "import triton; import rmsnorm_kernel"],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0, "importing triton before the kernels must fail without a GPU"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: triton was imported before the kernels"), result.stderr[-2000:]
    assert "TRITON_INTERPRET=1" in last, f"the whole message must be on one line: {last!r}"


@pytest.mark.skipif(ON_GPU, reason="the interpreter's version rule only acts without CUDA")
def test_mismatched_versions_stop_with_one_line():
    # Pretend to be triton 3.6 with numpy 2.4 (the pair that breaks the interpreter).
    code = ("import numpy, triton; numpy.__version__ = '2.4.1'; triton.__version__ = '3.6.0'; "
            "import rmsnorm_kernel")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: triton 3.6.0's CPU interpreter does not work with numpy 2.4.1: pip install 'numpy<2.4' "
        "(or triton>=3.9)"
    ], result.stderr[-2000:]


def test_as_rows_copies_only_a_non_contiguous_last_dim():
    x = torch.randn(2, 5, 6)
    transposed = x.transpose(1, 2)  # [2, 6, 5], stride(-1) == 6
    rows = as_rows(transposed, 5)
    assert rows.shape == (12, 5) and rows.stride(-1) == 1
    assert torch.equal(rows, transposed.reshape(-1, 5))
    # Row-strided (a column slice): the columns are contiguous, so no copy is made.
    sliced = x[..., :3]
    rows = as_rows(sliced, 3)
    assert rows.shape == (10, 3) and rows.data_ptr() == x.data_ptr()
    assert torch.equal(rows, sliced.reshape(-1, 3))


def test_check_kernel_device_errors(monkeypatch):
    on_cpu = torch.empty(3)
    with pytest.raises(ValueError, match="same device"):
        check_kernel_device(on_cpu, torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="unsupported device meta"):
        check_kernel_device(torch.empty(3, device="meta"))
    monkeypatch.setattr(kernel_common, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="CPU tensors need the Triton interpreter"):
        check_kernel_device(on_cpu)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))


def test_host_grid_arithmetic_matches_triton():
    import triton
    for n in range(1, 5000, 7):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 256):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
    assert next_power_of_2(2**20) == 2**20 and next_power_of_2(2**20 + 1) == 2**21


@pytest.mark.skipif(ON_GPU, reason="the interpreter's shortcut: CPU only")
def test_interpreter_lists_the_builtins_once_and_undoes_every_swap(monkeypatch):
    """kernel_common's shortcut in Triton's interpreter (_swap_builtins_once): results as
    before, triton.language's builtins listed only at the first launch, none listed again
    for the helpers inside a launch (ours, and Triton's own tl.sum, which sees tl.core), and
    after each launch tl's functions and tl.tensor's methods are the originals again."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    import rmsnorm_kernel
    assert interpreter._patch_lang.__module__ == "kernel_common"  # installed for this Triton
    originals = {name: getattr(tl, name) for name in ("sum", "load", "store", "arange", "where")}
    index = getattr(tl.tensor, "__index__", None)  # none: the interpreter adds one for a launch
    listed = []
    getmembers = inspect.getmembers
    monkeypatch.setattr(inspect, "getmembers", lambda obj, *a: listed.append(obj) or getmembers(obj, *a))
    x, w = torch.randn(5, 64), torch.rand(64)
    for launch in range(3):  # the RMSNorm kernel: tl.sum, and kernel_common's cast_to inside
        torch.testing.assert_close(_rmsnorm_fwd_launch(x, w), rmsnorm_kernel.rmsnorm_reference(x, w))
        assert all(getattr(tl, name) is f for name, f in originals.items()), launch
        assert getattr(tl.tensor, "__index__", None) is index
        if launch == 0:
            first = len(listed)
    assert len(listed) == first  # nothing listed after the first launch


def test_fast_launch_is_plain_triton_in_the_interpreter():
    import rmsnorm_kernel
    if not ON_GPU:
        assert not kernel_common.FAST_LAUNCH
    x, w = torch.randn(3, 64, device=DEVICE), torch.rand(64, device=DEVICE)
    for _ in range(3):  # the third call would take the shortcut where it is on
        torch.testing.assert_close(_rmsnorm_fwd_launch(x, w), rmsnorm_kernel.rmsnorm_reference(x, w))


def test_every_launch_asks_for_fp_fusion():
    """Fused multiply-adds are asked for at every launch (Triton 3.10 turns them off by default):
    both paths of @fast_launch go through the wrapper that adds the option; a launch's own setting wins."""
    import rmsnorm_kernel
    seen = []
    kernel_common._with_launch_options(lambda *args, **kwargs: seen.append((args, kwargs)), 7, num_warps=4)
    assert seen == [((7,), {"enable_fp_fusion": True, "num_warps": 4})]
    kernel_common._with_launch_options(lambda *args, **kwargs: seen.append(kwargs), enable_fp_fusion=False)
    assert seen[-1] == {"enable_fp_fusion": False}
    for grid in ((1,), lambda meta: (1,)):  # the fast path (GPU) or Triton's own (interpreter, a computed grid)
        assert rmsnorm_kernel._rmsnorm_fwd_kernel[grid].func is kernel_common._with_launch_options


def _rmsnorm_fwd_launch(x, w, plain=False):
    """One launch of the RMSNorm forward kernel, through @fast_launch or (plain) Triton's own."""
    import rmsnorm_kernel
    kernel = rmsnorm_kernel._rmsnorm_fwd_kernel.fn if plain else rmsnorm_kernel._rmsnorm_fwd_kernel
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[0], device=x.device)
    block_n, rows, num_warps = rmsnorm_kernel._launch_config(x.shape[1])
    kernel[(cdiv(x.shape[0], rows),)](
        x, w, y, rstd, rstd, x.stride(0), x.shape[0], x.shape[1], 1e-6, BLOCK_N=block_n, ROWS=rows, num_warps=num_warps)
    return y


def test_fast_launch_reuses_exactly_what_triton_would():
    need_gpu()
    import rmsnorm_kernel
    kernel = rmsnorm_kernel._rmsnorm_fwd_kernel
    assert kernel_common.FAST_LAUNCH, "this Triton version is not served by the fast path"
    kernel.compiled.clear()
    big = torch.randn(4 * 96 + 1, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(96, device="cuda", dtype=torch.bfloat16)
    aligned = big[:4 * 96].view(4, 96)
    shifted = big[1:].view(4, 96)  # 2 bytes past a 16-byte boundary: another specialization
    for x in (aligned, shifted, aligned, shifted, aligned):  # the last three take the shortcut
        assert torch.equal(_rmsnorm_fwd_launch(x, w), _rmsnorm_fwd_launch(x, w, plain=True))
    assert len(kernel.compiled) == 2, list(kernel.compiled)
    # Every kernel the shortcut holds is one Triton compiled and holds under its own key.
    triton_cache = kernel.fn.device_caches[torch.cuda.current_device()][0]
    for compiled in kernel.compiled.values():
        assert any(compiled is c for c in triton_cache.values())
    (key_a, a), (key_b, b) = kernel.compiled.items()
    assert a is not b and key_a[1] != key_b[1]
    assert a.metadata.enable_fp_fusion and b.metadata.enable_fp_fusion  # LAUNCH_OPTIONS


def test_fast_launch_steps_aside_for_launch_hooks():
    need_gpu()
    from triton import knobs
    x = torch.randn(8, 64, device="cuda")
    w = torch.rand(64, device="cuda")
    seen = []

    def hook(metadata):
        seen.append(metadata)

    for _ in range(3):  # compiled and cached: later launches would take the shortcut
        _rmsnorm_fwd_launch(x, w)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _rmsnorm_fwd_launch(x, w)
        _rmsnorm_fwd_launch(x, w)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 2
