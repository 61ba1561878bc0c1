#!/usr/bin/env bash
# device call B (untracked; the machine of call A still warm): multi-GPU check, then the attention grid
export PATH=/usr/local/cuda/bin:$PATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 NCCL_NVLS_ENABLE=0
R=$(pwd); D=$(mktemp -d); t0=$(date +%s); FINAL=$OUT
el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
SKIP=1; python3 -c "import jaxattn; assert jaxattn.built_with_cuda()" 2>/dev/null || SKIP=0
el "installed package present: $SKIP"
mkdir -p $D/multi; OUT=$D/multi SKIP_BUILD=$SKIP TIME_BUDGET=300 bash scripts/multi_gpu_check.sh > $D/multi.log 2>&1; el "multi_gpu_check rc $?"
cd /tmp
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 $R/benchmarks/attention.py --out $D/bench --heads 256,128,64 --time-budget 140 > $D/bench.log 2>&1; el "bench rc $?"
tar czf $FINAL/runB.tgz -C $D .
echo "=== multi"; sed -n '/summary/,$p' $D/multi.log | tail -45
echo "=== grid"; cat $D/bench/attention.md 2>/dev/null | tail -45 || tail -30 $D/bench.log
