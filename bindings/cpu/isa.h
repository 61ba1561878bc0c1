// Run-time choice of the CPU kernels' instruction set: workers are compiled
// once per target (GCC target attributes) and one is picked per call.
// JAXATTN_CPU_ISA=sse2|avx2|avx512 forces one (for testing).
#pragma once

#include <cstdlib>
#include <cstring>

#define JAXATTN_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi,bmi2")))
#define JAXATTN_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define JAXATTN_TARGET_SSE2

namespace jaxattn::cpu {

enum class CpuIsa { kSse2, kAvx2, kAvx512 };

inline CpuIsa detect_cpu_isa() {
  if (const char* env = std::getenv("JAXATTN_CPU_ISA")) {
    if (std::strcmp(env, "sse2") == 0) return CpuIsa::kSse2;
    if (std::strcmp(env, "avx2") == 0) return CpuIsa::kAvx2;
    if (std::strcmp(env, "avx512") == 0) return CpuIsa::kAvx512;
  }
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
    return CpuIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::kAvx2;
  return CpuIsa::kSse2;
}

}  // namespace jaxattn::cpu
