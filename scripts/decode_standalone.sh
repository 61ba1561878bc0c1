#!/usr/bin/env bash
# Builds the CUDA decode kernels (both versions) with their standalone
# checker (tests/cuda/decode_check.cu, no JAX) for one architecture (sm_90 by
# default), then: ptxas registers/spills per decode kernel, SASS health of
# version 2 (LDGSTS = cp.async, HMMA = tensor cores, LDL/STL = local memory),
# compute-sanitizer memcheck and racecheck on the quick cases (when the tool
# exists), and the full check against float64 (v1, v2 with the old, the
# default and every loader bit, and issue 9's short-context variants kV2Short,
# kV2Short without cluster merge, kV2ShortLong) plus the bandwidth tables: the
# issue-9 rows (paged, page 64, B=16/32/64 x L=4K/16K/64K), the default next
# to kV2Short and its neighbours (and both as contiguous caches), and last the
# short default-vs-kV2Short table of the paged bar. The last lines printed are
# the results (~130 s on an H200 with the sanitizers; the float64 check alone
# takes most of a minute even with --fast).
#
# Usage: scripts/decode_standalone.sh [args for decode_check: --bench-only,
#        --no-bench, --quick, --fast (check the default and kV2Short* only),
#        --sweep (forced split counts on the short rows too)]
# Env: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc), BUILD
#      (default build/decode_standalone), ARCH (90), SANITIZE (1), PREBUILT (0;
#      1: run the checker already in $BUILD, e.g. built on a machine without a
#      GPU and carried over). With $OUT set, the logs are copied there.
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
BUILD=${BUILD:-build/decode_standalone}
ARCH=${ARCH:-90}
mkdir -p "$BUILD"
FLAGS=(-O3 -std=c++17 --expt-relaxed-constexpr -Icuda -Itests/cuda -gencode "arch=compute_${ARCH},code=sm_${ARCH}")

t0=$(date +%s)
if [ "${PREBUILT:-0}" = 1 ] && [ -x "$BUILD/decode_check" ]; then
  echo "build: skipped (PREBUILT=1: $BUILD/decode_check and its ptxas logs as they are)"
else
pids=()
for src in cuda/decode/launch_decode.cu cuda/decode/launch_decode_v2.cu tests/cuda/decode_check.cu; do
  obj="$BUILD/$(basename "${src%.cu}").o"
  "$NVCC" "${FLAGS[@]}" -Xptxas -v -c "$src" -o "$obj" >"$obj.log" 2>&1 &
  pids+=($!)
done
fail=0
for pid in "${pids[@]}"; do wait "$pid" || fail=1; done
if [ $fail = 1 ]; then cat "$BUILD"/*.o.log; echo "BUILD FAILED"; exit 1; fi
"$NVCC" -gencode "arch=compute_${ARCH},code=sm_${ARCH}" "$BUILD"/launch_decode.o "$BUILD"/launch_decode_v2.o \
  "$BUILD"/decode_check.o -o "$BUILD/decode_check"
echo "build: $(( $(date +%s) - t0 )) s"
fi

echo "== ptxas: registers, stack and spills per decode kernel"
cat "$BUILD"/launch_decode*.o.log | grep -E "Compiling entry|Used [0-9]+ registers|spill" |
  sed -E 's/.*entry function .(_Z[^ ]*). for.*/\1/; s/ptxas info *: //' | paste - - - | c++filt |
  sed -E 's/jaxattn::cuda::decode:://g; s/\(jaxattn::AttnParams, DecodePlan\)//; s/, used [0-9]+ barriers//' | sort -u

echo "== SASS of decode_mma_kernel (version 2): per kernel LDGSTS HMMA LDSM CCTL (L2 prefetch) LDL/STL"
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}
if [ -x "$CUOBJDUMP" ] || command -v "$CUOBJDUMP" >/dev/null; then
  "$CUOBJDUMP" -sass "$BUILD/launch_decode_v2.o" | awk '
    /Function :/ { name = $3 }
    name != "" && /LDGSTS/ { ldgsts[name]++ } name != "" && /HMMA/ { hmma[name]++ }
    name != "" && /LDSM/ { ldsm[name]++ } name != "" && /(LDL|STL)/ { local_[name]++ }
    name != "" && /CCTL/ { cctl[name]++ }
    END { for (n in hmma) printf "%s LDGSTS %d HMMA %d LDSM %d CCTL %d LDL/STL %d\n", n, ldgsts[n], hmma[n], ldsm[n],
          cctl[n], local_[n] }' |
    c++filt | sed -E 's/jaxattn::cuda::decode:://g; s/\(jaxattn::AttnParams, DecodePlan\)//' | sort
else
  echo "cuobjdump not found"
fi

rm -f "$BUILD/sanitize.txt"
if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer memcheck, racecheck (quick cases)"
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool --print-limit 5 --error-exitcode 3 \
      "$BUILD/decode_check" --quick >"$BUILD/$tool.txt" 2>&1 &&
      echo "$tool: clean" | tee -a "$BUILD/sanitize.txt" ||
      { echo "$tool: FAILED or timed out" | tee -a "$BUILD/sanitize.txt"; tail -n 30 "$BUILD/$tool.txt"; }
  done
fi

echo "== check + bench"
status=0
"$BUILD/decode_check" "$@" | tee "$BUILD/main.txt" || status=1
if [ -n "${OUT:-}" ]; then
  cp "$BUILD"/main.txt "$BUILD"/*.o.log "$OUT/" 2>/dev/null || true
  cp "$BUILD"/memcheck.txt "$BUILD"/racecheck.txt "$OUT/" 2>/dev/null || true
fi
echo
echo "################ decode summary ################"
cat "$BUILD/sanitize.txt" 2>/dev/null || true
grep -E "FAIL|ALL OK|SOME" "$BUILD/main.txt" || true
sed -n '/== bench/,$p' "$BUILD/main.txt"
exit $status
