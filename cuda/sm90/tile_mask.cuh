// Masks of the Hopper kernels (windows, lengths, segment ids, soft cap; the
// dense bias / mask stay on the portable kernels): the key / query block range
// of a CTA, and the per-element mask of a wgmma accumulator tile. What is
// visible is decided by common/mask.cuh (MaskView); this file only maps the
// accumulator fragments to (query, key) coordinates.
//
// Fragment layout of an m64nN wgmma accumulator (per warpgroup): thread
// (warp w, lane = 4 g + t) holds rows 16 w + g (h = 0) and 16 w + g + 8 (h = 1),
// and per row the columns 8 j + 2 t + e (e = 0, 1): element acc[4 j + 2 h + e].
// The forward's tiles are (query rows) x (keys); the backward's S^T tiles are
// (keys) x (query columns).
#pragma once

#include <cstdint>

#include "common/mask.cuh"

namespace jaxattn::sm90 {

using cuda::MaskView;
using cuda::dq_adds_after;
using cuda::dq_run_last;
using cuda::dq_run_last_from;

// The blocks [first, end) of size kBlock of the range [lo, hi) ((0, 0) stays empty).
template <int kBlock>
__device__ __forceinline__ int2 blocks_of(int2 r) {
  return r.y > r.x ? make_int2(r.x / kBlock, (r.y + kBlock - 1) / kBlock) : make_int2(0, 0);
}

// A document tile's blocks of size kBlock of the range r (keys of its query rows, or
// queries of its keys) started at its document's first row or later: (first row of
// block 0, blocks); (r.x, 0) when nothing is left.
template <int kBlock>
__device__ __forceinline__ int2 blocks_from(int2 r, int doc_start) {
  const int first = max(r.x, doc_start);
  return make_int2(first, r.y > first ? (r.y - first + kBlock - 1) / kBlock : 0);
}

// Key blocks of size kBlockN that query rows [m0, m0 + kBlockM) of a CTA may see;
// with segment ids, only keys whose ids fall in the rows' id range. Every thread of
// the CTA calls it (block-wide scans; red: 2 ints of shared memory).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int2 cta_key_blocks(const MaskView& m, int m0, int* red) {
  return blocks_of<kBlockN>(cuda::cta_segment_span(m.key_range(m0, m0 + kBlockM), m.q_seg, m.q_seg_ranges, m0,
                                                   min(m0 + kBlockM, m.q_len), m.kv_seg, m.kv_seg_ranges, red));
}
// Query blocks of size kBlockM that keys [n0, n0 + kBlockN) of a CTA may be seen by
// (the backward's range; same contract).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int2 cta_query_blocks(const MaskView& m, int n0, int* red) {
  return blocks_of<kBlockM>(cuda::cta_segment_span(m.query_range(n0, n0 + kBlockN), m.kv_seg, m.kv_seg_ranges, n0,
                                                   min(n0 + kBlockN, m.kv_len), m.q_seg, m.q_seg_ranges, red));
}

// Which of a thread's accumulator elements pair equal segment ids: bit i of
// the kRegs-element tile is acc[i] = (row h, column 8 j + 2 t + e), i = 4 j + 2 h + e.
template <int kRegs>
struct SegmentBits {
  static constexpr int kCols = 2 * kRegs, kPerLane = kCols >= 32 ? kCols / 32 : 1;
  uint32_t bits[(kRegs + 31) / 32];

  // The block's column ids as the fast path reads them: kPerLane coalesced loads per
  // lane (column col0 + 32 k + lane), -1 past `limit`.
  __device__ __forceinline__ static void fetch_cols(int (&cols)[kPerLane], const int32_t* seg, int col0, int limit) {
    static_assert(kCols % 32 == 0, "whole warps of columns");
    const int lane = int(threadIdx.x % 32);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int c = col0 + 32 * k + lane;
      cols[k] = c < limit ? __ldg(seg + c) : -1;
    }
  }
  // The warp's row-id range (the same for every block of a tile).
  __device__ __forceinline__ static int2 row_range(const int (&row_ids)[2]) {
    return make_int2(__reduce_min_sync(0xffffffffu, min(row_ids[0], row_ids[1])),
                     __reduce_max_sync(0xffffffffu, max(row_ids[0], row_ids[1])));
  }

  // Fast path (warp-uniform): when the tile's 2 kRegs columns carry one id and so do
  // the warp's rows (a block inside one packed document), the bits follow from one
  // compare and warp reductions. Otherwise (a block that straddles documents) each
  // column's id comes from the lane that fetched it (cols: column 32 k + lane) by a
  // warp shuffle: no memory latency in either case. `cols`: fetch_cols of the block
  // (fetched a block ahead by SegmentAhead); `rows`: row_range.
  __device__ __forceinline__ void compare(const int (&row_ids)[2], int2 rows, const int (&cols)[kPerLane], int t) {
    int cmin = cols[0], cmax = cols[0];
#pragma unroll
    for (int k = 1; k < kPerLane; ++k) cmin = min(cmin, cols[k]), cmax = max(cmax, cols[k]);
    cmin = __reduce_min_sync(0xffffffffu, cmin);
    cmax = __reduce_max_sync(0xffffffffu, cmax);
    if (cmin == cmax && rows.x == rows.y) {
      const bool match = cmin == rows.x;
#pragma unroll
      for (int w = 0; w < (kRegs + 31) / 32; ++w)
        bits[w] = match ? (kRegs - 32 * w >= 32 ? 0xffffffffu : (1u << (kRegs - 32 * w)) - 1u) : 0u;
      return;
    }
#pragma unroll
    for (int w = 0; w < (kRegs + 31) / 32; ++w) bits[w] = 0;
#pragma unroll
    for (int j = 0; j < kRegs / 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // (column 8 j + 2 t + e: cols[j / 4] of lane 8 (j % 4) + 2 t + e)
        const int id = __shfl_sync(0xffffffffu, cols[j / 4], 8 * (j % 4) + 2 * t + e);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = 4 * j + 2 * h + e;
          if (row_ids[h] == id) bits[i / 32] |= 1u << (i % 32);
        }
      }
  }
  __device__ __forceinline__ bool same(int i) const { return (bits[i / 32] >> (i % 32)) & 1u; }
};

// SegmentBits fed one block ahead, the rows' id range reduced once per tile: the
// compare of block n waits on nothing, and the loads of block n + 1 have a whole
// block to land (session 7: loads issued just before the S wgmma wait left the
// reductions after them waiting out the L2 latency; fetching ahead cut the packed
// 1000-token-document forward 10%).
template <int kRegs>
struct SegmentAhead {
  using Bits = SegmentBits<kRegs>;
  int cols[Bits::kPerLane];
  int2 rows;

  __device__ __forceinline__ void start(const int (&row_ids)[2], const int32_t* seg, int first_col0, int limit) {
    rows = Bits::row_range(row_ids);
    Bits::fetch_cols(cols, seg, first_col0, limit);
  }
  // bits of this block (fetched by the previous call or start), then the fetch of
  // the block at next_col0 (< 0: none).
  __device__ __forceinline__ void step(Bits& bits, const int (&row_ids)[2], const int32_t* seg, int next_col0, int t,
                                       int limit) {
    int cur[Bits::kPerLane];
#pragma unroll
    for (int k = 0; k < Bits::kPerLane; ++k) cur[k] = cols[k];
    if (next_col0 >= 0) Bits::fetch_cols(cols, seg, next_col0, limit);
    bits.compare(row_ids, rows, cur, t);
  }
};

// The ids of this thread's two accumulator rows (row0 and row0 + 8), -1 past `limit`.
__device__ __forceinline__ void load_row_ids(int (&ids)[2], const int32_t* seg, int row0, int limit) {
#pragma unroll
  for (int h = 0; h < 2; ++h) ids[h] = row0 + 8 * h < limit ? __ldg(seg + row0 + 8 * h) : -1;
}

// Soft cap of a raw accumulator tile: x <- cap * tanh(scale * x / cap).
template <int kRegs>
__device__ __forceinline__ void softcap_tile(float (&acc)[kRegs], float scale, float cap) {
  const float inv_cap = 1.f / cap;
#pragma unroll
  for (int i = 0; i < kRegs; ++i) acc[i] = cuda::softcap_forward_fast(acc[i] * scale, cap, inv_cap);
}

// Sets to -inf the elements whose (query, key) pair the mask hides. kRowsAreQueries:
// the forward's layout (rows = queries at row0 + 8 h, columns = keys from col0);
// otherwise the backward's transposed S^T (rows = keys, columns = queries).
// segments: also hide the pairs whose segment ids differ (seg: the matches).
template <bool kRowsAreQueries, int kRegs>
__device__ __forceinline__ void mask_tile(float (&acc)[kRegs], const MaskView& m, int row0, int col0, int t,
                                          bool segments, const SegmentBits<kRegs>& seg) {
  int2 cols[2];  // each row's visible columns [x, y]
#pragma unroll
  for (int h = 0; h < 2; ++h) cols[h] = kRowsAreQueries ? m.keys_of_query(row0 + 8 * h) : m.queries_of_key(row0 + 8 * h);
#pragma unroll
  for (int j = 0; j < kRegs / 4; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 4 * j + 2 * h + e;
        const int c = col0 + 8 * j + 2 * t + e;
        bool ok = c >= cols[h].x && c <= cols[h].y;
        if (segments) ok = ok && seg.same(i);
        if (!ok) acc[i] = -INFINITY;
      }
}

// Masks a warp's accumulator tile where it needs it (warp-uniform decisions): not at
// all when the block cuts none of rows [row_first, row_first + kRows)
// (MaskView::tile_partial; kRows = 16: the warp's own rows, 64: its warpgroup's) and
// every pair of the warp shares a segment id; with the window / length / causal
// bounds only when the ids all match (a block inside one packed document: the
// segment test per element would change nothing); with both otherwise.
// kSpecialize: two inlined copies of mask_tile, one without the segment test (the
// forward); otherwise one copy with the test behind a uniform predicate (the
// backward at H=128 spills 8 bytes with two).
template <bool kRowsAreQueries, int kRows, bool kSpecialize, int kRegs>
__device__ __forceinline__ void mask_tile_where_needed(float (&acc)[kRegs], const MaskView& m, int row_first,
                                                       int row0, int col0, int t, bool segments,
                                                       const SegmentBits<kRegs>& seg) {
  const int c1 = col0 + 2 * kRegs;  // (kRegs / 4 column groups of 8)
  const bool partial = kRowsAreQueries ? m.tile_partial(row_first, row_first + kRows, col0, c1)
                                       : m.tile_partial(col0, c1, row_first, row_first + kRows);
  bool all_same = true;
  if (segments) {
#pragma unroll
    for (int w = 0; w < (kRegs + 31) / 32; ++w)
      all_same = all_same && seg.bits[w] == (kRegs - 32 * w >= 32 ? 0xffffffffu : (1u << (kRegs - 32 * w)) - 1u);
  }
  const bool cut_ids = __any_sync(0xffffffffu, !all_same);
  if constexpr (kSpecialize) {
    if (cut_ids)
      mask_tile<kRowsAreQueries>(acc, m, row0, col0, t, true, seg);
    else if (__any_sync(0xffffffffu, partial))
      mask_tile<kRowsAreQueries>(acc, m, row0, col0, t, false, seg);
  } else if (cut_ids || __any_sync(0xffffffffu, partial)) {
    mask_tile<kRowsAreQueries>(acc, m, row0, col0, t, cut_ids, seg);
  }
}

}  // namespace jaxattn::sm90
