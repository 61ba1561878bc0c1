// Division by a divisor fixed for a whole launch (computed once on the host):
// q = n / d for 0 <= n < 2^31 as one multiply-high, one add and one shift
// (Granlund and Montgomery's round-up method), where a division by a run-time
// divisor costs ~10 instructions and several registers. The persistent Hopper
// forward's producer thread (24 registers) maps tile numbers with it.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define JAXATTN_HD __host__ __device__ __forceinline__
#else
#define JAXATTN_HD inline  // (host-only users, e.g. tests)
#endif

namespace jaxattn {

struct FastDiv {
  uint32_t d = 1, mul = 1, shift = 0;  // (d = 1: mul = 1, shift = 0 gives n)

  FastDiv() = default;
  // d in [1, 2^31).
  explicit FastDiv(uint32_t divisor) : d(divisor) {
    while ((uint64_t(1) << shift) < d) ++shift;  // ceil(log2 d)
    mul = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  JAXATTN_HD uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(n, mul);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t(n) * mul) >> 32);
#endif
    return (hi + n) >> shift;
  }
};

}  // namespace jaxattn
