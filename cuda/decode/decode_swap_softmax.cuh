// The online softmax of decode's swapped orientation (S^T = K Q^T, O^T += V^T P^T), shared by
// decode_mma_kernel's swap-AB drift loop (kV2SwapAB) and the register loop (kV2Regs,
// decode_reg_loop.cuh): one n8 tile of S^T, its 16 keys down the rows and 8 query rows across.
#pragma once

#include "common/ptx.h"
#include "decode/decode_common.cuh"

namespace jaxattn::cuda::decode {

// Lane (g, t4) holds s[2 hk + e] = S^T[key jw + g + 8 hk][query row 2 t4 + e], the raw dot
// products. Scales them to log2 units (and soft-caps them: cap > 0), masks the keys query row
// 2 t4 + e does not see (row_ok[e]: a real row; keys at or past j_end, after pos[e], or before
// its window of wl keys), updates the row's running max m[e] and this lane's part of its sum
// l[e] (the column's other keys sit in the lanes of the same t4), calls rescale(e, alpha) for
// the row's O^T accumulators, and returns P^T as the B operand of O^T += V^T P^T.
template <typename Elem, typename Rescale>
__device__ __forceinline__ void swap_softmax(float (&s)[4], float (&m)[2], float (&l)[2], const bool (&row_ok)[2],
                                             const int (&pos)[2], int jw, int j_end, int wl, float qk_scale,
                                             float cap, int g, Rescale&& rescale, uint32_t (&pt)[2]) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float x[2];
#pragma unroll
    for (int hk = 0; hk < 2; ++hk) {
      const int j = jw + g + 8 * hk;
      float v = s[2 * hk + e] * qk_scale;
      if (cap > 0.f) v = cap * kLog2e * tanhf(v * (kLn2 / cap));
      const bool ok = row_ok[e] && j < j_end && j <= pos[e] && (wl < 0 || j >= pos[e] - wl);
      x[hk] = ok ? v : -INFINITY;
    }
    const float mx = ptx::column_max(fmaxf(x[0], x[1]));
    const float m_new = fmaxf(m[e], mx);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // rows with nothing visible yet
    const float alpha = ptx::exp2_approx(m[e] - m_use);
    m[e] = m_new;
    x[0] = ptx::exp2_approx(x[0] - m_use);
    x[1] = ptx::exp2_approx(x[1] - m_use);
    l[e] = l[e] * alpha + x[0] + x[1];
    rescale(e, alpha);
    s[e] = x[0];
    s[2 + e] = x[1];
  }
  // P^T: the S^T fragment (rows keys, columns query rows) packed and transposed per 8x8 block.
  pt[0] = ptx::movmatrix_trans(ptx::pack2<Elem>(s[0], s[1]));
  pt[1] = ptx::movmatrix_trans(ptx::pack2<Elem>(s[2], s[3]));
}

}  // namespace jaxattn::cuda::decode
