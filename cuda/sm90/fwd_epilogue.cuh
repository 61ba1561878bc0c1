// Epilogue of the Hopper forward (per consumer warpgroup): normalise O by the row
// sums, convert to 16 bits, write it into this warpgroup's own 64 rows of the Q
// tile in shared memory (same 128B-swizzled chunk layout, so the writes are free of
// bank conflicts), then one thread stores it with TMA (rows >= T are clipped by the
// tensor map). lse goes straight from registers. kShortTiles (the masked kernels,
// whose document tiles may end before T inside a warpgroup's 64 rows, where the next
// tile's rows begin): such a warpgroup copies its rows below row_end from shared
// memory with 16-byte stores instead.
#pragma once

#include <cuda.h>

#include "common/hopper_ptx.h"
#include "common/ptx.h"
#include "sm90/fwd_smem.cuh"
#include "sm90/fwd_softmax.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/smem_rows.cuh"

namespace jaxattn::sm90 {

template <class Tr>
struct FwdEpilogue {
  using Elem = typename Tr::Elem;
  static constexpr int kHeadDim = Tr::kHeadDim;
  static constexpr int kBlockM = Tr::kBlockM;

  // Requires: this warpgroup's wgmma reads of Q are complete (true after the main loop;
  // with Tr::kSeparateO the Q tile is not touched).
  template <bool kShortTiles = false>
  __device__ static void store(float (&o)[kHeadDim / 2], OnlineSoftmax<Tr::kBlockN>& softmax,
                               const CUtensorMap* tm_o, const FwdSmem<Tr>& sm, const FwdTile& tile,
                               const FwdArgs& args, int wg, int tid) {
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    float inv_sum[2], lse[2];
    softmax.finalize(args.scale, inv_sum, lse);

    // O -> this warpgroup's 64 rows of the Q tile (free of bank conflicts: same swizzle),
    // or of the O buffer (Tr::kSeparateO), which the previous tile's TMA store has read
    // once thread 0 of the warpgroup is past its bulk_wait_read0 (then the barrier).
    // That wait comes here, just before this store writes the buffer (and in finish()),
    // not right after the previous store was issued, so the read's latency overlaps the
    // next tile's main loop instead of holding the warpgroup, whose first wgmma needs
    // all four warps (H200, session 11, same call: +2-3% at H=64 non-causal T >= 2K and
    // H=128 non-causal T <= 2K, +2.4% at H=64 causal 16K, the rest within the 1-2% noise).
    if constexpr (Tr::kSeparateO) {
      if (tid == 0) hptx::bulk_wait_read0();
      hptx::named_bar_sync(1 + wg, 128);
    }
    const uint32_t rows = sm.o() + wg * 64 * 128;
    store_acc_sw128<Elem, kHeadDim>(o, inv_sum, rows, kBlockM * 128, warp * 16 + g, t);
    hptx::fence_proxy_async_smem();
    hptx::named_bar_sync(1 + wg, 128);
    const int wg_row0 = (kShortTiles ? tile.row0 : tile.m_block * kBlockM) + wg * 64;
    const int row_end = kShortTiles ? tile.row_end : args.seqlen_q;
    const int wg_rows = row_end - wg_row0;  // this warpgroup's rows in the tile (clipped to 64 by TMA)
    const bool by_tma = !kShortTiles || wg_rows >= 64 || row_end >= args.seqlen_q;
    if (by_tma && tid == 0 && wg_rows > 0) {
#pragma unroll
      for (int c = 0; c < Tr::kChunks; ++c)
        hptx::tma_store_5d(tm_o, rows + c * kBlockM * 128, 0, wg_row0, c, tile.head, tile.batch);
      hptx::bulk_commit();
    }
    if constexpr (kShortTiles) {
      if (!by_tma && wg_rows > 0) {
        const AttnParams& p = args.attn;
        Elem* out = static_cast<Elem*>(p.o) + tile.batch * p.o_batch_stride + tile.head * p.o_head_stride +
                    wg_row0 * p.o_row_stride;
        copy_rows_sw128<Tr::kChunks>(rows, kBlockM * 128, wg_rows, out, p.o_row_stride, tid);
      }
    }

    if (t == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = wg_row0 + warp * 16 + g + 8 * h;
        if (row < row_end)
          args.lse[((int64_t)tile.batch * args.seqlen_q + row) * args.num_heads + tile.head] = lse[h];
      }
    }
    if (!Tr::kSeparateO && tid == 0 && by_tma && wg_rows > 0) hptx::bulk_wait_read0();  // smem must outlive the copy
  }

  // After a CTA's last store() (with the O buffer: it must outlive its last copy).
  __device__ static void finish(int tid) {
    if (Tr::kSeparateO && tid == 0) hptx::bulk_wait_read0();
  }
};

}  // namespace jaxattn::sm90
