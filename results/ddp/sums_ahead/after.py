"""finetune_optimized.py with the gradient norm's sums launched after the last reduce-scatter,
as before GradientAverage._sums_ahead (the A/B of run1.sh; same flags). It ran at commit
e850eea: ddp.SUMS_AHEAD was removed after that call."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
from kernel_ft import ddp  # noqa: E402

ddp.SUMS_AHEAD = False
sys.argv = ["finetune_optimized.py", *sys.argv[1:]]
runpy.run_path("finetune_optimized.py", run_name="__main__")
