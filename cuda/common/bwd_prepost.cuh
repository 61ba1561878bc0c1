// The two small memory-bound kernels around every backward main kernel (sm80
// and sm90 alike): before it, dpsum = rowsum(dout * o) - dlse and dq_accum = 0;
// after it, dq = scale * dq_accum in the input dtype. Plus their launchers.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "common/ptx.h"

namespace jaxattn::cuda {

constexpr int kPrepWarps = 8;

// One warp per (b, t, n) row; lane l reads columns [8l, 8l+8) (head_dim <= 256).
template <typename Elem>
__global__ void __launch_bounds__(kPrepWarps * 32) flash_bwd_preprocess_kernel(const AttnParams p) {
  const int T = p.seqlen_q, N = p.num_heads, hd = p.head_dim;
  const int64_t rows = int64_t(p.batch) * T * N;
  const int64_t row = int64_t(blockIdx.x) * kPrepWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int n = int(row % N);
  const int64_t bt = row / N;
  const int t = int(bt % T), b = int(bt / T);
  const int64_t off = b * p.o_batch_stride + int64_t(t) * p.o_row_stride + n * p.o_head_stride;

  float acc = 0.f;
  const int col = lane * 8;
  if (col < hd) {
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.o) + off + col);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.dout) + off + col);
    const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = ptx::unpack2<Elem>(ow[i]), c = ptx::unpack2<Elem>(dw[i]);
      acc = fmaf(a.x, c.x, fmaf(a.y, c.y, acc));
    }
  }
  acc = ptx::warp_sum(acc);
  // The lse cotangent enters only here: dS = P * (dP - (rowsum(dout * o) - dlse)).
  if (lane == 0) p.dpsum[(int64_t(b) * N + n) * T + t] = acc - (p.dlse ? p.dlse[row] : 0.f);

  float4* dq = reinterpret_cast<float4*>(p.dq_accum + row * hd);
  for (int c = lane; c < hd / 4; c += 32) dq[c] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// dq[b, t, n, :] = scale * dq_accum[b, t, n, :]; one thread per 8 columns.
template <typename Elem>
__global__ void __launch_bounds__(256) flash_bwd_convert_dq_kernel(const AttnParams p) {
  const int T = p.seqlen_q, N = p.num_heads, hd = p.head_dim;
  const int chunks_per_row = hd / 8;
  const int64_t total = int64_t(p.batch) * T * N * chunks_per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks_per_row;
    const int col = int(i % chunks_per_row) * 8;
    const int n = int(row % N);
    const int64_t bt = row / N;
    const int t = int(bt % T), b = int(bt / T);
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + row * hd + col);
    const float4 x = src[0], y = src[1];
    const float s = p.scale;
    uint4 out;
    out.x = ptx::pack2<Elem>(x.x * s, x.y * s);
    out.y = ptx::pack2<Elem>(x.z * s, x.w * s);
    out.z = ptx::pack2<Elem>(y.x * s, y.y * s);
    out.w = ptx::pack2<Elem>(y.z * s, y.w * s);
    *reinterpret_cast<uint4*>(static_cast<Elem*>(p.dq) + b * p.q_batch_stride +
                              int64_t(t) * p.q_row_stride + n * p.q_head_stride + col) = out;
  }
}

// Enqueues flash_bwd_preprocess_kernel over every (b, t, n) row.
template <typename Elem>
cudaError_t launch_bwd_preprocess(const AttnParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.num_heads;
  if (rows == 0) return cudaSuccess;
  flash_bwd_preprocess_kernel<Elem>
      <<<unsigned((rows + kPrepWarps - 1) / kPrepWarps), kPrepWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

// Zeroes the deterministic mode's dQ ordering counters (a memset node under graph capture).
inline cudaError_t clear_dq_semaphore(const AttnParams& p, cudaStream_t stream) {
  const size_t n = size_t(p.batch) * p.num_heads * ((p.seqlen_q + kDqSemaphoreRows - 1) / kDqSemaphoreRows);
  return n ? cudaMemsetAsync(p.dq_semaphore, 0, n * sizeof(int32_t), stream) : cudaSuccess;
}

// Enqueues flash_bwd_convert_dq_kernel (grid-stride, capped grid).
template <typename Elem>
cudaError_t launch_bwd_convert_dq(const AttnParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.num_heads;
  const int64_t chunks = rows * (p.head_dim / 8);
  if (chunks == 0) return cudaSuccess;
  const int64_t blocks = (chunks + 255) / 256;
  flash_bwd_convert_dq_kernel<Elem>
      <<<unsigned(blocks < 65536 * 8 ? blocks : 65536 * 8), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jaxattn::cuda
