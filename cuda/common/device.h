// Host-side facts about the current CUDA device that the launchers need.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

namespace jaxattn::cuda {

// SMs of the current device, queried once per device (no host synchronisation: the
// attribute query is a host-side lookup, allowed while a CUDA graph is captured); 108
// if the query fails (an A100's count: a launch on a broken device fails anyway).
inline int device_sms() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // 0 = not asked yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  const int slot = std::min(std::max(dev, 0), kMaxDevices - 1);
  int sms = cache[slot].load(std::memory_order_relaxed);
  if (sms <= 0) {
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 108;
    cache[slot].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// Peak DRAM bandwidth of the current device in GB/s (2 transfers a memory clock times the
// bus width), queried once per device like device_sms(); 0 if the attributes are not
// reported. (H100 SXM: 3352; H200: 4915.)
inline int device_peak_dram_gbs() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // 0 = not asked yet, -1 = not reported
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  const int slot = std::min(std::max(dev, 0), kMaxDevices - 1);
  int gbs = cache[slot].load(std::memory_order_relaxed);
  if (gbs == 0) {
    int khz = 0, bits = 0;
    gbs = -1;
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, dev) == cudaSuccess && khz > 0 && bits > 0)
      gbs = int(2.0 * khz * 1e3 * (bits / 8) / 1e9);
    cache[slot].store(gbs, std::memory_order_relaxed);
  }
  return std::max(gbs, 0);
}

}  // namespace jaxattn::cuda
