"""finetune_optimized.py with h8^T written by TMA copies (the sweep's best tile) or by pointer stores (128 x 32,
4 warps): python ab.py tma|pointer BEST_JSON ARGS..."""
import json
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import swiglu_kernel  # noqa: E402

mode, best = sys.argv[1], json.load(open(sys.argv[2]))["best"]
swiglu_kernel.H8_T_TMA = mode == "tma"
swiglu_kernel.H8_T_TILE = tuple(best["tile"]) if mode == "tma" and best else (128, 32, 4)
print(f"h8^T: {mode}, tile {swiglu_kernel.H8_T_TILE}", flush=True)
sys.argv = ["finetune_optimized.py"] + sys.argv[3:]
runpy.run_path("finetune_optimized.py", run_name="__main__")
