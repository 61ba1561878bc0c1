// Main loop of the Hopper backward (layout and products in bwd_traits.cuh): the
// TMA producer (one thread) and the wgmma consumers (one warpgroup per 64 keys).
//
// Per query block (step), in each consumer warpgroup:
//   1. S^T and dP^T issued back to back (two commit groups); the per-query lse and
//      D values are read meanwhile from the stage's stats tile (written by produce).
//   2. P^T = exp2(S^T scale log2e - lse log2e) as soon as S^T lands (masked only on
//      boundary / diagonal blocks); dS^T = P^T (dP^T - D) when dP^T lands.
//   3. dV += P^T dO issued at once (A from registers); dS^T written to smem; one
//      barrier of both consumer warpgroups; then dQ = dS K (A: dS^T MN-major from
//      smem, this warpgroup's half of the head dim) and dK += dS^T Q.
//      Tr::kSkewDq: no barrier; the dQ issued here is the previous step's (its dS^T
//      ring slot full), and the last step's dQ follows the loop.
//   4. dQ (f32) staged in smem and added to the global accumulator by one thread
//      with a TMA reduce-add, while dK's wgmma finishes.
// Query rows >= T arrive as zeros (TMA fill) and get lse = +inf, D = 0, so their
// P and dS are 0 without masking; keys >= S and causal need the mask.
#pragma once

#include <cuda.h>

#include <cmath>

#include "common/hopper_ptx.h"
#include "common/params.h"  // kDqSemaphoreRows
#include "common/ptx.h"
#include "sm90/bwd_traits.cuh"
#include "sm90/fwd_smem.cuh"  // PipeState
#include "sm90/smem_rows.cuh"
#include "sm90/tile_mask.cuh"

namespace jaxattn::sm90 {

// The mask of one consumer thread's S^T accumulators in a masked backward (no-ops
// unless kMasked): 64 keys (this thread's rows key0, key0 + 8) x kCols query
// columns. It holds the key rows' segment ids, the step's segment-id matches
// (SegmentBits) and, with a soft cap, the cap's gradient factor of each element
// (in [0, 1], kept as fp16 pairs to save registers: finer than the 16-bit dS^T it
// multiplies).
template <bool kMasked, int kCols>
struct BwdStepMask {
  static constexpr int kPairs = kMasked ? kCols / 4 : 1;
  const MaskView* view;
  bool segments = false, capped = false;
  int key_ids[2] = {0, 0};
  SegmentBits<kMasked ? kCols / 2 : 4> seg;
  uint32_t grad[kPairs];

  __device__ __forceinline__ BwdStepMask(const MaskView* v, const AttnParams& attn, int key0) : view(v) {
    if constexpr (kMasked) {
      segments = v->q_seg != nullptr;
      capped = attn.softcap > 0.f;
      if (segments) load_row_ids(key_ids, v->kv_seg, key0, v->kv_len);
    }
  }
  SegmentAhead<kMasked ? kCols / 2 : 4> ahead;  // the next step's query ids, fetched during this one
  // Before the first step (its query columns from first_q0; < 0: no step).
  __device__ __forceinline__ void begin(int first_q0) {
    if constexpr (kMasked) {
      if (segments && first_q0 >= 0) ahead.start(key_ids, view->q_seg, first_q0, view->q_len);
    }
    (void)first_q0;
  }
  // The segment-id matches of this step's query columns (before waiting for S^T; their
  // ids were fetched a step ahead), and the fetch of the next step's from next_q0 (< 0:
  // none).
  __device__ __forceinline__ void load_ids(int next_q0, int t) {
    if constexpr (kMasked) {
      if (segments) ahead.step(seg, key_ids, view->q_seg, next_q0, t, view->q_len);
    }
    (void)next_q0;
  }
  // The raw S^T soft-capped (gradient factor kept) and set to -inf where the mask
  // hides the pair (key_first: the warpgroup's first key row; key0: this thread's
  // h = 0 key row). (A warp-level first key here made ptxas spill at H=128.)
  __device__ __forceinline__ void apply(float (&s)[kCols / 2], const AttnParams& attn, int key_first, int key0,
                                        int q0, int t) {
    if constexpr (kMasked) {
      if (capped) {
        softcap_tile(s, attn.scale, attn.softcap);
        const float inv_cap = 1.f / attn.softcap;
#pragma unroll
        for (int i = 0; i < kPairs; ++i)
          grad[i] = ptx::pack2<__half>(cuda::softcap_grad(s[2 * i], inv_cap), cuda::softcap_grad(s[2 * i + 1], inv_cap));
      }
      mask_tile_where_needed<false, 64, false>(s, *view, key_first, key0, q0, t, segments, seg);
    }
  }
  // Pair i of P times the cap's gradient factor (what chain_grads multiplies dS^T by;
  // for a warpgroup that forms dS^T from P without this mask: BwdMainloopWide).
  __device__ __forceinline__ float2 chained_pair(float x, float y, int i) const {
    if constexpr (kMasked) {
      if (capped) {
        const float2 g = ptx::unpack2<__half>(grad[i]);
        return make_float2(x * g.x, y * g.y);
      }
    }
    (void)i;
    return make_float2(x, y);
  }
  // dS^T of the capped logits -> of the raw ones (times the cap's gradient).
  __device__ __forceinline__ void chain_grads(float (&ds)[kCols / 2]) const {
    if constexpr (kMasked) {
      if (capped) {
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
          const float2 g = ptx::unpack2<__half>(grad[i]);
          ds[2 * i] *= g.x;
          ds[2 * i + 1] *= g.y;
        }
      }
    }
  }
};

template <class Tr>
struct BwdMainloop {
  using Elem = typename Tr::Elem;
  static constexpr int kHeadDim = Tr::kHeadDim;
  static constexpr int kBlockM = Tr::kBlockM;
  static constexpr int kBlockN = Tr::kBlockN;
  static constexpr int kSRegs = kBlockM / 2;    // S^T / dP^T accumulator floats (64 keys x kBlockM)
  static constexpr int kPRegs = kBlockM / 4;    // P^T / dS^T as packed 16-bit pairs
  static constexpr int kAccRegs = Tr::kAccRegs;  // dK / dV accumulator floats (64 keys x H)
  static constexpr int kDqRegs = Tr::kDqCols / 2;
  // L2 eviction priorities on the bulk copies (kL2Hint, head dim 256): Q / dO loads
  // and the dQ reduce-add evict_last (every key block's CTA of the head revisits
  // them: at T=16K a head's Q + dO + dQ accumulator is 48 MB against the 50 MB L2),
  // K / V loads evict_first (one reader). H200, session 28 run 1, standalone H=256
  // backward: non-causal +0 / +0.5 / +1-4% (T = 1K / 4K / 16K), causal +1.5 / +2 / +2%.
  // Not at 128: the policy registers made the 24-register dQ warp spill.
  static constexpr bool kL2Hint = Tr::kWide;
  using Pipe = PipeState<Tr::kStages>;

  // A Q / dO / K / V tile load and the dQ reduce-add, with an L2 policy under kL2Hint
  // (kReused: every key block's CTA touches the data, evict_last; else one reader,
  // evict_first), plain otherwise.
  template <bool kReused>
  __device__ __forceinline__ static void load_tile(uint32_t dst, const CUtensorMap* tm, uint32_t bar, int row,
                                                   int head, int batch) {
    if constexpr (kL2Hint)
      hptx::tma_load_5d_hint(dst, tm, bar, 0, row, 0, head, batch,
                             kReused ? hptx::l2_policy_evict_last() : hptx::l2_policy_evict_first());
    else
      hptx::tma_load_5d(dst, tm, bar, 0, row, 0, head, batch);
  }
  __device__ __forceinline__ static void reduce_add_tile(const CUtensorMap* tm, uint32_t src, int row, int col_chunk,
                                                         int head, int batch) {
    if constexpr (kL2Hint)
      hptx::tma_reduce_add_5d_hint(tm, src, 0, row, col_chunk, head, batch, hptx::l2_policy_evict_last());
    else
      hptx::tma_reduce_add_5d(tm, src, 0, row, col_chunk, head, batch);
  }

  // The query block of the step after (hg, m), or -1 after the last one.
  __device__ __forceinline__ static int next_step_block(const BwdTile& tile, int group, int hg, int m) {
    return m + 1 < tile.m_end ? m + 1 : (hg + 1 < group ? tile.m_begin : -1);
  }

  // ---- producer (one thread) ----------------------------------------------
  // The tile's K and V blocks (complete on bar_kv).
  __device__ static void load_kv(const CUtensorMap* tm_k, const CUtensorMap* tm_v, const BwdSmem<Tr>& sm,
                                 const BwdTile& tile) {
    hptx::mbar_arrive_expect_tx(sm.bar_kv(), 2 * Tr::kKVBytes);
    load_tile<false>(sm.k(), tm_k, sm.bar_kv(), tile.key_first, tile.kv_head, tile.batch);
    load_tile<false>(sm.v(), tm_v, sm.bar_kv(), tile.key_first, tile.kv_head, tile.batch);
  }

  // The producer warp (warp 0): lane 0 issues K / V (unless kv_issued: the masked
  // kernels issue them before their query range is known), then Q / dO step by step
  // through the ring; with each stage every lane writes the row statistics of two of
  // its query rows (rows lane and lane + 32): lse in the log2 domain (+inf for rows
  // past T or with no key, so P = 0) and D, loaded before the stage is free, then
  // arrives on q_full (33 arrivals with lane 0's expect_tx). The consumers read them
  // with 8-byte shared loads instead of per-lane global loads spread by 32 SHFLs per
  // step (session 9: +4-14% at H=64 / 128).
  __device__ static void produce(const CUtensorMap* tm_q, const CUtensorMap* tm_do, const CUtensorMap* tm_k,
                                 const CUtensorMap* tm_v, const BwdSmem<Tr>& sm, const BwdTile& tile,
                                 const BwdArgs& args, int lane, bool kv_issued = false) {
    if (!kv_issued && lane == 0) load_kv(tm_k, tm_v, sm, tile);
    const int T = args.seqlen_q, N = args.num_heads;
    Pipe pipe;
    for (int hg = 0; hg < args.group; ++hg) {
      const int head = tile.kv_head * args.group + hg;
      const float* lse = args.lse + (int64_t)tile.batch * T * N + head;
      const float* dps = args.dpsum + ((int64_t)tile.batch * N + head) * T;
      for (int m = tile.m_begin; m < tile.m_end; ++m) {
        // (The row recomputed from an opaque copy of m each step: ptxas otherwise keeps
        // strength-reduced 64-bit row pointers across steps and spills at 24 / 32
        // registers.)
        const int q0 = tile.q_row<Tr>(ptx::opaque(m)) + lane;
        constexpr int kLaneRows = kBlockM / 32;  // query rows per lane (lane + 32 r)
        float l[kLaneRows], d[kLaneRows];
#pragma unroll
        for (int r = 0; r < kLaneRows; ++r) {
          const int q = q0 + 32 * r;
          l[r] = q < T ? lse[(int64_t)q * N] : -INFINITY;
          d[r] = q < T ? dps[q] : 0.f;
        }
        hptx::mbar_wait(sm.bar_q_empty(pipe.stage), pipe.phase ^ 1);
        if (lane == 0) {
#ifdef JAXATTN_EXP_NO_DO_LOAD  // timing experiment only: dO never loaded (half the ring's traffic)
          hptx::mbar_arrive_expect_tx(sm.bar_q_full(pipe.stage), Tr::kQBytes);
          load_tile<true>(sm.q(pipe.stage), tm_q, sm.bar_q_full(pipe.stage), q0 - lane, head, tile.batch);
#else
          hptx::mbar_arrive_expect_tx(sm.bar_q_full(pipe.stage), 2 * Tr::kQBytes);
          load_tile<true>(sm.q(pipe.stage), tm_q, sm.bar_q_full(pipe.stage), q0 - lane, head, tile.batch);
          load_tile<true>(sm.dout(pipe.stage), tm_do, sm.bar_q_full(pipe.stage), q0 - lane, head, tile.batch);
#endif
        }
        const uint32_t st = sm.stats(pipe.stage) + 4 * lane;
#pragma unroll
        for (int r = 0; r < kLaneRows; ++r) {
          ptx::st_shared_f32(st + 4 * 32 * r, l[r] == -INFINITY ? INFINITY : l[r] * float(M_LOG2E));
          ptx::st_shared_f32(st + 4 * (kBlockM + 32 * r), d[r]);
        }
        hptx::mbar_arrive(sm.bar_q_full(pipe.stage));
        pipe.advance();
      }
    }
  }

  // ---- dQ reduce-add (one thread) ----------------------------------------------
  // The deterministic order: how many key blocks add into query block m before this
  // CTA's (two adds each). Descending key blocks: block n after the blocks above it in
  // the run that visits m (masked: view, dq_adds_after; else dq_run_last), with the
  // grid dispatched highest key block first (bwd_tile_from_block), so a block never
  // waits on one dispatched after it, and under causal or window ranges each block
  // reaches m after the blocks above it have added (ascending, block n waited ~2n
  // steps: 2-3.8x the default mode's time; docs/perf.md, sessions 23-24).
  __device__ __forceinline__ static int dq_adds_first(const BwdTile& tile, const BwdArgs& args, int m,
                                                      const MaskView* view) {
    const int n_blocks = (args.seqlen_k + kBlockN - 1) / kBlockN;
    if (view) return dq_adds_after<kBlockM, kBlockN>(*view, tile.n_block, m, n_blocks);
    return dq_run_last<kBlockM, kBlockN>(args.attn.is_causal, m, n_blocks) - tile.n_block;
  }

  // Adds warpgroup wg's dQ staging (at `stage`) to dq_accum's rows q_base .. of `head`
  // with one TMA reduce-add. Deterministic mode: key block n adds after the blocks
  // above it that visit this query block (two warpgroup adds each, to different
  // columns; dq_adds_first, view: the CTA's MaskView, else null, or `adds_first` when
  // the caller counted them, >= 0) and waits for its own add to land before counting it.
  __device__ static void add_dq(const CUtensorMap* tm_dq, uint32_t stage, const BwdTile& tile, const BwdArgs& args,
                                int head, int q_base, int wg, const MaskView* view, int adds_first = -1) {
    const int sem_blocks = (args.seqlen_q + kDqSemaphoreRows - 1) / kDqSemaphoreRows;
    int32_t* sem = args.dq_semaphore ? args.dq_semaphore + ((int64_t)tile.batch * args.num_heads + head) * sem_blocks +
                                           q_base / kDqSemaphoreRows
                                     : nullptr;
    if (sem) {
      const int first = adds_first >= 0 ? adds_first : dq_adds_first(tile, args, q_base / kBlockM, view);
      ptx::wait_counter_geq(sem, 2 * first);
      hptx::fence_proxy_async_global();
    }
#if defined(JAXATTN_EXP_HALF_DQ_REDUCE)  // timing experiment only: warpgroup 1's dQ never added
    if (wg == 0) reduce_add_tile(tm_dq, stage, q_base, wg * Tr::kDqChunks, head, tile.batch);
#elif !defined(JAXATTN_EXP_NO_DQ_REDUCE)  // timing experiment only: dQ never added
    // (Tr::kRows: warpgroup wg's dQ is rows 64 wg .. of the step, every column; none when
    // they all lie past T, rather than a box wholly outside the tensor.)
    if constexpr (Tr::kRows) {
      if (q_base + 64 * wg < args.seqlen_q) reduce_add_tile(tm_dq, stage, q_base + 64 * wg, 0, head, tile.batch);
    } else {
      reduce_add_tile(tm_dq, stage, q_base, wg * Tr::kDqChunks, head, tile.batch);
    }
#endif
    hptx::bulk_commit();
    if (sem) {
      hptx::bulk_wait0();
      hptx::fence_proxy_async_global();
      ptx::release_counter_inc(sem);
    }
  }

  // ---- dQ warp (one thread; Tr::kDqWarp) -------------------------------------
  // Issues every step's dQ reduce-adds: for each step and consumer warpgroup, waits
  // until the warpgroup has written its staging (dq_full), adds it to dq_accum
  // (deterministic mode: in key-block order, as the consumers did), and frees the
  // staging once the add has read it (dq_empty). The consumers then never wait on a
  // barrier for the add, only (rarely) for the previous add's read.
  __device__ static void reduce_dq(const CUtensorMap* tm_dq, const BwdSmem<Tr>& sm, const BwdTile& tile,
                                   const BwdArgs& args, const MaskView* view) {
    uint32_t phase = 0;
    for (int hg = 0; hg < args.group; ++hg) {
      const int head = tile.kv_head * args.group + hg;
      // Deterministic, masked: the run's last key block, advanced once per query block
      // by a scan (dq_run_last_from) that both warpgroups' adds share, instead of
      // dq_adds_after's binary search for every add. H200, session 26 run 3 (fwd+bwd at
      // 16K, H=128, deterministic / default): window 4096 1.74 -> 1.24, key lengths
      // 1.74 -> 1.21; unmasked kernels' SASS unchanged.
      const int n_blocks = (args.seqlen_k + kBlockN - 1) / kBlockN;
      int last = tile.n_block;
      for (int m = tile.m_begin; m < tile.m_end; ++m, phase ^= 1) {
        int adds_first = -1;
        if (args.dq_semaphore && view) {
          last = dq_run_last_from<kBlockM, kBlockN>(*view, last, m, n_blocks);
          adds_first = last - tile.n_block;
        }
#pragma unroll
        for (int wg = 0; wg < Tr::kConsumerWarpgroups; ++wg) {
          hptx::mbar_wait(sm.bar_dq_full(wg), phase);
          add_dq(tm_dq, sm.dq(wg), tile, args, head, tile.q_row<Tr>(m), wg, view, adds_first);
          hptx::bulk_wait_read0();
          hptx::mbar_arrive(sm.bar_dq_empty(wg));
        }
      }
    }
    hptx::bulk_wait0();  // (the adds complete before the CTA's shared memory goes away)
  }

  // ---- consumer pieces (one warpgroup) ---------------------------------------

  // acc(64 rows of `a_rows`, kBlockM cols) = A B^T over the head dim, both K-major tiles
  // ([kChunks][rows][64]): S^T = K Q^T, dP^T = V dO^T.
  template <bool kAdd>
  __device__ __forceinline__ static void issue_abT(float (&acc)[kSRegs], uint32_t a_rows, uint32_t a_chunk,
                                                   uint32_t b_tile) {
    const hptx::TileDesc<kAdd> a(a_rows, 16, 1024), b(b_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t col = kk / 4, off = (kk % 4) * 32;
      hptx::wgmma_ss<Elem, kBlockM, 0>(acc, a.at(col * a_chunk + off), b.at(col * kBlockM * 128 + off), kk > 0 ? 1 : 0);
    }
  }

  // As issue_abT with A (this warpgroup's 64 K or V rows) from registers
  // (load_a_frags_sw128): only B is read from shared memory.
  template <bool kAdd>
  __device__ __forceinline__ static void issue_abT_rs(float (&acc)[kSRegs], const uint32_t (&a)[kHeadDim / 4],
                                                      uint32_t b_tile) {
    const hptx::TileDesc<kAdd> b(b_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t col = kk / 4, off = (kk % 4) * 32;
      const uint32_t f[4] = {a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3]};
      hptx::wgmma_rs<Elem, kBlockM, 0>(acc, f, b.at(col * kBlockM * 128 + off), kk > 0 ? 1 : 0);
    }
  }

  // S^T = K Q^T or dP^T = V dO^T of this warpgroup's 64 key rows: A from registers
  // (kRegs: `frag`) or from the shared tile at `rows`; B = the step's Q or dO tile.
  template <bool kAdd, bool kRegs>
  __device__ __forceinline__ static void issue_s_tile(float (&acc)[kSRegs], const uint32_t (&frag)[kRegs ? kHeadDim / 4 : 1],
                                                      uint32_t rows, uint32_t b_tile) {
    if constexpr (kRegs) issue_abT_rs<kAdd>(acc, frag, b_tile);
    else issue_abT<kAdd>(acc, rows, kBlockN * 128, b_tile);
  }

  // acc(64 keys x H) += A(64 keys x kBlockM, registers) B(kBlockM x H: the Q or dO tile, MN-major).
  template <bool kAdd>
  __device__ __forceinline__ static void issue_acc_rs(float (&acc)[kAccRegs], const uint32_t (&a)[kPRegs],
                                                      uint32_t b_tile) {
    const hptx::TileDesc<kAdd> b(b_tile, kBlockM * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const uint32_t f[4] = {a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3]};
      hptx::wgmma_rs<Elem, kHeadDim, 1>(acc, f, b.at(kk * 16 * 128), 1);
    }
  }

  // This warpgroup's dQ tile (kBlockM x kDqCols: columns from wg * kDqCols) over all
  // 128 keys. A = dS^T [keys][kBlockM] in smem (MN-major), B = K (MN-major).
  template <bool kAdd>
  __device__ __forceinline__ static void issue_dq(float (&dq)[kDqRegs], uint32_t ds_tile, uint32_t k_tile, int wg) {
    const int col0 = wg * Tr::kDqCols;
    const uint32_t b_base = k_tile + (col0 / 64) * kBlockN * 128 + (col0 % 64) * 2;
    const hptx::TileDesc<kAdd> a(ds_tile, kBlockN * 128, 1024), b(b_base, kBlockN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      hptx::wgmma_ss_t<Elem, Tr::kDqCols, 1, 1>(dq, a.at(kk * 16 * 128), b.at(kk * 16 * 128), kk > 0 ? 1 : 0);
  }

  // Pingpong turns (Tr::kPingpong; named barriers 4 + wg, 256 threads): a warpgroup
  // waits for its turn before issuing a wgmma burst and hands the turn over after
  // issuing it, so the bursts of the two warpgroups alternate (A0 A1 B0 B1 ...:
  // A = S^T, dP^T; B = dQ, dK). A sub-partition's tensor core
  // runs wgmmas in issue order, so one warpgroup's P / dS phase overlaps the other's
  // burst instead of both idling the tensor cores at once.
  // (Turns for burst A only, the dS^T barrier lining the warpgroups up before B,
  // measured -5 to -6% at H=64 non-causal and neutral elsewhere: session 10.)
  __device__ __forceinline__ static void take_turn(int wg) {
    if constexpr (Tr::kPingpong) hptx::named_bar_sync(4 + wg, 256);
  }
  __device__ __forceinline__ static void pass_turn(int wg, bool last = false) {
    if constexpr (Tr::kPingpong) {
      if (!last) hptx::named_bar_arrive(4 + (wg ^ 1), 256);
    }
  }

  // One arrival per warp on an empty barrier (its reads of that stage are done).
  __device__ __forceinline__ static void release(uint32_t bar, int lane) {
    if (lane == 0) hptx::mbar_arrive(bar);
  }

  // The row statistics (lse_log2 or D, from the stage's stats tile at `row_stats`,
  // which starts at this accumulator's first query column) of this thread's query
  // columns 8 j + 2 t, 8 j + 2 t + 1: one 8-byte shared load per j.
  template <int kCols>
  __device__ __forceinline__ static void load_col_stats(float2 (&v)[kCols / 8], uint32_t row_stats, int t) {
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) v[j] = ptx::ld_shared_f32x2(row_stats + 4 * (8 * j + 2 * t));
  }

  // P^T = exp2(S^T scale log2e - lse) in place, for an accumulator of 64 keys (this
  // thread's rows key0, key0 + 8) x kCols query columns from q0; with kMask and
  // need_mask, keys >= S and (causal) keys > query are zeroed.
  // lse: load_col_stats of lse_log2.
  template <bool kCausal, bool kMask, int kCols>
  __device__ __forceinline__ static void probs_tile(float (&s)[kCols / 2], const float2 (&lse)[kCols / 8], int q0,
                                                    int key0, int S, float sl2, bool need_mask, int t) {
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float l = e == 0 ? lse[j].x : lse[j].y;
        const int q = q0 + 8 * j + 2 * t + e;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& x = s[4 * j + 2 * h + e];
          x = ptx::exp2_approx(fmaf(x, sl2, -l));
          if constexpr (kMask) {
            const int key = key0 + 8 * h;
            if (need_mask && (key >= S || (kCausal && key > q))) x = 0.f;
          }
        }
      }
    }
  }

  // probs_tile, masked only when need_mask (boundary / diagonal blocks). Causal: two
  // explicit paths; with the test inside one loop ptxas computed the causal predicates
  // on every step (P2R / LOP3 / ISETP: 692 -> 799 consumer instructions per step,
  // -12 to -15% at H=64, session 9). Non-causal: one loop with the (step-invariant)
  // key >= S test predicated; the two-path form ran 4-8% slower there (session 9).
  template <bool kCausal, int kCols>
  __device__ __forceinline__ static void probs(float (&s)[kCols / 2], const float2 (&lse)[kCols / 8], int q0, int key0,
                                               int S, float sl2, bool need_mask, int t) {
    if (!kCausal) probs_tile<false, true, kCols>(s, lse, q0, key0, S, sl2, need_mask, t);
    else if (need_mask) probs_tile<kCausal, true, kCols>(s, lse, q0, key0, S, sl2, true, t);
    else probs_tile<kCausal, false, kCols>(s, lse, q0, key0, S, sl2, false, t);
  }

  // dS^T = P^T (dP^T - D) in place of dP^T (dps: load_col_stats of D).
  template <int kCols>
  __device__ __forceinline__ static void dscores(float (&dp)[kCols / 2], const float (&p)[kCols / 2],
                                                 const float2 (&dps)[kCols / 8]) {
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float d = e == 0 ? dps[j].x : dps[j].y;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = 4 * j + 2 * h + e;
          dp[i] = p[i] * (dp[i] - d);
        }
      }
    }
  }

  // This warpgroup's dQ tile (registers, its wgmma done) into its staging and on to
  // the global accumulator: through the dQ warp (Tr::kDqWarp; dq_index counts the
  // tile's dQ tiles) or by one thread's reduce-add after the warpgroup's writes.
  __device__ __forceinline__ static void stage_dq(const float (&dq)[kDqRegs], const CUtensorMap* tm_dq,
                                                  const BwdSmem<Tr>& sm, const BwdTile& tile, const BwdArgs& args,
                                                  int head, int q_base, int wg, int tid, int dq_index,
                                                  const MaskView* view) {
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const uint32_t dq_stage = sm.dq(wg);
    if constexpr (Tr::kDqWarp) {
      // The dQ warp has read the previous tile's staging; write, publish, go on.
      hptx::mbar_wait(sm.bar_dq_empty(wg), (uint32_t)(dq_index & 1) ^ 1u);
      store_acc_f32_sw128<Tr::kDqCols, Tr::kDqStoreSpread>(dq, dq_stage, Tr::kDqRows * 128, warp * 16 + g, t);
      hptx::fence_proxy_async_smem();
      hptx::mbar_arrive(sm.bar_dq_full(wg));
    } else {
      if (tid == 0) hptx::bulk_wait_read0();  // the previous reduce has read the staging tile
      hptx::named_bar_sync(2 + wg, 128);
      store_acc_f32_sw128<Tr::kDqCols, Tr::kDqStoreSpread>(dq, dq_stage, kBlockM * 128, warp * 16 + g, t);
      hptx::fence_proxy_async_smem();
      hptx::named_bar_sync(2 + wg, 128);
      if (tid == 0) add_dq(tm_dq, dq_stage, tile, args, head, q_base, wg, view);
    }
  }

  // ---- consumer: every step of a tile -------------------------------------------
  // wg: consumer warpgroup (0 or 1); tid: thread in it (0..127). kMasked: the
  // mask is `mask_view` (shared memory; the causal mask is part of it, kCausal false).
  // dq_view: the view the deterministic dQ order reads (add_dq), null when none can.
  template <bool kCausal, bool kMasked = false>
  __device__ static void consume(float (&dk)[kAccRegs], float (&dv)[kAccRegs], const CUtensorMap* tm_dq,
                                 const BwdSmem<Tr>& sm, const BwdTile& tile, const BwdArgs& args, int wg,
                                 int tid, const MaskView* mask_view = nullptr, const MaskView* dq_view = nullptr) {
    static_assert(kBlockM == 64, "one lane pair per two query columns");
    static_assert(!(kCausal && kMasked), "masked kernels take causal from the MaskView");
    constexpr bool kAdd = Tr::template desc_add<kCausal, kMasked>();
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int key_wg0 = tile.key_first + wg * 64;  // first key of this warpgroup
    const int key0 = key_wg0 + warp * 16 + g;               // this thread's h = 0 key row
    const uint32_t k_rows = sm.k() + wg * 64 * 128, v_rows = sm.v() + wg * 64 * 128;
    const float sl2 = args.scale_log2;
    const int S = args.seqlen_k;

#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) dk[i] = dv[i] = 0.f;
    float s[kSRegs], dp[kSRegs], dq[kDqRegs];
    uint32_t p[kPRegs], ds[kPRegs];
    BwdStepMask<kMasked, kBlockM> mask(mask_view, args.attn, key0);
    mask.begin(tile.m_begin < tile.m_end ? tile.q_row<Tr>(tile.m_begin) : -1);

    hptx::mbar_wait(sm.bar_kv(), 0);
    // At head dim 64, S^T = K Q^T and dP^T = V dO^T take this warpgroup's K / V rows
    // from registers (2 x 16 registers), halving their shared-memory reads: +2-8%
    // (session 6). (At 128 / 256 the 64 / 128 registers are not there to spare.)
    constexpr bool kKvRegs = kHeadDim == 64;
    uint32_t k_frag[kKvRegs ? kHeadDim / 4 : 1], v_frag[kKvRegs ? kHeadDim / 4 : 1];
    if constexpr (kKvRegs) {
      load_a_frags_sw128<kHeadDim>(k_frag, k_rows, kBlockN * 128, warp, lane);
      load_a_frags_sw128<kHeadDim>(v_frag, v_rows, kBlockN * 128, warp, lane);
    }
    Pipe pipe;
    int ds_buf = 0;
    // Pingpong: warpgroup 0 has the first turn; warpgroup 1 skips handing over the
    // turn after its last burst (nobody would take it).
    const int n_steps = tile.steps(args.group);
    if (wg == 1 && n_steps > 0) pass_turn(wg);
    int step = 0;
    int prev_head = 0, prev_q_base = 0;  // (kSkewDq) the step whose dQ is issued next
    for (int hg = 0; hg < args.group; ++hg) {
      const int head = tile.kv_head * args.group + hg;
      for (int m = tile.m_begin; m < tile.m_end; ++m, ++step) {
        const int q_base = tile.q_row<Tr>(m);
        const bool last_step = step == n_steps - 1;

        hptx::mbar_wait(sm.bar_q_full(pipe.stage), pipe.phase);
        const uint32_t q_tile = sm.q(pipe.stage), do_tile = sm.dout(pipe.stage);
        take_turn(wg);
        hptx::wgmma_fence();
        issue_s_tile<kAdd, kKvRegs>(s, k_frag, k_rows, q_tile);
        hptx::wgmma_commit();
        issue_s_tile<kAdd, kKvRegs>(dp, v_frag, v_rows, do_tile);
        hptx::wgmma_commit();
        pass_turn(wg);
        const int next_m = next_step_block(tile, args.group, hg, m);
        mask.load_ids(next_m < 0 ? -1 : tile.q_row<Tr>(next_m), t);
        // The step's lse / D columns (shared loads): at head dim 64 both in flight while
        // S^T finishes. At 128 only lse fits there (16 registers), and only the
        // non-causal step gains from it (session 37 run 5: +3-4% non-causal, -4% causal
        // 4K); elsewhere lse once S^T is in (after its mask). D before waiting for dP^T.
        constexpr bool kEarlyStats = kHeadDim == 64 && !kMasked;
        constexpr bool kEarlyLse = kEarlyStats || (kHeadDim == 128 && !kMasked && !kCausal);
        float2 lse_c[kBlockM / 8], dps_c[kBlockM / 8];
        if constexpr (kEarlyLse) load_col_stats<kBlockM>(lse_c, sm.stats(pipe.stage), t);

        // P^T once S^T is in.
        hptx::wgmma_wait<1>();
        hptx::reg_fence_array(s);
        if constexpr (kEarlyStats) load_col_stats<kBlockM>(dps_c, sm.stats(pipe.stage) + kBlockM * 4, t);
        mask.apply(s, args.attn, key_wg0, key0, q_base, t);
        if constexpr (!kEarlyLse) load_col_stats<kBlockM>(lse_c, sm.stats(pipe.stage), t);
        const bool need_mask = !kMasked && (key_wg0 + 63 >= S || (kCausal && key_wg0 + 63 > q_base));
        probs<kCausal, kBlockM>(s, lse_c, q_base, key0, S, sl2, need_mask, t);
#pragma unroll
        for (int i = 0; i < kPRegs; ++i) p[i] = ptx::pack2<Elem>(s[2 * i], s[2 * i + 1]);

        // dS^T once dP^T is in.
        if constexpr (!kEarlyStats) load_col_stats<kBlockM>(dps_c, sm.stats(pipe.stage) + kBlockM * 4, t);
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(dp);
        dscores<kBlockM>(dp, s, dps_c);
        mask.chain_grads(dp);
#pragma unroll
        for (int i = 0; i < kPRegs; ++i) ds[i] = ptx::pack2<Elem>(dp[2 * i], dp[2 * i + 1]);

        // dV += P^T dO now; dS^T to smem for dQ (both warpgroups' halves).
        hptx::wgmma_fence();
        issue_acc_rs<kAdd>(dv, p, do_tile);
        hptx::wgmma_commit();
        const int slot = Tr::kSkewDq ? step & 1 : ds_buf;
        const int dq_step = step > 0 ? step - 1 : 0;  // (kSkewDq) the step whose dQ this one computes
        if constexpr (Tr::kSkewDq) {
          // Slot reuse: both warpgroups' dQ of step - 2 have read it.
          if (step >= 2) hptx::mbar_wait(sm.bar_ds_empty(slot), ((step >> 1) - 1) & 1);
        }
        store_packed_sw128<kBlockM>(ds, sm.ds(slot) + wg * 64 * 128, 0, warp * 16 + g, t);
        hptx::fence_proxy_async_smem();
        if constexpr (Tr::kSkewDq) {
          __syncwarp();
          if (lane == 0) hptx::mbar_arrive(sm.bar_ds_full(slot));
          // The previous step's dS^T (the other warpgroup wrote its half a step ago).
          // Step 0 has none: it computes a dQ of its own dS^T and drops it (a wgmma
          // behind a branch made ptxas keep dQ live across the loop: 68-490 bytes of
          // spills at H=128).
          hptx::mbar_wait(sm.bar_ds_full(dq_step & 1), (dq_step >> 1) & 1);
        } else {
          hptx::named_bar_sync(1, 256);
        }

        take_turn(wg);
        hptx::wgmma_fence();
        issue_dq<kAdd>(dq, sm.ds(Tr::kSkewDq ? dq_step & 1 : slot), sm.k(), wg);
        hptx::wgmma_commit();
        issue_acc_rs<kAdd>(dk, ds, q_tile);
        hptx::wgmma_commit();
        pass_turn(wg, wg == 1 && last_step);

        // dQ: staged once its wgmma (and dV's) are done, while dK's runs.
        hptx::wgmma_wait<1>();
        hptx::reg_fence_array(dq);
        hptx::reg_fence_array(p);  // keeps P^T's registers (dV's A operand) live until here
        if constexpr (Tr::kSkewDq) {
          if (step >= 1) {
            __syncwarp();
            if (lane == 0) hptx::mbar_arrive(sm.bar_ds_empty(dq_step & 1));
            stage_dq(dq, tm_dq, sm, tile, args, prev_head, prev_q_base, wg, tid, step - 1, dq_view);
          }
          prev_head = head;
          prev_q_base = q_base;
        } else {
          stage_dq(dq, tm_dq, sm, tile, args, head, q_base, wg, tid, step, dq_view);
        }

        // (The next step's S^T issued here, behind dK, at head dim 64: -1% causal, +6%
        // on the split-hd variant non-causal, still 4% behind the pingpong; at 128
        // ptxas serialised the wgmmas. Session 28 run 3.)
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(dk);
        hptx::reg_fence_array(dv);
        hptx::reg_fence_array(ds);  // dK's A operand
        release(sm.bar_q_empty(pipe.stage), lane);
        pipe.advance();
        ds_buf ^= 1;
      }
    }
    if constexpr (Tr::kSkewDq) {
      // The last step's dQ.
      if (n_steps > 0) {
        const int last = n_steps - 1;
        hptx::mbar_wait(sm.bar_ds_full(last & 1), (last >> 1) & 1);
        hptx::wgmma_fence();
        issue_dq<kAdd>(dq, sm.ds(last & 1), sm.k(), wg);
        hptx::wgmma_commit();
        hptx::wgmma_wait<0>();
        hptx::reg_fence_array(dq);
        stage_dq(dq, tm_dq, sm, tile, args, prev_head, prev_q_base, wg, tid, last, dq_view);
      }
    }
  }
};

}  // namespace jaxattn::sm90
