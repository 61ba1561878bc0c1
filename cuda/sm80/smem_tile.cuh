// Shared-memory tiles of the sm80 kernels: global<->shared copies and the
// warp-level MMA loops that read their operands from them.
//
// Tiles are row-major [rows][kPitch] of 16-bit elements (see tile_config.cuh).
// MMA fragments come from ldmatrix.x4; two lane-address patterns cover all
// uses (r = lane & 7, q = lane >> 3):
//   pattern A: row r + 8*(q&1), col 8*(q>>1)  -- A operand stored [m][k], or
//              B operand stored [k][n] read with .trans (two n8 tiles);
//   pattern B: row r + 8*(q>>1), col 8*(q&1)  -- B operand stored [n][k]
//              (two n8 tiles), or A operand stored [k][m] read with .trans.
// The accumulator of an m16n8 MMA holds, in lane (g = lane/4, t = lane%4),
// rows g and g+8, columns 2t and 2t+1.
#pragma once

#include <cstdint>

#include "common/ptx.h"

namespace jaxattn::cuda::sm80 {

// Byte offset of this lane's ldmatrix row address, pattern A.
template <int kPitch>
__device__ __forceinline__ uint32_t lane_offset_a(int lane) {
  const int row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int col = (lane >> 4) * 8;
  return static_cast<uint32_t>((row * kPitch + col) * 2);
}

// Byte offset of this lane's ldmatrix row address, pattern B.
template <int kPitch>
__device__ __forceinline__ uint32_t lane_offset_b(int lane) {
  const int row = (lane & 7) + (lane >> 4) * 8;
  const int col = ((lane >> 3) & 1) * 8;
  return static_cast<uint32_t>((row * kPitch + col) * 2);
}

// Starts async copies of rows [0, kRows) of a strided [rows, head_dim] matrix
// (gmem points at its row 0) into a smem tile; rows >= valid_rows and columns
// >= head_dim are zero-filled, never read. Thread i copies the 16-byte chunk
// i % kChunksPerRow of rows i / kChunksPerRow + j * kRowsPerPass.
template <int kRows, int kHeadDim, int kPitch, int kThreads, typename Elem>
__device__ __forceinline__ void load_tile_async(Elem* smem, const Elem* gmem,
                                                int64_t row_stride, int valid_rows,
                                                int head_dim) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  constexpr int kPasses = (kRows + kRowsPerPass - 1) / kRowsPerPass;
  static_assert(kRowsPerPass > 0, "too few threads for a row");
  const int row = threadIdx.x / kChunksPerRow;
  const int col = (threadIdx.x % kChunksPerRow) * 8;
  if (row >= kRowsPerPass) return;  // (when kChunksPerRow does not divide kThreads)
  const Elem* src = gmem + row * row_stride + col;
  const uint32_t dst = ptx::smem_addr(smem) + (row * kPitch + col) * 2;
  const bool col_ok = col < head_dim;
#pragma unroll
  for (int j = 0; j < kPasses; ++j) {
    const int r = row + j * kRowsPerPass;
    if (kRows % kRowsPerPass == 0 || r < kRows) {
      const bool valid = col_ok && r < valid_rows;
      ptx::cp_async_16(dst + j * kRowsPerPass * kPitch * 2,
                       valid ? src + j * kRowsPerPass * row_stride : gmem, valid);
    }
  }
}

// Copies rows [0, valid_rows) and columns [0, head_dim) of a smem tile to a
// strided global matrix with 16-byte stores.
template <int kRows, int kHeadDim, int kPitch, int kThreads, typename Elem>
__device__ __forceinline__ void store_tile(const Elem* smem, Elem* gmem, int64_t row_stride,
                                           int valid_rows, int head_dim) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
  for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    if (kChunks % kThreads == 0 || c < kChunks) {
      const int row = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      if (row < valid_rows && col < head_dim) {
        *reinterpret_cast<uint4*>(gmem + row * row_stride + col) =
            *reinterpret_cast<const uint4*>(smem + row * kPitch + col);
      }
    }
  }
}

// Writes a warp's accumulator tile, times a per-row factor, into smem as
// 16-bit values; smem points at the warp's first row. row_scale[i][h] is the
// factor of rows i*16 + g + 8h.
template <typename Elem, int kPitch, int kM, int kN8>
__device__ __forceinline__ void acc_to_smem(const float (&acc)[kM][kN8][4],
                                            const float (&row_scale)[kM][2], Elem* smem,
                                            int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kM; ++i) {
#pragma unroll
    for (int j = 0; j < kN8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = i * 16 + g + 8 * h;
        const uint32_t v = ptx::pack2<Elem>(acc[i][j][2 * h] * row_scale[i][h],
                                            acc[i][j][2 * h + 1] * row_scale[i][h]);
        *reinterpret_cast<uint32_t*>(smem + row * kPitch + j * 8 + 2 * t) = v;
      }
    }
  }
}

// Rounds an accumulator (16 x 16*kKSteps per m-tile) to the A-operand
// fragments of a following MMA: the C layout of two adjacent n8 tiles is the
// A layout of one k16 step.
template <typename Elem, int kM, int kKSteps>
__device__ __forceinline__ void acc_to_a_frags(const float (&acc)[kM][2 * kKSteps][4],
                                               uint32_t (&a)[kM][kKSteps][4]) {
#pragma unroll
  for (int i = 0; i < kM; ++i) {
#pragma unroll
    for (int k = 0; k < kKSteps; ++k) {
      a[i][k][0] = ptx::pack2<Elem>(acc[i][2 * k][0], acc[i][2 * k][1]);
      a[i][k][1] = ptx::pack2<Elem>(acc[i][2 * k][2], acc[i][2 * k][3]);
      a[i][k][2] = ptx::pack2<Elem>(acc[i][2 * k + 1][0], acc[i][2 * k + 1][1]);
      a[i][k][3] = ptx::pack2<Elem>(acc[i][2 * k + 1][2], acc[i][2 * k + 1][3]);
    }
  }
}

// acc[kM*16 x kN8*8] += A B^T (kBRowsAreK false) or A B (true) over k in [0, kK):
// A = smem [m][k] (a_addr: pattern A, at the warp's first row); B = smem [n][k]
// (b_addr: pattern B, at row 0) or smem [k][n] read transposed (pattern A, at
// row 0 / the warp's first column).
template <typename Elem, int kM, int kN8, int kK, int kPitchA, int kPitchB, bool kBRowsAreK>
__device__ __forceinline__ void gemm_ss(float (&acc)[kM][kN8][4], uint32_t a_addr, uint32_t b_addr) {
  static_assert(kN8 % 2 == 0, "n tiles come in pairs");
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kM][4];
#pragma unroll
    for (int i = 0; i < kM; ++i) ptx::ldmatrix_x4(a[i], a_addr + (i * 16 * kPitchA + kk * 16) * 2);
#pragma unroll
    for (int jp = 0; jp < kN8 / 2; ++jp) {
      uint32_t b[4];
      if constexpr (kBRowsAreK) ptx::ldmatrix_x4_trans(b, b_addr + (kk * 16 * kPitchB + jp * 16) * 2);
      else ptx::ldmatrix_x4(b, b_addr + (jp * 16 * kPitchB + kk * 16) * 2);
#pragma unroll
      for (int i = 0; i < kM; ++i) {
        ptx::mma_16816<Elem>(acc[i][2 * jp], a[i], b[0], b[1]);
        ptx::mma_16816<Elem>(acc[i][2 * jp + 1], a[i], b[2], b[3]);
      }
    }
  }
}
template <typename Elem, int kM, int kN8, int kK, int kPitchA, int kPitchB>
__device__ __forceinline__ void gemm_ss_abt(float (&acc)[kM][kN8][4], uint32_t a_addr, uint32_t b_addr) {
  gemm_ss<Elem, kM, kN8, kK, kPitchA, kPitchB, false>(acc, a_addr, b_addr);
}

// acc[kM*16 x kN8*8] += A B, A = register fragments (kKSteps k16 steps),
// B = smem [k][n] read transposed (b_addr: pattern A, at row 0 / column 0).
template <typename Elem, int kM, int kN8, int kKSteps, int kPitchB>
__device__ __forceinline__ void gemm_rs_ab(float (&acc)[kM][kN8][4],
                                           const uint32_t (&a)[kM][kKSteps][4],
                                           uint32_t b_addr) {
  static_assert(kN8 % 2 == 0, "n tiles come in pairs");
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
    for (int jp = 0; jp < kN8 / 2; ++jp) {
      uint32_t b[4];
      ptx::ldmatrix_x4_trans(b, b_addr + (ks * 16 * kPitchB + jp * 16) * 2);
#pragma unroll
      for (int i = 0; i < kM; ++i) {
        ptx::mma_16816<Elem>(acc[i][2 * jp], a[i][ks], b[0], b[1]);
        ptx::mma_16816<Elem>(acc[i][2 * jp + 1], a[i][ks], b[2], b[3]);
      }
    }
  }
}

// acc[kM*16 x kN8*8] += A B, A = smem stored transposed [k][m] (a_addr:
// pattern B, at the warp's first column), B = smem [k][n] (b_addr: pattern
// A, at the warp's first column), k in [0, kK).
template <typename Elem, int kM, int kN8, int kK, int kPitchA, int kPitchB>
__device__ __forceinline__ void gemm_ss_atb(float (&acc)[kM][kN8][4], uint32_t a_addr,
                                            uint32_t b_addr) {
  static_assert(kN8 % 2 == 0, "n tiles come in pairs");
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kM][4];
#pragma unroll
    for (int i = 0; i < kM; ++i)
      ptx::ldmatrix_x4_trans(a[i], a_addr + (kk * 16 * kPitchA + i * 16) * 2);
#pragma unroll
    for (int jp = 0; jp < kN8 / 2; ++jp) {
      uint32_t b[4];
      ptx::ldmatrix_x4_trans(b, b_addr + (kk * 16 * kPitchB + jp * 16) * 2);
#pragma unroll
      for (int i = 0; i < kM; ++i) {
        ptx::mma_16816<Elem>(acc[i][2 * jp], a[i], b[0], b[1]);
        ptx::mma_16816<Elem>(acc[i][2 * jp + 1], a[i], b[2], b[3]);
      }
    }
  }
}

// acc += A B, A = smem [m][k], B = smem [k][n] read transposed (gemm_ss).
template <typename Elem, int kM, int kN8, int kK, int kPitchA, int kPitchB>
__device__ __forceinline__ void gemm_ss_ab(float (&acc)[kM][kN8][4], uint32_t a_addr, uint32_t b_addr) {
  gemm_ss<Elem, kM, kN8, kK, kPitchA, kPitchB, true>(acc, a_addr, b_addr);
}

// Sets acc to zero.
template <int kM, int kN8>
__device__ __forceinline__ void clear(float (&acc)[kM][kN8][4]) {
#pragma unroll
  for (int i = 0; i < kM; ++i)
#pragma unroll
    for (int j = 0; j < kN8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}

}  // namespace jaxattn::cuda::sm80
