// Main loop of the Hopper forward: the TMA producer (one thread) and the wgmma
// consumers (one warpgroup per 64 query rows).
//
// Pipeline: Q once per tile (bar_q); K and V each through a kStages ring with
// full barriers (producer's arrive.expect_tx + TMA bytes) and empty barriers (one
// arrival per consumer warp, 8 per phase). S = Q K^T with both operands from
// 128B-swizzled smem (K-major); O += P V with P from registers (the S accumulator
// converted in place to the A fragment layout) and V MN-major from smem.
//
// kOverlap: issue S(n) = Q K(n)^T and O += P(n-1) V(n-1) together, run softmax(n)
// while the PV wgmma runs, and rescale O after it finishes (FA3's intra-warpgroup
// overlap); otherwise strictly S -> softmax -> PV per block.
// kPingpong: the two consumer warpgroups take turns issuing wgmma (named barriers
// 3 and 4), so that one warpgroup's softmax runs while the other's GEMMs occupy
// the tensor cores. Both warpgroups have the same number of issue turns.
#pragma once

#include <cuda.h>

#include <type_traits>

#include "common/hopper_ptx.h"
#include "common/ptx.h"
#include "sm90/fwd_smem.cuh"
#include "sm90/fwd_softmax.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/tile_mask.cuh"

namespace jaxattn::sm90 {

template <class Tr>
struct FwdMainloop {
  using Elem = typename Tr::Elem;
  static constexpr int kHeadDim = Tr::kHeadDim;
  static constexpr int kBlockM = Tr::kBlockM;
  static constexpr int kBlockN = Tr::kBlockN;
  static constexpr int kSRegs = kBlockN / 2;    // S accumulator floats per thread
  static constexpr int kORegs = kHeadDim / 2;   // O accumulator floats per thread
  static constexpr int kPRegs = kBlockN / 4;    // P as packed 16-bit pairs
  using Pipe = PipeState<Tr::kStages>;

  // ---- producer (one thread) ----------------------------------------------
  // The tile's Q block from query row `row0` (completes on bar_q).
  __device__ static void load_q(const CUtensorMap* tm_q, const FwdSmem<Tr>& sm, const FwdTile& tile, int row0,
                                int b = 0) {
    hptx::mbar_arrive_expect_tx(sm.bar_q(b), Tr::kQBytes);
    hptx::tma_load_5d(sm.q(b), tm_q, sm.bar_q(b), 0, row0, 0, tile.head, tile.batch);
  }

  // Loads one tile: Q (unless q_issued: the masked kernels issue it before their key
  // range is known), then K / V block by block through the ring (`pipe` carries
  // the ring position from tile to tile). With a persistent grid (q_empty_phase >= 0)
  // the first kPreloadKV K / V blocks (Tr::preload_kv) go out before Q, whose buffer
  // holds the previous tile's O, or is read by its S wgmma, until q_empty.
  template <int kPreloadKV = Tr::kStages>
  __device__ static void produce(const CUtensorMap* tm_q, const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                 const FwdSmem<Tr>& sm, const FwdTile& tile, int kv_head, Pipe& pipe,
                                 int q_empty_phase = -1, bool q_issued = false, int q_buf = 0) {
    auto load_kv = [&](int n) {
      hptx::mbar_wait(sm.bar_k_empty(pipe.stage), pipe.phase ^ 1);
      hptx::mbar_arrive_expect_tx(sm.bar_k_full(pipe.stage), Tr::kKVBytes);
      hptx::tma_load_5d(sm.k(pipe.stage), tm_k, sm.bar_k_full(pipe.stage), 0, tile.key0 + n * kBlockN, 0, kv_head,
                        tile.batch);
      hptx::mbar_wait(sm.bar_v_empty(pipe.stage), pipe.phase ^ 1);
      hptx::mbar_arrive_expect_tx(sm.bar_v_full(pipe.stage), Tr::kKVBytes);
      hptx::tma_load_5d(sm.v(pipe.stage), tm_v, sm.bar_v_full(pipe.stage), 0, tile.key0 + n * kBlockN, 0, kv_head,
                        tile.batch);
      pipe.advance();
    };
    int n = tile.n_begin;
    if (q_empty_phase >= 0) {
      for (; n < tile.n_blocks && n < tile.n_begin + kPreloadKV; ++n) load_kv(n);
      hptx::mbar_wait(sm.bar_q_empty(q_buf), (uint32_t)q_empty_phase ^ 1);
    }
    if (!q_issued) load_q(tm_q, sm, tile, tile.m_block * kBlockM, q_buf);
    for (; n < tile.n_blocks; ++n) load_kv(n);
  }

  // ---- consumer pieces (one warpgroup) ---------------------------------------

  // S = Q(64 rows at q_rows) K(tile at k_tile)^T; issues kHeadDim/16 wgmma, no commit.
  template <bool kAdd>
  __device__ __forceinline__ static void issue_qk(float (&s)[kSRegs], uint32_t q_rows, uint32_t k_tile) {
    const hptx::TileDesc<kAdd> a(q_rows, 16, 1024), b(k_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t col = (kk / 4), off = (kk % 4) * 32;
      hptx::wgmma_ss<Elem, kBlockN, 0>(s, a.at(col * kBlockM * 128 + off), b.at(col * kBlockN * 128 + off),
                                       kk > 0 ? 1 : 0);
    }
  }

  // O += P V(tile at v_tile); issues kBlockN/16 wgmma, no commit.
  template <bool kAdd>
  __device__ __forceinline__ static void issue_pv(float (&o)[kORegs], const uint32_t (&p)[kPRegs], uint32_t v_tile) {
    const hptx::TileDesc<kAdd> b(v_tile, kBlockN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t a[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
      hptx::wgmma_rs<Elem, kHeadDim, 1>(o, a, b.at(kk * 16 * 128), 1);
    }
  }

  // The S accumulator (probabilities) as the A fragments of the PV wgmma.
  __device__ __forceinline__ static void convert_p(const float (&s)[kSRegs], uint32_t (&p)[kPRegs]) {
#pragma unroll
    for (int i = 0; i < kPRegs; ++i) p[i] = ptx::pack2<Elem>(s[2 * i], s[2 * i + 1]);
  }

  __device__ __forceinline__ static void rescale_o(float (&o)[kORegs], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      o[4 * j + 0] *= alpha[0];
      o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1];
      o[4 * j + 3] *= alpha[1];
    }
  }

  // Pingpong turns between the two consumer warpgroups: barrier 3 + wg is "wg may
  // issue"; it completes when wg syncs (128 threads) and the other arrives (128).
  template <bool kPingpong>
  __device__ __forceinline__ static void turn_begin(int wg) {
    if constexpr (kPingpong) hptx::named_bar_sync(3 + wg, 256);
  }
  template <bool kPingpong>
  __device__ __forceinline__ static void turn_end(int wg) {
    if constexpr (kPingpong) hptx::named_bar_arrive(3 + (wg ^ 1), 256);
  }

  // One arrival per warp on an empty barrier (its wgmma reads of that stage are done).
  __device__ __forceinline__ static void release(uint32_t bar, int lane) {
    if (lane == 0) hptx::mbar_arrive(bar);
  }

  // ---- consumer: the whole key loop of one tile -------------------------------
  // wg: consumer warpgroup (0 or 1); tid: thread in it (0..127).
  // pipe: the K / V ring position (carried from tile to tile); q_phase: parity of
  // this tile's Q load. kMasked: the mask is `mask` (shared memory); an empty
  // tile (no visible key) runs no block and leaves O = 0, lse = -inf. kReleaseQ
  // (persistent grid with Tr::kSeparateO): each warp arrives on q_empty once the
  // tile's last S wgmma has read Q, so the next tile's Q loads meanwhile.
  //
  // Chained tiles (kOverlap, unmasked, persistent grid with two Q buffers, Tr::kQBuffers;
  // a NextTile callable given): consume() runs every tile of the CTA, next_tile(t)
  // giving the one after (false: none), and calls epilogue(o, softmax, tile) for
  // each. A tile's last PV and the next tile's first S wgmma go out in consecutive
  // pingpong turns, and the epilogue runs once both are done, while the other
  // warpgroup has the tensor cores; the pingpong's opening hand-over and closing
  // balance happen once per CTA instead of once per tile. The next tile's Q (loaded a
  // tile ahead into the other buffer) is then never waited for. (With one Q buffer the
  // next Q could only load after every warpgroup's last S of the tile, and that wait
  // sat where the epilogue had been: -2 to -5% with three warpgroups or causal tiles;
  // with two, +4-6% at T = 1K and up to -15% with three warpgroups: H200, session 24,
  // so launch_fwd's rule runs it on the two-warpgroup pingpong only.)
  struct NoNextTile {
    __device__ bool operator()(FwdTile&) const { return false; }
  };
  struct NoEpilogue {
    __device__ void operator()(float (&)[kORegs], OnlineSoftmax<kBlockN>&, const FwdTile&) const {}
  };
  template <bool kCausal, bool kOverlap, bool kPingpong, bool kMasked = false, bool kReleaseQ = false,
            class NextTile = NoNextTile, class Epilogue = NoEpilogue>
  __device__ static void consume(float (&o)[kORegs], OnlineSoftmax<kBlockN>& softmax, const FwdSmem<Tr>& sm,
                                 const FwdTile& first_tile, const FwdArgs& args, int wg, int tid, Pipe& pipe,
                                 uint32_t q_phase, const MaskView* mask_view = nullptr, NextTile next_tile = {},
                                 Epilogue epilogue = {}) {
    constexpr bool kChain = !std::is_same_v<NextTile, NoNextTile>;
    static_assert(!kChain || (kOverlap && !kMasked && kReleaseQ && Tr::kQBuffers == 2),
                  "chained tiles: overlap, unmasked, two Q buffers beside the O buffer");
    constexpr bool kAdd = Tr::template desc_add<kCausal, kMasked>();
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    FwdTile tile = first_tile;
    // The first query row of this warpgroup, and this thread's h = 0 row.
    int wg_row0 = (kMasked ? tile.row0 : tile.m_block * kBlockM) + wg * 64;
    int row0 = wg_row0 + warp * 16 + g;
    // (kChain: the tile's index in the CTA's sequence picks its Q buffer and parity)
    int q_tile = 0;
    uint32_t q_rows = sm.q() + wg * 64 * 128;
    auto q_empty = [&] { return sm.bar_q_empty(kChain ? q_buffer<Tr>(q_tile) : 0); };
    const float sl2 = args.scale_log2;
    const int S = args.seqlen_k;

#pragma unroll
    for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
    softmax.init();
    if (kMasked && tile.empty()) {  // (its Q load was issued before the range was known)
      hptx::mbar_wait(sm.bar_q(), q_phase);
      return;
    }
    float s[kSRegs];
    uint32_t p[kPRegs];
    float alpha[2];

    // Masked: segment ids of this thread's rows (once), compared with the block's
    // columns' (fetched a block ahead) by load_ids(n) before the S wgmma is waited for.
    const bool segments = kMasked && mask_view->q_seg != nullptr;
    int row_ids[2] = {0, 0};
    SegmentBits<kMasked ? kSRegs : 4> seg;
    if (segments) load_row_ids(row_ids, mask_view->q_seg, row0, mask_view->q_len);
    // Block n + 1's key ids are fetched during block n (SegmentAhead).
    SegmentAhead<kMasked ? kSRegs : 4> ahead;
    if constexpr (kMasked) {
      if (segments) ahead.start(row_ids, mask_view->kv_seg, tile.key0 + tile.n_begin * kBlockN, mask_view->kv_len);
    }
    auto load_ids = [&](int n) {
      if constexpr (kMasked) {
        if (segments)
          ahead.step(seg, row_ids, mask_view->kv_seg, n + 1 < tile.n_blocks ? tile.key0 + (n + 1) * kBlockN : -1, t,
                     mask_view->kv_len);
      }
    };
    // Masking is needed where the block has keys >= S, or (causal) keys past the
    // first row of this warpgroup; masked kernels: the soft cap, then where the
    // block may hide a pair of this warp's rows.
    auto needs_mask = [&](int n) {
      return (n + 1) * kBlockN > S || (kCausal && n * kBlockN + kBlockN - 1 > wg_row0);
    };
    auto mask = [&](int n) {
      if constexpr (kMasked) {
        const MaskView& m = *mask_view;
        if (args.attn.softcap > 0.f) softcap_tile(s, args.attn.scale, args.attn.softcap);
        mask_tile_where_needed<true, 16, true>(s, m, wg_row0 + 16 * warp, row0, tile.key0 + n * kBlockN, t, segments,
                                               seg);
      } else {
        if (needs_mask(n)) apply_mask<kBlockN, kCausal>(s, n * kBlockN, row0, t, S);
      }
    };

    // S = Q K(pipe)^T of one block, alone in a pingpong turn; O += P V(at), alone in one.
    auto issue_s = [&] {
      hptx::mbar_wait(sm.bar_k_full(pipe.stage), pipe.phase);
      turn_begin<kPingpong>(wg);
      hptx::wgmma_fence();
      issue_qk<kAdd>(s, q_rows, sm.k(pipe.stage));
      hptx::wgmma_commit();
      turn_end<kPingpong>(wg);
    };
    auto issue_pv_alone = [&](const Pipe& at) {
      hptx::mbar_wait(sm.bar_v_full(at.stage), at.phase);
      turn_begin<kPingpong>(wg);
      hptx::wgmma_fence();
      issue_pv<kAdd>(o, p, sm.v(at.stage));
      hptx::wgmma_commit();
      turn_end<kPingpong>(wg);
    };

    hptx::mbar_wait(sm.bar_q(), q_phase);
    // Warpgroup 0 takes the first turn.
    if (kPingpong && wg == 1) hptx::named_bar_arrive(3, 256);

    if constexpr (!kOverlap) {
      for (int n = tile.n_begin; n < tile.n_blocks; ++n) {
        issue_s();
        load_ids(n);
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(s);
        release(sm.bar_k_empty(pipe.stage), lane);
        mask(n);
        if (kReleaseQ && n == tile.n_blocks - 1) release(q_empty(), lane);
        softmax.step(s, sl2, alpha);
        rescale_o(o, alpha);
        convert_p(s, p);
        issue_pv_alone(pipe);
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(o);
        release(sm.bar_v_empty(pipe.stage), lane);
        pipe.advance();
      }
    } else {
      // First block: S, softmax, P.
      issue_s();
      load_ids(tile.n_begin);
      hptx::wgmma_wait<0>();
      hptx::reg_fence_array(s);
      release(sm.bar_k_empty(pipe.stage), lane);
      mask(tile.n_begin);
      if (kReleaseQ && tile.n_begin == tile.n_blocks - 1) release(q_empty(), lane);
      softmax.step(s, sl2, alpha);
      convert_p(s, p);
      Pipe prev = pipe;
      pipe.advance();
      for (;;) {  // (kChain: once per tile; else once)
        for (int n = tile.n_begin + 1; n < tile.n_blocks; ++n) {
          hptx::mbar_wait(sm.bar_k_full(pipe.stage), pipe.phase);
          turn_begin<kPingpong>(wg);
          hptx::wgmma_fence();
          issue_qk<kAdd>(s, q_rows, sm.k(pipe.stage));
          hptx::wgmma_commit();
          hptx::mbar_wait(sm.bar_v_full(prev.stage), prev.phase);
          hptx::wgmma_fence();
          issue_pv<kAdd>(o, p, sm.v(prev.stage));
          hptx::wgmma_commit();
          turn_end<kPingpong>(wg);
          load_ids(n);
          hptx::wgmma_wait<1>();  // S(n) done, PV(n-1) may still run
          hptx::reg_fence_array(s);
          release(sm.bar_k_empty(pipe.stage), lane);
          mask(n);
          if (kReleaseQ && n == tile.n_blocks - 1) release(q_empty(), lane);
          softmax.step(s, sl2, alpha);
          hptx::wgmma_wait<0>();
          hptx::reg_fence_array(o);
          hptx::reg_fence_array(p);
          release(sm.bar_v_empty(prev.stage), lane);
          rescale_o(o, alpha);
          convert_p(s, p);
          prev = pipe;
          pipe.advance();
        }
        issue_pv_alone(prev);
        if constexpr (kChain) {
          FwdTile next;
          if (next_tile(next)) {
            // The next tile's first S beside this tile's last PV.
            hptx::mbar_wait(sm.bar_q(q_buffer<Tr>(q_tile + 1)), q_parity<Tr>(q_tile + 1));
            q_rows = sm.q(q_buffer<Tr>(q_tile + 1)) + wg * 64 * 128;
            issue_s();
            // (Both waited for before the epilogue: with S still in flight there, ptxas
            // serialises the wgmmas, C7514. The other warpgroup's turns keep the tensor
            // cores busy meanwhile.)
            hptx::wgmma_wait<0>();
            hptx::reg_fence_array(o);
            hptx::reg_fence_array(s);
            release(sm.bar_v_empty(prev.stage), lane);
            release(sm.bar_k_empty(pipe.stage), lane);
            epilogue(o, softmax, tile);
            tile = next;
            wg_row0 = tile.m_block * kBlockM + wg * 64;
            row0 = wg_row0 + warp * 16 + g;
            ++q_tile;
#pragma unroll
            for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
            softmax.init();
            mask(tile.n_begin);
            if (tile.n_begin == tile.n_blocks - 1) release(q_empty(), lane);
            softmax.step(s, sl2, alpha);
            convert_p(s, p);
            prev = pipe;
            pipe.advance();
            continue;
          }
        }
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(o);
        release(sm.bar_v_empty(prev.stage), lane);
        if constexpr (kChain) epilogue(o, softmax, tile);
        break;
      }
    }
    // Balance barrier 3: warpgroup 1 arrived once more (its initial hand-over).
    if (kPingpong && wg == 0) hptx::named_bar_sync(3, 256);
  }
};

}  // namespace jaxattn::sm90
