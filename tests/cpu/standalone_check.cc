// Standalone check of the CPU flash-attention kernels (no JAX): compares
// flash_fwd / flash_bwd with a naive float64 reference on random inputs,
// over sizes, GQA ratios, head dims, causal or not, f32 / bf16 / f16 and
// strided layouts, then times T = S = 4096, B = 1, N = 8, H = 64.
//
//   standalone_check [--quick] [--no-bench] [--bench-only]
//
// Environment: JAXATTN_CPU_ISA (sse2|avx2|avx512) and JAXATTN_CPU_THREADS
// are read by the kernels themselves.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <sys/resource.h>

#include "common/params.h"
#include "cpu/flash_cpu.h"
#include "cpu/half_convert.h"
#include "cpu/parallel_for.h"

using jaxattn::AttnParams;
using jaxattn::DType;
namespace jc = jaxattn::cpu;

namespace {

const char* dtype_name(DType d) {
  return d == DType::kF32 ? "f32" : d == DType::kBF16 ? "bf16" : "f16";
}
size_t dtype_size(DType d) { return d == DType::kF32 ? 4 : 2; }
// Unit roundoff of the storage type.
double unit_roundoff(DType d) {
  return d == DType::kF32 ? std::ldexp(1.0, -24)
                          : d == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
}

// A tensor stored in a dtype, with a [B, L, Hd, D] layout given by strides.
struct Tensor {
  DType dt;
  int B, L, Hd, D;
  int64_t sb, sl, sh;  // strides in elements
  std::vector<uint8_t> raw;

  Tensor(DType dt_, int B_, int L_, int Hd_, int D_, bool padded)
      : dt(dt_), B(B_), L(L_), Hd(Hd_), D(D_) {
    const int hpad = padded ? 3 : 0, rpad = padded ? 5 : 0, bpad = padded ? 7 : 0;
    sh = D + hpad;
    sl = sh * Hd + rpad;
    sb = sl * L + bpad;
    raw.assign(size_t(std::max<int64_t>(sb * B, 1)) * dtype_size(dt), 0);
  }
  int64_t off(int b, int l, int h, int d) const { return b * sb + l * sl + h * sh + d; }
  size_t count() const { return raw.size() / dtype_size(dt); }
  double get_raw(size_t i) const {
    if (dt == DType::kF32) {
      float f;
      std::memcpy(&f, raw.data() + 4 * i, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, raw.data() + 2 * i, 2);
    return dt == DType::kBF16 ? jc::bf16_to_f32(h) : jc::f16_to_f32(h);
  }
  void set_raw(size_t i, float v) {
    if (dt == DType::kF32) {
      std::memcpy(raw.data() + 4 * i, &v, 4);
    } else {
      const uint16_t h = dt == DType::kBF16 ? jc::f32_to_bf16(v) : jc::f32_to_f16(v);
      std::memcpy(raw.data() + 2 * i, &h, 2);
    }
  }
  double get(int b, int l, int h, int d) const { return get_raw(size_t(off(b, l, h, d))); }
  void fill_random(std::mt19937& g, float sd) {
    std::normal_distribution<float> nd(0.f, sd);
    for (size_t i = 0; i < count(); ++i) set_raw(i, nd(g));
  }
  void poison() {  // every element, padding included, is a nan
    for (size_t i = 0; i < count(); ++i) set_raw(i, std::numeric_limits<float>::quiet_NaN());
  }
  bool is_element(size_t i) const {  // i is inside the logical tensor
    if (B == 0 || L == 0 || Hd == 0 || D == 0) return false;
    int64_t r = int64_t(i);
    const int b = int(r / sb);
    r -= b * sb;
    const int l = int(r / sl);
    r -= int64_t(l) * sl;
    const int h = int(r / sh);
    r -= int64_t(h) * sh;
    return b < B && l < L && h < Hd && r < D;
  }
};

struct Case {
  int B, T, S, N, K, H;
  bool causal;
  DType dt;
  bool padded;
  float scale_mul;  // scale = scale_mul / sqrt(H)
};

struct Ref {
  std::vector<double> o, lse, dq, dk, dv;  // dense [B, L, heads, H] / [B, T, N]
  // Largest sum of |terms| of one dq / dk element: dS = P * (dP - D) cancels
  // (fully when S = 1), so the f32 rounding error of a gradient scales with
  // this, not with the (possibly ~0) gradient itself.
  double dq_terms = 0, dk_terms = 0;
};

Ref reference(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v,
              const Tensor& dout, double scale) {
  const int B = c.B, T = c.T, S = c.S, N = c.N, H = c.H, K = c.K, G = N / K;
  Ref r;
  r.o.assign(size_t(B) * T * N * H, 0.0);
  r.lse.assign(size_t(B) * T * N, -INFINITY);
  r.dq.assign(size_t(B) * T * N * H, 0.0);
  r.dk.assign(size_t(B) * S * K * H, 0.0);
  r.dv.assign(size_t(B) * S * K * H, 0.0);
  std::vector<double> s(S), p(S), dp(S), qi(H), doi(H);
  std::vector<double> dq_abs(H), dk_abs(size_t(B) * S * K * H, 0.0);
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) {
      const int kh = n / G;
      for (int i = 0; i < T; ++i) {
        for (int h = 0; h < H; ++h) {
          qi[h] = q.get(b, i, n, h);
          doi[h] = dout.get(b, i, n, h);
        }
        double m = -INFINITY;
        for (int j = 0; j < S; ++j) {
          if (c.causal && j > i) {
            s[j] = -INFINITY;
            continue;
          }
          double acc = 0;
          for (int h = 0; h < H; ++h) acc += qi[h] * k.get(b, j, kh, h);
          s[j] = acc * scale;
          m = std::max(m, s[j]);
        }
        const size_t orow = ((size_t(b) * T + i) * N + n) * H;
        if (m == -INFINITY) continue;  // no visible key: o = 0, lse = -inf, grads 0
        double l = 0;
        for (int j = 0; j < S; ++j) l += s[j] == -INFINITY ? 0.0 : std::exp(s[j] - m);
        const double lse = m + std::log(l);
        r.lse[(size_t(b) * T + i) * N + n] = lse;
        for (int j = 0; j < S; ++j) p[j] = s[j] == -INFINITY ? 0.0 : std::exp(s[j] - lse);
        for (int j = 0; j < S; ++j)
          if (p[j] != 0)
            for (int h = 0; h < H; ++h) r.o[orow + h] += p[j] * v.get(b, j, kh, h);
        double D = 0;
        for (int h = 0; h < H; ++h) D += doi[h] * r.o[orow + h];
        std::fill(dq_abs.begin(), dq_abs.end(), 0.0);
        for (int j = 0; j < S; ++j) {
          if (p[j] == 0) continue;
          double acc = 0;
          for (int h = 0; h < H; ++h) acc += doi[h] * v.get(b, j, kh, h);
          const double ds = p[j] * (acc - D), ds_abs = p[j] * (std::fabs(acc) + std::fabs(D));
          const size_t krow = ((size_t(b) * S + j) * K + kh) * H;
          for (int h = 0; h < H; ++h) {
            r.dq[orow + h] += scale * ds * k.get(b, j, kh, h);
            r.dk[krow + h] += scale * ds * qi[h];
            r.dv[krow + h] += p[j] * doi[h];
            dq_abs[h] += std::fabs(scale * ds_abs * k.get(b, j, kh, h));
            dk_abs[krow + h] += std::fabs(scale * ds_abs * qi[h]);
          }
        }
        for (int h = 0; h < H; ++h) r.dq_terms = std::max(r.dq_terms, dq_abs[h]);
      }
    }
  for (double a : dk_abs) r.dk_terms = std::max(r.dk_terms, a);
  return r;
}

// max |x - ref| / max(1, floor, max |ref|) over the logical elements
// (inputs are unit normals, so 1 is the natural size of every output; floor
// is the sum of |terms| for dq / dk, so that a gradient that cancels to ~0,
// e.g. dk for S = 1, is judged against the size of what cancelled). Sets *bad on a nan/inf or
// on a written padding element.
double rel_err(const Tensor& x, const std::vector<double>& ref, bool* bad, double floor = 1.0) {
  double num = 0, den = 0;
  for (int b = 0; b < x.B; ++b)
    for (int l = 0; l < x.L; ++l)
      for (int h = 0; h < x.Hd; ++h)
        for (int d = 0; d < x.D; ++d) {
          const double got = x.get(b, l, h, d);
          const double want = ref[((size_t(b) * x.L + l) * x.Hd + h) * x.D + d];
          if (!std::isfinite(got)) *bad = true;
          num = std::max(num, std::fabs(got - want));
          den = std::max(den, std::fabs(want));
        }
  for (size_t i = 0; i < x.count(); ++i) {
    if (!x.is_element(i) && !std::isnan(x.get_raw(i))) *bad = true;  // wrote padding
  }
  return num / std::max({1.0, floor, den});
}

struct Result {
  double o, lse, dq, dk, dv;
  bool bad;
};

Result run_case(const Case& c, uint32_t seed) {
  std::mt19937 g(seed);
  Tensor q(c.dt, c.B, c.T, c.N, c.H, c.padded), k(c.dt, c.B, c.S, c.K, c.H, c.padded),
      v(c.dt, c.B, c.S, c.K, c.H, c.padded), o(c.dt, c.B, c.T, c.N, c.H, c.padded),
      dout(c.dt, c.B, c.T, c.N, c.H, c.padded), dq(c.dt, c.B, c.T, c.N, c.H, c.padded),
      dk(c.dt, c.B, c.S, c.K, c.H, c.padded), dv(c.dt, c.B, c.S, c.K, c.H, c.padded);
  q.fill_random(g, 1.f);
  k.fill_random(g, 1.f);
  v.fill_random(g, 1.f);
  dout.fill_random(g, 1.f);
  o.poison();
  dq.poison();
  dk.poison();
  dv.poison();
  std::vector<float> lse(size_t(c.B) * c.T * c.N, std::numeric_limits<float>::quiet_NaN());

  AttnParams p;
  p.batch = c.B;
  p.seqlen_q = c.T;
  p.seqlen_k = c.S;
  p.num_heads = c.N;
  p.num_heads_k = c.K;
  p.head_dim = c.H;
  p.dtype = c.dt;
  p.scale = float(c.scale_mul / std::sqrt(double(c.H)));
  p.is_causal = c.causal;
  p.q = q.raw.data();
  p.k = k.raw.data();
  p.v = v.raw.data();
  p.o = o.raw.data();
  p.lse = lse.data();
  p.dout = dout.raw.data();
  p.dq = dq.raw.data();
  p.dk = dk.raw.data();
  p.dv = dv.raw.data();
  p.q_batch_stride = q.sb, p.q_row_stride = q.sl, p.q_head_stride = q.sh;
  p.k_batch_stride = k.sb, p.k_row_stride = k.sl, p.k_head_stride = k.sh;
  p.v_batch_stride = v.sb, p.v_row_stride = v.sl, p.v_head_stride = v.sh;
  p.o_batch_stride = o.sb, p.o_row_stride = o.sl, p.o_head_stride = o.sh;

  jc::flash_fwd(p);
  jc::flash_bwd(p);

  const Ref r = reference(c, q, k, v, dout, double(p.scale));
  Result res{};
  res.bad = false;
  res.o = rel_err(o, r.o, &res.bad);
  res.dq = rel_err(dq, r.dq, &res.bad, r.dq_terms);
  res.dk = rel_err(dk, r.dk, &res.bad, r.dk_terms);
  res.dv = rel_err(dv, r.dv, &res.bad);
  double lerr = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(r.lse[i])) {
      if (!(std::isinf(lse[i]) && lse[i] < 0)) res.bad = true;
      continue;
    }
    if (!std::isfinite(lse[i])) res.bad = true;
    lerr = std::max(lerr, std::fabs(lse[i] - r.lse[i]) / std::max(1.0, std::fabs(r.lse[i])));
  }
  res.lse = lerr;
  return res;
}

// ---- conversion self-check (against the compiler's _Float16) ----------------

int check_conversions() {
  int fails = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    _Float16 x;
    const uint16_t hh = uint16_t(h);
    std::memcpy(&x, &hh, 2);
    const float want = float(x), got = jc::f16_to_f32(hh);
    if (!(std::memcmp(&want, &got, 4) == 0 || (std::isnan(want) && std::isnan(got)))) ++fails;
  }
  std::mt19937 g(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 4000000; ++i) {
    uint32_t u = bits(g);
    if (i % 4 == 1) u = (u & 0x80000000u) | (0x33000000u + (u % 0x14800000u));  // f16 range
    if (i % 4 == 2) u &= 0xffffe000u | (1u << 12);                             // f16 ties
    float f;
    std::memcpy(&f, &u, 4);
    const _Float16 x = _Float16(f);
    uint16_t want;
    std::memcpy(&want, &x, 2);
    const uint16_t got = jc::f32_to_f16(f);
    if (std::isnan(f) ? (got & 0x7fffu) <= 0x7c00u : got != want) ++fails;
    // bf16: nearest by double arithmetic, ties to even
    if (!std::isnan(f) && std::fabs(f) < 3.38e38f) {
      const uint16_t lo = uint16_t(u >> 16), hi = uint16_t(lo + 1);
      const double dl = std::fabs(double(jc::bf16_to_f32(lo)) - f);
      const double dh = std::fabs(double(jc::bf16_to_f32(hi)) - f);
      const uint16_t w = dl < dh ? lo : dh < dl ? hi : ((lo & 1) ? hi : lo);
      if (jc::f32_to_bf16(f) != w) ++fails;
    }
  }
  std::printf("conversion check: %d mismatches\n", fails);
  return fails;
}

// ---- timing -------------------------------------------------------------------

void bench(DType dt, bool causal, int reps) {
  const int B = 1, T = 4096, S = 4096, N = 8, K = 8, H = 64;
  std::mt19937 g(1);
  Tensor q(dt, B, T, N, H, false), k(dt, B, S, K, H, false), v(dt, B, S, K, H, false),
      o(dt, B, T, N, H, false), dout(dt, B, T, N, H, false), dq(dt, B, T, N, H, false),
      dk(dt, B, S, K, H, false), dv(dt, B, S, K, H, false);
  q.fill_random(g, 1.f);
  k.fill_random(g, 1.f);
  v.fill_random(g, 1.f);
  dout.fill_random(g, 1.f);
  std::vector<float> lse(size_t(B) * T * N);
  AttnParams p;
  p.batch = B, p.seqlen_q = T, p.seqlen_k = S, p.num_heads = N, p.num_heads_k = K;
  p.head_dim = H, p.dtype = dt, p.scale = 0.125f, p.is_causal = causal;
  jaxattn::set_contiguous_strides(p);
  p.q = q.raw.data(), p.k = k.raw.data(), p.v = v.raw.data(), p.o = o.raw.data();
  p.lse = lse.data(), p.dout = dout.raw.data(), p.dq = dq.raw.data();
  p.dk = dk.raw.data(), p.dv = dv.raw.data();
  // Min over reps of the wall time, and of the CPU time of all threads (the
  // latter is what to compare when other jobs share the machine).
  auto cpu_now = [] {
    rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + 1e-6 * u.ru_utime.tv_usec + u.ru_stime.tv_sec + 1e-6 * u.ru_stime.tv_usec;
  };
  double cpu_best = 0;
  auto time_min = [&](auto&& fn) {
    double best = 1e30;
    cpu_best = 1e30;
    for (int i = 0; i < reps; ++i) {
      const double c0 = cpu_now();
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::min(best, s);
      cpu_best = std::min(cpu_best, cpu_now() - c0);
    }
    return best;
  };
  jc::flash_fwd(p);  // warm up
  const double tf = time_min([&] { jc::flash_fwd(p); });
  const double cf = cpu_best;
  const double tb = time_min([&] { jc::flash_bwd(p); });
  const double cb = cpu_best;
  const double flops = 4.0 * B * N * double(T) * S * H * (causal ? 0.5 : 1.0);
  std::printf("bench %-4s %-6s T=S=4096 B=1 N=8 H=64 threads=%d: fwd %.3f s wall (%.1f GFLOP/s), %.3f s cpu | "
              "bwd %.3f s wall (%.1f GFLOP/s at 2.5x fwd flops), %.3f s cpu\n",
              dtype_name(dt), causal ? "causal" : "full", jc::num_threads(), tf, flops / tf * 1e-9, cf,
              tb, 2.5 * flops / tb * 1e-9, cb);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, do_bench = true, only_bench = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    if (a == "--no-bench") do_bench = false;
    if (a == "--bench-only") only_bench = true;
  }
  int failures = 0;
  if (!only_bench) {
    failures += check_conversions() != 0;

    // Sizes: every ordered pair from {1, 7, 129, 1000} (T != S, plus T == S).
    const int sizes[] = {1, 7, 129, 1000};
    const int heads[] = {8, 40, 64, 128, 256};
    struct NK { int N, K; };
    const NK groups[] = {{4, 4}, {4, 2}, {8, 2}, {8, 1}, {16, 2}, {3, 1}};  // ratio 1, 2, 4, 8(MQA), 8, 3(MQA)
    const DType dts[] = {DType::kF32, DType::kBF16, DType::kF16};
    std::vector<Case> cases;
    int idx = 0;
    for (int T : sizes)
      for (int S : sizes)
        for (DType dt : dts)
          for (int causal = 0; causal < 2; ++causal) {
            ++idx;
            if (quick && idx % 3 != 0) continue;
            Case c;
            c.T = T, c.S = S, c.dt = dt, c.causal = causal != 0;
            c.H = heads[idx % 5];
            const NK nk = groups[(idx / 5 + idx) % 6];
            c.N = nk.N, c.K = nk.K;
            c.B = idx % 3 == 0 ? 2 : 1;
            c.padded = idx % 2 == 0;
            c.scale_mul = idx % 7 == 0 ? 6.f : 1.f;  // some sharp softmaxes
            // Keep the float64 reference affordable.
            while (double(c.B) * c.T * c.S * c.N * c.H > 4e8 && c.N > c.K) c.N -= c.K;
            while (double(c.B) * c.T * c.S * c.N * c.H > 4e8 && c.B > 1) --c.B;
            cases.push_back(c);
          }
    // Extras: T=1 decode against long S, H=1, tiny odd shapes, no keys at all.
    cases.push_back({1, 1, 1000, 8, 1, 256, false, DType::kBF16, true, 1.f});
    cases.push_back({2, 7, 129, 4, 2, 1, true, DType::kF32, false, 1.f});
    cases.push_back({1, 129, 7, 2, 2, 3, true, DType::kF16, true, 1.f});
    cases.push_back({1, 65, 200, 2, 1, 17, true, DType::kF32, true, 30.f});
    cases.push_back({1, 10000, 3000, 2, 1, 8, true, DType::kBF16, false, 1.f});
    cases.push_back({1, 3000, 10000, 1, 1, 16, false, DType::kF32, true, 1.f});
    cases.push_back({1, 5, 0, 2, 1, 8, false, DType::kF32, false, 1.f});
    cases.push_back({1, 0, 5, 2, 1, 8, true, DType::kBF16, false, 1.f});

    double worst[3][5] = {};
    uint32_t seed = 1234;
    for (const Case& c : cases) {
      const Result r = run_case(c, seed++);
      const double u = unit_roundoff(c.dt);
      // Tolerance in units of the storage type's roundoff (outputs are
      // rounded once; dq/dk/dv also see the rounded o through D), with an
      // f32-arithmetic floor that grows with the logit magnitude (an f32
      // rounding of a logit of size L moves the softmax by ~L * 2^-24).
      const double f32_floor = 2e-6 * std::max(1.0, double(c.scale_mul));
      const double tol_o = std::max(2.0 * u, f32_floor), tol_g = std::max(8.0 * u, 10 * f32_floor);
      const bool ok = !r.bad && r.o <= tol_o && r.lse <= 1e-5 && r.dq <= tol_g &&
                      r.dk <= tol_g && r.dv <= tol_g;
      const int di = int(c.dt);
      const double errs[5] = {r.o, r.lse, r.dq, r.dk, r.dv};
      for (int e = 0; e < 5; ++e) worst[di][e] = std::max(worst[di][e], errs[e]);
      if (!ok) ++failures;
      std::printf("%s B=%d T=%4d S=%4d N=%2d K=%2d H=%3d %-6s %-4s %s scale*%-4g | o %.2e lse %.2e dq %.2e dk %.2e dv %.2e%s\n",
                  ok ? "ok  " : "FAIL", c.B, c.T, c.S, c.N, c.K, c.H,
                  c.causal ? "causal" : "full", dtype_name(c.dt), c.padded ? "strided" : "dense  ",
                  double(c.scale_mul), r.o, r.lse, r.dq, r.dk, r.dv, r.bad ? "  (nan/inf or padding written)" : "");
      std::fflush(stdout);
    }
    for (int d = 0; d < 3; ++d) {
      std::printf("worst %-4s (max|err|/max(1,max|ref|,[dq,dk: max sum|terms|])): o %.2e lse %.2e dq %.2e dk %.2e dv %.2e  (unit roundoff %.1e)\n",
                  dtype_name(DType(d)), worst[d][0], worst[d][1], worst[d][2], worst[d][3],
                  worst[d][4], unit_roundoff(DType(d)));
    }
    std::printf("%zu cases, %d failures\n", cases.size(), failures);
  }
  if (do_bench) {
    bench(DType::kF32, false, 3);
    bench(DType::kBF16, false, 3);
    bench(DType::kF32, true, 3);
    bench(DType::kBF16, true, 3);
  }
  return failures == 0 ? 0 : 1;
}
