// Vectorized exp2 on GCC vector-extension types (f32 lanes).
//
// exp2(x) = 2^n * 2^f with n = round(x), f = x - n in [-0.5, 0.5]; 2^f is a
// degree-6 polynomial (relative error ~1e-7, about f32 rounding), 2^n is
// built in the exponent bits. Inputs are clamped to [-127, 127]; anything at
// or below -127 (-inf included) gives exactly 0, which is what a masked
// logit must give. A nan input gives nan.
#pragma once

#include <cstdint>

#define JAXATTN_AI inline __attribute__((always_inline))

namespace jaxattn::cpu {

// Polynomial for 2^f on [-0.5, 0.5], fitted (weighted least squares on
// Chebyshev nodes) for this file.
constexpr float kExp2C1 = 0.69314718246459961f;
constexpr float kExp2C2 = 0.24022647738456726f;
constexpr float kExp2C3 = 0.055503290146589279f;
constexpr float kExp2C4 = 0.0096183735877275467f;
constexpr float kExp2C5 = 0.0013399848248809576f;
constexpr float kExp2C6 = 0.00015370704932138324f;

// F: a float vector type (vector_size 16/32/64), I: the int32 vector type of
// the same size.
template <class F, class I>
JAXATTN_AI F vexp2(const F& xin) {
  F x = xin;
  x = x < -127.f ? F{} - 127.f : x;
  x = x > 127.f ? F{} + 127.f : x;
  // Round to nearest by the 1.5 * 2^23 trick; the integer n sits in the
  // low mantissa bits of t.
  const F t = x + 12582912.f;
  const F n = t - 12582912.f;
  const F f = x - n;
  F p = f * kExp2C6 + kExp2C5;
  p = p * f + kExp2C4;
  p = p * f + kExp2C3;
  p = p * f + kExp2C2;
  p = p * f + kExp2C1;
  p = p * f + 1.f;
  // A C-style cast between same-size vector types reinterprets the bits.
  const I ni = (I)t - int32_t(0x4b400000);
  const I e = (ni + 127) << 23;  // n = -127 -> bits 0 -> 0.0f
  return p * (F)e;
}

}  // namespace jaxattn::cpu
