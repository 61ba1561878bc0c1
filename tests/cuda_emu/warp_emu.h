// A host emulation of the CUDA warp primitives the decode register loop uses, so that its
// real source (cuda/decode/decode_reg_loop.cuh, decode_swap_softmax.cuh) runs on a CPU:
// each CUDA thread is a std::thread; the warp-collective operations (mma.sync m16n8k16,
// movmatrix, the column reductions) exchange their operands through a per-warp buffer
// between two barriers, and are evaluated from the PTX ISA's fragment layouts. Global
// loads check that every address read lies inside a registered buffer.
// Used by tests/cuda_emu/reg_loop_check.cc (tests/test_cuda_emu.py builds and runs it).
#pragma once

#include <math.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#define __device__
#define __forceinline__ inline
#define __global__

struct uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
struct Dim3 {
  unsigned x, y, z;
};
inline thread_local Dim3 threadIdx{0, 0, 0};

inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Byte s[i] (a nibble's low 3 bits) of the 8 bytes {y, x} (x bytes 0-3) is byte i of the result.
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}

// CUDA's integer min / max (device functions the loop's page-id clamps use).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

namespace warp_emu {

// 16-bit element types standing in for __nv_bfloat16 / __half (2 bytes, bits only).
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline float bf16_to_float(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }
inline uint16_t float_to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
inline float f16_to_float(uint16_t h) {
  const uint32_t s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
  float v;
  if (e == 0) v = ldexpf(float(m), -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = ldexpf(float(m | 1024), int(e) - 25);
  return s ? -v : v;
}
inline uint16_t float_to_f16(float f) {  // round to nearest even (normal and subnormal range)
  const uint16_t s = signbit(f) ? 0x8000 : 0;
  f = fabsf(f);
  if (isnan(f)) return 0x7e00;
  if (f >= 65520.f) return s | 0x7c00;
  int e;
  frexpf(f, &e);                     // f = m * 2^e, m in [0.5, 1)
  const int ulp_exp = e < -13 ? -24 : e - 11;  // spacing of f16 values near f
  const float q = nearbyintf(ldexpf(f, -ulp_exp));  // (default rounding: to nearest even)
  const float r = ldexpf(q, ulp_exp);
  if (r == 0.f) return s;
  int er;
  const float mr = frexpf(r, &er);
  if (er < -13) return s | uint16_t(ldexpf(r, 24));           // subnormal
  return s | uint16_t(((er + 14) << 10) | (uint16_t(ldexpf(mr, 11)) & 1023));
}
template <typename E>
float to_float(uint16_t b) {
  if constexpr (std::is_same_v<E, Bf16>) return bf16_to_float(b);
  else return f16_to_float(b);
}
template <typename E>
uint16_t from_float(float f) {
  if constexpr (std::is_same_v<E, Bf16>) return float_to_bf16(f);
  else return float_to_f16(f);
}

// A barrier over the 32 threads of one warp (generation-counted, reusable).
class Barrier {
 public:
  void wait() {
    std::unique_lock<std::mutex> lk(mu_);
    const unsigned gen = gen_;
    if (++count_ == 32) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lk, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  unsigned count_ = 0, gen_ = 0;
};

// Per warp: the barrier and the operands each lane posts to a collective operation.
struct Warp {
  Barrier bar;
  uint32_t a[32][4], b[32][2];
  float f[32];
};
inline std::vector<Warp>& warps() {
  static std::vector<Warp> w(64);
  return w;
}
inline Warp& my_warp() { return warps()[threadIdx.x / 32]; }
inline int my_lane() { return int(threadIdx.x % 32); }

// Buffers global loads may read (bounds check); reads outside them are counted.
struct Region {
  const char* lo;
  size_t bytes;
};
inline std::vector<Region>& regions() {
  static std::vector<Region> r;
  return r;
}
// Whether bytes [p, p + n) lie inside one registered buffer.
inline bool inside_regions(const char* p, size_t n) {
  for (const auto& r : regions())
    if (p >= r.lo && p + n <= r.lo + r.bytes) return true;
  return false;
}
inline std::mutex& oob_mu() {
  static std::mutex m;
  return m;
}
inline long& oob_reads() {
  static long n = 0;
  return n;
}
// Addresses passed to prefetch.global.L2 (the register loop's warm-up), in call order.
inline std::vector<const char*>& prefetched() {
  static std::vector<const char*> v;
  return v;
}

}  // namespace warp_emu
