#!/usr/bin/env bash
export PATH=/usr/local/cuda/bin:$PATH
CHECK=bwd RUN=0 scripts/sm90_standalone.sh >/dev/null 2>&1 || { echo build failed; exit 1; }
B=build/sm90_standalone_bwd/sm90_bwd_check
which ncu || ls /opt/nvidia/nsight-compute/*/ncu
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for cfg in "64 4096 0" "128 4096 0"; do
  set -- $cfg
  timeout 150 $NCU --clock-control none -k regex:flash_bwd_sm90_kernel --launch-skip 5 --launch-count 1 --set full \
    $B --bench-one $cfg > $OUT/ncu_H$1.txt 2>&1
  echo "== H$1 rc $?"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Shared Memory|Issue Slots Busy|Executed Ipc|Warp Cycles Per Issued|No Eligible|Stall|Registers Per|Achieved Occ|L2 Cache Throughput|DRAM Throughput|L1/TEX Hit|Pipe|Tensor" $OUT/ncu_H$1.txt | head -60
done
