// Building blocks of the CPU kernels (flash attention and decode), written on
// GCC vector extensions so that one source serves SSE2 (4 lanes), AVX2 (8) and
// AVX-512 (16): every function here is always_inline and instantiated only
// inside a worker compiled with the matching target attribute (isa.h).
//
// Internal only: include from flash_cpu.cc and decode_cpu.cc.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <utility>

#include "common/params.h"
#include "cpu/fast_exp.h"
#include "cpu/half_convert.h"

// Vector types passed by value between always-inlined helpers: no ABI issue.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace jaxattn::cpu::kern {

typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;
constexpr float kInf = std::numeric_limits<float>::infinity();

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }
inline int round_up(int a, int b) { return ceil_div(a, b) * b; }

template <class F>
JAXATTN_AI F vload(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof(F));
  return v;
}

template <class F>
JAXATTN_AI void vstore(float* p, const F& v) {
  std::memcpy(p, &v, sizeof(F));
}

template <class F>
JAXATTN_AI F vset1(float x) {
  return F{} + x;
}

template <class F>
JAXATTN_AI F vmax(const F& a, const F& b) {
  return a > b ? a : b;
}

template <class F>
JAXATTN_AI float hmax(const F& v) {
  float m = v[0];
  for (int i = 1; i < int(sizeof(F) / 4); ++i) m = v[i] > m ? v[i] : m;
  return m;
}

template <class F>
JAXATTN_AI float hsum(const F& v) {
  float s = v[0];
  for (int i = 1; i < int(sizeof(F) / 4); ++i) s += v[i];
  return s;
}

// 64-byte aligned, zero-initialized f32 scratch.
class Buf {
 public:
  Buf() = default;
  explicit Buf(size_t n) { resize(n); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() { release(); }
  void resize(size_t n) {
    release();
    n_ = n;
    if (n == 0) return;
    p_ = static_cast<float*>(::operator new(n * sizeof(float), std::align_val_t(64)));
    std::memset(p_, 0, n * sizeof(float));
  }
  float* data() { return p_; }
  float& operator[](size_t i) { return p_[i]; }

 private:
  void release() {
    if (p_) ::operator delete(p_, std::align_val_t(64));
    p_ = nullptr;
  }
  float* p_ = nullptr;
  size_t n_ = 0;
};

// ---- element conversions ------------------------------------------------------

// dst[h] = float(src[off + h]) * mul for h < n. Plain loops that GCC
// vectorizes in the calling target.
template <DType D>
JAXATTN_AI void load_row(const void* base, int64_t off, int n, float mul, float* __restrict dst) {
  if constexpr (D == DType::kF32) {
    const float* __restrict s = static_cast<const float*>(base) + off;
    for (int h = 0; h < n; ++h) dst[h] = s[h] * mul;
  } else if constexpr (D == DType::kBF16) {
    const uint16_t* __restrict s = static_cast<const uint16_t*>(base) + off;
    for (int h = 0; h < n; ++h) dst[h] = bits_to_f32(uint32_t(s[h]) << 16) * mul;
  } else {
    const uint16_t* __restrict s = static_cast<const uint16_t*>(base) + off;
    for (int h = 0; h < n; ++h) {
      const uint32_t x = s[h];
      const uint32_t mag = x & 0x7fffu;
      uint32_t u = f32_to_bits(bits_to_f32(mag << 13) * 0x1p112f);
      u = mag >= 0x7c00u ? ((mag << 13) | 0x7f800000u) : u;
      dst[h] = bits_to_f32(u | ((x & 0x8000u) << 16)) * mul;
    }
  }
}

// dst[off + h] = convert(src[h] * mul) for h < n (round to nearest even).
template <DType D>
JAXATTN_AI void store_row(const float* __restrict src, int n, float mul, void* base, int64_t off) {
  if constexpr (D == DType::kF32) {
    float* __restrict d = static_cast<float*>(base) + off;
    for (int h = 0; h < n; ++h) d[h] = src[h] * mul;
  } else if constexpr (D == DType::kBF16) {
    uint16_t* __restrict d = static_cast<uint16_t*>(base) + off;
    for (int h = 0; h < n; ++h) d[h] = f32_to_bf16(src[h] * mul);
  } else {
    uint16_t* __restrict d = static_cast<uint16_t*>(base) + off;
    for (int h = 0; h < n; ++h) d[h] = f32_to_f16(src[h] * mul);
  }
}

// ---- online softmax ---------------------------------------------------------------

// One key block of a row's online softmax: s[0 .. n) holds the row's logits in
// log2 units (n a multiple of the lane count, masked entries -inf). Updates
// the running max m and sum l, leaves the weights exp2(s - m) in s and
// returns the factor exp2(m_old - m_new) that rescales the row's output.
template <class F, class I>
JAXATTN_AI float online_softmax_row(float* __restrict s, int n, float& m, float& l) {
  constexpr int W = sizeof(F) / 4;
  F mv = vset1<F>(-kInf);
  for (int j = 0; j < n; j += W) mv = vmax(mv, vload<F>(s + j));
  const float row_max = hmax(mv);
  const float mnew = row_max > m ? row_max : m;
  const float muse = mnew == -kInf ? 0.f : mnew;
  const float alpha = std::exp2(m - muse);
  F sum = F{};
  for (int j = 0; j < n; j += W) {
    const F e = vexp2<F, I>(vload<F>(s + j) - muse);
    vstore(s + j, e);
    sum += e;
  }
  l = l * alpha + hsum(sum);
  m = mnew;
  return alpha;
}

// ---- transposed panels -------------------------------------------------------------

// One butterfly stage of a W x W transpose held in W vectors (vector i = row
// i, lane k = column k): for rows i with bit D clear, swaps element (i, k)
// with (i + D, k - D) where bit D of k is set. The log2(W) stages (D = W/2,
// ..., 1) together transpose the block; each is W two-source shuffles on
// constant masks.
template <int W, int D>
constexpr int transpose_mask(int k, bool upper) {
  return (k & D) ? (upper ? W + k : W + k - D) : (upper ? k + D : k);
}

template <class F, class I, int D, int... K>
JAXATTN_AI void transpose_stage(F* v, std::integer_sequence<int, K...>) {
  constexpr int W = sizeof...(K);
  constexpr I lo = {transpose_mask<W, D>(K, false)...};
  constexpr I hi = {transpose_mask<W, D>(K, true)...};
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) {
    if (i & D) continue;
    const F a = v[i], b = v[i + D];
    v[i] = __builtin_shuffle(a, b, lo);
    v[i + D] = __builtin_shuffle(a, b, hi);
  }
}

template <class F, class I, int D = sizeof(F) / 8>
JAXATTN_AI void transpose_block(F* v) {
  transpose_stage<F, I, D>(v, std::make_integer_sequence<int, int(sizeof(F) / 4)>{});
  if constexpr (D > 1) transpose_block<F, I, D / 2>(v);
}

// dst[h * ld + k] = rows[k * Hp + h] for h < H, k < W: a block of W rows
// (Hp = round_up(H, W) floats each, columns H .. Hp-1 finite) stored
// transposed, W x W at a time through registers (transpose_block).
template <class F, class I>
JAXATTN_AI void store_transposed(const float* __restrict rows, int H, float* __restrict dst, int64_t ld) {
  constexpr int W = sizeof(F) / 4;
  const int Hp = round_up(H, W);
  for (int h0 = 0; h0 < H; h0 += W) {
    F v[W];
#pragma GCC unroll 16
    for (int k = 0; k < W; ++k) v[k] = vload<F>(rows + k * Hp + h0);
    transpose_block<F, I>(v);
    const int nh = H - h0 < W ? H - h0 : W;
    for (int k = 0; k < nh; ++k) vstore<F>(dst + (h0 + k) * ld, v[k]);
  }
}

// Converts nk key rows of one head into a transposed panel dst[h * ld + jj]
// (h < H, jj < nk; keys contiguous, as S = Q K^T reads them), row jj read at
// element offset row_off(jj) of base. Columns nk .. round_up(nk, W) - 1 are
// written as 0, later ones are left as they are (ld >= round_up(nk, W)).
// rows: scratch of W * Hp floats (Hp = round_up(H, W)) whose columns H .. Hp-1
// are 0.
template <class F, class I, DType D, class RowOff>
JAXATTN_AI void pack_panel_t(const void* base, RowOff row_off, int nk, int H, float* __restrict rows,
                             float* __restrict dst, int64_t ld) {
  constexpr int W = sizeof(F) / 4;
  const int Hp = round_up(H, W);
  for (int j0 = 0; j0 < nk; j0 += W) {
    const int n = nk - j0 < W ? nk - j0 : W;
    for (int k = 0; k < n; ++k) load_row<D>(base, row_off(j0 + k), H, 1.f, rows + k * Hp);
    for (int k = n; k < W; ++k) std::memset(rows + k * Hp, 0, sizeof(float) * H);
    store_transposed<F, I>(rows, H, dst + j0, ld);
  }
}

// ---- register-blocked matrix product ----------------------------------------------

enum class Acc { kSet, kAdd, kScaleAdd };

// C[r][c] (op)= sum_{k < kd} A(r, k) * B[k * ldb + c], r < R, c < CV * W,
// with A(r, k) = a[r * ars + k * aks] (so a transposed A is just strides).
// kSet: C = AB; kAdd: C += AB; kScaleAdd: C = C * rs[r] + AB.
template <class F, int R, int CV, Acc MODE>
JAXATTN_AI void micro(int kd, const float* __restrict a, int64_t ars, int64_t aks,
                      const float* __restrict b, int64_t ldb, float* __restrict c, int64_t ldc,
                      const float* __restrict rs) {
  constexpr int W = sizeof(F) / 4;
  F acc[R][CV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int v = 0; v < CV; ++v) {
      if constexpr (MODE == Acc::kSet) {
        acc[r][v] = F{};
      } else if constexpr (MODE == Acc::kAdd) {
        acc[r][v] = vload<F>(c + r * ldc + v * W);
      } else {
        acc[r][v] = vload<F>(c + r * ldc + v * W) * rs[r];
      }
    }
  }
  for (int k = 0; k < kd; ++k) {
    F bv[CV];
#pragma GCC unroll 16
    for (int v = 0; v < CV; ++v) bv[v] = vload<F>(b + k * ldb + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float av = a[r * ars + k * aks];
#pragma GCC unroll 16
      for (int v = 0; v < CV; ++v) acc[r][v] += av * bv[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int v = 0; v < CV; ++v) vstore<F>(c + r * ldc + v * W, acc[r][v]);
  }
}

template <class F, int R, int CVMAX, Acc MODE>
JAXATTN_AI void micro_cv(int cv, int kd, const float* a, int64_t ars, int64_t aks, const float* b,
                         int64_t ldb, float* c, int64_t ldc, const float* rs) {
  static_assert(CVMAX >= 1 && CVMAX <= 4, "CVMAX in 1..4");
  if (cv == CVMAX) {
    micro<F, R, CVMAX, MODE>(kd, a, ars, aks, b, ldb, c, ldc, rs);
  } else if constexpr (CVMAX > 1) {
    if (cv == 1) micro<F, R, 1, MODE>(kd, a, ars, aks, b, ldb, c, ldc, rs);
    if constexpr (CVMAX > 2) {
      if (cv == 2) micro<F, R, 2, MODE>(kd, a, ars, aks, b, ldb, c, ldc, rs);
    }
    if constexpr (CVMAX > 3) {
      if (cv == 3) micro<F, R, 3, MODE>(kd, a, ars, aks, b, ldb, c, ldc, rs);
    }
  }
}

// C[m x nc] (op)= A(m x kd) B[kd x nc]; nc a multiple of the lane count.
template <class F, int R, int CVMAX, Acc MODE>
JAXATTN_AI void gemm(int m, int nc, int kd, const float* a, int64_t ars, int64_t aks,
                     const float* b, int64_t ldb, float* c, int64_t ldc,
                     const float* rs = nullptr) {
  constexpr int W = sizeof(F) / 4;
  const int nv = nc / W;
  for (int v0 = 0; v0 < nv; v0 += CVMAX) {
    const int cv = nv - v0 < CVMAX ? nv - v0 : CVMAX;
    const float* bb = b + v0 * W;
    float* cc = c + v0 * W;
    int r = 0;
    for (; r + R <= m; r += R) {
      micro_cv<F, R, CVMAX, MODE>(cv, kd, a + r * ars, ars, aks, bb, ldb, cc + r * ldc, ldc,
                                  rs ? rs + r : nullptr);
    }
    for (; r < m; ++r) {
      micro_cv<F, 1, CVMAX, MODE>(cv, kd, a + r * ars, ars, aks, bb, ldb, cc + r * ldc, ldc,
                                  rs ? rs + r : nullptr);
    }
  }
}

}  // namespace jaxattn::cpu::kern
