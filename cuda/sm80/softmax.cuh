// Masking and the online softmax of the sm80 kernels, on MMA accumulators
// (lane g = lane/4, t = lane%4 holds rows g, g+8 and columns 2t, 2t+1 of each
// m16n8 tile).
#pragma once

#include <cmath>

#include "common/mask.cuh"
#include "common/ptx.h"

namespace jaxattn::cuda::sm80 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Sets to -inf every element of a warp's logits tile that `masked(row, col)`
// rejects; row0/col0 are the global row and column of the tile's (0, 0).
template <int kM, int kN8, typename Masked>
__device__ __forceinline__ void apply_mask(float (&s)[kM][kN8][4], int row0, int col0, int lane,
                                           Masked masked) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kM; ++i)
#pragma unroll
    for (int j = 0; j < kN8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + i * 16 + g + 8 * (e >> 1);
        const int col = col0 + j * 8 + 2 * t + (e & 1);
        if (masked(row, col)) s[i][j][e] = -INFINITY;
      }
}

// Masked kernels with a soft cap or a bias: s becomes softcap(scale * s) +
// bias (cap * tanh(x / cap); cap = 0: no cap; the softmax then scales by 1).
// With kBias, the bias of (row, col) is row_ptr(row)[col * col_step], read
// where row_ptr(row) is non-null and col < col_limit (else 0: such pairs are
// invisible anyway); one row pointer per fragment row keeps the index math
// (and the registers) small.
template <bool kBias, int kM, int kN8, typename RowPtr>
__device__ __forceinline__ void prescale_logits(float (&s)[kM][kN8][4], int row0, int col0, int lane, float scale,
                                                float cap, RowPtr row_ptr, int64_t col_step, int col_limit) {
  const int g = lane >> 2, t = lane & 3;
  const float inv_cap = cap > 0.f ? 1.f / cap : 0.f;
#pragma unroll
  for (int i = 0; i < kM; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float* rp = kBias ? row_ptr(row0 + i * 16 + g + 8 * h) : nullptr;
#pragma unroll
      for (int j = 0; j < kN8; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[i][j][2 * h + c];
          x *= scale;
          if (cap > 0.f) x = softcap_forward(x, cap, inv_cap);
          if (kBias) {
            const int col = col0 + j * 8 + 2 * t + c;
            if (rp != nullptr && col < col_limit) x += __ldg(rp + col * col_step);
          }
        }
    }
}

// Masked kernels: sets to -inf every element with !visible(row, col) or,
// with segment ids (row_ids / col_ids non-null: the ids of rows [0,
// row_limit) and columns [0, col_limit)), whose row and column ids differ.
// The ids are read here (L1-cached), not held in registers across the MMAs.
template <int kM, int kN8, typename Visible>
__device__ __forceinline__ void apply_visibility(float (&s)[kM][kN8][4], int row0, int col0, int lane,
                                                 const int32_t* row_ids, int row_limit, const int32_t* col_ids,
                                                 int col_limit, Visible visible) {
  const int g = lane >> 2, t = lane & 3;
  int row_id[kM][2], col_id[kN8][2];
  if (row_ids != nullptr) {
#pragma unroll
    for (int i = 0; i < kM; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + i * 16 + g + 8 * h;
        row_id[i][h] = row < row_limit ? __ldg(row_ids + row) : -1;
      }
#pragma unroll
    for (int j = 0; j < kN8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = col0 + j * 8 + 2 * t + e;
        col_id[j][e] = col < col_limit ? __ldg(col_ids + col) : -1;
      }
  }
#pragma unroll
  for (int i = 0; i < kM; ++i)
#pragma unroll
    for (int j = 0; j < kN8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + i * 16 + g + 8 * (e >> 1);
        const int col = col0 + j * 8 + 2 * t + (e & 1);
        bool ok = visible(row, col);
        if (row_ids != nullptr) ok = ok && row_id[i][e >> 1] == col_id[j][e & 1];
        if (!ok) s[i][j][e] = -INFINITY;
      }
}

// Running softmax state of the 2*kM rows a lane shares with its quad:
// max of the raw logits and (lane-partial) sum of exp2(scale_log2*(s - max)).
template <int kM>
struct OnlineSoftmax {
  float row_max[kM][2];
  float row_sum[kM][2];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < kM; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[i][h] = -INFINITY;
        row_sum[i][h] = 0.f;
      }
  }

  // Folds one block of raw logits in: turns s into unnormalised
  // probabilities and rescales the output accumulator o to the new maxima
  // (skipped when no row of the warp got a new maximum: the factor is 1).
  // kAlways: rescale o unconditionally (no branch: the caller's independent
  // work, e.g. the next block's MMAs, can be scheduled across the update).
  template <bool kAlways = false, int kN8, int kO8>
  __device__ __forceinline__ void update(float (&s)[kM][kN8][4], float (&o)[kM][kO8][4],
                                         float scale_log2) {
    float corr[kM][2], block_sum[kM][2];
    bool changed = false;
#pragma unroll
    for (int i = 0; i < kM; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = row_max[i][h];
#pragma unroll
        for (int j = 0; j < kN8; ++j) mx = fmaxf(mx, fmaxf(s[i][j][2 * h], s[i][j][2 * h + 1]));
        mx = ptx::quad_max(mx);
        // Old terms shrink by 2^(scale_log2 (old - new)); none yet if old = -inf.
        const float old = row_max[i][h];
        changed |= mx != old;
        corr[i][h] = old == -INFINITY ? 0.f : ptx::exp2_approx((old - mx) * scale_log2);
        row_max[i][h] = mx;
        // A row with every key masked so far keeps p = 0 (exp2(-inf)).
        const float mx_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kN8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = ptx::exp2_approx(fmaf(s[i][j][2 * h + e], scale_log2, -mx_scaled));
            s[i][j][2 * h + e] = p;
            sum += p;
          }
        block_sum[i][h] = sum;
      }
    if (kAlways || __any_sync(0xffffffffu, changed)) {
#pragma unroll
      for (int i = 0; i < kM; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          row_sum[i][h] *= corr[i][h];
#pragma unroll
          for (int j = 0; j < kO8; ++j) {
            o[i][j][2 * h] *= corr[i][h];
            o[i][j][2 * h + 1] *= corr[i][h];
          }
        }
    }
#pragma unroll
    for (int i = 0; i < kM; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) row_sum[i][h] += block_sum[i][h];
  }

  // Ends the pass: per-row factor 1/sum for the output (0 for a row that saw
  // no key) and the natural-log logsumexp of the scaled logits (-inf then).
  __device__ __forceinline__ void finish(float scale, float (&inv)[kM][2],
                                         float (&lse)[kM][2]) {
#pragma unroll
    for (int i = 0; i < kM; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sum = ptx::quad_sum(row_sum[i][h]);
        const bool empty = !(sum > 0.f);
        inv[i][h] = empty ? 0.f : 1.f / sum;
        lse[i][h] = empty ? -INFINITY : row_max[i][h] * scale + logf(sum);
      }
  }
};

}  // namespace jaxattn::cuda::sm80
