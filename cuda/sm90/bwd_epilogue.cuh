// Epilogue of the Hopper backward (per consumer warpgroup): dK (times the logits
// scale) and dV to 16 bits, written over this warpgroup's own part of the K and V
// tiles in shared memory (its 64 rows; same swizzled layout; wide: warpgroup 0 holds
// dV and writes the whole V tile, 1 dK over the K tile), then stored by one thread with
// TMA (rows >= S are clipped by the tensor maps). Waits for every bulk operation of
// the CTA's thread (dQ reduce-adds included) before returning. kDoc (document tiles,
// which may end before S inside a warpgroup's 64 keys, where the next tile's keys
// begin): such a warpgroup copies its keys below key_end with 16-byte stores instead.
#pragma once

#include <cuda.h>

#include "common/hopper_ptx.h"
#include "sm90/bwd_traits.cuh"
#include "sm90/bwd_tail.cuh"
#include "sm90/smem_rows.cuh"

namespace jaxattn::sm90 {

template <class Tr>
struct BwdEpilogue {
  using Elem = typename Tr::Elem;
  static constexpr int kHeadDim = Tr::kHeadDim;
  static constexpr int kBlockN = Tr::kBlockN;

  // Wide (BwdMainloopWide, head dim 256): warpgroup 0 holds dV, 1 dK, all columns
  // (dk: 0..127, dv: 128..255), each written over the whole V / K tile.
  template <bool kDoc = false>
  __device__ static void store(const float (&dk)[Tr::kAccRegs], const float (&dv)[Tr::kAccRegs],
                               const CUtensorMap* tm_dk, const CUtensorMap* tm_dv, const BwdSmem<Tr>& sm,
                               const BwdTile& tile, const BwdArgs& args, int wg, int tid) {
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    if constexpr (!Tr::kWide) {  // (no tail split at head dim 256: bwd_launch.cuh)
      if (tile.tail_slot >= 0) {  // a slice of a unit: its partial sums, added from registers
        bwd_tail_add_partial<Tr>(dk, dv, args, tile.tail_slot, wg, warp, g, t);
        if (tid == 0) hptx::bulk_wait0();  // (this thread's dQ reduce-adds read shared memory)
        return;
      }
    }
    // Both warpgroups' dQ wgmma (which read all of K) are complete past this barrier.
    hptx::named_bar_sync(1, 256);
    if constexpr (Tr::kWide) {
      static_assert(!kDoc, "wide: no document tiles");
      const uint32_t rows = wg == 0 ? sm.v() : sm.k();
      const float s = wg == 0 ? 1.f : args.scale;
      const float mul[2] = {s, s};
      constexpr uint32_t kHalfBytes = (Tr::kKvCols / 64) * kBlockN * 128;
      store_acc_sw128<Elem, Tr::kKvCols>(dk, mul, rows, kBlockN * 128, warp * 16 + g, t);
      store_acc_sw128<Elem, Tr::kKvCols>(dv, mul, rows + kHalfBytes, kBlockN * 128, warp * 16 + g, t);
      hptx::fence_proxy_async_smem();
      hptx::named_bar_sync(2 + wg, 128);
      if (tid == 0) {
        if (min(tile.key_end, args.seqlen_k) > tile.key_first) {
#pragma unroll
          for (int c = 0; c < kHeadDim / 64; ++c)
            hptx::tma_store_5d(wg == 0 ? tm_dv : tm_dk, rows + c * kBlockN * 128, 0, tile.key_first, c, tile.kv_head,
                               tile.batch);
          hptx::bulk_commit();
        }
        hptx::bulk_wait0();
      }
      return;
    }
    // This warpgroup's part of the tiles: its 64 keys, every chunk.
    constexpr int kWgChunks = kHeadDim / 64;
    const uint32_t wg_off = wg * 64 * 128;
    const uint32_t k_rows = sm.k() + wg_off, v_rows = sm.v() + wg_off;
    const float dk_mul[2] = {args.scale, args.scale}, dv_mul[2] = {1.f, 1.f};
    store_acc_sw128<Elem, Tr::kKvCols>(dk, dk_mul, k_rows, kBlockN * 128, warp * 16 + g, t);
    store_acc_sw128<Elem, Tr::kKvCols>(dv, dv_mul, v_rows, kBlockN * 128, warp * 16 + g, t);
    hptx::fence_proxy_async_smem();
    hptx::named_bar_sync(2 + wg, 128);
    const int key_wg0 = tile.key_first + wg * 64;
    const int wg_keys = min(tile.key_end, args.seqlen_k) - key_wg0;  // this warpgroup's keys (TMA clips to 64)
    const bool by_tma = !kDoc || wg_keys >= 64 || tile.key_end >= args.seqlen_k;
    if constexpr (kDoc) {
      if (!by_tma && wg_keys > 0) {
        const AttnParams& p = args.attn;
        const int64_t at = tile.batch * p.k_batch_stride + tile.kv_head * p.k_head_stride + key_wg0 * p.k_row_stride;
        const int64_t at_v = tile.batch * p.v_batch_stride + tile.kv_head * p.v_head_stride + key_wg0 * p.v_row_stride;
        copy_rows_sw128<kWgChunks>(k_rows, kBlockN * 128, wg_keys, static_cast<Elem*>(p.dk) + at, p.k_row_stride, tid);
        copy_rows_sw128<kWgChunks>(v_rows, kBlockN * 128, wg_keys, static_cast<Elem*>(p.dv) + at_v, p.v_row_stride,
                                   tid);
      }
    }
    if (tid == 0) {
      if (by_tma && wg_keys > 0) {
#pragma unroll
        for (int c = 0; c < kWgChunks; ++c) {
          hptx::tma_store_5d(tm_dk, k_rows + c * kBlockN * 128, 0, key_wg0, c, tile.kv_head, tile.batch);
          hptx::tma_store_5d(tm_dv, v_rows + c * kBlockN * 128, 0, key_wg0, c, tile.kv_head, tile.batch);
        }
        hptx::bulk_commit();
      }
      hptx::bulk_wait0();  // smem must outlive the copies; dQ reduce-adds complete too
    }
  }
};

}  // namespace jaxattn::sm90
