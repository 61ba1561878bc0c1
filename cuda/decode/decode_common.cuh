// Shared pieces of the CUDA decode kernels (decode_kernel.cuh, the CUDA-core
// version 1; decode_mma_kernel.cuh, the tensor-core version 2): the split
// plan, the visible key range of a row, 16-bit output rounding, and the
// logsumexp combine kernel that merges the split-KV partial outputs.
//
// Split workspace (both versions): split_o [B, K, num_splits, rows, H] holds
// each chunk's normalised partial output, split_lse [B, K, num_splits, rows]
// its logsumexp in log2 units (-inf for a chunk with no visible key); rows =
// Tq * G, row r = i * G + g (query i, head kh * G + g).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/params.h"
#include "common/ptx.h"
#include "decode/decode_plan.h"

namespace jaxattn::cuda::decode {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

template <bool kBf16>
__device__ __forceinline__ uint16_t to_half_bits(float x) {
  if constexpr (kBf16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  } else {
    return __half_as_ushort(__float2half_rn(x));
  }
}

// The keys any query of a row of length `length` (as stored: clamped here) may see: [lo, len).
__device__ __forceinline__ void keys_of_length(const AttnParams& p, int length, int* lo, int* len) {
  const int l = min(max(length, 0), p.seqlen_k);
  int first = 0;
  if (p.window_left >= 0) first = max(0, l - p.seqlen_q - p.window_left);
  *lo = min(first, l);
  *len = l;
}

// The keys any query of row b may see: [lo, len).
__device__ __forceinline__ void row_keys(const AttnParams& p, int b, int* lo, int* len) {
  keys_of_length(p, p.kv_lengths[b], lo, len);
}

// The keys [*j_begin, *j_end) of chunk `split` of a row whose visible keys are
// [lo, len) (lo rounded down to the loop's alignment): chunks of plan.chunk keys,
// or with plan.adaptive the row's own keys cut into plan.splits chunks of a
// multiple of 64 keys (at most plan.chunk).
__device__ __forceinline__ void chunk_keys(const DecodePlan& plan, int split, int lo, int len, int* j_begin,
                                           int* j_end) {
  int chunk = plan.chunk;
  if (plan.adaptive) {
    const int per = (len - lo + plan.splits - 1) / plan.splits;
    chunk = min(plan.chunk, max(64, (per + 63) / 64 * 64));
  }
  *j_begin = min(len, lo + split * chunk);
  *j_end = min(len, *j_begin + chunk);
}

// One CTA per (query row of a KV head, KV head, batch row); thread h merges
// element h of the plan.splits partial outputs.
template <bool kBf16>
__global__ void decode_combine_kernel(const __grid_constant__ AttnParams p, const DecodePlan plan) {
  ptx::griddep_wait();  // launched programmatically after the split kernel (plan.pdl): its partials
  // plan.warm: the next grid (the next decode call's) may launch now; its CTAs prefetch
  // their first keys while this grid finishes, then wait for it.
  if (plan.warm > 0) ptx::griddep_launch_dependents();
  const int row = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  const int G = p.num_heads / p.num_heads_k, K = p.num_heads_k, H = p.head_dim;
  const int64_t slot0 = ((int64_t(b) * K + kh) * p.num_splits) * plan.rows + row;
  float M = -INFINITY;
  for (int s = 0; s < plan.splits; ++s) M = fmaxf(M, p.split_lse[slot0 + int64_t(s) * plan.rows]);
  float L = 0.f;
  if (M != -INFINITY) {
    for (int s = 0; s < plan.splits; ++s) L += exp2f(p.split_lse[slot0 + int64_t(s) * plan.rows] - M);
  }
  const int i = row / G, n = kh * G + row % G;
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    float o = 0.f;
    if (L > 0.f) {
      for (int s = 0; s < plan.splits; ++s) {
        const int64_t slot = slot0 + int64_t(s) * plan.rows;
        const float w = exp2f(p.split_lse[slot] - M);
        if (w > 0.f) o += w * p.split_o[slot * H + h];
      }
      o /= L;
    }
    static_cast<uint16_t*>(p.o)[b * p.o_batch_stride + i * p.o_row_stride + n * p.o_head_stride + h] =
        to_half_bits<kBf16>(o);
  }
  if (threadIdx.x == 0) {
    p.lse[(int64_t(b) * p.seqlen_q + i) * p.num_heads + n] = L > 0.f ? (M + log2f(L)) * kLn2 : -INFINITY;
  }
}

}  // namespace jaxattn::cuda::decode
