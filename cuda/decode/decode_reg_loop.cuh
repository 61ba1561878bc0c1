// The register-streaming loop of decode version 2 (kV2Regs; decode_mma_kernel<128,
// *, kLoopRegs>, session 43): K and V go from global memory straight into registers,
// with no shared-memory ring, no barrier and no mbarrier in the loop.
//
// Why: every loop that stages K / V in shared memory (the cp.async ring, the drift
// loop's TMA ring) reads 4-10 points of the read bandwidth below cuDNN's decode kernel
// on every row (perf.md sessions 17-42), while register loads on the same grid read
// 97-100% (tests/cuda/stream_probe.cu, session 17). Here each warp is its own stream.
//
// Shape: kRegWarps = 8 warps, one CTA per (row, KV head, chunk); warp w takes the 16-key
// groups w, w + 8, w + 16, ... of the chunk and keeps two groups of loads in flight (64
// registers each): while it computes group i, group i + 8 is landing and group
// i + 16 is issued right after. A 16-key group lies in one page (page sizes are
// multiples of 16 and groups start on multiples of 16), so a group costs one page
// lookup.
//
// Math: the swapped orientation (as kV2SwapAB): S^T = K Q^T (m16 keys x n8 query
// rows) and O^T += V^T P^T (m16 head dims x n8 rows), for at most 8 query rows per
// KV head. The mma fragments come from the loaded registers without shuffles by
// permuting the head dimension, which a dot product over it does not see:
// - S^T: lane (g, t4) loads 16-byte chunks t4, t4 + 4, t4 + 8, t4 + 12 of key rows g
//   and g + 8. In k-step kk, the A fragment's columns 2 t4 + e (e = 0, 1) are head
//   dims 8 (t4 + 4 (kk / 2)) + 4 (kk % 2) + e and columns 2 t4 + 8 + e the dims 2
//   after them: word 2 (kk % 2) and word 2 (kk % 2) + 1 of chunk kk / 2 of each row.
//   Q^T (the B operand) is read from query row g's same chunks, so the k-steps sum
//   the same products, in another order.
// - O^T: lane (g, t4) loads chunks g and g + 8 of key rows 2 t4, 2 t4 + 1, 2 t4 + 8,
//   2 t4 + 9. Row g of m-tile mt is head dim 8 g + mt and row g + 8 is 64 + 8 g + mt:
//   each A register pairs element mt of two key rows (one byte permute). The O^T
//   accumulator of (m-tile mt, row g) is output dim 8 g + mt: each lane ends with
//   whole 8-dim chunks of its two query rows (RegLoopAcc::o).
// - P^T (the B operand) from the S^T accumulators by movmatrix, as kV2SwapAB.
#pragma once

#include "common/ptx.h"
#include "decode/decode_common.cuh"
#include "decode/decode_swap_softmax.cuh"

namespace jaxattn::cuda::decode {

// Timing experiment (decode_check builds; scripts/decode_build_ab.sh EXPS=...):
// JAXATTN_EXP_DECODE_REG_L2_128=1: the K loads, which read half a 128-byte line each,
// fetch whole lines into L2 (.L2::128B); H100, session 44: ~+1%, inside the noise; the
// H200 is still to time it. (CTAs of 4 warps, two per SM, lost 2-3% there: removed.)
#ifndef JAXATTN_EXP_DECODE_REG_L2_128
#define JAXATTN_EXP_DECODE_REG_L2_128 0
#endif
constexpr int kRegWarps = 8;       // warps of a kLoopRegs CTA
constexpr int kRegGroupKeys = 16;  // keys per load group (one page at most)
constexpr int kRegMaxRows = 8;     // query rows per KV head the loop takes (one n8 tile)

// One warp's loads of a 16-key group (64 registers): k[h][q] = chunk t4 + 4 q of key
// row g + 8 h; v[i][c] = chunk g + 8 c of key row 2 t4 + (i & 1) + 8 (i >> 1).
struct RegGroup {
  uint4 k[2][4];
  uint4 v[4][2];
};

// One warp's running state: o[mt][c] = O^T fragment c of m-tile mt (c = e: output dim
// 8 g + mt of query row 2 t4 + e; c = 2 + e: dim 64 + 8 g + mt), m / l the running max
// (log2 units) and this lane's part of the sum of query row 2 t4 + e.
template <int H>
struct RegLoopAcc {
  float o[H / 16][4];
  float m[2], l[2];
};

// What the loop reads of the kernel's prologue.
struct RegLoopArgs {
  const void *kcache, *vcache;  // this KV head's K / V (head offset applied)
  const int32_t* pages_s;       // the chunk's page ids (paged)
  const void* q_s;              // query rows [16][pitch] in shared memory (zero past the last)
  int pitch;                    // q_s row pitch, elements
  int b, page0, j_begin, j_end, lo_keys, len, T, G, r0, rows_here;
};

template <int H, typename Elem>
__device__ __forceinline__ void reg_loop(const AttnParams& p, const RegLoopArgs& a, RegLoopAcc<H>& acc) {
  static_assert(H == 128, "the register loop's fragment mapping is written for H = 128");
  constexpr int kW = kRegWarps, kG = kRegGroupKeys;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t4 = lane % 4;
  const bool paged = p.block_table != nullptr;
  const int ps = p.page_size;
  const int64_t krs = p.k_row_stride, vrs = p.v_row_stride;
  const Elem* kcache = static_cast<const Elem*>(a.kcache);
  const Elem* vcache = static_cast<const Elem*>(a.vcache);
  // This lane's element offsets inside a group: K row g, chunk t4; V row 2 t4, chunk g.
  const int64_t k_lane = g * krs + t4 * 8, v_lane = 2 * t4 * vrs + g * 8;

#pragma unroll
  for (int mt = 0; mt < H / 16; ++mt)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc.o[mt][c] = 0.f;
#pragma unroll
  for (int e = 0; e < 2; ++e) acc.m[e] = -INFINITY, acc.l[e] = 0.f;

  // Q^T fragments: chunks t4 + 4 q of query row g.
  uint4 qv[H / 32];
#pragma unroll
  for (int q = 0; q < H / 32; ++q)
    qv[q] = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(a.q_s) + g * a.pitch + (t4 + 4 * q) * 8);
  int pos[2];
  bool row_ok[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * t4 + e;
    row_ok[e] = r < a.rows_here;
    pos[e] = a.len - a.T + (a.r0 + r) / a.G;
  }
  const int wl = p.window_left;
  const float qk_scale = p.scale * kLog2e;
  const float cap = p.softcap;

  // Issues the loads of the group starting at key jg (a multiple of 16). Rows at or
  // past j_end are not read (zeros); V rows before lo_keys are zeroed too (their
  // P is 0, and a zero row keeps a never-written one's NaN out of O).
  auto load = [&](RegGroup& r, int jg) {
    const Elem *kb, *vb;
    if (paged) {
      const int rel = jg / ps;
      const int64_t page = a.pages_s[rel - a.page0];
      const int in = jg - rel * ps;
      kb = kcache + page * p.k_batch_stride + in * krs;
      vb = vcache + page * p.v_batch_stride + in * vrs;
    } else {
      kb = kcache + a.b * p.k_batch_stride + jg * krs;
      vb = vcache + a.b * p.v_batch_stride + jg * vrs;
    }
    kb += k_lane;
    vb += v_lane;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool ok = jg + g + 8 * h < a.j_end;
#pragma unroll
      for (int q = 0; q < H / 32; ++q) r.k[h][q] = ptx::ldg_stream_16<JAXATTN_EXP_DECODE_REG_L2_128 != 0>(kb + 8 * h * krs + 32 * q, ok);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = (i & 1) + 8 * (i >> 1);  // + 2 t4 (in v_lane)
      const int j = jg + 2 * t4 + row;
      const bool ok = j >= a.lo_keys && j < a.j_end;
#pragma unroll
      for (int c = 0; c < 2; ++c) r.v[i][c] = ptx::ldg_stream_16(vb + row * vrs + 64 * c, ok);
    }
  };

  auto word = [](const uint4& x, int w) { return w == 0 ? x.x : w == 1 ? x.y : w == 2 ? x.z : x.w; };

  // The math of the group at key jg (its loads landed in r).
  auto compute = [&](const RegGroup& r, int jg) {
#ifndef JAXATTN_EXP_DECODE_NO_MATH
    float s[4] = {0.f, 0.f, 0.f, 0.f};  // S^T: [key g][rows 2 t4, 2 t4 + 1], [key g + 8][...]
#pragma unroll
    for (int kk = 0; kk < H / 16; ++kk) {
      const int c = kk / 2, w = 2 * (kk % 2);
      const uint32_t af[4] = {word(r.k[0][c], w), word(r.k[1][c], w), word(r.k[0][c], w + 1),
                              word(r.k[1][c], w + 1)};
      ptx::mma_16816<Elem>(s, af, word(qv[c], w), word(qv[c], w + 1));
    }
    uint32_t pt[2];  // P^T (keys 2 t4, 2 t4 + 1 | 2 t4 + 8, 2 t4 + 9 of query row g)
    swap_softmax<Elem>(s, acc.m, acc.l, row_ok, pos, jg, a.j_end, wl, qk_scale, cap, g,
                       [&](int e, float alpha) {
#pragma unroll
                         for (int mt = 0; mt < H / 16; ++mt) {
                           acc.o[mt][e] *= alpha;
                           acc.o[mt][2 + e] *= alpha;
                         }
                       },
                       pt);
    // V^T as the A operand: element mt of chunk g (rows g) or g + 8 (rows g + 8) of
    // key rows 2 t4 (low half) and 2 t4 + 1 (high half), then 2 t4 + 8 and 2 t4 + 9.
#pragma unroll
    for (int mt = 0; mt < H / 16; ++mt) {
      const int w = mt / 2;
      const uint32_t sel = mt % 2 ? 0x7632u : 0x5410u;
      const uint32_t af[4] = {__byte_perm(word(r.v[0][0], w), word(r.v[1][0], w), sel),
                              __byte_perm(word(r.v[0][1], w), word(r.v[1][1], w), sel),
                              __byte_perm(word(r.v[2][0], w), word(r.v[3][0], w), sel),
                              __byte_perm(word(r.v[2][1], w), word(r.v[3][1], w), sel)};
      ptx::mma_16816<Elem>(acc.o[mt], af, pt[0], pt[1]);
    }
#else
    // Timing probe (wrong results): the loads are consumed by a fold, nothing else.
    (void)jg;
    uint32_t f = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < H / 32; ++q) f ^= r.k[h][q].x ^ r.k[h][q].y ^ r.k[h][q].z ^ r.k[h][q].w;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int c = 0; c < 2; ++c) f ^= r.v[i][c].x ^ r.v[i][c].y ^ r.v[i][c].z ^ r.v[i][c].w;
    acc.o[0][0] += __uint_as_float(f & 0x3f800000u);
#endif
  };

  // Groups gi = warp + kW i of the chunk, two in flight: A holds the even steps,
  // B the odd ones; a buffer is refilled right after its group's math.
  const int groups = (a.j_end - a.j_begin + kG - 1) / kG;
  RegGroup ra, rb;
  int gi = warp;
  if (gi < groups) load(ra, a.j_begin + gi * kG);
  if (gi + kW < groups) load(rb, a.j_begin + (gi + kW) * kG);
  for (; gi < groups; gi += 2 * kW) {
    compute(ra, a.j_begin + gi * kG);
    if (gi + 2 * kW < groups) load(ra, a.j_begin + (gi + 2 * kW) * kG);
    if (gi + kW >= groups) break;
    compute(rb, a.j_begin + (gi + kW) * kG);
    if (gi + 3 * kW < groups) load(rb, a.j_begin + (gi + 3 * kW) * kG);
  }
}

// plan.warm (kV2WarmShift; with plan.pdl, before the CTA waits for the previous grid):
// each warp prefetches into L2 the K and V lines of its first `groups` 16-key groups of
// the chunk's keys [j_begin, j_end) (the groups reg_loop loads first: warp, warp +
// kRegWarps, ...), so the DRAM works for this grid while the previous grid's last CTAs
// finish, and the loop's first loads find their lines in L2 instead of paying the DRAM
// latency after the wait.
// The caller (decode_mma_kernel) takes j_begin / j_end from the row's length read then,
// and this reads the page ids, before the previous grid has completed, which may still
// write them: they only pick which lines are fetched, every one inside the caches
// (lengths and page ids clamped as the kernel clamps them), and they are read through L2
// only (ld.global.cg), so no line of them stays in L1 for the kernel's own reads after
// the wait. A prefetched K / V line is never stale either: L2 is where every write of
// the previous grid lands, and the loop's loads (after the wait, with no L1 allocation)
// read from it. (tests/cuda_emu/reg_loop_check.cc checks the lines it fetches.)
template <int H, typename Elem>
__device__ __forceinline__ void reg_loop_warm_l2(const AttnParams& p, int b, int kh, int j_begin, int j_end,
                                                 int groups) {
  static_assert(H * int(sizeof(Elem)) == 256, "a key row is two 128-byte lines");
  constexpr int kW = kRegWarps, kG = kRegGroupKeys;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int r = lane / 2, half = lane % 2;  // key row of the group, 128-byte line of the row
  const Elem* kc = static_cast<const Elem*>(p.k) + kh * p.k_head_stride + half * (H / 2);
  const Elem* vc = static_cast<const Elem*>(p.v) + kh * p.v_head_stride + half * (H / 2);
  for (int i = 0; i < groups; ++i) {
    const int j = j_begin + (warp + kW * i) * kG + r;
    if (j >= j_end) break;
    int64_t row = j, page = b;
    if (p.block_table != nullptr) {
      const int rel = j / p.page_size;
      page = min(max(ptx::ldg_l2_only_s32(p.block_table + int64_t(b) * p.max_pages + min(rel, p.max_pages - 1)), 0),
                 p.num_pages - 1);
      row = j - rel * p.page_size;
    }
    ptx::prefetch_l2(kc + page * p.k_batch_stride + row * p.k_row_stride);
    ptx::prefetch_l2(vc + page * p.v_batch_stride + row * p.v_row_stride);
  }
}

}  // namespace jaxattn::cuda::decode
