// Backward flash attention on mma.sync (sm_80+), parallel over key blocks:
// one CTA per (key block, kv head, batch) keeps K, V and the dK, dV
// accumulators of its block, and walks the query blocks of every query head
// of its GQA group (above the causal diagonal skipped), adding dQ to
// dq_accum with f32 atomics. See tile_config.cuh (BwdTile) for the layout.
// kMasked instantiates the masked variant (window, lengths, segments, soft
// cap, dense bias (with dbias) and mask: common/mask.cuh): only the query
// blocks that can see the key block run.
#pragma once

#include <cuda_runtime.h>

#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.h"
#include "launch.h"
#include "common/bwd_prepost.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/softmax.cuh"
#include "sm80/tile_config.cuh"

namespace jaxattn::cuda::sm80 {

// kDoDV: accumulate and write dV. kDoDKQ: accumulate and write dK, add dQ.
// (The masked variant asks for 1 CTA per SM: its mask state would spill
// under the 2-CTA register budget of the H = 32 tile.)
template <class Tile, typename Elem, bool kDoDV, bool kDoDKQ, bool kMasked>
__global__ void __launch_bounds__(Tile::kThreads, kMasked ? 1 : Tile::kMinBlocks)
    flash_bwd_kernel(const AttnParams p) {
  constexpr int kH = Tile::kHeadDim, kBM = Tile::kBlockM, kBN = Tile::kBlockN;
  constexpr int kPitch = Tile::kPitch, kDsPitch = Tile::kDsPitch, kThreads = Tile::kThreads;
  constexpr int kQ8 = kBM / 8;      // n8 tiles of a warp's S^T row block
  constexpr int kQSteps = kBM / 16;  // k16 steps over queries
  // Pair layout (see BwdTile): the unmasked kernels only.
  constexpr bool kPair = Tile::kPair && !kMasked;
  static_assert(!kPair || (kDoDV && kDoDKQ), "pair layout: one pass");
  constexpr int kAccM = kPair ? 2 : 1;              // m16 tiles (keys) of dK, dV
  constexpr int kAcc8 = kPair ? kH / 16 : kH / 8;   // n8 tiles (columns) of dK, dV
  constexpr int kQH = kBM / 2;                      // kPair: queries of a warp's S^T
  // (tile_config.cuh, both on by default: kStagger, the second half of the warps
  // adds the previous step's dQ at the end of a step; kLeanDq, branch-free dQ adds
  // for full query blocks.)
  constexpr bool kStagger = kPair && JAXATTN_BWD_STAGGER != 0;
  constexpr bool kLeanDq = kPair && JAXATTN_BWD_LEAN_DQ != 0;
  extern __shared__ __align__(16) unsigned char smem[];
  Elem* base = reinterpret_cast<Elem*>(smem);
  Elem* sK = base + Tile::kOffK;
  Elem* sV = base + Tile::kOffV;
  Elem* sQ = base + Tile::kOffQ;    // [2][kBM][kPitch]
  Elem* sdO = base + Tile::kOffdO;  // [2][kBM][kPitch]
  Elem* sdS = base + Tile::kOffdS;  // [2][kBN][kDsPitch]: dS^T
  float* sLse = reinterpret_cast<float*>(base + Tile::kElems);  // [2][kBM], log2 units
  float* sDps = sLse + 2 * kBM;                                  // [2][kBM]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int T = p.seqlen_q, S = p.seqlen_k, N = p.num_heads, G = p.num_heads / p.num_heads_k;
  const int hd = p.head_dim;
  const bool causal = p.is_causal;
  // Deterministic: highest key block first, the order of the dQ adds (dq_step).
  const int n_block = p.deterministic ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
  const int kv_head = blockIdx.y, b = blockIdx.z;
  const int n0 = n_block * kBN;

  const Elem* k = static_cast<const Elem*>(p.k) + b * p.k_batch_stride +
                  int64_t(n0) * p.k_row_stride + kv_head * p.k_head_stride;
  const Elem* v = static_cast<const Elem*>(p.v) + b * p.v_batch_stride +
                  int64_t(n0) * p.v_row_stride + kv_head * p.v_head_stride;
  load_tile_async<kBN, kH, kPitch, kThreads>(sK, k, p.k_row_stride, S - n0, hd);
  if (kDoDKQ) load_tile_async<kBN, kH, kPitch, kThreads>(sV, v, p.v_row_stride, S - n0, hd);

  // Steps: (query head of the group, query block), query blocks entirely
  // above the causal diagonal (every query < n0) skipped; masked, only the
  // blocks holding queries [m_lo, m_hi) that may see a key of this block.
  int m_first = causal ? n0 / kBM : 0;
  int m_blocks = (T + kBM - 1) / kBM;
  // The mask state lives in shared memory (read where needed, not held in
  // registers across the MMAs); the soft cap is read from the parameters.
  __shared__ MaskView mask_smem;  // (unused, so not allocated, when unmasked)
  const MaskView& mask = mask_smem;
  bool segments = false;
  const float softcap = kMasked ? p.softcap : 0.f;
  if constexpr (kMasked) {
    __shared__ int red[2];
    if (threadIdx.x == 0) mask_smem = MaskView::of(p, b);
    __syncthreads();
    int2 rows = mask.query_range(n0, n0 + kBN);
    segments = mask.q_seg != nullptr;
    // (Deterministic mode keeps the closed-form ranges: its dQ order counts
    // the key blocks visiting a query block, see dq_step.)
    if (!p.deterministic)  // (with segments: only queries whose ids fall in the block's id range)
      rows = cta_segment_span(rows, mask.kv_seg, mask.kv_seg_ranges, n0, min(n0 + kBN, mask.kv_len), mask.q_seg,
                              mask.q_seg_ranges, red);
    m_first = rows.x / kBM;
    m_blocks = (rows.y + kBM - 1) / kBM;
  }
  const int sem_blocks = (T + kDqSemaphoreRows - 1) / kDqSemaphoreRows;
  static_assert(kBM % kDqSemaphoreRows == 0, "dQ ordering counters per query block");
  const int steps_per_head = max(0, m_blocks - m_first);
  const int n_steps = steps_per_head * G;
  auto step_head = [&](int step) { return kv_head * G + step / steps_per_head; };
  auto step_m0 = [&](int step) { return (m_first + step % steps_per_head) * kBM; };

  auto load_step = [&](int step, int stage) {
    const int head = step_head(step), m0 = step_m0(step);
    const Elem* q = static_cast<const Elem*>(p.q) + b * p.q_batch_stride +
                    int64_t(m0) * p.q_row_stride + head * p.q_head_stride;
    const Elem* dout = static_cast<const Elem*>(p.dout) + b * p.o_batch_stride +
                       int64_t(m0) * p.o_row_stride + head * p.o_head_stride;
    load_tile_async<kBM, kH, kPitch, kThreads>(sQ + stage * kBM * kPitch, q, p.q_row_stride,
                                               T - m0, hd);
    load_tile_async<kBM, kH, kPitch, kThreads>(sdO + stage * kBM * kPitch, dout,
                                               p.o_row_stride, T - m0, hd);
  };
  // Row statistics go through registers (one row per thread), so that lse can
  // be turned into log2 units with +inf for rows past T or without any key
  // (giving P = 0 there).
  auto load_stats = [&](int step, float& lse, float& dps) {
    const int head = step_head(step), row = step_m0(step) + threadIdx.x;
    lse = -INFINITY;
    dps = 0.f;
    if (threadIdx.x < kBM && row < T) {
      lse = p.lse[(int64_t(b) * T + row) * N + head];
      if (kDoDKQ) dps = p.dpsum[(int64_t(b) * N + head) * T + row];
    }
  };
  auto store_stats = [&](int stage, float lse, float dps) {
    if (threadIdx.x < kBM) {
      sLse[stage * kBM + threadIdx.x] = lse == -INFINITY ? INFINITY : lse * kLog2e;
      sDps[stage * kBM + threadIdx.x] = dps;
    }
  };

  if (n_steps > 0) load_step(0, 0);
  ptx::cp_async_commit();
  if (n_steps > 0) {
    float lse, dps;
    load_stats(0, lse, dps);
    store_stats(0, lse, dps);
  }

  float dv[kAccM][kAcc8][4], dk[kAccM][kAcc8][4];
  clear(dv);
  clear(dk);
  // With a soft cap or a bias the logits are scaled (capped, biased) before
  // the softmax, which then scales by 1.
  const bool prescaled = kMasked && (softcap > 0.f || p.bias != nullptr);
  const float scale_log2 = (prescaled ? 1.f : p.scale) * kLog2e;
  const int key_row = warp * 16;  // this warp's keys within the block

  const uint32_t k_addr_a = ptx::smem_addr(sK) + key_row * kPitch * 2 + lane_offset_a<kPitch>(lane);
  const uint32_t v_addr_a = ptx::smem_addr(sV) + key_row * kPitch * 2 + lane_offset_a<kPitch>(lane);
  const uint32_t q_addr = ptx::smem_addr(sQ);
  const uint32_t do_addr = ptx::smem_addr(sdO);
  const uint32_t off_a = lane_offset_a<kPitch>(lane), off_b = lane_offset_b<kPitch>(lane);
  // kPair: this warp's pair owns keys [pair_key, + 32); it computes S^T for
  // queries [half * kQH, + kQH) and dK, dV for columns [half * kH / 2, + kH / 2).
  const int pair_key = (warp >> 1) * 32, half = warp & 1;
  Elem* sP = base + Tile::kOffP;  // kPair: P^T [kBN][kDsPitch]
  // dQ piece of this warp: rows [dq_m, + kDqMTiles*16), columns [dq_n, + kDqCols).
  constexpr int kDqM = Tile::kDqMTiles, kDq8 = Tile::kDqCols / 8;
  const int dq_m = (warp % Tile::kDqWarpsM) * 16 * kDqM;
  const int dq_n = (warp / Tile::kDqWarpsM) * Tile::kDqCols;
  const uint32_t ds_addr_t = ptx::smem_addr(sdS) + dq_m * 2 + lane_offset_b<kDsPitch>(lane);
  const uint32_t k_addr_t = ptx::smem_addr(sK) + dq_n * 2 + off_a;
  // dQ of a finished step = dS K, added unscaled to dq_accum; every warp's
  // dS^T of that step must be in smem (a barrier after it was written).
  auto dq_step = [&](int step) {
    const int head = step_head(step), m0 = step_m0(step);
    float dq[kDqM][kDq8][4];
    clear(dq);
    gemm_ss_atb<Elem, kDqM, kDq8, kBN, kDsPitch, kPitch>(
        dq, ds_addr_t + (step & 1) * kBN * kDsPitch * 2, k_addr_t);
    float* dq_accum = p.dq_accum + (int64_t(b) * T * N + head) * hd;
    // Deterministic mode: key block n adds after the blocks above it (one count each).
    int32_t* sem = p.deterministic ? p.dq_semaphore + (int64_t(b) * N + head) * sem_blocks + m0 / kDqSemaphoreRows
                                   : nullptr;
    if (sem) {
      // The key blocks that visit this query block are a contiguous run (masked:
      // closed-form ranges, monotone in the key block); this block adds after
      // those of the run above it, the grid dispatched highest key block first
      // (common/mask.cuh).
      const int n_blocks = (S + kBN - 1) / kBN;
      const int before = kMasked ? dq_adds_after<kBM, kBN>(mask, n_block, m0 / kBM, n_blocks)
                                 : dq_run_last<kBM, kBN>(causal, m0 / kBM, n_blocks) - n_block;
      if (threadIdx.x == 0) ptx::wait_counter_geq(sem, before);
      __syncthreads();
    }
#if JAXATTN_BWD_DQ_V4 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // (Variant) 4 floats a reduction (ptx::red_add_frag_f32x4; 16-byte aligned: hd
    // and the fragments' first columns are multiples of 8).
#pragma unroll
    for (int i = 0; i < kDqM; ++i) {
      const int row = m0 + dq_m + i * 16 + g;
      float* lo = dq_accum + int64_t(row) * N * hd;
      float* hi = lo + int64_t(8) * N * hd;
#pragma unroll
      for (int j = 0; j < kDq8; ++j) {
        const int col = dq_n + j * 8;
        ptx::red_add_frag_f32x4(lo + col, hi + col, row < T && col < hd, row + 8 < T && col < hd, t, dq[i][j][0],
                                dq[i][j][1], dq[i][j][2], dq[i][j][3]);
      }
    }
#else
    if (kLeanDq && m0 + kBM <= T && hd == kH) {
      // (Every row < T, every column < hd: no bounds branches.)
      const int64_t row_stride = int64_t(N) * hd;
      float* dst = dq_accum + int64_t(m0 + dq_m + g) * row_stride + dq_n + 2 * t;
#pragma unroll
      for (int i = 0; i < kDqM; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < kDq8; ++j)
            ptx::red_add_f32x2(dst + (i * 16 + 8 * h) * row_stride + j * 8, dq[i][j][2 * h], dq[i][j][2 * h + 1]);
    } else {
#pragma unroll
      for (int i = 0; i < kDqM; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m0 + dq_m + i * 16 + g + 8 * h;
          if (row < T) {
            float* dst_row = dq_accum + int64_t(row) * N * hd;
#pragma unroll
            for (int j = 0; j < kDq8; ++j) {
              const int col = dq_n + j * 8 + 2 * t;
              if (col < hd) ptx::red_add_f32x2(dst_row + col, dq[i][j][2 * h], dq[i][j][2 * h + 1]);
            }
          }
        }
    }
#endif
    if (sem) {
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) ptx::release_counter_inc(sem);
    }
  };

  // kStagger: warps of the second half add dQ of step - 1 at the end of step
  // (its dS^T buffer is rewritten only after the next step's barrier); in
  // deterministic mode every warp adds at the start (dq_step synchronises the CTA).
  const bool dq_late = kStagger && !p.deterministic && warp >= kThreads / 64;
  for (int step = 0; step < n_steps; ++step) {
    const int stage = step & 1;
    const int head = step_head(step), m0 = step_m0(step);
    ptx::cp_async_wait<0>();  // this step's Q, dO landed ...
    __syncthreads();          // ... for all threads, and the previous step is done
    const bool has_next = step + 1 < n_steps;
    float next_lse, next_dps;
    if (has_next) {
      load_step(step + 1, stage ^ 1);
      ptx::cp_async_commit();
      load_stats(step + 1, next_lse, next_dps);
    }
    if (kDoDKQ && step > 0 && !dq_late) dq_step(step - 1);
    const uint32_t q_stage = q_addr + stage * kBM * kPitch * 2;
    const uint32_t do_stage = do_addr + stage * kBM * kPitch * 2;
    const float* lse_l2 = sLse + stage * kBM;
    const float* dps = sDps + stage * kBM;

    if constexpr (kPair) {
      constexpr int kQ8h = kQH / 8;
      const int q_off = half * kQH;
      // S^T = K Q^T for the pair's 32 keys and this warp's kQH queries.
      float pt[2][kQ8h][4];
      clear(pt);
      gemm_ss_abt<Elem, 2, kQ8h, kH, kPitch, kPitch>(pt, ptx::smem_addr(sK) + pair_key * kPitch * 2 + off_a,
                                                      q_stage + off_b + q_off * kPitch * 2);
      if (n0 + kBN > S || (causal && n0 + kBN - 1 > m0)) {
        apply_mask(pt, n0 + pair_key, m0 + q_off, lane,
                   [&](int key, int query) { return key >= S || (causal && key > query); });
      }
#pragma unroll
      for (int j = 0; j < kQ8h; ++j) {
        const float2 l = *reinterpret_cast<const float2*>(lse_l2 + q_off + j * 8 + 2 * t);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            pt[i][j][2 * h] = ptx::exp2_approx(fmaf(pt[i][j][2 * h], scale_log2, -l.x));
            pt[i][j][2 * h + 1] = ptx::exp2_approx(fmaf(pt[i][j][2 * h + 1], scale_log2, -l.y));
          }
      }
      // dP^T = V dO^T; dS^T = P^T (dP^T - dpsum).
      float dst[2][kQ8h][4];
      clear(dst);
      gemm_ss_abt<Elem, 2, kQ8h, kH, kPitch, kPitch>(dst, ptx::smem_addr(sV) + pair_key * kPitch * 2 + off_a,
                                                      do_stage + off_b + q_off * kPitch * 2);
      // P^T and dS^T to smem (rows: keys, columns: queries); the pair reads both.
      Elem* ds = sdS + stage * kBN * kDsPitch;
#pragma unroll
      for (int j = 0; j < kQ8h; ++j) {
        const float2 d = *reinterpret_cast<const float2*>(dps + q_off + j * 8 + 2 * t);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float p0 = pt[i][j][2 * h], p1 = pt[i][j][2 * h + 1];
            const int off = (pair_key + i * 16 + g + 8 * h) * kDsPitch + q_off + j * 8 + 2 * t;
            *reinterpret_cast<uint32_t*>(sP + off) = ptx::pack2<Elem>(p0, p1);
            *reinterpret_cast<uint32_t*>(ds + off) =
                ptx::pack2<Elem>(p0 * (dst[i][j][2 * h] - d.x), p1 * (dst[i][j][2 * h + 1] - d.y));
          }
      }
      ptx::named_barrier_sync(1 + (warp >> 1), 64);
      // dV += P^T dO, dK += dS^T Q for the pair's keys, this warp's columns.
      const uint32_t a_off = pair_key * kDsPitch * 2 + lane_offset_a<kDsPitch>(lane);
      const uint32_t col_off = half * (kH / 2) * 2;
      gemm_ss_ab<Elem, 2, kH / 16, kBM, kDsPitch, kPitch>(dv, ptx::smem_addr(sP) + a_off, do_stage + off_a + col_off);
      gemm_ss_ab<Elem, 2, kH / 16, kBM, kDsPitch, kPitch>(dk, ptx::smem_addr(ds) + a_off, q_stage + off_a + col_off);
    } else {

    // S^T = K Q^T for this warp's 16 keys; P^T = exp2(S^T scale_log2 - lse_log2).
    float pt[1][kQ8][4];
    clear(pt);
    gemm_ss_abt<Elem, 1, kQ8, kH, kPitch, kPitch>(pt, k_addr_a, q_stage + off_b);
    if constexpr (kMasked) {
      if (p.bias != nullptr) {  // (rows are keys, columns queries)
        prescale_logits<true>(pt, n0 + key_row, m0, lane, p.scale, softcap,
                              [&](int key) { return mask.bias_col(head, key); }, mask.bias_at.row, mask.q_len);
      } else if (softcap > 0.f) {
        prescale_logits<false>(pt, n0 + key_row, m0, lane, p.scale, softcap, [](int) { return nullptr; }, 0, 0);
      }
      if (segments || mask.tile_partial(m0, m0 + kBM, n0 + key_row, n0 + key_row + 16))
        apply_visibility(pt, n0 + key_row, m0, lane, mask.kv_seg, mask.kv_len, mask.q_seg, mask.q_len,
                         [&](int key, int query) { return mask.visible(query, key) && mask.dense_ok(head, query, key); });
    } else if (n0 + kBN > S || (causal && n0 + kBN - 1 > m0)) {
      apply_mask(pt, n0 + key_row, m0, lane,
                 [&](int key, int query) { return key >= S || (causal && key > query); });
    }
#pragma unroll
    for (int j = 0; j < kQ8; ++j) {
      const float2 l = *reinterpret_cast<const float2*>(lse_l2 + j * 8 + 2 * t);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        pt[0][j][2 * h] = ptx::exp2_approx(fmaf(pt[0][j][2 * h], scale_log2, -l.x));
        pt[0][j][2 * h + 1] = ptx::exp2_approx(fmaf(pt[0][j][2 * h + 1], scale_log2, -l.y));
      }
    }

    if constexpr (kDoDV) {  // dV += P^T dO
      uint32_t pa[1][kQSteps][4];
      acc_to_a_frags<Elem>(pt, pa);
      gemm_rs_ab<Elem, 1, kH / 8, kQSteps, kPitch>(dv, pa, do_stage + off_a);
    }

    if constexpr (kDoDKQ) {
      // dP^T = V dO^T; dS^T = P^T (dP^T - dpsum).
      float dst[1][kQ8][4];
      clear(dst);
      gemm_ss_abt<Elem, 1, kQ8, kH, kPitch, kPitch>(dst, v_addr_a, do_stage + off_b);
#pragma unroll
      for (int j = 0; j < kQ8; ++j) {
        const float2 d = *reinterpret_cast<const float2*>(dps + j * 8 + 2 * t);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          dst[0][j][2 * h] = pt[0][j][2 * h] * (dst[0][j][2 * h] - d.x);
          dst[0][j][2 * h + 1] = pt[0][j][2 * h + 1] * (dst[0][j][2 * h + 1] - d.y);
        }
      }
      if constexpr (kMasked) {
        // dS is the gradient of the final logit: dbias (f32 atomics into the
        // bias's broadcast shape, only where P > 0). With a soft cap, dS of the
        // uncapped logit is dS * (1 - tanh^2); the capped logit is recovered
        // from P = exp2((capped + bias) log2e - lse_log2).
        if (p.dbias != nullptr || softcap > 0.f) {
          const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;
#pragma unroll
          for (int j = 0; j < kQ8; ++j) {
            const float2 l = *reinterpret_cast<const float2*>(lse_l2 + j * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float pv = pt[0][j][e];
              if (!(pv > 0.f)) continue;  // (dS = 0 already)
              const int key = n0 + key_row + g + 8 * (e >> 1), query = m0 + j * 8 + 2 * t + (e & 1);
              if (p.dbias != nullptr) ptx::red_add_f32(p.dbias + mask.bias_at.at(head, query, key), dst[0][j][e]);
              if (softcap > 0.f) {
                const float capped = (log2f(pv) + ((e & 1) ? l.y : l.x)) * kLn2 - mask.bias_of(head, query, key);
                dst[0][j][e] *= softcap_grad(capped, inv_cap);
              }
            }
          }
        }
      }
      uint32_t dsa[1][kQSteps][4];
      acc_to_a_frags<Elem>(dst, dsa);
      // dK += dS^T Q (scaled at the end).
      gemm_rs_ab<Elem, 1, kH / 8, kQSteps, kPitch>(dk, dsa, q_stage + off_a);
      // dS^T to smem for dQ (next step): fragment [kq][r] holds row g + 8(r&1),
      // columns 16kq + 8(r>>1) + 2t, 2t+1.
      Elem* ds = sdS + stage * kBN * kDsPitch;
#pragma unroll
      for (int kq = 0; kq < kQSteps; ++kq)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = key_row + g + 8 * (r & 1), col = kq * 16 + 8 * (r >> 1) + 2 * t;
          *reinterpret_cast<uint32_t*>(ds + row * kDsPitch + col) = dsa[0][kq][r];
        }
    }
    }  // (!kPair)
    if (has_next) store_stats(stage ^ 1, next_lse, next_dps);
    if (kStagger && step > 0 && dq_late) dq_step(step - 1);
  }

  if (kDoDKQ && n_steps > 0) {
    __syncthreads();
    dq_step(n_steps - 1);
  }

  // Epilogue: dK (scaled) and dV through the K / V tiles.
  ptx::cp_async_wait<0>();  // (K/V copies are still in flight when there was no step)
  __syncthreads();
  // (kPair: the warp's tile is keys [pair_key, + 32) x columns [half * kH / 2, + kH / 2).)
  const int acc_off = kPair ? pair_key * kPitch + half * (kH / 2) : key_row * kPitch;
  if constexpr (kDoDKQ) {
    float sc[kAccM][2];
#pragma unroll
    for (int i = 0; i < kAccM; ++i) sc[i][0] = sc[i][1] = p.scale;
    acc_to_smem<Elem, kPitch>(dk, sc, sK + acc_off, lane);
  }
  if constexpr (kDoDV) {
    float one[kAccM][2];
#pragma unroll
    for (int i = 0; i < kAccM; ++i) one[i][0] = one[i][1] = 1.f;
    acc_to_smem<Elem, kPitch>(dv, one, sV + acc_off, lane);
  }
  __syncthreads();
  if constexpr (kDoDKQ) {
    Elem* dk_out = static_cast<Elem*>(p.dk) + b * p.k_batch_stride +
                   int64_t(n0) * p.k_row_stride + kv_head * p.k_head_stride;
    store_tile<kBN, kH, kPitch, kThreads>(sK, dk_out, p.k_row_stride, S - n0, hd);
  }
  if constexpr (kDoDV) {
    Elem* dv_out = static_cast<Elem*>(p.dv) + b * p.v_batch_stride +
                   int64_t(n0) * p.v_row_stride + kv_head * p.v_head_stride;
    store_tile<kBN, kH, kPitch, kThreads>(sV, dv_out, p.v_row_stride, S - n0, hd);
  }
}

// Enqueues the main kernel(s) of tile Tile (masked or not).
template <class Tile, typename Elem, bool kMasked>
LaunchStatus launch_bwd_main(const AttnParams& p, cudaStream_t stream) {
  const dim3 grid((p.seqlen_k + Tile::kBlockN - 1) / Tile::kBlockN, p.num_heads_k, p.batch);
  auto launch = [&](auto kernel, const char* name) -> LaunchStatus {
    if (grid.x == 0) return {};  // no keys: dq = 0 needs only the zeroing
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Tile::kSmemBytes);
    if (e != cudaSuccess) return {e, name};
    kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
    return {cudaGetLastError(), name};
  };
  if constexpr (Tile::kSplitDV) {
    LaunchStatus st = launch(flash_bwd_kernel<Tile, Elem, true, false, kMasked>, "flash_bwd_dv_sm80");
    if (!st.ok()) return st;
    return launch(flash_bwd_kernel<Tile, Elem, false, true, kMasked>, "flash_bwd_dkdq_sm80");
  } else {
    return launch(flash_bwd_kernel<Tile, Elem, true, true, kMasked>, "flash_bwd_sm80");
  }
}

// Enqueues preprocess, main kernel(s) and dq conversion for head dims up to kHeadDim.
template <int kHeadDim, typename Elem>
LaunchStatus run_bwd(const AttnParams& p, cudaStream_t stream) {
  cudaError_t err = launch_bwd_preprocess<Elem>(p, stream);
  if (err != cudaSuccess) return {err, "flash_bwd_preprocess_sm80"};
  if (p.dbias != nullptr) {  // (the kernel adds into it)
    size_t n = 1;
    for (int d : p.bias_dims) n *= size_t(d);
    err = cudaMemsetAsync(p.dbias, 0, n * sizeof(float), stream);
    if (err != cudaSuccess) return {err, "flash_bwd_sm80 (dbias memset)"};
  }
  if (p.deterministic) {
    err = clear_dq_semaphore(p, stream);
    if (err != cudaSuccess) return {err, "flash_bwd_sm80 (semaphore memset)"};
  }
  const LaunchStatus st =
      p.has_masks() ? launch_bwd_main<typename BwdTileMaskedFor<kHeadDim>::type, Elem, true>(p, stream)
                    : launch_bwd_main<typename BwdTileFor<kHeadDim>::type, Elem, false>(p, stream);
  if (!st.ok()) return st;

  err = launch_bwd_convert_dq<Elem>(p, stream);
  return {err, err == cudaSuccess ? "" : "flash_bwd_convert_dq_sm80"};
}

}  // namespace jaxattn::cuda::sm80
