// Is decode's per-CTA spread a per-GPC bandwidth share? (issue 9, session 21)
//
// Session 21 run 1: at B=16 L=4K the drift loop's 128 CTAs (one per SM, equal work)
// take 52 us on some SMs and 65 on others, alike within groups of SMs. If each GPC
// gets an equal share of the memory fabric, a CTA's speed follows how many busy SMs
// its GPC holds. This probe:
//  1. maps SMs to GPCs: one wave of thread block clusters of the largest size the
//     device takes (16 on an H100/H200 with the non-portable size allowed): a cluster
//     runs inside one GPC, so the SMs of one cluster share a GPC (GPCs too small for a
//     cluster stay unmapped);
//  2. streams 2 MB per CTA (16-byte loads, 16 in flight per thread, 256 threads, one
//     CTA per SM through its shared-memory request) with 128 and with 132 CTAs, and
//     prints each CTA's time by SM, then the mean per GPC with its count of busy SMs.
//   nvcc -O3 -std=c++17 -Icuda -Itests/cuda -gencode arch=compute_90,code=sm_90 tests/cuda/gpc_probe.cu -o gpc_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <vector>

#include "cuda_check.h"

__device__ unsigned smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
__device__ unsigned long long gtimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Each CTA records its SM and its cluster (then holds the SM ~50 us so the wave is
// resident at once).
__global__ void map_kernel(int* out) {
  extern __shared__ unsigned char map_pad[];
  if (threadIdx.x == 0) {
    map_pad[0] = 0;
    unsigned cid;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cid));
    out[2 * blockIdx.x] = smid();
    out[2 * blockIdx.x + 1] = cid;
    const unsigned long long t0 = gtimer();
    while (gtimer() - t0 < 50000) {
    }
  }
}

// CTA c streams bytes [c * per, (c + 1) * per) of src; records SM, start, end.
__global__ void stream_kernel(const uint4* src, size_t per_cta_vec, unsigned long long* rec, float* sink) {
  extern __shared__ unsigned char pad[];  // (forces one CTA per SM)
  const uint4* p = src + blockIdx.x * per_cta_vec;
  __syncthreads();
  const unsigned long long t0 = gtimer();
  float acc = 0.f;
  for (size_t i = threadIdx.x; i < per_cta_vec; i += blockDim.x * 16) {
    uint4 v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const size_t j = i + size_t(k) * blockDim.x;
      v[k] = j < per_cta_vec ? __ldcs(p + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) acc += __uint_as_float(v[k].x ^ v[k].w);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    rec[3 * blockIdx.x] = smid();
    rec[3 * blockIdx.x + 1] = t0;
    rec[3 * blockIdx.x + 2] = gtimer();
  }
  if (acc == 1234.5f) sink[0] = acc + pad[0];
}

int main() {
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // 1. SM -> GPC (cluster) map.
  CUDA_CHECK(cudaFuncSetAttribute(map_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const int map_smem = 150 * 1024;  // one CTA per SM, so a cluster of 16 spans 16 SMs of one GPC
  CUDA_CHECK(cudaFuncSetAttribute(map_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, map_smem));
  std::map<int, int> gpc_of;  // sm -> group id
  for (int cs : {16, 8}) {
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cs, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
    cfg.blockDim = dim3(32);
    cfg.dynamicSmemBytes = map_smem;
    cfg.attrs = &attr, cfg.numAttrs = 1;
    cfg.gridDim = dim3(cs);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, map_kernel, &cfg) != cudaSuccess || clusters < 1) {
      cudaGetLastError();
      std::printf("cluster size %d: not available\n", cs);
      continue;
    }
    // One CTA per SM (the shared-memory request); clusters * cs <= sms: one wave.
    cfg.gridDim = dim3(clusters * cs);
    int* d = nullptr;
    CUDA_CHECK(cudaMalloc(&d, clusters * cs * 2 * sizeof(int)));
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, map_kernel, d));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<int> h(clusters * cs * 2);
    CUDA_CHECK(cudaMemcpy(h.data(), d, h.size() * sizeof(int), cudaMemcpyDeviceToHost));
    cudaFree(d);
    std::map<int, std::vector<int>> by_cluster;
    for (int i = 0; i < clusters * cs; ++i) by_cluster[h[2 * i + 1]].push_back(h[2 * i]);
    std::printf("cluster size %d: %d clusters resident\n", cs, clusters);
    for (auto& [c, v] : by_cluster) {
      std::sort(v.begin(), v.end());
      v.erase(std::unique(v.begin(), v.end()), v.end());
      std::printf("  cluster %d (%zu SMs):", c, v.size());
      for (int s : v) std::printf(" %d", s);
      std::printf("\n");
      if (cs == 16)
        for (int s : v) gpc_of[s] = c;
    }
  }
  // 2. Streaming, one CTA per SM, 2 MB each.
  const size_t per = 2u << 20, vec = per / 16;
  uint4* src = nullptr;
  float* sink = nullptr;
  unsigned long long* rec = nullptr;
  CUDA_CHECK(cudaMalloc(&src, per * sms));
  CUDA_CHECK(cudaMemset(src, 1, per * sms));
  CUDA_CHECK(cudaMalloc(&sink, 4));
  CUDA_CHECK(cudaMalloc(&rec, 3 * sms * sizeof(unsigned long long)));
  const int smem = 150 * 1024;
  CUDA_CHECK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int ctas : {128, 132, 128, 132}) {
    for (int warm = 0; warm < 3; ++warm) stream_kernel<<<ctas, 256, smem>>>(src, vec, rec, sink);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<unsigned long long> h(3 * ctas);
    CUDA_CHECK(cudaMemcpy(h.data(), rec, h.size() * 8, cudaMemcpyDeviceToHost));
    unsigned long long s0 = ~0ull, e1 = 0;
    std::map<int, std::pair<double, int>> per_gpc;  // group -> (sum us, busy SMs)
    std::vector<std::pair<double, int>> t;  // (us, sm)
    for (int c = 0; c < ctas; ++c) {
      s0 = std::min(s0, h[3 * c + 1]), e1 = std::max(e1, h[3 * c + 2]);
      const double us = (h[3 * c + 2] - h[3 * c + 1]) * 1e-3;
      const int sm = int(h[3 * c]);
      t.push_back({us, sm});
      const int gpc = gpc_of.count(sm) ? gpc_of[sm] : -1;
      per_gpc[gpc].first += us, per_gpc[gpc].second += 1;
    }
    std::sort(t.begin(), t.end());
    std::printf("\n%d CTAs x 2 MB: span %.1f us (%.0f GB/s); CTA time min / median / max %.1f / %.1f / %.1f us\n", ctas,
                (e1 - s0) * 1e-3, double(per) * ctas / ((e1 - s0) * 1e-9) / 1e9, t.front().first, t[t.size() / 2].first,
                t.back().first);
    std::printf("  per group of SMs (cluster-16 group, -1 = unmapped): mean us (busy SMs):");
    for (auto& [gpc, v] : per_gpc) std::printf("  g%d %.1f (%d)", gpc, v.first / v.second, v.second);
    std::printf("\n  us@SM, sorted:");
    for (auto& [us, sm] : t) std::printf(" %.0f@%d", us, sm);
    std::printf("\n");
  }
  return 0;
}
