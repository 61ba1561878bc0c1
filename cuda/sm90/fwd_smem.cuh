// Addresses of the Hopper forward's shared-memory tiles and mbarriers (layout in
// fwd_traits.cuh), plus the stage/phase counter of the K/V ring.
#pragma once

#include <cstdint>

namespace jaxattn::sm90 {

template <class Tr>
struct FwdSmem {
  uint32_t base;  // 1024-aligned shared address

  __device__ __forceinline__ uint32_t q(int b = 0) const { return base + Tr::kOffQ + b * Tr::kQBytes; }
  __device__ __forceinline__ uint32_t k(int s) const { return base + Tr::kOffK + s * Tr::kKVBytes; }
  __device__ __forceinline__ uint32_t v(int s) const { return base + Tr::kOffV + s * Tr::kKVBytes; }
  // The epilogue's O staging: its own buffer (Tr::kSeparateO) or the Q tile.
  __device__ __forceinline__ uint32_t o() const { return Tr::kSeparateO ? base + Tr::kOffO : q(); }
  // mbarriers: Q buffer b loaded; K/V stage s full (TMA landed) / empty (both consumers done).
  static constexpr int kQB = Tr::kQBuffers;
  __device__ __forceinline__ uint32_t bar_q(int b = 0) const { return base + Tr::kOffBar + 8 * b; }
  __device__ __forceinline__ uint32_t bar_k_full(int s) const { return bar_q() + 8 * (kQB + s); }
  __device__ __forceinline__ uint32_t bar_k_empty(int s) const { return bar_q() + 8 * (kQB + Tr::kStages + s); }
  __device__ __forceinline__ uint32_t bar_v_full(int s) const { return bar_q() + 8 * (kQB + 2 * Tr::kStages + s); }
  __device__ __forceinline__ uint32_t bar_v_empty(int s) const { return bar_q() + 8 * (kQB + 3 * Tr::kStages + s); }
  // Persistent grid: the Q tile is free for the next tile (after the epilogue's O
  // staging has been read; with Tr::kSeparateO, after the tile's last S wgmma).
  __device__ __forceinline__ uint32_t bar_q_empty(int b = 0) const {
    return bar_q() + 8 * (kQB + 4 * Tr::kStages + b);
  }
};

// The Q buffer and its load's parity for the j-th tile of a persistent CTA.
template <class Tr>
__device__ __forceinline__ int q_buffer(int j) {
  return Tr::kQBuffers == 2 ? (j & 1) : 0;
}
template <class Tr>
__device__ __forceinline__ uint32_t q_parity(int j) {
  return Tr::kQBuffers == 2 ? (uint32_t)((j >> 1) & 1) : (uint32_t)(j & 1);
}

// Position in the K/V ring: the stage, and the parity of its current fill.
template <int kStages>
struct PipeState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// One unit of work: a kBlockM-row query tile of one (batch, head), and its key range.
// Masked kernels: the tile is rows [row0, row_end) (at most kBlockM; row0 = m_block *
// kBlockM except for document tiles, common/doc_tiles.h), and key block n holds keys
// key0 + n * kBlockN .. + kBlockN - 1 (key0 > 0 for document tiles, whose blocks
// start at their document's first visible key). The other kernels leave row0 /
// row_end unset and key0 = 0.
struct FwdTile {
  int m_block, head, batch;
  int n_blocks;     // key blocks n_begin .. n_blocks-1 are visible to some row of the tile
  int n_begin = 0;  // (masked kernels: > 0 with a window or segments; empty when n_begin >= n_blocks)
  int row0 = 0, row_end = 0;
  int key0 = 0;
  __device__ __forceinline__ bool empty() const { return n_begin >= n_blocks; }
};

}  // namespace jaxattn::sm90
