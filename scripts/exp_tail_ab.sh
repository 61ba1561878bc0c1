#!/usr/bin/env bash
# The Hopper backward's tail split (cuda/sm90/bwd_tail.cuh) through JAX (session 32 run 1): package build; GPU tests; fwd+bwd grid
# non-causal H=64/128 with the split and with it disabled (placeholder workspace), alternating.
set -u
R="$(cd "$(dirname "$0")/.." && pwd)"
P=/opt/torch/.venv/bin/python3
export PIP_NO_INDEX=1 JAXATTN_CUDA_ARCHS=90-real CMAKE_BUILD_PARALLEL_LEVEL=14 XLA_PYTHON_CLIENT_PREALLOCATE=false
O=${OUT:-/tmp/out}; mkdir -p $O
STEP=${STEP:-all}
if [[ $STEP == all || $STEP == build ]]; then
  t0=$(date +%s)
  (cd $R && $P -m pip install --no-build-isolation --no-deps -q . > $O/build.log 2>&1); echo "build rc=$? $(( $(date +%s)-t0 ))s"
  (cd /tmp && $P -c "import jaxattn._jaxattn as m; print('tail rows', m.cuda_bwd_tail_rows())")
fi
if [[ $STEP == all || $STEP == tests1 ]]; then
  t0=$(date +%s)
  (cd /tmp && $P -m pytest $R/tests/test_backward.py $R/tests/test_gpu.py -m gpu -n 12 -q -p no:cacheprovider --rootdir $R > $O/tests1.log 2>&1); echo "tests1 rc=$? $(( $(date +%s)-t0 ))s"; tail -3 $O/tests1.log
fi
if [[ $STEP == all || $STEP == grid ]]; then
  for mode in split nosplit; do
    t0=$(date +%s)
    (cd /tmp && MODE=$mode $P - "$@" --pass fwdbwd --heads 64,128 --seqlens ${SEQ:-1024,2048,4096,8192,16384} --causal 0 --out $O/grid_$mode > $O/grid_$mode.log 2>&1 <<PY
import os, runpy, sys
sys.argv = ["attention.py"] + sys.argv[1:]
import jaxattn._ffi_calls as f
import jax, jax.numpy as jnp
if os.environ["MODE"] == "nosplit":
    f._dkv_tail_type = lambda k, split: jax.ShapeDtypeStruct((1,), jnp.float32)
runpy.run_path("$R/benchmarks/attention.py", run_name="__main__")
PY
); echo "grid $mode rc=$? $(( $(date +%s)-t0 ))s"
  done
fi
if [[ $STEP == tests2 ]]; then
  t0=$(date +%s)
  (cd /tmp && $P -m pytest $R/tests/test_transforms.py $R/tests/test_masks_gpu.py -m gpu -n 12 -q -p no:cacheprovider --rootdir $R > $O/tests2.log 2>&1); echo "tests2 rc=$? $(( $(date +%s)-t0 ))s"; tail -3 $O/tests2.log
fi
