// build_doc_tiles: the document tiles of a packed forward (common/doc_tiles.h), one
// CTA per batch row, on the forward's stream just before it (no host round trip).
//
// Per row: (1) whether the row qualifies (query ids == key ids, each id one run), in
// one coalesced pass that also keeps a bit mask of the document starts in shared
// memory; (2) each thread walks its own chunk of positions in the mask, carrying the
// document start from the chunks before it (a block-wide max scan of the last start
// in each chunk), and counts the tile starts (kDocTileRows * k after a document
// start); (3) a sum scan places them, in position order, in shared memory; (4) each
// tile's end is the next tile's start, its document's end the end of the last tile
// with the same start (a binary search: starts never decrease); (5) a counting sort
// by work writes them longest first: the forward's query tiles by their key blocks
// (causal: from the document's start to the tile's end; else the whole document), the
// backward's key tiles (key_tiles) by the query rows that see them (causal: from the
// tile's start to the document's end; else the whole document).
#include <climits>

#include "sm90/doc_tiles.h"

namespace jaxattn::sm90 {
namespace {

constexpr int kThreads = 1024;

// Exclusive block-wide scan (kMax: running max, else running sum) of one int per
// thread; `total` gets the scan of all. scratch: 32 ints of shared memory.
template <bool kMax>
__device__ int block_exclusive_scan(int x, int* scratch, int& total) {
  static_assert(kThreads == 32 * 32, "one warp scans the warps' totals");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int identity = kMax ? INT_MIN : 0;
  auto op = [](int a, int b) { return kMax ? max(a, b) : a + b; };
  int inc = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc = op(inc, y);
  }
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int w = scratch[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w = op(w, y);
    }
    scratch[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  int excl = __shfl_up_sync(0xffffffffu, inc, 1);
  if (lane == 0) excl = identity;
  const int r = op(warp > 0 ? scratch[warp - 1] : identity, excl);
  total = scratch[31];
  __syncthreads();  // (scratch is reused by the next scan)
  return r;
}

// The row's ids are read once, coalesced; the passes after that walk a bit mask of
// the document starts in shared memory (after the records and counters).
__global__ void __launch_bounds__(kThreads) build_doc_tiles_kernel(const int32_t* q_seg, const int32_t* kv_seg,
                                                                   int T, bool causal, bool key_tiles,
                                                                   int32_t* doc_tiles) {
  extern __shared__ int4 list[];  // [cap] records in position order, [m + 1] counters, [T / 32] start bits
  __shared__ int scratch[32];
  // A record's work in kDocTileRows blocks (its counting-sort bucket, 0 .. m).
  auto work = [&](int4 r) {
    const int rows = !causal ? r.w - r.z : key_tiles ? r.w - r.x : r.y - r.z;
    return (rows + cuda::kDocTileRows - 1) / cuda::kDocTileRows;
  };
  const int cap = cuda::doc_tile_capacity(T);
  const int m = (T + cuda::kDocTileRows - 1) / cuda::kDocTileRows;  // the most key blocks of a tile
  int* hist = reinterpret_cast<int*>(list + cap);
  uint32_t* starts = reinterpret_cast<uint32_t*>(hist + m + 1);  // bit i % 32 of word i / 32: a document starts at i
  const int b = blockIdx.x, tid = threadIdx.x, lane = tid % 32;
  const int32_t* ids = q_seg + int64_t(b) * T;
  const int32_t* kids = kv_seg + int64_t(b) * T;
  int4* out = reinterpret_cast<int4*>(doc_tiles) + int64_t(b) * (cap + 1);
  int unused;

  // (1) Qualify: query ids == key ids, and every id one run of the row (documents
  // back to back): ids decrease nowhere but at the last run's start, and the last
  // run's id (padding, typically) occurs nowhere before it.
  const int pad = __ldg(ids + T - 1);
  bool ok = true;
  int last = -1, first_pad = INT_MAX, dec_min = INT_MAX, dec_max = -1;
  // kUnroll strided positions per thread per round, their loads issued together (one
  // round trip per round, not per position); whole warps (the ballot).
  constexpr int kUnroll = 8;
  for (int base = tid - lane; base < T; base += kThreads * kUnroll) {
    int id[kUnroll], prev[kUnroll], kid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + lane;
      id[u] = i < T ? __ldg(ids + i) : 0;
      prev[u] = i < T && i > 0 ? __ldg(ids + i - 1) : 0;
      kid[u] = i < T ? __ldg(kids + i) : 0;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i0 = base + u * kThreads, i = i0 + lane;
      if (i0 >= T) break;  // (warp-uniform)
      const bool valid = i < T;
      ok &= !valid || id[u] == kid[u];
      const bool start = valid && (i == 0 || id[u] != prev[u]);
      if (start) last = i;
      if (valid && i > 0 && id[u] < prev[u]) dec_min = min(dec_min, i), dec_max = max(dec_max, i);
      if (valid && id[u] == pad) first_pad = min(first_pad, i);
      const uint32_t word = __ballot_sync(0xffffffffu, start);
      if (lane == 0) starts[i0 / 32] = word;
    }
  }
  int last_run, neg;
  block_exclusive_scan<true>(last, scratch, last_run);
  block_exclusive_scan<true>(-first_pad, scratch, neg);
  first_pad = -neg;
  block_exclusive_scan<true>(-dec_min, scratch, neg);
  dec_min = -neg;
  block_exclusive_scan<true>(dec_max, scratch, dec_max);  // (its barriers also publish `starts`)
  ok = __syncthreads_and(ok) && first_pad >= last_run && (dec_max < 0 || (dec_min == last_run && dec_max == last_run));
  if (!ok) {  // (uniform)
    if (tid == 0) out[0] = make_int4(-1, 0, 0, 0);
    return;
  }
  // (2) The tile starts (kDocTileRows apart from each document start) in each
  // thread's chunk of whole words, the document start carried in from before it.
  const int words = (T + 31) / 32, per_thread = (words + kThreads - 1) / kThreads;
  const int w0 = min(words, tid * per_thread), w1 = min(words, w0 + per_thread);
  const int c0 = 32 * w0, c1 = min(T, 32 * w1);
  last = -1;
  for (int w = w1 - 1; w >= w0; --w) {
    if (starts[w]) {
      last = 32 * w + 31 - __clz(starts[w]);
      break;
    }
  }
  const int carry = block_exclusive_scan<true>(last, scratch, unused);  // (thread 0's chunk starts one at 0)
  auto starts_doc = [&](int i) { return (starts[i / 32] >> (i % 32)) & 1u; };
  int n = 0;
  for (int i = c0, d = carry; i < c1; ++i) {
    if (starts_doc(i)) d = i;
    n += (i - d) % cuda::kDocTileRows == 0;
  }
  // (3) Place the tile starts.
  int total;
  int at = block_exclusive_scan<false>(n, scratch, total);
  if (total > cap) {  // (uniform) documents too short for the capacity
    if (tid == 0) out[0] = make_int4(-1, 0, 0, 0);
    return;
  }
  for (int i = c0, d = carry; i < c1; ++i) {
    if (starts_doc(i)) d = i;
    if ((i - d) % cuda::kDocTileRows == 0) list[at++] = make_int4(i, 0, d, 0);
  }
  for (int k = tid; k <= m; k += kThreads) hist[k] = 0;
  __syncthreads();
  // (4) Ends, document ends, key blocks.
  for (int k = tid; k < total; k += kThreads) {
    const int ds = list[k].z;
    int lo = k, hi = total - 1;  // the document's last tile
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (list[mid].z == ds) lo = mid;
      else hi = mid - 1;
    }
    const int end = k + 1 < total ? list[k + 1].x : T;
    const int doc_end = lo + 1 < total ? list[lo + 1].x : T;
    list[k].y = end;  // (other threads read only .x and .z)
    list[k].w = doc_end;
    atomicAdd(&hist[work(make_int4(list[k].x, end, ds, doc_end))], 1);
  }
  __syncthreads();
  // (5) Most key blocks first: bucket j's first slot is the count of tiles with more.
  const int per = (m + kThreads) / kThreads;  // buckets m, m - 1, ..., 0 in runs of `per`
  int sum = 0;
  for (int r = 0; r < per; ++r) {
    const int j = m - (tid * per + r);
    if (j >= 0) sum += hist[j];
  }
  int first = block_exclusive_scan<false>(sum, scratch, unused);
  for (int r = 0; r < per; ++r) {
    const int j = m - (tid * per + r);
    if (j >= 0) {
      const int c = hist[j];
      hist[j] = first;
      first += c;
    }
  }
  __syncthreads();
  for (int k = tid; k < total; k += kThreads) {
    const int4 rec = list[k];
    out[1 + atomicAdd(&hist[work(rec)], 1)] = rec;
  }
  if (tid == 0) out[0] = make_int4(total, 0, 0, 0);
}

}  // namespace

cudaError_t build_doc_tiles(const AttnParams& p, cudaStream_t stream, bool key_tiles) {
  const int T = p.seqlen_q;
  const int cap = cuda::doc_tile_capacity(T);
  const int m = (T + cuda::kDocTileRows - 1) / cuda::kDocTileRows;
  const size_t smem = size_t(cap) * sizeof(int4) + size_t(m + 1) * sizeof(int) + size_t((T + 31) / 32) * 4;
  cudaError_t e = cudaFuncSetAttribute(build_doc_tiles_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  build_doc_tiles_kernel<<<p.batch, kThreads, smem, stream>>>(p.q_segment_ids, p.kv_segment_ids, T, p.is_causal,
                                                              key_tiles, p.doc_tiles);
  return cudaGetLastError();
}

}  // namespace jaxattn::sm90
