// Scalar bit conversions between f32 and the 16-bit float formats (bf16,
// IEEE binary16), round-to-nearest-even, inf/nan preserved. Written with
// plain integer arithmetic so that loops over them auto-vectorize and so
// that they need no F16C / AVX512-BF16 instructions.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxattn::cpu {

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---- bf16 ------------------------------------------------------------------

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // nan: keep it a (quiet) nan
    return uint16_t((u >> 16) | 0x0040u);
  }
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(rounded >> 16);
}

// ---- f16 (IEEE binary16) ---------------------------------------------------

// Exact for every input, subnormals included: the 15 magnitude bits shifted
// into place form an f32 whose value is the half value times 2^-112.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t mag = h & 0x7fffu;
  uint32_t out = f32_to_bits(bits_to_f32(mag << 13) * 0x1p112f);
  if (mag >= 0x7c00u) out = (mag << 13) | 0x7f800000u;  // inf / nan
  return bits_to_f32(out | sign);
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf or nan
    return uint16_t(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  }
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520: inf
  if (a < 0x38800000u) {
    // Below the smallest normal half (2^-14): the result is a multiple of
    // 2^-24. Adding 0.5 (whose ulp is 2^-24) rounds |f| to that grid with
    // the hardware's round-to-nearest-even; the low bits are the result.
    const float t = bits_to_f32(a) + 0.5f;
    return uint16_t(sign | (f32_to_bits(t) - 0x3f000000u));
  }
  // Normal: rebias the exponent (127 -> 15) and round away 13 mantissa bits.
  const uint32_t r = a - 0x38000000u;
  return uint16_t(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
}

}  // namespace jaxattn::cpu
