// Host launcher template of the Hopper forward: builds the four tensor maps, picks
// the kernel instantiation (causal x main-loop variant) and launches it on a grid of
// (query tiles, heads, batch). Included only by the per-head-dim fwd_hdim*.cu files.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "common/device.h"
#include "sm90/doc_tiles.h"
#include "sm90/fwd_dispatch.h"
#include "sm90/fwd_kernel.cuh"
#include "sm90/fwd_schedule.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/tma_descriptors.cuh"

namespace jaxattn::sm90 {

// The main-loop schedule used by flash_fwd_sm90, from H200 measurements (bf16, B*T =
// 16384, N*H = 2048): overlap + pingpong wins at H 64/128 (e.g. H=64 T=16K 446 vs 397
// TFLOP/s, H=128 causal T=4K 520 vs 455); at H=256 (64-key blocks) plain overlap was
// ahead by 1-3%, so its 80-key kWideKeys runs plain overlap. At H=64 with T >= 2048,
// three consumer warpgroups (192-row tiles) beat it: T=16K 496 vs 456 (causal 489 vs
// 436), T=4K 465 vs 441 (causal 395 vs 384); at T=1024 they lose (361 vs 370, causal
// 236 vs 253): fewer, longer tiles. (2048 is between the measured 1024 and 4096.) At
// H=128 with S >= 8192, 176-key blocks (kWideKeys) beat 128-key ones (session 6,
// round-robin timing: T=16K 651 vs 629 non-causal, 623 vs 596 causal; T=4K +0.7%; T=1K
// -2 / -9%, where fewer, longer blocks leave more of the last block masked). (8192:
// between the measured 4096 and 16384.) At H=256, 80-key blocks (kWideKeys there) beat
// 64-key ones everywhere (session 8, one binary, TFLOP/s grid 80 vs 64: 545 / 677 /
// 726 vs 498 / 578 / 594, causal 373 / 564 / 686 vs 359 / 500 / 586): each S wgmma
// does 25% more work for the same softmax / barrier cost per block.
inline FwdVariant default_variant(int head_dim, int seqlen_q, int seqlen_k) {
  if (head_dim == 64 && seqlen_q >= 2048) return FwdVariant::kOverlap3;
  if (head_dim == 128 && seqlen_k >= 8192) return FwdVariant::kWideKeys;
  if (head_dim == 256) return FwdVariant::kWideKeys;  // 80-key blocks, overlap (no pingpong)
  return FwdVariant::kOverlapPingpong;
}

// Keys per block of kWideKeys at head dim 128: 176 (too large for the O buffer, so
// its persistent form runs 128-key blocks). 160 keys (O buffer kept, so the
// persistent grid frees Q early with wide blocks) measured -3 to +0.5% everywhere
// but causal T=4K (+6%) in session 9 and was not adopted.
constexpr int kWideKeys128 = 176;

// Builds the tensor maps for the tile shape of Tr and launches `kernel` on its grid.
// persistent: a 1-D grid of min(tiles, SMs) CTAs instead of (query tiles, heads, batch).
// masked: with the document tiles' workspace (p.doc_tiles), build_doc_tiles runs first
// and the grid has doc_tile_capacity(T) tile slots per (head, row).
template <class Tr>
cuda::LaunchStatus launch_fwd(const AttnParams& p, cudaStream_t stream, void (*kernel)(const FwdParams),
                              bool persistent, bool masked = false, bool grouped = false) {
  constexpr int kHeadDim = Tr::kHeadDim;
  const char* name = "flash_fwd_sm90";
  FwdParams kp;
  cudaError_t e;
  e = make_tmap_bshd(&kp.tm_q, p.q, p.dtype, p.batch, p.seqlen_q, p.num_heads, kHeadDim, p.q_batch_stride,
                     p.q_row_stride, p.q_head_stride, Tr::kBlockM, Tr::kChunks);
  if (e == cudaSuccess)
    e = make_tmap_bshd(&kp.tm_k, p.k, p.dtype, p.batch, p.seqlen_k, p.num_heads_k, kHeadDim, p.k_batch_stride,
                       p.k_row_stride, p.k_head_stride, Tr::kBlockN, Tr::kChunks);
  if (e == cudaSuccess)
    e = make_tmap_bshd(&kp.tm_v, p.v, p.dtype, p.batch, p.seqlen_k, p.num_heads_k, kHeadDim, p.v_batch_stride,
                       p.v_row_stride, p.v_head_stride, Tr::kBlockN, Tr::kChunks);
  if (e == cudaSuccess)
    e = make_tmap_bshd(&kp.tm_o, p.o, p.dtype, p.batch, p.seqlen_q, p.num_heads, kHeadDim, p.o_batch_stride,
                       p.o_row_stride, p.o_head_stride, 64, 1);
  if (e != cudaSuccess) return {e, "flash_fwd_sm90 (cuTensorMapEncodeTiled)"};

  kp.args.lse = p.lse;
  kp.args.seqlen_q = p.seqlen_q;
  kp.args.batch = p.batch;
  kp.args.seqlen_k = p.seqlen_k;
  kp.args.num_heads = p.num_heads;
  kp.args.group = p.num_heads / p.num_heads_k;
  // With a soft cap the kernel scales and caps the logits itself; the softmax
  // then works on them unscaled.
  const float scale = p.softcap > 0.f ? 1.f : p.scale;
  kp.args.scale = scale;
  kp.args.scale_log2 = scale * static_cast<float>(M_LOG2E);
  kp.args.attn = p;

  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (e != cudaSuccess) return {e, name};
  const int m_tiles = (p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  dim3 grid(m_tiles, p.num_heads, p.batch);
  // (the masked kernels' query tiles are 128 rows, as document tiles: run_masked)
  const bool doc_tiles = masked && doc_tiles_apply(p, Tr::kBlockM);
  if (doc_tiles) {
    e = build_doc_tiles(p, stream);
    if (e != cudaSuccess) return {e, "build_doc_tiles"};
    grid.x = cuda::doc_tile_capacity(p.seqlen_q);
  } else {
    kp.args.attn.doc_tiles = nullptr;
  }
  if (persistent) {
    const int sms = cuda::device_sms();
    const int64_t tiles = (int64_t)m_tiles * p.num_heads * p.batch;
    if (tiles + sms >= (int64_t(1) << 31)) return {cudaErrorInvalidValue, "flash_fwd_sm90 (too many tiles)"};
    grid = dim3((unsigned)std::min<int64_t>(tiles, sms), 1, 1);
    if (p.is_causal) kp.args.sched = make_fwd_schedule(m_tiles, p.num_heads, p.batch, p.num_heads / p.num_heads_k, (int)grid.x);
  }
  kp.args.causal_groups = 0;
  if (kFwdCausalGroupsF10 > 0 && grouped && p.is_causal && !persistent && !masked) {
    const int heads = p.num_heads * p.batch;
    if ((int64_t)m_tiles * heads >= (int64_t(1) << 31)) return {cudaErrorInvalidValue, "flash_fwd_sm90 (too many tiles)"};
    kp.args.causal_groups = causal_groups(heads, m_tiles, cuda::device_sms(), kFwdCausalGroupsF10);
    grid = dim3(m_tiles * heads, 1, 1);
  }
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(kp);
  e = cudaGetLastError();
  return {e, e == cudaSuccess ? "" : name};
}

// Launches the kernel instantiation (causal x schedule x grid x masked) for a tile shape.
template <class Tr, bool kOverlap, bool kPingpong, bool kPersistent, bool kMasked = false>
cuda::LaunchStatus launch_schedule(const AttnParams& p, cudaStream_t stream, bool grouped = false) {
  auto kernel = p.is_causal ? flash_fwd_sm90_kernel<Tr, true, kOverlap, kPingpong, kPersistent, kMasked>
                            : flash_fwd_sm90_kernel<Tr, false, kOverlap, kPingpong, kPersistent, kMasked>;
  return launch_fwd<Tr>(p, stream, kernel, kPersistent, kMasked, grouped);
}

// Masked calls (window, lengths, segments, soft cap) run one schedule per head dim,
// the unmasked default at T < 2048: overlap + pingpong at H 64 / 128, overlap at 256.
template <int kHeadDim, typename Elem>
cuda::LaunchStatus run_masked(const AttnParams& p, cudaStream_t stream) {
  using Tr = FwdTraits<kHeadDim, Elem>;
  return launch_schedule<Tr, true, kHeadDim <= 128, false, true>(p, stream);
}

// One of the explicit schedules (not kPersistent / kDefault) on the (query tiles,
// heads, batch) grid; grouped (the default's causal calls): in groups of heads
// (sm90/causal_groups.h), so the explicit variants time and check the usual grid.
template <int kHeadDim, typename Elem>
cuda::LaunchStatus run_schedule(const AttnParams& p, cudaStream_t stream, FwdVariant variant, bool grouped = false) {
  using Tr = FwdTraits<kHeadDim, Elem>;
  switch (variant) {
    case FwdVariant::kSerial:
      return launch_schedule<Tr, false, false, false>(p, stream, grouped);
    case FwdVariant::kOverlapPingpong:
      return launch_schedule<Tr, true, true, false>(p, stream, grouped);
    case FwdVariant::kSerialPingpong:
      return launch_schedule<Tr, false, true, false>(p, stream, grouped);
    case FwdVariant::kWideKeys:  // (at head dim 64: overlap + pingpong)
      if constexpr (kHeadDim == 128)
        return launch_schedule<FwdTraits<kHeadDim, Elem, 2, kWideKeys128>, true, true, false>(p, stream, grouped);
      if constexpr (kHeadDim == 256)
        return launch_schedule<FwdTraits<kHeadDim, Elem, 2, 80>, true, false, false>(p, stream, grouped);
      return launch_schedule<Tr, true, true, false>(p, stream, grouped);
    case FwdVariant::kOverlap3:
      if constexpr (kHeadDim == 64) return launch_schedule<FwdTraits<kHeadDim, Elem, 3>, true, false, false>(p, stream, grouped);
      [[fallthrough]];
    default:
      return launch_schedule<Tr, true, false, false>(p, stream, grouped);
  }
}

// kPersistent runs the default schedule on the persistent grid: only the schedules
// default_variant picks have persistent instantiations. chained (H 64 / 128): the
// two-warpgroup pingpong with chained tiles and two Q buffers (FwdTraits' kQBuffers_),
// whatever `best` says (the default asks for it only where best is that pingpong).
template <int kHeadDim, typename Elem>
cuda::LaunchStatus run_persistent(const AttnParams& p, cudaStream_t stream, FwdVariant best, bool chained) {
  if constexpr (kHeadDim == 256) {
    (void)best, (void)chained;  // (always kWideKeys at 256)
    return launch_schedule<FwdTraits<kHeadDim, Elem, 2, 80>, true, false, true>(p, stream);
  } else {
    if (chained) return launch_schedule<FwdTraits<kHeadDim, Elem, 2, 0, 2>, true, true, true>(p, stream);
    if constexpr (kHeadDim == 64) {
      if (best == FwdVariant::kOverlap3) return launch_schedule<FwdTraits<kHeadDim, Elem, 3>, true, false, true>(p, stream);
    }
    if constexpr (kHeadDim == 128 && FwdTraits<kHeadDim, Elem, 2, kWideKeys128>::kSeparateO) {
      if (best == FwdVariant::kWideKeys)
        return launch_schedule<FwdTraits<kHeadDim, Elem, 2, kWideKeys128>, true, true, true>(p, stream);
    }
    // overlap + pingpong: kOverlapPingpong, and kWideKeys at 128 where its blocks leave
    // no room for the O buffer (176 keys)
    return launch_schedule<FwdTraits<kHeadDim, Elem>, true, true, true>(p, stream);
  }
}

// Whether the default runs its schedule on the persistent grid. Since O is staged
// apart from Q (kSeparateO, H 64 / 128), the next tile's Q loads during this tile's
// tail and the persistent grid wins (session 8, one binary, TFLOP/s persistent vs
// grid): H=64 1K / 4K / 16K 395 / 506 / 551 vs 397 / 460 / 511 (causal 269 / 414 / 486
// vs 263 / 394 / 476); H=128 548 / 623 / 671 vs 490 / 562 / 637. H=256 (80-key blocks,
// no room for the O buffer) is even non-causal (558 / 678 / 719 vs 545 / 677 / 726) and
// behind causal (328 / 507 / 559 vs 373 / 564 / 686; with session 12's paired causal
// order 376 / 484 / 556 / 581 vs 380 / 498 / 581 / 695 at T = 1K / 2K / 4K / 16K, still
// behind). H=128 causal, since the persistent grid pairs query tiles (session 12,
// fwd_schedule.cuh): ahead everywhere, T = 1K / 2K / 4K 409 / 533 / 597 vs 343 / 438 /
// 510 for the grid, and at 16K 654 vs 623 for the grid's 176-key blocks (the
// persistent form keeps 128). H=256 causal, measured again in sessions 24-25 (six
// standalone runs, persistent vs grid; what moved since session 12 not isolated): ahead
// at T <= 4096 (+1.1 to +2.4% at 1K, +0.3 to +2.4% at 2K, +0.6 to +1.2% at 4K), far
// behind at 16K (614 vs 688); a causal call reads keys only up to its last query row,
// so seqlen_q decides. The grid in groups of heads (sm90/causal_groups.h, the default's
// causal calls on this grid) beats the persistent pairs at 2K (+1-3%) and 4K (+6%),
// session 35 run 6; at 1K the pairs win (438 vs 411, -6%). At H 64 / 128 causal the
// pairs beat the grouped grid at every T (session 36 run 1b, TFLOP/s pairs / grouped:
// H=64 1K-16K 318 (chained 333) / 249, 411 / 336, 468 / 401, 507 / 472, 549 / 512;
// H=128 464 (chained 471) / 367, 576 / 492, 659 / 587, 704 / 656, 722 / 694).
#ifndef JAXATTN_FWD_PERSISTENT_CAUSAL_MAX_Q256
#define JAXATTN_FWD_PERSISTENT_CAUSAL_MAX_Q256 1024
#endif
constexpr int kPersistentCausalMaxQ256 = JAXATTN_FWD_PERSISTENT_CAUSAL_MAX_Q256;
inline bool default_persistent(int head_dim, int seqlen_q, int seqlen_k, bool causal) {
  (void)seqlen_k;
  return !causal || head_dim <= 128 || seqlen_q <= kPersistentCausalMaxQ256;
}

// Whether the default's persistent pingpong (H 64 at T < 2048, H 128) chains its
// tiles. H200, session 24 runs 1-3 (standalone, TFLOP/s chained vs not): H=64 T=1K
// +4-5% non-causal, +5-6.5% causal; H=128 non-causal -1 to +3% (T = 1K..16K), causal
// T = 1K / 2K +3-5 / +0.3-2%, 4K / 16K -1.3 / -2-3%. (The three-warpgroup kernel, the
// H=64 default at T >= 2048, lost 5-15% with chained tiles: run 2.)
inline bool default_chained(FwdVariant best, int seqlen_q, bool causal) {
  return best != FwdVariant::kOverlap3 && (!causal || seqlen_q <= 2048);
}

template <int kHeadDim, typename Elem>
cuda::LaunchStatus run_fwd(const AttnParams& p, cudaStream_t stream, FwdVariant variant) {
  if (p.has_masks()) return run_masked<kHeadDim, Elem>(p, stream);
  const FwdVariant best = default_variant(kHeadDim, p.seqlen_q, p.seqlen_k);
  if (variant == FwdVariant::kPersistent || variant == FwdVariant::kChained)
    return run_persistent<kHeadDim, Elem>(p, stream, best, variant == FwdVariant::kChained);
  if (variant == FwdVariant::kDefault && default_persistent(kHeadDim, p.seqlen_q, p.seqlen_k, p.is_causal))
    return run_persistent<kHeadDim, Elem>(p, stream, best, default_chained(best, p.seqlen_q, p.is_causal));
  if (variant == FwdVariant::kDefault) return run_schedule<kHeadDim, Elem>(p, stream, best, true);
  return run_schedule<kHeadDim, Elem>(p, stream, variant);
}

}  // namespace jaxattn::sm90

// Explicit instantiations for one head dim, both element types.
#define JAXATTN_SM90_FWD_INSTANTIATE(HD)                                                          \
  template jaxattn::cuda::LaunchStatus jaxattn::sm90::run_fwd<HD, __nv_bfloat16>(                 \
      const jaxattn::AttnParams&, cudaStream_t, jaxattn::sm90::FwdVariant);                       \
  template jaxattn::cuda::LaunchStatus jaxattn::sm90::run_fwd<HD, __half>(const jaxattn::AttnParams&, \
                                                                          cudaStream_t,               \
                                                                          jaxattn::sm90::FwdVariant);
