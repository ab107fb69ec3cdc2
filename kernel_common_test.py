"""
Tests for what every kernel shares (kernel_common.py).

The version check refuses the Triton / NumPy combinations known to fail with one
line that says what to install and lets the good ones through; importing triton
before the kernels on a machine without a GPU stops with one clear line; and the
host-side helpers (``as_rows``, ``swap_modules``, ``check_kernel_device``) do
what the launchers and the model patching rely on.

Usage:
    python kernel_common_test.py   # or: python -m pytest kernel_common_test.py
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import kernel_common
from conftest import ON_GPU
from kernel_common import as_rows, check_kernel_device, check_versions, swap_modules

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


def test_swap_modules_replaces_submodules_never_the_root():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)), nn.ReLU())
    inner = model[1]
    count = swap_modules(model, lambda m: isinstance(m, nn.Linear), lambda m: nn.Identity())
    assert count == 2
    assert isinstance(model[0], nn.Identity) and isinstance(model[1][1], nn.Identity)
    assert model[1] is inner and isinstance(model[1][0], nn.ReLU) and isinstance(model[2], nn.ReLU)
    # The root matches too, but has no parent to hold a replacement: it stays.
    assert swap_modules(model, lambda m: isinstance(m, nn.Sequential), lambda m: nn.Tanh()) == 1
    assert isinstance(model, nn.Sequential) and isinstance(model[1], nn.Tanh)
    assert swap_modules(nn.Linear(2, 2), lambda m: True, lambda m: nn.Tanh()) == 0


def test_swap_modules_nested_matches_replace_the_outer_one():
    model = nn.Sequential(nn.Sequential(nn.Sequential(nn.ReLU())), nn.Sequential(nn.ReLU()))
    count = swap_modules(model, lambda m: isinstance(m, nn.Sequential), lambda m: nn.Tanh())
    assert count == 2
    assert isinstance(model[0], nn.Tanh) and isinstance(model[1], nn.Tanh)


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
