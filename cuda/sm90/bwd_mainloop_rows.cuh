// Consumer loop of the Hopper backward with 128-query steps at head dim 64
// (BwdTraits::kRows): the H=64 default for unmasked, non-deterministic calls (H200,
// standalone: causal +4-6% over the split with the late dQ at T = 1K / 4K / 16K, session
// 30 run 1; non-causal +1.5-3.6% over the pingpong at T = 1K / 4K / 16K, session
// 44 on an H100).
//
// The CTA holds 128 keys (K, V); a step is 128 query rows (Q, dO, their lse / D),
// twice the default tile's, so the per-step costs (barriers, the stage hand-offs,
// the dQ hand-off) are paid once per twice the FLOPs. Warpgroup wg takes query rows
// 64 wg .. 64 wg + 63 of the step for the score products and its keys 64 wg ..
// for the gradient products:
//   S  = Q_wg K^T, dP = dO_wg V^T   (64 x 128 each, A and B from shared memory)
//   P  = exp2(S scale log2e - lse), dS = P (dP - D)  (per query row: two rows a thread)
//   P, dS -> shared memory as [128 queries][128 keys] (two 64-key chunks; the dS^T
//        area's slots: dS in slot 0, P in slot 1), one barrier of both warpgroups
//   dQ_wg  = dS_wg K      (64 x 64, A = dS from registers)     -> the dQ warp
//   dV_wg += P^T dO,  dK_wg += dS^T Q   (this warpgroup's 64 keys over all 128 queries,
//        A = the tile's key chunk wg, MN-major)
// A second barrier of both warpgroups per step (before P is written) keeps the
// single P / dS tiles from being overwritten while the other warpgroup's dV / dK
// still read them (double tiles would not fit beside the 2-stage ring: 229 KB).
// Registers at the peak (dS being formed): S 64 + dP 64 + dK 32 + dV 32 f32.
// Unmasked calls only, not deterministic (run_bwd sends those to the other kernels).
#pragma once

#include <cuda.h>

#include <cmath>

#include "common/hopper_ptx.h"
#include "common/ptx.h"
#include "sm90/bwd_mainloop.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/smem_rows.cuh"

namespace jaxattn::sm90 {

template <class Tr>
struct BwdMainloopRows {
  using Base = BwdMainloop<Tr>;
  using Elem = typename Tr::Elem;
  static_assert(Tr::kRows && Tr::kHeadDim == 64 && Tr::kBlockM == 128 && Tr::kBlockN == 128, "row steps");
  static constexpr int kBlockM = Tr::kBlockM;
  static constexpr int kBlockN = Tr::kBlockN;
  static constexpr int kSRegs = kBlockN / 2;   // S / dP floats: 64 query rows x 128 keys
  static constexpr int kPRegs = kBlockN / 4;   // P / dS packed 16-bit pairs
  static constexpr int kAccRegs = Tr::kAccRegs;  // dK / dV: 64 keys x 64
  static constexpr int kDqRegs = Tr::kDqCols / 2;  // dQ: 64 rows x 64
  static constexpr uint32_t kChunk = kBlockM * 128;  // bytes of one 64-key chunk of the P / dS tiles
  using Pipe = typename Base::Pipe;

  // acc(64 rows of the A tile at a_rows, 128 keys) = A B^T over the head dim (one
  // 64-element chunk), both K-major: S = Q K^T, dP = dO V^T.
  __device__ __forceinline__ static void issue_scores(float (&acc)[kSRegs], uint32_t a_rows, uint32_t b_tile) {
    const hptx::TileDesc<false> a(a_rows, 16, 1024), b(b_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < Tr::kHeadDim / 16; ++kk)
      hptx::wgmma_ss<Elem, kBlockN, 0>(acc, a.at(kk * 32), b.at(kk * 32), kk > 0 ? 1 : 0);
  }

  // acc(64 keys, 64) += A^T B over the step's 128 queries: A = key chunk `chunk` of a
  // [queries][keys] tile (MN-major), B = the step's Q or dO tile (MN-major).
  __device__ __forceinline__ static void issue_grad(float (&acc)[kAccRegs], uint32_t chunk, uint32_t b_tile) {
    const hptx::TileDesc<false> a(chunk, kChunk, 1024), b(b_tile, kBlockM * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      hptx::wgmma_ss_t<Elem, Tr::kHeadDim, 1, 1>(acc, a.at(kk * 16 * 128), b.at(kk * 16 * 128), 1);
  }

  // dq(64 rows, 64) = dS K over the CTA's 128 keys: A = dS from registers, B = K (MN-major).
  __device__ __forceinline__ static void issue_dq(float (&dq)[kDqRegs], const uint32_t (&ds)[kPRegs], uint32_t k_tile) {
    const hptx::TileDesc<false> b(k_tile, kBlockN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t f[4] = {ds[4 * kk], ds[4 * kk + 1], ds[4 * kk + 2], ds[4 * kk + 3]};
      hptx::wgmma_rs<Elem, Tr::kHeadDim, 1>(dq, f, b.at(kk * 16 * 128), kk > 0 ? 1 : 0);
    }
  }

  // P = exp2(S scale log2e - lse) in place (rows q0, q0 + 8; keys key0 + 8 j + e); with
  // kMask, keys >= S and (causal) keys past the row's query are zeroed.
  template <bool kCausal, bool kMask>
  __device__ __forceinline__ static void probs(float (&s)[kSRegs], const float (&lse)[2], int q0, int key0, int S,
                                               float sl2) {
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          x = ptx::exp2_approx(fmaf(x, sl2, -lse[h]));
          if constexpr (kMask) {
            const int key = key0 + 8 * j + e;
            if (key >= S || (kCausal && key > q0 + 8 * h)) x = 0.f;
          }
        }
  }

  // S and dP of the step in ring stage `stage` (two commit groups), once it has landed
  // (the full barrier's phase `phase`).
  __device__ __forceinline__ static void issue_step_scores(float (&s)[kSRegs], float (&dp)[kSRegs],
                                                           const BwdSmem<Tr>& sm, int stage, uint32_t phase, int wg) {
    hptx::mbar_wait(sm.bar_q_full(stage), phase);
    hptx::wgmma_fence();
    issue_scores(s, sm.q(stage) + 64 * wg * 128, sm.k());
    hptx::wgmma_commit();
    issue_scores(dp, sm.dout(stage) + 64 * wg * 128, sm.v());
    hptx::wgmma_commit();
  }

  // wg: consumer warpgroup (0 or 1); tid: thread in it (0..127).
  template <bool kCausal>
  __device__ static void consume(float (&dk)[kAccRegs], float (&dv)[kAccRegs], const BwdSmem<Tr>& sm,
                                 const BwdTile& tile, const BwdArgs& args, int wg, int tid) {
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int row0 = 64 * wg + 16 * warp + g;  // this thread's h = 0 row of the step
    const float sl2 = args.scale_log2;
    const int S = args.seqlen_k;
    const uint32_t ds_tile = sm.ds(0), p_tile = sm.ds(1);

#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) dk[i] = dv[i] = 0.f;
    float s[kSRegs], dp[kSRegs], dq[kDqRegs];
    uint32_t pk[kPRegs];

    hptx::mbar_wait(sm.bar_kv(), 0);
    Pipe pipe;
    int step = 0;
    for (int hg = 0; hg < args.group; ++hg) {
      const int head = tile.kv_head * args.group + hg;
      for (int m = tile.m_begin; m < tile.m_end; ++m, ++step) {
        const int q_base = tile.q_row<Tr>(m);
        issue_step_scores(s, dp, sm, pipe.stage, pipe.phase, wg);
        const uint32_t q_tile = sm.q(pipe.stage), do_tile = sm.dout(pipe.stage);
        // This thread's two rows' lse (log2 domain; +inf past T) and D.
        const uint32_t stats = sm.stats(pipe.stage);
        float lse[2], dps[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          lse[h] = ptx::ld_shared_f32(stats + 4 * (row0 + 8 * h));
          dps[h] = ptx::ld_shared_f32(stats + 4 * (kBlockM + row0 + 8 * h));
        }

        // P once S is in: s[4 j + 2 h + e] is row row0 + 8 h, key key_first + 8 j + 2 t + e.
        hptx::wgmma_wait<1>();
        hptx::reg_fence_array(s);
        const int q_first = q_base + 64 * wg;
        const bool need_mask = tile.key_first + kBlockN - 1 >= S || (kCausal && tile.key_first + kBlockN - 1 > q_first);
        // Two paths (as BwdMainloop::probs: a mask test inside the one loop made ptxas
        // compute the predicates on every step, session 9), each running on through the
        // P stores: with the paths joined right after probs, the packs and stores ran
        // back to back after the join (as at head dim 256, bwd_mainloop_wide.cuh). H200,
        // session 36 run 5, standalone causal: +4.4 / +5.3 / +5.0% at T = 2K / 4K / 16K.
        // (The same split in BwdMainloop, through the dV issue at head dim 128, made
        // ptxas serialise the wgmmas (C7512): -15%.)
        auto p_part = [&](auto masked) {
          probs<kCausal, decltype(masked)::value>(s, lse, q_base + row0, tile.key_first + 2 * t, S, sl2);
#pragma unroll
          for (int i = 0; i < kPRegs; ++i) pk[i] = ptx::pack2<Elem>(s[2 * i], s[2 * i + 1]);
          // Both warpgroups' dV / dK of the step before have read the P / dS tiles.
          hptx::named_bar_sync(1, 256);
          store_packed_sw128<kBlockN>(pk, p_tile, kChunk, row0, t);
        };
        if (need_mask)
          p_part(std::true_type{});
        else
          p_part(std::false_type{});

        // dS once dP is in (P still in f32), into registers (dQ's A) and the tile.
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(dp);
#pragma unroll
        for (int i = 0; i < kSRegs; ++i) dp[i] = s[i] * (dp[i] - dps[(i / 2) % 2]);  // (row h = (i / 2) % 2)
#pragma unroll
        for (int i = 0; i < kPRegs; ++i) pk[i] = ptx::pack2<Elem>(dp[2 * i], dp[2 * i + 1]);
        store_packed_sw128<kBlockN>(pk, ds_tile, kChunk, row0, t);
        hptx::fence_proxy_async_smem();
        hptx::named_bar_sync(1, 256);  // both warpgroups' rows of P and dS are in

        hptx::wgmma_fence();
        issue_dq(dq, pk, sm.k());
        hptx::wgmma_commit();
        issue_grad(dv, p_tile + wg * kChunk, do_tile);
        issue_grad(dk, ds_tile + wg * kChunk, q_tile);
        hptx::wgmma_commit();

        // dQ to the dQ warp while dV / dK run.
        hptx::wgmma_wait<1>();
        hptx::reg_fence_array(dq);
        hptx::reg_fence_array(pk);  // dQ's A operand, live until its wgmma is done
        Base::stage_dq(dq, nullptr, sm, tile, args, head, q_base, wg, tid, step, nullptr);

        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(dk);
        hptx::reg_fence_array(dv);
        Base::release(sm.bar_q_empty(pipe.stage), lane);
        pipe.advance();
      }
    }
  }
};

}  // namespace jaxattn::sm90
