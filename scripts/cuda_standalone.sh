#!/usr/bin/env bash
# Builds the sm80 kernels with the standalone checker (no JAX), for one
# architecture (sm_90 by default), then runs: compute-sanitizer memcheck and
# racecheck on a few small cases (when the tool exists), the full check against
# the float64 CPU reference with the benchmarks, and (VARIANTS=1) the
# head-dim-128 check + benchmark again for a few other tile shapes. The last
# lines printed are the results table.
#
# Usage: scripts/cuda_standalone.sh [args for standalone_check]
# Env: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc),
#      BUILD (default build/standalone), ARCH (default 90), SANITIZE (1),
#      VARIANTS (0; 1 adds the head-dim-128 tile variants below).
#      With $OUT set, logs are copied there.
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
BUILD=${BUILD:-build/standalone}
ARCH=${ARCH:-90}
mkdir -p "$BUILD"
FLAGS=(-O3 -std=c++17 -Icuda -gencode "arch=compute_${ARCH},code=sm_${ARCH}" -Xptxas -v)
JOBS=${JOBS:-$(nproc)}

# compile SRC OBJ [extra flags...] (in the background; pid appended to pids)
pids=()
compile() {
  local src=$1 obj=$2
  shift 2
  "$NVCC" "${FLAGS[@]}" "$@" -Xcompiler -fopenmp -c "$src" -o "$obj" >"$obj.log" 2>&1 &
  pids+=($!)
}
wait_all() {
  local fail=0
  for pid in "${pids[@]}"; do wait "$pid" || fail=1; done
  pids=()
  return $fail
}
link() {  # link OUT OBJS...
  local out=$1
  shift
  "$NVCC" -gencode "arch=compute_${ARCH},code=sm_${ARCH}" -Xcompiler -fopenmp "$@" -o "$out"
}

# Tile variants of the head-dim-128 kernels: name, forward knobs, backward knobs.
fwd() { echo "-DJAXATTN_FWD128_BN=$1 -DJAXATTN_FWD128_WARPS=$2 -DJAXATTN_FWD128_MTILES=$3 -DJAXATTN_FWD128_MINB=$4"; }
bwd() { echo "-DJAXATTN_BWD128_BM=$1 -DJAXATTN_BWD128_WARPS=$2 -DJAXATTN_BWD128_MINB=$3"; }
VARIANT_NAMES=(f32 f64x4w3)
VARIANT_FWD=("$(fwd 32 4 2 2)" "$(fwd 64 4 1 3)")
VARIANT_BWD=("$(bwd 64 8 1)" "$(bwd 64 8 1)")

t0=$(date +%s)
objs=()
for src in cuda/sm80/*.cu tests/cuda/standalone_check.cu; do
  obj="$BUILD/$(basename "${src%.cu}").o"
  objs+=("$obj")
  compile "$src" "$obj"
done
if [ "${VARIANTS:-0}" = 1 ]; then
  for i in "${!VARIANT_NAMES[@]}"; do
    d="$BUILD/var_${VARIANT_NAMES[$i]}"
    mkdir -p "$d"
    # shellcheck disable=SC2086
    compile cuda/sm80/fwd_hdim128.cu "$d/fwd_hdim128.o" ${VARIANT_FWD[$i]}
    # shellcheck disable=SC2086
    compile cuda/sm80/bwd_hdim128.cu "$d/bwd_hdim128.o" ${VARIANT_BWD[$i]}
  done
fi
if ! wait_all; then
  for log in "$BUILD"/*.o.log "$BUILD"/var_*/*.o.log; do
    grep -q "error" "$log" && { echo "== $log"; cat "$log"; }
  done
  echo "BUILD FAILED"
  exit 1
fi
link "$BUILD/standalone_check" "${objs[@]}"
echo "build: $(( $(date +%s) - t0 )) s"

echo "== ptxas: kernels with spills or stack frames (none expected)"
cat "$BUILD"/*.o.log | grep -E "stack frame|spill" |
  grep -v "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" || echo "none"
echo "== ptxas: registers per kernel"
cat "$BUILD"/*.o.log | grep -E "Compiling entry|Used [0-9]+ registers" |
  sed -E 's/.*entry function .(_Z[^ ]*). for.*/\1/; s/ptxas info *: //' | paste - - |
  awk '{printf "%-4s %s\n", $3, $1}' | sort -u | grep sm80 | sed 's/_ZN7jaxattn4cuda4sm80//'

rm -f "$BUILD/sanitize.txt"
if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer memcheck, racecheck (quick cases)"
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool --print-limit 5 --error-exitcode 3 \
      "$BUILD/standalone_check" --quick --no-bench >"$BUILD/$tool.txt" 2>&1 &&
      echo "$tool: clean" | tee -a "$BUILD/sanitize.txt" ||
      { echo "$tool: FAILED or timed out" | tee -a "$BUILD/sanitize.txt"; tail -n 30 "$BUILD/$tool.txt"; }
  done
fi

echo "== check + bench"
status=0
"$BUILD/standalone_check" "$@" | tee "$BUILD/main.txt" || status=1

if [ "${VARIANTS:-0}" = 1 ]; then
  base=()
  for o in "${objs[@]}"; do
    case "$o" in */fwd_hdim128.o | */bwd_hdim128.o) ;; *) base+=("$o") ;; esac
  done
  for i in "${!VARIANT_NAMES[@]}"; do
    d="$BUILD/var_${VARIANT_NAMES[$i]}"
    link "$d/standalone_check" "${base[@]}" "$d/fwd_hdim128.o" "$d/bwd_hdim128.o"
    echo "== variant ${VARIANT_NAMES[$i]}: fwd ${VARIANT_FWD[$i]} / bwd ${VARIANT_BWD[$i]}"
    grep -hE "spill|registers" "$d"/*.log | sort | uniq -c | grep -v " 32 registers" || true
    "$d/standalone_check" --h128 >"$d/out.txt" 2>&1 || true
    tail -n 30 "$d/out.txt"
  done
fi

if [ -n "${OUT:-}" ]; then
  cp "$BUILD/main.txt" "$OUT/" 2>/dev/null || true
  cp "$BUILD/memcheck.txt" "$BUILD/racecheck.txt" "$OUT/" 2>/dev/null || true
  for d in "$BUILD"/var_*; do [ -f "$d/out.txt" ] && cp "$d/out.txt" "$OUT/$(basename "$d").txt"; done
fi

echo
echo "################ summary ################"
cat "$BUILD/sanitize.txt" 2>/dev/null || true
sed -n '/===== results =====/,$p' "$BUILD/main.txt"
if [ "${VARIANTS:-0}" = 1 ]; then
  for d in "$BUILD"/var_*; do
    echo "-- $(basename "$d")"
    grep -E "TFLOP/s|FAIL|ALL OK|SOME" "$d/out.txt" || tail -n 3 "$d/out.txt"
  done
fi
exit $status
