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

#include "common/doc_tiles.h"
#include "common/hopper_ptx.h"
#include "common/ptx.h"
#include "sm90/causal_groups.h"
#include "sm90/bwd_epilogue.cuh"
#include "sm90/bwd_mainloop.cuh"
#include "sm90/bwd_mainloop_rows.cuh"
#include "sm90/bwd_mainloop_wide.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/bwd_tail.cuh"
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
  tile.tail_slot = -1;
  int slice = 0, slices = 1;  // (tail split: this CTA's slice of its unit's query blocks)
  if (a.tail_slices > 0) {
    bwd_tail_unit(a, tile, slice, slices);
  } else if (kCausal && kBwdCausalGroupsF10 > 0 && a.causal_groups > 0) {
    const int K = a.attn.num_heads_k;
    int head;
    causal_group_unit((int)blockIdx.x, K * a.attn.batch, a.n_kblocks, a.causal_groups, tile.n_block, head);
    tile.kv_head = head % K;
    tile.batch = head / K;
  } else {
    // Deterministic: highest key block first, the order of the dQ adds (dq_adds_first).
    tile.n_block = a.dq_semaphore ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    tile.kv_head = blockIdx.y;
    tile.batch = blockIdx.z;
  }
  tile.key_first = tile.n_block * Tr::kBlockN;
  tile.key_end = tile.key_first + Tr::kBlockN;
  tile.q_shift = 0;
  tile.m_rot = 0;
  tile.m_begin = kCausal ? (tile.n_block * Tr::kBlockN) / Tr::kBlockM : 0;
  tile.m_end = (a.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  if (tile.m_begin > tile.m_end) tile.m_begin = tile.m_end;
  if (slices > 1) {  // (non-causal only: m_begin is 0)
    const int M = tile.m_end;
    tile.m_begin = M * slice / slices;
    tile.m_end = M * (slice + 1) / slices;
  }
  return tile;
}

// The tile of a CTA of the document-tile grid (kDoc: AttnParams::doc_tiles, built by
// build_doc_tiles(key_tiles) just before; slots x of (slots, kv heads, batch)): slot x
// of row b is that row's x-th key tile (most query rows first; `doc` set, its
// document in doc_rows) or nothing past the row's count; a row whose ids did not
// qualify (count -1) takes key block x of the usual tiles. Query blocks are left to
// the kernel. false: no tile.
template <class Tr>
__device__ __forceinline__ bool bwd_doc_tile_from_block(const BwdArgs& a, BwdTile& tile, bool& doc,
                                                        int2& doc_rows) {
  const int x = (int)blockIdx.x;
  tile.kv_head = blockIdx.y;
  tile.batch = blockIdx.z;
  tile.q_shift = 0;
  tile.m_rot = 0;
  tile.tail_slot = -1;
  tile.m_begin = tile.m_end = 0;
  const int4* rec = cuda::doc_tile_records(a.attn.doc_tiles, tile.batch, a.seqlen_q);
  const int count = __ldg(&rec[0].x);
  const int4 r = __ldg(rec + 1 + x);  // (x < the capacity: the grid's slots; one round trip with the count)
  doc = count >= 0;
  if (doc) {
    if (x >= count) return false;
    tile.n_block = 0;  // (the ordered dQ adds, which read it, never run document tiles)
    tile.key_first = r.x;
    tile.key_end = r.y;
    doc_rows = make_int2(r.z, r.w);
    return true;
  }
  if (x >= (a.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN) return false;
  tile.n_block = x;
  tile.key_first = x * Tr::kBlockN;
  tile.key_end = tile.key_first + Tr::kBlockN;
  return true;
}

// The MaskView of a masked CTA and its query blocks (every thread; `red`: the exact
// scan's scratch). Deterministic mode keeps the closed-form range (segments aside),
// which its dQ order counts on (dq_adds_after). A document tile (doc, document
// doc_rows = [ds, de)) drops the segment ids (its keys see only their own document's
// queries) and ends queries and keys at de; its query blocks start at its first
// visible query, not at a multiple of kBlockM, as if the document were alone.
template <class Tr>
__device__ __forceinline__ MaskView bwd_mask_tile(BwdTile& tile, const BwdArgs& a, int* red, bool doc,
                                                  int2 doc_rows) {
  MaskView view = MaskView::of(a.attn, tile.batch);
  if (doc) {
    view = view.in_document(doc_rows.y, doc_rows.y);
    const int2 blocks = blocks_from<Tr::kBlockM>(view.query_range(tile.key_first, tile.key_end), doc_rows.x);
    tile.q_shift = blocks.x;
    tile.m_begin = 0;
    tile.m_end = blocks.y;
  } else if (a.dq_semaphore != nullptr) {
    const int2 blocks = blocks_of<Tr::kBlockM>(view.query_range(tile.key_first, tile.key_first + Tr::kBlockN));
    tile.m_begin = blocks.x;
    tile.m_end = blocks.y;
  } else {
    const int2 blocks = cta_query_blocks<Tr::kBlockM, Tr::kBlockN>(view, tile.key_first, red);
    tile.m_begin = blocks.x;
    tile.m_end = blocks.y;
  }
  return view;
}

// kMasked: the call has mask options (window, lengths, segments, soft cap; kCausal
// false, the causal mask is part of the MaskView): the tile's query blocks narrowed
// to those whose rows may see one of its keys (every thread computes it; K / V are
// already loading). kDoc (masked, head dims 64 / 128): the grid of document tiles
// (bwd_doc_tile_from_block).
template <class Tr, bool kCausal, bool kMasked = false, bool kDoc = false>
__global__ void __launch_bounds__(Tr::kThreads, 1) flash_bwd_sm90_kernel(const __grid_constant__ BwdParams params) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const BwdSmem<Tr> sm{(ptx::smem_addr(smem_raw) + 1023u) & ~1023u};
  const BwdArgs& args = params.args;
  static_assert(!kDoc || (kMasked && !Tr::kWide && Tr::kBlockN == cuda::kDocTileRows), "document tiles");
  static_assert(!Tr::kRows || !kMasked, "row steps: unmasked calls only");
  BwdTile tile;
  bool doc = false;
  int2 doc_rows = make_int2(0, 0);
  if constexpr (kDoc) {
    if (!bwd_doc_tile_from_block<Tr>(args, tile, doc, doc_rows)) return;  // (uniform)
  } else {
    tile = bwd_tile_from_block<Tr, kCausal>(args);
    if constexpr (Tr::kRotateQ && !kCausal && !kMasked) {
      if (!args.dq_semaphore && tile.tail_slot < 0 && tile.m_end > 0)
        tile.m_rot = (tile.n_block * Tr::kBlockN / Tr::kBlockM) % tile.m_end;
    }
  }
  // (masked only) the call's MaskView and reduction scratch, in the dynamic window
  uint8_t* const smem = smem_raw + (sm.base - ptx::smem_addr(smem_raw));
  MaskView& mask_view = *reinterpret_cast<MaskView*>(smem + Tr::kOffMask);
  int* const mask_red = reinterpret_cast<int*>(smem + Tr::kOffMaskRed);
  static_assert(sizeof(MaskView) <= Tr::kMaskBytes && alignof(MaskView) <= 16, "MaskView fits its slot");
  const int warpgroup = __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0);
  // The view the deterministic dQ order reads (dq_adds_after; document tiles never
  // run deterministic, so theirs compiles without it).
  const MaskView* const dq_view = kMasked && !kDoc ? &mask_view : nullptr;

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
    const MaskView view = bwd_mask_tile<Tr>(tile, args, mask_red, doc, doc_rows);
    if (threadIdx.x == 32) mask_view = view;
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
      BwdMainloop<Tr>::reduce_dq(&params.tm_dq, sm, tile, args, dq_view);
    }
  } else {
    hptx::setmaxnreg_inc<Tr::kConsumerRegs>();
    const int wg = warpgroup - 1;
    const int tid = threadIdx.x % 128;
    float dk[Tr::kAccRegs], dv[Tr::kAccRegs];
    if constexpr (Tr::kWide)  // (dk / dv are its lo / hi: dV in wg 0, dK in wg 1)
      BwdMainloopWide<Tr>::template consume<kCausal, kMasked>(dk, dv, &params.tm_dq, sm, tile, args, wg, tid,
                                                              &mask_view, dq_view);
    else if constexpr (Tr::kRows)
      BwdMainloopRows<Tr>::template consume<kCausal>(dk, dv, sm, tile, args, wg, tid);
    else
      BwdMainloop<Tr>::template consume<kCausal, kMasked>(dk, dv, &params.tm_dq, sm, tile, args, wg, tid,
                                                          &mask_view, dq_view);
    BwdEpilogue<Tr>::template store<kDoc>(dk, dv, &params.tm_dk, &params.tm_dv, sm, tile, args, wg, tid);
  }
}

}  // namespace jaxattn::sm90
