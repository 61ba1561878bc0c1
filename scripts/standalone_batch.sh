#!/usr/bin/env bash
# Several standalone checker builds measured in one device call: build them here
# (no GPU needed), carry one small archive, run them all there.
#
#   scripts/standalone_batch.sh build NAME:CHECK[:FLAGS] ...   # on the dev box
#   scripts/standalone_batch.sh run [ARGS for every binary]    # on the GPU machine
#
# build: for each NAME, scripts/sm90_standalone.sh CHECK=fwd|bwd|masked with
#   EXTRA_FLAGS=FLAGS (commas become spaces) into build/batch/NAME (RUN=0), then the
#   stripped binaries go into build/batch.tar.xz (xz finds what the binaries share:
#   six of them, 212 MB, made 5.6 MB). Pass build/batch.tar.xz as the device call's
#   carry.
#   Example: scripts/standalone_batch.sh build fwd:fwd bwd:bwd masked:masked
# run: unpacks build/batch.tar.xz and runs each binary in turn (check against float64
#   and bench, or whatever ARGS say), writing $OUT/NAME.txt, then prints each
#   binary's results section. Binaries run one after another, so a later one meets a
#   warmer GPU: compare variants inside one binary where possible.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}; shift || true
case "$mode" in
  build)
    rm -rf build/batch && mkdir -p build/batch
    for spec in "$@"; do
      IFS=: read -r name check flags <<<"$spec"
      echo "== $name (CHECK=$check ${flags:+EXTRA_FLAGS=${flags//,/ }})"
      CHECK=$check RUN=0 BUILD="build/batch_obj/$name" EXTRA_FLAGS="${flags//,/ }" \
        scripts/sm90_standalone.sh >"build/batch_obj_$name.log" 2>&1 || { tail -20 "build/batch_obj_$name.log"; exit 1; }
      grep -A3 "stack frames" "build/batch_obj_$name.log" || true
      cp "build/batch_obj/$name/sm90_${check}_check" "build/batch/$name"
      strip "build/batch/$name"
    done
    tar cf - -C build batch | xz -9 -T0 >build/batch.tar.xz
    ls -la build/batch.tar.xz
    ;;
  run)
    O=${OUT:-/tmp/out}
    mkdir -p "$O"
    tar xJf build/batch.tar.xz -C build
    t0=$(date +%s)
    for bin in build/batch/*; do
      name=$(basename "$bin")
      rc=0
      timeout "${LIMIT:-240}" "$bin" "$@" >"$O/$name.txt" 2>&1 || rc=$?
      echo "$name: rc $rc ($(($(date +%s) - t0)) s)"
    done
    for bin in build/batch/*; do
      name=$(basename "$bin")
      echo "===== $name"
      if grep -q "===== results =====" "$O/$name.txt"; then sed -n '/===== results =====/,$p' "$O/$name.txt"; else tail -n 30 "$O/$name.txt"; fi
    done
    ;;
  *)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac
