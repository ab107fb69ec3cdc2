"""Shared helpers for the profile and fine-tune scripts (work in progress)."""

import datetime
import os
import platform

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def environment_info():
    """Return the device and library versions as a dict (quoted with every figure)."""
    import triton
    import transformers

    on_gpu = torch.cuda.is_available()
    return {
        "device": "cuda" if on_gpu else "cpu",
        "gpu": torch.cuda.get_device_name(0) if on_gpu else "CPU",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
    }
