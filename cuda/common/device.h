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

}  // namespace jaxattn::cuda
