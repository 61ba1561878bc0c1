// Decode's read pattern without the attention (issue 9, session 17): does reading a
// [B, L, K, H] cache one KV head per CTA (256-byte pieces at a 2 KB stride, H=128
// bf16, K=8) stream slower than reading it a whole key row (all K heads, 2 KB
// contiguous) at a time? cuDNN's decode reads a contiguous cache at 94-102% of the
// measured read bandwidth where ours reads 79-93% (session 17, run 2); if the
// per-head pattern alone costs that, the loop needs CTAs that own key rows, not heads.
//
// Every kernel reads the same bytes (K and V, B * L * K * H bf16 each) with the same
// grid size (splits * K * B CTAs of 128 threads, two resident per SM through a 100 KB
// shared-memory request, as the decode kernel) and 16-byte loads, 16 in flight per
// thread per tensor:
//   per_head  CTA (split, kh, b): keys of its split, head kh only (decode's pattern);
//   per_row   CTA (split', b): 1/K of the keys of row b, every head (2 KB rows; on a
//             contiguous cache each CTA reads one contiguous range);
//   the same two through a shuffled page table of 64-key pages ("paged");
//   per_head through a 3-stage shared-memory ring as decode's loop, filled by
//   16-byte cp.async copies ("cp.async ring") or by one 256-byte cp.async.bulk per
//   row on per-stage mbarriers ("bulk ring"). Run 4 (session 17): per_head and
//   per_row read alike (97-100%), so the DRAM pattern is not decode's gap.
// Prints GB/s, and each column as % of per_row on the contiguous cache; the ring
// columns (below) also check the words they read.
//   nvcc -O3 -std=c++17 -Icuda -gencode arch=compute_90,code=sm_90 tests/cuda/stream_probe.cu -o stream_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "common/hopper_ptx.h"
#include "common/ptx.h"

namespace ptx = jaxattn::ptx;
namespace hptx = jaxattn::hptx;

#define CK(x)                                                                             \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

constexpr int kK = 8, kRowBytes = 256, kThreads = 128, kUnroll = 16, kPage = 64;

// (not volatile: ptxas may issue a whole unrolled step's loads before the first use)
__device__ __forceinline__ uint4 ldg_nc(const uint4* p) { return __ldg(p); }

struct Args {
  const char *k, *v;
  const int* table;  // [B, L / kPage] page ids, or null (contiguous)
  int B, L, splits;
  unsigned* sink;
  unsigned* errors;  // ring modes: words read that were not the copied bytes
};

// Byte offset of (b, key j, head kh) in the cache; `pages` holds the page ids of
// the CTA's keys from j0 on (shared memory, as the decode kernel keeps them).
__device__ __forceinline__ int64_t offset(const Args& a, const int* pages, int j0, int b, int j, int kh) {
  int64_t row;
  if (a.table) {
    row = int64_t(pages[(j - j0) / kPage]) * kPage + j % kPage;
  } else {
    row = int64_t(b) * a.L + j;
  }
  return (row * kK + kh) * kRowBytes;
}

// The page ids of keys [j0, j0 + n) of row b into shared memory.
__device__ __forceinline__ void stage_pages(const Args& a, int* pages, int b, int j0, int n) {
  if (a.table)
    for (int i = threadIdx.x; i < n / kPage; i += kThreads) pages[i] = a.table[b * (a.L / kPage) + j0 / kPage + i];
  __syncthreads();
}

__device__ __forceinline__ uint32_t fold(uint4 x) { return x.x ^ x.y ^ x.z ^ x.w; }

// Mode 1: per_head; 2: per_row.
template <int kMode>
__global__ void __launch_bounds__(kThreads) probe(Args a) {
  extern __shared__ int pages_s[];  // page ids; 100 KB requested: two CTAs per SM
  const int tid = threadIdx.x;
  const int cta = blockIdx.x;
  uint32_t acc = 0;
  if constexpr (kMode == 1) {
    // CTA (split, kh, b); 16 threads a 256-byte row piece, 8 rows a step, kUnroll steps in flight.
    const int split = cta % a.splits, kh = (cta / a.splits) % kK, b = cta / (a.splits * kK);
    const int chunk = a.L / a.splits, j0 = split * chunk;
    const int r = tid / 16, c = (tid % 16) * 16;
    stage_pages(a, pages_s, b, j0, chunk);
    for (int j = j0 + r; j < j0 + chunk; j += 8 * kUnroll) {
      uint4 x[kUnroll], y[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int jj = min(j + 8 * u, j0 + chunk - 1);
        const int64_t off = offset(a, pages_s, j0, b, jj, kh) + c;
        x[u] = ldg_nc(reinterpret_cast<const uint4*>(a.k + off));
        y[u] = ldg_nc(reinterpret_cast<const uint4*>(a.v + off));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) acc ^= fold(x[u]) ^ fold(y[u]);
    }
  } else {
    // CTA (split', b) with splits * K of them per row: a whole 2 KB key row an iteration.
    const int parts = a.splits * kK, part = cta % parts, b = cta / parts;
    const int chunk = a.L / parts, j0 = part * chunk;
    const int kh = tid / 16, c = (tid % 16) * 16;
    stage_pages(a, pages_s, b, j0, chunk);
    for (int j = j0; j < j0 + chunk; j += kUnroll) {
      uint4 x[kUnroll], y[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int jj = min(j + u, j0 + chunk - 1);
        const int64_t off = offset(a, pages_s, j0, b, jj, kh) + c;
        x[u] = ldg_nc(reinterpret_cast<const uint4*>(a.k + off));
        y[u] = ldg_nc(reinterpret_cast<const uint4*>(a.v + off));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) acc ^= fold(x[u]) ^ fold(y[u]);
    }
  }
  if (acc == 0x9e3779b9u) a.sink[cta * kThreads + tid] = acc;  // keeps the loads
}

// ---- the per_head pattern through a shared-memory ring, as decode's loop ---------
// (session 17, run 5: decode's loop with no math stops at 92% where the register
// loads above read 97-100%; is it the copies into shared memory?). Tiles of 64 keys
// (K and V: 32 KB) into kStages stages of the decode kernel's padded layout (272-byte
// rows), one CTA-wide barrier per tile; the CTA reads one word per thread of each tile.
//   kBulk = false: every thread issues 16-byte cp.async.cg copies (decode's loader);
//   kBulk = true:  warp 0 issues one 256-byte cp.async.bulk per row, completing on the
//                  stage's mbarrier (no per-thread copies, no wait_group).
constexpr int kStages = 3, kTileRows = 64, kPitchBytes = 272;
constexpr int kStageBytes = 2 * kTileRows * kPitchBytes;
constexpr int kRingSmem = kStages * kStageBytes + 1024 + 64;  // ring, page ids, mbarriers

template <bool kBulk>
__global__ void __launch_bounds__(kThreads) ring_probe(Args a) {
  extern __shared__ __align__(128) char smem[];
  int* pages_s = reinterpret_cast<int*>(smem + kStages * kStageBytes);
  const uint32_t ring = ptx::smem_addr(smem), bars = ptx::smem_addr(smem + kStages * kStageBytes + 1024);
  const int tid = threadIdx.x, cta = blockIdx.x;
  const int split = cta % a.splits, kh = (cta / a.splits) % kK, b = cta / (a.splits * kK);
  const int chunk = a.L / a.splits, j0 = split * chunk, tiles = chunk / kTileRows;
  if (kBulk && tid < kStages) hptx::mbar_init(bars + 8 * tid, 1);
  if (kBulk) hptx::mbar_init_fence();
  stage_pages(a, pages_s, b, j0, chunk);  // (its barrier also publishes the mbarriers)
  auto issue = [&](int t) {
    const int stage = t % kStages;
    const uint32_t dst = ring + stage * kStageBytes;
    const int jt = j0 + t * kTileRows;
    if constexpr (kBulk) {
      if (tid < 32) {
        if (tid == 0) hptx::mbar_arrive_expect_tx(bars + 8 * stage, 2 * kTileRows * kRowBytes);
        __syncwarp();
        for (int r = tid; r < kTileRows; r += 32) {
          const int64_t off = offset(a, pages_s, j0, b, jt + r, kh);
          hptx::bulk_load(dst + r * kPitchBytes, a.k + off, kRowBytes, bars + 8 * stage);
          hptx::bulk_load(dst + (kTileRows + r) * kPitchBytes, a.v + off, kRowBytes, bars + 8 * stage);
        }
      }
    } else {
      const int c = (tid % 16) * 16;
#pragma unroll
      for (int k = 0; k < kTileRows / 8; ++k) {
        const int r = tid / 16 + 8 * k;
        const int64_t off = offset(a, pages_s, j0, b, jt + r, kh) + c;
        ptx::cp_async_16(dst + r * kPitchBytes + c, a.k + off, true);
        ptx::cp_async_16(dst + (kTileRows + r) * kPitchBytes + c, a.v + off, true);
      }
      ptx::cp_async_commit();
    }
  };
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < tiles) {
      issue(t);
    } else if (!kBulk) {
      ptx::cp_async_commit();
    }
  }
  uint32_t acc = 0;
  for (int t = 0; t < tiles; ++t) {
    const int stage = t % kStages;
    if constexpr (kBulk) {
      hptx::mbar_wait(bars + 8 * stage, (t / kStages) & 1);
    } else {
      ptx::cp_async_wait<kStages - 2>();
    }
    __syncthreads();  // tile t is in; every thread is done with tile t - 1's stage
    if (t + kStages - 1 < tiles) {
      issue(t + kStages - 1);
    } else if (!kBulk) {
      ptx::cp_async_commit();
    }
    const char* st = smem + stage * kStageBytes;
    acc ^= *reinterpret_cast<const uint32_t*>(st + (tid % kTileRows) * kPitchBytes + (tid / kTileRows) * 128);
    acc ^= *reinterpret_cast<const uint32_t*>(st + (kTileRows + tid % kTileRows) * kPitchBytes + 4);
  }
  // K bytes are all 1 and V bytes all 2 (main's memsets): each tile adds 0x03030303.
  if (acc != ((tiles & 1) ? 0x03030303u : 0u)) atomicAdd(a.errors, 1u);
}

// Median ms per launch of `kernel` over 7 rounds of `reps` back-to-back launches.
static float time_ms(void (*kernel)(Args), int smem, const Args& a, int ctas, int reps) {
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int round = 0; round < 7; ++round) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i) kernel<<<ctas, kThreads, smem>>>(a);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t / reps);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main() {
  std::printf("| B | L | splits | per_row GB/s | per_head | per_head paged | per_row paged | cp.async ring | "
              "cp.async ring paged | bulk ring | bulk ring paged |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  struct Row { int B, L, splits; };
  for (Row r : {Row{16, 4096, 2}, Row{64, 4096, 1}, Row{16, 16384, 2}, Row{64, 16384, 1}}) {
    const size_t bytes = size_t(r.B) * r.L * kK * kRowBytes;
    char *k, *v;
    unsigned* sink;
    CK(cudaMalloc(&k, bytes));
    CK(cudaMalloc(&v, bytes));
    CK(cudaMemset(k, 1, bytes));
    CK(cudaMemset(v, 2, bytes));
    const int ctas = r.splits * kK * r.B;
    CK(cudaMalloc(&sink, size_t(ctas) * kThreads * 4));
    const int pages = r.B * r.L / kPage;
    std::vector<int> perm(pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(r.B * 31 + r.L));
    int* table;
    CK(cudaMalloc(&table, pages * sizeof(int)));
    CK(cudaMemcpy(table, perm.data(), pages * sizeof(int), cudaMemcpyHostToDevice));
    unsigned* errors;
    CK(cudaMalloc(&errors, 4));
    CK(cudaMemset(errors, 0, 4));
    Args a{k, v, nullptr, r.B, r.L, r.splits, sink, errors};
    Args ap = a;
    ap.table = table;
    const int reps = 20;
    const double gb = 2.0 * bytes / 1e9;
    float t[8];
    for (int pass = 0; pass < 2; ++pass) {  // the first pass warms up
      constexpr int kSmem = 100 * 1024;  // two CTAs per SM, as decode
      t[0] = time_ms(probe<2>, kSmem, a, ctas, reps);
      t[1] = time_ms(probe<1>, kSmem, a, ctas, reps);
      t[2] = time_ms(probe<1>, kSmem, ap, ctas, reps);
      t[3] = time_ms(probe<2>, kSmem, ap, ctas, reps);
      t[4] = time_ms(ring_probe<false>, kRingSmem, a, ctas, reps);
      t[5] = time_ms(ring_probe<false>, kRingSmem, ap, ctas, reps);
      t[6] = time_ms(ring_probe<true>, kRingSmem, a, ctas, reps);
      t[7] = time_ms(ring_probe<true>, kRingSmem, ap, ctas, reps);
    }
    const double flat = gb / (t[0] * 1e-3);
    std::printf("| %d | %d | %d | %.0f |", r.B, r.L, r.splits, flat);
    for (int i = 1; i < 8; ++i) {
      const double g = gb / (t[i] * 1e-3);
      std::printf(" %.0f (%.0f%%) |", g, 100 * g / flat);
    }
    unsigned errs = 0;
    CK(cudaMemcpy(&errs, errors, 4, cudaMemcpyDeviceToHost));
    std::printf(errs ? " RING ERRORS: %u\n" : "\n", errs);
    CK(cudaFree(errors));
    CK(cudaFree(k));
    CK(cudaFree(v));
    CK(cudaFree(sink));
    CK(cudaFree(table));
  }
  return 0;
}
