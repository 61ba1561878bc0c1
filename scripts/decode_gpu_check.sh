#!/usr/bin/env bash
# The decode kernels on a GPU in one call (~6-8 minutes on an H200 from a bare
# machine): the standalone checker (scripts/decode_standalone.sh, no JAX) runs
# while the package builds; then the decode GPU tests (both kernel versions)
# and benchmarks/decode.py. Logs go to $OUT (default <repo>/results/decode);
# the summary is printed last. Env: PYTHON (python3), JAXATTN_CUDA_ARCHS
# (90-real), BUILD_JOBS (16), SKIP_BUILD=1, SKIP_STANDALONE=1, SKIP_TESTS=1,
# SKIP_BENCH=1, BENCH_ARGS (extra benchmark flags), WHEEL=path (install that wheel instead
# of building: one built on the CPU machine with JAXATTN_CUDA_ARCHS=90-real and carried,
# ~2 s instead of ~190 s), TEST_JOBS=n (pytest-xdist workers when it is installed; default
# 4), BENCH_LIMIT (seconds, default 150).
# Issue 9's grid on an H200, the register loop against the drift loop:
#   WHEEL=build/wheel/*.whl SKIP_STANDALONE=1 BENCH_LIMIT=300 BENCH_ARGS="--batches 16,32,64
#   --contexts 4096,16384,65536 --v2-variants drift=15105 --impls 'jaxattn xla paged,cuda_v2 paged,
#   cuda_v2 paged [drift],cudnn,xla paged,cudnn paged'" scripts/decode_gpu_check.sh
set -u -o pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT="${OUT:-$REPO/results/decode}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
if [[ -x /usr/local/cuda/bin/nvcc ]]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
export JAXATTN_CUDA=ON JAXATTN_CUDA_ARCHS="${JAXATTN_CUDA_ARCHS:-90-real}" JAXATTN_SM90="${JAXATTN_SM90:-ON}"
export CMAKE_BUILD_PARALLEL_LEVEL="${BUILD_JOBS:-16}" PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUNDIR=$(mktemp -d)  # python runs outside the source tree
status=0

standalone_pid=
if [[ "${SKIP_STANDALONE:-0}" != 1 ]]; then
  (cd "$REPO" && OUT="$OUT" bash scripts/decode_standalone.sh >"$OUT/standalone.log" 2>&1) &
  standalone_pid=$!
fi
if [[ -n "${WHEEL:-}" ]]; then
  echo "== install $WHEEL"
  # shellcheck disable=SC2086
  "$PY" -m pip install --no-deps --force-reinstall -q $WHEEL >"$OUT/build.log" 2>&1 ||
    { status=1; echo "install FAILED"; tail -n 30 "$OUT/build.log"; }
elif [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  echo "== build"
  (cd "$REPO" && timeout 420 "$PY" -m pip install --no-build-isolation --no-deps -q .) >"$OUT/build.log" 2>&1 ||
    { status=1; echo "build FAILED"; tail -n 30 "$OUT/build.log"; }
fi
if [[ -n "$standalone_pid" ]]; then wait "$standalone_pid" || status=1; fi
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  echo "== tests"
  jobs=()
  "$PY" -c "import xdist" 2>/dev/null && jobs=(-n "${TEST_JOBS:-4}")
  (cd "$RUNDIR" && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 "$PY" -m pytest "$REPO/tests/test_decode.py" \
    -q -rs -p no:cacheprovider "${jobs[@]}" -k "cuda or gpu" >"$OUT/tests.log" 2>&1) || status=1
fi
if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
  echo "== benchmark"
  # (rows stop starting 45 s before the limit, so the table is printed; BENCH_ARGS may override)
  # shellcheck disable=SC2086
  (cd "$RUNDIR" && eval timeout "${BENCH_LIMIT:-150}" "$PY" "$REPO/benchmarks/decode.py" --out "$OUT" \
    --time-budget $(( ${BENCH_LIMIT:-150} - 45 )) ${BENCH_ARGS:-} \
    >"$OUT/bench.md" 2>"$OUT/bench.log") || status=1
fi
rm -rf "$RUNDIR"
echo
echo "################ decode GPU check ################"
[[ -f "$OUT/standalone.log" ]] && sed -n '/== ptxas/,/== compute-sanitizer/p;/decode summary/,$p' "$OUT/standalone.log"
[[ -f "$OUT/tests.log" ]] && { grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20; tail -n 1 "$OUT/tests.log"; }
[[ -f "$OUT/bench.md" ]] && cat "$OUT/bench.md"
echo "decode_gpu_check: exit $status (logs in $OUT)"
exit $status
