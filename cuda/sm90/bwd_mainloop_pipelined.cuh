// Consumer main loop of the Hopper backward at head dim 64, software-pipelined
// (BwdTraits::kPipelined; tile and products as in bwd_traits.cuh). The producer and
// every helper are BwdMainloop's.
//
// At H=64 the elementwise work of a step (P^T, dS^T) takes about as long as its five
// wgmmas, and in BwdMainloop::consume the tensor cores idle through it. Here step k
// first issues S^T(k+1) into the second of two S^T register sets, then computes
// P^T(k) and dS^T(k) while it runs (dP^T(k+1) is issued after step k's products,
// into the one dP^T set):
//   top of step k: wait for every wgmma (S^T(k), dP^T(k), dK(k-1), ...); the Q / dO
//                  stage of step k-1 goes back to the producer
//   issue S^T(k+1)
//   P^T(k), dS^T(k) -> shared memory (P^T: this warpgroup's rows; dS^T: double-buffered);
//   one barrier of both warpgroups (dQ needs both dS^T halves)
//   issue dV += P^T dO, dQ = dS K (one group), dK += dS^T Q (another; SS wgmmas),
//   dP^T(k+1) (a third)
//   wait for dQ; stage it and reduce-add it (BwdMainloop::reduce_dq) while dK runs.
// P^T and dS^T go through shared memory so that only the two S^T / dP^T sets and
// dK / dV live in registers across the step (3 x 32 + 64 floats).
#pragma once

#include <cuda.h>

#include "common/hopper_ptx.h"
#include "common/ptx.h"
#include "sm90/bwd_mainloop.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/fwd_smem.cuh"  // PipeState
#include "sm90/smem_rows.cuh"

namespace jaxattn::sm90 {

template <class Tr>
struct BwdMainloopPipelined {
  static_assert(Tr::kPipelined && Tr::kBlockM == 64 && Tr::kPtBufs == 1, "pipelined tile");
  using Base = BwdMainloop<Tr>;
  using Elem = typename Tr::Elem;
  static constexpr int kBlockM = Tr::kBlockM;
  static constexpr int kBlockN = Tr::kBlockN;
  static constexpr int kSRegs = Base::kSRegs;
  static constexpr int kAccRegs = Base::kAccRegs;
  static constexpr int kDqRegs = Base::kDqRegs;
  using Pipe = PipeState<Tr::kStages>;

  // Everything a step needs besides its register sets.
  struct Ctx {
    const CUtensorMap* tm_dq;
    const BwdSmem<Tr>* sm;
    const BwdTile* tile;
    const BwdArgs* args;
    int wg, tid, key_wg0, steps, blocks;
    Pipe issue_pipe, use_pipe;  // stage of the next step to issue / of the step being worked on
  };

  // S^T of the next step to issue (waits for its Q / dO to land; one commit group).
  __device__ __forceinline__ static void issue_s(Ctx& c, float (&s)[kSRegs]) {
    const BwdSmem<Tr>& sm = *c.sm;
    hptx::mbar_wait(sm.bar_q_full(c.issue_pipe.stage), c.issue_pipe.phase);
    hptx::wgmma_fence();
    Base::issue_abT(s, sm.k() + c.wg * 64 * 128, kBlockN * 128, sm.q(c.issue_pipe.stage));
    hptx::wgmma_commit();
  }
  // dP^T of that step (one commit group); then the next step to issue is the one after.
  __device__ __forceinline__ static void issue_dp(Ctx& c, float (&dp)[kSRegs]) {
    const BwdSmem<Tr>& sm = *c.sm;
    hptx::wgmma_fence();
    Base::issue_abT(dp, sm.v() + c.wg * 64 * 128, kBlockN * 128, sm.dout(c.issue_pipe.stage));
    hptx::wgmma_commit();
    c.issue_pipe.advance();
  }

  // Step k, its scores in (s, dp), the next step's S^T going into s_next (dP^T into dp,
  // once step k is done with it). kLast: no next step. (The number of wgmma groups in
  // flight must not depend on run-time values, or ptxas serialises every wgmma.)
  template <bool kCausal, bool kLast>
  __device__ __forceinline__ static void step(Ctx& c, int k, float (&s)[kSRegs], float (&dp)[kSRegs],
                                              float (&s_next)[kSRegs], float (&dk)[kAccRegs],
                                              float (&dv)[kAccRegs]) {
    const BwdSmem<Tr>& sm = *c.sm;
    const BwdArgs& args = *c.args;
    const int warp = c.tid / 32, lane = c.tid % 32, g = lane / 4, t = lane % 4;
    const int T = args.seqlen_q;
    const int head = c.tile->kv_head * args.group + k / c.blocks;
    const int q_base = (c.tile->m_begin + k % c.blocks) * kBlockM;
    const uint32_t pt_rows = sm.pt(0) + c.wg * 64 * 128;
    float2 lse2, dps2;
    Base::load_row_stats(args.lse + (int64_t)c.tile->batch * T * args.num_heads + head,
                         args.dpsum + ((int64_t)c.tile->batch * args.num_heads + head) * T, q_base, T,
                         args.num_heads, lane, lse2, dps2);

    hptx::wgmma_wait<0>();  // S^T(k), dP^T(k) and everything of step k-1
    hptx::reg_fence_array(s);
    hptx::reg_fence_array(dp);
    hptx::reg_fence_array(dk);
    hptx::reg_fence_array(dv);
    if (k > 0)  // step k-1's Q / dO are read no more
      Base::release(sm.bar_q_empty((c.use_pipe.stage + Tr::kStages - 1) % Tr::kStages), lane);
    if constexpr (!kLast) issue_s(c, s_next);

    const uint32_t q_tile = sm.q(c.use_pipe.stage), do_tile = sm.dout(c.use_pipe.stage);
    const uint32_t ds_tile = sm.ds(k & 1);
    const int key0 = c.key_wg0 + warp * 16 + g;
    const bool need_mask = c.key_wg0 + 63 >= args.seqlen_k || (kCausal && c.key_wg0 + 63 > q_base);
    Base::template probs<kCausal, kBlockM>(s, lse2, q_base, key0, args.seqlen_k, args.scale_log2, need_mask, t);
    const float one[2] = {1.f, 1.f};
    store_acc_sw128<Elem, kBlockM>(s, one, pt_rows, 0, warp * 16 + g, t);
    Base::template dscores<kBlockM>(dp, s, dps2, t);
    store_acc_sw128<Elem, kBlockM>(dp, one, ds_tile + c.wg * 64 * 128, 0, warp * 16 + g, t);
    hptx::fence_proxy_async_smem();
    hptx::named_bar_sync(1, 256);  // both warpgroups' dS^T rows (and this one's P^T) are in

    float dq[kDqRegs];
    hptx::wgmma_fence();
    Base::issue_acc_ss(dv, pt_rows, do_tile);
    Base::issue_dq(dq, ds_tile, sm.k(), c.wg);
    hptx::wgmma_commit();
    Base::issue_acc_ss(dk, ds_tile + c.wg * 64 * 128, q_tile);
    hptx::wgmma_commit();
    if constexpr (!kLast) {
      issue_dp(c, dp);
      hptx::wgmma_wait<2>();  // dQ (and dV, S^T(k+1)); dK, dP^T(k+1) still running
    } else {
      hptx::wgmma_wait<1>();  // dQ (and dV); dK still running
    }
    hptx::reg_fence_array(dq);
    Base::reduce_dq(dq, c.tm_dq, sm, *c.tile, args, head, q_base, c.wg, c.tid);
    c.use_pipe.advance();
  }

  // wg: consumer warpgroup (0 or 1); tid: thread in it (0..127).
  template <bool kCausal>
  __device__ static void consume(float (&dk)[kAccRegs], float (&dv)[kAccRegs], const CUtensorMap* tm_dq,
                                 const BwdSmem<Tr>& sm, const BwdTile& tile, const BwdArgs& args, int wg,
                                 int tid) {
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) dk[i] = dv[i] = 0.f;
    // The zeros are defined here, not sunk past the first wgmmas (ptxas would then
    // serialise every wgmma: a non-wgmma definition of an accumulator in flight).
    hptx::reg_fence_array(dk);
    hptx::reg_fence_array(dv);
    Ctx c{tm_dq, &sm, &tile, &args, wg, tid, tile.n_block * kBlockN + wg * 64, 0, tile.m_end - tile.m_begin, {}, {}};
    c.steps = c.blocks * args.group;
    hptx::mbar_wait(sm.bar_kv(), 0);
    if (c.steps == 0) return;
    float s0[kSRegs], s1[kSRegs], dp[kSRegs];
    issue_s(c, s0);
    issue_dp(c, dp);
    int k = 0;
    for (; k + 2 < c.steps; k += 2) {
      step<kCausal, false>(c, k, s0, dp, s1, dk, dv);
      step<kCausal, false>(c, k + 1, s1, dp, s0, dk, dv);
    }
    if (k + 2 == c.steps) {
      step<kCausal, false>(c, k, s0, dp, s1, dk, dv);
      step<kCausal, true>(c, k + 1, s1, dp, s0, dk, dv);
    } else {
      step<kCausal, true>(c, k, s0, dp, s1, dk, dv);
    }
    hptx::wgmma_wait<0>();
    hptx::reg_fence_array(dk);
    hptx::reg_fence_array(dv);
    Base::release(sm.bar_q_empty((c.use_pipe.stage + Tr::kStages - 1) % Tr::kStages), tid % 32);
  }
};

}  // namespace jaxattn::sm90
