#!/usr/bin/env bash
# Pack a Triton release small enough to copy to a GPU machine whose image has another
# Triton and no package index (a Triton wheel is ~290 MB), to run the GPU tests and
# benchmarks there under today's release:
#
#   bash tools/pack_triton.sh triton-3.9.0-cp312-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl [--with-ptxas]
#     -> .triton/triton.tar.xz (41 MB for 3.9.0), which tools/device_env.sh unpacks in front
#        of the machine's own Triton
#
# Kept: the Python package, the NVIDIA backend (its Python and the CUDA headers its
# launcher is compiled against), libtriton.so stripped of its symbols (476 -> 192 MB).
# Left out: the AMD backend, the profiler's and CUPTI's libraries, the MLIR headers and
# plugins, and the CUDA binaries (ptxas, cuobjdump, nvdisasm): device_env.sh points the
# packed Triton at the machine's own. The wheel's Python tag must match the machine's
# Python (the GPU image's is 3.12).
#
# --with-ptxas keeps the one binary Triton 3.9+ assembles Hopper and Blackwell code with,
# ptxas-blackwell (52 MB, +12 MB packed), and device_env.sh then uses it: the GPU then runs
# the code a pip install of that Triton gets. Without it the machine's ptxas assembles, which
# may be another CUDA release with other register allocation (for the attention backward:
# results/attention/gluon_backward/ptxas_sm90/).
set -euo pipefail
wheel=${1:?usage: bash tools/pack_triton.sh TRITON_WHEEL [--with-ptxas]}
exclude=('triton/backends/amd/*' 'triton/backends/nvidia/lib/cupti*' 'triton/_C/libproton.so' 'triton/include/*'
         'triton/plugins/*' 'triton/instrumentation/*')
case "${2:-}" in
  "") exclude+=('triton/backends/nvidia/bin/*') ;;
  --with-ptxas) exclude+=('triton/backends/nvidia/bin/ptxas' 'triton/backends/nvidia/bin/cuobjdump'
                          'triton/backends/nvidia/bin/nvdisasm') ;;
  *) echo "pack_triton.sh: unknown option $2 (only --with-ptxas)" >&2; exit 2 ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unzip -q "$wheel" -d "$work" -x "${exclude[@]}"
if [ "${2:-}" = --with-ptxas ] && [ ! -x "$work/triton/backends/nvidia/bin/ptxas-blackwell" ]; then
  echo "pack_triton.sh: $wheel has no ptxas-blackwell (Triton 3.9 or newer has)" >&2; exit 2
fi
strip --strip-unneeded "$work/triton/_C/libtriton.so"
mkdir -p .triton
tar -cJf .triton/triton.tar.xz -C "$work" triton $(cd "$work" && ls -d triton-*.dist-info)
ls -l .triton/triton.tar.xz
