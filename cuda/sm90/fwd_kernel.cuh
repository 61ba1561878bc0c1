// The Hopper (sm_90a) flash-attention forward kernel: warp-specialised, one CTA
// per 128-row query tile of one (batch, head).
//
// Threads: warpgroup 0 = producer (setmaxnreg.dec to 24; one thread issues every
// TMA load), warpgroups 1..2 = consumers (setmaxnreg.inc to 240; wgmma + softmax
// + epilogue on 64 query rows each). The tile comes from blockIdx, or (persistent
// grid) from a static round-robin over the tile list.
#pragma once

#include <cuda.h>

#include "common/hopper_ptx.h"
#include "common/ptx.h"
#include "sm90/fwd_epilogue.cuh"
#include "sm90/fwd_mainloop.cuh"
#include "sm90/fwd_schedule.cuh"
#include "sm90/fwd_smem.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/tile_mask.cuh"

namespace jaxattn::sm90 {

// Kernel parameters: tensor maps first (64-byte aligned), then the plain arguments.
struct FwdParams {
  CUtensorMap tm_q;  // box (64, kBlockM, kChunks, 1, 1)
  CUtensorMap tm_k;  // box (64, kBlockN, kChunks, 1, 1)
  CUtensorMap tm_v;  // box (64, kBlockN, kChunks, 1, 1)
  CUtensorMap tm_o;  // box (64, 64, 1, 1, 1): one chunk of one warpgroup's rows
  FwdArgs args;
};

// Masked instantiations (window, lengths, segments, soft cap; non-persistent grid of
// tile slots, fwd_masked_tile_from_block): the tile's key blocks narrowed to what
// some row of the tile may see. Every thread
// builds the MaskView in registers and finds the range itself (with range tables:
// one round of loads per warp, no barrier), so nothing waits on one thread before
// the kernel's first barrier; warp 1 (idle in the producer warpgroup) publishes the
// view in `shared` for the consumers. (Session 7: thread 0 building it, then a
// barrier, then the range, then another barrier cost ~10% of a short-document
// forward.) `red`: the exact scan's scratch (no range tables).
// A document tile (doc; common/doc_tiles.h) lies inside document doc_keys = [ds, de):
// its view drops the segment ids (every key it visits has its rows' id) and ends the
// keys at de, and its key blocks start at its first visible key, not at a multiple
// of kBlockN, so they line up with the tile's rows as in a document alone.
template <class Tr>
__device__ __forceinline__ void fwd_mask_tile(FwdTile& tile, const FwdArgs& a, MaskView& shared, int* red, bool doc,
                                              int2 doc_keys) {
  MaskView view = MaskView::of(a.attn, tile.batch);
  if (doc) {
    view = view.in_document(doc_keys.y, view.q_len);
    const int2 blocks = blocks_from<Tr::kBlockN>(view.key_range(tile.row0, tile.row_end), doc_keys.x);
    tile.key0 = blocks.x;
    tile.n_begin = 0;
    tile.n_blocks = blocks.y;
  } else {
    const int2 blocks = cta_key_blocks<Tr::kBlockM, Tr::kBlockN>(view, tile.row0, red);
    tile.n_begin = blocks.x;
    tile.n_blocks = blocks.y;
  }
  if (threadIdx.x == 32) shared = view;
}

// kPersistent: a 1-D grid of at most one CTA per SM; CTA c runs tiles c, c + grid,
// ... (fwd_tile order; causal: pairs of query tiles, fwd_causal_cta_tile), and its
// producer loads the next tile's first K / V blocks while the consumers finish the
// previous tile.
// kMasked: the call has mask options (AttnParams::has_masks, no dense bias / mask);
// the causal mask is then part of the MaskView, and kCausal only orders the tiles.
template <class Tr, bool kCausal, bool kOverlap, bool kPingpong, bool kPersistent = false, bool kMasked = false>
__global__ void __launch_bounds__(Tr::kThreads, 1) flash_fwd_sm90_kernel(const __grid_constant__ FwdParams params) {
  static_assert(!(kMasked && kPersistent), "masked kernels run on the (query tiles, heads, batch) grid");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const FwdSmem<Tr> sm{(ptx::smem_addr(smem_raw) + 1023u) & ~1023u};
  const FwdArgs& args = params.args;
  // Chained tiles (FwdMainloop::consume): the persistent grid with two Q buffers.
  constexpr bool kChain = kPersistent && Tr::kQBuffers == 2;
  static_assert(Tr::kQBuffers == 1 || (kPersistent && kOverlap && !kMasked), "two Q buffers: chained tiles");
  constexpr int kPreloadKV = Tr::preload_kv(kCausal, kPersistent);
  const int num_tiles = kPersistent ? ((args.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM) * args.num_heads * args.batch
                                    : 1;

  // Warp-uniform warpgroup index (the compiler then knows the role branch is uniform).
  const int warpgroup = __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0);

  if (threadIdx.x == 0) {
    // (q_empty: one arrival per consumer warpgroup after its epilogue; with
    // Tr::kSeparateO one per consumer warp after the tile's last S wgmma)
#pragma unroll
    for (int b = 0; b < Tr::kQBuffers; ++b) {
      hptx::mbar_init(sm.bar_q(b), 1);
      hptx::mbar_init(sm.bar_q_empty(b), Tr::kSeparateO ? 4 * Tr::kConsumerWarpgroups : Tr::kConsumerWarpgroups);
    }
#pragma unroll
    for (int s = 0; s < Tr::kStages; ++s) {
      hptx::mbar_init(sm.bar_k_full(s), 1);
      hptx::mbar_init(sm.bar_v_full(s), 1);
      hptx::mbar_init(sm.bar_k_empty(s), 4 * Tr::kConsumerWarpgroups);
      hptx::mbar_init(sm.bar_v_empty(s), 4 * Tr::kConsumerWarpgroups);
    }
    hptx::mbar_init_fence();
  }
  __shared__ MaskView mask_view;  // (masked only; otherwise unused, so not allocated)
  __shared__ int mask_red[2];
  FwdTile tile{};
  if constexpr (!kPersistent) {
    if constexpr (kMasked) {
      bool doc = false;
      int2 doc_keys;
      // (uniform: a slot past the row's document tiles has nothing to do)
      if (!fwd_masked_tile_from_block<Tr, kCausal>(args, tile, doc, doc_keys)) return;
      // Q does not depend on the key range: its load goes out first, so its latency
      // and the range's (the segment-id range-table loads) overlap instead of adding up.
      if (threadIdx.x == 0) FwdMainloop<Tr>::load_q(&params.tm_q, sm, tile, tile.row0);
      fwd_mask_tile<Tr>(tile, args, mask_view, mask_red, doc, doc_keys);
    } else {
      tile = fwd_tile_from_block<Tr, kCausal>(args);
    }
  }
  __syncthreads();

  typename FwdMainloop<Tr>::Pipe pipe;  // K / V ring position, carried across tiles
  if (warpgroup == 0) {
    hptx::setmaxnreg_dec<Tr::kProducerRegs>();
    if (threadIdx.x == 0) {
      hptx::prefetch_tmap(&params.tm_q);
      hptx::prefetch_tmap(&params.tm_k);
      hptx::prefetch_tmap(&params.tm_v);
      if constexpr (kPersistent) {
        // (the n-th tile's Q buffer and parity: q_buffer / q_parity; one buffer: q_phase.
        // n counts the CTA's tiles: the causal schedule's j may skip)
        uint32_t q_phase = 0;
        int n = 0;
        auto parity = [&] { return (int)(Tr::kQBuffers == 2 ? q_parity<Tr>(n) : q_phase); };
        if constexpr (kCausal) {  // (fwd_schedule.cuh: paired query tiles)
          FwdTile t;
          for (int j = 0; fwd_causal_cta_tile<Tr>(args, blockIdx.x, j, t); ++j, q_phase ^= 1, ++n)
            FwdMainloop<Tr>::template produce<kPreloadKV>(&params.tm_q, &params.tm_k, &params.tm_v, sm, t,
                                                          args.sched.div_group.div(t.head), pipe, parity(),
                                                          false, q_buffer<Tr>(n));
        } else {
          for (int idx = blockIdx.x; idx < num_tiles; idx += gridDim.x, q_phase ^= 1, ++n) {
            const FwdTile t = fwd_tile<Tr>(args, idx);
            FwdMainloop<Tr>::template produce<kPreloadKV>(&params.tm_q, &params.tm_k, &params.tm_v, sm, t,
                                                          t.head / args.group, pipe, parity(), false,
                                                          q_buffer<Tr>(n));
          }
        }
      } else if (!tile.empty()) {
        FwdMainloop<Tr>::produce(&params.tm_q, &params.tm_k, &params.tm_v, sm, tile, tile.head / args.group, pipe,
                                 -1, kMasked);
      }
    }
  } else {
    hptx::setmaxnreg_inc<Tr::kConsumerRegs>();
    const int wg = warpgroup - 1;
    const int tid = threadIdx.x % 128;
    float o[Tr::kHeadDim / 2];
    OnlineSoftmax<Tr::kBlockN> softmax;
    if constexpr (kChain) {
      auto epilogue = [&](float (&o_)[Tr::kHeadDim / 2], OnlineSoftmax<Tr::kBlockN>& sm_, const FwdTile& t) {
        FwdEpilogue<Tr>::store(o_, sm_, &params.tm_o, sm, t, args, wg, tid);
      };
      FwdTile t;
      if constexpr (kCausal) {
        int j = 0;
        if (fwd_causal_cta_tile<Tr>(args, blockIdx.x, j, t)) {
          auto next = [&](FwdTile& nt) { return fwd_causal_cta_tile<Tr>(args, blockIdx.x, ++j, nt); };
          FwdMainloop<Tr>::template consume<kCausal, kOverlap, kPingpong, false, true>(
              o, softmax, sm, t, args, wg, tid, pipe, 0u, nullptr, next, epilogue);
        }
      } else {
        int idx = blockIdx.x;
        if (idx < num_tiles) {
          auto next = [&](FwdTile& nt) {
            idx += gridDim.x;
            if (idx >= num_tiles) return false;
            nt = fwd_tile<Tr>(args, idx);
            return true;
          };
          FwdMainloop<Tr>::template consume<kCausal, kOverlap, kPingpong, false, true>(
              o, softmax, sm, fwd_tile<Tr>(args, idx), args, wg, tid, pipe, 0u, nullptr, next, epilogue);
        }
      }
    } else if constexpr (kPersistent) {
      uint32_t q_phase = 0;
      auto run = [&](const FwdTile& t) {
        FwdMainloop<Tr>::template consume<kCausal, kOverlap, kPingpong, false, Tr::kSeparateO>(
            o, softmax, sm, t, args, wg, tid, pipe, q_phase);
        FwdEpilogue<Tr>::store(o, softmax, &params.tm_o, sm, t, args, wg, tid);
        // (store() waited for its TMA reads; kSeparateO: consume() released Q already)
        if (!Tr::kSeparateO && tid == 0) hptx::mbar_arrive(sm.bar_q_empty());
      };
      if constexpr (kCausal) {
        FwdTile t;
        for (int j = 0; fwd_causal_cta_tile<Tr>(args, blockIdx.x, j, t); ++j, q_phase ^= 1) run(t);
      } else {
        for (int idx = blockIdx.x; idx < num_tiles; idx += gridDim.x, q_phase ^= 1) run(fwd_tile<Tr>(args, idx));
      }
    } else {
      FwdMainloop<Tr>::template consume<kCausal, kOverlap, kPingpong, kMasked>(o, softmax, sm, tile, args, wg, tid,
                                                                               pipe, 0, &mask_view);
      FwdEpilogue<Tr>::template store<kMasked>(o, softmax, &params.tm_o, sm, tile, args, wg, tid);
    }
    FwdEpilogue<Tr>::finish(tid);
  }
}

}  // namespace jaxattn::sm90
