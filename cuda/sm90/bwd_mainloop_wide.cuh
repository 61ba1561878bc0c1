// Consumer main loop of the Hopper backward at head dim 256 ("wide": layout and
// producer in bwd_traits.cuh / BwdMainloop), the work of each step split by role.
//
// Warpgroup 0 computes S^T and warpgroup 1 dP^T, each for all 64 query columns (wgmma
// N = 64), so K and V are read once a step; each holds a whole 64 x 256 accumulator
// (warpgroup 0 dV, warpgroup 1 dK, halves `lo` / `hi` of 128 columns), which it feeds
// from registers (RS wgmma: P^T resp. dS^T never read back from shared memory for dV /
// dK). ~456 KB of shared memory a step. (The split it replaced gave each warpgroup 32
// query columns of both S^T and dP^T: wgmma N = 32 with both operands in shared memory,
// both warpgroups reading all of K and V every step, ~544 KB a step, and 192 B/clk of
// operands against the 128 B/clk shared memory serves.)
//
// Per step:
//   wg 0: S^T; masked calls: the MaskView applied (BwdStepMask over the 64 query
//         columns); P^T = exp(...) (f32); P^T as f16 to the P^T slot for warpgroup 1
//         (f16 keeps 2^-11 relative for P in [0, 1], where bf16 would round dS's
//         factor to 2^-9; masked: P times the soft cap's gradient factor, also in
//         [0, 1], so warpgroup 1's dS^T comes out chained with no mask state of its
//         own, and masked P is 0); arrive on kBarP; dV += P^T dO (RS); wait for
//         kBarDs; dQ[:, 0:128] = dS K (two 64-column halves, A = dS^T from shared
//         memory).
//   wg 1: dP^T; wait for kBarP; P from the slot (ldmatrix, the A-fragment layout is
//         the accumulator's); dS^T = P (dP^T - D); dK += dS^T Q (RS); dS^T (Elem) to
//         the dS^T slot; arrive on kBarDs; dQ[:, 128:256].
// dQ staging: warpgroup 0 over the step's dO tile, 1 over its Q tile. Nothing else
// reads those once they stage: dO's other reader (dP^T, warpgroup 1) is done before
// kBarDs, Q's (S^T, warpgroup 0) before kBarP, and each warpgroup's own dV / dK reads
// complete before its staging. One thread adds the staged dQ to the global
// accumulator with a TMA reduce-add; the stage goes back to the producer when that
// reduce has read it (checked at the next step, after its first wgmma is issued). The
// P^T / dS^T slots are double-buffered: a warpgroup rewrites slot b two steps later,
// after the other has passed the hand-off of the step between (so it has read slot b).
// H200 against the split by query columns: standalone unmasked backward +16-18%
// non-causal, +9-12% causal (session 33 run 1); masked calls through JAX, fwd+bwd:
// sliding window +17%, documents +8-10% (session 34 run 2).
#pragma once

#include <cuda.h>
#include <cuda_fp16.h>

#include "common/hopper_ptx.h"
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
  static constexpr int kSRegs = kBlockM / 2;        // S^T / dP^T accumulator (64 keys x 64 queries)
  static constexpr int kPRegs = kBlockM / 4;        // packed 16-bit pairs of it
  static constexpr int kHalfRegs = Tr::kAccRegs;    // one 128-column half of dV / dK (64 floats)
  static constexpr int kChunkBytes = kBlockM * 128;  // one 64-column chunk of a Q / dO / K tile
  static_assert(kBlockN * 128 == kChunkBytes, "K and Q tiles share the chunk stride");
  static constexpr int kDqCols = 64;                // columns of one dQ accumulator (two per warpgroup)
  // Named barriers of the hand-offs (ids 1 and 2 + wg are the epilogue's / a warpgroup's own).
  static constexpr int kBarP = 4, kBarDs = 5;
  using Pipe = PipeState<Tr::kStages>;

  // acc(64 keys x 64 queries) = A B^T over the head dim: A = K or V, B = Q or dO (both
  // K-major chunked tiles).
  template <bool kAdd>
  __device__ __forceinline__ static void issue_abT(float (&acc)[kSRegs], uint32_t a_tile, uint32_t b_tile) {
    const hptx::TileDesc<kAdd> a(a_tile, 16, 1024), b(b_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t chunk = kk / 4, off = (kk % 4) * 32;
      hptx::wgmma_ss<Elem, kBlockM, 0>(acc, a.at(chunk * kChunkBytes + off), b.at(chunk * kChunkBytes + off),
                                       kk > 0 ? 1 : 0);
    }
  }

  // dq(64 queries x 64) = dS K for head-dim columns 128 wg + 64 part ..: A = the dS^T
  // tile read MN-major, B = K (MN-major).
  template <bool kAdd>
  __device__ __forceinline__ static void issue_dq(float (&dq)[kDqCols / 2], uint32_t ds_tile, uint32_t k_tile, int wg,
                                                  int part) {
    const uint32_t b_base = k_tile + (wg * 2 + part) * kChunkBytes;
    const hptx::TileDesc<kAdd> a(ds_tile, kBlockN * 128, 1024), b(b_base, kChunkBytes, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      hptx::wgmma_ss_t<Elem, kDqCols, 1, 1>(dq, a.at(kk * 16 * 128), b.at(kk * 16 * 128), kk > 0 ? 1 : 0);
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

  // acc += A B over the step's 64 queries, all 256 columns as two halves: A = P^T or
  // dS^T from registers (a[4 kk + i]: k-step kk), B = dO or Q (MN-major chunked tile).
  template <bool kAdd>
  __device__ __forceinline__ static void issue_rs(float (&lo)[kHalfRegs], float (&hi)[kHalfRegs],
                                                  const uint32_t (&a)[kPRegs], uint32_t b_tile) {
    const hptx::TileDesc<kAdd> b0(b_tile, kChunkBytes, 1024), b1(b_tile + 2 * kChunkBytes, kChunkBytes, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const uint32_t f[4] = {a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3]};
      hptx::wgmma_rs<Elem, 128, 1>(lo, f, b0.at(kk * 16 * 128), 1);
      hptx::wgmma_rs<Elem, 128, 1>(hi, f, b1.at(kk * 16 * 128), 1);
    }
  }

  // wg: consumer warpgroup (0: S^T / P / dV, 1: dP^T / dS / dK); tid: thread in it.
  // lo / hi: its accumulator (dV for 0, dK for 1), head-dim columns 0..127 / 128..255.
  // kMasked: as BwdMainloop::consume (the MaskView in mask_view; warpgroup 0 applies it).
  template <bool kCausal, bool kMasked = false>
  __device__ static void consume(float (&lo)[kHalfRegs], float (&hi)[kHalfRegs], const CUtensorMap* tm_dq,
                                 const BwdSmem<Tr>& sm, const BwdTile& tile, const BwdArgs& args, int wg, int tid,
                                 const MaskView* mask_view = nullptr, const MaskView* dq_view = nullptr) {
    static_assert(!(kCausal && kMasked), "masked kernels take causal from the MaskView");
    constexpr bool kAdd = Tr::template desc_add<kCausal, kMasked>();
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int key_cta0 = tile.key_first;
    const int key0 = key_cta0 + warp * 16 + g;  // this thread's h = 0 key row
    const int row = warp * 16 + g;
    const float sl2 = args.scale_log2;
    const int S = args.seqlen_k;

#pragma unroll
    for (int i = 0; i < kHalfRegs; ++i) lo[i] = hi[i] = 0.f;
    float acc[kSRegs], dq[kDqCols / 2];  // (acc: S^T / dP^T, then the second dQ half)
    uint32_t pk[kPRegs];
    BwdStepMask<kMasked, kBlockM> mask(mask_view, args.attn, key0);  // (used by warpgroup 0 only)
    if (wg == 0) mask.begin(tile.m_begin < tile.m_end ? tile.q_row<Tr>(tile.m_begin) : -1);

    hptx::mbar_wait(sm.bar_kv(), 0);
    Pipe pipe;
    int buf = 0;
    int pending_stage = -1;  // stage whose dQ reduce-add may still be reading it (thread 0)
    for (int hg = 0; hg < args.group; ++hg) {
      const int head = tile.kv_head * args.group + hg;
      for (int m = tile.m_begin; m < tile.m_end; ++m) {
        const int q_base = tile.q_row<Tr>(m);
        const uint32_t q_tile = sm.q(pipe.stage), do_tile = sm.dout(pipe.stage);
        const uint32_t stats = sm.stats(pipe.stage);
        // S^T (wg 0) or dP^T (wg 1), all 64 query columns.
        hptx::mbar_wait(sm.bar_q_full(pipe.stage), pipe.phase);
        hptx::wgmma_fence();
        issue_abT<kAdd>(acc, wg == 0 ? sm.k() : sm.v(), wg == 0 ? q_tile : do_tile);
        hptx::wgmma_commit();
        if constexpr (kMasked) {
          if (wg == 0) {
            const int next_m = Base::next_step_block(tile, args.group, hg, m);
            mask.load_ids(next_m < 0 ? -1 : tile.q_row<Tr>(next_m), t);
          }
        }
        // The previous step's reduce-add has read its staging: that stage is free.
        free_stage(sm, tid, pending_stage);
        float2 col[kBlockM / 8];  // lse (wg 0) or D (wg 1) of the 64 query columns
        Base::template load_col_stats<kBlockM>(col, stats + (wg == 0 ? 0 : kBlockM * 4), t);
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(acc);

        // Warpgroup 0's part of the step up to the hand-off of dS^T, in one of three
        // forms (kPart): 0 one path (probs masks where need_mask: non-causal and masked
        // calls); causal unmasked calls 1 on the diagonal step (causal and key >= S
        // masks), 2 on every other step (the non-causal form: only the CTA-invariant key
        // >= S test, predicated). Causal used to branch around probs alone: the paths
        // joined after the exps, so the packs and the P stores ran back to back after
        // the join and the dV wgmma waited for them (6.9% of the stall samples, session
        // 36 run 3). Two whole copies interleave as the non-causal step does: causal
        // backward +5.5-6% at T = 2K-16K, non-causal unchanged (session 36 run 4).
        auto wg0_part = [&](auto part) {
          constexpr int kPart = decltype(part)::value;
          mask.apply(acc, args.attn, key_cta0, key0, q_base, t);
          if constexpr (kPart == 0) {
            // (Never causal here: causal unmasked calls take 1 / 2, masked ones have kCausal false.)
            const bool need_mask = !kMasked && key_cta0 + kBlockN - 1 >= S;
            Base::template probs<kCausal, kBlockM>(acc, col, q_base, key0, S, sl2, need_mask, t);
          } else if constexpr (kPart == 1) {
            Base::template probs_tile<true, true, kBlockM>(acc, col, q_base, key0, S, sl2, true, t);
          } else {
            Base::template probs_tile<false, true, kBlockM>(acc, col, q_base, key0, S, sl2,
                                                            key_cta0 + kBlockN - 1 >= S, t);
          }
          if constexpr (kMasked || !std::is_same_v<Elem, __half>) {
            uint32_t ph[kPRegs];  // (masked: P times the cap's gradient, for warpgroup 1's dS^T)
#pragma unroll
            for (int i = 0; i < kPRegs; ++i) {
              const float2 x = mask.chained_pair(acc[2 * i], acc[2 * i + 1], i);
              ph[i] = ptx::pack2<__half>(x.x, x.y);
            }
            store_packed_sw128<kBlockM>(ph, sm.pt(buf), 0, row, t);
          }
#pragma unroll
          for (int i = 0; i < kPRegs; ++i) pk[i] = ptx::pack2<Elem>(acc[2 * i], acc[2 * i + 1]);
          if constexpr (!kMasked && std::is_same_v<Elem, __half>) store_packed_sw128<kBlockM>(pk, sm.pt(buf), 0, row, t);
          hptx::named_bar_arrive(kBarP, 256);  // P of this step in slot buf
          hptx::wgmma_fence();
          issue_rs<kAdd>(lo, hi, pk, do_tile);  // dV += P^T dO
          hptx::wgmma_commit();
        };
        if (wg == 0) {
          if constexpr (kCausal && !kMasked) {
            if (key_cta0 + kBlockN - 1 > q_base)
              wg0_part(std::integral_constant<int, 1>{});
            else
              wg0_part(std::integral_constant<int, 2>{});
          } else {
            wg0_part(std::integral_constant<int, 0>{});
          }
          hptx::named_bar_sync(kBarDs, 256);  // dS^T of this step in slot buf (async-proxy fenced)
        } else {
          hptx::named_bar_sync(kBarP, 256);
          uint32_t pf[kPRegs];  // P (f16) in the accumulator's layout
          load_a_frags_sw128<kBlockM>(pf, sm.pt(buf), 0, warp, lane);
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float2 p = ptx::unpack2<__half>(pf[2 * j + h]);
              float& x = acc[4 * j + 2 * h];
              float& y = acc[4 * j + 2 * h + 1];
              x = p.x * (x - col[j].x);
              y = p.y * (y - col[j].y);
            }
          }
#pragma unroll
          for (int i = 0; i < kPRegs; ++i) pk[i] = ptx::pack2<Elem>(acc[2 * i], acc[2 * i + 1]);
          hptx::wgmma_fence();
          issue_rs<kAdd>(lo, hi, pk, q_tile);  // dK += dS^T Q
          hptx::wgmma_commit();
          store_packed_sw128<kBlockM>(pk, sm.ds(buf), 0, row, t);
          hptx::fence_proxy_async_smem();
          hptx::named_bar_arrive(kBarDs, 256);
          hptx::named_bar_sync(2 + wg, 128);  // this warpgroup's dS^T rows all written
        }

        // dQ[:, 128 wg + 64 part ...] = dS K, one 64-column half after the other, the
        // first once dV / dK is done (staged by wg 0 over dO, by 1 over Q). With both
        // halves in flight, or the first in flight beside the RS product, ptxas ran
        // out of registers and serialised every wgmma (C7512); with the second half
        // issued before the first is staged, 36 bytes of spills (non-causal). The other
        // warpgroup's products fill these waits.
        hptx::wgmma_wait<0>();
        hptx::wgmma_fence();
        issue_dq<kAdd>(dq, sm.ds(buf), sm.k(), wg, 0);
        hptx::wgmma_commit();
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(dq);
        const uint32_t dq_stage = wg == 0 ? do_tile : q_tile;
        store_acc_f32_sw128<kDqCols, true>(dq, dq_stage, kBlockM * 128, row, t);
        hptx::wgmma_fence();
        issue_dq<kAdd>(acc, sm.ds(buf), sm.k(), wg, 1);
        hptx::wgmma_commit();
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(acc);
        store_acc_f32_sw128<kDqCols, true>(acc, dq_stage + (kDqCols / 32) * kBlockM * 128, kBlockM * 128, row, t);
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
