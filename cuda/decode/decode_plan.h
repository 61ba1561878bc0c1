// How a decode call is cut into CTAs (the split plan), and the host pieces
// both kernel versions share: the plan struct, the key span of a row, the
// SM count, the logsumexp combine launch. Plain C++ plus the CUDA runtime.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/device.h"
#include "common/params.h"
#include "launch.h"

namespace jaxattn::cuda::decode {

constexpr int kMaxChunk = 8192;  // keys per chunk: bounds the shared page list
// Page ids of a chunk in shared memory: kMaxChunk keys of 16-key pages from
// any start (+1), and 2 spare so that version 2's long chunks (kV2LongChunks)
// reach 513 pages x 64 keys >= 32K keys at page size 64.
constexpr int kMaxChunkPages = kMaxChunk / 16 + 3;
constexpr int kMinChunk = 256;   // keys per chunk, at least (below, the combine costs more than it gains)

struct DecodePlan {
  int splits;      // chunks per (row, KV head)
  int chunk;       // keys per chunk, <= kMaxChunk (version 2 with kV2LongChunks: what pages_s holds)
  int row_blocks;  // blocks of query rows (of RB rows in version 1, 16 in version 2)
  int rows;        // Tq * G
  // Version 2: each row cuts its own visible keys into `splits` chunks of a
  // multiple of 64 keys (at most `chunk`), so short rows of a ragged batch
  // are not left with empty chunks; false: chunks of exactly `chunk` keys.
  bool adaptive;
  // Version 2 loader (issue 9; kV2* in launch_decode.h): page ids looked up
  // once per tile instead of once per key row (pages of >= one tile), and
  // `prefetch` tiles beyond the ring's newest one prefetched into L2 (0: off).
  bool hoist;
  bool touch;  // one L2 prefetch per page of the chunk before the loop
  int prefetch;
  // Version 2, short contexts (issue 9; kV2Refill / kV2Cluster in launch_decode.h).
  // refill: a ring stage is refilled as soon as every warp is done with it
  // (a second barrier per tile), so all kStages tiles are in flight while the
  // CTA waits, not kStages - 1.
  bool refill;
  // cluster: the `splits` CTAs of one (row, KV head, row block) form a thread
  // block cluster (sm_90+, splits <= kMaxClusterSplits; the launcher uses 2) and merge their
  // partial outputs through distributed shared memory at the end: no split
  // workspace round trip, no combine kernel. Grid x is then rb * splits + split
  // (the cluster's CTAs adjacent) instead of split * row_blocks + rb.
  bool cluster;
  // pdl: launched with programmatic stream serialization (sm_90+; kV2Pdl):
  // the kernel waits for the previous grid on the device (griddepcontrol)
  // instead of in the launch queue, so its launch and the previous grid's
  // tail overlap.
  bool pdl;
  // lean: the branch-free loader with per-tile bases computed ahead (kV2Lean;
  // contiguous caches and pages of >= one tile).
  bool lean;
  // warm (the register loop with pdl; kV2WarmShift; reg_plan sets it, 0 elsewhere): 16-key
  // groups per warp whose K / V lines each CTA prefetches into L2 before it waits for the
  // previous grid; the combine kernel then lets the next grid launch at its start.
  int warm;
};

constexpr int kMaxClusterSplits = 8;  // portable cluster size

inline int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

// Keys one row may need at most: the capacity, or Tq + window.
inline int64_t key_span(const AttnParams& p) {
  int64_t span = p.seqlen_k;
  if (p.window_left >= 0) span = std::min<int64_t>(span, int64_t(p.seqlen_q) + p.window_left);
  return std::max<int64_t>(span, 1);
}

// Chunks of `span` keys for about `splits` splits: a multiple of 64 keys, at
// most max_chunk (kMaxChunk unless the plan allows longer chunks); sets
// plan.chunk and plan.splits (the real count).
inline void set_chunks(DecodePlan& plan, int64_t span, int splits, int64_t max_chunk = kMaxChunk) {
  plan.chunk = int(std::min<int64_t>(max_chunk, (int64_t(ceil_div(span, std::max(splits, 1))) + 63) / 64 * 64));
  plan.splits = ceil_div(span, plan.chunk);
}

// Merges plan.splits partial outputs per query row into p.o and p.lse.
LaunchStatus launch_combine(const AttnParams& p, const DecodePlan& plan, cudaStream_t stream);

}  // namespace jaxattn::cuda::decode
