// Standalone check and benchmark of the CUDA decode kernels, versions 1 and 2
// (cuda/decode/; no JAX), so that a wrong element can be found without XLA.
//
// Check: for each case, fresh random q and caches (contiguous, or paged with
// a shuffled page table whose entries past a row's length are out of range),
// ragged lengths 1..capacity, outputs and split workspace poisoned with NaN;
// decode_fwd called for each version; o and lse compared with a float64 CPU
// reference (max abs error; rows that see no key must give 0 and -inf).
// Bench: the issue's rows (paged, page size 64, N=32 over K=8, H=128, bf16,
// Tq=1, every row full): GB/s of K, V, Q, O and the fraction of the read
// bandwidth measured by a plain streaming-sum kernel, timed with CUDA events.
//
// Kernels checked: v1, v2 with the session-3 loader ("v2old", kV2Old), v2
// with the default variant ("v2new", kDecodeV2DefaultVariant: what
// decode_fwd(version 2) runs), v2 with every loader bit ("v2all"), and the
// short-context variants of issue 9: "v2short" (kV2Short: the >= 0.9-wave
// plan, cluster merge of 2 chunks), "v2shnc" (the same plan, combine kernel)
// and "v2shlong" (kV2ShortLong: kV2Short with chunks beyond kMaxChunk).
// The bench times, per issue-9 row, the default next to kV2Short, kV2Short
// with long chunks, the default with kV2Refill and the session-5 loader
// (shuffled pages), the default through the identity page table, and the
// default and kV2Short as a contiguous cache; optionally (--sweep) forced
// split counts on the short rows; it ends with the short table of the issue-9
// bar (paged, % of read bandwidth, default vs the session-5 loader).
//
// Usage: decode_check [--quick] [--no-bench] [--no-check] [--bench-only]
//   --quick: a few small cases, no benchmark (for compute-sanitizer).
//   --fast: check only the default ("v2new"), kV2Short, kV2ShortLong,
//           kV2Short with PDL / with the lean loader alone, the default
//           without the drift and register loops ("v2cpas"), the drift loop with
//           kV2SwapAB ("v2swap"), the default without the register loop ("v2drift") and
//           with it on any device ("v2regs"), and the latter with its L2 warm-up
//           before the wait (kV2WarmShift, 2 groups a warp: "v2warm").
//   --sweep: also time forced split counts on the short rows.
//   --row B L: bench that issue-9 row only, no check (for a profiler).
//   --timeline B L: a build with -DJAXATTN_DECODE_TIMELINE only: per variant of
//           that row, event-timed GB/s and the kernel's own per-CTA phase stamps
//           over 40 back-to-back calls (note: the stamps change the kernel's
//           code generation; session 16 found that build 8-10% faster on paged
//           caches than the plain one).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check_util.h"
#include "common/params.h"
#include "decode/launch_decode.h"

using jaxattn::AttnParams;
using jaxattn::DType;
namespace jc = jaxattn::cuda;

struct DecodeCase {
  int B, Tq, N, K, H, capacity;
  int page_size;  // 0: contiguous
  bool bf16;
  int window = -1;
  float softcap = 0.f;
  int chunk = 0;  // forced keys per split (0: the launcher's plan)
};

static std::string describe(const DecodeCase& c) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "B%d Tq%d N%d K%d H%d cap%d %s %s%s%s%s", c.B, c.Tq, c.N, c.K, c.H, c.capacity,
                c.page_size ? ("page" + std::to_string(c.page_size)).c_str() : "contig", c.bf16 ? "bf16" : "fp16",
                c.window >= 0 ? (" win" + std::to_string(c.window)).c_str() : "",
                c.softcap > 0 ? " softcap" : "", c.chunk ? (" chunk" + std::to_string(c.chunk)).c_str() : "");
  return buf;
}

template <typename T>
static T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Device buffers of one call and the AttnParams that describe them.
struct Call {
  AttnParams p;
  uint16_t *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float *lse = nullptr, *split_o = nullptr, *split_lse = nullptr;
  int32_t *lengths = nullptr, *table = nullptr;
  size_t o_count = 0, lse_count = 0, so_count = 0, sl_count = 0;

  void poison() {
    CUDA_CHECK(cudaMemset(o, 0xFF, o_count * 2));
    CUDA_CHECK(cudaMemset(lse, 0xFF, lse_count * 4));
    CUDA_CHECK(cudaMemset(split_o, 0xFF, so_count * 4));
    CUDA_CHECK(cudaMemset(split_lse, 0xFF, sl_count * 4));
  }
  void free_all() {
    for (void* x : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)lse, (void*)split_o, (void*)split_lse,
                    (void*)lengths, (void*)table})
      cudaFree(x);
  }
};

// Fills p as bindings/decode_params.h does for these shapes; allocates o, lse and the workspace.
static Call make_call(const DecodeCase& c, int cache_rows, int max_pages, int num_pages) {
  Call call;
  AttnParams& p = call.p;
  p.batch = c.B, p.seqlen_q = c.Tq, p.num_heads = c.N, p.num_heads_k = c.K, p.head_dim = c.H;
  p.dtype = c.bf16 ? DType::kBF16 : DType::kF16;
  if (c.page_size) {
    p.page_size = c.page_size, p.max_pages = max_pages, p.num_pages = num_pages;
    p.seqlen_k = max_pages * c.page_size;
  } else {
    p.seqlen_k = c.capacity;
  }
  jaxattn::set_contiguous_strides(p);
  p.k_batch_stride = p.v_batch_stride = int64_t(cache_rows) * p.k_row_stride;
  p.scale = 1.f / std::sqrt(float(c.H));
  p.is_causal = true;
  p.window_left = c.window;
  p.window_right = -1;
  p.softcap = c.softcap;
  const int rows = c.Tq * (c.N / c.K);
  const int splits = jc::decode_max_splits(p.seqlen_k, c.chunk);
  call.o_count = size_t(c.B) * c.Tq * c.N * c.H;
  call.lse_count = size_t(c.B) * c.Tq * c.N;
  call.sl_count = size_t(c.B) * c.K * splits * rows;
  call.so_count = call.sl_count * c.H;
  CUDA_CHECK(cudaMalloc(&call.o, call.o_count * 2));
  CUDA_CHECK(cudaMalloc(&call.lse, call.lse_count * 4));
  CUDA_CHECK(cudaMalloc(&call.split_o, call.so_count * 4));
  CUDA_CHECK(cudaMalloc(&call.split_lse, call.sl_count * 4));
  p.num_splits = splits;
  p.split_o = call.split_o;
  p.split_lse = call.split_lse;
  p.o = call.o;
  p.lse = call.lse;
  return call;
}

// Kernel ids of this checker: 1 = v1, 2 = v2 old loader, 3 = v2 new loader,
// 4 = v2 as decode_fwd(version 2) runs it (the default variant), 5 = v2 with
// every loader bit (hoist, touch, 8 tiles of L2 prefetch), 6 = kV2Short,
// 7 = kV2Short without the cluster merge, 8 = kV2ShortLong, 9 = kV2Short with
// programmatic dependent launch (kV2Pdl), 10 = kV2Short with the lean loader
// (kV2Lean), 11 = the default without the drift loop (the cp.async loop at H=128),
// 12 = the drift loop with kV2SwapAB (A and B swapped), 13 = the default without
// kV2Regs (the drift loop where the register loop would run), 14 = the default with
// kV2RegsAnywhere (the register loop on any device; the default takes it only where the
// peak DRAM bandwidth is >= kRegsMinPeakGBs), 15 = 14 with 2 groups a warp prefetched
// into L2 before the wait for the previous grid (kV2WarmShift).
// The default (kV2Default) is kV2Short | kV2Lean | kV2Pdl | kV2Drift | kV2Regs, with 1 group
// a warp of warm-up (1 << kV2WarmShift).
constexpr int kShortNoCluster = jc::kV2Short & ~jc::kV2Cluster;
constexpr int kNoWarm = jc::kDecodeV2DefaultVariant & ~(3 << jc::kV2WarmShift);
constexpr int kRegsWarm2 = kNoWarm | jc::kV2RegsAnywhere | (2 << jc::kV2WarmShift);
static const char* kernel_name(int kernel) {
  switch (kernel) {
    case 1: return "v1";
    case 2: return "v2old";
    case 3: return "v2new";
    case 5: return "v2all";
    case 6: return "v2short";
    case 7: return "v2shnc";
    case 8: return "v2shlong";
    case 9: return "v2pdl";
    case 10: return "v2lean";
    case 11: return "v2cpas";
    case 12: return "v2swap";
    case 13: return "v2drift";
    case 14: return "v2regs";
    case 15: return "v2warm";
    default: return "v2";
  }
}

static jaxattn::cuda::LaunchStatus run_kernel(const AttnParams& p, int kernel, int chunk, int variant = -1) {
  if (variant >= 0) return jc::decode_fwd_v2(p, nullptr, chunk, variant);
  switch (kernel) {
    case 1: return jc::decode_fwd(p, nullptr, 1, chunk);
    case 2: return jc::decode_fwd_v2(p, nullptr, chunk, jc::kV2Old);
    case 3: return jc::decode_fwd_v2(p, nullptr, chunk, jc::kDecodeV2DefaultVariant);
    case 5: return jc::decode_fwd_v2(p, nullptr, chunk, jc::kV2Hoist | jc::kV2Touch | (8 << jc::kV2PrefetchShift));
    case 6: return jc::decode_fwd_v2(p, nullptr, chunk, jc::kV2Short);
    case 7: return jc::decode_fwd_v2(p, nullptr, chunk, kShortNoCluster);
    case 8: return jc::decode_fwd_v2(p, nullptr, chunk, jc::kV2ShortLong);
    case 9: return jc::decode_fwd_v2(p, nullptr, chunk, jc::kV2Short | jc::kV2Pdl);
    case 10: return jc::decode_fwd_v2(p, nullptr, chunk, jc::kV2Short | jc::kV2Lean);
    case 11: return jc::decode_fwd_v2(p, nullptr, chunk, jc::kDecodeV2DefaultVariant & ~(jc::kV2Drift | jc::kV2Regs));
    case 12: return jc::decode_fwd_v2(p, nullptr, chunk, (jc::kDecodeV2DefaultVariant & ~jc::kV2Regs) | jc::kV2SwapAB);
    case 13: return jc::decode_fwd_v2(p, nullptr, chunk, jc::kDecodeV2DefaultVariant & ~jc::kV2Regs);
    case 14: return jc::decode_fwd_v2(p, nullptr, chunk, jc::kDecodeV2DefaultVariant | jc::kV2RegsAnywhere);
    case 15: return jc::decode_fwd_v2(p, nullptr, chunk, kRegsWarm2);
    default: return jc::decode_fwd(p, nullptr, 2, chunk);
  }
}

// Max abs error of o against the float64 reference; -1 when a row's
// emptiness (lse -inf, o 0) or a NaN disagrees.
static double check_case(const DecodeCase& c, int kernel, uint64_t seed, double* lse_err) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int G = c.N / c.K, H = c.H, ps = c.page_size;
  const int max_pages = ps ? c.capacity / ps : 0;
  const int num_pages = ps ? c.B * max_pages + 3 : 0;
  const int cache_rows = ps ? ps : c.capacity;           // rows per page / per batch row
  const int cache_count = ps ? num_pages : c.B;           // pages / batch rows
  std::vector<int32_t> len(c.B);
  for (int b = 0; b < c.B; ++b) len[b] = 1 + int(rng() % c.capacity);
  len[0] = c.capacity;
  if (c.B > 1) len[1] = 1;
  if (c.B > 2) len[2] = std::min(c.capacity, c.Tq + 1);
  std::vector<int32_t> table;
  if (ps) {
    std::vector<int32_t> perm(num_pages);
    for (int i = 0; i < num_pages; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    table.assign(size_t(c.B) * max_pages, 0);
    for (int b = 0; b < c.B; ++b) {
      const int used = (len[b] + ps - 1) / ps;
      for (int t = 0; t < max_pages; ++t) table[b * max_pages + t] = t < used ? perm[b * max_pages + t] : 1000000;
    }
  }
  auto fill = [&](size_t n, std::vector<uint16_t>& bits, std::vector<float>& val) {
    bits.resize(n);
    val.resize(n);
    for (size_t i = 0; i < n; ++i) {
      bits[i] = to_bits(nd(rng), c.bf16);
      val[i] = from_bits(bits[i], c.bf16);
    }
  };
  std::vector<uint16_t> qb, kb, vb;
  std::vector<float> qv, kv, vv;
  fill(size_t(c.B) * c.Tq * c.N * H, qb, qv);
  fill(size_t(cache_count) * cache_rows * c.K * H, kb, kv);
  fill(size_t(cache_count) * cache_rows * c.K * H, vb, vv);

  Call call = make_call(c, cache_rows, max_pages, num_pages);
  call.q = upload(qb), call.k = upload(kb), call.v = upload(vb), call.lengths = upload(len);
  call.p.q = call.q, call.p.k = call.k, call.p.v = call.v, call.p.kv_lengths = call.lengths;
  if (ps) {
    call.table = upload(table);
    call.p.block_table = call.table;
  }
  call.poison();
  check_launch(run_kernel(call.p, kernel, c.chunk));
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> ob(call.o_count);
  std::vector<float> lse(call.lse_count);
  CUDA_CHECK(cudaMemcpy(ob.data(), call.o, ob.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(lse.data(), call.lse, lse.size() * 4, cudaMemcpyDeviceToHost));
  call.free_all();

  // Float64 reference, row by row.
  const double scale = 1.0 / std::sqrt(double(H));
  double err = 0.0;
  *lse_err = 0.0;
  std::vector<double> s(c.capacity), acc(H);
  for (int b = 0; b < c.B; ++b) {
    for (int i = 0; i < c.Tq; ++i) {
      const int pos = len[b] - c.Tq + i;
      for (int n = 0; n < c.N; ++n) {
        const int kh = n / G;
        double m = -INFINITY;
        for (int j = 0; j < len[b]; ++j) {
          s[j] = -INFINITY;
          if (j > pos || (c.window >= 0 && j < pos - c.window)) continue;
          const size_t row = ps ? size_t(table[b * max_pages + j / ps]) * ps + j % ps : size_t(b) * c.capacity + j;
          double d = 0.0;
          for (int h = 0; h < H; ++h)
            d += double(qv[((size_t(b) * c.Tq + i) * c.N + n) * H + h]) * kv[(row * c.K + kh) * H + h];
          d *= scale;
          if (c.softcap > 0) d = c.softcap * std::tanh(d / c.softcap);
          s[j] = d;
          m = std::max(m, d);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double l = 0.0;
        for (int j = 0; j < len[b] && m != -INFINITY; ++j) {
          if (s[j] == -INFINITY) continue;
          const double w = std::exp(s[j] - m);
          l += w;
          const size_t row = ps ? size_t(table[b * max_pages + j / ps]) * ps + j % ps : size_t(b) * c.capacity + j;
          for (int h = 0; h < H; ++h) acc[h] += w * vv[(row * c.K + kh) * H + h];
        }
        const size_t at = (size_t(b) * c.Tq + i) * c.N + n;
        const bool empty = !(l > 0);
        if (empty != std::isinf(lse[at]) || std::isnan(lse[at])) return -1.0;
        if (!empty) *lse_err = std::max(*lse_err, std::abs(double(lse[at]) - (m + std::log(l))));
        for (int h = 0; h < H; ++h) {
          const double got = from_bits(ob[at * H + h], c.bf16);
          if (std::isnan(got)) return -1.0;
          err = std::max(err, std::abs(got - (empty ? 0.0 : acc[h] / l)));
        }
      }
    }
  }
  return err;
}

// A streaming read of `bytes` (the chip's read bandwidth; what the bar is a fraction of).
__global__ void read_sum(const uint4* p, size_t n, unsigned* out) {
  unsigned x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 u = __ldg(p + i);
    x ^= u.x ^ u.y ^ u.z ^ u.w;
  }
  if (x == 0x12345678u) *out = x;  // keeps the loads
}

static double read_bandwidth() {
  const size_t bytes = size_t(4) << 30;
  uint4* buf = nullptr;
  unsigned* out = nullptr;
  CUDA_CHECK(cudaMalloc(&buf, bytes));
  CUDA_CHECK(cudaMalloc(&out, 4));
  CUDA_CHECK(cudaMemset(buf, 1, bytes));
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int r = 0; r < 5; ++r) {
    CUDA_CHECK(cudaEventRecord(e0));
    read_sum<<<sms * 4, 512>>>(buf, bytes / 16, out);
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (r > 0) best = std::min(best, ms);
  }
  cudaFree(buf);
  cudaFree(out);
  return bytes / (best * 1e-3);
}

// Timing of one kernel on one call: 3 warm-up calls, which also size the
// repetitions of a sample (~40 ms of back-to-back calls, 10..200); sample()
// times one such batch with CUDA events. Callers take samples of several
// kernels round robin, so clock / thermal drift lands on all of them alike
// (timed one after the other, the same variant read up to 11 points of
// bandwidth apart in one run, session 6).
struct CallTimer {
  const AttnParams* p;
  int kernel, variant, chunk, reps;
  std::vector<double> gbs;

  CallTimer(const AttnParams& params, int kern, int var, int ch = 0) : p(&params), kernel(kern), variant(var), chunk(ch) {
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    CUDA_CHECK(cudaEventRecord(e0));
    for (int w = 0; w < 3; ++w) check_launch(run_kernel(*p, kernel, chunk, variant));
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    reps = std::min(200, std::max(10, int(40.f / std::max(ms / 3, 1e-3f))));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
  void sample(double bytes) {
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    CUDA_CHECK(cudaEventRecord(e0));
    for (int r = 0; r < reps; ++r) check_launch(run_kernel(*p, kernel, chunk, variant));
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    gbs.push_back(bytes / (ms * 1e-3 / reps) / 1e9);
  }
  double median() {
    std::sort(gbs.begin(), gbs.end());
    return gbs[gbs.size() / 2];
  }
};

// GB/s of each timer's call: `rounds` samples of every timer, round robin.
static void time_round_robin(std::vector<CallTimer>& timers, double bytes, int rounds = 5) {
  for (int r = 0; r < rounds; ++r)
    for (CallTimer& t : timers) t.sample(bytes);
}

// The issue's rows (paged, page size 64, N=32 K=8 H=128 bf16 Tq=1, every row
// full). One K and one V buffer per (B, L) hold B * L / 64 pages, read
// through a shuffled page table (the bar), for one column through the
// identity table, and for two columns as a contiguous cache [B, L, K, H]
// (the same bytes, no page table).
static bool g_sweep = false;  // --sweep: forced split counts on the short rows
constexpr int kBenchN = 32, kBenchK = 8, kBenchH = 128, kBenchPage = 64;

// One issue-9 row's buffers: the paged call (shuffled table), the same pages
// through the identity table (pid), and as a contiguous cache (pc).
struct BenchRow {
  Call call;
  int32_t* identity = nullptr;
  AttnParams pid, pc;
  double bytes;  // K, V, Q and O
  BenchRow(int B, int L) {
    const int N = kBenchN, K = kBenchK, H = kBenchH, ps = kBenchPage;
    DecodeCase c{B, 1, N, K, H, L, ps, true};
    const int max_pages = L / ps, num_pages = B * max_pages;
    call = make_call(c, ps, max_pages, num_pages);
    const size_t cache = size_t(num_pages) * ps * K * H;
    CUDA_CHECK(cudaMalloc(&call.q, size_t(B) * N * H * 2));
    CUDA_CHECK(cudaMalloc(&call.k, cache * 2));
    CUDA_CHECK(cudaMalloc(&call.v, cache * 2));
    fill_random<<<1024, 256>>>(call.q, size_t(B) * N * H, 1u, true);
    fill_random<<<4096, 256>>>(call.k, cache, 2u, true);
    fill_random<<<4096, 256>>>(call.v, cache, 3u, true);
    std::vector<int32_t> perm(num_pages), len(B, L);
    for (int i = 0; i < num_pages; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(B * 7 + L));
    call.table = upload(perm);
    call.lengths = upload(len);
    AttnParams& p = call.p;
    p.q = call.q, p.k = call.k, p.v = call.v, p.block_table = call.table, p.kv_lengths = call.lengths;
    for (int i = 0; i < num_pages; ++i) perm[i] = i;
    identity = upload(perm);
    pid = p;  // the paged path over pages in order
    pid.block_table = identity;
    pc = p;  // contiguous [B, L, K, H]: row b = pages b * max_pages ...
    pc.block_table = nullptr;
    pc.page_size = pc.max_pages = pc.num_pages = 0;
    pc.k_batch_stride = pc.v_batch_stride = int64_t(L) * p.k_row_stride;
    bytes = (2.0 * B * L * K * H + 2.0 * B * N * H) * 2;
  }
  ~BenchRow() {
    call.free_all();
    cudaFree(identity);
  }
  BenchRow(const BenchRow&) = delete;
  BenchRow& operator=(const BenchRow&) = delete;
};
static int g_only_B = 0, g_only_L = 0;  // --row B L: bench that row only (profiling)

static void bench(double peak) {
  const int def = jc::kDecodeV2DefaultVariant;
  // layout: 0 paged, shuffled pages; 1 contiguous (the same buffer, row b's pages in
  // order); 2 paged with the identity table (the contiguous layout read through the
  // paged code path).
  struct Col { const char* name; int variant; int layout; };
  const Col cols[] = {{"default", def, 0},
                      {"default, cp.async loop", def & ~(jc::kV2Drift | jc::kV2Regs), 0},
                      {"short + long chunks", jc::kV2ShortLong, 0},
                      {"short", jc::kV2Short, 0},
                      {"default identity", def, 2},
                      {"default + refill", def | jc::kV2Refill, 0},
                      {"drift + swap-AB", (def & ~jc::kV2Regs) | jc::kV2SwapAB, 0},
                      {"drift loop", def & ~jc::kV2Regs, 0},
                      {"drift loop contig", def & ~jc::kV2Regs, 1},
                      {"register loop", def | jc::kV2RegsAnywhere, 0},
                      {"register loop, warm 2", kRegsWarm2, 0},
                      {"default contig", def, 1},
                      {"short contig", jc::kV2Short, 1},
                      {"hoist (session-5 default)", jc::kV2Hoist, 0}};
  constexpr int kCols = sizeof(cols) / sizeof(cols[0]);
  struct Row { int B, L; double g[kCols]; };
  std::vector<Row> rows;
  auto pct = [&](double gbs) { return 100 * gbs * 1e9 / peak; };
  auto plan_str = [&](const AttnParams& p, int variant, int chunk) {
    bool cl = false;
    const int s = jc::decode_v2_plan_splits(p, chunk, variant, &cl);
    return std::to_string(s) + (cl ? "c" : "");
  };
  std::printf("\nGB/s (%% of read bandwidth), paged (shuffled) unless 'contig'. default: kDecodeV2DefaultVariant "
              "(%d); short: kV2Short (%d); 'nc': no cluster merge. [splits, c = cluster merge]\n", def, jc::kV2Short);
  std::printf("\n| B | L |");
  for (const Col& c : cols) std::printf(" %s |", c.name);
  std::printf(" default / hoist |\n|---|---|");
  for (int i = 0; i <= kCols; ++i) std::printf("---|");
  std::printf("\n");
  std::vector<std::string> sweep;
  for (int B : {16, 32, 64}) {
    for (int L : {4096, 16384, 65536}) {
      if (g_only_B && (B != g_only_B || L != g_only_L)) continue;
      BenchRow br(B, L);
      const AttnParams &p = br.call.p, &pid = br.pid, &pc = br.pc;
      const double bytes = br.bytes;
      Row r{B, L, {}};
      std::vector<CallTimer> timers;
      for (int i = 0; i < kCols; ++i)
        timers.emplace_back(cols[i].layout == 1 ? pc : cols[i].layout == 2 ? pid : p, 0, cols[i].variant);
      time_round_robin(timers, bytes);
      std::printf("| %d | %d |", B, L);
      for (int i = 0; i < kCols; ++i) {
        r.g[i] = timers[i].median();
        std::printf(" %.0f (%.0f%%) [%s] |", r.g[i], pct(r.g[i]), plan_str(*timers[i].p, cols[i].variant, 0).c_str());
      }
      std::printf(" %.2fx |\n", r.g[0] / r.g[kCols - 1]);
      rows.push_back(r);
      if (g_sweep && L <= 16384 && !(B == 64 && L == 16384)) {
        // Split-count sweep (forced chunks of L / s keys): combine kernel, and kV2Short (cluster merge at 2 splits).
        for (int s : {1, 2, 3, 4, 6, 8}) {
          const int chunk = (L / s + 63) / 64 * 64;
          std::vector<CallTimer> pair;
          pair.emplace_back(p, 0, kShortNoCluster, chunk);
          if (s > 1) pair.emplace_back(p, 0, jc::kV2Short, chunk);
          time_round_robin(pair, bytes);
          const double a = pair[0].median();
          const double b = s > 1 ? pair[1].median() : a;
          char buf[200];
          std::snprintf(buf, sizeof buf, "| %d | %d | %d | %d | %.0f (%.0f%%) | %.0f (%.0f%%) |", B, L, s,
                        (B * kBenchK * s + 263) / 264, a, pct(a), b, pct(b));
          sweep.push_back(buf);
        }
      }
    }
  }
  if (g_sweep) {
    std::printf("\n== split sweep (forced chunks, paged): combine kernel vs kV2Short (cluster merge at 2 splits)\n");
    std::printf("| B | L | splits | waves (264 slots) | combine | cluster |\n|---|---|---|---|---|---|\n");
    for (const std::string& l : sweep) std::printf("%s\n", l.c_str());
  }
  std::printf("\n== issue-9 bar: paged (page 64, shuffled), %% of read bandwidth %.0f GB/s; bar 85%%\n", peak / 1e9);
  std::printf("| B | L | default | hoist (session-5 default) | default / hoist | default contig |\n"
              "|---|---|---|---|---|---|\n");
  int contig = 0;  // the "default contig" column
  while (contig < kCols - 1 && std::strcmp(cols[contig].name, "default contig") != 0) ++contig;
  for (const Row& r : rows)
    std::printf("| %d | %d | %.0f%% | %.0f%% | %.2fx | %.0f%% |\n", r.B, r.L, pct(r.g[0]), pct(r.g[kCols - 1]),
                r.g[0] / r.g[kCols - 1], pct(r.g[contig]));
}

#ifdef JAXATTN_DECODE_TIMELINE
// --timeline B L (profiling build, -DJAXATTN_DECODE_TIMELINE): per variant of
// that row, GB/s of back-to-back calls (CUDA events, round robin), then the
// phases of kCalls back-to-back calls from the kernel's own global-timer
// stamps (decode_mma_kernel.cuh): medians over the calls after the first 10
// of the per-call launch spread, the prologue (page ids, Q), the first tile's
// wait, the loop, the epilogue (merge, stores), the span of a call (first CTA
// start to last CTA end), the gap to the next call's first CTA, and the CTAs'
// end times as percentiles of the span; last, the number of CTAs in their
// loop per 4 us of one call.
static void timeline(double peak, int B, int L) {
  constexpr int kCalls = 40, kSkip = 10, M = jaxattn::cuda::decode::kTimelineMarksHost;
  BenchRow br(B, L);
  const int def = jc::kDecodeV2DefaultVariant;
  // layout: 0 paged (shuffled pages), 1 contiguous, 2 paged through the identity table.
  struct Cfg { const char* name; int variant; int layout; };
  // (The register loop, the default at H=128 since session 45, stamps no first tile: its
  // "first tile" column is 0 and its loop includes the first loads' wait.)
  const Cfg cfgs[] = {{"paged", def, 0},
                      {"paged, no warm-up", kNoWarm | jc::kV2RegsAnywhere, 0},
                      {"paged, warm 2", kRegsWarm2, 0},
                      {"paged, drift loop", def & ~jc::kV2Regs, 0},
                      {"paged, cp.async loop", def & ~(jc::kV2Drift | jc::kV2Regs), 0},
                      {"paged, no pdl", def & ~jc::kV2Pdl, 0},
                      {"contig", def, 1},
                      {"contig, drift loop", def & ~jc::kV2Regs, 1}};
  auto params_of = [&](const Cfg& c) -> const AttnParams& {
    return c.layout == 1 ? br.pc : c.layout == 2 ? br.pid : br.call.p;
  };
  std::vector<CallTimer> timers;
  for (const Cfg& c : cfgs) timers.emplace_back(params_of(c), 0, c.variant);
  time_round_robin(timers, br.bytes);
  std::printf("\n== timeline B=%d L=%d (paged page %d / contiguous), N=%d K=%d H=%d; read bandwidth %.0f GB/s; "
              "us, medians over calls %d..%d\n", B, L, kBenchPage, kBenchN, kBenchK, kBenchH, peak / 1e9, kSkip,
              kCalls - 2);
  std::printf("| variant | GB/s (%%) | splits | CTAs | launch spread | prologue | first tile | loop (min / med / max) "
              "| epilogue (warps' merge + the rest) | span | gap to next | period | CTA ends at %% of span (p10 / p50 / p90) |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> profiles;
  for (size_t ci = 0; ci < timers.size(); ++ci) {
    const Cfg& cfg = cfgs[ci];
    const AttnParams& p = params_of(cfg);
    bool cl = false;
    const int splits = jc::decode_v2_plan_splits(p, 0, cfg.variant, &cl);
    const int ctas = splits * B * kBenchK;  // one row block (Tq * G = 4 rows)
    unsigned long long* buf = nullptr;
    unsigned* calls = nullptr;
    const size_t n = size_t(kCalls) * ctas * M;
    CUDA_CHECK(cudaMalloc(&buf, n * 8));
    CUDA_CHECK(cudaMalloc(&calls, ctas * 4));
    CUDA_CHECK(cudaMemset(buf, 0, n * 8));
    CUDA_CHECK(cudaMemset(calls, 0, ctas * 4));
    CUDA_CHECK(jc::decode_timeline_set(buf, calls, kCalls, ctas));
    for (int c = 0; c < kCalls; ++c) check_launch(run_kernel(p, 0, 0, cfg.variant));
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(jc::decode_timeline_set(nullptr, nullptr, 0, 0));
    std::vector<unsigned long long> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), buf, n * 8, cudaMemcpyDeviceToHost));
    cudaFree(buf);
    cudaFree(calls);
    auto at = [&](int c, int cta, int m) { return double(h[(size_t(c) * ctas + cta) * M + m]) * 1e-3; };  // us
    auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    auto pctl = [](std::vector<double> v, double q) { std::sort(v.begin(), v.end()); return v[size_t(q * (v.size() - 1))]; };
    std::vector<double> spread, pro, first, lmin, lmed, lmax, epi, emerge, span, gap, period, e10, e50, e90;
    for (int c = kSkip; c < kCalls - 1; ++c) {
      double s0 = 1e300, s1 = -1e300, end = -1e300, next0 = 1e300;
      std::vector<double> vp, vf, vl, ve, vm, ends;
      for (int k = 0; k < ctas; ++k) {
        s0 = std::min(s0, at(c, k, 0));
        s1 = std::max(s1, at(c, k, 0));
        end = std::max(end, at(c, k, 5));
        next0 = std::min(next0, at(c + 1, k, 0));
        vp.push_back(at(c, k, 1) - at(c, k, 0));
        vf.push_back(at(c, k, 2) - at(c, k, 1));
        vl.push_back(at(c, k, 4) - at(c, k, 2));
        ve.push_back(at(c, k, 5) - at(c, k, 4));
        vm.push_back(at(c, k, 7) - at(c, k, 4));  // mark 7: the warps' merge done
      }
      for (int k = 0; k < ctas; ++k) ends.push_back(100 * (at(c, k, 5) - s0) / (end - s0));
      spread.push_back(s1 - s0), pro.push_back(med(vp)), first.push_back(med(vf));
      lmin.push_back(pctl(vl, 0)), lmed.push_back(med(vl)), lmax.push_back(pctl(vl, 1)), epi.push_back(med(ve)), emerge.push_back(med(vm));
      span.push_back(end - s0), gap.push_back(next0 - end), period.push_back(next0 - s0);
      e10.push_back(pctl(ends, 0.1)), e50.push_back(pctl(ends, 0.5)), e90.push_back(pctl(ends, 0.9));
      if (c == kCalls / 2) {
        std::string line = std::string(cfg.name) + ": CTAs in their loop per 4 us:";
        for (double t = s0; t < end; t += 4) {
          int active = 0;
          for (int k = 0; k < ctas; ++k) active += at(c, k, 2) <= t + 2 && t + 2 < at(c, k, 4);
          line += " " + std::to_string(active);
        }
        profiles.push_back(line);
        // Which SMs ran the fastest and slowest loops (equal work per CTA in these
        // rows), and the mean loop time by how many of this call's CTAs shared the
        // SM's TPC (SM ids 2i, 2i + 1): is the spread placement?
        std::vector<std::pair<double, int>> by_loop;
        std::vector<int> per_tpc(256, 0);
        for (int k = 0; k < ctas; ++k) {
          const int sm = int(std::lround(at(c, k, 6) * 1e3));
          by_loop.push_back({at(c, k, 4) - at(c, k, 2), sm});
          ++per_tpc[std::min(sm / 2, 255)];
        }
        std::sort(by_loop.begin(), by_loop.end());
        std::string ext = std::string(cfg.name) + ": loop us @ SM, fastest:";
        for (size_t i = 0; i < std::min<size_t>(8, by_loop.size()); ++i)
          ext += " " + std::to_string(int(by_loop[i].first)) + "@" + std::to_string(by_loop[i].second);
        ext += "; slowest:";
        for (size_t i = by_loop.size() > 8 ? by_loop.size() - 8 : 0; i < by_loop.size(); ++i)
          ext += " " + std::to_string(int(by_loop[i].first)) + "@" + std::to_string(by_loop[i].second);
        double sum[3] = {0, 0, 0};
        int cnt[3] = {0, 0, 0};
        for (const auto& [loop_us, sm] : by_loop) {
          const int n = std::min(per_tpc[std::min(sm / 2, 255)], 2);
          sum[n] += loop_us, ++cnt[n];
        }
        char buf[160];
        std::snprintf(buf, sizeof buf, "; mean loop with 1 / 2+ CTAs on the TPC: %.1f (%d) / %.1f (%d)",
                      cnt[1] ? sum[1] / cnt[1] : 0.0, cnt[1], cnt[2] ? sum[2] / cnt[2] : 0.0, cnt[2]);
        profiles.push_back(ext + buf);
        // Is the spread between rows (all KV heads of a batch row slow together: placement
        // or bandwidth arbitration) or within rows (the heads of one row, which read
        // interleaved 256-byte pieces of the same key rows, drift apart)? CTA k is
        // (split, head, row) = (k % splits, k / splits % K, k / (splits * K)).
        std::vector<double> row_sum(B, 0), row_min(B, 1e300), row_max(B, -1e300), head_sum(kBenchK, 0);
        for (int k = 0; k < ctas; ++k) {
          const double v = at(c, k, 4) - at(c, k, 2);
          const int r = k / (splits * kBenchK), hd = k / splits % kBenchK;
          row_sum[r] += v, row_min[r] = std::min(row_min[r], v), row_max[r] = std::max(row_max[r], v);
          head_sum[hd] += v;
        }
        std::string rl = std::string(cfg.name) + ": loop us per row (mean [min-max]):";
        for (int r = 0; r < B && r < 16; ++r) {
          char b2[64];
          std::snprintf(b2, sizeof b2, " %.0f[%.0f-%.0f]", row_sum[r] / (ctas / B), row_min[r], row_max[r]);
          rl += b2;
        }
        rl += "; per head:";
        for (int hd = 0; hd < kBenchK; ++hd) {
          char b2[32];
          std::snprintf(b2, sizeof b2, " %.1f", head_sum[hd] / (ctas / kBenchK));
          rl += b2;
        }
        profiles.push_back(rl);
      }
    }
    const double g = timers[ci].median();
    std::printf("| %s | %.0f (%.0f%%) | %d%s | %d | %.1f | %.1f | %.1f | %.1f / %.1f / %.1f | %.1f (%.1f + %.1f) | %.1f | "
                "%.1f | %.1f | %.0f / %.0f / %.0f |\n", cfg.name, g, 100 * g * 1e9 / peak, splits, cl ? "c" : "", ctas,
                med(spread), med(pro), med(first), med(lmin), med(lmed), med(lmax), med(epi), med(emerge),
                med(epi) - med(emerge), med(span), med(gap), med(period),
                med(e10), med(e50), med(e90));
  }
  for (const std::string& l : profiles) std::printf("%s\n", l.c_str());
}
#endif

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines survive a timeout when piped
  bool quick = false, do_bench = true, do_check = true, fast = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true, do_bench = false;
    if (!std::strcmp(argv[i], "--no-bench")) do_bench = false;
    if (!std::strcmp(argv[i], "--no-check")) do_check = false;
    if (!std::strcmp(argv[i], "--bench-only")) do_check = false, do_bench = true;
    if (!std::strcmp(argv[i], "--fast")) fast = true;
    if (!std::strcmp(argv[i], "--sweep")) g_sweep = true;
#ifdef JAXATTN_DECODE_TIMELINE
    if (!std::strcmp(argv[i], "--timeline") && i + 2 < argc) {
      timeline(read_bandwidth(), std::atoi(argv[i + 1]), std::atoi(argv[i + 2]));
      return 0;
    }
#endif
    if (!std::strcmp(argv[i], "--row")) {
      if (i + 2 < argc) g_only_B = std::atoi(argv[i + 1]), g_only_L = std::atoi(argv[i + 2]);
      const bool known = (g_only_B == 16 || g_only_B == 32 || g_only_B == 64) &&
                         (g_only_L == 4096 || g_only_L == 16384 || g_only_L == 65536);
      if (!known) {
        std::fprintf(stderr, "--row B L: B in {16, 32, 64}, L in {4096, 16384, 65536}\n");
        return 2;
      }
      do_check = false;
      i += 2;
    }
  }
  std::vector<DecodeCase> cases;
  if (quick) {
    cases = {{3, 1, 32, 8, 128, 512, 64, true},
             {3, 4, 8, 1, 64, 256, 16, false, -1, 0.f, 80},
             {2, 1, 4, 4, 256, 300, 0, true},
             {3, 2, 16, 2, 128, 768, 256, false, 37, 5.f},
             {3, 1, 32, 8, 128, 1024, 64, true, -1, 0.f, 512}};
  } else {
    const int groups[][3] = {{4, 4, 1}, {8, 4, 1}, {32, 8, 1}, {8, 1, 1}, {8, 2, 4}, {8, 1, 4}, {16, 1, 4}};
    int i = 0;
    for (int ps : {0, 16, 64, 256}) {
      for (int H : {64, 128, 256}) {
        for (int chunk : {0, 80}) {
          const int* g = groups[i % 7];
          DecodeCase c{4, g[2], g[0], g[1], H, 3 * (ps ? ps : 96), ps, i % 2 == 0};
          c.chunk = chunk;
          if (i % 5 == 4) c.window = 37, c.softcap = 5.f;
          cases.push_back(c);
          ++i;
        }
      }
    }
    cases.push_back({2, 1, 32, 8, 128, 8192, 64, true});  // long rows: the auto plan splits
    cases.push_back({1, 16, 16, 2, 128, 4096, 0, false});  // 128 rows: 8 row blocks
    // The issue-9 loader: tiles straddling two pages (windows, forced chunks
    // off the page grid, page sizes that are not powers of two), pages
    // smaller than a tile (per-row fallback), several row blocks, long rows.
    cases.push_back({3, 1, 32, 8, 128, 640, 128, true, 200});
    cases.push_back({2, 4, 16, 2, 64, 384, 96, false});
    cases.push_back({3, 1, 8, 1, 256, 480, 48, true, -1, 5.f});
    cases.push_back({2, 1, 8, 2, 128, 448, 32, false, -1, 0.f, 80});
    cases.push_back({2, 4, 32, 4, 128, 2048, 64, true});
    cases.push_back({2, 1, 32, 8, 128, 16384, 128, true, 5000});
    cases.push_back({2, 1, 8, 8, 256, 4096, 256, false, -1, 0.f, 200});
    // Issue 9's short-context variants: cluster merges of 2..8 chunks (forced
    // chunks and the auto plan), two row blocks per cluster row, windows,
    // H 64 / 256, contiguous and paged, ragged rows with empty chunks.
    cases.push_back({5, 4, 32, 4, 128, 1024, 64, true, -1, 0.f, 256});
    cases.push_back({3, 2, 16, 2, 256, 1024, 64, false, -1, 5.f, 256});
    cases.push_back({3, 1, 8, 1, 64, 2000, 0, true, -1, 0.f, 512});
    cases.push_back({4, 1, 32, 8, 128, 4096, 64, true, 700, 0.f, 512});
    cases.push_back({6, 1, 32, 8, 128, 4096, 64, true});
    cases.push_back({3, 3, 16, 4, 64, 8192, 128, false});
    cases.push_back({2, 1, 16, 2, 128, 3000, 0, true, -1, 0.f, 384});
    // Chunks beyond kMaxChunk (kV2LongChunks; forced here): 2 splits merged in a cluster.
    cases.push_back({2, 1, 16, 4, 128, 20480, 64, true, -1, 0.f, 16384});
    cases.push_back({2, 2, 8, 8, 64, 24576, 0, false, -1, 0.f, 12288});
    cases.push_back({3, 1, 32, 8, 128, 32768, 256, true, 20000});
  }
  int failures = 0, checked = 0;
  if (do_check) {
    constexpr int kCheckKernels[] = {1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    std::printf("== check against float64 (max abs error of o, of lse)\n");
    uint64_t seed = 1;
    for (const DecodeCase& c : cases) {
      for (int kernel : kCheckKernels) {
        if (fast && (kernel == 1 || kernel == 2 || kernel == 5 || kernel == 7))
          continue;
        double lse_err = 0.0;
        const double err = check_case(c, kernel, seed, &lse_err);
        const double tol = c.bf16 ? 2e-2 : 4e-3;
        const bool ok = err >= 0 && err <= tol && lse_err <= 2e-2;
        failures += !ok;
        ++checked;
        std::printf("%-4s %-5s %-60s o %.2e lse %.2e%s\n", ok ? "ok" : "FAIL", kernel_name(kernel), describe(c).c_str(), err,
                    lse_err, err < 0 ? " (NaN / unwritten element or wrong empty row)" : "");
      }
      ++seed;
    }
    std::printf("%s: %d of %d case-versions failed\n", failures ? "SOME FAILED" : "ALL OK", failures, checked);
  }
  if (do_bench) {
    const double peak = read_bandwidth();
    std::printf("\n== bench: paged (page 64), N=32 K=8 H=128 bf16 Tq=1; read bandwidth %.0f GB/s (decode_fwd v2 "
                "default loader: %s)\n", peak / 1e9, jc::kDecodeV2DefaultVariant == jc::kV2Old ? "old" : "new");
    bench(peak);
  }
  return failures ? 1 : 0;
}
