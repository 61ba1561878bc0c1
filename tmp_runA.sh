#!/usr/bin/env bash
# device call A (untracked): build; tests on GPU 0 while memcheck, decode and masks benchmarks run on GPU 1
export PATH=/usr/local/cuda/bin:$PATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 NCCL_NVLS_ENABLE=0
R=$(pwd); D=$(mktemp -d); t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi -L
JAXATTN_CUDA=ON JAXATTN_CUDA_ARCHS=90-real CMAKE_BUILD_PARALLEL_LEVEL=32 timeout 280 python3 -m pip install --no-build-isolation --no-deps -q . > $D/build.log 2>&1 && el "build ok" || { el "BUILD FAILED"; tail -30 $D/build.log; }
cd /tmp
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 --kernel-name kns=flash_ python3 $R/tests/gpu_sanitize.py > $D/memcheck.log 2>&1; echo "memcheck rc $?" >> $D/memcheck.log
  timeout 100 python3 $R/benchmarks/decode.py --out $D/decode --time-budget 80 > $D/decode_bench.md 2> $D/decode_bench.log; echo "decode bench rc $?" >> $D/decode_bench.log
  timeout 100 python3 $R/benchmarks/masks.py --out $D/masks > $D/masks_bench.md 2> $D/masks_bench.log; echo "masks bench rc $?" >> $D/masks_bench.log
) &
side=$!
CUDA_VISIBLE_DEVICES=0 timeout 270 python3 -m pytest $R/tests -q -n 16 -p no:cacheprovider --rootdir $R -k "not cpu and not sharding and not ring" > $D/tests.log 2>&1; el "tests rc $?"
wait $side; el "side jobs done"
tar czf $OUT/runA.tgz -C $D .
echo "=== memcheck"; grep -m3 "ERROR SUMMARY\|Invalid\|rc " $D/memcheck.log
echo "=== tests"; grep -E "^(FAILED|ERROR)" $D/tests.log | head -30; tail -2 $D/tests.log
echo "=== decode"; tail -20 $D/decode_bench.md; tail -3 $D/decode_bench.log
echo "=== masks"; tail -25 $D/masks_bench.md; tail -3 $D/masks_bench.log
