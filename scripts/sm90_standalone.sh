#!/usr/bin/env bash
# Builds the Hopper (sm_90a) kernels with a standalone checker (no JAX) and runs:
# ptxas/SASS summary, a compute-sanitizer memcheck pass on a few small cases (when
# the tool exists), then the full check against the float64 CPU reference and the
# benchmarks. The last lines printed are the results table.
#
# Usage: [CHECK=fwd|bwd|masked] scripts/sm90_standalone.sh [args for sm90_$CHECK_check]
#   CHECK=fwd (default): tests/cuda/sm90_fwd_check.cu; CHECK=bwd: tests/cuda/sm90_bwd_check.cu
#   (which also links the portable kernels: it compares against them); CHECK=masked:
#   tests/cuda/standalone_check.cu on the Hopper kernels (masked cases, forward and
#   backward, against float64; --packed: packed vs separate documents).
# Env: NVCC (default /usr/local/cuda/bin/nvcc, else nvcc on PATH), BUILD
#      (default build/sm90_standalone_$CHECK), SANITIZE (1), RUN (1; 0 = build only),
#      REUSE (0; 1 = keep object files already built), EXTRA_FLAGS (more nvcc flags,
#      e.g. -D switches of a timing experiment).
#      With $OUT set, logs are copied there.
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
[ -x "$NVCC" ] || NVCC=$(command -v nvcc)
CHECK=${CHECK:-fwd}
BUILD=${BUILD:-build/sm90_standalone_$CHECK}
BIN="$BUILD/sm90_${CHECK}_check"
mkdir -p "$BUILD"
ARCH=(-gencode arch=compute_90a,code=sm_90a)
FLAGS=(-O3 -std=c++17 --expt-relaxed-constexpr -Icuda -Itests/cuda "${ARCH[@]}" -Xptxas -v -lineinfo ${EXTRA_FLAGS:-})

t0=$(date +%s)
pids=()
objs=()
SRCS=(cuda/sm90/*.cu "tests/cuda/sm90_${CHECK}_check.cu")
[ "$CHECK" = bwd ] && SRCS+=(cuda/sm80/*.cu)
if [ "$CHECK" = masked ]; then
  SRCS=(cuda/sm90/*.cu cuda/sm80/*.cu tests/cuda/standalone_check.cu)
  FLAGS+=(-DJAXATTN_CHECK_SM90)
fi
for src in "${SRCS[@]}"; do
  obj="$BUILD/$(basename "$(dirname "$src")")_$(basename "${src%.cu}").o"
  objs+=("$obj")
  [ "${REUSE:-0}" = 1 ] && [ -f "$obj" ] && continue  # objects of an earlier RUN=0 call
  "$NVCC" "${FLAGS[@]}" -Xcompiler -fopenmp -c "$src" -o "$obj" >"$obj.log" 2>&1 &
  pids+=($!)
done
fail=0
for pid in "${pids[@]}"; do wait "$pid" || fail=1; done
if [ $fail = 1 ]; then
  for log in "$BUILD"/*.o.log; do grep -q "error" "$log" && { echo "== $log"; head -50 "$log"; }; done
  echo "BUILD FAILED"
  exit 1
fi
"$NVCC" "${ARCH[@]}" -Xcompiler -fopenmp "${objs[@]}" -o "$BIN"
echo "build: $(($(date +%s) - t0)) s"

echo "== ptxas: stack frames / spills (none expected), setmaxnreg or wgmma warnings"
cat "$BUILD"/*.o.log | grep -E "stack frame|spill" |
  grep -v "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" || echo "none"
grep -hE "C7508|C75[0-9][0-9].*serializ|warning" "$BUILD"/*.o.log | sort | uniq -c || echo "no warnings"
echo "== ptxas: registers per kernel"
cat "$BUILD"/*.o.log | grep -E "Compiling entry|Used [0-9]+ registers" |
  sed -E 's/.*entry function .(_Z[^ ]*). for.*/\1/; s/ptxas info *: //' | paste - - |
  awk '{printf "%-4s %s\n", $3, $1}' | sort -u | grep sm90 |
  sed -E 's/_ZN7jaxattn4sm9021flash_fwd_sm90_kernelINS0_9FwdTraitsILi//; s/EEEvNS0_9FwdParamsE//'

CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
if [ -x "$CUOBJDUMP" ]; then
  echo "== SASS (per object: HGMMA, UTMALDG, UTMASTG, local memory, setmaxnreg)"
  for o in "$BUILD"/sm90_fwd_hdim*.o "$BUILD"/sm90_bwd_hdim*.o; do
    "$CUOBJDUMP" --dump-sass "$o" >"$o.sass" 2>/dev/null || continue
    [ -f "$o" ] || continue
    # "wait0": full wgmma waits; one after every HGMMA means ptxas serialised them.
    printf "%-16s HGMMA %5d  wait0 %4d  UTMALDG %3d  UTMASTG %3d  UTMAREDG %3d  LDL/STL %3d  USETMAXREG %3d\n" "$(basename "$o")" \
      "$(grep -c HGMMA "$o.sass")" "$(grep -c 'WARPGROUP.DEPBAR.LE gsb0, 0x0' "$o.sass")" \
      "$(grep -c UTMALDG "$o.sass")" "$(grep -c UTMASTG "$o.sass")" "$(grep -c UTMAREDG "$o.sass")" \
      "$(grep -cE '\b(LDL|STL)\b' "$o.sass")" "$(grep -c USETMAXREG "$o.sass")"
  done
fi
[ "${RUN:-1}" = 1 ] || exit 0

echo "== smoke (quick cases, no sanitizer)"
smoke=0
timeout 60 "$BIN" --quick >"$BUILD/smoke.txt" 2>&1 || smoke=$?
if [ $smoke = 0 ]; then echo "smoke: ok"; else echo "smoke: FAILED (rc $smoke)"; tail -n 20 "$BUILD/smoke.txt"; fi
if [ $smoke = 124 ]; then
  echo "smoke run hung: skipping the rest"
  [ -n "${OUT:-}" ] && cp "$BUILD/smoke.txt" "$OUT/"
  exit 1
fi

echo "== check + bench"
status=0
timeout "${MAIN_TIMEOUT:-200}" "$BIN" --log "$BUILD/cases.txt" "$@" >"$BUILD/main.txt" 2>&1 || status=$?
[ $status = 124 ] && { echo "main run TIMED OUT; last cases:"; tail -n 5 "$BUILD/cases.txt"; }

if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer memcheck (quick cases)"
  timeout "${SANITIZE_TIMEOUT:-90}" compute-sanitizer --tool memcheck --print-limit 5 --error-exitcode 3 \
    "$BIN" --quick >"$BUILD/memcheck.txt" 2>&1 &&
    echo "memcheck: clean" || { echo "memcheck: FAILED or timed out"; tail -n 30 "$BUILD/memcheck.txt"; }
fi
if [ -n "${OUT:-}" ]; then
  cp "$BUILD/main.txt" "$BUILD/cases.txt" "$BUILD/smoke.txt" "$OUT/" 2>/dev/null || true
  cp "$BUILD/memcheck.txt" "$OUT/" 2>/dev/null || true
  cp "$BUILD"/*.o.log "$OUT/" 2>/dev/null || true
fi
echo
echo "################ summary ################"
if grep -q "===== results =====" "$BUILD/main.txt"; then
  sed -n '/===== results =====/,$p' "$BUILD/main.txt"
else
  tail -n 40 "$BUILD/main.txt"
fi
exit $status
