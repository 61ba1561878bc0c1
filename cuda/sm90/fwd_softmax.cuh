// Online softmax on a wgmma accumulator tile S (64 x kBlockN per warpgroup).
//
// Each thread holds two rows (h = 0: row g, h = 1: row g + 8 of its warp's 16) and,
// per row, kBlockN / 4 columns: s[4 j + 2 h + e] is column 8 j + 2 t + e. The row max
// and the scale*log2(e) factor fold into one FFMA before ex2.approx; the row sum is
// kept per thread (partial over its columns) and reduced over the quad only at the end.
#pragma once

#include <cmath>

#include "common/ptx.h"

namespace jaxattn::sm90 {

template <int kBlockN>
struct OnlineSoftmax {
  static constexpr int kRegs = kBlockN / 2;
  float row_max[2];  // raw logits max (unscaled), -inf before any visible key
  float row_sum[2];  // this thread's partial sum of exp

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[h] = -INFINITY;
      row_sum[h] = 0.f;
    }
  }

  // Replaces s by exp2(s * scale_log2 - max * scale_log2) with the running max updated;
  // returns in alpha[h] the factor by which the previous O rows and sums must be scaled.
  __device__ __forceinline__ void step(float (&s)[kRegs], float scale_log2, float (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = row_max[h];
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      mx = ptx::quad_max(mx);
      const float max_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
      alpha[h] = row_max[h] == -INFINITY ? 0.f : ptx::exp2_approx(row_max[h] * scale_log2 - max_scaled);
      row_max[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          x = ptx::exp2_approx(fmaf(x, scale_log2, -max_scaled));
          sum += x;
        }
      }
      row_sum[h] = row_sum[h] * alpha[h] + sum;
    }
  }

  // Full row sums over the quad; returns 1/sum (0 for a row with no visible key) and
  // the natural-log logsumexp of scale * logits (-inf for such a row).
  __device__ __forceinline__ void finalize(float scale, float (&inv_sum)[2], float (&lse)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = ptx::quad_sum(row_sum[h]);
      const bool empty = sum == 0.f || row_max[h] == -INFINITY;
      inv_sum[h] = empty ? 0.f : 1.f / sum;
      lse[h] = empty ? -INFINITY : row_max[h] * scale + logf(sum);
    }
  }
};

// Sets to -inf the logits of keys >= seqlen_k, and (kCausal) of keys > the query row.
// key0: first key of the tile; row0: query row of this thread's h = 0 row; t: lane % 4.
template <int kBlockN, bool kCausal>
__device__ __forceinline__ void apply_mask(float (&s)[kBlockN / 2], int key0, int row0, int t, int seqlen_k) {
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = key0 + 8 * j + 2 * t + e;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool masked = key >= seqlen_k || (kCausal && key > row0 + 8 * h);
        if (masked) s[4 * j + 2 * h + e] = -INFINITY;
      }
    }
  }
}

}  // namespace jaxattn::sm90
