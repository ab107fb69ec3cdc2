"""finetune_optimized.py with adamw_kernel.SMS_PER_BESIDE_PROGRAM set to argv[1] (run1b.sh's sweep)."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import adamw_kernel  # noqa: E402

adamw_kernel.SMS_PER_BESIDE_PROGRAM = int(sys.argv[1])
sys.argv = ["finetune_optimized.py", *sys.argv[2:]]
runpy.run_path("finetune_optimized.py", run_name="__main__")
