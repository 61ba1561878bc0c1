#!/usr/bin/env bash
# Side-by-side measurement of the sm80 (mma.sync) kernel candidates on one GPU
# (see docs/sm80_variants_notes.md). Builds the standalone checker once with the default
# tiles and once per variant binary (only the head-dim files a variant changes
# are recompiled, all in parallel), checks every binary against the float64
# reference on twelve small odd-size cases, then times each on H = 64, 128,
# 256 at B = 1, T = S = 16384, N = 2048 / H, causal and not (bf16), and prints
# one table. A binary pairs one forward variant with one backward variant:
# the fwd column measures the first, the bwd column the second.
#
# Usage: scripts/sm80_variants.sh   (from anywhere; about 90 s on 16 cores + H200)
# Env: NVCC, ARCH (90), BUILD (build/sm80_variants), ONLY (space-separated
#      binary names to build and run; default all), OUT (logs copied there),
#      JOBS (parallel nvcc, default nproc).
#      BUILD_ONLY=1: stop after building; strip the binaries and pack them with
#      the ptxas logs into $BUILD.tar.xz (to carry to the GPU machine).
#      RUN_ONLY=1: no build; unpack $BUILD.tar.xz (when present) and run the
#      checks and timings of the binaries in it (ONLY selects among them).
#   e.g. here:  BUILD_ONLY=1 ONLY="base s1 s2 s3" scripts/sm80_variants.sh
#        there: RUN_ONLY=1 ONLY="base s1 s2 s3" scripts/sm80_variants.sh
set -uo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
ARCH=${ARCH:-90}
BUILD=${BUILD:-build/sm80_variants}
mkdir -p "$BUILD"
FLAGS=(-O3 -std=c++17 -Icuda -gencode "arch=compute_${ARCH},code=sm_${ARCH}" -Xptxas -v)
t0=$(date +%s)

# Forward variants: name and, per forward head-dim file, its -D flags ("" = default object).
#   fdb    K/V double buffer (FwdTile kKVStages = 2), default tiles.
#   f8w    H = 64, 128: 8 warps x 32 rows (256-row CTA, 1 CTA/SM) instead of 2 CTAs of 4 warps.
#   f8wdb  f8w + double buffer; H = 256: double buffer.
#   fmix   H = 128: 8 warps x 32 rows, 32 keys a step, double buffer; H = 64: 4 warps, double
#          buffer; H = 256: 4 warps x 16 rows, 32 keys a step, 2 CTAs/SM, double buffer.
#   fpipe  H = 64: 48 keys a step, S of the next key block computed before the softmax of the
#          current one (FwdTile kPipelineS; H = 128 spills with it, so not built).
#          H = 128, 256: default objects.
F128_8W="-DJAXATTN_FWD128_BN=48 -DJAXATTN_FWD128_WARPS=8 -DJAXATTN_FWD128_MTILES=2 -DJAXATTN_FWD128_MINB=1 -DJAXATTN_FWD128_BNM=16"
F64_8W="-DJAXATTN_FWD64_BN=64 -DJAXATTN_FWD64_WARPS=8 -DJAXATTN_FWD64_MTILES=2 -DJAXATTN_FWD64_MINB=1 -DJAXATTN_FWD64_BND=32"
DB="-DJAXATTN_FWD_STAGES=2"
declare -A FV=(
  [fbase]="|||"
  [fdb]="$DB|$DB|$DB"
  [f8w]="$F64_8W|$F128_8W|"
  [f8wdb]="$F64_8W $DB|$F128_8W $DB|$DB"
  [fpipe]="-DJAXATTN_FWD64_BN=48 -DJAXATTN_FWD_PIPE=true||"
  [fmix]="$DB|-DJAXATTN_FWD128_BN=32 -DJAXATTN_FWD128_WARPS=8 -DJAXATTN_FWD128_MTILES=2 -DJAXATTN_FWD128_MINB=1 -DJAXATTN_FWD128_BNM=16 $DB|-DJAXATTN_FWD256_BN=32 -DJAXATTN_FWD256_WARPS=4 -DJAXATTN_FWD256_MTILES=1 -DJAXATTN_FWD256_MINB=2 $DB"
)
FV_FILES=(fwd_hdim64 fwd_hdim128 fwd_hdim256)
# Backward variants (per file bwd_hdim64, bwd_hdim96, bwd_hdim128, bwd_hdim256).
#   bpair  warp pairs share 32 keys: S^T / dP^T 32 keys x 32 queries per warp, P^T and dS^T
#          through smem, dK / dV 32 keys x H/2 per warp (BwdTile kPair).
#   bpairv4  bpair + dQ added with 16-byte reductions (red.global.add.v4.f32 after a lane
#          swap: half the reduction instructions); H = 256 gets the v4 reductions alone.
#   bstag  H = 128 (pairs): warps 4-7 add dQ of the previous step at the end of a step, warps
#          0-3 at its start (JAXATTN_BWD_STAGGER: the two warps of each SM sub-partition are
#          half a phase apart, so one issues MMAs while the other is in exp / dS / atomics).
#   blean  H = 128 (pairs): branch-free dQ reductions for full query blocks (JAXATTN_BWD_LEAN_DQ).
#   bstaglean  both.
P1="-DJAXATTN_BWD_PAIR=1"
V4="-DJAXATTN_BWD_DQ_V4=1"
STAG="-DJAXATTN_BWD_STAGGER=1"
LEAN="-DJAXATTN_BWD_LEAN_DQ=1"
declare -A BV=(
  [bbase]="|||"
  [bpair]="$P1|$P1|$P1|"
  [bpairv4]="$P1 $V4|$P1 $V4|$P1 $V4|$V4"
  [bstag]="||$STAG|"
  [blean]="||$LEAN|"
  [bstaglean]="||$STAG $LEAN|"
)
BV_FILES=(bwd_hdim64 bwd_hdim96 bwd_hdim128 bwd_hdim256)
# Binaries: name fwd-variant bwd-variant.
BINS=(
  "base fbase bbase"
  "v1 fdb bpair"
  "v2 f8w bbase"
  "v3 f8wdb bpair"
  "v4 fmix bpairv4"
  "v5 fpipe bpair"
  "s1 fbase bstag"
  "s2 fbase blean"
  "s3 fbase bstaglean"
)
ONLY=${ONLY:-}

pids=()
BUILD_ONLY=${BUILD_ONLY:-0}
RUN_ONLY=${RUN_ONLY:-0}
ARCHIVE="$BUILD.tar.xz"
if [ "$RUN_ONLY" = 1 ]; then
  if [ -f "$ARCHIVE" ]; then tar -xJf "$ARCHIVE" -C "$BUILD" || { echo "cannot unpack $ARCHIVE"; exit 1; }; fi
  run_bins=()
  for b in "${BINS[@]}"; do
    set -- $b
    [ -n "$ONLY" ] && [[ " $ONLY " != *" $1 "* ]] && continue
    if [ -x "$BUILD/bin_$1" ]; then run_bins+=("$b"); else echo "no binary $BUILD/bin_$1 (skipped)"; fi
  done
  [ ${#run_bins[@]} = 0 ] && { echo "nothing to run"; exit 1; }
else
JOBS=${JOBS:-$(nproc)}  # (at most this many nvcc at once)
compile() {  # compile SRC OBJ [flags...] in the background
  local src=$1 obj=$2
  shift 2
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
  "$NVCC" "${FLAGS[@]}" "$@" -Xcompiler -fopenmp -c "$src" -o "$obj" >"$obj.log" 2>&1 &
  pids+=($!)
}

# Default objects.
base_objs=()
for src in cuda/sm80/*.cu tests/cuda/standalone_check.cu; do
  obj="$BUILD/$(basename "${src%.cu}").o"
  base_objs+=("$obj")
  compile "$src" "$obj" -Itests/cuda
done
# Variant objects: $BUILD/<variant>/<file>.o for each file whose flags are non-empty.
declare -A VOBJ=()  # "<variant>/<file>" -> object
want_variant() {  # is a variant used by a selected binary?
  local v=$1 b
  for b in "${BINS[@]}"; do
    set -- $b
    [ -n "$ONLY" ] && [[ " $ONLY " != *" $1 "* ]] && continue
    [ "$2" = "$v" ] || [ "$3" = "$v" ] && return 0
  done
  return 1
}
build_variant() {  # build_variant NAME "f1|f2|f3" FILE...
  local name=$1 spec=$2
  shift 2
  local IFS_save=$IFS i=0 f flags
  IFS='|' read -r -a parts <<<"$spec|"
  IFS=$IFS_save
  mkdir -p "$BUILD/$name"
  for f in "$@"; do
    flags=${parts[$i]:-}
    i=$((i + 1))
    [ -z "$flags" ] && continue
    VOBJ["$name/$f"]="$BUILD/$name/$f.o"
    # shellcheck disable=SC2086
    compile "cuda/sm80/$f.cu" "$BUILD/$name/$f.o" $flags
  done
}
for v in "${!FV[@]}"; do want_variant "$v" && build_variant "$v" "${FV[$v]}" "${FV_FILES[@]}"; done
for v in "${!BV[@]}"; do want_variant "$v" && build_variant "$v" "${BV[$v]}" "${BV_FILES[@]}"; done
fail=0
for pid in "${pids[@]}"; do wait "$pid" || fail=1; done
pids=()
if [ $fail = 1 ]; then
  for log in "$BUILD"/*.o.log "$BUILD"/*/*.o.log; do
    grep -q "error" "$log" && { echo "== $log"; head -n 40 "$log"; }
  done
  echo "BUILD FAILED"
  exit 1
fi

# Link one binary per entry of BINS.
run_bins=()
for b in "${BINS[@]}"; do
  set -- $b
  name=$1 fv=$2 bv=$3
  [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]] && continue
  objs=()
  for o in "${base_objs[@]}"; do
    f=$(basename "${o%.o}")
    if [ -n "${VOBJ[$fv/$f]:-}" ]; then objs+=("${VOBJ[$fv/$f]}")
    elif [ -n "${VOBJ[$bv/$f]:-}" ]; then objs+=("${VOBJ[$bv/$f]}")
    else objs+=("$o"); fi
  done
  "$NVCC" -gencode "arch=compute_${ARCH},code=sm_${ARCH}" -Xcompiler -fopenmp "${objs[@]}" -o "$BUILD/bin_$name" &
  pids+=($!)
  run_bins+=("$b")
done
for pid in "${pids[@]}"; do wait "$pid" || fail=1; done
pids=()
[ $fail = 1 ] && { echo "LINK FAILED"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
fi  # (RUN_ONLY)

echo "== ptxas: spills / stack frames (none expected)"
cat "$BUILD"/*.o.log "$BUILD"/*/*.o.log | grep -E "stack frame|spill" |
  grep -v "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" || echo "none"
echo "== ptxas: registers of the variant kernels (sm80 namespace)"
for log in "$BUILD"/*/*.o.log; do
  grep -E "Compiling entry|Used [0-9]+ registers" "$log" |
    sed -E 's/.*entry function .(_Z[^ ]*). for.*/\1/; s/ptxas info *: //' | paste - - |
    awk -v f="$(basename "$(dirname "$log")")/$(basename "${log%.o.log}")" '{print f, $3}' | sort | uniq -c |
    awk '{printf "  %-24s %s regs x%d\n", $2, $3, $1}'
done

if [ "$BUILD_ONLY" = 1 ]; then
  names=()
  for b in "${run_bins[@]}"; do
    set -- $b
    strip "$BUILD/bin_$1" 2>/dev/null || true
    names+=("bin_$1")
  done
  logs=$(cd "$BUILD" && ls *.o.log */*.o.log 2>/dev/null)
  # shellcheck disable=SC2086
  tar -cJf "$ARCHIVE" -C "$BUILD" "${names[@]}" $logs || { echo "PACKING FAILED"; exit 1; }
  echo "packed ${names[*]} into $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1)); on the GPU machine:"
  echo "  RUN_ONLY=1 ONLY=\"$ONLY\" BUILD=$BUILD scripts/sm80_variants.sh"
  exit 0
fi

# Correctness: all binaries at once (small cases, CPU reference), then the timings one at a time.
ncpu=$(nproc)
nb=${#run_bins[@]}
for b in "${run_bins[@]}"; do
  set -- $b
  OMP_NUM_THREADS=$(( ncpu / nb > 0 ? ncpu / nb : 1 )) timeout 300 "$BUILD/bin_$1" --sweep --no-bench \
    >"$BUILD/check_$1.txt" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
pids=()
echo "checks: $(( $(date +%s) - t0 )) s"
for b in "${run_bins[@]}"; do
  set -- $b
  timeout 200 "$BUILD/bin_$1" --sweep --no-check >"$BUILD/bench_$1.txt" 2>&1
done
echo "benchmarks: $(( $(date +%s) - t0 )) s"

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/sm80_variants"
  cp "$BUILD"/check_*.txt "$BUILD"/bench_*.txt "$OUT/sm80_variants/" 2>/dev/null || true
  cat "$BUILD"/*.o.log "$BUILD"/*/*.o.log >"$OUT/sm80_variants/ptxas.txt" 2>/dev/null || true
fi

echo
echo "################ sm80 variants (TFLOP/s; fwd+bwd counts bwd as 2.5x fwd flops) ################"
for b in "${run_bins[@]}"; do
  set -- $b
  if grep -q "^ALL OK" "$BUILD/check_$1.txt"; then ck="checks ok"
  else ck="CHECKS FAILED: $(grep -c FAIL "$BUILD/check_$1.txt") failing cases (see check_$1.txt)"; fi
  echo "$1 = fwd $2 + bwd $3: $ck"
  grep -q "^ALL OK" "$BUILD/check_$1.txt" || grep FAIL "$BUILD/check_$1.txt" | head -n 5 | sed 's/^/    /'
  grep -qE "^ALL OK|SOME FAILED" "$BUILD/check_$1.txt" || tail -n 3 "$BUILD/check_$1.txt" | sed 's/^/    /'
done
printf "\n%-6s %-7s %-7s %-5s %-7s %7s %7s %8s\n" bin fwd_var bwd_var H mask fwd bwd fwd+bwd
for b in "${run_bins[@]}"; do
  set -- $b
  grep "^sweep" "$BUILD/bench_$1.txt" | while read -r _ h mask _ f _ bw _ tot; do
    printf "%-6s %-7s %-7s %-5s %-7s %7s %7s %8s\n" "$1" "$2" "$3" "${h#H}" "$mask" "$f" "$bw" "$tot"
  done
  grep -q "^sweep" "$BUILD/bench_$1.txt" || { echo "$1: no timings:"; tail -n 5 "$BUILD/bench_$1.txt"; }
done
