"""Shared pieces of the correctness tests (pytest loads this file first).

* Without CUDA, kernels run through the Triton interpreter on CPU tensors;
  kernel_common sets the variable before triton is imported, so it comes first.
* ``rel_err`` and ``no_worse`` implement the project's definition of correct:
  compare with a float64 truth, and require the kernel's error to be no worse
  than about twice the error of the PyTorch path at the same dtype.
* ``Report`` prints the playbook-style PASSED/FAILED lines when a test file is
  run as a plain script.
"""

import pytest
import torch

import kernel_common  # noqa: F401 - first: the Triton interpreter switch (no GPU: TRITON_INTERPRET=1)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_TITLES = {"fp32": "Float32", "bf16": "BFloat16", "fp16": "Float16"}
WHERE = torch.cuda.get_device_name() if ON_GPU else "CPU (Triton interpreter)"  # for report titles

# An absolute floor on relative error, a tenth of the dtype's unit roundoff: when
# the PyTorch path happens to be nearly exact, "2x its error" alone would demand
# more than the dtype can represent.
ERROR_FLOOR = {torch.float32: 1.2e-8, torch.float16: 9.8e-5, torch.bfloat16: 7.8e-4}

def need_gpu():
    """Skip the calling check (in pytest and in the script report) without CUDA."""
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
    all outputs, one per output, or None for each output's own dtype. Returns
    the report detail "name ours/peer ...".
    """
    if dtypes is None or isinstance(dtypes, torch.dtype):
        dtypes = [dtypes] * len(names)
    parts = []
    for name, a, b, t, dtype in zip(names, ours, peer, truth, dtypes):
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype}, {peer_name} gives {b.dtype}"
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)}, {peer_name} gives {tuple(b.shape)}"
        e_ours, e_peer = rel_err(a, t), rel_err(b, t)
        assert no_worse(e_ours, e_peer, dtype or a.dtype, factor), (
            f"{name}: error {e_ours:.2e} vs {peer_name} {e_peer:.2e}"
        )
        parts.append(f"{name} {e_ours:.1e}/{e_peer:.1e}")
    return "  ".join(parts)


class Report:
    """Collects check lines for the script mode of a test file."""

    def __init__(self, title):
        self.failed = 0
        self.passed = 0
        print(title)
        print("=" * 72)

    def section(self, title):
        print(f"\n{title}")

    def checks(self, title, checks):
        """A section of (label, check) pairs, the lists the pytest parametrizations use."""
        self.section(title)
        for label, fn in checks:
            self.run(label, fn)

    def cases_by_dtype(self, cases, dtype_of, run_case, note=""):
        """Sections "Test 1..3: Float32 / BFloat16 / Float16" of the cases of each dtype.

        cases: tuples whose first item is the label; dtype_of(case) gives its
        DTYPES key; run_case(case) runs the check and returns its detail.
        """
        for i, dt in enumerate(DTYPES, 1):
            self.section(f"Test {i}: {DTYPE_TITLES[dt]}{note}")
            for case in cases:
                if dtype_of(case) == dt:
                    self.run(case[0], lambda c=case: run_case(c))

    def line(self, label, ok, detail=""):
        status = "PASSED" if ok else "FAILED"
        self.passed += ok
        self.failed += not ok
        print(f"  {label:<34} {detail:<30} {status}")

    def run(self, label, fn):
        """Run a pytest-style check function; an AssertionError is a failure."""
        try:
            detail = fn()
            self.line(label, True, detail or "")
        except pytest.skip.Exception as e:
            print(f"  {label:<34} skipped: {e}")
        except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 - the report shows every failure
            self.line(label, False, f"{type(e).__name__}: {e}"[:200])

    def finish(self, name):
        print("=" * 72)
        verdict = "PASSED" if self.failed == 0 else "FAILED"
        print(f"All {name} tests {verdict}: {self.passed} passed, {self.failed} failed")
        return 0 if self.failed == 0 else 1
