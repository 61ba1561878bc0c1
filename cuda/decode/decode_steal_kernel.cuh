// Experiment (session 21, -DJAXATTN_EXP_DECODE_STEAL; H=128, sm_90): the drift loop
// (decode_mma_kernel<128, *, true>, MmaLayout<128, true>) as a persistent grid whose
// CTAs share the work tile by tile.
//
// Why: session 21 run 1's timeline showed the drift loop's per-CTA loop times
// spread 52-65 us at B=16 L=4K although every CTA streams the same 2 MB, and the
// spread is between groups of SMs (all 8 CTAs of a batch row alike): the call ends
// with the slowest group. Here one CTA per SM takes units (row b, KV head kh, row
// block rb) from a global counter; each unit's tiles are claimed from its front by
// its owner (two at a time), and a CTA with no unit left steals the back half of the
// unit with the most tiles left, until no unit has kMinSteal left. So the fast SMs
// take over the slow ones' tails (and the 4 SMs the 128 units leave idle help).
//
// Partials: every consumer warp keeps its running (m, l, o) per visit of a unit
// (a run of consecutive tiles of the CTA's stream from one unit); when its group
// moves to another unit or the stream ends, the group's 4 warps merge theirs
// through shared memory into one part slot of the unit (taken when the visit
// began) and add the tiles they did to the unit's count; the group whose add
// completes the unit merges the unit's parts (all 128 threads, every part's loads
// in flight at once) and writes o and lse. At most 1 + kMaxSteals visits per
// unit, two groups each: kMaxParts slots. (Run 2's first version wrote one part
// per warp and merged them in one warp, part after part: 30 us a call.)
//
// State (StealState): per unit a 64-bit word (front tile claimed so far, low 32
// bits; back = end of the owner's range, high 32 bits, signed), the done count,
// the part count and the steal count, plus the unit counter; zeroed before the
// call. Experiment only: the launcher keeps two copies in a lazily allocated
// device buffer, and each call zeroes the copy the next call uses (after the PDL
// wait, so the previous call is done with it). Not CUDA-graph safe, one stream
// per device: the checker's timing, not the package's path.
#pragma once

#include "decode/decode_mma_kernel.cuh"

namespace jaxattn::cuda::decode {

constexpr int kStealClaim = 2;   // tiles an owner claims per atomic
constexpr int kMinSteal = 4;     // tiles a unit must have left to be stolen from
#ifndef JAXATTN_EXP_STEAL_MAX
#define JAXATTN_EXP_STEAL_MAX 3
#endif
constexpr int kMaxSteals = JAXATTN_EXP_STEAL_MAX;  // steals per unit (0: a persistent grid, no steals)
constexpr int kStealGroups = 2;  // consumer groups of MmaLayout<128, true>
constexpr int kMaxParts = kStealGroups * (1 + kMaxSteals);

struct StealState {
  unsigned long long* word;  // [units]
  int* done;                 // [units]
  int* nparts;               // [units]
  int* steals;               // [units]
  int* next_unit;            // [1]
  int* zero;                 // the other copy's ints, zeroed by this call
  int zero_ints;
  float* parts;              // [units][kMaxParts][part_rows][H + 2]: m, l, o[H] per row
  int part_rows;             // min(16, plan.rows)
};

// One stage's tile: which unit, its first key, and the unit's geometry.
struct StealInfo {
  int u, jt, len, lo_keys, n_tiles, done, pad0, pad1;
};

template <int H, bool kBf16>
__global__ void __launch_bounds__(MmaLayout<H, true>::kThreads)
    decode_steal_kernel(const __grid_constant__ AttnParams p, const DecodePlan plan,
                        const __grid_constant__ DecodeTma tma, const StealState st) {
#ifdef JAXATTN_DECODE_DRIFT_ON
  using L = MmaLayout<H, true>;
  static_assert(L::kGroups == kStealGroups && L::kKeyWarps == 4 && L::kBlockN == 64, "steal layout");
  using Elem = std::conditional_t<kBf16, __nv_bfloat16, __half>;
  constexpr int kStages = L::kStages, kPitch = L::kPitch;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* ring = smem + (((ptx::smem_addr(smem) + 1023) & ~1023u) - ptx::smem_addr(smem));
  StealInfo* info = reinterpret_cast<StealInfo*>(ring + kStages * L::kTmaStageBytes);
  Elem* q_st = reinterpret_cast<Elem*>(info + kStages);  // [kStages][16][H]: a visit's query rows
  Elem* q_s = q_st + kStages * 16 * H;                    // [2 groups][16][kPitch]
  // Per group: the warps' (m, l, o) rows for the group merge, and two ints (the
  // visit's part slot, the completing flag).
  constexpr int kRedFloats = 4 * 16 * (H + 4) + 2 * 4 * 16 + 4;
  float* red_all = reinterpret_cast<float*>(q_s + 2 * 16 * kPitch);
  const uint32_t full_bar = ptx::smem_addr(red_all + 2 * kRedFloats), empty_bar = full_bar + 8 * kStages;
  const uint32_t ring_base = ptx::smem_addr(ring);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int T = p.seqlen_q, G = p.num_heads / p.num_heads_k, K = p.num_heads_k;
  const int units = p.batch * K * plan.row_blocks;
  const bool paged = p.block_table != nullptr;
  const int ps = p.page_size;
  if (plan.pdl) {
    ptx::griddep_wait();
    ptx::griddep_launch_dependents();
  }
  for (int i = blockIdx.x * blockDim.x + tid; i < st.zero_ints; i += gridDim.x * blockDim.x) st.zero[i] = 0;
  if (tid < kStages) {
    hptx::mbar_init(full_bar + 8 * tid, 1);
    hptx::mbar_init(full_bar + 8 * (kStages + tid), L::kKeyWarps);
  }
  hptx::mbar_init_fence();
  __syncthreads();

  // A unit's geometry: (b, kh, rb) and its tiles [lo64, lo64 + 64 n).
  auto unit_geom = [&](int u, int& b, int& kh, int& rb, int& lo_keys, int& len, int& n) {
    rb = u % plan.row_blocks;
    kh = u / plan.row_blocks % K;
    b = u / (plan.row_blocks * K);
    row_keys(p, b, &lo_keys, &len);
    const int lo64 = lo_keys / 64 * 64;
    n = len > lo64 ? (len - lo64 + 63) / 64 : 0;
  };

  if (warp == L::kWarps) {
    // ---- producer warp ----
    if (lane == 0) {
      hptx::prefetch_tmap(&tma.k);
      hptx::prefetch_tmap(&tma.v);
    }
    int tseq = 0;
    int win_b = -1, win_base = 0, my_id = 0;  // page ids of pages [win_base, win_base + 32) of row win_b
    auto page_of = [&](int b, int rel) {
      if (b != win_b || rel < win_base || rel >= win_base + 32) {
        win_b = b, win_base = rel;
        const int t = rel + lane;
        my_id = t < p.max_pages ? min(max(p.block_table[int64_t(b) * p.max_pages + t], 0), p.num_pages - 1) : 0;
      }
      return __shfl_sync(~0u, my_id, rel - win_base);
    };
    // The query rows of the unit being issued (qv) and of the next owned one (nq):
    // 16 rows x 16 chunks of 16 bytes, 8 per lane; written into the first two stages
    // of each visit, where each group's first tile of the visit finds them.
    uint4 qv[8], nq[8];
    auto load_q = [&](int b, int kh, int rb, uint4 (&dst)[8]) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int c = lane + 32 * k, r = c / 16, col = (c % 16) * 8, row = rb * 16 + r;
        dst[k] = make_uint4(0, 0, 0, 0);
        if (row < plan.rows) {
          const int i = row / G, hn = kh * G + row % G;
          dst[k] = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.q) + b * p.q_batch_stride +
                                                   i * p.q_row_stride + hn * p.q_head_stride + col);
        }
      }
    };
    int last_u = -1, q_left = 0;
    auto issue = [&](int u, int b, int kh, int tile, int lo_keys, int len, int n) {
      const int stage = tseq % kStages;
      if (u != last_u) last_u = u, q_left = 2;
      const int jt = lo_keys / 64 * 64 + tile * 64;
      int row = jt, batch = b;
      if (paged) {
        const int rel = jt / ps;
        row = jt - rel * ps;
        batch = page_of(b, rel);
      }
      if (tseq >= kStages) hptx::mbar_wait(empty_bar + 8 * stage, ((tseq / kStages) - 1) & 1);
      if (q_left > 0) {
        --q_left;
#pragma unroll
        for (int k = 0; k < 8; ++k) reinterpret_cast<uint4*>(q_st + stage * 16 * H)[lane + 32 * k] = qv[k];
        __syncwarp();  // (lane 0's arrive below releases every lane's rows)
      }
      if (lane == 0) {
        info[stage] = StealInfo{u, jt, len, lo_keys, n, 0, 0, 0};
        const uint32_t dst = ring_base + stage * L::kTmaStageBytes, bar = full_bar + 8 * stage;
        hptx::mbar_arrive_expect_tx(bar, L::kTmaStageBytes);
        hptx::tma_load_5d(dst, &tma.k, bar, 0, row, 0, kh, batch);
        hptx::tma_load_5d(dst + L::kTmaTileBytes, &tma.v, bar, 0, row, 0, kh, batch);
      }
      __syncwarp();
      ++tseq;
    };
    // Owned units: the first is blockIdx.x, the next ones come from the counter
    // (offset by the grid), each asked for when the previous one starts. Its row
    // length and first page ids load while the current unit streams.
    int u = blockIdx.x;
    int pre_b = -1, pre_base = 0, pre_id = 0;  // the next unit's first page ids
    auto preload = [&](int b, int lo_keys) {
      pre_b = b, pre_base = paged ? lo_keys / 64 * 64 / ps : 0;
      const int t = pre_base + lane;
      pre_id = paged && t < p.max_pages ? min(max(p.block_table[int64_t(b) * p.max_pages + t], 0), p.num_pages - 1) : 0;
    };
    if (u < units) {
      int b, kh, rb, lo_keys, len, n;
      unit_geom(u, b, kh, rb, lo_keys, len, n);
      preload(b, lo_keys);
      load_q(b, kh, rb, nq);
    }
    while (u < units) {
      int nu = 0;
      if (lane == 0) nu = gridDim.x + atomicAdd(st.next_unit, 1);  // (in flight while u streams)
      int b, kh, rb, lo_keys, len, n;
      unit_geom(u, b, kh, rb, lo_keys, len, n);
      win_b = pre_b, win_base = pre_base, my_id = pre_id;
#pragma unroll
      for (int k = 0; k < 8; ++k) qv[k] = nq[k];
      if (n == 0) {  // nothing visible: o = 0, lse = -inf
        const int r0 = rb * 16, rows_here = min(16, plan.rows - r0);
        for (int c = lane; c < rows_here * H; c += 32) {
          const int row = r0 + c / H, i = row / G, hn = kh * G + row % G;
          static_cast<uint16_t*>(p.o)[b * p.o_batch_stride + i * p.o_row_stride + hn * p.o_head_stride + c % H] =
              to_half_bits<kBf16>(0.f);
        }
        if (lane < rows_here) {
          const int row = r0 + lane, i = row / G, hn = kh * G + row % G;
          p.lse[(int64_t(b) * T + i) * p.num_heads + hn] = -INFINITY;
        }
      } else {
        // Our first claim, tiles [0, kStealClaim), is part of the add that sets the
        // back (no steal can precede it: a unit with back 0 has nothing to steal).
        if (lane == 0) atomicAdd(st.word + u, (static_cast<unsigned long long>(n) << 32) + kStealClaim);
        int f = 0, bk = n;
        bool first = true;
        while (f < bk) {
          unsigned long long nxt = 0;
          if (lane == 0) nxt = atomicAdd(st.word + u, static_cast<unsigned long long>(kStealClaim));  // ahead
          for (int t = f; t < min(f + kStealClaim, bk); ++t) issue(u, b, kh, t, lo_keys, len, n);
          if (first) {  // the next unit's row length and first page ids, while this one streams
            first = false;
            const int v = __shfl_sync(~0u, nu, 0);
            if (v < units) {
              int vb, vkh, vrb, vlo, vlen, vn;
              unit_geom(v, vb, vkh, vrb, vlo, vlen, vn);
              preload(vb, vlo);
              load_q(vb, vkh, vrb, nq);
            }
          }
          nxt = __shfl_sync(~0u, nxt, 0);
          f = int(uint32_t(nxt)), bk = int(nxt >> 32);
        }
      }
      u = __shfl_sync(~0u, nu, 0);
      if (n == 0 && u < units) {
        int vb, vkh, vrb, vlo, vlen, vn;
        unit_geom(u, vb, vkh, vrb, vlo, vlen, vn);
        preload(vb, vlo);
        load_q(vb, vkh, vrb, nq);
      }
    }
    // Steals: the back half of the unit with the most tiles left.
    while (true) {
      int best = 0, bu = -1;
      for (int v = lane; v < units; v += 32) {
        const unsigned long long w = *reinterpret_cast<volatile unsigned long long*>(st.word + v);
        const int rem = int(w >> 32) - int(uint32_t(w));
        if (rem > best && *reinterpret_cast<volatile int*>(st.steals + v) < kMaxSteals) best = rem, bu = v;
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) {
        const int ob = __shfl_xor_sync(~0u, best, o), ou = __shfl_xor_sync(~0u, bu, o);
        if (ob > best || (ob == best && ou < bu)) best = ob, bu = ou;
      }
      if (best < kMinSteal) break;
      const int k = best / 2;
      int lo = 0, hi = 0;
      if (lane == 0) {
        if (atomicAdd(st.steals + bu, 1) < kMaxSteals) {
          const unsigned long long old =
              atomicAdd(st.word + bu, static_cast<unsigned long long>(-(static_cast<long long>(k) << 32)));
          const int f = int(uint32_t(old)), bk = int(old >> 32);
          lo = max(f, bk - k), hi = bk;
        }
      }
      lo = __shfl_sync(~0u, lo, 0), hi = __shfl_sync(~0u, hi, 0);
      if (lo < hi) {
        int b, kh, rb, lo_keys, len, n;
        unit_geom(bu, b, kh, rb, lo_keys, len, n);
        if (bu != last_u) load_q(b, kh, rb, qv);
        for (int t = lo; t < hi; ++t) issue(bu, b, kh, t, lo_keys, len, n);
      }
    }
    // The end of the stream: one empty stage per group.
    for (int e = 0; e < L::kGroups; ++e) {
      const int stage = tseq % kStages;
      if (tseq >= kStages) hptx::mbar_wait(empty_bar + 8 * stage, ((tseq / kStages) - 1) & 1);
      if (lane == 0) {
        info[stage] = StealInfo{-1, 0, 0, 0, 0, 1, 0, 0};
        hptx::mbar_arrive(full_bar + 8 * stage);
      }
      __syncwarp();
      ++tseq;
    }
    return;
  }

  // ---- consumer warps ----
  const int group = warp / L::kKeyWarps, kw = warp % L::kKeyWarps;
  const int g = lane / 4, t4 = lane % 4;
  Elem* q_g = q_s + group * 16 * kPitch;
  const uint32_t q_addr = ptx::smem_addr(q_g) + sm80::lane_offset_a<kPitch>(lane);
  const uint32_t k_sw = (kw * 16 + (lane & 7) + (lane >> 4) * 8) * 128, y_k = (lane & 7) ^ ((lane >> 3) & 1);
  const uint32_t v_sw = (kw * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * 128, y_v = (lane & 7) ^ (lane >> 4);
  const int wl = p.window_left;
  const float qk_scale = p.scale * kLog2e;
  const float cap = p.softcap;
  float o_acc[1][H / 8][4];
  float m[2], l[2];
  int pos[2];
  bool row_ok[2];
  int cur = -1, cur_n = 0, nt = 0, cur_b = 0, cur_kh = 0, cur_rb = 0;

  // The group's part of unit `cur`: the 4 warps' rows merged through shared memory
  // into the visit's part slot; the group whose tiles complete the unit merges its
  // parts and writes o and lse.
  float* red_o = red_all + group * kRedFloats;  // [4][16][H + 4]
  float* red_m = red_o + 4 * 16 * (H + 4);      // [4][16]
  float* red_l = red_m + 4 * 16;                // [4][16]
  int* red_i = reinterpret_cast<int*>(red_l + 4 * 16);  // [0]: the visit's slot, [1]: completes the unit
  const int gt = kw * 32 + lane;                // thread of the group
  auto group_bar = [&]() { asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group), "r"(L::kKeyWarps * 32) : "memory"); };
  // Completion of a flushed visit is checked at the next unit change or the end
  // (thread 0's done add stays in flight meanwhile): pend_* describe it.
  int cur_slot = 0, pend_done = 0, pend_u = -1, pend_nt = 0, pend_n = 0;
  auto flush = [&]() {
    const int rows_here = min(16, plan.rows - cur_rb * 16);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float lsum = ptx::quad_sum(l[h]);
      const int r = g + 8 * h;
      if (r < rows_here) {
        if (t4 == 0) red_m[kw * 16 + r] = m[h], red_l[kw * 16 + r] = lsum;
#pragma unroll
        for (int d = 0; d < H / 8; ++d)
          *reinterpret_cast<float2*>(red_o + (kw * 16 + r) * (H + 4) + d * 8 + 2 * t4) =
              make_float2(o_acc[0][d][2 * h], o_acc[0][d][2 * h + 1]);
      }
    }
    if (gt == 0) red_i[0] = cur_slot;
    group_bar();
    const int slot = red_i[0];
    float* part = st.parts + (int64_t(cur) * kMaxParts + slot) * st.part_rows * (H + 2);
    for (int e = gt; e < rows_here * H; e += L::kKeyWarps * 32) {
      const int r = e / H, d = e % H;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < 4; ++w) M = fmaxf(M, red_m[w * 16 + r]);
      float o = 0.f, sum = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const float wt = exp2f(red_m[w * 16 + r] - M);
          o += wt * red_o[(w * 16 + r) * (H + 4) + d];
          sum += wt * red_l[w * 16 + r];
        }
      }
      part[r * (H + 2) + 2 + d] = o;
      if (d == 0) part[r * (H + 2)] = M, part[r * (H + 2) + 1] = sum;
    }
    // Release by one thread after the group barrier (the barrier orders the other
    // threads' part writes before its fence); the add's answer is read later.
    group_bar();
    if (gt == 0) {
      __threadfence();
      pend_done = atomicAdd(st.done + cur, nt);
    }
    pend_u = cur, pend_nt = nt, pend_n = cur_n;
  };
  // The pending visit's completion: the group whose add completed its unit merges
  // the unit's parts (every part's loads in flight at once) and writes o and lse.
  auto resolve = [&]() {
    if (pend_u < 0) return;
    if (gt == 0) {
      const bool last = pend_done + pend_nt == pend_n;
      if (last) __threadfence();  // (acquire: the other parts' writes)
      red_i[1] = last;
    }
    group_bar();
    const int u = pend_u;
    pend_u = -1;
    if (!red_i[1]) return;
    const int rb = u % plan.row_blocks, kh = u / plan.row_blocks % K, b = u / (plan.row_blocks * K);
    const int rows_here = min(16, plan.rows - rb * 16);
    const int np = *reinterpret_cast<volatile int*>(st.nparts + u);
    const float* base = st.parts + int64_t(u) * kMaxParts * st.part_rows * (H + 2);
    for (int e = gt; e < rows_here * H; e += L::kKeyWarps * 32) {
      const int r = e / H, d = e % H;
      float mq[kMaxParts], lq[kMaxParts], oq[kMaxParts];
#pragma unroll
      for (int q = 0; q < kMaxParts; ++q) {
        const float* pr = base + (q * st.part_rows + r) * (H + 2);
        mq[q] = q < np ? __ldcg(pr) : -INFINITY;
        lq[q] = q < np ? __ldcg(pr + 1) : 0.f;
        oq[q] = q < np ? __ldcg(pr + 2 + d) : 0.f;
      }
      float M = -INFINITY;
#pragma unroll
      for (int q = 0; q < kMaxParts; ++q) M = fmaxf(M, mq[q]);
      float sum = 0.f, o = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int q = 0; q < kMaxParts; ++q) {
          const float wt = exp2f(mq[q] - M);
          sum += wt * lq[q];
          o += wt * oq[q];
        }
      }
      const int row = rb * 16 + r, i = row / G, hn = kh * G + row % G;
      static_cast<uint16_t*>(p.o)[b * p.o_batch_stride + i * p.o_row_stride + hn * p.o_head_stride + d] =
          to_half_bits<kBf16>(sum > 0.f ? o / sum : 0.f);
      if (d == 0) p.lse[(int64_t(b) * T + i) * p.num_heads + hn] = sum > 0.f ? (M + log2f(sum)) * kLn2 : -INFINITY;
    }
  };

  for (int tile = group;; tile += L::kGroups) {
    const int stage = tile % kStages;
    const uint32_t stg = ring_base + stage * L::kTmaStageBytes;
    hptx::mbar_wait(full_bar + 8 * stage, (tile / kStages) & 1);
    const StealInfo in = info[stage];
    if (in.done) break;
    if (in.u != cur) {
      resolve();
      if (cur >= 0) flush();
      // The group's 4 warps all reach this tile: copy in the new unit's query rows
      // (the producer put them in this stage) and take the visit's part slot.
      group_bar();
      cur = in.u;
      if (gt == 0) cur_slot = atomicAdd(st.nparts + cur, 1);  // (read at the flush)
      cur_rb = cur % plan.row_blocks, cur_kh = cur / plan.row_blocks % K, cur_b = cur / (plan.row_blocks * K);
      cur_n = in.n_tiles;
      nt = 0;
      const int r0 = cur_rb * 16, rows_here = min(16, plan.rows - r0);
      for (int c = gt; c < 16 * L::kChunksPerRow; c += L::kKeyWarps * 32) {
        const int r = c / L::kChunksPerRow, col = (c % L::kChunksPerRow) * 8;
        *reinterpret_cast<uint4*>(q_g + r * kPitch + col) =
            *reinterpret_cast<const uint4*>(q_st + stage * 16 * H + r * H + col);
      }
      group_bar();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        row_ok[h] = r < rows_here;
        pos[h] = in.len - T + (r0 + r) / G;
        m[h] = -INFINITY, l[h] = 0.f;
      }
      sm80::clear(o_acc);
    }
    const int jw = in.jt + kw * 16, j_end = in.len, lo_keys = in.lo_keys;
    if (jw < lo_keys || jw + 16 > j_end) {  // rows outside [lo_keys, j_end): V zeroed (as the drift loop)
      for (int i = lane; i < 16 * (H / 8); i += 32) {
        const int r = i / (H / 8), u = i % (H / 8);
        if (jw + r < lo_keys || jw + r >= j_end) {
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(stg + L::kTmaTileBytes +
                                                                           (u / 8) * L::kTmaChunkBytes +
                                                                           (kw * 16 + r) * 128 + (u % 8) * 16),
                       "r"(0u)
                       : "memory");
        }
      }
      hptx::fence_proxy_async_smem();
      __syncwarp();
    }
    float s_acc[1][2][4];
    sm80::clear(s_acc);
#pragma unroll
    for (int kk = 0; kk < H / 16; ++kk) {
      uint32_t a[4], kb[4];
      ptx::ldmatrix_x4(a, q_addr + kk * 16 * 2);
      ptx::ldmatrix_x4(kb, stg + (kk / 4) * L::kTmaChunkBytes + k_sw + ((((kk % 4) * 2) ^ y_k) << 4));
      ptx::mma_16816<Elem>(s_acc[0][0], a, kb[0], kb[1]);
      ptx::mma_16816<Elem>(s_acc[0][1], a, kb[2], kb[3]);
    }
    uint32_t v_frag[H / 16][4];
#pragma unroll
    for (int jp = 0; jp < H / 16; ++jp) {
      ptx::ldmatrix_x4_trans(v_frag[jp], stg + L::kTmaTileBytes + (jp / 4) * L::kTmaChunkBytes + v_sw +
                                             ((((jp % 4) * 2) ^ y_v) << 4));
    }
#include "decode/decode_softmax_tile.inc"
#pragma unroll
    for (int jp = 0; jp < H / 16; ++jp) {
      ptx::mma_16816<Elem>(o_acc[0][2 * jp], p_frag[0][0], v_frag[jp][0], v_frag[jp][1]);
      ptx::mma_16816<Elem>(o_acc[0][2 * jp + 1], p_frag[0][0], v_frag[jp][2], v_frag[jp][3]);
    }
    ++nt;
    __syncwarp();
    if (lane == 0) hptx::mbar_arrive(empty_bar + 8 * stage);
  }
  resolve();
  if (cur >= 0) flush();
  resolve();
#else
  __trap();
#endif
}

// Shared memory of decode_steal_kernel<H, *>: the ring (1024-aligned), the stage
// infos, two groups' query rows and merge rows, and the mbarriers.
template <int H>
constexpr int steal_smem_bytes() {
  using L = MmaLayout<H, true>;
  return 1024 + L::kStages * L::kTmaStageBytes + L::kStages * int(sizeof(StealInfo)) + L::kStages * 16 * H * 2 +
         2 * 16 * L::kPitch * 2 +
         2 * (4 * 16 * (H + 4) + 2 * 4 * 16 + 4) * 4 + 2 * L::kStages * 8;
}

}  // namespace jaxattn::cuda::decode
