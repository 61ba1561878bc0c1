#!/usr/bin/env bash
# Builds and runs the standalone (no JAX) check of the CPU flash kernels:
# correctness against a float64 reference on every ISA path, then timings.
#   scripts/cpu_standalone.sh [--quick] [--no-bench]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${JAXATTN_CPU_BUILD:-/tmp/jaxattn_cpu_standalone}"
mkdir -p "$build"
CXX="${CXX:-g++}"
"$CXX" -O3 -std=c++17 -Wall -Wextra -pthread -I"$root/cuda" -I"$root/bindings" \
  "$root/bindings/cpu/flash_cpu.cc" "$root/tests/cpu/standalone_check.cc" \
  -o "$build/standalone_check"
quick=()
bench=()
for a in "$@"; do
  case "$a" in
    --quick) quick=(--quick) ;;
    --no-bench) bench=(--no-bench) ;;
  esac
done
# Every ISA path the machine can run (the kernels pick the best one by
# default); the non-default ones on the quick subset.
flags="$(grep -m1 '^flags' /proc/cpuinfo || true)"
for isa in sse2 avx2 avx512; do
  case "$isa" in
    avx2) [[ "$flags" == *" avx2 "* && "$flags" == *" fma "* ]] || continue ;;
    avx512) [[ "$flags" == *" avx512f "* && "$flags" == *" avx512bw "* ]] || continue ;;
  esac
  echo "=== ISA $isa (quick subset) ==="
  JAXATTN_CPU_ISA=$isa "$build/standalone_check" --quick --no-bench | tail -n 5
done
echo "=== default ISA, all cases ==="
"$build/standalone_check" "${quick[@]}" "${bench[@]}"
