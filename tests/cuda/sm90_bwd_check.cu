// Standalone check and benchmark of the Hopper (sm_90a) backward (no JAX).
//
// Check: per case, fresh random q, k, v, dout (strided layouts included); o and
// lse from the portable forward; dq, dk, dv poisoned with NaN (pad columns and a
// tail guard must stay so) and computed by flash_bwd_sm90 and by the portable
// flash_bwd_sm80. Small cases are compared with a float64 CPU reference (pass:
// no non-finite value, nothing clobbered, relative Frobenius error of each
// gradient within 2x of the portable kernel's own error plus 1e-3); large ones
// against the portable kernel (relative Frobenius difference < 1e-2).
// Every Hopper variant (BwdVariant) is checked and timed.
// Bench: B*T = 16384, N*H = 2048, T in {1024, 4096, 16384}, H 64/128, causal and
// not, bf16: sm90 (each variant, default) vs sm80 backward (preprocess + main + dQ
// conversion), median of 10 timed calls after warm-up; TFLOP/s = 2.5 * 4 B N T S H
// (halved when causal).
//
// Usage: sm90_bwd_check [--quick] [--no-bench] [--no-check] [--log FILE] [--bench-one H T causal]
//                       [--groups-only]
//   --groups-only: only the host check of the causal grid's grouped order
//     (sm90/causal_groups.h; runs without a GPU).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "check_util.h"
#include "common/params.h"
#include "launch.h"
#include "sm90/causal_groups.h"
#include "sm90/bwd_dispatch.h"
#include "sm90/bwd_tail.cuh"

using jaxattn::AttnParams;
using jaxattn::DType;
using jaxattn::sm90::BwdVariant;
namespace jc = jaxattn::cuda;
static constexpr int kNV = jaxattn::sm90::kNumBwdVariants;
static const char* variant_name(int v) {
  static const char* names[] = {"split-hd", "pingpong", "rows", "default"};
  return v >= 0 && v <= kNV ? names[v] : "?";
}

static FILE* g_log = stdout;
static constexpr size_t kGuard = 4096;  // poisoned elements after each gradient


// Device buffers of one case.
struct DevCase {
  uint16_t *q, *k, *v, *o, *dout, *dq, *dk, *dv;
  float *lse, *dq_accum, *dpsum;
};

static uint16_t* upload(const HostTensor& t) {
  uint16_t* d;
  CUDA_CHECK(cudaMalloc(&d, (t.count() + kGuard) * 2));
  CUDA_CHECK(cudaMemset(d, 0xFF, (t.count() + kGuard) * 2));
  CUDA_CHECK(cudaMemcpy(d, t.bits.data(), t.count() * 2, cudaMemcpyHostToDevice));
  return d;
}
static uint16_t* poisoned(size_t n) {
  uint16_t* d;
  CUDA_CHECK(cudaMalloc(&d, (n + kGuard) * 2));
  CUDA_CHECK(cudaMemset(d, 0xFF, (n + kGuard) * 2));
  return d;
}

// The tail split's partial sums (sm90/bwd_tail.cuh): one unit per SM at head dim 256.
static float* g_dkv_tail = nullptr;
static int g_dkv_tail_units = 0;
static void alloc_dkv_tail() {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&g_dkv_tail_units, cudaDevAttrMultiProcessorCount, dev));
  CUDA_CHECK(cudaMalloc(&g_dkv_tail, size_t(g_dkv_tail_units) * 2 * jaxattn::sm90::kTailRows * 256 * 4));
}

static AttnParams make_params(const Case& c, const HostTensor& q, const HostTensor& k, const DevCase& d) {
  AttnParams p;
  if (!g_dkv_tail) alloc_dkv_tail();
  p.dkv_tail = g_dkv_tail;
  p.dkv_tail_units = g_dkv_tail_units;
  p.batch = c.B, p.seqlen_q = c.T, p.seqlen_k = c.S, p.num_heads = c.N, p.num_heads_k = c.K, p.head_dim = c.H;
  p.dtype = c.bf16 ? DType::kBF16 : DType::kF16;
  p.scale = c.scale_mult / std::sqrt(float(c.H));
  p.is_causal = c.causal;
  p.q = d.q, p.k = d.k, p.v = d.v, p.o = d.o, p.lse = d.lse, p.dout = d.dout;
  p.dq = d.dq, p.dk = d.dk, p.dv = d.dv, p.dq_accum = d.dq_accum, p.dpsum = d.dpsum;
  p.q_batch_stride = q.bs(), p.q_row_stride = q.rs(), p.q_head_stride = q.hs();
  p.o_batch_stride = q.bs(), p.o_row_stride = q.rs(), p.o_head_stride = q.hs();
  p.k_batch_stride = k.bs(), p.k_row_stride = k.rs(), p.k_head_stride = k.hs();
  p.v_batch_stride = k.bs(), p.v_row_stride = k.rs(), p.v_head_stride = k.hs();
  return p;
}

// Gradients as float, plus poison checks: pad columns and the tail guard must hold NaN bits.
struct Grads {
  std::vector<float> dq, dk, dv;
  long clobbered = 0, nonfinite = 0;
};

static std::vector<float> fetch(const uint16_t* d, const HostTensor& like, bool bf16, Grads& g) {
  std::vector<uint16_t> bits(like.count() + kGuard);
  CUDA_CHECK(cudaMemcpy(bits.data(), d, bits.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> out(like.count(), 0.f);
  for (size_t i = 0; i < bits.size(); ++i) {
    const bool valid = i < like.count() && int64_t(i % like.hs()) < like.H;
    if (!valid) {
      if (bits[i] != 0xFFFF) ++g.clobbered;
      continue;
    }
    out[i] = from_bits(bits[i], bf16);
    if (!std::isfinite(out[i])) ++g.nonfinite;
  }
  return out;
}

// float64 reference gradients (dq, dk, dv over valid elements, layout of q / k).
static void reference(const Case& c, const HostTensor& q, const HostTensor& k, const HostTensor& v,
                      const HostTensor& dout, double scale, std::vector<double>& dq, std::vector<double>& dk,
                      std::vector<double>& dv) {
  dq.assign(q.count(), 0.0);
  dk.assign(k.count(), 0.0);
  dv.assign(k.count(), 0.0);
  const int group = c.N / c.K;
  // Parallel over (b, kv head): every query head of the group and every row adds into
  // the same dk / dv rows, so they are owned by one thread.
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int b = 0; b < c.B; ++b)
    for (int kh = 0; kh < c.K; ++kh) {
      std::vector<double> s(c.S), o(c.H);
      for (int n = kh * group; n < (kh + 1) * group; ++n)
        for (int t = 0; t < c.T; ++t) {
          const int nk = c.causal ? std::min(c.S, t + 1) : c.S;
          if (nk == 0) continue;
          double mx = -INFINITY;
          for (int j = 0; j < nk; ++j) {
            double d = 0;
            for (int h = 0; h < c.H; ++h) d += double(q.val[q.idx(b, t, n, h)]) * k.val[k.idx(b, j, kh, h)];
            s[j] = d * scale;
            mx = std::max(mx, s[j]);
          }
          double sum = 0;
          for (int j = 0; j < nk; ++j) sum += (s[j] = std::exp(s[j] - mx));
          std::fill(o.begin(), o.end(), 0.0);
          for (int j = 0; j < nk; ++j) {
            s[j] /= sum;
            for (int h = 0; h < c.H; ++h) o[h] += s[j] * v.val[v.idx(b, j, kh, h)];
          }
          double D = 0;
          for (int h = 0; h < c.H; ++h) D += double(dout.val[dout.idx(b, t, n, h)]) * o[h];
          for (int j = 0; j < nk; ++j) {
            double dp = 0;
            for (int h = 0; h < c.H; ++h) dp += double(dout.val[dout.idx(b, t, n, h)]) * v.val[v.idx(b, j, kh, h)];
            const double ds = s[j] * (dp - D) * scale;
            for (int h = 0; h < c.H; ++h) {
              dq[q.idx(b, t, n, h)] += ds * k.val[k.idx(b, j, kh, h)];
              dk[k.idx(b, j, kh, h)] += ds * q.val[q.idx(b, t, n, h)];
              dv[k.idx(b, j, kh, h)] += s[j] * dout.val[dout.idx(b, t, n, h)];
            }
          }
        }
    }
}

// Relative Frobenius error of got against want over the valid elements of `like`.
template <typename W>
static double frob(const std::vector<float>& got, const std::vector<W>& want, const HostTensor& like) {
  double e2 = 0, r2 = 0;
  for (size_t i = 0; i < like.count(); ++i) {
    if (int64_t(i % like.hs()) >= like.H) continue;
    const double d = double(got[i]) - double(want[i]);
    e2 += d * d;
    r2 += double(want[i]) * double(want[i]);
  }
  return std::sqrt(e2 / std::max(r2, 1e-30));
}

struct CaseResult {
  // per sm90 variant, the last the default (an experiment build's default may be a
  // kernel no explicit variant names); dq, dk, dv
  double err90[kNV + 1][3] = {}, err80[3] = {0, 0, 0};
  long clobbered = 0, nonfinite = 0;
  bool ok[kNV + 1] = {};
};

static CaseResult run_case(const Case& c, uint64_t seed, bool with_ref) {
  std::mt19937_64 rng(seed);
  HostTensor q = make_tensor(c.B, c.T, c.N, c.H, c.pad, c.bf16, rng);
  HostTensor k = make_tensor(c.B, c.S, c.K, c.H, c.pad, c.bf16, rng);
  HostTensor v = make_tensor(c.B, c.S, c.K, c.H, c.pad, c.bf16, rng);
  HostTensor dout = make_tensor(c.B, c.T, c.N, c.H, c.pad, c.bf16, rng);
  DevCase d{};
  d.q = upload(q), d.k = upload(k), d.v = upload(v), d.dout = upload(dout);
  d.o = poisoned(q.count());
  const size_t rows = size_t(c.B) * c.T * c.N;
  CUDA_CHECK(cudaMalloc(&d.lse, rows * 4));
  CUDA_CHECK(cudaMalloc(&d.dpsum, rows * 4));
  CUDA_CHECK(cudaMalloc(&d.dq_accum, rows * c.H * 4));
  CUDA_CHECK(cudaMemset(d.dq_accum, 0xFF, rows * c.H * 4));  // the preprocess must zero it
  AttnParams p = make_params(c, q, k, d);
  check_launch(jc::flash_fwd_sm80(p, 0));

  // impl 0: the portable backward; impl 1 + v: the Hopper one, variant v (v = kNV: the
  // default).
  Grads g[2 + kNV];
  std::vector<float> r[2 + kNV][3];
  for (int impl = 0; impl <= kNV + 1; ++impl) {
    d.dq = poisoned(q.count()), d.dk = poisoned(k.count()), d.dv = poisoned(k.count());
    p.dq = d.dq, p.dk = d.dk, p.dv = d.dv;
    // The tail split's partial sums for the default column only: the explicit variants
    // check the unsplit grids, the default the split one (where the launcher splits).
    p.dkv_tail = impl == kNV + 1 ? g_dkv_tail : nullptr;
    if (impl == 0) {
      check_launch(jc::flash_bwd_sm80(p, 0));
    } else {
      if (!jc::sm90_bwd_supports(p, 9, 0)) {
        std::fprintf(stderr, "sm90 backward does not support %s\n", describe(c).c_str());
        std::exit(2);
      }
      check_launch(jaxattn::sm90::flash_bwd_sm90_variant(p, 0, BwdVariant(impl - 1)));
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    r[impl][0] = fetch(d.dq, q, c.bf16, g[impl]);
    r[impl][1] = fetch(d.dk, k, c.bf16, g[impl]);
    r[impl][2] = fetch(d.dv, k, c.bf16, g[impl]);
    CUDA_CHECK(cudaFree(d.dq));
    CUDA_CHECK(cudaFree(d.dk));
    CUDA_CHECK(cudaFree(d.dv));
  }
  for (void* ptr : {(void*)d.q, (void*)d.k, (void*)d.v, (void*)d.o, (void*)d.dout, (void*)d.lse, (void*)d.dpsum,
                    (void*)d.dq_accum})
    CUDA_CHECK(cudaFree(ptr));

  CaseResult res;
  const HostTensor* like[3] = {&q, &k, &k};
  std::vector<double> ref[3];
  if (with_ref) reference(c, q, k, v, dout, p.scale, ref[0], ref[1], ref[2]);
  for (int i = 0; i < 3 && with_ref; ++i) res.err80[i] = frob(r[0][i], ref[i], *like[i]);
  for (int vi = 0; vi <= kNV; ++vi) {
    const Grads& gv = g[1 + vi];
    res.clobbered += gv.clobbered;
    res.nonfinite += gv.nonfinite;
    bool ok = gv.clobbered == 0 && gv.nonfinite == 0 && g[0].nonfinite == 0;
    for (int i = 0; i < 3; ++i) {
      if (with_ref) {
        res.err90[vi][i] = frob(r[1 + vi][i], ref[i], *like[i]);
        ok &= res.err90[vi][i] <= 2 * res.err80[i] + 1e-3;
      } else {
        res.err90[vi][i] = frob(r[1 + vi][i], r[0][i], *like[i]);
        ok &= res.err90[vi][i] < 1e-2;
      }
    }
    res.ok[vi] = ok;
  }
  return res;
}

static std::vector<std::pair<Case, bool>> check_cases(bool quick) {
  std::vector<std::pair<Case, bool>> cs;  // (case, compare with the float64 reference)
  auto add = [&](Case c, bool ref) { cs.push_back({c, ref}); };
  add({1, 128, 128, 1, 1, 128, true, false}, true);
  add({1, 128, 128, 1, 1, 64, true, true}, true);
  add({2, 200, 333, 4, 2, 128, true, true, 1.f, 8}, true);
  add({1, 130, 190, 2, 1, 256, true, true}, true);
  if (quick) return cs;
  for (int H : {64, 128, 256})
    for (bool causal : {false, true}) {
      add({1, 333, 200, 2, 1, H, true, causal}, true);
      add({2, 129, 257, 4, 4, H, false, causal}, true);
      add({1, 1, 700, 2, 2, H, true, causal}, true);
      add({1, 700, 1, 2, 1, H, false, causal}, true);
      add({1, 64, 65, 8, 1, H, true, causal}, true);  // MQA, group 8
      add({1, 300, 300, 2, 2, H, true, causal, 8.f}, true);  // sharp softmax
      add({1, 257, 513, 6, 3, H, false, causal, 1.f, 16}, true);  // strided, GQA 2
      add({2, 2049, 2049, 4, 2, H, true, causal}, false);
      add({1, 4096, 1000, 8, 8, H, false, causal}, false);
      // Fewer units than SMs over many query blocks: at head dims 64 / 128 the tail
      // split cuts every unit (the default column; non-causal; 256 never splits),
      // several key rows per unit.
      if (!causal) add({1, 1000, 300, 2, 1, H, true, false}, true);
      // Many heads (35, an odd count) over 16-32 key blocks: with the causal grouped
      // order the default column runs several groups of uneven size.
      if (causal) add({5, 2048, 2048, 7, 7, H, true, true}, false);
    }
  return cs;
}

// ---- deterministic mode ------------------------------------------------------------------
// dq of 5 runs with p.deterministic (9 key blocks adding into every query block, GQA 4)
// must be identical bit for bit. Returns whether they were.
static bool determinism_check(int H, int variant) {
  Case c{2, 1100, 1100, 8, 2, H, true, false};
  std::mt19937_64 rng(99 + H);
  HostTensor q = make_tensor(c.B, c.T, c.N, c.H, 0, true, rng);
  HostTensor k = make_tensor(c.B, c.S, c.K, c.H, 0, true, rng);
  HostTensor v = make_tensor(c.B, c.S, c.K, c.H, 0, true, rng);
  HostTensor dout = make_tensor(c.B, c.T, c.N, c.H, 0, true, rng);
  DevCase d{};
  d.q = upload(q), d.k = upload(k), d.v = upload(v), d.dout = upload(dout);
  d.o = poisoned(q.count()), d.dq = poisoned(q.count()), d.dk = poisoned(k.count()), d.dv = poisoned(k.count());
  const size_t rows = size_t(c.B) * c.T * c.N;
  CUDA_CHECK(cudaMalloc(&d.lse, rows * 4));
  CUDA_CHECK(cudaMalloc(&d.dpsum, rows * 4));
  CUDA_CHECK(cudaMalloc(&d.dq_accum, rows * c.H * 4));
  int32_t* sem;
  const size_t n_sem = size_t(c.B) * c.N * ((c.T + jaxattn::kDqSemaphoreRows - 1) / jaxattn::kDqSemaphoreRows);
  CUDA_CHECK(cudaMalloc(&sem, n_sem * 4));
  AttnParams p = make_params(c, q, k, d);
  p.deterministic = true;
  p.dq_semaphore = sem;
  check_launch(jc::flash_fwd_sm80(p, 0));
  std::vector<uint16_t> first(q.count()), again(q.count());
  bool same = true;
  for (int run = 0; run < 5; ++run) {
    check_launch(jaxattn::sm90::flash_bwd_sm90_variant(p, 0, BwdVariant(variant)));
    CUDA_CHECK(cudaMemcpy(run ? again.data() : first.data(), d.dq, q.count() * 2, cudaMemcpyDeviceToHost));
    if (run) same &= std::memcmp(first.data(), again.data(), q.count() * 2) == 0;
  }
  for (void* ptr : {(void*)d.q, (void*)d.k, (void*)d.v, (void*)d.o, (void*)d.dout, (void*)d.dq, (void*)d.dk,
                    (void*)d.dv, (void*)d.lse, (void*)d.dpsum, (void*)d.dq_accum, (void*)sem})
    CUDA_CHECK(cudaFree(ptr));
  return same;
}

// ---- benchmark --------------------------------------------------------------------------
struct BenchRow {
  int H, T;
  bool causal;
  double tf[1 + kNV + 1];  // sm80, each sm90 variant, sm90 default
};

static BenchRow bench(int T, int H, bool causal) {
  const int B = 16384 / T, N = 2048 / H, S = T;
  const size_t n = size_t(B) * T * N * H, rows = size_t(B) * T * N;
  DevCase d{};
  uint16_t** bufs[] = {&d.q, &d.k, &d.v, &d.o, &d.dout, &d.dq, &d.dk, &d.dv};
  for (uint16_t** b : bufs) {
    CUDA_CHECK(cudaMalloc(b, n * 2));
    fill_random<<<1024, 256>>>(*b, n, uint32_t(reinterpret_cast<uintptr_t>(*b)), true);
  }
  CUDA_CHECK(cudaMalloc(&d.lse, rows * 4));
  CUDA_CHECK(cudaMalloc(&d.dpsum, rows * 4));
  CUDA_CHECK(cudaMalloc(&d.dq_accum, rows * H * 4));
  Case c{B, T, S, N, N, H, true, causal};
  HostTensor qd{B, T, N, H, 0, {}, {}}, kd{B, S, N, H, 0, {}, {}};
  AttnParams p = make_params(c, qd, kd, d);
  check_launch(jc::flash_fwd_sm80(p, 0));
  const double flops = 2.5 * 4.0 * B * N * double(T) * S * H * (causal ? 0.5 : 1.0);
  BenchRow row{H, T, causal, {}};
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  // Round robin: every repetition times each implementation once, so clock / thermal
  // drift during the row lands on all columns alike (timing one column after the
  // other read the same kernel up to 10% apart in one run, session 6).
  auto call = [&](int impl) {
    check_launch(impl == 0 ? jc::flash_bwd_sm80(p, 0)
                           : jaxattn::sm90::flash_bwd_sm90_variant(p, 0, BwdVariant(impl - 1)));
  };
  std::vector<float> ms[kNV + 2];
  for (int impl = 0; impl <= kNV + 1; ++impl)
    for (int i = 0; i < 2; ++i) call(impl);
  for (int i = 0; i < 10; ++i)
    for (int impl = 0; impl <= kNV + 1; ++impl) {
      CUDA_CHECK(cudaEventRecord(e0));
      call(impl);
      CUDA_CHECK(cudaEventRecord(e1));
      CUDA_CHECK(cudaEventSynchronize(e1));
      float t;
      CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
      ms[impl].push_back(t);
    }
  for (int impl = 0; impl <= kNV + 1; ++impl) {
    std::sort(ms[impl].begin(), ms[impl].end());
    row.tf[impl] = flops / (ms[impl][ms[impl].size() / 2] * 1e-3) / 1e12;
  }
  for (uint16_t** b : bufs) CUDA_CHECK(cudaFree(*b));
  CUDA_CHECK(cudaFree(d.lse));
  CUDA_CHECK(cudaFree(d.dpsum));
  CUDA_CHECK(cudaFree(d.dq_accum));
  return row;
}

// Host check of the causal grid's grouped order: every (key block, head) exactly once,
// each group's units key block slowest over consecutive heads.
static int check_causal_groups() {
  int bad = 0, configs = 0;
  for (int heads : {1, 2, 3, 7, 8, 24, 35, 64, 130})
    for (int n_kblocks = 1; n_kblocks <= 70; n_kblocks += 3)
      for (int sms : {1, 7, 132})
        for (int f10 : {10, 15, 20}) {
          const int groups = jaxattn::sm90::causal_groups(heads, n_kblocks, sms, f10);
          if (groups < 1 || groups > heads) { ++bad; continue; }
          std::vector<int> seen(size_t(heads) * n_kblocks, 0);
          int prev_head = -1, prev_n = 0, max_head = -1;
          for (int x = 0; x < heads * n_kblocks; ++x) {
            int n, h;
            jaxattn::sm90::causal_group_unit(x, heads, n_kblocks, groups, n, h);
            if (n < 0 || n >= n_kblocks || h < 0 || h >= heads) { ++bad; break; }
            seen[size_t(h) * n_kblocks + n]++;
            // (n, head) increases inside a group; the next group starts at key block 0
            // with the next head
            if (prev_head >= 0) {
              const bool in_group = n > prev_n || (n == prev_n && h > prev_head);
              const bool next_group = n == 0 && h == max_head + 1 && prev_n == n_kblocks - 1;
              bad += !in_group && !next_group;
            }
            prev_head = h, prev_n = n, max_head = std::max(max_head, h);
          }
          for (int v : seen) bad += v != 1;
          ++configs;
        }
  std::printf("causal groups: %d configurations, %d units missed, repeated or out of order\n", configs, bad);
  return bad;
}

int main(int argc, char** argv) {
  const int groups_bad = check_causal_groups();
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--groups-only")) return groups_bad ? 1 : 0;
  bool quick = false, do_bench = true, do_check = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true, do_bench = false;
    else if (!std::strcmp(argv[i], "--no-bench")) do_bench = false;
    else if (!std::strcmp(argv[i], "--no-check")) do_check = false;
    else if (!std::strcmp(argv[i], "--log") && i + 1 < argc) g_log = std::fopen(argv[++i], "w");
    else if (!std::strcmp(argv[i], "--bench-one") && i + 3 < argc) {
      // One benchmark row (e.g. under a profiler): --bench-one H T causal(0/1).
      const int H = std::atoi(argv[i + 1]), T = std::atoi(argv[i + 2]);
      const bool causal = std::atoi(argv[i + 3]) != 0;
      const BenchRow r = bench(T, H, causal);
      std::printf("H %d T %d causal %d: sm80 %.0f", H, T, causal, r.tf[0]);
      for (int vi = 0; vi <= kNV; ++vi) std::printf(", %s %.0f", variant_name(vi), r.tf[1 + vi]);
      std::printf(" TFLOP/s\n");
      return 0;
    }
  }
  int failed = 0, total = 0;
  if (do_check) {
    uint64_t seed = 1234;
    for (auto& [c, ref] : check_cases(quick)) {
      const CaseResult r = run_case(c, seed++, ref);
      for (int vi = 0; vi <= kNV; ++vi) {
        ++total;
        failed += !r.ok[vi];
        std::fprintf(g_log, "%-4s %-44s %-10s %s dq %.2e dk %.2e dv %.2e", r.ok[vi] ? "ok" : "FAIL",
                     describe(c).c_str(), variant_name(vi), ref ? "vs f64:" : "vs sm80:", r.err90[vi][0],
                     r.err90[vi][1], r.err90[vi][2]);
        if (ref) std::fprintf(g_log, " (sm80 %.2e %.2e %.2e)", r.err80[0], r.err80[1], r.err80[2]);
        if (r.clobbered || r.nonfinite)
          std::fprintf(g_log, " clobbered %ld nonfinite %ld", r.clobbered, r.nonfinite);
        std::fprintf(g_log, "\n");
        std::fflush(g_log);
        if (!r.ok[vi] && g_log != stdout)
          std::printf("FAIL %s %s dq %.2e dk %.2e dv %.2e clobbered %ld nonfinite %ld\n", describe(c).c_str(),
                      variant_name(vi), r.err90[vi][0], r.err90[vi][1], r.err90[vi][2], r.clobbered, r.nonfinite);
      }
    }
  }
  int det_failed = 0;
  if (do_check && !quick)
    for (int H : {64, 128, 256})
      for (int vi = 0; vi < kNV; ++vi) {
        const bool same = determinism_check(H, vi);
        det_failed += !same;
        std::fprintf(g_log, "%-4s deterministic H%d %s: 5 runs %s\n", same ? "ok" : "FAIL", H, variant_name(vi),
                     same ? "bit-identical" : "DIFFER");
      }
  failed += det_failed;
  std::vector<BenchRow> rows;
  if (do_bench)
    for (int H : {64, 128, 256})
      for (bool causal : {false, true})
        for (int T : {1024, 4096, 16384}) rows.push_back(bench(T, H, causal));
  std::printf("===== results =====\n");
  if (do_check) {
    std::printf("check: %d / %d (case, variant) runs ok\n", total - (failed - det_failed), total);
    if (!quick) std::printf("deterministic: %d of %d (H, variant) pairs differ between runs\n", det_failed, 3 * kNV);
  }
  if (!rows.empty()) {
    std::printf("| H | T | causal | sm80 |");
    for (int vi = 0; vi <= kNV; ++vi) std::printf(" sm90 %s |", variant_name(vi));
    std::printf(" default/sm80 |\n|---|---|---|---|");
    for (int vi = 0; vi <= kNV; ++vi) std::printf("---|");
    std::printf("---|\n");
    for (auto& r : rows) {
      std::printf("| %d | %d | %s | %.0f |", r.H, r.T, r.causal ? "yes" : "no", r.tf[0]);
      for (int vi = 0; vi <= kNV; ++vi) std::printf(" %.0f |", r.tf[1 + vi]);
      std::printf(" %.2f |\n", r.tf[kNV + 1] / r.tf[0]);
    }
  }
  return failed || groups_bad ? 1 : 0;
}
