// Standalone check and benchmark of the sm80 CUDA kernels (no JAX).
//
// For each case: fresh random q, k, v, dout; outputs and workspace poisoned
// with NaN; flash_fwd_sm80 and flash_bwd_sm80 called; o, lse, dq, dk, dv
// compared with a float64 CPU reference by relative Frobenius error. Then
// large cases are timed (CUDA events) and reported in TFLOP/s.
//
// Usage: standalone_check [--quick] [--no-bench] [--no-check] [--h128] [--sweep]
//                         [--sm80] [--packed]
//   A build with -DJAXATTN_CHECK_SM90 and the sm_90a objects (scripts/sm90_standalone.sh
//   CHECK=masked) runs the Hopper kernels wherever their dispatch rule takes the call;
//   --sm80: the portable ones anyway;
//   --packed: the benchmark is packed documents vs the same documents separate;
//   --quick: four small cases, no benchmark (for compute-sanitizer);
//   --h128: only cases on the head-dim-128 kernels, and the T = 16384 benchmarks;
//   --sweep: twelve small odd-size cases (head dims 64 .. 256, bf16 and fp16,
//     masked and not), then the benchmarks of scripts/sm80_variants.sh: H = 64,
//     128, 256 at B = 1, T = 16384, N = 2048 / H, causal and not, bf16 (lines
//     "sweep H<h> <full|causal> fwd <TFLOP/s> bwd <TFLOP/s> total <TFLOP/s>").
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

#include "common/params.h"
#include "launch.h"
#include "cuda_check.h"
#include "half_bits.h"

using jaxattn::AttnParams;
using jaxattn::DType;
namespace jc = jaxattn::cuda;



// Masks of a case (the masked kernels): window, lengths of batch 0 (others
// full), a soft cap, packed segment ids (query i in document i / q_doc, key j
// in j / kv_doc; 0 = no segment ids), a dense bias [1, N, T, S] (broadcast
// over the batch; its gradient is checked) and a dense mask [B, 1, T, S].
// Segment ids go with their (min, max) tables (AttnParams::q_segment_ranges, as
// jaxattn passes them) unless scan_ids; seg_mod > 0 makes documents repeat (id
// (i / q_doc) % seg_mod: ids not sorted, a document's tokens in several places).
struct Masks {
  int left = -1, right = -1;
  int q_len0 = -1, kv_len0 = -1;
  float softcap = 0.f;
  int q_doc = 0, kv_doc = 0;
  bool bias = false, mask = false;
  bool scan_ids = false;
  int seg_mod = 0;
  int q_id(int i) const { return seg_mod > 0 ? (i / q_doc) % seg_mod : i / q_doc; }
  int kv_id(int j) const { return seg_mod > 0 ? (j / kv_doc) % seg_mod : j / kv_doc; }
  bool any() const {
    return left >= 0 || right >= 0 || q_len0 >= 0 || kv_len0 >= 0 || softcap > 0 || q_doc > 0 || bias || mask;
  }
};

struct Case {
  int B, T, S, N, K, H;
  bool bf16, causal;
  int pad = 0;  // extra elements per head slot: tests non-contiguous strides
  Masks m = {};
};

static std::string describe(const Case& c) {
  char buf[256];
  int n = std::snprintf(buf, sizeof buf, "B%d T%d S%d N%d K%d H%d %s %s%s", c.B, c.T, c.S, c.N, c.K, c.H,
                        c.bf16 ? "bf16" : "fp16", c.causal ? "causal" : "full", c.pad ? " strided" : "");
  const Masks& m = c.m;
  if (m.left >= 0 || m.right >= 0) n += std::snprintf(buf + n, sizeof buf - n, " win(%d,%d)", m.left, m.right);
  if (m.q_len0 >= 0 || m.kv_len0 >= 0) n += std::snprintf(buf + n, sizeof buf - n, " len(%d,%d)", m.q_len0, m.kv_len0);
  if (m.softcap > 0) n += std::snprintf(buf + n, sizeof buf - n, " cap%g", m.softcap);
  if (m.q_doc > 0)
    n += std::snprintf(buf + n, sizeof buf - n, " docs(%d,%d%s%s)", m.q_doc, m.kv_doc,
                       m.seg_mod > 0 ? (" mod " + std::to_string(m.seg_mod)).c_str() : "", m.scan_ids ? " scan" : "");
  if (m.bias) n += std::snprintf(buf + n, sizeof buf - n, " bias");
  if (m.mask) n += std::snprintf(buf + n, sizeof buf - n, " mask");
  return buf;
}

// The dense mask of a case: [B, 1, T, S], about 70% true.
static std::vector<uint8_t> dense_mask(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> m(size_t(c.B) * c.T * c.S);
  for (auto& x : m) x = (rng() % 10) < 7;
  return m;
}

// Whether query i of batch b sees key j (the float64 reference's rule, written
// independently of common/mask.cuh); dmask: the dense mask, or empty.
static bool ref_visible(const Case& c, int b, int i, int j, const std::vector<uint8_t>& dmask) {
  if (!dmask.empty() && !dmask[(size_t(b) * c.T + i) * c.S + j]) return false;
  const Masks& m = c.m;
  const int ql = (b == 0 && m.q_len0 >= 0) ? std::min(m.q_len0, c.T) : c.T;
  const int kl = (b == 0 && m.kv_len0 >= 0) ? std::min(m.kv_len0, c.S) : c.S;
  if (i >= ql || j >= kl) return false;
  if (c.causal && j > i) return false;
  if (m.left >= 0 && j < i - m.left) return false;
  if (m.right >= 0 && j > i + m.right) return false;
  if (m.q_doc > 0 && m.q_id(i) != m.kv_id(j)) return false;
  return true;
}


// A [B, L, Hn, H] tensor with head slot H + pad; host values are the rounded ones.
struct Tensor {
  int B, L, Hn, H, pad;
  bool bf16;
  std::vector<uint16_t> bits;
  uint16_t* dev = nullptr;
  int64_t slot() const { return H + pad; }
  int64_t head_stride() const { return slot(); }
  int64_t row_stride() const { return slot() * Hn; }
  int64_t batch_stride() const { return row_stride() * L; }
  size_t count() const { return size_t(batch_stride()) * B; }
  size_t idx(int b, int l, int h, int d) const {
    return size_t(b * batch_stride() + l * row_stride() + h * head_stride() + d);
  }
  double at(int b, int l, int h, int d) const { return from_bits(bits[idx(b, l, h, d)], bf16); }
};

static Tensor make_tensor(int B, int L, int Hn, int H, int pad, bool bf16, std::mt19937_64* rng) {
  Tensor t{B, L, Hn, H, pad, bf16, {}, nullptr};
  t.bits.assign(t.count(), 0xFFFF);  // pad columns hold NaN: must never be read
  if (rng) {
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int b = 0; b < B; ++b)
      for (int l = 0; l < L; ++l)
        for (int h = 0; h < Hn; ++h)
          for (int d = 0; d < H; ++d) t.bits[t.idx(b, l, h, d)] = to_bits(nd(*rng), bf16);
  }
  CUDA_CHECK(cudaMalloc(&t.dev, t.count() * 2));
  CUDA_CHECK(cudaMemcpy(t.dev, t.bits.data(), t.count() * 2, cudaMemcpyHostToDevice));
  return t;
}

static void fetch(Tensor& t) {
  CUDA_CHECK(cudaMemcpy(t.bits.data(), t.dev, t.count() * 2, cudaMemcpyDeviceToHost));
}

// Relative Frobenius error; the reference norm is floored at an RMS of 1e-3,
// so that an output whose exact value is ~0 (dq, dk with a single key: dS = 0)
// is judged by its absolute rounding noise.
struct Err {
  double num = 0, den = 0, n = 0;
  long bad = 0;  // non-finite
  void add(double got, double ref) {
    n += 1;
    if (!std::isfinite(got)) {
      ++bad;
      return;
    }
    num += (got - ref) * (got - ref);
    den += ref * ref;
  }
  double rel() const { return bad ? INFINITY : std::sqrt(num / std::max(den, 1e-6 * n + 1e-300)); }
};

struct Result {
  double o, lse, dq, dk, dv;
  bool pad_intact;
  double dbias = 0;  // (with a bias)
};

// Window, soft cap, lengths [B] and segment ids [B, T] / [B, S] of a case, on the
// device and in `p` (the dense bias / mask are run_case's). free() releases them.
struct DeviceMasks {
  int32_t *lens = nullptr, *seg = nullptr;
  void free() const {
    if (lens) CUDA_CHECK(cudaFree(lens));
    if (seg) CUDA_CHECK(cudaFree(seg));
  }
};
static DeviceMasks upload_masks(const Case& c, AttnParams& p) {
  const Masks& m = c.m;
  DeviceMasks d;
  if (!m.any()) return d;
  p.window_left = m.left, p.window_right = m.right, p.softcap = m.softcap;
  std::vector<int32_t> lens(2 * c.B);
  for (int b = 0; b < c.B; ++b) {
    lens[b] = (b == 0 && m.q_len0 >= 0) ? m.q_len0 : c.T;
    lens[c.B + b] = (b == 0 && m.kv_len0 >= 0) ? m.kv_len0 : c.S;
  }
  CUDA_CHECK(cudaMalloc(&d.lens, lens.size() * 4));
  CUDA_CHECK(cudaMemcpy(d.lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  p.q_lengths = d.lens, p.kv_lengths = d.lens + c.B;
  if (m.q_doc > 0) {
    // ids [B, T], [B, S], then their (min, max) tables [B, ceil(T / 64), 2], [B, ceil(S / 64), 2].
    const int kb = jaxattn::kSegmentBlock, tq = (c.T + kb - 1) / kb, ts = (c.S + kb - 1) / kb;
    std::vector<int32_t> seg(size_t(c.B) * (c.T + c.S + 2 * tq + 2 * ts));
    int32_t* q_ids = seg.data();
    int32_t* kv_ids = q_ids + size_t(c.B) * c.T;
    int32_t* q_tab = kv_ids + size_t(c.B) * c.S;
    int32_t* kv_tab = q_tab + size_t(c.B) * 2 * tq;
    auto table = [&](const int32_t* ids, int len, int32_t* tab) {
      for (int t = 0; t * kb < len; ++t) {
        int lo = ids[t * kb], hi = lo;
        for (int i = t * kb; i < std::min(len, (t + 1) * kb); ++i) lo = std::min(lo, ids[i]), hi = std::max(hi, ids[i]);
        tab[2 * t] = lo, tab[2 * t + 1] = hi;
      }
    };
    for (int b = 0; b < c.B; ++b) {
      for (int i = 0; i < c.T; ++i) q_ids[size_t(b) * c.T + i] = m.q_id(i);
      for (int j = 0; j < c.S; ++j) kv_ids[size_t(b) * c.S + j] = m.kv_id(j);
      table(q_ids + size_t(b) * c.T, c.T, q_tab + size_t(b) * 2 * tq);
      table(kv_ids + size_t(b) * c.S, c.S, kv_tab + size_t(b) * 2 * ts);
    }
    CUDA_CHECK(cudaMalloc(&d.seg, seg.size() * 4));
    CUDA_CHECK(cudaMemcpy(d.seg, seg.data(), seg.size() * 4, cudaMemcpyHostToDevice));
    p.q_segment_ids = d.seg, p.kv_segment_ids = d.seg + (kv_ids - q_ids);
    if (!m.scan_ids) p.q_segment_ranges = d.seg + (q_tab - q_ids), p.kv_segment_ranges = d.seg + (kv_tab - q_ids);
  }
  return d;
}

// Which kernels run: the portable ones, or (a build with -DJAXATTN_CHECK_SM90 and
// the sm_90a objects, unless --sm80) the Hopper ones wherever their dispatch rule
// takes the call, as jaxattn's handlers do on an H100 / H200.
#ifdef JAXATTN_CHECK_SM90
static bool g_sm90 = true;
#else
static bool g_sm90 = false;
#endif
static jc::LaunchStatus run_fwd(const AttnParams& p) {
#ifdef JAXATTN_CHECK_SM90
  if (g_sm90 && jc::sm90_fwd_supports(p, 9, 0)) return jc::flash_fwd_sm90(p, 0);
#endif
  return jc::flash_fwd_sm80(p, 0);
}
static jc::LaunchStatus run_bwd(const AttnParams& p) {
#ifdef JAXATTN_CHECK_SM90
  if (g_sm90 && jc::sm90_bwd_supports(p, 9, 0)) return jc::flash_bwd_sm90(p, 0);
#endif
  return jc::flash_bwd_sm80(p, 0);
}

static Result run_case(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const double scale = 1.0 / std::sqrt(double(c.H));
  Tensor q = make_tensor(c.B, c.T, c.N, c.H, c.pad, c.bf16, &rng);
  Tensor k = make_tensor(c.B, c.S, c.K, c.H, c.pad, c.bf16, &rng);
  Tensor v = make_tensor(c.B, c.S, c.K, c.H, c.pad, c.bf16, &rng);
  Tensor dout = make_tensor(c.B, c.T, c.N, c.H, c.pad, c.bf16, &rng);
  Tensor o = make_tensor(c.B, c.T, c.N, c.H, c.pad, c.bf16, nullptr);  // NaN
  Tensor dq = make_tensor(c.B, c.T, c.N, c.H, c.pad, c.bf16, nullptr);
  Tensor dk = make_tensor(c.B, c.S, c.K, c.H, c.pad, c.bf16, nullptr);
  Tensor dv = make_tensor(c.B, c.S, c.K, c.H, c.pad, c.bf16, nullptr);
  const size_t rows = size_t(c.B) * c.T * c.N;
  float *lse, *dq_accum, *dpsum;
  CUDA_CHECK(cudaMalloc(&lse, rows * 4));
  CUDA_CHECK(cudaMalloc(&dq_accum, rows * c.H * 4));
  CUDA_CHECK(cudaMalloc(&dpsum, rows * 4));
  CUDA_CHECK(cudaMemset(lse, 0xFF, rows * 4));
  CUDA_CHECK(cudaMemset(dq_accum, 0xFF, rows * c.H * 4));
  CUDA_CHECK(cudaMemset(dpsum, 0xFF, rows * 4));

  AttnParams p;
  p.batch = c.B, p.seqlen_q = c.T, p.seqlen_k = c.S, p.num_heads = c.N, p.num_heads_k = c.K;
  p.head_dim = c.H, p.dtype = c.bf16 ? DType::kBF16 : DType::kF16;
  p.scale = float(scale), p.is_causal = c.causal;
  p.q = q.dev, p.k = k.dev, p.v = v.dev, p.o = o.dev, p.lse = lse;
  p.q_batch_stride = q.batch_stride(), p.q_row_stride = q.row_stride(), p.q_head_stride = q.head_stride();
  p.k_batch_stride = k.batch_stride(), p.k_row_stride = k.row_stride(), p.k_head_stride = k.head_stride();
  p.v_batch_stride = v.batch_stride(), p.v_row_stride = v.row_stride(), p.v_head_stride = v.head_stride();
  p.o_batch_stride = o.batch_stride(), p.o_row_stride = o.row_stride(), p.o_head_stride = o.head_stride();
  p.dout = dout.dev, p.dq = dq.dev, p.dk = dk.dev, p.dv = dv.dev;
  p.dq_accum = dq_accum, p.dpsum = dpsum;
  const Masks& m = c.m;
  const DeviceMasks dm = upload_masks(c, p);
  // Dense bias [1, N, T, S] with its gradient, dense mask [B, 1, T, S].
  const size_t nbias = size_t(c.N) * c.T * c.S;
  std::vector<float> bias_h;
  std::vector<uint8_t> dmask;
  float *d_bias = nullptr, *d_dbias = nullptr;
  bool* d_mask = nullptr;
  if (m.bias) {
    std::normal_distribution<float> nd(0.f, 1.f);
    bias_h.resize(nbias);
    for (float& x : bias_h) x = nd(rng);
    CUDA_CHECK(cudaMalloc(&d_bias, nbias * 4));
    CUDA_CHECK(cudaMalloc(&d_dbias, nbias * 4));
    CUDA_CHECK(cudaMemcpy(d_bias, bias_h.data(), nbias * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(d_dbias, 0xFF, nbias * 4));  // NaN: the launcher must zero it
    p.bias = d_bias, p.dbias = d_dbias;
    const int dims[5] = {1, 1, c.N, c.T, c.S};
    std::copy(dims, dims + 5, p.bias_dims);
  }
  if (m.mask) {
    dmask = dense_mask(c, seed ^ 0x5bd1e995);
    CUDA_CHECK(cudaMalloc(&d_mask, dmask.size()));
    CUDA_CHECK(cudaMemcpy(d_mask, dmask.data(), dmask.size(), cudaMemcpyHostToDevice));  // (bool = 1 byte)
    p.mask = d_mask;
    const int dims[5] = {1, c.B, 1, c.T, c.S};
    std::copy(dims, dims + 5, p.mask_dims);
  }

  check_launch(run_fwd(p));
  CUDA_CHECK(cudaDeviceSynchronize());
  check_launch(run_bwd(p));
  CUDA_CHECK(cudaDeviceSynchronize());
  fetch(o), fetch(dq), fetch(dk), fetch(dv);
  std::vector<float> lse_h(rows);
  CUDA_CHECK(cudaMemcpy(lse_h.data(), lse, rows * 4, cudaMemcpyDeviceToHost));

  // float64 reference, parallel over (batch, kv head); dk/dv sum over the group.
  const int G = c.N / c.K;
  Err e_o, e_lse, e_dq, e_dk, e_dv;
  std::vector<Err> eo(c.B * c.K), else_(c.B * c.K), edq(c.B * c.K), edk(c.B * c.K), edv(c.B * c.K);
  // d(loss)/d(bias) per (b, kv head), summed after the parallel loop.
  std::vector<std::vector<double>> dbias_part(m.bias ? c.B * c.K : 0, std::vector<double>(nbias, 0.0));
#pragma omp parallel for schedule(dynamic)
  for (int bk = 0; bk < c.B * c.K; ++bk) {
    const int b = bk / c.K, kh = bk % c.K, H = c.H;
    std::vector<double> dk_r(size_t(c.S) * H, 0.0), dv_r(size_t(c.S) * H, 0.0);
    std::vector<double> s(c.S), pr(c.S), orow(H), dqrow(H);
    for (int n = kh * G; n < (kh + 1) * G; ++n) {
      for (int i = 0; i < c.T; ++i) {
        const int jend = c.causal ? std::min(c.S, i + 1) : c.S;
        double mx = -INFINITY;
        for (int j = 0; j < jend; ++j) {
          s[j] = -INFINITY;
          if (!ref_visible(c, b, i, j, dmask)) continue;
          double acc = 0;
          for (int d = 0; d < H; ++d) acc += q.at(b, i, n, d) * k.at(b, j, kh, d);
          s[j] = acc * scale;
          if (m.softcap > 0) s[j] = m.softcap * std::tanh(s[j] / m.softcap);
          if (m.bias) s[j] += bias_h[(size_t(n) * c.T + i) * c.S + j];
          mx = std::max(mx, s[j]);
        }
        double l = 0;
        for (int j = 0; j < jend; ++j) l += s[j] == -INFINITY ? 0.0 : std::exp(s[j] - mx);
        const bool empty = !(l > 0);  // no visible key: o = 0, lse = -inf
        const double lse_r = empty ? -INFINITY : mx + std::log(l);
        std::fill(orow.begin(), orow.end(), 0.0);
        for (int j = 0; j < jend; ++j) {
          pr[j] = empty || s[j] == -INFINITY ? 0.0 : std::exp(s[j] - lse_r);
          for (int d = 0; d < H; ++d) orow[d] += pr[j] * v.at(b, j, kh, d);
        }
        const double got_lse = lse_h[(size_t(b) * c.T + i) * c.N + n];
        if (empty) {
          else_[bk].add(got_lse == -INFINITY ? 0.0 : NAN, 0.0);
        } else {
          else_[bk].add(got_lse, lse_r);
        }
        double dps = 0;
        for (int d = 0; d < H; ++d) {
          eo[bk].add(o.at(b, i, n, d), orow[d]);
          dps += dout.at(b, i, n, d) * orow[d];
        }
        std::fill(dqrow.begin(), dqrow.end(), 0.0);
        for (int j = 0; j < jend; ++j) {
          double dp = 0;
          for (int d = 0; d < H; ++d) dp += dout.at(b, i, n, d) * v.at(b, j, kh, d);
          double ds = pr[j] * (dp - dps);
          if (m.bias) {
            dbias_part[bk][(size_t(n) * c.T + i) * c.S + j] += ds;
            if (pr[j] > 0) s[j] -= bias_h[(size_t(n) * c.T + i) * c.S + j];  // the capped logit
          }
          if (m.softcap > 0 && pr[j] > 0) ds *= 1.0 - (s[j] / m.softcap) * (s[j] / m.softcap);
          for (int d = 0; d < H; ++d) {
            dqrow[d] += scale * ds * k.at(b, j, kh, d);
            dk_r[size_t(j) * H + d] += scale * ds * q.at(b, i, n, d);
            dv_r[size_t(j) * H + d] += pr[j] * dout.at(b, i, n, d);
          }
        }
        for (int d = 0; d < H; ++d) edq[bk].add(dq.at(b, i, n, d), dqrow[d]);
      }
    }
    for (int j = 0; j < c.S; ++j)
      for (int d = 0; d < H; ++d) {
        edk[bk].add(dk.at(b, j, kh, d), dk_r[size_t(j) * H + d]);
        edv[bk].add(dv.at(b, j, kh, d), dv_r[size_t(j) * H + d]);
      }
  }
  auto merge = [](Err& into, const std::vector<Err>& v) {
    for (const Err& e : v) into.num += e.num, into.den += e.den, into.n += e.n, into.bad += e.bad;
  };
  merge(e_o, eo), merge(e_lse, else_), merge(e_dq, edq), merge(e_dk, edk), merge(e_dv, edv);
  Err e_dbias;
  if (m.bias) {
    std::vector<float> got(nbias);
    CUDA_CHECK(cudaMemcpy(got.data(), d_dbias, nbias * 4, cudaMemcpyDeviceToHost));
    for (size_t x = 0; x < nbias; ++x) {
      double ref = 0;
      for (const auto& part : dbias_part) ref += part[x];
      e_dbias.add(got[x], ref);
    }
  }

  // Pad columns (strided cases) must still hold the poison: never written.
  bool pad_ok = true;
  if (c.pad) {
    for (Tensor* t : {&o, &dq, &dk, &dv})
      for (int b = 0; b < t->B; ++b)
        for (int l = 0; l < t->L; ++l)
          for (int h = 0; h < t->Hn; ++h)
            for (int d = c.H; d < c.H + c.pad; ++d)
              if (t->bits[t->idx(b, l, h, d)] != 0xFFFF) pad_ok = false;
  }
  for (Tensor* t : {&q, &k, &v, &dout, &o, &dq, &dk, &dv}) CUDA_CHECK(cudaFree(t->dev));
  CUDA_CHECK(cudaFree(lse));
  CUDA_CHECK(cudaFree(dq_accum));
  CUDA_CHECK(cudaFree(dpsum));
  dm.free();
  if (d_bias) {
    CUDA_CHECK(cudaFree(d_bias));
    CUDA_CHECK(cudaFree(d_dbias));
  }
  if (d_mask) CUDA_CHECK(cudaFree(d_mask));
  return {e_o.rel(), e_lse.rel(), e_dq.rel(), e_dk.rel(), e_dv.rel(), pad_ok, e_dbias.rel()};
}

// ---- benchmark --------------------------------------------------------------
__global__ void fill_random(uint16_t* x, size_t n, uint64_t seed, bool bf16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    const float u = float(h >> 40) * (1.f / 16777216.f) * 2.f - 1.f;  // [-1, 1)
    const float val = u * 1.7f;
    if (bf16) {
      __nv_bfloat16 b = __float2bfloat16(val);
      x[i] = *reinterpret_cast<uint16_t*>(&b);
    } else {
      __half b = __float2half(val);
      x[i] = *reinterpret_cast<uint16_t*>(&b);
    }
  }
}

__global__ void count_nonfinite(const uint16_t* x, size_t n, bool bf16, unsigned long long* out) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    // Exponent all ones: inf or NaN (bf16: 8 exponent bits, fp16: 5).
    const uint16_t e = bf16 ? (x[i] >> 7) & 0xFF : (x[i] >> 10) & 0x1F;
    c += bf16 ? (e == 0xFF) : (e == 0x1F);
  }
  atomicAdd(out, c);
}

struct Bench {
  Case c;
  double fwd_ms, bwd_ms, fwd_tflops, bwd_tflops, total_tflops;
  unsigned long long nonfinite;
};

static Bench bench(const Case& c, int iters) {
  const size_t nq = size_t(c.B) * c.T * c.N * c.H, nk = size_t(c.B) * c.S * c.K * c.H;
  const size_t rows = size_t(c.B) * c.T * c.N;
  uint16_t *q, *k, *v, *o, *dout, *dq, *dk, *dv;
  float *lse, *dq_accum, *dpsum;
  CUDA_CHECK(cudaMalloc(&q, nq * 2));
  CUDA_CHECK(cudaMalloc(&o, nq * 2));
  CUDA_CHECK(cudaMalloc(&dout, nq * 2));
  CUDA_CHECK(cudaMalloc(&dq, nq * 2));
  CUDA_CHECK(cudaMalloc(&k, nk * 2));
  CUDA_CHECK(cudaMalloc(&v, nk * 2));
  CUDA_CHECK(cudaMalloc(&dk, nk * 2));
  CUDA_CHECK(cudaMalloc(&dv, nk * 2));
  CUDA_CHECK(cudaMalloc(&lse, rows * 4));
  CUDA_CHECK(cudaMalloc(&dpsum, rows * 4));
  CUDA_CHECK(cudaMalloc(&dq_accum, nq * 4));
  fill_random<<<1024, 256>>>(q, nq, 1, c.bf16);
  fill_random<<<1024, 256>>>(k, nk, 2, c.bf16);
  fill_random<<<1024, 256>>>(v, nk, 3, c.bf16);
  fill_random<<<1024, 256>>>(dout, nq, 4, c.bf16);
  CUDA_CHECK(cudaGetLastError());

  AttnParams p;
  p.batch = c.B, p.seqlen_q = c.T, p.seqlen_k = c.S, p.num_heads = c.N, p.num_heads_k = c.K;
  p.head_dim = c.H, p.dtype = c.bf16 ? DType::kBF16 : DType::kF16;
  p.scale = 1.f / std::sqrt(float(c.H)), p.is_causal = c.causal;
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse, p.dout = dout, p.dq = dq, p.dk = dk, p.dv = dv;
  p.dq_accum = dq_accum, p.dpsum = dpsum;
  jaxattn::set_contiguous_strides(p);
  const DeviceMasks dm = upload_masks(c, p);

  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  auto time_it = [&](auto fn) {
    for (int i = 0; i < 2; ++i) check_launch(fn());
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> ts;
    for (int i = 0; i < iters; ++i) {
      CUDA_CHECK(cudaEventRecord(e0));
      check_launch(fn());
      CUDA_CHECK(cudaEventRecord(e1));
      CUDA_CHECK(cudaEventSynchronize(e1));
      float ms;
      CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    return double(ts[ts.size() / 2]);
  };
  Bench r{c};
  r.fwd_ms = time_it([&] { return run_fwd(p); });
  r.bwd_ms = time_it([&] { return run_bwd(p); });
  double flops = 4.0 * c.B * c.N * double(c.T) * c.S * c.H;
  if (c.causal) flops /= 2;
  r.fwd_tflops = flops / r.fwd_ms * 1e-9;
  r.bwd_tflops = 2.5 * flops / r.bwd_ms * 1e-9;
  r.total_tflops = 3.5 * flops / (r.fwd_ms + r.bwd_ms) * 1e-9;

  unsigned long long* cnt;
  CUDA_CHECK(cudaMalloc(&cnt, 8));
  CUDA_CHECK(cudaMemset(cnt, 0, 8));
  count_nonfinite<<<1024, 256>>>(o, nq, c.bf16, cnt);
  count_nonfinite<<<1024, 256>>>(dq, nq, c.bf16, cnt);
  count_nonfinite<<<1024, 256>>>(dk, nk, c.bf16, cnt);
  count_nonfinite<<<1024, 256>>>(dv, nk, c.bf16, cnt);
  CUDA_CHECK(cudaMemcpy(&r.nonfinite, cnt, 8, cudaMemcpyDeviceToHost));
  for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)dout, (void*)dq, (void*)dk,
                    (void*)dv, (void*)lse, (void*)dpsum, (void*)dq_accum, (void*)cnt})
    CUDA_CHECK(cudaFree(ptr));
  dm.free();
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  return r;
}

int main(int argc, char** argv) {
  // --profile-masked: only the separate 1024-token documents (B=16, H=128, causal) on
  // the masked kernel (one segment id per row), then on the plain one, 2 warm-up + 3
  // timed calls each: identical work for Nsight Compute, e.g. forward kernels 2 (masked)
  // and 7 (plain): ncu -k regex:flash_fwd_sm90 --launch-skip 2 --launch-count 1 ...
  bool quick = false, do_bench = true, do_check = true, h128 = false, sweep = false, packed = false,
       profile_masked = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--packed")) packed = true;
    if (!std::strcmp(argv[i], "--profile-masked")) profile_masked = true, do_check = false;
    if (!std::strcmp(argv[i], "--sm80")) g_sm90 = false;
    if (!std::strcmp(argv[i], "--sweep")) sweep = true;
    if (!std::strcmp(argv[i], "--h128")) h128 = true;
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--no-bench")) do_bench = false;
    if (!std::strcmp(argv[i], "--no-check")) do_check = false;
  }
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, cc %d.%d; kernels: %s\n", prop.name, prop.multiProcessorCount, prop.major,
              prop.minor, g_sm90 ? "Hopper where its dispatch rule takes the call, else portable" : "portable");

  //              B    T    S  N  K    H  bf16 causal pad
  std::vector<Case> cases = {
      {2, 256, 256, 4, 4, 64, true, false},
      {2, 256, 256, 4, 4, 64, true, true},
      {1, 197, 301, 6, 2, 128, true, true},
      {1, 301, 197, 4, 1, 128, false, true},
      {2, 130, 130, 2, 2, 32, false, false},
      {1, 100, 150, 4, 2, 40, true, true},
      {1, 257, 257, 2, 1, 96, true, false},
      {1, 200, 333, 4, 4, 80, false, true},
      {1, 200, 200, 4, 2, 192, true, true},
      {1, 190, 190, 2, 2, 256, true, false},
      {1, 129, 64, 2, 1, 256, false, true},
      {1, 77, 99, 3, 3, 200, true, false},
      {1, 50, 50, 2, 1, 8, true, true},
      {1, 1, 1, 1, 1, 128, true, false},
      {1, 1, 1000, 2, 1, 128, true, false},
      {1, 1000, 1, 2, 1, 64, true, true},
      {2, 512, 512, 4, 2, 128, true, false, 8},
      {1, 512, 512, 8, 1, 128, false, true},
      {1, 300, 300, 2, 2, 136, true, true, 24},
      {1, 640, 640, 2, 2, 128, true, true},
      // Masked kernels: window, lengths (a batch row with no query / no key),
      // soft cap, packed segments (ids of different packings for T != S).
      {2, 333, 257, 4, 2, 128, true, false, 0, {40, 5}},
      {2, 257, 333, 4, 2, 64, false, true, 0, {-1, -1, 100, 0}},
      {2, 300, 300, 4, 2, 128, false, true, 0, {-1, -1, 0, 170}},
      {2, 300, 300, 8, 2, 128, true, true, 0, {-1, -1, -1, -1, 5.f}},
      {2, 300, 300, 4, 4, 64, false, true, 0, {-1, -1, -1, -1, 0.f, 70, 70}},
      {2, 333, 257, 4, 1, 96, true, true, 0, {90, 0, 250, 200, 3.f, 50, 40}},
      {1, 200, 200, 2, 1, 256, true, false, 0, {30, 30, -1, -1, 0.f, 64, 64}},
      {1, 200, 200, 2, 1, 32, true, true, 0, {0, 0, 150, 180}},
      {2, 333, 257, 4, 2, 128, true, false, 0, {-1, -1, -1, -1, 0.f, 0, 0, true, true}},
      {2, 257, 333, 4, 1, 64, false, true, 0, {60, 10, 200, -1, 4.f, 0, 0, true, false}},
      {1, 300, 300, 4, 2, 256, true, true, 0, {-1, -1, -1, -1, 0.f, 70, 70, true, true}},
      // Segment ids: the exact id scan (no tables), and repeating documents (ids not sorted).
      {2, 300, 300, 4, 4, 64, false, true, 0, {-1, -1, -1, -1, 0.f, 70, 70, false, false, true}},
      {2, 333, 257, 4, 1, 128, true, false, 0, {-1, -1, 250, 200, 0.f, 50, 40, false, false, false, 3}},
      {2, 700, 700, 4, 2, 128, true, true, 0, {-1, -1, -1, -1, 0.f, 90, 90, false, false, false, 4}},
      {1, 500, 500, 4, 2, 64, true, true, 0, {-1, -1, -1, -1, 0.f, 30, 30, false, false, true, 5}},
      {1, 400, 400, 2, 1, 256, false, false, 0, {20, 20, -1, -1, 0.f, 64, 64, false, false, false, 2}},
      // Soft cap at head dim 256 (the wide kernels' masked path; the role split hands the
      // cap's gradient from one warpgroup to the other with P).
      {2, 300, 300, 4, 2, 256, false, false, 0, {-1, -1, -1, -1, 5.f}},
      {2, 333, 257, 4, 1, 256, true, true, 0, {90, 0, 250, 200, 3.f, 50, 40}},
  };
  if (quick) cases = {cases[2], cases[8], cases[9], cases[16]};
  if (sweep)
    cases = {cases[1],  cases[2],  cases[3],  cases[5],  cases[7],  cases[9],  cases[11],
             cases[16], cases[20], cases[24], cases[28], cases[30]};
  auto on_h128 = [](const Case& c) { return c.H > 96 && c.H <= 128; };
  if (h128) cases.erase(std::remove_if(cases.begin(), cases.end(), [&](const Case& c) { return !on_h128(c); }), cases.end());

  bool all_ok = true;
  std::vector<std::string> lines;
  if (do_check) {
    std::random_device rd;
    for (const Case& c : cases) {
      const Result r = run_case(c, (uint64_t(rd()) << 32) ^ rd());
      const double tol = c.bf16 ? 2e-2 : 4e-3;
      const double lse_tol = 1e-4;  // relative; lse is computed in f32
      const bool ok = r.o < tol && r.dq < tol && r.dk < tol && r.dv < tol && r.lse < lse_tol &&
                      r.dbias < tol && r.pad_intact;
      all_ok &= ok;
      char buf[320];
      std::snprintf(buf, sizeof buf, "%-40s o %.2e lse %.2e dq %.2e dk %.2e dv %.2e%s %s%s",
                    describe(c).c_str(), r.o, r.lse, r.dq, r.dk, r.dv,
                    c.m.bias ? (" dbias " + std::to_string(r.dbias)).c_str() : "", ok ? "ok" : "FAIL",
                    r.pad_intact ? "" : " (pad written)");
      std::printf("%s\n", buf);
      std::fflush(stdout);
      lines.push_back(buf);
    }
  }

  std::vector<Bench> benches;
  if (do_bench && !quick) {
    std::vector<Case> big = {
        {1, 16384, 16384, 16, 16, 128, true, false}, {1, 16384, 16384, 16, 16, 128, true, true},
        {4, 4096, 4096, 16, 16, 128, true, false},   {4, 4096, 4096, 16, 16, 128, true, true},
        {2, 8192, 8192, 16, 16, 64, true, false},    {2, 8192, 8192, 16, 16, 256, true, false},
        {1, 16384, 16384, 16, 16, 128, false, false},
    };
    if (h128) big.resize(2);
    if (packed) {
      // Packed documents (segment ids, per-document causal) vs the same documents
      // as a batch of separate sequences: 16 documents of 1000 tokens (tiles of
      // 128 rows straddle two documents) and of 1024 (they do not), H = 128, N = 16.
      big.clear();
      for (int doc : {1000, 1024}) {
        Masks seg;
        seg.q_doc = seg.kv_doc = doc;
        Masks scan = seg;
        scan.scan_ids = true;
        big.push_back({1, 16 * doc, 16 * doc, 16, 16, 128, true, true, 0, seg});
        big.push_back({16, doc, doc, 16, 16, 128, true, true});
        big.push_back({1, 16 * doc, 16 * doc, 16, 16, 128, true, true, 0, scan});
        big.push_back({16, doc, doc, 16, 16, 128, true, true});
        // The separate documents on the masked kernel (one id per row): its own cost.
        big.push_back({16, doc, doc, 16, 16, 128, true, true, 0, seg});
        big.push_back({16, doc, doc, 16, 16, 128, true, true});
      }
    }
    if (profile_masked) {
      Masks one;
      one.q_doc = one.kv_doc = 1024;
      big = {{16, 1024, 1024, 16, 16, 128, true, true, 0, one}, {16, 1024, 1024, 16, 16, 128, true, true}};
    }
    if (sweep) {
      big.clear();
      for (int H : {64, 128, 256})
        for (bool causal : {false, true}) big.push_back({1, 16384, 16384, 2048 / H, 2048 / H, H, true, causal});
    }
    for (const Case& c : big) {
      benches.push_back(bench(c, profile_masked ? 3 : 5));
      const Bench& b = benches.back();
      std::printf("bench %-40s fwd %.3f ms bwd %.3f ms\n", describe(c).c_str(), b.fwd_ms, b.bwd_ms);
      std::fflush(stdout);
    }
  }

  std::printf("\n===== results =====\n");
  for (const std::string& l : lines) std::printf("%s\n", l.c_str());
  for (const Bench& b : benches) {
    if (sweep)
      std::printf("sweep H%d %s fwd %.1f bwd %.1f total %.1f\n", b.c.H, b.c.causal ? "causal" : "full",
                  b.fwd_tflops, b.bwd_tflops, b.total_tflops);
    if (b.c.m.q_doc > 0)  // (the FLOP count of packed documents is not the dense one: times only)
      std::printf("%-40s fwd %.3f ms  bwd %.3f ms%s\n", describe(b.c).c_str(), b.fwd_ms, b.bwd_ms,
                  b.nonfinite ? " NONFINITE OUTPUTS" : "");
    else
      std::printf("%-40s fwd %6.1f  bwd %6.1f  fwd+bwd %6.1f TFLOP/s%s\n", describe(b.c).c_str(),
                  b.fwd_tflops, b.bwd_tflops, b.total_tflops, b.nonfinite ? " NONFINITE OUTPUTS" : "");
    all_ok &= b.nonfinite == 0;
  }
  if (packed || profile_masked)
    for (size_t i = 0; i + 1 < benches.size(); i += 2)
      std::printf("time / separate documents' time, %s: fwd %.2f  bwd %.2f  fwd+bwd %.2f\n",
                  describe(benches[i].c).c_str(), benches[i].fwd_ms / benches[i + 1].fwd_ms,
                  benches[i].bwd_ms / benches[i + 1].bwd_ms,
                  (benches[i].fwd_ms + benches[i].bwd_ms) / (benches[i + 1].fwd_ms + benches[i + 1].bwd_ms));
  std::printf("%s\n", all_ok ? "ALL OK" : "SOME FAILED");
  return all_ok ? 0 : 1;
}
