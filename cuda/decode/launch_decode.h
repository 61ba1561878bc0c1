// Host entry point of the CUDA decode kernels (jaxattn.decode_attention):
// split-KV attention of Tq <= 16 queries per row over a contiguous or paged
// KV cache, then a logsumexp combine.
//
// Two versions, picked per call by the caller (jaxattn/decode.py reads the
// choice at trace time; the handler never reads the environment):
//  1: CUDA cores, register-only pipelining (decode_kernel.cuh);
//  2: cp.async shared-memory ring + mma.sync tensor cores (decode_mma_kernel.cuh).
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "launch.h"

namespace jaxattn::cuda {

// Whether the decode kernels take `p` (a decode call, see the decode block of
// AttnParams): bf16/fp16, head dim 64, 128 or 256. Empty string when they do,
// else why not.
const char* decode_unsupported_reason(const AttnParams& p);

// Largest forced chunk (keys) a caller may ask for.
constexpr int kDecodeMaxForcedChunk = 8192;

// Splits of one (row, KV head) the workspace must hold for a row capacity of
// `capacity` keys (and a forced chunk of `forced_chunk` keys, 0 = none): no
// version ever uses more. The Python wrapper sizes split_o / split_lse with
// this function (jaxattn/decode.py).
int decode_max_splits(int capacity, int forced_chunk = 0);

// Writes p.o and p.lse; uses p.split_o [B, K, max_splits, Tq * G, H] and
// p.split_lse [B, K, max_splits, Tq * G] (p.num_splits = max_splits) when it
// splits a row's keys. `version`: 1 or 2 (above). `forced_chunk` > 0 (at
// most kDecodeMaxForcedChunk) cuts every row into chunks of exactly that
// many keys (tests: many splits at small sizes); 0 = the launcher's plan.
// Enqueues on `stream` only (CUDA-graph safe).
// `variant` (version 2 only): -1 = kDecodeV2DefaultVariant, else kV2* bits
// below kV2VariantEnd (tests and benchmarks: a same-run A/B through JAX).
LaunchStatus decode_fwd(const AttnParams& p, cudaStream_t stream, int version = 1, int forced_chunk = 0,
                        int variant = -1);
constexpr int kV2VariantEnd = 1 << 19;

// Loader variants of version 2 (bits; decode_check measures them side by
// side). kV2Hoist: a tile's page ids are read once per tile (two shared-memory
// reads) instead of a division and a shared-memory read per key row, for pages
// of at least one tile. Bits 4-7: tiles beyond the ring's newest load that are
// prefetched into L2 (prefetch.global.L2), so more bytes are in flight per SM
// than the shared-memory ring holds and a new page's address translation is
// taken ahead of its copies. kV2Old: the session-3 loader; kV2New: both.
constexpr int kV2Hoist = 1;
// kV2Touch: before the loop, one L2 prefetch per page of the chunk (its first
// K and V row of this head), so every page's address translation starts at
// once instead of one page per tile (a probe of the TLB hypothesis; not in kV2New).
constexpr int kV2Touch = 2;
constexpr int kV2PrefetchShift = 4;
// Short contexts (issue 9). kV2Refill: a ring stage is refilled as soon as
// every warp is done with it (two barriers per tile), so the whole ring is in
// flight while a CTA waits, not all but one stage (H200: no gain, not in
// kV2Short). kV2Waves: the fewest splits giving >= 0.9 waves of CTAs over the
// resident slots (then the fullest last wave among [s0, 2 s0]) instead of
// >= 1.9 waves: short rows run in one wave of longer chunks (H200, forced-chunk
// sweep: one full wave beat two or more at every short row). kV2LongChunks:
// chunks up to what the shared page list holds at the call's page size
// (paged) or unbounded (contiguous) instead of kMaxChunk keys. kV2Cluster: on
// sm_90+, the 2 chunks of a (row, KV head) are one thread block cluster that
// merges its partial outputs through distributed shared memory (no combine
// kernel, no split workspace round trip; clusters of 3-8 lost on the H200).
constexpr int kV2Refill = 4;
constexpr int kV2Waves = 1 << 8;
constexpr int kV2Cluster = 1 << 9;
constexpr int kV2LongChunks = 1 << 10;
// kV2Pdl: programmatic dependent launch (sm_90+): the kernel (and the combine
// kernel after it) are launched with programmatic stream serialization and
// wait for the previous grid on the device, so a launch overlaps the tail of
// the grid before it.
constexpr int kV2Pdl = 1 << 11;
// kV2Lean: the lean loader (decode_mma_kernel.cuh): per-tile bases computed
// before the wait, branch-free copies per row (contiguous caches and pages of
// >= one tile; smaller pages keep the per-row lookups).
constexpr int kV2Lean = 1 << 12;
// kV2Drift (H=128, sm_90, session 20): the drift loop (decode_mma_kernel.cuh,
// MmaLayout<128, true>: one CTA per SM, two groups of warps on alternate tiles fed
// by TMA, no per-tile CTA barrier) wherever it can run (launch_decode_v2.cu,
// drift_plan); elsewhere the cp.async loop. H200, checker, paged page 64, against
// the cp.async loop in the same run: B=16 L=4K 80 -> 83-84%, B=16 L=16K 89 -> 89%,
// B=64 L=4K 89 -> 89% of the read bandwidth (perf.md, session 20).
constexpr int kV2Drift = 1 << 13;
// kV2SwapAB (with kV2Drift; session 42): the drift loop computes S^T = K Q^T and
// O^T += V^T P^T (decode_mma_kernel<128, *, true, true>), the query rows in n8 tiles:
// at <= 8 rows per KV head (G * Tq) half the mma and half the rescaled accumulators.
// H200 checker, same call, against the plain drift loop: B=16 L=4K 85 -> 86%, B=64 L=4K
// 90 -> 91%, B=16 L=16K 90 -> 90% (perf.md session 42 run 2; that build had it behind a
// macro). Not in kV2Default until it has run through JAX as this runtime bit
// (build/s42r3.sh; no device was lent for it in session 42).
constexpr int kV2SwapAB = 1 << 14;
// kV2Regs (H=128, at most 8 query rows per KV head; session 43): the register-streaming
// loop (decode_reg_loop.cuh; decode_mma_kernel<128, *, kLoopRegs>): 8 warps, each
// loading its own 16-key groups of K and V straight into registers (two groups in
// flight), no shared-memory ring and no barrier in the loop, swapped orientation.
// Taken before kV2Drift where its plan allows (launch_decode_v2.cu, reg_plan).
// Written without a GPU (session 43); session 44 on an H100: every GPU test and the
// float64 checker pass, memcheck clean, but it read 1-3 points less of the read
// bandwidth than the drift loop through JAX there. On the H200 (session 45, decode.py,
// paged page 64, two rounds, against the drift loop in the same run) it reads more on
// every row: B=16 L=4K 79-80 -> 84-85%, B=16 L=16K 85-86 -> 91-92%, B=64 L=4K 86-87 ->
// 90-92%, B=64 L=16K 89 -> 95%. In kV2Default since session 45, on devices whose peak
// DRAM bandwidth is at least kRegsMinPeakGBs (the H200's 4.9 TB/s, not the H100's 3.35:
// there the drift loop stays); kV2RegsAnywhere runs it on any device (tests, A/B runs).
constexpr int kV2Regs = 1 << 15;
constexpr int kV2RegsAnywhere = 1 << 16;
constexpr int kRegsMinPeakGBs = 4000;
// Bits 17-18 (kV2WarmShift; the register loop with kV2Pdl, session 46): 16-key groups
// per warp (0-3) whose K and V lines each CTA prefetches into L2 before it waits for
// the previous grid (decode_reg_loop.cuh, reg_loop_warm_l2), and the combine kernel
// lets the next grid launch as soon as it starts: back-to-back decode calls (a model's
// layers) put the DRAM to work during the previous call's tail.
constexpr int kV2WarmShift = 17;
constexpr int kV2Old = 0;
constexpr int kV2New = kV2Hoist | (2 << kV2PrefetchShift);
// kV2Short: the short-context candidate for the default (H200 run 1 of the
// issue-9 helper, every row configuration it runs measured there: B=16 L=4K
// 65% -> 72% of read bandwidth, B=32 L=4K 75% -> 81%, B=16 L=16K 82% -> 85%,
// L=64K rows and B=64 L=4K unchanged plans). kV2ShortLong adds long chunks
// (one wave of 16K-32K-key chunks at L=16K-64K): float64-checked in part,
// not yet timed as such.
constexpr int kV2Short = kV2Hoist | kV2Waves | kV2Cluster;
constexpr int kV2ShortLong = kV2Short | kV2LongChunks;
// kV2Default: what decode_fwd(version 2) runs since session 16: kV2Short with the
// lean loader and PDL. H200, paged page 64, against kV2Short in the same run: the
// plain build (what ships) B=16 L=4K 71 -> 73% of the read bandwidth, B=16 L=16K
// 79 -> 82%, B=64 L=4K 80 -> 80% (checker); through JAX -3..+6 points (B=64 L=64K
// 81 -> 87%). Since session 17 the kernel reads each tile's V fragments before the
// softmax (what ptxas had done only in the timeline build): the default reads 90 / 89
// / 80% at B=64 L=4K / B=16 L=16K / B=16 L=4K in the checker (perf.md, session 17).
// Session 45: kV2Regs added (above); the drift loop runs where the register loop does not:
// devices below kRegsMinPeakGBs, more than 8 query rows per KV head, forced chunks of no
// multiple of 16 keys.
// Session 46: with 1 group a warp of L2 warm-up (kV2WarmShift; the register loop only).
// H200, B=16 L=4K, same runs: checker (back-to-back PDL calls) 88-89 -> 91% (warm 2:
// 91-92%), through JAX (decode.py, 8 layers a step) 83 -> 85% (warm 2: 82%, inside
// that run's +-2); other rows within 1 point. H100, the register loop forced: checker
// 93 -> 97% (warm 2), through JAX +-1 (perf.md, session 46).
// Session 47, through JAX with the slope timing (read bandwidth 4664 GB/s): the nine issue-9
// rows read 85.9-94.5% (issue 9's bar met); the same bits without the warm-up read 0.2-1.3
// points more in that run. Kept for the checker's +2-3 until a same-run repeat says whether
// that is noise (perf.md, session 47).
constexpr int kV2Default = kV2Short | kV2Lean | kV2Pdl | kV2Drift | kV2Regs | (1 << kV2WarmShift);
// Before: kV2Short (session 6; before it kV2Hoist, hoisted
// page lookups alone: -DJAXATTN_DECODE_V2_VARIANT=kV2Hoist builds that). H200, session 4
// (scripts/decode_standalone.sh, page 64, shuffled pages, B=64 L=16K): old 58%,
// hoist 89%, hoist + prefetch 2 78% of read bandwidth (the L2 prefetch costs
// contiguous caches 10 points too); identity page tables ran as fast as shuffled
// ones, so address translation was not the cost, the per-row lookups were.
#ifndef JAXATTN_DECODE_V2_VARIANT
#define JAXATTN_DECODE_V2_VARIANT kV2Default
#endif
constexpr int kDecodeV2DefaultVariant = JAXATTN_DECODE_V2_VARIANT;

// Tests and benchmarks: the split count version 2 would run `p` with, and
// whether its chunks merge in a cluster (no launch; sets up the kernel's
// shared-memory limit on first use like a launch does). 0 when version 1 would run.
int decode_v2_plan_splits(const AttnParams& p, int forced_chunk, int variant, bool* cluster);

#ifdef JAXATTN_DECODE_TIMELINE
// Profiling builds (decode_check --timeline): where decode_mma_kernel records
// its per-CTA phase stamps (buf [max_calls][ctas][8], calls [ctas] zeroed;
// buf = nullptr: off).
cudaError_t decode_timeline_set(unsigned long long* buf, unsigned* calls, int max_calls, int ctas);
namespace decode {
constexpr int kTimelineMarksHost = 8;  // = kTimelineMarks (decode_mma_kernel.cuh)
}
#endif

// The two versions (decode_fwd dispatches; same contract). `variant`: kV2* bits.
LaunchStatus decode_fwd_v1(const AttnParams& p, cudaStream_t stream, int forced_chunk);
LaunchStatus decode_fwd_v2(const AttnParams& p, cudaStream_t stream, int forced_chunk,
                           int variant = kDecodeV2DefaultVariant);

}  // namespace jaxattn::cuda
