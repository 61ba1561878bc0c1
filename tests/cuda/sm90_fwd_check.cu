// Standalone check and benchmark of the Hopper (sm_90a) forward (no JAX).
//
// Check: for each case, fresh random q, k, v; o (pad columns and a tail guard
// included) and lse poisoned with NaN; flash_fwd_sm90 (each main-loop variant)
// run and compared with a float64 CPU reference: max abs and relative Frobenius
// error of o, max abs error of lse, non-finite values, and whether anything
// outside o's / lse's valid elements was written.
// Bench: B*T = 16384, N*H = 2048, T in {1024, 4096, 16384}, H 64/128 (and 256),
// causal and not, bf16, each main-loop variant and the default: median of 20 timed
// calls (CUDA events) after warm-up, TFLOP/s = 4 B N T S H (halved when causal) / time.
//
// Usage: sm90_fwd_check [--quick] [--no-bench] [--no-check] [--log FILE]
//                       [--bench-one H T causal VARIANT] [--schedule-only]
//   --quick: a few small cases, no benchmark (for compute-sanitizer).
//   --bench-one: one benchmark row of one variant (its FwdVariant number; 8 = the
//     default), e.g. under a profiler; nothing else runs.
//   --schedule-only: only the host check of the persistent grid's causal tile order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/params.h"
#include "launch.h"
#include "sm90/fwd_dispatch.h"
#include "sm90/fwd_schedule.cuh"
#include "check_util.h"

using jaxattn::AttnParams;
using jaxattn::DType;
using jaxattn::sm90::FwdVariant;

static FILE* g_log = stdout;  // per-case lines
static int g_only_variant = -1;  // --bench-one: time only this variant

static constexpr int kNV = jaxattn::sm90::kNumFwdVariants;
static const char* variant_name(FwdVariant v) {
  switch (v) {
    case FwdVariant::kOverlap: return "overlap";
    case FwdVariant::kSerial: return "serial";
    case FwdVariant::kOverlapPingpong: return "ovl+pp";
    case FwdVariant::kSerialPingpong: return "ser+pp";
    case FwdVariant::kOverlap3: return "ovl 3wg";
    case FwdVariant::kPersistent: return "persist";
    case FwdVariant::kWideKeys: return "wide-n";
    case FwdVariant::kChained: return "chained";
    default: return "default";
  }
}


struct CaseResult {
  double o_max_abs = 0, o_frob = 0, lse_max_abs = 0;
  std::string where;  // location of the largest o error (or first non-finite value)
  long nonfinite = 0, clobbered = 0;
  bool ok = false;
};

static constexpr size_t kGuard = 4096;  // elements after o and lse that must stay poisoned

static CaseResult run_case(const Case& c, FwdVariant variant, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostTensor q = make_tensor(c.B, c.T, c.N, c.H, c.pad, c.bf16, rng);
  HostTensor k = make_tensor(c.B, c.S, c.K, c.H, c.pad, c.bf16, rng);
  HostTensor v = make_tensor(c.B, c.S, c.K, c.H, c.pad, c.bf16, rng);
  const size_t o_count = q.count(), lse_count = size_t(c.B) * c.T * c.N;

  uint16_t *dq, *dk, *dv, *dout;
  float* dlse;
  CUDA_CHECK(cudaMalloc(&dq, q.count() * 2));
  CUDA_CHECK(cudaMalloc(&dk, k.count() * 2));
  CUDA_CHECK(cudaMalloc(&dv, v.count() * 2));
  CUDA_CHECK(cudaMalloc(&dout, (o_count + kGuard) * 2));
  CUDA_CHECK(cudaMalloc(&dlse, (lse_count + kGuard) * 4));
  CUDA_CHECK(cudaMemcpy(dq, q.bits.data(), q.count() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dk, k.bits.data(), k.count() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dv, v.bits.data(), v.count() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(dout, 0xFF, (o_count + kGuard) * 2));    // NaN in bf16 and fp16
  CUDA_CHECK(cudaMemset(dlse, 0xFF, (lse_count + kGuard) * 4));  // NaN

  AttnParams p;
  p.batch = c.B;
  p.seqlen_q = c.T;
  p.seqlen_k = c.S;
  p.num_heads = c.N;
  p.num_heads_k = c.K;
  p.head_dim = c.H;
  p.dtype = c.bf16 ? DType::kBF16 : DType::kF16;
  p.scale = c.scale_mult / std::sqrt(float(c.H));
  p.is_causal = c.causal;
  p.q = dq;
  p.k = dk;
  p.v = dv;
  p.o = dout;
  p.lse = dlse;
  p.q_batch_stride = q.bs(), p.q_row_stride = q.rs(), p.q_head_stride = q.hs();
  p.o_batch_stride = q.bs(), p.o_row_stride = q.rs(), p.o_head_stride = q.hs();
  p.k_batch_stride = k.bs(), p.k_row_stride = k.rs(), p.k_head_stride = k.hs();
  p.v_batch_stride = v.bs(), p.v_row_stride = v.rs(), p.v_head_stride = v.hs();

  CaseResult r;
  if (!jaxattn::cuda::sm90_fwd_supports(p, 9, 0)) {
    std::fprintf(stderr, "not supported: %s\n", describe(c).c_str());
    std::exit(2);
  }
  jaxattn::cuda::LaunchStatus st = jaxattn::sm90::flash_fwd_sm90_variant(p, 0, variant);
  if (!st.ok()) {
    std::fprintf(stderr, "launch failed in %s: %s\n", st.kernel, cudaGetErrorString(st.error));
    std::exit(2);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> o(o_count + kGuard);
  std::vector<float> lse(lse_count + kGuard);
  CUDA_CHECK(cudaMemcpy(o.data(), dout, o.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(dq));
  CUDA_CHECK(cudaFree(dk));
  CUDA_CHECK(cudaFree(dv));
  CUDA_CHECK(cudaFree(dout));
  CUDA_CHECK(cudaFree(dlse));

  // Poison outside the valid elements must survive.
  for (size_t i = 0; i < o.size(); ++i) {
    const bool valid = i < o_count && int64_t(i % q.hs()) < c.H;
    if (!valid && o[i] != 0xFFFF) ++r.clobbered;
  }
  for (size_t i = lse_count; i < lse.size(); ++i) {
    uint32_t b;
    std::memcpy(&b, &lse[i], 4);
    if (b != 0xFFFFFFFFu) ++r.clobbered;
  }

  // float64 reference, one (b, n, t) row per iteration.
  const int group = c.N / c.K;
  const double scale = p.scale;
  double err2 = 0, ref2 = 0, max_abs = 0, lse_err = 0;
  long nonfinite = 0;
  double where_err = -1;
  std::string where;
#pragma omp parallel reduction(+ : err2, ref2, nonfinite) reduction(max : max_abs, lse_err)
  {
    std::vector<double> sc(c.S), acc(c.H);
    double my_err = -1;
    char my_where[160] = "";
#pragma omp for collapse(3) schedule(dynamic, 16)
    for (int b = 0; b < c.B; ++b)
      for (int n = 0; n < c.N; ++n)
        for (int t = 0; t < c.T; ++t) {
          const int kh = n / group;
          const int nkeys = c.causal ? std::min(c.S, t + 1) : c.S;
          const float* qr = &q.val[q.idx(b, t, n, 0)];
          double mx = -INFINITY;
          for (int j = 0; j < nkeys; ++j) {
            const float* kr = &k.val[k.idx(b, j, kh, 0)];
            double d = 0;
            for (int h = 0; h < c.H; ++h) d += double(qr[h]) * double(kr[h]);
            sc[j] = d * scale;
            mx = std::max(mx, sc[j]);
          }
          std::fill(acc.begin(), acc.end(), 0.0);
          double sum = 0;
          for (int j = 0; j < nkeys; ++j) {
            const double e = std::exp(sc[j] - mx);
            sum += e;
            const float* vr = &v.val[v.idx(b, j, kh, 0)];
            for (int h = 0; h < c.H; ++h) acc[h] += e * double(vr[h]);
          }
          const double ref_lse = nkeys ? mx + std::log(sum) : -INFINITY;
          for (int h = 0; h < c.H; ++h) {
            const double ref = nkeys ? acc[h] / sum : 0.0;
            const double got = from_bits(o[q.idx(b, t, n, h)], c.bf16);
            const double e = std::isfinite(got) ? std::fabs(got - ref) : 1e30;
            if (e > my_err) {
              my_err = e;
              std::snprintf(my_where, sizeof my_where, "o[b%d t%d n%d h%d] got %.4g ref %.4g", b, t, n, h, got,
                            ref);
            }
            if (!std::isfinite(got)) {
              ++nonfinite;
              continue;
            }
            err2 += (got - ref) * (got - ref);
            ref2 += ref * ref;
            max_abs = std::max(max_abs, std::fabs(got - ref));
          }
          const double got_lse = lse[(size_t(b) * c.T + t) * c.N + n];
          if (std::isnan(got_lse) || (std::isinf(got_lse) && got_lse != ref_lse))
            ++nonfinite;
          else if (std::isfinite(ref_lse))
            lse_err = std::max(lse_err, std::fabs(got_lse - ref_lse));
        }
#pragma omp critical
    if (my_err > where_err) {
      where_err = my_err;
      where = my_where;
    }
  }
  r.where = where;
  r.o_max_abs = max_abs;
  r.o_frob = std::sqrt(err2 / std::max(ref2, 1e-30));
  r.lse_max_abs = lse_err;
  r.nonfinite = nonfinite;
  // bf16 rounds P and O to 8 bits of mantissa, fp16 to 11.
  const double frob_tol = c.bf16 ? 1.5e-2 : 3e-3, abs_tol = c.bf16 ? 6e-2 : 1e-2;
  r.ok = r.nonfinite == 0 && r.clobbered == 0 && r.o_frob < frob_tol && r.o_max_abs < abs_tol &&
         r.lse_max_abs < 2e-3 * std::max(1.f, c.scale_mult);
  return r;
}

// ---- cases ----------------------------------------------------------------------------------
static std::vector<Case> check_cases(bool quick) {
  std::vector<Case> cs;
  if (quick) {
    cs.push_back({1, 7, 129, 4, 1, 64, true, false});
    cs.push_back({2, 129, 7, 4, 4, 128, false, true});
    cs.push_back({1, 200, 300, 2, 2, 128, true, true, 1.f, 8});
    cs.push_back({1, 130, 257, 2, 1, 256, true, false});
    return cs;
  }
  const int sizes[] = {1, 7, 128, 129, 1000, 2049};
  int i = 0;
  for (int T : sizes)
    for (int S : sizes) {
      if (T == S) continue;
      // Per (T, S): both head dims x both masks, dtype and GQA alternating.
      for (int H : {64, 128})
        for (bool causal : {false, true}) {
          const bool bf16 = (i & 1) == 0;
          const bool gqa = (i & 2) != 0;
          ++i;
          cs.push_back({1, T, S, 4, gqa ? 1 : 4, H, bf16, causal});
        }
    }
  // Square, batched, strided, sharp softmax, other GQA ratios.
  for (bool causal : {false, true}) {
    cs.push_back({2, 1000, 1000, 4, 1, 128, true, causal});
    cs.push_back({2, 1000, 1000, 4, 4, 64, false, causal});
    cs.push_back({1, 2049, 2049, 2, 2, 128, false, causal});
    cs.push_back({2, 300, 513, 6, 2, 128, true, causal, 1.f, 8});
    cs.push_back({2, 513, 300, 6, 3, 64, false, causal, 1.f, 16});
    cs.push_back({1, 700, 900, 4, 2, 128, true, causal, 8.f});
    cs.push_back({1, 900, 700, 4, 2, 64, false, causal, 8.f});
    cs.push_back({1, 128, 128, 8, 8, 128, true, causal});
    // head dim 256
    cs.push_back({1, 129, 1000, 2, 1, 256, true, causal});
    cs.push_back({1, 1000, 129, 2, 2, 256, false, causal});
    cs.push_back({1, 7, 2049, 4, 1, 256, true, causal});
    // More tiles than an H200 has SMs (288 / 144): every persistent CTA runs several,
    // so the tile boundary (the next tile's Q and K / V order, the ring and the Q
    // phase carried across tiles, odd M for the causal pairs) is checked too.
    cs.push_back({4, 260, 260, 24, 6, 64, true, causal});
    cs.push_back({4, 260, 260, 24, 6, 128, false, causal});
    cs.push_back({2, 260, 260, 24, 6, 256, true, causal});
  }
  // Many heads (320: GQA 5) over 5 query tiles of head dim 256, causal: with the grouped
  // causal grid (sm90/causal_groups.h; the default column, where it is not persistent)
  // several groups of uneven size.
  cs.push_back({8, 520, 520, 40, 8, 256, true, true});
  // A long causal head dim 256 case on the default's grouped grid (one group), checked
  // in the default column only: T > 4096 (its float64 reference costs seconds a run).
  cs.push_back({1, 4500, 4500, 4, 2, 256, false, true});
  return cs;
}

// ---- benchmark --------------------------------------------------------------------------
struct BenchRow {
  int H, T;
  bool causal;
  double tflops[kNV + 1];  // explicit variants, then kDefault
};

static BenchRow bench(int T, int H, bool causal) {
  const int B = 16384 / T, N = 2048 / H, S = T;
  const size_t n = size_t(B) * T * N * H;
  uint16_t *q, *k, *v, *o;
  float* lse;
  CUDA_CHECK(cudaMalloc(&q, n * 2));
  CUDA_CHECK(cudaMalloc(&k, n * 2));
  CUDA_CHECK(cudaMalloc(&v, n * 2));
  CUDA_CHECK(cudaMalloc(&o, n * 2));
  CUDA_CHECK(cudaMalloc(&lse, size_t(B) * T * N * 4));
  fill_random<<<1024, 256>>>(q, n, 1, true);
  fill_random<<<1024, 256>>>(k, n, 2, true);
  fill_random<<<1024, 256>>>(v, n, 3, true);
  AttnParams p;
  p.batch = B, p.seqlen_q = T, p.seqlen_k = S, p.num_heads = N, p.num_heads_k = N, p.head_dim = H;
  p.dtype = DType::kBF16;
  p.scale = 1.f / std::sqrt(float(H));
  p.is_causal = causal;
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse;
  jaxattn::set_contiguous_strides(p);
  BenchRow row{H, T, causal, {}};
  const double flop = 4.0 * B * N * double(T) * S * H * (causal ? 0.5 : 1.0);
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  // Round robin: every repetition times each variant once, so clock / thermal drift
  // during the row lands on all columns alike (timing one column after the other read
  // the same kernel up to 10% apart in one run, session 6).
  std::vector<float> ms[kNV + 1];  // kNV == kDefault
  auto skip = [](int vi) { return g_only_variant >= 0 && vi != g_only_variant; };
  for (int vi = 0; vi <= kNV; ++vi)
    for (int w = 0; w < 2; ++w)
      if (!skip(vi)) jaxattn::sm90::flash_fwd_sm90_variant(p, 0, FwdVariant(vi));
  CUDA_CHECK(cudaDeviceSynchronize());
  for (int it = 0; it < 20; ++it)
    for (int vi = 0; vi <= kNV; ++vi) {
      if (skip(vi)) continue;
      CUDA_CHECK(cudaEventRecord(e0));
      jaxattn::cuda::LaunchStatus st = jaxattn::sm90::flash_fwd_sm90_variant(p, 0, FwdVariant(vi));
      CUDA_CHECK(cudaEventRecord(e1));
      CUDA_CHECK(cudaEventSynchronize(e1));
      if (!st.ok()) {
        std::fprintf(stderr, "bench launch failed: %s\n", cudaGetErrorString(st.error));
        std::exit(2);
      }
      float t;
      CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
      ms[vi].push_back(t);
    }
  for (int vi = 0; vi <= kNV; ++vi) {
    if (skip(vi)) continue;
    std::sort(ms[vi].begin(), ms[vi].end());
    row.tflops[vi] = flop / (ms[vi][ms[vi].size() / 2] * 1e-3) / 1e12;
  }
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  CUDA_CHECK(cudaFree(q));
  CUDA_CHECK(cudaFree(k));
  CUDA_CHECK(cudaFree(v));
  CUDA_CHECK(cudaFree(o));
  CUDA_CHECK(cudaFree(lse));
  return row;
}

// The persistent grid's causal tile order covers every (query tile, batch * heads)
// exactly once, for every grid size (host only; no GPU needed).
static int check_schedule() {
  int bad = 0, configs = 0;
  for (int m_tiles = 1; m_tiles <= 40; ++m_tiles)
    for (int heads : {1, 3, 16})
      for (int batch : {1, 2, 5, 11, 40})
        for (int sms : {1, 7, 66, 132}) {
          const int tiles = m_tiles * heads * batch, grid = std::min(tiles, sms);
          const jaxattn::sm90::FwdSchedule s = jaxattn::sm90::make_fwd_schedule(m_tiles, heads, batch, 1, grid);
          std::vector<int> seen(tiles, 0);
          for (int c = 0; c < grid; ++c) {
            int m, bh;
            for (int j = 0; jaxattn::sm90::causal_persistent_tile(s, c, j, m, bh); ++j) {
              if (m < 0 || m >= m_tiles || bh < 0 || bh >= heads * batch || j > 2 * tiles) { ++bad; break; }
              seen[bh * m_tiles + m]++;
            }
          }
          for (int v : seen) bad += v != 1;
          ++configs;
        }
  std::printf("schedule: %d configurations, %d tiles missed or repeated\n", configs, bad);
  return bad;
}

int main(int argc, char** argv) {
  const int schedule_bad = check_schedule();
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--schedule-only")) return schedule_bad ? 1 : 0;
  bool quick = false, do_bench = true, do_check = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true, do_bench = false;
    if (!std::strcmp(argv[i], "--no-bench")) do_bench = false;
    if (!std::strcmp(argv[i], "--no-check")) do_check = false;
    if (!std::strcmp(argv[i], "--log") && i + 1 < argc) g_log = std::fopen(argv[++i], "w");
    if (!g_log) g_log = stdout;
    if (!std::strcmp(argv[i], "--bench-one") && i + 4 < argc) {
      const int H = std::atoi(argv[i + 1]), T = std::atoi(argv[i + 2]);
      const bool causal = std::atoi(argv[i + 3]) != 0;
      g_only_variant = std::atoi(argv[i + 4]);
      if (g_only_variant < 0 || g_only_variant > kNV) return 2;
      const BenchRow r = bench(T, H, causal);
      std::printf("H %d T %d causal %d %s: %.1f TFLOP/s\n", H, T, int(causal),
                  variant_name(FwdVariant(g_only_variant)), r.tflops[g_only_variant]);
      return 0;
    }
  }
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (cc %d.%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);

  int n_fail = 0, n_cases = 0;
  // Worst errors per (H, dtype, variant).
  struct Worst {
    double frob = 0, abs = 0, lse = 0;
    int n = 0, fail = 0;
  } worst[3][2][kNV + 1];
  std::vector<std::string> failures;
  if (do_check) {
    const std::vector<Case> cs = check_cases(quick);
    uint64_t seed = 1234;
    for (const Case& c : cs) {
      ++seed;
      // every explicit variant and the default (vi == kNV); the long cases (T > 4096)
      // the default only (their float64 reference costs seconds a run)
      for (int vi = c.T > 4096 ? kNV : 0; vi <= kNV; ++vi) {
        const FwdVariant var = vi == kNV ? FwdVariant::kDefault : FwdVariant(vi);
        CaseResult r = run_case(c, var, seed);
        ++n_cases;
        const int hi = c.H == 64 ? 0 : c.H == 128 ? 1 : 2;
        Worst& w = worst[hi][c.bf16 ? 0 : 1][vi];
        w.n++;
        w.frob = std::max(w.frob, r.o_frob);
        w.abs = std::max(w.abs, r.o_max_abs);
        w.lse = std::max(w.lse, r.lse_max_abs);
        char line[400];
        std::snprintf(line, sizeof line, "%-46s %-7s o_max_abs %.2e o_frob %.2e lse_abs %.2e nonfinite %ld clobbered %ld %s",
                      describe(c).c_str(), variant_name(var), r.o_max_abs, r.o_frob, r.lse_max_abs, r.nonfinite,
                      r.clobbered, r.ok ? "ok" : "FAIL");
        std::fprintf(g_log, "%s\n", line);
        std::fflush(g_log);  // partial results survive a hang
        if (!r.ok) {
          std::fprintf(g_log, "    worst at %s\n", r.where.c_str());
          ++n_fail;
          w.fail++;
          failures.push_back(line);
          failures.push_back(std::string("    worst at ") + r.where);
        }
      }
    }
    if (g_log != stdout) std::fflush(g_log);
  }

  std::vector<BenchRow> rows;
  if (do_bench) {
    for (int H : {64, 128, 256})
      for (bool causal : {false, true})
        for (int T : {1024, 2048, 4096, 8192, 16384}) rows.push_back(bench(T, H, causal));
  }

  std::printf("\n===== results =====\n");
  if (do_check) {
    std::printf("check: %d runs (cases x %d variants and the default), %d failed\n", n_cases, kNV, n_fail);
    for (size_t i = 0; i < failures.size() && i < 40; ++i) std::printf("  %s\n", failures[i].c_str());
    std::printf("worst errors   H  dtype variant   runs  o_frob    o_max_abs lse_abs   fails\n");
    const int hs[3] = {64, 128, 256};
    for (int hi = 0; hi < 3; ++hi)
      for (int di = 0; di < 2; ++di)
        for (int vi = 0; vi <= kNV; ++vi) {
          const Worst& w = worst[hi][di][vi];
          if (!w.n) continue;
          std::printf("             %3d  %s  %-7s %5d  %.2e  %.2e  %.2e  %d\n", hs[hi], di ? "fp16" : "bf16",
                      variant_name(FwdVariant(vi)), w.n, w.frob, w.abs, w.lse, w.fail);
        }
  }
  if (do_bench) {
    std::printf("bench bf16, B*T=16384, N*H=2048 (TFLOP/s, median of 20)\n");
    std::printf("  H  causal      T");
    for (int vi = 0; vi <= kNV; ++vi) std::printf("  %8s", variant_name(FwdVariant(vi)));
    std::printf("\n");
    for (const BenchRow& r : rows) {
      std::printf("%3d  %6d  %5d", r.H, int(r.causal), r.T);
      for (int vi = 0; vi <= kNV; ++vi) std::printf("  %8.1f", r.tflops[vi]);
      std::printf("\n");
    }
  }
  n_fail += schedule_bad;
  std::printf("%s\n", n_fail ? "SOME CHECKS FAILED" : "ALL OK");
  return n_fail ? 1 : 0;
}
