// Writing wgmma accumulator tiles into 128B-swizzled shared memory (the layout TMA
// stores and wgmma descriptors read): shared by the forward and backward epilogues
// and the backward's dS / dQ staging; reading a tile back as wgmma A fragments; and
// copying its first rows to global memory where a TMA store would write too many.
//
// A chunked tile is [chunks][rows][128 bytes]: chunk c at rows_addr + c * chunk_stride,
// row r at + r * 128, and the 16-byte unit u of a row stored at unit u ^ (r % 8).
#pragma once

#include <cstdint>

#include "common/ptx.h"

namespace jaxattn::sm90 {

// Packed 16-bit pairs of an accumulator tile of kCols columns (pk[2 j + h] = columns
// 8 j + 2 t, + 1 of row row + 8 h; the layout convert_p gives) -> chunked tile of
// 64-element chunks. row: this thread's h = 0 row (16 warp + g); t = lane % 4;
// col0: the tile column of the accumulator's column 0 (a multiple of 8).
template <int kCols>
__device__ __forceinline__ void store_packed_sw128(const uint32_t (&pk)[kCols / 4], uint32_t rows_addr,
                                                   uint32_t chunk_stride, int row, int t, int col0 = 0) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row + 8 * h;
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
      const int u = j + col0 / 8;  // 16-byte unit of the tile row
      const uint32_t addr = rows_addr + (u / 8) * chunk_stride + r * 128 + (((u % 8) ^ (r % 8)) * 16) + 4 * t;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pk[2 * j + h]) : "memory");
    }
  }
}

// f32 accumulator tile (acc[4 j + 2 h + e]) scaled by mul[h] -> 16-bit chunked tile.
template <typename Elem, int kCols>
__device__ __forceinline__ void store_acc_sw128(const float (&acc)[kCols / 2], const float (&mul)[2],
                                                uint32_t rows_addr, uint32_t chunk_stride, int row, int t) {
  uint32_t pk[kCols / 4];
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) pk[2 * j + h] = ptx::pack2<Elem>(acc[4 * j + 2 * h] * mul[h], acc[4 * j + 2 * h + 1] * mul[h]);
  store_packed_sw128<kCols>(pk, rows_addr, chunk_stride, row, t);
}

// f32 accumulator tile -> f32 chunked tile (32-element chunks), unscaled.
// A warp's 8-byte stores go out by half warps (rows g = 0..3 or 4..7, 32 bytes each):
// with every row writing its columns 8 j + 2 t, + 1 at the same j, rows g and g ^ 1
// hit the same two 16-byte units (the swizzle XORs the unit with the row), a 2-way
// bank conflict on every store (run 5 of session 14: 24% of the backward's shared
// store wavefronts). With kSpread, odd rows write the column group j ^ 2 (same
// 32-column chunk) when even rows write j: the four rows of a half warp then cover all
// eight units, at the cost of a select per value.
template <int kCols, bool kSpread = false>
__device__ __forceinline__ void store_acc_f32_sw128(const float (&acc)[kCols / 2], uint32_t rows_addr,
                                                    uint32_t chunk_stride, int row, int t) {
  static_assert(kCols % 32 == 0, "whole 32-column chunks");
  const bool odd = kSpread && (row & 1);
  const uint32_t flip = odd ? 2u : 0u;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row + 8 * h;
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
      // Columns 8 jj + 2 t, + 1 (jj = j ^ flip): chunk j / 4, unit 2 (jj % 4) + t / 2, byte 8 (t % 2).
      const uint32_t unit = ((2 * (j % 4)) ^ (2 * flip)) + t / 2;
      const uint32_t addr = rows_addr + (j / 4) * chunk_stride + r * 128 + ((unit ^ (r % 8)) * 16) + 8 * (t % 2);
      const int jo = j ^ 2;  // (compile-time) the column group odd rows write at this j
      const float x = odd ? acc[4 * jo + 2 * h] : acc[4 * j + 2 * h];
      const float y = odd ? acc[4 * jo + 2 * h + 1] : acc[4 * j + 2 * h + 1];
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
    }
  }
}

// The register A fragments (m64 x k16, K-major) of a warpgroup's 64 rows of a 16-bit
// chunked tile, kCols columns: frag[4 kk + i] for k-step kk, in the layout of an
// m16n8k16 A fragment per warp (the one convert_p gives: rows g / g + 8, columns 2 t
// and 2 t + 8 of the step). rows_addr: the warpgroup's row 0. ldmatrix.x4: lanes
// 8 m .. 8 m + 7 address matrix m (rows + 8 when m is odd, columns + 8 when m >= 2).
template <int kCols>
__device__ __forceinline__ void load_a_frags_sw128(uint32_t (&frag)[kCols / 4], uint32_t rows_addr,
                                                   uint32_t chunk_stride, int warp, int lane) {
  const int m = lane / 8, r = 16 * warp + lane % 8 + (m & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kCols / 16; ++kk) {
    const int u = 2 * kk + (m >> 1);  // 16-byte unit of the tile row
    const uint32_t addr = rows_addr + (u / 8) * chunk_stride + r * 128 + (((u % 8) ^ (r % 8)) * 16);
    uint32_t x[4];
    ptx::ldmatrix_x4(x, addr);
#pragma unroll
    for (int i = 0; i < 4; ++i) frag[4 * kk + i] = x[i];
  }
}

// Rows [0, rows) of a chunked 16-bit tile of kChunks chunks to global memory (row r
// at out + r * row_stride, chunk c at + 64 c elements) with 16-byte stores, by the
// 128 threads of a warpgroup (tid 0..127): the epilogues of tiles that end inside a
// warpgroup's 64 rows, where the rows after theirs belong to another tile.
template <int kChunks, typename Elem>
__device__ __forceinline__ void copy_rows_sw128(uint32_t rows_addr, uint32_t chunk_stride, int rows, Elem* out,
                                                int64_t row_stride, int tid) {
  for (int i = tid; i < rows * kChunks * 8; i += 128) {  // row r, chunk c, 16-byte unit u
    const int u = i % 8, c = (i / 8) % kChunks, r = i / (8 * kChunks);
    const uint4 x = ptx::ld_shared_u32x4(rows_addr + c * chunk_stride + r * 128 + ((u ^ (r % 8)) * 16));
    *reinterpret_cast<uint4*>(out + r * row_stride + c * 64 + u * 8) = x;
  }
}

}  // namespace jaxattn::sm90
