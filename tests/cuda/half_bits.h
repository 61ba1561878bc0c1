// Host-side bf16/fp16 <-> float conversions for the standalone CUDA checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

// The bits of x rounded to bf16 (or fp16).
static inline uint16_t to_bits(float x, bool bf16) {
  uint16_t r;
  if (bf16) {
    __nv_bfloat16 h = __float2bfloat16(x);
    std::memcpy(&r, &h, 2);
  } else {
    __half h = __float2half(x);
    std::memcpy(&r, &h, 2);
  }
  return r;
}

// The float value of bf16 (or fp16) bits.
static inline float from_bits(uint16_t b, bool bf16) {
  if (bf16) {
    __nv_bfloat16 h;
    std::memcpy(&h, &b, 2);
    return __bfloat162float(h);
  }
  __half h;
  std::memcpy(&h, &b, 2);
  return __half2float(h);
}
