// Host launcher template of the Hopper backward: the shared preprocess kernel
// (dpsum, zeroed dQ accumulator), the seven tensor maps, the main kernel on a grid
// of (key blocks, kv heads, batch) (or the tail split's 1-D grid, sm90/bwd_tail.cuh,
// with its partial sums' memset before and conversion after) and the shared dQ
// conversion. Included only by
// the per-head-dim bwd_hdim*.cu files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "common/bwd_prepost.cuh"
#include "common/device.h"
#include "sm90/causal_groups.h"
#include "sm90/bwd_dispatch.h"
#include "sm90/bwd_kernel.cuh"
#include "sm90/bwd_tail.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/doc_tiles.h"
#include "sm90/tma_descriptors.cuh"

namespace jaxattn::sm90 {

// The variant flash_bwd_sm90 uses (kDefault), from H200 measurements.
// Pingpong wins 1-5% at head dim 64 over the split with the mid-step barrier and
// lost up to 7% at 128 (session 5), so only head dim 64 has it. With dQ one step
// late (BwdTraits::kSkewDq, split only) the split beats it at head dim 64 causal
// (+4-5% at T = 4K / 16K, -2% at 1K) and loses non-causal (-3 to -8%): session 14.
// Masked calls keep the pingpong at 64 (not measured with the late dQ). H=64 takes the
// 128-query row steps where they apply (run_bwd: unmasked, not deterministic): causal
// since session 30 (run 1: +4-6% over the split at T = 1K / 4K / 16K), non-causal since
// session 44 (H100, same SMs and clocks as the H200; against the pingpong, two rounds:
// +2.2-2.4% at T = 16K, +1.5-3.4% at 4K, +2.5-3.6% at 1K).
inline BwdVariant default_bwd_variant(int head_dim) {
  return head_dim == 64 ? BwdVariant::kRows : BwdVariant::kSplitHeadDim;
}

// grouped: the causal grid goes in groups of heads (sm90/causal_groups.h; kDefault
// only, so the explicit variants time and check the usual grid beside it).
template <class Tr>
cuda::LaunchStatus launch_bwd(const AttnParams& p, cudaStream_t stream, bool grouped = false) {
  using Elem = typename Tr::Elem;
  constexpr int kHeadDim = Tr::kHeadDim;
  const char* name = "flash_bwd_sm90";
  cudaError_t e = cuda::launch_bwd_preprocess<Elem>(p, stream);
  if (e != cudaSuccess) return {e, "flash_bwd_preprocess"};

  BwdParams kp;
  auto map16 = [&](CUtensorMap* m, const void* base, int rows, int heads, int64_t bs, int64_t rs, int64_t hs,
                   int box_rows, int box_chunks) {
    if (e == cudaSuccess)
      e = make_tmap_bshd(m, base, p.dtype, p.batch, rows, heads, kHeadDim, bs, rs, hs, box_rows, box_chunks);
  };
  const int T = p.seqlen_q, S = p.seqlen_k, N = p.num_heads, K = p.num_heads_k;
  map16(&kp.tm_q, p.q, T, N, p.q_batch_stride, p.q_row_stride, p.q_head_stride, Tr::kBlockM, Tr::kChunks);
  map16(&kp.tm_do, p.dout, T, N, p.o_batch_stride, p.o_row_stride, p.o_head_stride, Tr::kBlockM, Tr::kChunks);
  map16(&kp.tm_k, p.k, S, K, p.k_batch_stride, p.k_row_stride, p.k_head_stride, Tr::kBlockN, Tr::kChunks);
  map16(&kp.tm_v, p.v, S, K, p.v_batch_stride, p.v_row_stride, p.v_head_stride, Tr::kBlockN, Tr::kChunks);
  map16(&kp.tm_dk, p.dk, S, K, p.k_batch_stride, p.k_row_stride, p.k_head_stride, 64, 1);
  map16(&kp.tm_dv, p.dv, S, K, p.v_batch_stride, p.v_row_stride, p.v_head_stride, 64, 1);
  if (e == cudaSuccess)
    e = make_tmap_bshd_f32(&kp.tm_dq, p.dq_accum, p.batch, T, N, kHeadDim, Tr::kDqRows, Tr::kDqChunks);
  if (e != cudaSuccess) return {e, "flash_bwd_sm90 (cuTensorMapEncodeTiled)"};

  kp.args.lse = p.lse;
  kp.args.dpsum = p.dpsum;
  kp.args.dq_semaphore = p.deterministic ? p.dq_semaphore : nullptr;
  if (p.deterministic) {
    e = cuda::clear_dq_semaphore(p, stream);
    if (e != cudaSuccess) return {e, "flash_bwd_sm90 (semaphore memset)"};
  }
  kp.args.seqlen_q = T;
  kp.args.seqlen_k = S;
  kp.args.num_heads = N;
  kp.args.group = N / K;
  kp.args.scale = p.scale;
  kp.args.scale_log2 = (p.softcap > 0.f ? 1.f : p.scale) * static_cast<float>(M_LOG2E);
  kp.args.attn = p;
  kp.args.tail_first = kp.args.tail_slices = 0;
  kp.args.causal_groups = 0;
  kp.args.n_kblocks = (S + Tr::kBlockN - 1) / Tr::kBlockN;

  // Masked calls: one instantiation (the causal mask is part of the MaskView), and
  // one on the grid of document tiles (packed documents, T == S; not the wide tiles,
  // whose 64 keys are not the documents' 128-row tiles; never deterministic: the
  // ordered dQ adds go by key block).
  // (Row steps, Tr::kRows: unmasked only; run_bwd sends masked calls elsewhere.)
  const bool doc_tiles =
      !Tr::kWide && !Tr::kRows && p.has_masks() && !p.deterministic && doc_tiles_apply(p, Tr::kBlockN);
  void (*kernel)(const BwdParams) = nullptr;
  if constexpr (Tr::kRows) {
    if (p.has_masks() || p.deterministic) return {cudaErrorInvalidValue, "flash_bwd_sm90 (row steps: unmasked only)"};
    kernel = p.is_causal ? flash_bwd_sm90_kernel<Tr, true> : flash_bwd_sm90_kernel<Tr, false>;
  } else {
    kernel = doc_tiles       ? flash_bwd_sm90_kernel<Tr, false, true, !Tr::kWide>
             : p.has_masks() ? flash_bwd_sm90_kernel<Tr, false, true>
             : p.is_causal   ? flash_bwd_sm90_kernel<Tr, true>
                             : flash_bwd_sm90_kernel<Tr, false>;
  }
  if (!doc_tiles) kp.args.attn.doc_tiles = nullptr;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (e != cudaSuccess) return {e, name};
  dim3 grid((S + Tr::kBlockN - 1) / Tr::kBlockN, K, p.batch);
  if (doc_tiles) {
    e = build_doc_tiles(p, stream, /*key_tiles=*/true);
    if (e != cudaSuccess) return {e, "build_doc_tiles"};
    grid.x = cuda::doc_tile_capacity(S);
  }
  // Tail split (sm90/bwd_tail.cuh): the last (units mod SMs) units cut into query-range
  // slices. Not at head dim 256: there the last wave's CTAs already run faster with half
  // the SMs idle, and the slices cost what the tail saves (split by query columns,
  // session 31 run 4: -1.6 / 0%; role split, session 34 run 3: -1 to -3% at T=16K, 0 to
  // -1.6% at 4K, standalone non-causal).
  int tail_units = 0;  // units split (R), each into kp.args.tail_slices CTAs
  if (p.dkv_tail && !Tr::kWide && !doc_tiles && !p.has_masks() && !p.is_causal && !p.deterministic && !Tr::kRows) {
    const int units = kp.args.n_kblocks * K * p.batch;
    const int sms = cuda::device_sms();
    const int slices = bwd_tail_slices(units, sms, (T + Tr::kBlockM - 1) / Tr::kBlockM, p.dkv_tail_units,
                                       kHeadDim == 64 ? 3.0 : 8.0);
    if (slices > 0) {
      tail_units = units % sms;
      kp.args.tail_first = units - tail_units;
      kp.args.tail_slices = slices;
      grid = dim3(units - tail_units + tail_units * slices, 1, 1);
      e = cudaMemsetAsync(p.dkv_tail, 0, size_t(tail_units) * 2 * kTailRows * kHeadDim * sizeof(float), stream);
      if (e != cudaSuccess) return {e, "flash_bwd_sm90 (tail memset)"};
    }
  }
  if (kBwdCausalGroupsF10 > 0 && grouped && p.is_causal && !p.has_masks() && !p.deterministic && !doc_tiles) {
    const int heads = K * p.batch;
    kp.args.causal_groups = causal_groups(heads, kp.args.n_kblocks, cuda::device_sms(), kBwdCausalGroupsF10);
    grid = dim3(kp.args.n_kblocks * heads, 1, 1);
  }
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(kp);
  e = cudaGetLastError();
  if (e != cudaSuccess) return {e, name};
  if (tail_units > 0) {
    bwd_tail_convert_kernel<Elem, Tr::kBlockN, kHeadDim>
        <<<dim3(tail_units, 2), 256, 0, stream>>>(p, kp.args.tail_first, kp.args.n_kblocks);
    e = cudaGetLastError();
    if (e != cudaSuccess) return {e, "flash_bwd_sm90 (tail convert)"};
  }

  e = cuda::launch_bwd_convert_dq<Elem>(p, stream);
  return {e, e == cudaSuccess ? "" : "flash_bwd_convert_dq"};
}

template <int kHeadDim, typename Elem>
cuda::LaunchStatus run_bwd(const AttnParams& p, cudaStream_t stream, BwdVariant variant) {
  const bool plain_causal = p.is_causal && !p.has_masks();
  const bool grouped = variant == BwdVariant::kDefault;
  if (variant == BwdVariant::kDefault) variant = default_bwd_variant(kHeadDim);
  if constexpr (kHeadDim == 64) {
    // 128-query steps: unmasked, non-deterministic calls; the others take what they
    // would otherwise, deterministic causal the split, the rest the pingpong.
    if (variant == BwdVariant::kRows) {
      const bool rows = !p.has_masks() && !p.deterministic;
      if (rows) return launch_bwd<BwdTraits<kHeadDim, Elem, false, true>>(p, stream, grouped);
      variant = plain_causal ? BwdVariant::kSplitHeadDim : BwdVariant::kPingpong;
    }
    if (variant == BwdVariant::kPingpong) return launch_bwd<BwdTraits<kHeadDim, Elem, true>>(p, stream, grouped);
  }
  return launch_bwd<BwdTraits<kHeadDim, Elem, false>>(p, stream, grouped);
}

}  // namespace jaxattn::sm90

// Explicit instantiations for one head dim, both element types.
#define JAXATTN_SM90_BWD_INSTANTIATE(HD)                                                                  \
  template jaxattn::cuda::LaunchStatus jaxattn::sm90::run_bwd<HD, __nv_bfloat16>(                        \
      const jaxattn::AttnParams&, cudaStream_t, jaxattn::sm90::BwdVariant);                               \
  template jaxattn::cuda::LaunchStatus jaxattn::sm90::run_bwd<HD, __half>(const jaxattn::AttnParams&,       \
                                                                          cudaStream_t, jaxattn::sm90::BwdVariant);
