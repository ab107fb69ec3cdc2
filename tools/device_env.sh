# Sourced at the top of every script that runs on a GPU machine without the project's extras:
#
#   source tools/device_env.sh OUTDIR
#
# installs the wheels placed in .whl/ (peers, datasets, trl: what the machine's image
# lacks) into /tmp/site without touching the system's packages, puts a Triton packed by
# tools/pack_triton.sh in front of the machine's own (if .triton/ holds one), puts the checkout
# first on PYTHONPATH (as `pip install -e .` would), and writes OUTDIR/env.txt: the
# GPU, the versions, the commit and the date every result file is read against.
export PYTHONUNBUFFERED=1
mkdir -p "$1"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
# A Triton packed by tools/pack_triton.sh (today's release, say), in front of the machine's
# own; the CUDA binaries stay the machine's: ptxas, and from Triton 3.9 on also the one it
# names ptxas-blackwell, which it calls for Hopper too -- unless the pack kept its own
# ptxas-blackwell (--with-ptxas): then Hopper code is assembled as a pip install of it would.
if [ -f .triton/triton.tar.xz ]; then
  bin=$(python3 -c 'import os, triton; print(os.path.dirname(triton.__file__))')/backends/nvidia/bin
  # Afresh: a machine kept warm between calls still holds the last call's unpacking (its ptxas-blackwell too).
  rm -rf /tmp/triton_packed && mkdir -p /tmp/triton_packed && tar -xJf .triton/triton.tar.xz -C /tmp/triton_packed
  export PYTHONPATH=/tmp/triton_packed${PYTHONPATH:+:$PYTHONPATH}
  export TRITON_BACKENDS_IN_TREE=1  # the machine's Triton's metadata names backends the packed one lacks
  export TRITON_PTXAS_PATH=$bin/ptxas
  if [ -x /tmp/triton_packed/triton/backends/nvidia/bin/ptxas-blackwell ]; then
    export TRITON_PTXAS_BLACKWELL_PATH=/tmp/triton_packed/triton/backends/nvidia/bin/ptxas-blackwell
  elif [ -x "$bin/ptxas-blackwell" ]; then
    export TRITON_PTXAS_BLACKWELL_PATH=$bin/ptxas-blackwell
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  if [ -n "${TRITON_PTXAS_BLACKWELL_PATH:-}" ]; then
    echo "ptxas-blackwell $TRITON_PTXAS_BLACKWELL_PATH: $("$TRITON_PTXAS_BLACKWELL_PATH" --version | tail -1)"
  fi
  git rev-parse --short HEAD 2>/dev/null; date -u +%F; } | tee "$1/env.txt"
