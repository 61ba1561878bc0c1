#!/usr/bin/env bash
# Decode kernel builds side by side (issue 9, session 16's finding: the same
# source read 8-10% faster on paged caches when built with the timeline stamps,
# because ptxas scheduled the V fragments' ldmatrix differently).
#
# Builds tests/cuda/decode_check.cu several ways for sm_90 -- plain, with each
# entry of $EXPS (experiment macros, e.g. EXPS="JAXATTN_EXP_X JAXATTN_EXP_X+JAXATTN_EXP_Y=3";
# A+B defines both, A=v gives a value; the build's folder is the entry with '=' and
# '+' as '_'; default: none), and the
# timeline build (-DJAXATTN_DECODE_TIMELINE) -- then, on a GPU, times the issue-9
# rows (decode_check --row: the default column first) with every build, and runs
# the float64 checker (--fast --no-bench) on each experiment build.
#   BUILD_ONLY=1 scripts/decode_build_ab.sh   # here, without a GPU (~1 min a build on 2 cores)
#   RUN_ONLY=1 OUT=$OUT scripts/decode_build_ab.sh   # on the GPU machine, build/decode_ab carried
# TIMELINE=0 leaves the timeline build out; CHECK=0 skips the float64 checks
# (timing-only experiment builds, e.g. the NO_MATH / NO_LOAD probes); CHECK_EXPS="..."
# checks only those builds.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
B=${BUILD:-build/decode_ab}
EXPS=${EXPS:-}
ROWS=${ROWS:-"64 4096;16 16384;16 4096"}
FLAGS=(-O3 -std=c++17 --expt-relaxed-constexpr -Icuda -Itests/cuda -gencode arch=compute_90,code=sm_90)
# A build's folder: its EXPS entry with '=' and '+' as '_' (entries may set values:
# JAXATTN_EXP_A=1+JAXATTN_EXP_B=3).
dir_of() { local d=${1//=/_}; echo "${d//+/_}"; }
names=(plain)
for e in $EXPS; do names+=("$(dir_of "$e")"); done
[ "${TIMELINE:-1}" = 1 ] && names+=(timeline)
build_one() {  # name, extra flags...
  local name=$1; shift
  local d="$B/$name"; mkdir -p "$d"
  for src in cuda/decode/launch_decode.cu cuda/decode/launch_decode_v2.cu tests/cuda/decode_check.cu; do
    "$NVCC" "${FLAGS[@]}" "$@" -Xptxas -v -c "$src" -o "$d/$(basename "${src%.cu}").o" 2>>"$d/ptxas.log"
  done
  "$NVCC" -gencode arch=compute_90,code=sm_90 "$d"/*.o -o "$d/decode_check"
  echo "built $name: $(grep -o 'Used [0-9]* registers' "$d/ptxas.log" | sort | uniq -c | tr '\n' ' ')"
}
if [ "${RUN_ONLY:-0}" != 1 ]; then
  build_one plain
  for e in $EXPS; do build_one "$(dir_of "$e")" $(printf -- '-D%s ' ${e//+/ }); done
  [ "${TIMELINE:-1}" = 1 ] && build_one timeline -DJAXATTN_DECODE_TIMELINE
fi
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
OUT=${OUT:-$B}
IFS=';' read -ra rows <<<"$ROWS"
for row in "${rows[@]}"; do
  for n in "${names[@]}"; do
    echo "== $n $row"; timeout 40 "$B/$n/decode_check" --row $row 2>&1 | grep "^| [0-9]" | head -1
  done
done | tee "$OUT/decode_ab_rows.txt"
[ "${CHECK:-1}" = 1 ] || exit 0  # CHECK=0: timing-only experiment builds (no float64 check)
for e in ${CHECK_EXPS:-$EXPS}; do  # CHECK_EXPS: the builds to check (default: every one)
  d=$(dir_of "$e")
  timeout 300 "$B/$d/decode_check" --fast --no-bench >"$OUT/decode_ab_check_$d.txt" 2>&1 || true
  echo "float64 $d: $(grep -c '^ok' "$OUT/decode_ab_check_$d.txt") ok, $(grep -c FAIL "$OUT/decode_ab_check_$d.txt") FAIL"
done
