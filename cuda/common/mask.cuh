// Which (query, key) pairs a masked attention call lets through, for the CUDA
// kernels of every architecture: causal + local window + per-batch lengths in
// closed form (tile ranges and a per-element predicate), document segments as
// per-warp reads of the ids' (min, max) per-64 tables, or CTA-wide scans of the
// ids without them (tiles whose ids cannot match are never visited), the
// dense bias and mask read in place through their broadcast strides, and the
// logit soft cap. Layout-agnostic: a kernel maps its accumulator fragments to
// (row, column) itself (sm80: sm80/softmax.cuh prescale_logits, apply_visibility).
//
// Conventions (as AttnParams): query i sees key j iff i < q_len, j < kv_len,
// (!causal or j <= i), (left < 0 or i - j <= left), (right < 0 or j - i <=
// right), with segment ids q_seg[i] == kv_seg[j], and with a dense mask
// mask[n, i, j]. Logits are softcap(scale q.k) + bias[n, i, j]. An empty range
// is (0, 0).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace jaxattn::cuda {

// Where element (head n, query i, key j) of a dense bias / mask (dims [E,
// Bb, Nb, Tb, Sb] broadcast against [batch, N, T, S], AttnParams) sits for
// one batch row: base + n * head + i * row + j * col (0 on broadcast dims).
struct DenseIndex {
  int64_t base, head;
  int row, col;

  __device__ static DenseIndex of(const int (&dims)[5], int batch, int b) {
    const int inner = batch / dims[0];
    const int64_t bb = int64_t(b / inner) * dims[1] + (dims[1] > 1 ? b % inner : 0);
    DenseIndex d;
    d.col = dims[4] > 1 ? 1 : 0;
    d.row = dims[3] > 1 ? dims[4] : 0;
    d.head = dims[2] > 1 ? int64_t(dims[3]) * dims[4] : 0;
    d.base = bb * dims[2] * int64_t(dims[3]) * dims[4];
    return d;
  }
  __device__ int64_t at(int n, int i, int j) const { return base + n * head + int64_t(i) * row + int64_t(j) * col; }
};

// The mask of one batch row b of a call (trivial type: kernels may keep it
// in shared memory; MaskView::of fills every field).
struct MaskView {
  int q_len, kv_len;  // valid queries / keys (lengths clamped to [0, T] / [0, S])
  int left, right;    // local window, -1 = unlimited
  bool causal;
  const int32_t* q_seg;   // segment ids of row b ([T]), or null
  const int32_t* kv_seg;  // [S], or null
  const int2* q_seg_ranges;   // (min, max) id per kSegmentBlock queries of row b, or null
  const int2* kv_seg_ranges;  // per kSegmentBlock keys, or null
  const float* bias;      // dense bias (f32, AttnParams::bias), or null
  DenseIndex bias_at;
  const bool* dense;      // dense mask (true = attend, AttnParams::mask), or null
  DenseIndex dense_at;

  // The mask of batch row b of p.
  __device__ static MaskView of(const AttnParams& p, int b) {
    MaskView m;
    const int T = p.seqlen_q, S = p.seqlen_k;
    m.q_len = p.q_lengths ? min(max(p.q_lengths[b], 0), T) : T;
    m.kv_len = p.kv_lengths ? min(max(p.kv_lengths[b], 0), S) : S;
    m.left = p.window_left;
    m.right = p.window_right;
    m.causal = p.is_causal;
    m.q_seg = p.q_segment_ids ? p.q_segment_ids + int64_t(b) * T : nullptr;
    m.kv_seg = p.q_segment_ids ? p.kv_segment_ids + int64_t(b) * S : nullptr;
    const bool tables = p.q_segment_ids && p.q_segment_ranges && p.kv_segment_ranges;
    const int tq = (T + kSegmentBlock - 1) / kSegmentBlock, ts = (S + kSegmentBlock - 1) / kSegmentBlock;
    m.q_seg_ranges = tables ? reinterpret_cast<const int2*>(p.q_segment_ranges) + int64_t(b) * tq : nullptr;
    m.kv_seg_ranges = tables ? reinterpret_cast<const int2*>(p.kv_segment_ranges) + int64_t(b) * ts : nullptr;
    m.bias = p.bias;
    m.bias_at = DenseIndex::of(p.bias_dims, p.batch, b);
    m.dense = p.mask;
    m.dense_at = DenseIndex::of(p.mask_dims, p.batch, b);
    return m;
  }

  // The bias of (head n, query i, key j), 0 outside the valid lengths (where
  // the pair is invisible anyway) or without a bias.
  __device__ float bias_of(int n, int i, int j) const {
    return bias && i < q_len && j < kv_len ? __ldg(bias + bias_at.at(n, i, j)) : 0.f;
  }
  // Row i of head n of the bias (element j at + j * bias_at.col), or null
  // outside the valid queries; bias_col: column j (query i at + i * bias_at.row).
  __device__ const float* bias_row(int n, int i) const {
    return i < q_len ? bias + bias_at.at(n, i, 0) : nullptr;
  }
  __device__ const float* bias_col(int n, int j) const {
    return j < kv_len ? bias + bias_at.at(n, 0, j) : nullptr;
  }
  // Whether the dense mask lets (head n, query i, key j) through (a valid pair).
  __device__ bool dense_ok(int n, int i, int j) const {
    return !dense || (i < q_len && j < kv_len && dense[dense_at.at(n, i, j)]);
  }

  // The view of a document tile (common/doc_tiles.h): every pair it visits shares one
  // segment id, so no ids; keys end at kv_end and queries at q_end (the document's end;
  // the forward passes q_len, its rows lying inside the document already).
  __device__ MaskView in_document(int kv_end, int q_end) const {
    MaskView m = *this;
    m.q_seg = m.kv_seg = nullptr;
    m.q_seg_ranges = m.kv_seg_ranges = nullptr;
    m.q_len = min(q_len, q_end);
    m.kv_len = min(kv_len, kv_end);
    return m;
  }

  // Keys [x, y) that some query of rows [m0, m1) may see (segments aside).
  __device__ int2 key_range(int m0, int m1) const {
    const int m_end = min(m1, q_len);
    if (m0 >= m_end) return make_int2(0, 0);
    int lo = 0, hi = kv_len;
    if (left >= 0) lo = max(lo, m0 - left);
    if (causal) hi = min(hi, m_end);
    if (right >= 0) hi = int(min(int64_t(hi), int64_t(m_end) + right));
    return lo < hi ? make_int2(lo, hi) : make_int2(0, 0);
  }

  // Queries [x, y) that may see some key of [n0, n1) (segments aside): the backward's range.
  __device__ int2 query_range(int n0, int n1) const {
    const int n_end = min(n1, kv_len);
    if (n0 >= n_end) return make_int2(0, 0);
    int lo = 0, hi = q_len;
    if (causal) lo = max(lo, n0);
    if (right >= 0) lo = max(lo, n0 - right);
    if (left >= 0) hi = int(min(int64_t(hi), int64_t(n_end) + left));
    return lo < hi ? make_int2(lo, hi) : make_int2(0, 0);
  }

  // Whether the tile rows [m0, m1) x keys [n0, n1) may hold an invisible pair
  // (segments aside): false means every pair is visible, no predicate needed.
  __device__ bool tile_partial(int m0, int m1, int n0, int n1) const {
    return dense != nullptr || m1 > q_len || n1 > kv_len || (causal && n1 - 1 > m0) ||
           (left >= 0 && int64_t(m1) - 1 - n0 > left) || (right >= 0 && int64_t(n1) - 1 - m0 > right);
  }

  // The keys [x, y] (inclusive; x > y when none) query i sees, segments aside:
  // visible(i, j) == (x <= j && j <= y). Per-row bounds make a tile's predicate
  // two compares per element.
  __device__ int2 keys_of_query(int i) const {
    if (i >= q_len) return make_int2(0, -1);
    int lo = 0, hi = kv_len - 1;
    if (causal) hi = min(hi, i);
    if (left >= 0) lo = max(lo, i - left);
    if (right >= 0) hi = int(min(int64_t(hi), int64_t(i) + right));
    return make_int2(lo, hi);
  }
  // The queries [x, y] (inclusive; x > y when none) that see key j, segments aside.
  __device__ int2 queries_of_key(int j) const {
    if (j >= kv_len) return make_int2(0, -1);
    int lo = 0, hi = q_len - 1;
    if (causal) lo = max(lo, j);
    if (right >= 0) lo = max(lo, j - right);
    if (left >= 0) hi = int(min(int64_t(hi), int64_t(j) + left));
    return make_int2(lo, hi);
  }

  // Whether query i sees key j (segments aside; the caller compares the ids).
  __device__ bool visible(int i, int j) const {
    return i < q_len && j < kv_len && (!causal || j <= i) && (left < 0 || i - j <= left) &&
           (right < 0 || j - i <= right);
  }
};

// min / max of ids[lo, hi) over the whole CTA (every thread calls it; red: 2
// ints of shared memory). (INT_MAX, INT_MIN) when the range is empty.
__device__ inline int2 cta_id_range(const int32_t* ids, int lo, int hi, int* red) {
  int mn = 0x7fffffff, mx = int(0x80000000);
  for (int i = lo + int(threadIdx.x); i < hi; i += blockDim.x) {
    const int id = __ldg(ids + i);
    mn = min(mn, id);
    mx = max(mx, id);
  }
  mn = __reduce_min_sync(0xffffffffu, mn);
  mx = __reduce_max_sync(0xffffffffu, mx);
  if (threadIdx.x == 0) red[0] = 0x7fffffff, red[1] = int(0x80000000);
  __syncthreads();
  if (threadIdx.x % 32 == 0) atomicMin(red, mn), atomicMax(red + 1, mx);
  __syncthreads();
  const int2 r = make_int2(red[0], red[1]);
  __syncthreads();  // (red may be reused at once)
  return r;
}

// The narrowest [x, y) within [lo, hi) holding every index i with vmin <=
// ids[i] <= vmax, over the whole CTA (every thread calls it; red: 2 ints of
// shared memory); (0, 0) when there is none. Exact for any ids; with sorted
// (packed) ids nothing outside it can match and nothing inside is skipped.
// The scan may read all S ids of a row: its latency, not its bandwidth, is what
// costs, so each thread keeps kUnroll 16-byte loads (4 ids each) in flight; the
// < 4 ids before / after the 16-byte-aligned middle are read one by one.
__device__ inline int2 cta_id_span(const int32_t* ids, int lo, int hi, int vmin, int vmax, int* red) {
  constexpr int kUnroll = 4;
  int first = 0x7fffffff, last = -1;
  auto take = [&](int i, int id) {
    if (id >= vmin && id <= vmax) {
      first = min(first, i);
      last = max(last, i);
    }
  };
  if (vmin <= vmax && lo < hi) {
    const int mis = int((reinterpret_cast<uintptr_t>(ids) >> 2) & 3);  // ids + i is 16-aligned iff (i + mis) % 4 == 0
    const int a0 = min(hi, lo + ((4 - ((lo + mis) & 3)) & 3));
    const int a1 = max(a0, hi - ((hi + mis) & 3));
    const int tid = int(threadIdx.x);
    if (tid < a0 - lo) take(lo + tid, __ldg(ids + lo + tid));
    if (tid < hi - a1) take(a1 + tid, __ldg(ids + a1 + tid));
    const int4* vec = reinterpret_cast<const int4*>(ids + a0);
    const int nvec = (a1 - a0) / 4, step = int(blockDim.x);
    for (int base = tid; base < nvec; base += step * kUnroll) {
      int4 x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) x[u] = base + u * step < nvec ? __ldg(vec + base + u * step) : int4{};
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * step < nvec) {
          const int i = a0 + 4 * (base + u * step);
          take(i, x[u].x);
          take(i + 1, x[u].y);
          take(i + 2, x[u].z);
          take(i + 3, x[u].w);
        }
      }
    }
  }
  first = __reduce_min_sync(0xffffffffu, first);
  last = __reduce_max_sync(0xffffffffu, last);
  if (threadIdx.x == 0) red[0] = 0x7fffffff, red[1] = -1;
  __syncthreads();
  if (threadIdx.x % 32 == 0) atomicMin(red, first), atomicMax(red + 1, last);
  __syncthreads();
  const int f = red[0], l = red[1];
  __syncthreads();
  return l >= f ? make_int2(f, l + 1) : make_int2(0, 0);
}

// The table form of cta_segment_span (AttnParams::q_segment_ranges): [x, y) within
// [lo, hi), the blocks of kSegmentBlock other-side items whose (min, max) id range
// meets the id range of the own items' blocks covering [own0, own_end) (first to
// last, clipped to [lo, hi)); (0, 0) when none. A superset of the exact scan's
// answer, block-aligned (the kernels round out to their own blocks anyway; the
// per-element id compare still decides). Each warp computes it alone, with no
// shared memory and no barrier, and the own and the first 8 x 32 other entries
// load together: one L2 round trip up to S = 16K (longer rows add one per 16K).
// Every lane of the warp calls it.
__device__ inline int2 warp_table_span(const int2* own, int own0, int own_end, const int2* other, int lo, int hi) {
  constexpr int kUnroll = 8;
  const int lane = int(threadIdx.x % 32);
  const int ob0 = own0 / kSegmentBlock, ob1 = own_end > own0 ? (own_end - 1) / kSegmentBlock + 1 : ob0;
  const int b0 = lo / kSegmentBlock, b1 = hi > lo ? (hi - 1) / kSegmentBlock + 1 : b0;
  int2 mine = ob0 + lane < ob1 ? __ldg(own + ob0 + lane) : make_int2(0x7fffffff, int(0x80000000));
  int2 r[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) r[u] = b0 + lane + 32 * u < b1 ? __ldg(other + b0 + lane + 32 * u) : int2{};
  for (int b = ob0 + lane + 32; b < ob1; b += 32) {  // (own tiles of > 32 blocks only)
    const int2 x = __ldg(own + b);
    mine.x = min(mine.x, x.x);
    mine.y = max(mine.y, x.y);
  }
  const int vmin = __reduce_min_sync(0xffffffffu, mine.x), vmax = __reduce_max_sync(0xffffffffu, mine.y);
  int first = 0x7fffffff, last = -1;
  for (int base = b0 + lane;; base += 32 * kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int blk = base + 32 * u;
      if (blk < b1 && r[u].x <= vmax && r[u].y >= vmin) {
        first = min(first, blk);
        last = max(last, blk);
      }
    }
    if (base - lane + 32 * kUnroll >= b1) break;  // (warp-uniform)
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int blk = base + 32 * kUnroll + 32 * u;
      r[u] = blk < b1 ? __ldg(other + blk) : int2{};
    }
  }
  first = __reduce_min_sync(0xffffffffu, first);
  last = __reduce_max_sync(0xffffffffu, last);
  return last >= 0 && vmin <= vmax ? make_int2(max(lo, first * kSegmentBlock), min(hi, (last + 1) * kSegmentBlock))
                                   : make_int2(0, 0);
}

// `range` (indices of the other side: keys, or queries) narrowed to the items
// whose segment ids fall in the id range of the CTA's own items [own0, own_end);
// unchanged without segment ids (own_seg null). Every thread of the CTA calls it.
// With the range tables (both non-null) it reads S / kSegmentBlock id pairs per
// warp and no barrier (a superset, block-aligned: the per-element id compare
// still decides); without them it scans the ids exactly (3 barriers, up to S ids).
__device__ inline int2 cta_segment_span(int2 range, const int32_t* own_seg, const int2* own_ranges, int own0,
                                        int own_end, const int32_t* other_seg, const int2* other_ranges, int* red) {
  if (own_seg == nullptr) return range;
  if (own_ranges != nullptr && other_ranges != nullptr)
    return warp_table_span(own_ranges, own0, own_end, other_ranges, range.x, range.y);
  const int2 ids = cta_id_range(own_seg, own0, own_end, red);
  return cta_id_span(other_seg, range.x, range.y, ids.x, ids.y, red);
}

// The logit soft cap: cap * tanh(x / cap) of a scaled logit x (inv_cap = 1 / cap).
// Two forms that agree to ~1e-6 cap, so a forward on one kernel and a backward on
// another recompute the same logits: tanhf (the portable kernels; the fast form
// made ptxas spill 12 bytes in their H=96 dense backward), and
// softcap_forward_fast = cap - 2 cap / (1 + e^(2 x / cap)), one ex2.approx and one
// approximate divide (the Hopper kernels: tanhf cost their forward 2x its time at
// T=16K, this form 1.7x).
__device__ __forceinline__ float softcap_forward(float x, float cap, float inv_cap) {
  return cap * tanhf(x * inv_cap);
}
__device__ __forceinline__ float softcap_forward_fast(float x, float cap, float inv_cap) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(fminf(x * inv_cap * 2.8853900817779268f, 64.f)));  // 2 log2(e)
  return cap - __fdividef(2.f * cap, 1.f + y);
}

// d softcap(x) / dx = 1 - tanh^2(x / cap), from the capped value c = cap * tanh(x / cap).
__device__ __forceinline__ float softcap_grad(float capped, float inv_cap) {
  const float t = capped * inv_cap;
  return 1.f - t * t;
}

// ---- the deterministic backward's dQ order (sm80 dq_step, sm90 add_dq) -----------
// Key blocks (kBlockN keys) add into a query block (kBlockM rows) one after the other.
// With the closed-form ranges (MaskView::query_range, no segment spans: deterministic
// CTAs take those) the key blocks visiting a query block are one run, monotone in the
// key block (range starts and ends only grow, empty ranges come last), so its ends
// are a binary search away. The order is descending (the grids dispatch the highest
// key block first): block n adds after the blocks of its run above it, so under
// causal or window ranges each block reaches a query block after those above it
// have added (ascending, block n waited ~2n steps: docs/perf.md, sessions 23-24).
// Whether key block n is in m_block's run or below it: its range is not empty and
// starts at or before m_block (true up to the run's last block, false past it).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ bool dq_run_reaches(const MaskView& m, int n, int m_block) {
  const int2 r = m.query_range(n * kBlockN, n * kBlockN + kBlockN);
  return (r.y > r.x) & (r.x / kBlockM <= m_block);
}
// How many blocks of m_block's run come after n_block (n_blocks: the row's key
// blocks): a binary search for the run's last block.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int dq_adds_after(const MaskView& m, int n_block, int m_block, int n_blocks) {
  int lo = n_block, hi = n_blocks - 1;  // the run's last key block (n_block is in it)
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (dq_run_reaches<kBlockM, kBlockN>(m, mid, m_block)) lo = mid;
    else hi = mid - 1;
  }
  return lo - n_block;
}
// The run's last key block for m_block, advanced from `last`, its value at an earlier
// query block (it never decreases with m_block): a linear scan that, over a CTA's
// query blocks in order, costs O(1) a block (sm90 reduce_dq: the masked deterministic
// mode's cost over the default fell from ~1.74x to ~1.22x, session 26).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int dq_run_last_from(const MaskView& m, int last, int m_block, int n_blocks) {
  while (last + 1 < n_blocks && dq_run_reaches<kBlockM, kBlockN>(m, last + 1, m_block)) ++last;
  return last;
}
// The last key block that visits m_block without masks (causal: blocks start at query
// block n kBlockN / kBlockM; else every block visits every query block).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int dq_run_last(bool causal, int m_block, int n_blocks) {
  return causal ? min(n_blocks - 1, ((m_block + 1) * kBlockM - 1) / kBlockN) : n_blocks - 1;
}

}  // namespace jaxattn::cuda
