// Compile-time shape of the Hopper forward: CTA tile, pipeline depth, shared
// memory layout and the warpgroup roles. One instantiation per head dim and
// element type; everything else in cuda/sm90/ reads its numbers from here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/fast_div.h"
#include "common/params.h"

namespace jaxattn::sm90 {

// Shared memory (offsets from a 1024-aligned base; every tile is 128B-swizzled and
// stored as kChunks column chunks of 64 elements, each chunk [rows][64]):
//   Q  [kChunks][kBlockM][64]          (reused for O in the epilogue, unless kSeparateO)
//   K  [kStages][kChunks][kBlockN][64]
//   V  [kStages][kChunks][kBlockN][64]
//   O  [kChunks][kBlockM][64]          (kSeparateO only)
//   mbarriers: q_full, k_full[s], k_empty[s], v_full[s], v_empty[s], q_empty
// kConsumerWarpgroups = 2 (128-row tiles) everywhere; 3 (192-row tiles, 160 registers
// per consumer thread) fits at head dim 64 only (O 32 + S 64 + P 32 registers).
// kBlockN_: keys per block (0: 128 at head dims 64 / 128, 64 at 256); FwdVariant::kWideKeys
// is 176 at head dim 128 (the default there at S >= 8192) and 80 at 256 (FA3's tile:
// Q 64 KB + 2 stages of 40 KB K and V = 224 KB).
// kQBuffers_: 2 for the chained tiles of the persistent grid (FwdMainloop::consume;
// tile j of a CTA in Q buffer j % 2, so the next Q loads a whole tile ahead), which
// need the O buffer and fit at head dims 64 / 128 with 128-key blocks (224 KB at 128).
template <int kHeadDim_, typename Elem_, int kConsumerWarpgroups_ = 2, int kBlockN_ = 0, int kQBuffers_ = 1>
struct FwdTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim");

  static constexpr int kConsumerWarpgroups = kConsumerWarpgroups_;  // each owns 64 query rows
  static_assert(kConsumerWarpgroups == 2 || (kConsumerWarpgroups == 3 && kHeadDim == 64), "warpgroups");
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  static constexpr int kBlockN = kBlockN_ ? kBlockN_ : kHeadDim <= 128 ? 128 : 64;
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "key block: whole k-steps of the PV wgmma, one TMA box");
  static constexpr int kStages = kHeadDim <= 64 ? 3 : 2;  // (3 at head dim 128: no faster, session 5)
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // 24*128 + 240*256 = 64512 and 24*128 + 160*384 = 64512 <= 65536
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 2 ? 240 : 160;

  static constexpr int kChunks = kHeadDim / 64;       // 128-byte column chunks
  static constexpr int kChunkRowBytes = 128;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // one K or V stage

  static constexpr int kOffQ = 0;
  // The epilogue stages O in its own buffer where it fits, so a persistent CTA frees
  // Q as soon as the tile's last S wgmma has read it and the next tile's Q loads
  // during this tile's last PV and epilogue (session 8: +5-12% on the persistent grid
  // at H 64 / 128). Fits at head dims 64 / 128 with 128-key blocks (192 KB at 128),
  // not at 256 or with 176-key blocks. (A second Q buffer alone, so that the next
  // tile's Q loads a whole tile ahead, measured -12 to +3% at H=64 and -3 to +3% at
  // H=128 in session 12; with chained tiles it pays: kQBuffers_, session 24.)
  static constexpr bool kSeparateO = kQBytes + 2 * kStages * kKVBytes + kQBytes + 1024 + 128 <= 227 * 1024;
  static constexpr int kQBuffers = kQBuffers_;
  static_assert(kQBuffers == 1 || (kQBuffers == 2 && kSeparateO &&
                                   3 * kQBytes + 2 * kStages * kKVBytes + 1024 + 128 <= 227 * 1024),
                "two Q buffers: beside the O buffer, where they fit");
  static constexpr int kOffK = kOffQ + kQBuffers * kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKVBytes;
  static constexpr int kOffO = kOffV + kStages * kKVBytes;  // (kSeparateO only)
  static constexpr int kOffBar = kOffO + (kSeparateO ? kQBytes : 0);
  static constexpr int kNumBars = 2 * kQBuffers + 4 * kStages;
  // Persistent grid: the K / V blocks of the next tile the producer loads before the
  // next tile's Q. Block j of the next tile reuses the stage of block n_blocks - kStages
  // + j of this one, free once both warpgroups' PV of that block is done, which is
  // before their last S (which frees Q, kSeparateO) only for j < kStages - 2. Loading
  // all kStages blocks first held the next Q until warpgroup 1's last PV of the tile.
  // Without the O buffer Q holds the previous O until its store has read it, so K / V
  // go first. Chosen by measurement (H200, session 13 runs 2-3, standalone, against
  // all-first): H=64 +3 / +5 / +3 / +1% non-causal and +4 / +7 / +1 / 0% causal (T =
  // 1K / 2K / 4K / 16K), H=128 causal +3 / 0 / +1 / +1%; H=128 non-causal -4 to +1%,
  // so it keeps all-first. (One Q barrier per consumer warpgroup on top, so the one
  // ahead in the pingpong gets its rows after its own last S, measured the same.)
  static constexpr int preload_kv(bool causal, bool persistent) {
    return kQBuffers == 2 ? 0  // (chained tiles: the next Q goes first, a tile ahead)
           : persistent && kSeparateO && (kHeadDim == 64 || causal) ? (kStages > 2 ? kStages - 2 : 0) : kStages;
  }
  static constexpr int kSmemBytes = kOffBar + kNumBars * 8 + 1024;  // + slack for 1024 alignment
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
  static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0, "1024-aligned tiles");

  // wgmma descriptors by addition (hptx::TileDesc<true>) or rebuilt from each address,
  // chosen per kernel by measurement (H200, standalone, every schedule). By addition:
  // H=64 causal (session 10: +2 / +3 / +6% at T = 1K / 4K / 16K) and non-causal (session
  // 38 run 5: +1.4-4.3% at 4K-16K, -0.2 / -2.1% at 1K; neutral in session 10), H=128
  // non-causal (session 10: +1.5-3%), H=256 causal (session 38 run 7: +0.8-1.6%).
  // Rebuilt: H=128 causal (session 10: -1 / -2%; run 7: 0), H=256 non-causal (run 7:
  // -1 to -5%), the masked kernels (run 7, H=128 documents: within +-2% either way).
  template <bool kCausal, bool kMasked>
  static constexpr bool desc_add() {
    return !kMasked && (kHeadDim == 64 || (kHeadDim == 128 && !kCausal) || (kHeadDim == 256 && kCausal));
  }
};

// The causal persistent grid's tile plan, built by the host (make_fwd_schedule, used
// by fwd_causal_cta_tile): grid size and the pairing of query tiles.
struct FwdSchedule {
  int m_tiles = 0, grid = 0;
  int half = 0;   // query-tile pairs per (batch, head): ceil(m_tiles / 2)
  int pairs = 0;  // pair units in all: heads * batch * half
  FastDiv div_half, div_heads, div_group, div_grid;  // by half, num_heads, N / K, grid
};

// Device-side arguments other than the tensor maps.
struct FwdArgs {
  float* lse;        // [B, T, N]
  int seqlen_q, seqlen_k, num_heads, group;  // group = N / K
  int batch;                                 // (the persistent grid's tile count)
  float scale;       // factor of the raw row max in lse: the logits scale (1 with a soft cap,
                     // whose logits are already scaled)
  float scale_log2;  // scale * log2(e): the softmax's exponent factor
  // The call itself (masked instantiations read their options from it: MaskView::of,
  // scale, softcap).
  AttnParams attn;
  FwdSchedule sched;  // (persistent causal grid)
  // (Causal, non-persistent, sm90/causal_groups.h) causal_groups > 0: a 1-D grid of the
  // (query tile, head) units in that many groups of heads, longest tile first inside a
  // group. 0: the usual (query tiles, heads, batch) grid.
  int causal_groups;
};

}  // namespace jaxattn::sm90
