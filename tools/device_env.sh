# Sourced at the top of every script that runs on a GPU machine without the project's extras:
#
#   source tools/device_env.sh OUTDIR
#
# installs the wheels placed in .whl/ (peers, datasets, trl: what the machine's image
# lacks) into /tmp/site without touching the system's packages, puts the checkout
# first on PYTHONPATH (as `pip install -e .` would), and writes OUTDIR/env.txt: the
# GPU, the versions, the commit and the date every result file is read against.
export PYTHONUNBUFFERED=1
mkdir -p "$1"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null; date -u +%F; } | tee "$1/env.txt"
