// Compile-time shape of the Hopper backward: CTA tile, pipeline depth, shared
// memory layout and warpgroup roles, plus the shared-memory address helper.
// One instantiation per head dim and element type.
//
// A CTA owns kBlockN = 128 keys of one (batch, kv head): K and V stay resident in
// shared memory and dK / dV in registers (consumer warpgroup w holds keys 64 w ..
// 64 w + 63), while the query blocks (kBlockM rows of Q, dO) of every query head
// of the GQA group stream through a kStages TMA ring. Per query block each
// consumer warpgroup computes, for its 64 keys:
//   S^T = K Q^T, dP^T = V dO^T                   (wgmma, A and B from smem)
//   P^T = exp(scale S^T - lse), dS^T = P^T (dP^T - D)  (registers)
//   dV += P^T dO, dK += dS^T Q                   (wgmma, A = P^T / dS^T from registers)
//   dQ[:, half w] = dS K                         (wgmma, A = dS^T of both warpgroups via smem)
// and adds its half of dQ (f32) into the global accumulator with a TMA reduce-add.
//
// Head dim 256 ("wide": dK + dV of 64 keys x 256 do not fit one warpgroup's
// registers): a CTA owns kBlockN = 64 keys and both consumer warpgroups work on
// all of them, each step split by role (bwd_mainloop_wide.cuh): warpgroup 0 computes
// S^T, P^T (masked calls: the MaskView applied) and dV += P^T dO for all 256 columns,
// warpgroup 1 dP^T, dS^T and dK += dS^T Q (P handed over through shared memory), and
// each computes dQ = dS K for 128 of the columns. dQ is staged in the step's own Q /
// dO buffer once nobody reads it any more, and the stage is handed back to the
// producer after the reduce-add has read it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/params.h"

namespace jaxattn::sm90 {

// Shared memory (offsets from a 1024-aligned base; 16-bit tiles are 128B-swizzled
// [chunks][rows][64 elements], the f32 dQ staging [chunks][64 rows][32 floats]):
//   K   [kChunks][kBlockN][64]          (reused for dK in the epilogue)
//   V   [kChunks][kBlockN][64]          (reused for dV in the epilogue)
//   Q   [kStages][kChunks][kBlockM][64]
//   dO  [kStages][kChunks][kBlockM][64]
//   dS^T [2][kBlockN][kBlockM]           (double-buffered: kBlockM = 64 = one chunk;
//                                         kRows: dS and P [kBlockM][kBlockN] instead)
//   P^T  [2][kBlockN][kBlockM]           (wide only)
//   dQ staging [2 warpgroups][kDqCols/32 chunks][kDqRows][32 floats] (not wide)
//   row stats [kStages][2][kBlockM] f32: the step's lse * log2(e) (+inf for rows
//     past T or with no key) and D, written by the producer warp with each Q / dO stage
//   mbarriers: kv_full, q_full[s], q_empty[s] (+ dq_full[wg], dq_empty[wg]; + ds_full[2], ds_empty[2])
//   masked kernels: the MaskView, 2 ints of reduction scratch
// dQ = dS K is split by head dim: each warpgroup computes half of the columns over all
// 128 keys, so it needs the other's dS^T half (a barrier of both warpgroups every step, or, with
// kSkewDq, a step later through a two-slot ring).
// (Splitting by keys instead, each warpgroup all columns over its own 64 keys, ran
// 2-5% slower at head dim 64 in sessions 3 and 5 and was removed.)
// kPingpong (head dim 64): the consumer warpgroups take turns issuing their wgmma
// bursts (bwd_mainloop.cuh), so one's P / dS phase runs while the other's products execute.
// kRows (head dim 64, unmasked, not deterministic; bwd_mainloop_rows.cuh): steps of
// 128 query rows, each warpgroup S = Q K^T and dP = dO V^T for its 64 of them over the
// CTA's 128 keys; P and dS [128 queries][128 keys] in shared memory (the dS^T area's two
// slots: dS in 0, P in 1) for dV / dK of each warpgroup's 64 keys; dQ = dS K of its 64
// rows with dS from registers, all 64 columns (staging [2 chunks][64 rows][32 floats]).
template <int kHeadDim_, typename Elem_, bool kPingpong_ = false, bool kRows_ = false>
struct BwdTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kPingpong = kPingpong_;
  static constexpr bool kRows = kRows_;
  static_assert(!kPingpong || kHeadDim <= 128, "pingpong: the narrow (two 64-key warpgroups) tile");
  static_assert(!kRows || (kHeadDim == 64 && !kPingpong), "row steps: head dim 64, no pingpong");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim");

  // Wide: both warpgroups share the CTA's 64 keys and split the head dim.
  static constexpr bool kWide = kHeadDim == 256;
  static constexpr int kConsumerWarpgroups = 2;  // each owns 64 keys (wide: half the head dim)
  // Head dims 64 and 128: the dQ staging goes through full / empty mbarriers per
  // warpgroup (consumers write and arrive; warp 1 of the producer warpgroup issues the
  // reduce-add), so no consumer waits on a named barrier for it. H=64: +2-7% (session
  // 7, same run: T=16K 384 -> 410 non-causal, 373 -> 386 causal). H=128 (session 15
  // run 1, standalone, against the named-barrier staging): +2 / 0 / +1.6% non-causal
  // (T = 1K / 4K / 16K), +2 / +4 / +3.6% causal. There the producer warpgroup keeps 24
  // registers so the consumers keep 240 (at 232 ptxas serialised their wgmmas and the
  // dQ warp lost 13-15%, session 7); the producer and dQ warps then spill 12-36 bytes
  // (a loop counter, a row index, the semaphore pointer: L1 hits, off the consumers'
  // path). 256 (wide) has its own path.
  static constexpr bool kDqWarp = kHeadDim <= 128;
  static constexpr int kBlockN = kWide ? 64 : 64 * kConsumerWarpgroups;
  static constexpr int kBlockM = kRows ? 128 : 64;  // query rows per step (one dS^T chunk; kRows: two)
  // (3 stages: same speed at head dim 64 (session 5; the pingpong again in session 38
  // run 4: 0 +- 1%), -1 to +0.3% at 128 (session 9) and -2.9 to +2.8% there in session
  // 44 (H100, with the dQ warp and the late dQ; no consistent sign).)
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // setmaxnreg only moves registers inside the CTA's launch allocation, 168 per thread
  // x 384 (__launch_bounds__(384, 1)) = 64512, not the whole 64K file: 128 x 24 + 256 x
  // 240 fills it exactly. At H=64 the dQ warp's loop gets 32, so its consumers get 232
  // (128 x 32 + 256 x 240 was 1024 over: setmaxnreg.inc waited forever, session 7).
  // The dQ staging stores without bank conflicts (store_acc_f32_sw128's kSpread). H200,
  // session 14 run 6, standalone: H=128 +5 / +4 / +6.5% non-causal (T = 1K / 4K /
  // 16K), +2 / +5.5 / +6.5% causal; H=64 0 to +2% non-causal but -2 / -3 / -3% causal,
  // H=256 causal -0 / -2 / -3% (the selects cost more there than the conflicts did).
  // The H=64 pingpong kernels (non-causal, masked) take it too: session 15 run 3, same
  // run, +1 / +1.2 / +0.5% non-causal (T = 1K / 4K / 16K). The causal H=64 row kernels
  // (64 x 64 staging a warpgroup, as wide as the wide kernels') take it: session 39 run 4,
  // standalone, two rounds, +3.3 / +4.6 / +3.8% (T = 1K / 4K / 16K). The causal split
  // kernels (64 x 32 staging) keep the plain store.
  static constexpr bool kDqStoreSpread = kHeadDim == 128 || (kHeadDim == 64 && (kPingpong || kRows));
  static constexpr int kProducerRegs = kHeadDim == 64 ? 32 : 24;
  static constexpr int kConsumerRegs = kHeadDim == 64 ? 232 : 240;
  static_assert((kProducerRegs + kConsumerWarpgroups * kConsumerRegs) * 128 <= 168 * 384, "register pool");

  static constexpr int kChunks = kHeadDim / 64;
  static constexpr int kDqCols = kRows ? kHeadDim : kHeadDim / 2;        // dQ columns per warpgroup
  static constexpr int kDqRows = kRows ? 64 : kBlockM;                   // dQ rows per warpgroup
  static constexpr int kKvCols = kWide ? kHeadDim / 2 : kHeadDim;        // columns of a dK / dV array (wide: a half)
  static constexpr int kAccRegs = kKvCols / 2;                           // dK / dV floats per thread
  static constexpr int kDqChunks = kDqCols / 32;       // f32 chunks of them
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  // Wide: dQ is staged in the step's Q / dO buffers (no tile of its own).
  static constexpr int kDqWgBytes = kWide ? 0 : kDqRows * kDqCols * 4;
  static_assert(!kWide || kBlockM * kDqCols * 4 == kQBytes, "a warpgroup's dQ fits its Q / dO buffer");

  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKVBytes;
  static constexpr int kOffQ = kOffV + kKVBytes;
  static constexpr int kOffDo = kOffQ + kStages * kQBytes;
  static constexpr int kOffDs = kOffDo + kStages * kQBytes;
  static constexpr int kOffPt = kOffDs + 2 * kDsBytes;  // wide: P^T [2][kBlockN][kBlockM]
  static constexpr int kOffDq = kOffPt + (kWide ? 2 * kDsBytes : 0);
  static constexpr int kStatsBytes = 2 * kBlockM * 4;  // per stage: lse_log2[kBlockM], D[kBlockM]
  static constexpr int kOffStats = kOffDq + kConsumerWarpgroups * kDqWgBytes;
  static constexpr int kOffBar = kOffStats + kStages * kStatsBytes;
  // dQ one step late (kSkewDq; not wide, not pingpong): step m issues the dQ of step
  // m - 1, whose dS^T halves (both warpgroups') are already in shared memory, so
  // neither warpgroup waits at a named barrier for the other's P / dS phase of the
  // same step; the dS^T tiles are a two-slot ring between the warpgroups (ds_full /
  // ds_empty mbarriers). H200, session 14 run 1, standalone, against the barrier:
  // H=128 -1 / 0 / +2% non-causal (T = 1K / 4K / 16K), 0 / +3 / +0.5% causal; H=64
  // split causal +4 / +12 / +13% (ahead of the pingpong, which it now replaces for
  // causal H=64). With the pingpong it lost 3-5% at H=64 and gained 0-2% at H=128
  // (pingpong at 128), so the pingpong keeps the barrier.
  static constexpr bool kSkewDq = !kWide && !kPingpong && !kRows;
  // Unmasked, non-causal, not deterministic: CTA n starts at query block n kBlockN /
  // kBlockM (mod the count) and wraps (BwdTile::m_rot), so the CTAs running at once add
  // their dQ into different rows instead of all into the same block. H200, session 31
  // run 2, standalone, two alternations: H=256 +1.3 / +0.8 / +0.9% (T = 1K / 4K / 16K),
  // H=64 / 128 within noise (so wide only). (The deterministic adds wait on key blocks
  // in query-block order; causal CTAs already start at their own diagonals.)
  static constexpr bool kRotateQ = kWide;
  // Wide: BwdMainloopWide splits the step by role (warpgroup 0 S^T / P / dV, 1 dP^T /
  // dS / dK, all 256 columns each; +9-18% on the unmasked H=256 backward over the
  // split by query columns, session 33 run 1; masked fwd+bwd +8-17%, session 34). (An
  // earlier role split that kept dV / dK split by columns, S^T / P^T in one warpgroup
  // and dP^T / dS^T in the other, measured -6 to -10%: session 27 run 3.)
  static constexpr int kNumBars =
      1 + 2 * kStages + (kDqWarp ? 2 * kConsumerWarpgroups : 0) + (kSkewDq ? 4 : 0);
  // Arrivals that free a Q / dO stage: one per consumer warp; wide: one per
  // warpgroup, after its dQ reduce-add has read the staging it put there.
  static constexpr int kQEmptyArrivals = kWide ? kConsumerWarpgroups : 4 * kConsumerWarpgroups;
  // Arrivals that fill one: lane 0 of the producer warp's expect_tx, then every lane's
  // after writing its rows' statistics.
  static constexpr int kQFullArrivals = 1 + 32;
  // Masked kernels: their MaskView and a 2-int reduction scratch, in the dynamic
  // window (a static __shared__ variable would push the 1024-aligned dynamic window
  // up by a whole 1 KB and head dim 256 would not fit).
  static constexpr int kOffMask = (kOffBar + kNumBars * 8 + 15) / 16 * 16;
  static constexpr int kMaskBytes = 256;
  static constexpr int kOffMaskRed = kOffMask + kMaskBytes;
  static constexpr int kSmemBytes = kOffMaskRed + 16 + 1024;  // + slack for 1024 alignment
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
  static_assert(kQBytes % 1024 == 0 && kDsBytes % 1024 == 0 && kDqWgBytes % 1024 == 0, "1024-aligned tiles");
  static_assert(kBlockM == 64 || kRows, "a dS^T / P^T tile is one 64-column chunk");

  // wgmma descriptors by addition (hptx::TileDesc<true>) or rebuilt from each address,
  // chosen per kernel by measurement (H200, standalone). By addition: non-causal H=128 /
  // 256 (session 10: +1-4%); the H=64 non-causal pingpong (session 38 run 4: +2.0% mean,
  // +1.7-2.3% at T=16K; it had lost 3% in session 10, before the K / V register
  // fragments, the dQ warp and the early statistics); causal H=128 (run 5: +1.8% mean,
  // +2-4% at 16K; within 2% in session 10); the masked kernels at H = 64 / 128 (run 7:
  // -2% backward time on H=128 documents, no spills now (8 bytes in session 10); the
  // masked H=64 speed not measured). Rebuilt: causal H=256 (session 10: -4 to -11%; 28
  // bytes of spills with it now), the masked H=256 kernels (not measured); the causal
  // H=64 row kernel builds its own (BwdMainloopRows; by addition 0 +- 0.5%, run 5).
  template <bool kCausal, bool kMasked>
  static constexpr bool desc_add() {
    return (!kMasked || kHeadDim <= 128) && (!kCausal || kHeadDim == 128) && (kHeadDim >= 128 || kPingpong);
  }
};

// Device-side arguments other than the tensor maps.
struct BwdArgs {
  const float* lse;    // [B, T, N], natural log
  const float* dpsum;  // [B, N, T]: rowsum(dout * o) - dlse
  int32_t* dq_semaphore;  // deterministic mode: [B, N, ceil(T / kDqSemaphoreRows)]; else null
  int seqlen_q, seqlen_k, num_heads, group;  // group = N / K
  float scale;         // logits scale (dK is scaled here; dQ by the convert kernel)
  float scale_log2;    // the exponent factor of P: scale * log2(e) (log2(e) with a soft cap,
                       // whose logits are already scaled)
  // The call itself (masked instantiations read their options from it: MaskView::of,
  // softcap).
  AttnParams attn;
  // (The tail split, sm90/bwd_tail.cuh) tail_slices > 0: a 1-D grid of units (key
  // block, kv head, batch; key blocks fastest, n_kblocks of them), whole before
  // tail_first, then tail_slices CTAs for each unit from tail_first, each a slice of its
  // query blocks. 0: the usual (key blocks, kv heads, batch) grid.
  int tail_first, tail_slices, n_kblocks;
  // (Causal, sm90/causal_groups.h) causal_groups > 0: a 1-D grid of the
  // units in that many groups of heads, key block slowest inside a group. 0: as above.
  int causal_groups;
};

template <class Tr>
struct BwdSmem {
  uint32_t base;  // 1024-aligned shared address

  __device__ __forceinline__ uint32_t k() const { return base + Tr::kOffK; }
  __device__ __forceinline__ uint32_t v() const { return base + Tr::kOffV; }
  __device__ __forceinline__ uint32_t q(int s) const { return base + Tr::kOffQ + s * Tr::kQBytes; }
  __device__ __forceinline__ uint32_t dout(int s) const { return base + Tr::kOffDo + s * Tr::kQBytes; }
  __device__ __forceinline__ uint32_t ds(int b) const { return base + Tr::kOffDs + b * Tr::kDsBytes; }
  __device__ __forceinline__ uint32_t pt(int b) const { return base + Tr::kOffPt + b * Tr::kDsBytes; }
  __device__ __forceinline__ uint32_t dq(int wg) const { return base + Tr::kOffDq + wg * Tr::kDqWgBytes; }
  // Stage s's row statistics: lse_log2 of its kBlockM query rows, then D at + kBlockM * 4.
  __device__ __forceinline__ uint32_t stats(int s) const { return base + Tr::kOffStats + s * Tr::kStatsBytes; }
  // mbarriers: K and V loaded; Q/dO stage s full (TMA landed, stats written) / empty (every
  // consumer warp done).
  __device__ __forceinline__ uint32_t bar_kv() const { return base + Tr::kOffBar; }
  __device__ __forceinline__ uint32_t bar_q_full(int s) const { return bar_kv() + 8 * (1 + s); }
  __device__ __forceinline__ uint32_t bar_q_empty(int s) const { return bar_kv() + 8 * (1 + Tr::kStages + s); }
  // (Tr::kDqWarp) warpgroup wg's dQ staging written (128 arrivals) / read by its reduce-add (1).
  __device__ __forceinline__ uint32_t bar_dq_full(int wg) const { return bar_kv() + 8 * (1 + 2 * Tr::kStages + wg); }
  __device__ __forceinline__ uint32_t bar_dq_empty(int wg) const {
    return bar_kv() + 8 * (1 + 2 * Tr::kStages + Tr::kConsumerWarpgroups + wg);
  }
  // (Tr::kSkewDq) dS^T slot b written by every consumer warp (8 arrivals) / read by
  // both warpgroups' dQ wgmma (8 arrivals).
  __device__ __forceinline__ uint32_t bar_ds_full(int b) const {
    return bar_kv() + 8 * (1 + 2 * Tr::kStages + (Tr::kDqWarp ? 2 * Tr::kConsumerWarpgroups : 0) + b);
  }
  __device__ __forceinline__ uint32_t bar_ds_empty(int b) const { return bar_ds_full(b) + 16; }
};

// The work of one CTA: the kBlockN keys from key_first of (batch, kv_head), of which
// it stores [key_first, key_end), and the query blocks [m_begin, m_end) of each of the
// group's query heads, block m at rows q_shift + m kBlockM. Usual tiles: key block
// n_block (key_first = n_block kBlockN, key_end = key_first + kBlockN), q_shift 0. A
// document tile (common/doc_tiles.h) starts its keys and query blocks where its
// document's rows do, not at block multiples. Tr::kRotateQ: step m runs query block
// m + m_rot, wrapped into [m_begin, m_end) (m_rot 0: block m).
struct BwdTile {
  int n_block, kv_head, batch;
  int key_first, key_end;
  int m_begin, m_end, q_shift;
  int m_rot;
  int tail_slot;  // (tail split) this piece's unit in AttnParams::dkv_tail, or -1: a whole unit
  __device__ __forceinline__ int steps(int group) const { return (m_end - m_begin) * group; }
  // The first query row of step m's block.
  template <class Tr>
  __device__ __forceinline__ int q_row(int m) const {
    if constexpr (Tr::kRotateQ) {
      m += m_rot;
      if (m >= m_end) m -= m_end - m_begin;
    }
    return q_shift + m * Tr::kBlockM;
  }
};

}  // namespace jaxattn::sm90
