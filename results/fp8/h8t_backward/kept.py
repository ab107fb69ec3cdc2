"""finetune_optimized.py with the FP8 down_proj keeping h8^T from forward, as before
swiglu_kernel.TritonSwiGLUFP8DownFunction (the A/B of run1.sh; same flags)."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import swiglu_kernel  # noqa: E402

swiglu_kernel.FP8_DOWN_IN_BACKWARD = False
sys.argv = ["finetune_optimized.py", *sys.argv[1:]]
runpy.run_path("finetune_optimized.py", run_name="__main__")
