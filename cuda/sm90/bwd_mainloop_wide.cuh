// Consumer main loop of the Hopper backward at head dim 256 ("wide", layout in
// bwd_traits.cuh): both consumer warpgroups work on the CTA's 64 keys, warpgroup w
// on query columns 32 w .. 32 w + 31 of S^T / dP^T and on head-dim columns
// 128 w .. 128 w + 127 of dK, dV and dQ. The producer is BwdMainloop's.
//
// Per query block (step), in warpgroup w:
//   1. S^T and dP^T for its 32 query columns (wgmma N = 32, two commit groups).
//   2. P^T, then dS^T, to shared memory (its columns of the shared P^T / dS^T tiles);
//      one barrier of both warpgroups.
//   3. dV += P^T dO, dK += dS^T Q (one commit group), dQ = dS K (another); all
//      operands from shared memory, this warpgroup's half of the head dim.
//   4. Once dV / dK are done in both warpgroups (a second barrier) nothing reads
//      the step's Q / dO any more: dQ (f32) is staged over Q (w = 0) or dO (w = 1)
//      and one thread adds it to the global accumulator with a TMA reduce-add. The
//      stage goes back to the producer when that reduce has read it: checked at
//      the next step, after its first wgmmas are issued.
// Masked calls only: the unmasked ones take BwdMainloopWideRoles
// (bwd_mainloop_wide_roles.cuh), which splits the step by role instead of by query
// columns (+9-18% on the H=256 backward, session 33 run 1).
#pragma once

#include <cuda.h>

#include <cmath>

#include "common/hopper_ptx.h"
#include "common/params.h"  // kDqSemaphoreRows
#include "common/ptx.h"
#include "sm90/bwd_mainloop.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/fwd_smem.cuh"  // PipeState
#include "sm90/smem_rows.cuh"

namespace jaxattn::sm90 {

template <class Tr>
struct BwdMainloopWide {
  static_assert(Tr::kWide && Tr::kBlockN == 64 && Tr::kBlockM == 64, "wide tile: 64 keys x 64 queries");
  using Elem = typename Tr::Elem;
  using Base = BwdMainloop<Tr>;
  static constexpr int kHeadDim = Tr::kHeadDim;
  static constexpr int kBlockM = Tr::kBlockM;
  static constexpr int kBlockN = Tr::kBlockN;
  static constexpr int kQCols = kBlockM / 2;       // query columns of S^T / dP^T per warpgroup
  static constexpr int kSRegs = kQCols / 2;        // their accumulator floats (64 keys x 32)
  static constexpr int kHalf = kHeadDim / 2;       // head-dim columns of dK / dV / dQ per warpgroup
  static constexpr int kAccRegs = Tr::kAccRegs;    // = kHalf / 2
  static constexpr int kChunkBytes = kBlockM * 128;  // one 64-column chunk of a Q / dO / K tile
  static_assert(kBlockN * 128 == kChunkBytes, "K and Q tiles share the chunk stride");
  using Pipe = PipeState<Tr::kStages>;

  // acc(64 keys x kCols queries) = A B^T over the head dim: A = K or V (all 64 rows),
  // B = Q or dO rows kCols wg .. kCols wg + kCols - 1; both K-major chunked tiles.
  template <bool kAdd, int kCols = kQCols>
  __device__ __forceinline__ static void issue_abT(float (&acc)[kCols / 2], uint32_t a_tile, uint32_t b_tile, int wg) {
    const hptx::TileDesc<kAdd> a(a_tile, 16, 1024), b(b_tile + wg * kCols * 128, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t chunk = kk / 4, off = (kk % 4) * 32;
      hptx::wgmma_ss<Elem, kCols, 0>(acc, a.at(chunk * kChunkBytes + off), b.at(chunk * kChunkBytes + off),
                                     kk > 0 ? 1 : 0);
    }
  }

  // acc(64 keys x kHalf) += A B: A = P^T or dS^T ([keys][queries] tile, K-major),
  // B = dO or Q, head-dim columns of half wg (MN-major).
  template <bool kAdd>
  __device__ __forceinline__ static void issue_kv(float (&acc)[kAccRegs], uint32_t a_tile, uint32_t b_tile, int wg) {
    const hptx::TileDesc<kAdd> a(a_tile, 16, 1024), b(b_tile + 2 * wg * kChunkBytes, kChunkBytes, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      hptx::wgmma_ss_t<Elem, kHalf, 0, 1>(acc, a.at(kk * 32), b.at(kk * 16 * 128), 1);
  }

  // dq(64 queries x kCols) = dS K: A = dS^T tile read MN-major, B = K (MN-major), head-dim
  // columns of half wg (kCols = kHalf), or of its part `part` (kCols = kHalf / 2).
  template <bool kAdd, int kCols = kHalf>
  __device__ __forceinline__ static void issue_dq(float (&dq)[kCols / 2], uint32_t ds_tile, uint32_t k_tile, int wg,
                                                  int part = 0) {
    static_assert(kCols % 64 == 0, "whole 64-column chunks of K");
    const uint32_t b_base = k_tile + (wg * (kHalf / 64) + part * (kCols / 64)) * kChunkBytes;
    const hptx::TileDesc<kAdd> a(ds_tile, kBlockN * 128, 1024), b(b_base, kChunkBytes, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      hptx::wgmma_ss_t<Elem, kCols, 1, 1>(dq, a.at(kk * 16 * 128), b.at(kk * 16 * 128), kk > 0 ? 1 : 0);
  }

  // A warpgroup's dQ, staged over `dq_stage` by all its threads, on to the global
  // accumulator: one thread's TMA reduce-add once every write is in (deterministic
  // mode: one add per warpgroup per key block, disjoint columns).
  __device__ __forceinline__ static void add_staged_dq(const CUtensorMap* tm_dq, uint32_t dq_stage, const BwdTile& tile,
                                                       const BwdArgs& args, int head, int q_base, int wg, int tid,
                                                       const MaskView* dq_view) {
    hptx::fence_proxy_async_smem();
    hptx::named_bar_sync(2 + wg, 128);
    if (tid == 0) Base::add_dq(tm_dq, dq_stage, tile, args, head, q_base, wg, dq_view);
  }

  // Thread 0 of a warpgroup: once the reduce-add it issued from stage `stage`'s dQ
  // staging has read it, the stage goes back to the producer (none: stage < 0).
  __device__ __forceinline__ static void free_stage(const BwdSmem<Tr>& sm, int tid, int stage) {
    if (tid == 0 && stage >= 0) {
      hptx::bulk_wait_read0();
      hptx::mbar_arrive(sm.bar_q_empty(stage));
    }
  }

  // wg: consumer warpgroup (0 or 1); tid: thread in it (0..127).
  // kMasked: as BwdMainloop::consume (always, here: unmasked calls take the roles loop).
  template <bool kCausal, bool kMasked>
  __device__ static void consume(float (&dk)[kAccRegs], float (&dv)[kAccRegs], const CUtensorMap* tm_dq,
                                 const BwdSmem<Tr>& sm, const BwdTile& tile, const BwdArgs& args, int wg,
                                 int tid, const MaskView* mask_view = nullptr, const MaskView* dq_view = nullptr) {
    static_assert(kMasked && !kCausal, "masked kernels (causal from the MaskView); unmasked: BwdMainloopWideRoles");
    constexpr bool kAdd = Tr::template desc_add<kCausal, kMasked>();
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int key_cta0 = tile.key_first;  // first key of this CTA
    const int key0 = key_cta0 + warp * 16 + g;    // this thread's h = 0 key row
    const float sl2 = args.scale_log2;
    const int S = args.seqlen_k;

#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) dk[i] = dv[i] = 0.f;
    float s[kSRegs], dp[kSRegs], dq[kHalf / 2];
    uint32_t pk[kSRegs / 2];
    BwdStepMask<kMasked, kQCols> mask(mask_view, args.attn, key0);
    mask.begin(tile.m_begin < tile.m_end ? tile.q_row<Tr>(tile.m_begin) + wg * kQCols : -1);

    hptx::mbar_wait(sm.bar_kv(), 0);
    Pipe pipe;
    int buf = 0;
    int pending_stage = -1;  // stage whose dQ reduce-add may still be reading it (thread 0)
    for (int hg = 0; hg < args.group; ++hg) {
      const int head = tile.kv_head * args.group + hg;
      for (int m = tile.m_begin; m < tile.m_end; ++m) {
        const int q_base = tile.q_row<Tr>(m), q0 = q_base + wg * kQCols;

        hptx::mbar_wait(sm.bar_q_full(pipe.stage), pipe.phase);
        hptx::wgmma_fence();
        issue_abT<kAdd>(s, sm.k(), sm.q(pipe.stage), wg);  // S^T, one commit group
        hptx::wgmma_commit();
        issue_abT<kAdd>(dp, sm.v(), sm.dout(pipe.stage), wg);  // dP^T, another
        hptx::wgmma_commit();
        const uint32_t q_tile = sm.q(pipe.stage), do_tile = sm.dout(pipe.stage);
        const int next_m = Base::next_step_block(tile, args.group, hg, m);
        mask.load_ids(next_m < 0 ? -1 : tile.q_row<Tr>(next_m) + wg * kQCols, t);

        // The previous step's reduce-add has read its staging: that stage is free.
        free_stage(sm, tid, pending_stage);

        // This warpgroup's lse / D columns from the stage's stats tile, in flight while
        // S^T finishes (loading them after the S^T wait, as at head dim 128, measured
        // -0.3 to -1% non-causal and -6 to -7% causal: session 10).
        float2 lse_c[kQCols / 8], dps_c[kQCols / 8];
        const uint32_t stats = sm.stats(pipe.stage) + 4 * wg * kQCols;
        Base::template load_col_stats<kQCols>(lse_c, stats, t);
        Base::template load_col_stats<kQCols>(dps_c, stats + kBlockM * 4, t);

        // P^T, then dS^T, into this warpgroup's columns of the shared tiles.
        hptx::wgmma_wait<1>();
        hptx::reg_fence_array(s);
        mask.apply(s, args.attn, key_cta0, key0, q0, t);
        Base::template probs<kCausal, kQCols>(s, lse_c, q0, key0, S, sl2, false, t);  // (masked by the view)
#pragma unroll
        for (int i = 0; i < kSRegs / 2; ++i) pk[i] = ptx::pack2<Elem>(s[2 * i], s[2 * i + 1]);
        store_packed_sw128<kQCols>(pk, sm.pt(buf), 0, warp * 16 + g, t, wg * kQCols);
        // (dV issued here, under dS^T, behind one more barrier of both warpgroups:
        // -3 to -8% non-causal, +0-1% causal, session 28 run 1.)
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(dp);
        Base::template dscores<kQCols>(dp, s, dps_c);
        mask.chain_grads(dp);
#pragma unroll
        for (int i = 0; i < kSRegs / 2; ++i) pk[i] = ptx::pack2<Elem>(dp[2 * i], dp[2 * i + 1]);
        store_packed_sw128<kQCols>(pk, sm.ds(buf), 0, warp * 16 + g, t, wg * kQCols);
        hptx::fence_proxy_async_smem();
        hptx::named_bar_sync(1, 256);  // both warpgroups' P^T / dS^T columns are in

        hptx::wgmma_fence();
        issue_kv<kAdd>(dv, sm.pt(buf), do_tile, wg);
        issue_kv<kAdd>(dk, sm.ds(buf), q_tile, wg);
        hptx::wgmma_commit();
        issue_dq<kAdd>(dq, sm.ds(buf), sm.k(), wg);
        hptx::wgmma_commit();
        // dV / dK done here and (barrier) in the other warpgroup: Q / dO are free.
        hptx::wgmma_wait<1>();
        hptx::reg_fence_array(dk);
        hptx::reg_fence_array(dv);
        hptx::named_bar_sync(1, 256);
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(dq);
        const uint32_t dq_stage = wg == 0 ? q_tile : do_tile;
        store_acc_f32_sw128<kHalf>(dq, dq_stage, kBlockM * 128, warp * 16 + g, t);
        add_staged_dq(tm_dq, dq_stage, tile, args, head, q_base, wg, tid, dq_view);
        pending_stage = pipe.stage;
        pipe.advance();
        buf ^= 1;
      }
    }
    free_stage(sm, tid, pending_stage);
  }
};

}  // namespace jaxattn::sm90
