// Epilogue of the Hopper backward (per consumer warpgroup): dK (times the logits
// scale) and dV to 16 bits, written over this warpgroup's own part of the K and V
// tiles in shared memory (its 64 rows; wide: its half of the chunks; same
// swizzled layout), then stored by one thread with
// TMA (rows >= S are clipped by the tensor maps). Waits for every bulk operation of
// the CTA's thread (dQ reduce-adds included) before returning.
#pragma once

#include <cuda.h>

#include "common/hopper_ptx.h"
#include "sm90/bwd_traits.cuh"
#include "sm90/smem_rows.cuh"

namespace jaxattn::sm90 {

template <class Tr>
struct BwdEpilogue {
  using Elem = typename Tr::Elem;
  static constexpr int kHeadDim = Tr::kHeadDim;
  static constexpr int kBlockN = Tr::kBlockN;

  __device__ static void store(const float (&dk)[Tr::kAccRegs], const float (&dv)[Tr::kAccRegs],
                               const CUtensorMap* tm_dk, const CUtensorMap* tm_dv, const BwdSmem<Tr>& sm,
                               const BwdTile& tile, const BwdArgs& args, int wg, int tid) {
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    // Both warpgroups' dQ wgmma (which read all of K) are complete past this barrier.
    hptx::named_bar_sync(1, 256);
    // This warpgroup's part of the tiles: its 64 keys, every chunk; wide: all 64
    // keys, its half of the chunks.
    constexpr int kWgChunks = Tr::kKvCols / 64;
    const uint32_t wg_off = Tr::kWide ? wg * kWgChunks * kBlockN * 128 : wg * 64 * 128;
    const uint32_t k_rows = sm.k() + wg_off, v_rows = sm.v() + wg_off;
    const float dk_mul[2] = {args.scale, args.scale}, dv_mul[2] = {1.f, 1.f};
    store_acc_sw128<Elem, Tr::kKvCols>(dk, dk_mul, k_rows, kBlockN * 128, warp * 16 + g, t);
    store_acc_sw128<Elem, Tr::kKvCols>(dv, dv_mul, v_rows, kBlockN * 128, warp * 16 + g, t);
    hptx::fence_proxy_async_smem();
    hptx::named_bar_sync(2 + wg, 128);
    if (tid == 0) {
      const int key_wg0 = tile.n_block * kBlockN + (Tr::kWide ? 0 : wg * 64);
      const int chunk0 = Tr::kWide ? wg * kWgChunks : 0;
      if (key_wg0 < args.seqlen_k) {
#pragma unroll
        for (int c = 0; c < kWgChunks; ++c) {
          hptx::tma_store_5d(tm_dk, k_rows + c * kBlockN * 128, 0, key_wg0, chunk0 + c, tile.kv_head, tile.batch);
          hptx::tma_store_5d(tm_dv, v_rows + c * kBlockN * 128, 0, key_wg0, chunk0 + c, tile.kv_head, tile.batch);
        }
        hptx::bulk_commit();
      }
      hptx::bulk_wait0();  // smem must outlive the copies; dQ reduce-adds complete too
    }
  }
};

}  // namespace jaxattn::sm90
