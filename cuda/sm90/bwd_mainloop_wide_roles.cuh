// Consumer main loop of the Hopper backward at head dim 256 for unmasked calls, the
// work split by role instead of by query columns (the masked calls keep
// BwdMainloopWide; layout and producer as its, bwd_traits.cuh).
//
// BwdMainloopWide gives each warpgroup 32 query columns of S^T and dP^T: wgmma N = 32
// with both operands in shared memory, so both warpgroups read all of K and V every
// step (64 + 64 KB) and an m64n32k16 needs 3 KB of operands per 16 tensor cycles,
// 192 B/clk against the 128 B/clk shared memory serves: that phase runs at <= 2/3 of
// the tensor peak, and the step moves ~544 KB of shared memory. Here warpgroup 0
// computes S^T and warpgroup 1 dP^T, each for all 64 query columns (N = 64), so K and
// V are read once; and each holds a whole 64 x 256 accumulator (warpgroup 0 dV,
// warpgroup 1 dK, halves `lo` / `hi` of 128 columns), which it feeds from registers
// (RS wgmma: P^T resp. dS^T never read back from shared memory for dV / dK). ~456 KB
// of shared memory a step.
//
// Per step:
//   wg 0: S^T; P^T = exp(...) (f32); P^T as f16 to the P^T slot for warpgroup 1
//         (f16 keeps 2^-11 relative for P in [0, 1], where bf16 would round dS's
//         factor to 2^-9); arrive on kBarP; dV += P^T dO (RS); wait for kBarDs;
//         dQ[:, 0:128] = dS K (two 64-column halves, A = dS^T from shared memory).
//   wg 1: dP^T; wait for kBarP; P from the slot (ldmatrix, the A-fragment layout is
//         the accumulator's); dS^T = P (dP^T - D); dK += dS^T Q (RS); dS^T (Elem) to
//         the dS^T slot; arrive on kBarDs; dQ[:, 128:256].
// dQ staging: warpgroup 0 over the step's dO tile, 1 over its Q tile. Nothing else
// reads those once they stage: dO's other reader (dP^T, warpgroup 1) is done before
// kBarDs, Q's (S^T, warpgroup 0) before kBarP, and each warpgroup's own dV / dK reads
// complete before its staging; so the second barrier of both warpgroups that
// BwdMainloopWide needs before staging goes. The slots are double-buffered: a
// warpgroup rewrites slot b two steps later, after the other has passed the
// hand-off of the step between (so it has read slot b).
// Masked calls (experiment -DJAXATTN_EXP_BWD256_ROLES_MASKED=1; not yet run on a GPU):
// warpgroup 0 applies the mask to S^T (BwdStepMask over all 64 query columns) and
// sends P times the soft cap's gradient factor instead of P, so warpgroup 1's dS^T =
// (P g)(dP^T - D) comes out chained with no mask state of its own (P g in [0, 1]: f16
// keeps it as it keeps P).
// H200, session 33 run 1, standalone H=256 backward against BwdMainloopWide's unmasked
// form (dQ in two halves, the next S^T between them): non-causal +16 / +17 / +18%,
// causal +9 / +12 / +10% (T = 1K / 4K / 16K).
#pragma once

#include <cuda.h>
#include <cuda_fp16.h>

#include "common/hopper_ptx.h"
#include "common/ptx.h"
#include "sm90/bwd_mainloop.cuh"
#include "sm90/bwd_mainloop_wide.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/fwd_smem.cuh"  // PipeState
#include "sm90/smem_rows.cuh"

#ifndef JAXATTN_EXP_BWD256_ROLES_MASKED
#define JAXATTN_EXP_BWD256_ROLES_MASKED 0
#endif

namespace jaxattn::sm90 {

// Whether the masked head-dim-256 kernels take the role split too (experiment).
inline constexpr bool kBwd256RolesMasked = JAXATTN_EXP_BWD256_ROLES_MASKED != 0;

template <class Tr>
struct BwdMainloopWideRoles {
  static_assert(Tr::kWide && Tr::kBlockN == 64 && Tr::kBlockM == 64, "wide tile: 64 keys x 64 queries");
  using Elem = typename Tr::Elem;
  using Base = BwdMainloop<Tr>;
  using Wide = BwdMainloopWide<Tr>;
  static constexpr int kBlockM = Tr::kBlockM;
  static constexpr int kBlockN = Tr::kBlockN;
  static constexpr int kSRegs = kBlockM / 2;        // S^T / dP^T accumulator (64 keys x 64 queries)
  static constexpr int kPRegs = kBlockM / 4;        // packed 16-bit pairs of it
  static constexpr int kHalfRegs = Tr::kAccRegs;    // one 128-column half of dV / dK (64 floats)
  static constexpr int kChunkBytes = kBlockM * 128;
  static constexpr int kDqCols = 64;                // columns of one dQ accumulator (two per warpgroup)
  // Named barriers of the hand-offs (ids 1 and 2 + wg are BwdMainloopWide's / the epilogue's).
  static constexpr int kBarP = 4, kBarDs = 5;
  using Pipe = PipeState<Tr::kStages>;

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
        Wide::template issue_abT<kAdd, kBlockM>(acc, wg == 0 ? sm.k() : sm.v(), wg == 0 ? q_tile : do_tile, 0);
        hptx::wgmma_commit();
        if constexpr (kMasked) {
          if (wg == 0) {
            const int next_m = Base::next_step_block(tile, args.group, hg, m);
            mask.load_ids(next_m < 0 ? -1 : tile.q_row<Tr>(next_m), t);
          }
        }
        // The previous step's reduce-add has read its staging: that stage is free.
        Wide::free_stage(sm, tid, pending_stage);
        float2 col[kBlockM / 8];  // lse (wg 0) or D (wg 1) of the 64 query columns
        Base::template load_col_stats<kBlockM>(col, stats + (wg == 0 ? 0 : kBlockM * 4), t);
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(acc);

        if (wg == 0) {
          mask.apply(acc, args.attn, key_cta0, key0, q_base, t);
          const bool need_mask =
              !kMasked && (key_cta0 + kBlockN - 1 >= S || (kCausal && key_cta0 + kBlockN - 1 > q_base));
          Base::template probs<kCausal, kBlockM>(acc, col, q_base, key0, S, sl2, need_mask, t);
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
        Wide::template issue_dq<kAdd, kDqCols>(dq, sm.ds(buf), sm.k(), wg, 0);
        hptx::wgmma_commit();
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(dq);
        const uint32_t dq_stage = wg == 0 ? do_tile : q_tile;
        store_acc_f32_sw128<kDqCols, true>(dq, dq_stage, kBlockM * 128, row, t);
        hptx::wgmma_fence();
        Wide::template issue_dq<kAdd, kDqCols>(acc, sm.ds(buf), sm.k(), wg, 1);
        hptx::wgmma_commit();
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(acc);
        store_acc_f32_sw128<kDqCols, true>(acc, dq_stage + (kDqCols / 32) * kBlockM * 128, kBlockM * 128, row, t);
        Wide::add_staged_dq(tm_dq, dq_stage, tile, args, head, q_base, wg, tid, dq_view);
        pending_stage = pipe.stage;
        pipe.advance();
        buf ^= 1;
      }
    }
    Wide::free_stage(sm, tid, pending_stage);
  }
};

}  // namespace jaxattn::sm90
