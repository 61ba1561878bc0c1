// CUDA decode kernel, version 2: split-KV attention over a KV cache built for
// read bandwidth (cp.async ring + tensor cores).
//
// decode_mma_kernel<H, kBf16>: one CTA per (row b, KV head kh, chunk of keys,
// block of 16 query rows). The query rows are the G heads sharing the KV head
// times the Tq queries (row r = i * G + g), padded to one m16 tile, so every
// K/V byte of the chunk is read once for all of them (more than 16 rows take
// several row blocks; they are adjacent in launch order, so the second reads
// the chunk from L2).
//
// Loads: tiles of kBlockN keys (K and V) stream through a kStages-deep
// shared-memory ring with 16-byte cp.async copies; every thread copies fixed
// 16-byte columns of fixed tile rows. The page ids of the chunk are read once
// into shared memory before the loop (no global dependent load in the loop).
// Two loaders (plan.hoist, plan.prefetch; kV2* in launch_decode.h): the
// session-3 one divides and reads a page id per key row; the issue-9 one reads
// a tile's (at most two) page ids once per tile, and prefetches the tiles
// plan.prefetch beyond the ring's newest one into L2.
//
// Compute: warp w takes keys [16 w, 16 w + 16) of each tile. S = Q K^T with
// mma.sync m16n8k16 (Q from shared memory, K via ldmatrix), an online softmax
// per row in log2 units (each warp its own running max and sum), then O += P V
// with P from the S accumulators in registers and V via ldmatrix.trans. At
// the end the warps are merged through shared memory (aliasing the ring).
// One chunk: o and lse are written directly; several: the normalised partial
// output and its logsumexp go to the split workspace and
// decode_combine_kernel (decode_common.cuh) merges them, or (plan.cluster,
// sm_90+) the chunks of one (row, KV head, row block) are one thread block
// cluster and merge through distributed shared memory (no combine kernel).
//
// plan.lean (issue 9, session 16): a branch-free loader whose per-tile page
// bases are computed before the wait for the tile in use. plan.pdl: launched
// with programmatic stream serialization; the kernel waits for the previous
// grid itself (griddepcontrol) before its first global read.
//
// plan.refill (issue 9): the ring stage of tile t is refilled with tile
// t + kStages right after every warp is done with tile t (a second barrier per
// tile), so kStages tiles are in flight while the CTA waits for the next one
// (kStages - 1 without it: the stage freed by tile t - 1 is refilled only
// after tile t has landed).
//
// decode_mma_kernel<128, kBf16, kLoopDrift> (kV2Drift, the H=128 default where
// launch_decode_v2.cu's drift_plan allows it; session 20): the drift loop
// (MmaLayout<128, kLoopDrift>). One CTA per SM, tiles loaded by a producer warp with
// TMA boxes onto full / empty mbarriers per stage, two groups of 4 consumer warps
// on alternate tiles and no CTA barrier in the loop; prologue, softmax
// (decode_softmax_tile.inc), warp merge and epilogue are the cp.async loop's.
//
// decode_mma_kernel<128, kBf16, kLoopRegs> (kV2Regs, session 43; the default since session 45):
// the register-streaming loop (decode_reg_loop.cuh): 8 warps, each loading its own
// 16-key groups of K and V into registers, at most 8 query rows per KV head; the
// prologue, warp merge and epilogue are the others'.
#pragma once

#include <cuda.h>  // CUtensorMap (a header type)

#include "common/hopper_ptx.h"
#include "common/ptx.h"
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define JAXATTN_DECODE_DRIFT_ON 1  // the drift loop is compiled in (sm_90 code)
#endif
#include "decode/decode_common.cuh"
#include "decode/decode_reg_loop.cuh"
#include "decode/decode_swap_softmax.cuh"
#include "sm80/smem_tile.cuh"

namespace jaxattn::cuda::decode {

// The kernel's main loops (its third template parameter): the cp.async ring, the
// drift loop (kV2Drift) and the register-streaming loop (kV2Regs, decode_reg_loop.cuh).
enum : int { kLoopCpAsync = 0, kLoopDrift = 1, kLoopRegs = 2 };

// Tile shape and ring depth per head dim: >= 2 CTAs per SM where shared
// memory allows, ~64 KB+ of loads in flight per SM. kLoop: the drift loop's or the
// register loop's layout (below; H=128 only).
template <int H, int kLoop = kLoopCpAsync>
struct MmaConfig;
template <>
struct MmaConfig<64> {
  static constexpr int kBlockN = 64, kStages = 4, kGroups = 1;
};
template <>
struct MmaConfig<128> {
  static constexpr int kBlockN = 64, kStages = 3, kGroups = 1;
};
// The drift loop's ring: 4 stages of 32 KB (H200, session 20 runs 1-4: 6 stages read
// 87 / 89 / 84% at B=64 L=4K / B=16 L=16K / B=16 L=4K, 4 stages 89 / 89 / 83-84, 2
// stages 81 / 82 / 77). JAXATTN_EXP_DECODE_DRIFT_STAGES overrides (a multiple of 2).
#ifndef JAXATTN_EXP_DECODE_DRIFT_STAGES
#define JAXATTN_EXP_DECODE_DRIFT_STAGES 4
#endif
// JAXATTN_EXP_DECODE_DRIFT_GROUPS overrides the groups (1: one group of 4 consumer warps
// on every tile; with 3 stages (~106 KB) two CTAs fit per SM, so the plan splits the
// short rows in 2-CTA clusters: session 21's prepared build).
#ifndef JAXATTN_EXP_DECODE_DRIFT_GROUPS
#define JAXATTN_EXP_DECODE_DRIFT_GROUPS 2
#endif
template <>
struct MmaConfig<128, kLoopDrift> {
  static constexpr int kBlockN = 64, kStages = JAXATTN_EXP_DECODE_DRIFT_STAGES,
                       kGroups = JAXATTN_EXP_DECODE_DRIFT_GROUPS;
};
// The register loop: kRegWarps warps of 16 keys a round, no ring (kStages unused).
template <>
struct MmaConfig<128, kLoopRegs> {
  static constexpr int kBlockN = kRegWarps * kRegGroupKeys, kStages = 1, kGroups = 1;
};
template <>
struct MmaConfig<256> {
  static constexpr int kBlockN = 32, kStages = 3, kGroups = 1;
};

template <int H, int kLoop = kLoopCpAsync>
struct MmaLayout {
  using Config = MmaConfig<H, kLoop>;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  // The drift loop (kLoopDrift; H=128, sm_90; the short rows' default since session
  // 20): one CTA per SM; kGroups groups of kBlockN / 16 consumer warps take alternate
  // tiles (group g: tiles g, g + kGroups, ...), each warp 16 keys of a tile, with no
  // CTA-wide barrier in the loop: one producer warp loads each tile with two TMA
  // boxes (128B-swizzled) onto a full mbarrier per stage and refills a stage once
  // its group's warps have arrived on its empty mbarrier. One CTA per SM whose warps
  // meet at a barrier every tile is compute-bound (session 19 runs 4-5: 56-73%);
  // here the two groups drift apart, as two CTAs per SM do.
  static constexpr int kGroups = Config::kGroups;
  static constexpr bool kDrift = kLoop == kLoopDrift;
  static constexpr bool kRegs = kLoop == kLoopRegs;  // (no ring: K / V stay in registers)
  // Each group must see its own stages in order (stage = tile % kStages): with an
  // odd ring, a group could pass a stage's parity wait one phase early.
  static_assert(kStages % kGroups == 0, "drift ring depth: a multiple of the groups");
  static constexpr int kKeyWarps = kBlockN / 16;     // warps sharing a tile (16 keys each)
  static constexpr int kWarps = kKeyWarps * kGroups;  // consumer warps
  static constexpr int kThreads = kWarps * 32 + (kDrift ? 32 : 0);  // + the producer warp
  static constexpr int kLoadThreads = kKeyWarps * 32;                // the cp.async loader's threads
  static constexpr int kRows = 16;       // query rows per CTA (one m16 tile)
  static constexpr int kPitch = H + 8;   // smem row pitch (elements): conflict-free ldmatrix
  static constexpr int kTileElems = kBlockN * kPitch;
  static constexpr int kChunksPerRow = H / 8;  // 16-byte copies per key row
  static constexpr int kRowsPerPass = kLoadThreads / kChunksPerRow;
  static constexpr int kPasses = kBlockN / kRowsPerPass;
  static_assert(kLoadThreads % kChunksPerRow == 0 && kBlockN % kRowsPerPass == 0, "loader shape");
  // The drift loop's stages: a K and a V tile of kBlockN rows x H, 64-column chunks
  // of kBlockN rows x 128 bytes (128B-swizzled TMA boxes), 1024-byte aligned.
  static constexpr int kTmaChunkBytes = kBlockN * 128;
  static constexpr int kTmaTileBytes = kBlockN * H * 2;
  static constexpr int kTmaStageBytes = 2 * kTmaTileBytes;
  // Shared memory: the K/V ring, or (after the loop) the warps' partial
  // results; then Q and the chunk's page ids (and the drift loop's mbarriers).
  static constexpr int kRingBytes =
      kRegs ? 0 : kDrift ? kStages * kTmaStageBytes + 1024 : kStages * 2 * kTileElems * 2;
  static constexpr int kMergeBytes = kWarps * kRows * (H + 4) * 4 + 2 * kWarps * kRows * 4 + kRows * 4;
  // plan.cluster: after the merge buffers, the CTA's normalised partial output
  // [kRows][H] and logsumexp [kRows] (read by the cluster's other CTAs), and
  // the merge weights [kRows][kMaxClusterSplits] (local).
  static constexpr int kPartOffset = (kMergeBytes + 15) / 16 * 16;
  static constexpr int kPartBytes = (kRows * H + kRows + kRows * kMaxClusterSplits) * 4;
  static constexpr int kFirstBytes =
      kRingBytes > kPartOffset + kPartBytes ? kRingBytes : kPartOffset + kPartBytes;
  static constexpr int kQOffset = kFirstBytes;
  static constexpr int kPagesOffset = kQOffset + kRows * kPitch * 2;
  static constexpr int kBarOffset = (kPagesOffset + kMaxChunkPages * 4 + 7) / 8 * 8;  // full[kStages], empty[kStages]
  static constexpr int kSmemBytes = kDrift ? kBarOffset + 2 * kStages * 8 : kPagesOffset + kMaxChunkPages * 4;
};

// The drift loop's tensor maps of the K and V caches ([pages or B, rows, K, H] as
// make_tmap_bshd describes them: boxes of kBlockN rows x H, 64-column chunks);
// unused by the cp.async loop.
struct DecodeTma {
  CUtensorMap k, v;
};

// Thread block cluster helpers (sm_90+; the host selects plan.cluster only
// where the kernel was compiled for sm_90 or later).
__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

// The float at shared-memory address `addr` (this CTA's layout) of the
// cluster's CTA `rank`.
__device__ __forceinline__ float ld_cluster_f32(uint32_t addr, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
  return v;
#else
  __trap();
  return 0.f;
#endif
}

#ifdef JAXATTN_DECODE_TIMELINE
// Profiling builds only (decode_check --timeline): thread 0 of each CTA
// records global-timer stamps of its phases (kTimelineMarks per CTA: start,
// prologue done, first tile in, middle tile in, loop done, end, SM id, the warps'
// merge done (before the cluster merge / output stores)) into
// buf[call][cta], call = how many times this CTA index has run before.
constexpr int kTimelineMarks = 8;
struct DecodeTimeline {
  unsigned long long* buf;
  unsigned* calls;  // [ctas]
  int max_calls, ctas;
};
__device__ DecodeTimeline g_decode_timeline;
#define JAXATTN_DECODE_MARK(i) (tl_stamp[i] = ptx::global_timer_ns())
#else
#define JAXATTN_DECODE_MARK(i) ((void)0)
#endif

// kSwap (the drift loop only; kV2SwapAB): S^T = K Q^T and O^T += V^T P^T (below).
template <int H, bool kBf16, int kLoop = kLoopCpAsync, bool kSwap = false>
__global__ void __launch_bounds__(MmaLayout<H, kLoop>::kThreads)
    decode_mma_kernel(const __grid_constant__ AttnParams p, const DecodePlan plan,
                      const __grid_constant__ DecodeTma tma) {
  using L = MmaLayout<H, kLoop>;
  using Elem = std::conditional_t<kBf16, __nv_bfloat16, __half>;
  constexpr int kBlockN = L::kBlockN, kStages = L::kStages, kPitch = L::kPitch, kThreads = L::kThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  // (The drift loop's ring starts at the first 1024-byte boundary: swizzled TMA boxes.)
  Elem* ring = reinterpret_cast<Elem*>(
      L::kDrift ? smem + (((ptx::smem_addr(smem) + 1023) & ~1023u) - ptx::smem_addr(smem)) : smem);
  Elem* q_s = reinterpret_cast<Elem*>(smem + L::kQOffset);
  int32_t* pages_s = reinterpret_cast<int32_t*>(smem + L::kPagesOffset);

  const int rb = plan.cluster ? blockIdx.x / plan.splits : blockIdx.x % plan.row_blocks;
  const int split = plan.cluster ? blockIdx.x % plan.splits : blockIdx.x / plan.row_blocks;
  const int kh = blockIdx.y, b = blockIdx.z;
  const int T = p.seqlen_q, G = p.num_heads / p.num_heads_k, K = p.num_heads_k;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
#ifdef JAXATTN_DECODE_TIMELINE
  unsigned long long tl_stamp[kTimelineMarks] = {};
#endif
  JAXATTN_DECODE_MARK(0);
  // plan.pdl (launched with programmatic stream serialization): nothing the
  // previous grid writes is read before it has completed (plan.warm reads the
  // row's length and page ids earlier, as prefetch hints only:
  // reg_loop_warm_l2); the next grid may launch now (its CTAs take SM slots as
  // ours free them, then wait likewise).
  if (plan.pdl) {
    if constexpr (L::kRegs) {
      if (plan.warm > 0) {  // (this chunk's keys from the length as it reads now: hints only)
        int wlo, wlen, wb, we;
        keys_of_length(p, ptx::ldg_l2_only_s32(p.kv_lengths + b), &wlo, &wlen);
        chunk_keys(plan, split, wlo / kRegGroupKeys * kRegGroupKeys, wlen, &wb, &we);
        reg_loop_warm_l2<H, Elem>(p, b, kh, wb, we, plan.warm);
      }
    }
    ptx::griddep_wait();
    ptx::griddep_launch_dependents();
  }
  const int r0 = rb * L::kRows;
  const int rows_here = min(L::kRows, plan.rows - r0);

  const bool paged = p.block_table != nullptr;
  const int ps = p.page_size;
  // The drift loop loads the query rows, and without a window chunk 0's page ids (it
  // starts at key 0 whatever the row's length), into registers in the same global
  // round trip as the length rather than after it: one dependent round trip less
  // before the first tile (session 21 run 1: +1-1.5 points at B=16 L=4K, H200). Ids
  // past the chunk's pages are read too (inside row b of the table, clamped) and never
  // used. (The cp.async loop keeps its query load below: sharing one lambda changed
  // every kernel's SASS.)
  constexpr bool early_q = L::kDrift || L::kRegs;
  constexpr int kEarlyQ = (L::kRows * L::kChunksPerRow + kThreads - 1) / kThreads;  // uint4 per thread
  uint4 early_qv[kEarlyQ];
#pragma unroll
  for (int i = 0; i < kEarlyQ; ++i) {
    const int c = tid + i * kThreads, r = c / L::kChunksPerRow, col = (c % L::kChunksPerRow) * 8;
    early_qv[i] = make_uint4(0, 0, 0, 0);
    if (early_q && c < L::kRows * L::kChunksPerRow && r < rows_here) {
      const int row = r0 + r, i_q = row / G, n = kh * G + row % G;
      early_qv[i] = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.q) + b * p.q_batch_stride +
                                                     i_q * p.q_row_stride + n * p.q_head_stride + col);
    }
  }
  const bool early_pages = (L::kDrift || L::kRegs) && paged && split == 0 && p.window_left < 0;
  constexpr int kEarlyIds = (kMaxChunkPages + kThreads - 1) / kThreads;  // ids per thread, at most
  int32_t early_id[kEarlyIds];
#pragma unroll
  for (int i = 0; i < kEarlyIds; ++i) {  // (loads into registers: in flight with the length's)
    const int t = tid + i * kThreads;
    early_id[i] = early_pages && t < min(p.max_pages, kMaxChunkPages)
                      ? p.block_table[int64_t(b) * p.max_pages + t] : 0;
  }
  // This CTA's keys [j_begin, j_end).
  int lo, len;
  row_keys(p, b, &lo, &len);
  if (early_pages) {
#pragma unroll
    for (int i = 0; i < kEarlyIds; ++i) {
      const int t = tid + i * kThreads;
      if (t < min(p.max_pages, kMaxChunkPages)) pages_s[t] = min(max(early_id[i], 0), p.num_pages - 1);
    }
  }
  if constexpr (early_q) {
#pragma unroll
    for (int i = 0; i < kEarlyQ; ++i) {
      const int c = tid + i * kThreads, r = c / L::kChunksPerRow, col = (c % L::kChunksPerRow) * 8;
      if (c < L::kRows * L::kChunksPerRow) *reinterpret_cast<uint4*>(q_s + r * kPitch + col) = early_qv[i];
    }
  }
  // The drift loop's TMA tiles start on 64-key boundaries (page-aligned): keys
  // [lo / 64 * 64, lo) are read too, masked by the window (their V rows zeroed).
  [[maybe_unused]] const int lo_keys = lo;
  if constexpr (L::kDrift) lo = lo / 64 * 64;
  if constexpr (L::kRegs) lo = lo / kRegGroupKeys * kRegGroupKeys;  // (the register loop's 16-key groups)
  int j_begin, j_end;
  chunk_keys(plan, split, lo, len, &j_begin, &j_end);
  const int num_tiles = (j_end - j_begin + kBlockN - 1) / kBlockN;

  // Page ids of the chunk (clamped), and the query rows (zero past the last).
  const int page0 = paged ? j_begin / ps : 0;
  int npages = 0;
  if (paged && j_begin < j_end) {
    npages = (j_end - 1) / ps - page0 + 1;
    for (int t = tid; t < (early_pages ? 0 : npages); t += kThreads) {
      const int32_t id = p.block_table[int64_t(b) * p.max_pages + page0 + t];
      pages_s[t] = min(max(id, 0), p.num_pages - 1);
    }
  }
  for (int c = tid; c < (early_q ? 0 : L::kRows * L::kChunksPerRow); c += kThreads) {
    const int r = c / L::kChunksPerRow, col = (c % L::kChunksPerRow) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < rows_here) {
      const int row = r0 + r, i = row / G, n = kh * G + row % G;
      v = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.q) + b * p.q_batch_stride +
                                          i * p.q_row_stride + n * p.q_head_stride + col);
    }
    *reinterpret_cast<uint4*>(q_s + r * kPitch + col) = v;
  }
#ifdef JAXATTN_DECODE_DRIFT_ON
  const uint32_t full_bar = ptx::smem_addr(smem + L::kBarOffset);  // the drift loop's full[s], then empty[s]
  if constexpr (L::kDrift) {
    if (tid < kStages) {
      hptx::mbar_init(full_bar + 8 * tid, 1);                            // the producer's arrive + the bytes
      hptx::mbar_init(full_bar + 8 * (kStages + tid), L::kKeyWarps);     // one arrive per warp of the group
    }
    hptx::mbar_init_fence();
  }
#endif
  __syncthreads();  // pages_s, q_s (and the drift loop's mbarriers)
  JAXATTN_DECODE_MARK(1);

  // The loader: thread tid copies column chunk tid % kChunksPerRow of tile
  // rows tid / kChunksPerRow + k * kRowsPerPass. Rows past j_end are zero-filled.
  const int ld_row = tid / L::kChunksPerRow, ld_col = (tid % L::kChunksPerRow) * 8;
  const Elem* kcache = static_cast<const Elem*>(p.k) + kh * p.k_head_stride;
  const Elem* vcache = static_cast<const Elem*>(p.v) + kh * p.v_head_stride;
  const Elem* kbase = kcache + ld_col;
  const Elem* vbase = vcache + ld_col;
  const uint32_t ring_addr = ptx::smem_addr(ring) + (ld_row * kPitch + ld_col) * 2;
  // Element offsets of key j's K and V rows: per key row, a division and a
  // shared-memory read of its page id (the session-3 loader; any page size).
  auto row_offsets = [&](int j, int64_t& ko, int64_t& vo) {
    if (paged) {
      const int rel = j / ps;
      const int64_t page = pages_s[rel - page0];
      const int in_page = j - rel * ps;
      ko = page * p.k_batch_stride + in_page * p.k_row_stride;
      vo = page * p.v_batch_stride + in_page * p.v_row_stride;
    } else {
      ko = b * p.k_batch_stride + int64_t(j) * p.k_row_stride;
      vo = b * p.v_batch_stride + int64_t(j) * p.v_row_stride;
    }
  };
  // Hoisted page lookups (pages of >= one tile): the keys [jt, jt + kBlockN)
  // of a tile lie in two pages at most, page A (keys from jt) and page B (the
  // next); key jt + r sits at in = off + r of page A, or in - ps of page B.
  // Per tile: one division and two shared-memory reads; per row: a compare
  // and a multiply-add. ka/va: page A's base, kb/vb: page B's base minus ps rows.
  const bool hoist = paged && plan.hoist && ps >= kBlockN;
  auto tile_pages = [&](int jt, int& off, int64_t& ka, int64_t& va, int64_t& kb, int64_t& vb) {
    const int rel = jt / ps;
    off = jt - rel * ps;
    const int t = rel - page0;
    const int64_t pa = pages_s[t], pb = pages_s[min(t + 1, npages - 1)];
    ka = pa * p.k_batch_stride;
    va = pa * p.v_batch_stride;
    kb = pb * p.k_batch_stride - int64_t(ps) * p.k_row_stride;
    vb = pb * p.v_batch_stride - int64_t(ps) * p.v_row_stride;
  };
  // Offsets of key j = jt + r of a tile: hoisted (tile_pages' bases) or per row.
  auto key_offsets = [&](int r, int j, int off, int64_t ka, int64_t va, int64_t kb, int64_t vb, int64_t& ko,
                         int64_t& vo) {
    if (hoist) {
      const int in = off + r;
      const bool in_a = in < ps;
      ko = (in_a ? ka : kb) + int64_t(in) * p.k_row_stride;
      vo = (in_a ? va : vb) + int64_t(in) * p.v_row_stride;
    } else {
      row_offsets(j, ko, vo);
    }
  };
  // The lean loader (plan.lean; kV2Lean in launch_decode.h), for contiguous
  // caches and pages of >= one tile: a tile's rows come from at most two runs
  // of consecutive cache rows, rows r < lim from bases ka / va and the others
  // from kb / vb, each base offset so that tile row r sits at base + r * stride.
  // Per tile: one division and two shared-memory reads (paged), computed
  // before the wait for the tile the loop is about to use (the copies then
  // issue right after the barrier); per row: a compare, selects, a
  // multiply-add, no branch.
  const bool lean = plan.lean && (!paged || hoist);
  struct TileBases {
    const Elem *ka, *kb, *va, *vb;
    int lim, jt;
  };
  auto tile_bases = [&](int tile) {
    TileBases t;
    t.jt = j_begin + tile * kBlockN;
    if (paged) {
      const int rel = t.jt / ps, off = t.jt - rel * ps, i = rel - page0;
      const int64_t pa = pages_s[i], pb = pages_s[min(i + 1, npages - 1)];
      t.ka = kbase + pa * p.k_batch_stride + int64_t(off) * p.k_row_stride;
      t.va = vbase + pa * p.v_batch_stride + int64_t(off) * p.v_row_stride;
      t.kb = kbase + pb * p.k_batch_stride + int64_t(off - ps) * p.k_row_stride;
      t.vb = vbase + pb * p.v_batch_stride + int64_t(off - ps) * p.v_row_stride;
      t.lim = ps - off;
    } else {
      t.ka = t.kb = kbase + b * p.k_batch_stride + int64_t(t.jt) * p.k_row_stride;
      t.va = t.vb = vbase + b * p.v_batch_stride + int64_t(t.jt) * p.v_row_stride;
      t.lim = kBlockN;
    }
    return t;
  };
  auto load_tile_lean = [&](int tile, const TileBases& t) {
    const uint32_t dst = ring_addr + (tile % kStages) * 2 * L::kTileElems * 2;
#pragma unroll
    for (int k = 0; k < L::kPasses; ++k) {
      const int r = ld_row + k * L::kRowsPerPass;
      const bool valid = t.jt + r < j_end, in_a = r < t.lim;
      const Elem* ks = (in_a ? t.ka : t.kb) + int64_t(r) * p.k_row_stride;
      const Elem* vs = (in_a ? t.va : t.vb) + int64_t(r) * p.v_row_stride;
      const uint32_t off_s = k * L::kRowsPerPass * kPitch * 2;
      ptx::cp_async_16(dst + off_s, valid ? ks : kbase, valid);
      ptx::cp_async_16(dst + L::kTileElems * 2 + off_s, valid ? vs : vbase, valid);
    }
  };
  auto load_tile = [&](int tile) {
    if (lean) {
      load_tile_lean(tile, tile_bases(tile));
      return;
    }
    const int stage = tile % kStages;
    const uint32_t dst = ring_addr + stage * 2 * L::kTileElems * 2;
    const int jt = j_begin + tile * kBlockN;
    int off = 0;
    int64_t ka = 0, va = 0, kb = 0, vb = 0;
    if (hoist) tile_pages(jt, off, ka, va, kb, vb);
#pragma unroll
    for (int k = 0; k < L::kPasses; ++k) {
      const int r = ld_row + k * L::kRowsPerPass;
      const int j = jt + r;
      const bool valid = j < j_end;
      int64_t ko = 0, vo = 0;
      if (valid) {
        key_offsets(r, j, off, ka, va, kb, vb, ko, vo);
      }
      const uint32_t off_s = k * L::kRowsPerPass * kPitch * 2;
      ptx::cp_async_16(dst + off_s, kbase + ko, valid);
      ptx::cp_async_16(dst + L::kTileElems * 2 + off_s, vbase + vo, valid);
    }
  };
  // L2 prefetch of a tile (plan.prefetch > 0): every 128-byte line of its K
  // and V rows, one prefetch.global.L2 each, spread over the threads.
  constexpr int kLines = H * 2 / 128;
  auto prefetch_tile = [&](int tile) {
    const int jt = j_begin + tile * kBlockN;
    int off = 0;
    int64_t ka = 0, va = 0, kb = 0, vb = 0;
    if (hoist) tile_pages(jt, off, ka, va, kb, vb);
#pragma unroll
    for (int i = 0; i < (kBlockN * kLines + kThreads - 1) / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / kLines, line = c % kLines;
      const int j = jt + r;
      if (c < kBlockN * kLines && j < j_end) {
        int64_t ko, vo;
        key_offsets(r, j, off, ka, va, kb, vb, ko, vo);
        ptx::prefetch_l2(kcache + ko + line * 64);
        ptx::prefetch_l2(vcache + vo + line * 64);
      }
    }
  };
  const int prefetch = plan.prefetch;

  // Per lane: rows g and g + 8 of the tile (h = 0, 1), keys 2t, 2t+1 of
  // each n8 tile of the warp's 16 keys.
  const int g = lane / 4, t4 = lane % 4;
  int pos[2];
  bool row_ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    row_ok[h] = r < rows_here;
    pos[h] = len - T + (r0 + r) / G;
  }
  const int wl = p.window_left;
  const float qk_scale = p.scale * kLog2e;
  const float cap = p.softcap;  // logits (natural units) capped: cap * tanh(x / cap)

  float o_acc[1][H / 8][4];
  sm80::clear(o_acc);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  // kSwap: the drift loop with A and B swapped (kV2SwapAB): S^T = K Q^T
  // (m16 keys x n8 query rows) and O^T += V^T P^T (m16 dims x n8 rows), so a tile's
  // query rows fill n8 tiles instead of an m16 tile: at <= 8 rows (G * Tq, e.g. 4)
  // half the mma of the usual orientation. Thread 4 g + t4 holds rows nt * 8 + 2 t4 + e.
  float ot_acc[H / 16][2][4];
  float sw_m[2][2], sw_l[2][2];
#pragma unroll
  for (int i = 0; i < H / 16; ++i)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) ot_acc[i][nt][c] = 0.f;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) sw_m[nt][e] = -INFINITY, sw_l[nt][e] = 0.f;

  const uint32_t q_addr = ptx::smem_addr(q_s) + sm80::lane_offset_a<kPitch>(lane);
  const uint32_t k_lane = ptx::smem_addr(ring) + (warp * 16 * kPitch) * 2 + sm80::lane_offset_b<kPitch>(lane);
  const uint32_t v_lane =
      ptx::smem_addr(ring) + (L::kTileElems + warp * 16 * kPitch) * 2 + sm80::lane_offset_a<kPitch>(lane);

  [[maybe_unused]] RegLoopAcc<H> reg_acc;
  if constexpr (L::kRegs) {
    JAXATTN_DECODE_MARK(2);  // (timeline builds: the register loop's "first tile" is its start)
    const RegLoopArgs args{kcache, vcache, pages_s, q_s, kPitch, b, page0, j_begin, j_end, lo_keys, len, T, G, r0,
                           rows_here};
    reg_loop<H, Elem>(p, args, reg_acc);
  } else if constexpr (L::kDrift) {
#ifdef JAXATTN_DECODE_DRIFT_ON
    // The drift loop (MmaLayout). Producer warp: lane 0 loads tile t into stage
    // t % kStages (two 5D TMA boxes, K and V, onto full[stage]) once the group that
    // used the stage for tile t - kStages has left it (empty[stage]). Consumer warp
    // w: group w / kKeyWarps takes tiles group, group + kGroups, ...; the warp's 16
    // keys are rows 16 (w % kKeyWarps) .. + 16 of each. Rows past a page's or the
    // cache's end read as zero; rows of a tile outside [lo_keys, j_end) hold other
    // keys (or never-written cache rows), so the warp zeroes their V rows first.
    const uint32_t ring_base = ptx::smem_addr(ring), empty_bar = full_bar + 8 * kStages;
    if (warp == L::kWarps) {
      if (lane == 0 && num_tiles > 0) {
        hptx::prefetch_tmap(&tma.k);
        hptx::prefetch_tmap(&tma.v);
        for (int tile = 0; tile < num_tiles; ++tile) {
          const int stage = tile % kStages, jt = j_begin + tile * kBlockN;
          if (tile >= kStages) hptx::mbar_wait(empty_bar + 8 * stage, ((tile / kStages) - 1) & 1);
          int row = jt, batch = b;
          if (paged) {
            const int rel = jt / ps;
            row = jt - rel * ps;
            batch = pages_s[rel - page0];
          }
          const uint32_t dst = ring_base + stage * L::kTmaStageBytes, bar = full_bar + 8 * stage;
          hptx::mbar_arrive_expect_tx(bar, L::kTmaStageBytes);
          hptx::tma_load_5d(dst, &tma.k, bar, 0, row, 0, kh, batch);
          hptx::tma_load_5d(dst + L::kTmaTileBytes, &tma.v, bar, 0, row, 0, kh, batch);
        }
      }
    } else {
      const int group = warp / L::kKeyWarps, kw = warp % L::kKeyWarps;
      // This lane's ldmatrix rows in a swizzled stage (K: pattern B, V: pattern A);
      // 16-byte unit u of row r of a 64-column chunk sits at unit u ^ (r % 8).
      const uint32_t k_sw = (kw * 16 + (lane & 7) + (lane >> 4) * 8) * 128, y_k = (lane & 7) ^ ((lane >> 3) & 1);
      const uint32_t v_sw = (kw * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * 128, y_v = (lane & 7) ^ (lane >> 4);
      [[maybe_unused]] const uint32_t q_b = ptx::smem_addr(q_s) + sm80::lane_offset_b<kPitch>(lane);
      [[maybe_unused]] const bool two = rows_here > 8;  // rows 8-15 real: the second n8 tile of query rows
      int sw_pos[2][2];
      bool sw_ok[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = nt * 8 + 2 * t4 + e;
          sw_ok[nt][e] = r < rows_here;
          sw_pos[nt][e] = len - T + (r0 + r) / G;
        }
      for (int tile = group; tile < num_tiles; tile += L::kGroups) {
        const int stage = tile % kStages;
        const uint32_t st = ring_base + stage * L::kTmaStageBytes;
        const int jw = j_begin + tile * kBlockN + kw * 16;
        hptx::mbar_wait(full_bar + 8 * stage, (tile / kStages) & 1);
#ifdef JAXATTN_DECODE_TIMELINE
        if (tile == 0) JAXATTN_DECODE_MARK(2);
        if (tile / 2 == num_tiles / 4) JAXATTN_DECODE_MARK(3);
#endif
#ifndef JAXATTN_EXP_DECODE_NO_MATH  // (timing probe: the loop waits and releases, no math)
        if (jw < lo_keys || jw + 16 > j_end) {  // whole rows: the swizzle only permutes units within a row
          for (int i = lane; i < 16 * (H / 8); i += 32) {
            const int r = i / (H / 8), u = i % (H / 8);
            if (jw + r < lo_keys || jw + r >= j_end) {
              asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(st + L::kTmaTileBytes +
                                                                               (u / 8) * L::kTmaChunkBytes +
                                                                               (kw * 16 + r) * 128 + (u % 8) * 16),
                           "r"(0u)
                           : "memory");
            }
          }
          hptx::fence_proxy_async_smem();  // these writes, before the stage's next TMA writes
          __syncwarp();
        }
        if constexpr (!kSwap) {
        float s_acc[1][2][4];
        sm80::clear(s_acc);
#pragma unroll
        for (int kk = 0; kk < H / 16; ++kk) {
          uint32_t a[4], kb[4];
          ptx::ldmatrix_x4(a, q_addr + kk * 16 * 2);
          ptx::ldmatrix_x4(kb, st + (kk / 4) * L::kTmaChunkBytes + k_sw + ((((kk % 4) * 2) ^ y_k) << 4));
          ptx::mma_16816<Elem>(s_acc[0][0], a, kb[0], kb[1]);
          ptx::mma_16816<Elem>(s_acc[0][1], a, kb[2], kb[3]);
        }
        uint32_t v_frag[H / 16][4];
#pragma unroll
        for (int jp = 0; jp < H / 16; ++jp) {
          ptx::ldmatrix_x4_trans(v_frag[jp], st + L::kTmaTileBytes + (jp / 4) * L::kTmaChunkBytes + v_sw +
                                                 ((((jp % 4) * 2) ^ y_v) << 4));
        }
#include "decode/decode_softmax_tile.inc"
#pragma unroll
        for (int jp = 0; jp < H / 16; ++jp) {
          ptx::mma_16816<Elem>(o_acc[0][2 * jp], p_frag[0][0], v_frag[jp][0], v_frag[jp][1]);
          ptx::mma_16816<Elem>(o_acc[0][2 * jp + 1], p_frag[0][0], v_frag[jp][2], v_frag[jp][3]);
        }
        } else {
        // S^T: K as the A operand (pattern A rows of the swizzled K chunk), Q^T as B
        // (pattern B rows of q_s: b0 b1 rows 0-7, b2 b3 rows 8-15).
        float st_acc[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < H / 16; ++kk) {
          uint32_t ka[4], qb[4];
          ptx::ldmatrix_x4(qb, q_b + kk * 16 * 2);
          ptx::ldmatrix_x4(ka, st + (kk / 4) * L::kTmaChunkBytes + v_sw + ((((kk % 4) * 2) ^ y_v) << 4));
          ptx::mma_16816<Elem>(st_acc[0], ka, qb[0], qb[1]);
          if (two) ptx::mma_16816<Elem>(st_acc[1], ka, qb[2], qb[3]);
        }
        // V^T as the A operand: pattern B rows of the V chunk, transposed.
        uint32_t vt_frag[H / 16][4];
#pragma unroll
        for (int mt = 0; mt < H / 16; ++mt) {
          ptx::ldmatrix_x4_trans(vt_frag[mt], st + L::kTmaTileBytes + (mt / 4) * L::kTmaChunkBytes + k_sw +
                                                  ((((mt % 4) * 2) ^ y_k) << 4));
        }
        // Online softmax per query row (keys jw + g and jw + g + 8 in this thread; the
        // row's other keys in the lanes of the same t4).
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          if (nt == 1 && !two) break;
          uint32_t pt[2];
          swap_softmax<Elem>(st_acc[nt], sw_m[nt], sw_l[nt], sw_ok[nt], sw_pos[nt], jw, j_end, wl, qk_scale, cap, g,
                             [&](int e, float alpha) {
#pragma unroll
                               for (int mt = 0; mt < H / 16; ++mt) {
                                 ot_acc[mt][nt][e] *= alpha;
                                 ot_acc[mt][nt][2 + e] *= alpha;
                               }
                             },
                             pt);
#pragma unroll
          for (int mt = 0; mt < H / 16; ++mt) ptx::mma_16816<Elem>(ot_acc[mt][nt], vt_frag[mt], pt[0], pt[1]);
        }
        }
#else
        (void)jw;
#endif
        __syncwarp();  // every lane's reads of the stage are done (their results used above)
        if (lane == 0) hptx::mbar_arrive(empty_bar + 8 * stage);
      }
    }
#else
    __trap();  // the drift layout runs only as sm_90 code (the launcher checks)
#endif
  } else {
  // The cp.async loop (every layout but the drift loop's).
  // Tiles in the ring before the loop: kStages - 1, or every stage (refill).
  const bool refill = plan.refill;
  const int ahead = refill ? kStages : kStages - 1;
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    if (s < ahead) {
      if (s < num_tiles) load_tile(s);
      ptx::cp_async_commit();
    }
  }
  // Tiles ahead .. ahead - 1 + prefetch into L2; later, each loop step
  // prefetches the tile `prefetch` beyond the one it loads (each tile once).
  for (int t = ahead; t < min(num_tiles, ahead + prefetch); ++t) prefetch_tile(t);
  // plan.touch: the first line of every page of the chunk (after the first
  // copies, so they are not delayed).
  if (paged && plan.touch) {
    for (int t = tid; t < npages; t += kThreads) {
      const int64_t page = pages_s[t];
      ptx::prefetch_l2(kcache + page * p.k_batch_stride);
      ptx::prefetch_l2(vcache + page * p.v_batch_stride);
    }
  }
  for (int tile = 0; tile < num_tiles; ++tile) {
    if (refill) {
      ptx::cp_async_wait<kStages - 1>();  // groups: kStages before the loop + one per step
      __syncthreads();  // tile `tile` is in
    } else {
      const int next = tile + kStages - 1;
      TileBases nb{};
      if (lean && next < num_tiles) nb = tile_bases(next);  // (pages_s is read-only by now)
      ptx::cp_async_wait<kStages - 2>();
      __syncthreads();  // tile `tile` is in; every warp is done with tile - 1
      // Timing probe (-DJAXATTN_EXP_DECODE_NO_LOAD, wrong results): the loop issues
      // no copies, so it times the math and the barriers alone.
#ifndef JAXATTN_EXP_DECODE_NO_LOAD
      if (next < num_tiles) {
#else
      if (next < num_tiles && num_tiles < 0) {
#endif
        if (lean) {
          load_tile_lean(next, nb);
        } else {
          load_tile(next);
        }
      }
      ptx::cp_async_commit();
    }
    if (prefetch > 0 && tile + ahead + prefetch < num_tiles) prefetch_tile(tile + ahead + prefetch);
#ifdef JAXATTN_DECODE_TIMELINE
    if (tile == 0) JAXATTN_DECODE_MARK(2);
    if (tile == num_tiles / 2) JAXATTN_DECODE_MARK(3);
#endif
    const uint32_t stage_off = (tile % kStages) * 2 * L::kTileElems * 2;
    // Timing probe (-DJAXATTN_EXP_DECODE_NO_MATH, wrong results): the loop waits for
    // and refills its ring with no math, so it times the loader and the barriers alone.
#ifndef JAXATTN_EXP_DECODE_NO_MATH

    float s_acc[1][2][4];
    sm80::clear(s_acc);
    sm80::gemm_ss_abt<Elem, 1, 2, H, kPitch, kPitch>(s_acc, q_addr, k_lane + stage_off);
    // The V fragments of this tile are read before the softmax, so their shared-
    // memory latency hides under it (H <= 128: 32 registers; 157 at H=128). Left
    // to ptxas they were read after it: 8-11% slower on paged caches (H200,
    // perf.md session 17 run 1: B=64 L=4K 79 -> 90%, B=16 L=16K 82 -> 89%, B=16
    // L=4K 71 -> 80% of read bandwidth). (Q fragments kept in registers instead of
    // 8 ldmatrix a tile: no gain on top of this, same run.)
    constexpr bool kEarlyV = H <= 128;
    uint32_t v_frag[kEarlyV ? H / 16 : 1][4];
    if constexpr (kEarlyV) {
#pragma unroll
      for (int jp = 0; jp < H / 16; ++jp) ptx::ldmatrix_x4_trans(v_frag[jp], v_lane + stage_off + jp * 16 * 2);
    }

    const int jw = j_begin + tile * kBlockN + warp * 16;
#include "decode/decode_softmax_tile.inc"
    if constexpr (kEarlyV) {
#pragma unroll
      for (int jp = 0; jp < H / 16; ++jp) {
        ptx::mma_16816<Elem>(o_acc[0][2 * jp], p_frag[0][0], v_frag[jp][0], v_frag[jp][1]);
        ptx::mma_16816<Elem>(o_acc[0][2 * jp + 1], p_frag[0][0], v_frag[jp][2], v_frag[jp][3]);
      }
    } else {
      sm80::gemm_rs_ab<Elem, 1, H / 8, 1, kPitch>(o_acc, p_frag, v_lane + stage_off);
    }
#else
    (void)stage_off;
#endif
    if (refill) {
      __syncthreads();  // every warp is done with this stage: refill it now
      if (tile + kStages < num_tiles) load_tile(tile + kStages);
      ptx::cp_async_commit();
    }
  }
  }
  ptx::cp_async_wait<0>();
  __syncthreads();  // the ring is free: the merge buffers alias it
  JAXATTN_DECODE_MARK(4);
#ifdef JAXATTN_DECODE_TIMELINE
  // Writes the stamps (mark 5 = now, the end of the CTA's work but its
  // output stores) when the CTA returns.
  struct TimelineFlush {
    unsigned long long* stamp;
    int tid;
    __device__ ~TimelineFlush() {
      const DecodeTimeline t = g_decode_timeline;
      if (tid != 0 || t.buf == nullptr) return;
      stamp[5] = ptx::global_timer_ns();
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      stamp[6] = sm;
      const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
      if (cta >= t.ctas) return;
      const unsigned call = atomicAdd(t.calls + cta, 1u);
      if (call >= unsigned(t.max_calls)) return;
      unsigned long long* dst = t.buf + (size_t(call) * t.ctas + cta) * kTimelineMarks;
      for (int i = 0; i < kTimelineMarks; ++i) dst[i] = stamp[i];
    }
  } tl_flush{tl_stamp, tid};
#endif

  // Merge the warps: each writes its (m, l, o) rows; then per row the
  // common max M, the sum L and every warp's weight 2^(m_w - M) / L.
  float* red_o = reinterpret_cast<float*>(smem);  // [kWarps][kRows][H + 4]
  float* red_m = red_o + L::kWarps * L::kRows * (H + 4);
  float* red_l = red_m + L::kWarps * L::kRows;
  float* row_lse = red_l + L::kWarps * L::kRows;  // [kRows]: the row's logsumexp (log2)
  if constexpr (L::kRegs) {
    // Rows 2 t4 + e (rows 8-15 of the merge buffers stay unwritten: the loop takes at
    // most 8 rows, and only rows below rows_here are read back).
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float lsum = ptx::column_sum(reg_acc.l[e]);
      const int r = 2 * t4 + e;
      if (g == 0) {
        red_m[warp * L::kRows + r] = reg_acc.m[e];
        red_l[warp * L::kRows + r] = lsum;
      }
      float* dst = red_o + (warp * L::kRows + r) * (H + 4);
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int h4 = 0; h4 < 2; ++h4)
          *reinterpret_cast<float4*>(dst + 64 * c + 8 * g + 4 * h4) =
              make_float4(reg_acc.o[4 * h4][2 * c + e], reg_acc.o[4 * h4 + 1][2 * c + e],
                          reg_acc.o[4 * h4 + 2][2 * c + e], reg_acc.o[4 * h4 + 3][2 * c + e]);
    }
  } else if constexpr (L::kDrift && kSwap) {
    if (warp < L::kWarps) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float lsum = ptx::column_sum(sw_l[nt][e]);
          const int r = nt * 8 + 2 * t4 + e;
          if (g == 0) {
            red_m[warp * L::kRows + r] = sw_m[nt][e];
            red_l[warp * L::kRows + r] = lsum;
          }
#pragma unroll
          for (int mt = 0; mt < H / 16; ++mt) {
            red_o[(warp * L::kRows + r) * (H + 4) + mt * 16 + g] = ot_acc[mt][nt][e];
            red_o[(warp * L::kRows + r) * (H + 4) + mt * 16 + g + 8] = ot_acc[mt][nt][2 + e];
          }
        }
    }
  } else {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float lsum = ptx::quad_sum(l[h]);
    const int r = g + 8 * h;
    if (L::kDrift && warp >= L::kWarps) break;  // (the drift loop's producer warp holds no rows)
    if (t4 == 0) {
      red_m[warp * L::kRows + r] = m[h];
      red_l[warp * L::kRows + r] = lsum;
    }
#pragma unroll
    for (int d = 0; d < H / 8; ++d) {
      *reinterpret_cast<float2*>(red_o + (warp * L::kRows + r) * (H + 4) + d * 8 + 2 * t4) =
          make_float2(o_acc[0][d][2 * h], o_acc[0][d][2 * h + 1]);
    }
  }
  }
  __syncthreads();
  if (tid < L::kRows) {
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < L::kWarps; ++w) M = fmaxf(M, red_m[w * L::kRows + tid]);
    float sum = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < L::kWarps; ++w) {
        const float wgt = exp2f(red_m[w * L::kRows + tid] - M);
        red_m[w * L::kRows + tid] = wgt;  // now the warp's weight
        sum += red_l[w * L::kRows + tid] * wgt;
      }
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;  // (weights stay 0 for an empty row)
#pragma unroll
    for (int w = 0; w < L::kWarps; ++w) red_m[w * L::kRows + tid] = M == -INFINITY ? 0.f : red_m[w * L::kRows + tid] * inv;
    row_lse[tid] = sum > 0.f ? M + log2f(sum) : -INFINITY;
  }
  __syncthreads();
  JAXATTN_DECODE_MARK(7);
  const bool direct = plan.splits == 1;
  if (plan.cluster && !direct) {
    // Cluster merge: every CTA publishes its normalised partial output and
    // logsumexp in its shared memory; after the cluster barrier, CTA `split`
    // merges elements split * kThreads + tid + k * splits * kThreads of the
    // row block from all `splits` CTAs, and CTA 0 writes the rows' lse.
    float* part_o = reinterpret_cast<float*>(smem + L::kPartOffset);  // [kRows][H]
    float* part_lse = part_o + L::kRows * H;                          // [kRows] (log2)
    float* wts = part_lse + L::kRows;                                 // [kRows][kMaxClusterSplits]
    for (int c = tid; c < rows_here * H; c += kThreads) {
      const int r = c / H, d = c % H;
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < L::kWarps; ++w) o += red_m[w * L::kRows + r] * red_o[(w * L::kRows + r) * (H + 4) + d];
      part_o[c] = o;
    }
    if (tid < L::kRows) part_lse[tid] = row_lse[tid];
    cluster_sync_all();  // every CTA's part_o / part_lse are written
    const int S = plan.splits;
    if (tid < rows_here) {
      const uint32_t lse_addr = ptx::smem_addr(part_lse + tid);
      float M = -INFINITY;
      for (int q = 0; q < S; ++q) {
        const float x = ld_cluster_f32(lse_addr, q);
        wts[tid * kMaxClusterSplits + q] = x;
        M = fmaxf(M, x);
      }
      float sum = 0.f;
      for (int q = 0; q < S; ++q) {
        const float w = M == -INFINITY ? 0.f : exp2f(wts[tid * kMaxClusterSplits + q] - M);
        wts[tid * kMaxClusterSplits + q] = w;
        sum += w;
      }
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int q = 0; q < S; ++q) wts[tid * kMaxClusterSplits + q] *= inv;
      if (split == 0) {
        const int row = r0 + tid, i = row / G, n = kh * G + row % G;
        p.lse[(int64_t(b) * T + i) * p.num_heads + n] = sum > 0.f ? (M + log2f(sum)) * kLn2 : -INFINITY;
      }
    }
    __syncthreads();  // wts
    const uint32_t part_addr = ptx::smem_addr(part_o);
    for (int c = split * kThreads + tid; c < rows_here * H; c += S * kThreads) {
      const int r = c / H, d = c % H;
      float o = 0.f;
      for (int q = 0; q < S; ++q) {
        const float w = wts[r * kMaxClusterSplits + q];
        const float x = ld_cluster_f32(part_addr + c * 4, q);
        o += w > 0.f ? w * x : 0.f;
      }
      const int row = r0 + r, i = row / G, n = kh * G + row % G;
      static_cast<uint16_t*>(p.o)[b * p.o_batch_stride + i * p.o_row_stride + n * p.o_head_stride + d] =
          to_half_bits<kBf16>(o);
    }
    cluster_sync_all();  // no CTA leaves while the others still read its shared memory
    return;
  }
  for (int c = tid; c < rows_here * H; c += kThreads) {
    const int r = c / H, d = c % H;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < L::kWarps; ++w) o += red_m[w * L::kRows + r] * red_o[(w * L::kRows + r) * (H + 4) + d];
    const int row = r0 + r, i = row / G, n = kh * G + row % G;
    if (direct) {
      static_cast<uint16_t*>(p.o)[b * p.o_batch_stride + i * p.o_row_stride + n * p.o_head_stride + d] =
          to_half_bits<kBf16>(o);
    } else {
      const int64_t slot = ((int64_t(b) * K + kh) * p.num_splits + split) * plan.rows + row;
      p.split_o[slot * H + d] = o;
    }
  }
  if (tid < rows_here) {
    const int row = r0 + tid, i = row / G, n = kh * G + row % G;
    if (direct) {
      p.lse[(int64_t(b) * T + i) * p.num_heads + n] = row_lse[tid] * kLn2;
    } else {
      p.split_lse[((int64_t(b) * K + kh) * p.num_splits + split) * plan.rows + row] = row_lse[tid];
    }
  }
}

}  // namespace jaxattn::cuda::decode
