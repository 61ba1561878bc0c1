// Host stand-in for cuda/common/ptx.h (tests/cuda_emu: the decode register loop's real
// source compiled for a CPU): the same names, evaluated by warp_emu.h's emulation.
#pragma once

#include <type_traits>

#include "warp_emu.h"

namespace jaxattn::ptx {

// mma.sync.aligned.m16n8k16.row.col.f32: A 16x16 (lane 4 g + t: a[0] = A[g][2t..2t+1],
// a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]), B 16x8 (b0 = B[2t..2t+1][g],
// b1 = B[2t+8..2t+9][g]), D (d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..]).
template <typename Elem>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto& w = warp_emu::my_warp();
  const int lane = warp_emu::my_lane();
  for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  w.bar.wait();
  auto half = [](uint32_t v, int h) { return warp_emu::to_float<Elem>(uint16_t(h ? v >> 16 : v & 0xffff)); };
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = half(w.a[l][0], h);
      A[g + 8][2 * t + h] = half(w.a[l][1], h);
      A[g][2 * t + 8 + h] = half(w.a[l][2], h);
      A[g + 8][2 * t + 8 + h] = half(w.a[l][3], h);
      B[2 * t + h][g] = half(w.b[l][0], h);
      B[2 * t + 8 + h][g] = half(w.b[l][1], h);
    }
  }
  w.bar.wait();
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i / 2), c = 2 * t + i % 2;
    double s = d[i];
    for (int k = 0; k < 16; ++k) s += double(A[r][k]) * B[k][c];
    d[i] = float(s);
  }
}

// movmatrix.sync.aligned.m8n8.trans.b16: lane 4 g + t holds row g, columns 2t, 2t + 1.
inline uint32_t movmatrix_trans(uint32_t x) {
  auto& w = warp_emu::my_warp();
  const int lane = warp_emu::my_lane();
  w.a[lane][0] = x;
  w.bar.wait();
  const int g = lane / 4, t = lane % 4;
  auto elem = [&](int r, int c) { return uint32_t(c % 2 ? w.a[4 * r + c / 2][0] >> 16 : w.a[4 * r + c / 2][0] & 0xffff); };
  const uint32_t out = elem(2 * t, g) | (elem(2 * t + 1, g) << 16);
  w.bar.wait();
  return out;
}

template <typename Elem>
inline uint32_t pack2(float lo, float hi) {
  return uint32_t(warp_emu::from_float<Elem>(lo)) | (uint32_t(warp_emu::from_float<Elem>(hi)) << 16);
}

inline float exp2_approx(float x) { return exp2f(x); }

// Reductions over the 8 lanes that share lane % 4.
template <typename Op>
inline float column_reduce(float x, Op op) {
  auto& w = warp_emu::my_warp();
  const int lane = warp_emu::my_lane();
  w.f[lane] = x;
  w.bar.wait();
  float r = w.f[lane % 4];
  for (int l = lane % 4 + 4; l < 32; l += 4) r = op(r, w.f[l]);
  w.bar.wait();
  return r;
}
inline float column_max(float x) { return column_reduce(x, [](float a, float b) { return fmaxf(a, b); }); }
inline float column_sum(float x) { return column_reduce(x, [](float a, float b) { return a + b; }); }

// ld.global.nc of 16 bytes (zeros when !valid); counts reads outside the registered buffers.
template <bool kL2Line = false>
inline uint4 ldg_stream_16(const void* gmem, bool valid) {
  if (!valid) return make_uint4(0, 0, 0, 0);
  const char* p = static_cast<const char*>(gmem);
  if (warp_emu::inside_regions(p, 16)) {
    uint4 v;
    std::memcpy(&v, p, 16);
    return v;
  }
  std::lock_guard<std::mutex> lk(warp_emu::oob_mu());
  ++warp_emu::oob_reads();
  return make_uint4(0, 0, 0, 0);
}

// ld.global.cg of an int32 (a plain read here).
inline int32_t ldg_l2_only_s32(const int32_t* gmem) { return *gmem; }

// prefetch.global.L2: recorded (warp_emu::prefetched) and counted as an out-of-bounds read
// when its 128-byte line is not inside a registered buffer.
inline void prefetch_l2(const void* gmem) {
  const char* p = static_cast<const char*>(gmem);
  std::lock_guard<std::mutex> lk(warp_emu::oob_mu());
  warp_emu::prefetched().push_back(p);
  if (!warp_emu::inside_regions(p, 128)) ++warp_emu::oob_reads();
}

}  // namespace jaxattn::ptx
