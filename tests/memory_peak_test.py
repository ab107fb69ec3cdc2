"""tools/memory_peak.py: the replay of an allocator record to its peak, and the grouping
of the blocks alive there by the project's line that allocated them (synthetic records:
the record itself needs a GPU); its refusals, one line each."""

import os

import pytest

from tools import memory_peak

ROOT = memory_peak.ROOT


def frame(path, line, name):
    return {"filename": os.path.join(ROOT, path), "line": line, "name": name}


TORCH = {"filename": "/site-packages/torch/nn/functional.py", "line": 10, "name": "linear"}


def event(action, addr, size, *frames):
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def test_the_peak_is_the_highest_point_and_its_live_blocks():
    """Allocated bytes rise at alloc and fall at free_requested, as the allocator's own
    count does (a block another stream still reads is taken back later, at free_completed,
    which changes nothing here); the live set is the one at the highest point, not at the end."""
    weights = frame("kernel_ft/models.py", 5, "build")
    saved = frame("swiglu_kernel.py", 40, "forward")
    step = frame("kernel_ft/training.py", 90, "train_step")
    events = [
        event("alloc", 1, 100, weights),
        event("alloc", 2, 30, TORCH, saved, step),
        event("alloc", 3, 30, TORCH, saved, step),
        event("alloc", 4, 5, step),  # the peak: 165
        event("free_requested", 2, 30),
        event("alloc", 5, 20, step),  # 155 (block 2 no longer counts); counted until free_completed: 185
        event("free_completed", 2, 30),
        event("free_requested", 3, 30),
        event("free_completed", 3, 30),
        event("alloc", 6, 10, step),  # 135 at the end
    ]
    peak, live, at = memory_peak.live_at_peak(events)
    assert (peak, at) == (165, 3)
    assert sorted(e["addr"] for e in live) == [1, 2, 3, 4]
    groups = memory_peak.by_site(live)
    assert groups[0] == ("kernel_ft/models.py:5 build", 1, 100)
    # The innermost frame of the project (torch's own frames skipped), with its caller.
    assert groups[1] == ("swiglu_kernel.py:40 forward <- kernel_ft/training.py:90 train_step", 2, 60)
    assert groups[2] == ("kernel_ft/training.py:90 train_step", 1, 5)
    assert memory_peak.site([TORCH]) == "functional.py:10 linear"  # no frame of ours: the innermost one
    assert memory_peak.live_at_peak([]) == (0, [], -1)


def test_refusals_are_one_line():
    with pytest.raises(SystemExit, match="^error: name the script to run after --"):
        memory_peak.parse_args(["finetune_optimized.py"])
    with pytest.raises(SystemExit, match="^error: after -- comes a script"):
        memory_peak.parse_args(["--top", "5", "--"])
    args = memory_peak.parse_args(["--top", "5", "--", "finetune_optimized.py", "--steps", "2"])
    assert args.top == 5 and args.command == ["finetune_optimized.py", "--steps", "2"]
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="^error: tools/memory_peak.py records the CUDA allocator: it needs a GPU"):
            memory_peak.main(["--", "finetune_optimized.py"])
