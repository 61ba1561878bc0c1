// The two small memory-bound kernels around every backward main kernel (sm80
// and sm90 alike): before it, dpsum = rowsum(dout * o) - dlse and dq_accum = 0;
// after it, dq = scale * dq_accum in the input dtype. Plus their launchers.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "common/ptx.h"

namespace jaxattn::cuda {

constexpr int kPrepThreads = 256;

// The lanes that share one (b, t, n) row, 8 columns (16 bytes) each: the power of two
// >= head_dim / 8 (8 at 64, 16 at 128, 32 at 256; head_dim <= 256).
inline int prep_lanes_per_row(int head_dim) {
  int lanes = 1;
  while (lanes * 8 < head_dim) lanes *= 2;
  return lanes;
}

// Rows are numbered (b, n, t), t fastest, so the dpsum writes of a warp are
// contiguous; each row's O / dout reads (and dq_accum zeroes) are whole 16-byte
// pieces over `lanes` lanes, so every lane of every warp moves data (one warp per
// row left three quarters of the lanes idle at head dim 64: 1.9 TB/s on the H200).
template <typename Elem>
__global__ void __launch_bounds__(kPrepThreads) flash_bwd_preprocess_kernel(const AttnParams p, int lanes) {
  const int T = p.seqlen_q, N = p.num_heads, hd = p.head_dim;
  const int64_t rows = int64_t(p.batch) * T * N;
  const int64_t row = int64_t(blockIdx.x) * (kPrepThreads / lanes) + threadIdx.x / lanes;
  const int sub = threadIdx.x % lanes;  // lanes is a power of two <= 32: groups never straddle warps
  if (row >= rows) return;             // (whole groups leave together: the shuffles below stay in-group)
  const int t = int(row % T);
  const int64_t bn = row / T;
  const int n = int(bn % N), b = int(bn / N);
  const int64_t off = b * p.o_batch_stride + int64_t(t) * p.o_row_stride + n * p.o_head_stride;
  const int64_t btn = (int64_t(b) * T + t) * N + n;  // the [B, T, N] index (dlse, dq_accum rows)

  float acc = 0.f;
  const int col = sub * 8;
  if (col < hd) {
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.o) + off + col);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.dout) + off + col);
    float4* dq = reinterpret_cast<float4*>(p.dq_accum + btn * hd + col);
    dq[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    dq[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = ptx::unpack2<Elem>(ow[i]), c = ptx::unpack2<Elem>(dw[i]);
      acc = fmaf(a.x, c.x, fmaf(a.y, c.y, acc));
    }
  }
  const unsigned group = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1) << (threadIdx.x % 32 / lanes * lanes);
  for (int o = lanes / 2; o > 0; o /= 2) acc += __shfl_xor_sync(group, acc, o);
  // The lse cotangent enters only here: dS = P * (dP - (rowsum(dout * o) - dlse)).
  if (sub == 0) p.dpsum[row] = acc - (p.dlse ? p.dlse[btn] : 0.f);
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
  const int lanes = prep_lanes_per_row(p.head_dim), rows_per_block = kPrepThreads / lanes;
  flash_bwd_preprocess_kernel<Elem>
      <<<unsigned((rows + rows_per_block - 1) / rows_per_block), kPrepThreads, 0, stream>>>(p, lanes);
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
