// The Hopper (sm_90a) flash-attention backward kernel: warp-specialised, one CTA
// per 128-key block (head dim 256: 64 keys) of one (batch, kv head); the whole GQA group of query heads
// streams through it, so dK / dV are reduced over the group in registers.
//
// Threads: warpgroup 0 = producer (setmaxnreg.dec): warp 0 feeds the ring (lane 0
// issues every TMA load, all lanes write each stage's row statistics), and at head
// dim 64 one thread of warp 1 issues the dQ reduce-adds; warpgroups 1..2 = consumers
// (setmaxnreg.inc; wgmma, P / dS, dQ reduce-adds and the dK / dV epilogue for 64 keys
// each).
#pragma once

#include <cuda.h>

#include "common/hopper_ptx.h"
#include "common/ptx.h"
#include "sm90/bwd_epilogue.cuh"
#include "sm90/bwd_mainloop.cuh"
#include "sm90/bwd_mainloop_wide.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/tile_mask.cuh"

namespace jaxattn::sm90 {

// Kernel parameters: tensor maps first (64-byte aligned), then the plain arguments.
struct BwdParams {
  CUtensorMap tm_q;   // box (64, kBlockM, kChunks, 1, 1)
  CUtensorMap tm_do;  // box (64, kBlockM, kChunks, 1, 1)
  CUtensorMap tm_k;   // box (64, kBlockN, kChunks, 1, 1)
  CUtensorMap tm_v;   // box (64, kBlockN, kChunks, 1, 1)
  CUtensorMap tm_dk;  // box (64, 64, 1, 1, 1): one chunk of one warpgroup's keys
  CUtensorMap tm_dv;  // box (64, 64, 1, 1, 1)
  CUtensorMap tm_dq;  // f32 dq_accum, box (32, kBlockM, kDqChunks, 1, 1)
  BwdArgs args;
};

// The tile of this CTA. Causal: only query blocks that reach the first key.
template <class Tr, bool kCausal>
__device__ __forceinline__ BwdTile bwd_tile_from_block(const BwdArgs& a) {
  BwdTile tile;
  tile.n_block = blockIdx.x;
  tile.kv_head = blockIdx.y;
  tile.batch = blockIdx.z;
  tile.m_begin = kCausal ? (tile.n_block * Tr::kBlockN) / Tr::kBlockM : 0;
  tile.m_end = (a.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  if (tile.m_begin > tile.m_end) tile.m_begin = tile.m_end;
  return tile;
}

// kMasked: the call has mask options (window, lengths, segments, soft cap; kCausal
// false, the causal mask is part of the MaskView): the tile's query blocks narrowed
// to those whose rows may see one of its keys (every thread computes it; K / V are
// already loading).
template <class Tr, bool kCausal, bool kMasked = false>
__global__ void __launch_bounds__(Tr::kThreads, 1) flash_bwd_sm90_kernel(const __grid_constant__ BwdParams params) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const BwdSmem<Tr> sm{(ptx::smem_addr(smem_raw) + 1023u) & ~1023u};
  const BwdArgs& args = params.args;
  BwdTile tile = bwd_tile_from_block<Tr, kCausal>(args);
  // (masked only) the call's MaskView and reduction scratch, in the dynamic window
  uint8_t* const smem = smem_raw + (sm.base - ptx::smem_addr(smem_raw));
  MaskView& mask_view = *reinterpret_cast<MaskView*>(smem + Tr::kOffMask);
  int* const mask_red = reinterpret_cast<int*>(smem + Tr::kOffMaskRed);
  static_assert(sizeof(MaskView) <= Tr::kMaskBytes && alignof(MaskView) <= 16, "MaskView fits its slot");
  const int warpgroup = __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0);

  if (threadIdx.x == 0) {
    hptx::mbar_init(sm.bar_kv(), 1);
#pragma unroll
    for (int s = 0; s < Tr::kStages; ++s) {
      hptx::mbar_init(sm.bar_q_full(s), Tr::kQFullArrivals);
      hptx::mbar_init(sm.bar_q_empty(s), Tr::kQEmptyArrivals);
    }
    if constexpr (Tr::kDqWarp) {
#pragma unroll
      for (int wg = 0; wg < Tr::kConsumerWarpgroups; ++wg) {
        hptx::mbar_init(sm.bar_dq_full(wg), 128);
        hptx::mbar_init(sm.bar_dq_empty(wg), 1);
      }
    }
    if constexpr (Tr::kSkewDq) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        hptx::mbar_init(sm.bar_ds_full(b), 4 * Tr::kConsumerWarpgroups);
        hptx::mbar_init(sm.bar_ds_empty(b), 4 * Tr::kConsumerWarpgroups);
      }
    }
    hptx::mbar_init_fence();
    // K / V do not depend on the query range: with masks their loads go out before
    // it is computed, so the two latencies overlap instead of adding up.
    if constexpr (kMasked) BwdMainloop<Tr>::load_kv(&params.tm_k, &params.tm_v, sm, tile);
  }
  if constexpr (kMasked) {
    // Every thread builds the view and finds the range itself (range tables: one
    // round of loads per warp, no barrier), before the one barrier; warp 1 (idle
    // in the producer warpgroup) publishes the view for the consumers.
    const MaskView view = MaskView::of(args.attn, tile.batch);
    if (threadIdx.x == 32) mask_view = view;
    const int2 blocks = cta_query_blocks<Tr::kBlockM, Tr::kBlockN>(view, tile.n_block * Tr::kBlockN, mask_red);
    tile.m_begin = blocks.x;
    tile.m_end = blocks.y;
  }
  __syncthreads();

  if (warpgroup == 0) {
    hptx::setmaxnreg_dec<Tr::kProducerRegs>();
    if (threadIdx.x < 32) {
      if (threadIdx.x == 0) {
        hptx::prefetch_tmap(&params.tm_q);
        hptx::prefetch_tmap(&params.tm_do);
        hptx::prefetch_tmap(&params.tm_k);
        hptx::prefetch_tmap(&params.tm_v);
      }
      BwdMainloop<Tr>::produce(&params.tm_q, &params.tm_do, &params.tm_k, &params.tm_v, sm, tile, args,
                               threadIdx.x, kMasked);
    } else if (Tr::kDqWarp && threadIdx.x == 32) {
      BwdMainloop<Tr>::reduce_dq(&params.tm_dq, sm, tile, args);
    }
  } else {
    hptx::setmaxnreg_inc<Tr::kConsumerRegs>();
    const int wg = warpgroup - 1;
    const int tid = threadIdx.x % 128;
    float dk[Tr::kAccRegs], dv[Tr::kAccRegs];
    if constexpr (Tr::kWide)
      BwdMainloopWide<Tr>::template consume<kCausal, kMasked>(dk, dv, &params.tm_dq, sm, tile, args, wg, tid,
                                                              &mask_view);
    else
      BwdMainloop<Tr>::template consume<kCausal, kMasked>(dk, dv, &params.tm_dq, sm, tile, args, wg, tid,
                                                          &mask_view);
    BwdEpilogue<Tr>::store(dk, dv, &params.tm_dk, &params.tm_dv, sm, tile, args, wg, tid);
  }
}

}  // namespace jaxattn::sm90
