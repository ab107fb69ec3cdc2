"""finetune_optimized.py with SwiGLU's h8^T tile from the environment: H8T="BLOCK_N,ROWS,WARPS,PACK" (run2.sh; as it
ran then: swiglu_kernel.H8_T_PACK was removed after)."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import swiglu_kernel  # noqa: E402

*tile, pack = (int(v) for v in os.environ["H8T"].split(","))
swiglu_kernel.H8_T_TILE, swiglu_kernel.H8_T_PACK = tuple(tile), bool(pack)
sys.argv = ["finetune_optimized.py", *sys.argv[1:]]
runpy.run_path("finetune_optimized.py", run_name="__main__")
