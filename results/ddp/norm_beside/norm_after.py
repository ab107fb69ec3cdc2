"""finetune_optimized.py with the pieces' sums of squares made after backward, by the
optimizer, as before GradientAverage._sum_beside (the A/B of run1.sh; same flags)."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
from kernel_ft import ddp  # noqa: E402

ddp.GradientAverage._sum_beside = lambda self, work, piece: None  # nothing summed: the optimizer sums them all
sys.argv = ["finetune_optimized.py", *sys.argv[1:]]
runpy.run_path("finetune_optimized.py", run_name="__main__")
