"""finetune_optimized.py with the gradient norm's sums of squares made after backward, by
the optimizer, as before adamw_kernel.BackwardSums (the A/B of run1.sh and run2.sh; same
flags): neither the one-process hooks (TritonAdamW.sum_in_backward) nor the pieces' sums
under --ddp (GradientAverage._sum_beside)."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import adamw_kernel  # noqa: E402
from kernel_ft import ddp  # noqa: E402

adamw_kernel.TritonAdamW.sum_in_backward = lambda self, min_bytes=0: None
ddp.GradientAverage._sum_beside = lambda self, work, piece: None
sys.argv = ["finetune_optimized.py", *sys.argv[1:]]
runpy.run_path("finetune_optimized.py", run_name="__main__")
