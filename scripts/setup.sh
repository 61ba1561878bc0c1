#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with jax,
# the build tools and jaxattn itself built from this checkout (its CUDA kernels
# too when nvcc is found). Safe to run again: it rebuilds the package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# Build requirements first, so the package builds without isolation (no second
# download of jax into a throw-away build environment).
.venv/bin/python -m pip install -q "jax>=0.6" "jaxlib>=0.6" numpy "nanobind>=2.0" "scikit-build-core>=0.10" pytest flatbuffers "flax>=0.12" optax
start=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  .venv/bin/python -m pip install -q --no-build-isolation --no-deps .
echo "jaxattn built and installed in $(( $(date +%s) - start )) s"
# From another directory: the source tree would shadow the installed package.
venv_python="$(pwd)/.venv/bin/python"
(cd / && "$venv_python" -c "import jaxattn; print('jaxattn', jaxattn.__version__, '- CUDA kernels:', jaxattn.built_with_cuda())")
