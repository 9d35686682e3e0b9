#!/bin/bash
# Runs bench.py on a GPU machine that has JAX but no TensorFlow and no package index, from the
# project's root: the wheels it lacks (keras, keras-hub, namex, optree; Python 3.12) are in .whl
# (git-ignored, carried along; pip download them where an index is reachable). tfbig.models
# comes from the working tree. The JSON lines are in $OUT/bench.log (or ./bench.log).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
KERAS_BACKEND=jax XLA_PYTHON_CLIENT_MEM_FRACTION=.92 PYTHONUNBUFFERED=1 \
    python3 benchmarks/gpu_proxy/bench.py "$@" 2>&1 | tee "${OUT:-.}/bench.log"
