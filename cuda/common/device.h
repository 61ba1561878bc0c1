// Host-side facts about the current CUDA device that the launchers need.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

namespace jaxattn::cuda {

// A fact about the current device, computed by `query(dev)` once per device and cached
// (no host synchronisation: attribute and occupancy queries are host-side lookups,
// allowed while a CUDA graph is captured). `query` returns a non-zero int, or 0 for "ask
// again next time" (a failed set-up); each caller keeps its own cache. Release / acquire:
// what a query did (a kernel attribute it set) happens before a reader's use of the value.
constexpr int kMaxDevices = 64;  // devices with a cache slot of their own (the rest share the last)
template <typename Query>
inline int per_device_cached(std::atomic<int> (&cache)[kMaxDevices], Query query) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  const int slot = std::min(std::max(dev, 0), kMaxDevices - 1);
  int v = cache[slot].load(std::memory_order_acquire);  // 0 = not asked yet
  if (v == 0) {
    v = query(dev);
    cache[slot].store(v, std::memory_order_release);
  }
  return v;
}

// SMs of the current device; 108 if the query fails (an A100's count: a launch on a
// broken device fails anyway).
inline int device_sms() {
  static std::atomic<int> cache[kMaxDevices];
  return per_device_cached(cache, [](int dev) {
    int sms = 0;
    return cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && sms > 0 ? sms : 108;
  });
}

// Peak DRAM bandwidth of the current device in GB/s (2 transfers a memory clock times the
// bus width); 0 if the attributes are not reported. (H100 SXM: 3352; H200: about 4900.)
inline int device_peak_dram_gbs() {
  static std::atomic<int> cache[kMaxDevices];
  const int gbs = per_device_cached(cache, [](int dev) {
    int khz = 0, bits = 0;
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess || khz <= 0 || bits <= 0)
      return -1;  // (cached as "not reported")
    return std::max(int(2.0 * khz * 1e3 * (bits / 8) / 1e9), 1);
  });
  return std::max(gbs, 0);
}

}  // namespace jaxattn::cuda
