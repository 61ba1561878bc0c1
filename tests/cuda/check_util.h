// Shared pieces of the standalone CUDA checks (tests/cuda/*_check.cu): error
// checking, the case description, host tensors with padded head slots (strided
// layouts; pad columns hold NaN bits that must never be read), a device-side
// random fill for benchmarks.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "half_bits.h"


struct Case {
  int B, T, S, N, K, H;
  bool bf16, causal;
  float scale_mult = 1.f;  // scale = scale_mult / sqrt(H); > 1 gives sharp softmax rows
  int pad = 0;             // extra elements per head slot (multiple of 8): strided tensors
};

static std::string describe(const Case& c) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "B%d T%d S%d N%d K%d H%d %s %s%s%s", c.B, c.T, c.S, c.N, c.K, c.H,
                c.bf16 ? "bf16" : "fp16", c.causal ? "causal" : "full", c.pad ? " strided" : "",
                c.scale_mult != 1.f ? " sharp" : "");
  return buf;
}

// [B, L, Hn, H] with head slot H + pad.
struct HostTensor {
  int B, L, Hn, H, pad;
  std::vector<uint16_t> bits;
  std::vector<float> val;  // rounded values (for the reference)
  int64_t hs() const { return H + pad; }
  int64_t rs() const { return hs() * Hn; }
  int64_t bs() const { return rs() * L; }
  size_t count() const { return size_t(bs()) * B; }
  size_t idx(int b, int l, int h, int d) const { return size_t(b * bs() + l * rs() + h * hs() + d); }
};

static HostTensor make_tensor(int B, int L, int Hn, int H, int pad, bool bf16, std::mt19937_64& rng) {
  HostTensor t{B, L, Hn, H, pad, {}, {}};
  t.bits.assign(t.count(), 0xFFFF);  // pad columns hold NaN: never to be read
  t.val.assign(t.count(), NAN);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (size_t i = 0; i < t.count(); ++i) {
    if (int64_t(i % t.hs()) >= H) continue;
    t.bits[i] = to_bits(nd(rng), bf16);
    t.val[i] = from_bits(t.bits[i], bf16);
  }
  return t;
}

__global__ void fill_random(uint16_t* p, size_t n, uint32_t seed, bool bf16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    const float f = (x & 0xFFFFFF) / float(1 << 24) * 2.f - 1.f;
    if (bf16) {
      __nv_bfloat16 h = __float2bfloat16(f);
      p[i] = *reinterpret_cast<uint16_t*>(&h);
    } else {
      __half h = __float2half(f);
      p[i] = *reinterpret_cast<uint16_t*>(&h);
    }
  }
}

