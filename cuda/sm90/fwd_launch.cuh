// Host launcher template of the Hopper forward: builds the four tensor maps, picks
// the kernel instantiation (causal x main-loop variant) and launches it on a grid of
// (query tiles, heads, batch). Included only by the per-head-dim fwd_hdim*.cu files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "sm90/fwd_dispatch.h"
#include "sm90/fwd_kernel.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/tma_descriptors.cuh"

namespace jaxattn::sm90 {

// The main-loop schedule used by flash_fwd_sm90, from H200 measurements (bf16,
// B*T = 16384, N*H = 2048): overlap + pingpong wins at H 64/128 (e.g. H=64 T=16K
// 446 vs 397 TFLOP/s, H=128 causal T=4K 520 vs 455); at H=256 (kBlockN = 64) plain
// overlap is ahead by 1-3%. At H=64 with T >= 2048, three consumer warpgroups
// (192-row tiles) beat it: T=16K 496 vs 456 (causal 489 vs 436), T=4K 465 vs 441
// (causal 395 vs 384); at T=1024 they lose (361 vs 370, causal 236 vs 253): fewer,
// longer tiles. (2048 is between the measured 1024 and 4096.)
inline FwdVariant default_variant(int head_dim, bool causal, int seqlen_q) {
  (void)causal;
  if (head_dim == 64 && seqlen_q >= 2048) return FwdVariant::kOverlap3;
  return head_dim <= 128 ? FwdVariant::kOverlapPingpong : FwdVariant::kOverlap;
}

// Builds the tensor maps for the tile shape of Tr and launches `kernel` on its grid.
template <class Tr>
cuda::LaunchStatus launch_fwd(const AttnParams& p, cudaStream_t stream, void (*kernel)(const FwdParams)) {
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
  kp.args.seqlen_k = p.seqlen_k;
  kp.args.num_heads = p.num_heads;
  kp.args.group = p.num_heads / p.num_heads_k;
  kp.args.scale = p.scale;
  kp.args.scale_log2 = p.scale * static_cast<float>(M_LOG2E);

  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (e != cudaSuccess) return {e, name};
  const dim3 grid((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, p.num_heads, p.batch);
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(kp);
  e = cudaGetLastError();
  return {e, e == cudaSuccess ? "" : name};
}

// The kernel instantiation (causal x schedule) for a tile shape.
template <class Tr, bool kOverlap, bool kPingpong>
auto fwd_kernel_for(bool causal) -> void (*)(const FwdParams) {
  return causal ? flash_fwd_sm90_kernel<Tr, true, kOverlap, kPingpong>
                : flash_fwd_sm90_kernel<Tr, false, kOverlap, kPingpong>;
}

template <int kHeadDim, typename Elem>
cuda::LaunchStatus run_fwd(const AttnParams& p, cudaStream_t stream, FwdVariant variant) {
  using Tr = FwdTraits<kHeadDim, Elem>;
  if (variant == FwdVariant::kDefault) variant = default_variant(kHeadDim, p.is_causal, p.seqlen_q);
  const bool c = p.is_causal;
  switch (variant) {
    case FwdVariant::kSerial:
      return launch_fwd<Tr>(p, stream, fwd_kernel_for<Tr, false, false>(c));
    case FwdVariant::kOverlapPingpong:
      return launch_fwd<Tr>(p, stream, fwd_kernel_for<Tr, true, true>(c));
    case FwdVariant::kSerialPingpong:
      return launch_fwd<Tr>(p, stream, fwd_kernel_for<Tr, false, true>(c));
    case FwdVariant::kOverlap3:
      if constexpr (kHeadDim == 64) {
        using Tr3 = FwdTraits<kHeadDim, Elem, 3>;
        return launch_fwd<Tr3>(p, stream, fwd_kernel_for<Tr3, true, false>(c));
      }
      [[fallthrough]];
    default:
      return launch_fwd<Tr>(p, stream, fwd_kernel_for<Tr, true, false>(c));
  }
}

}  // namespace jaxattn::sm90

// Explicit instantiations for one head dim, both element types.
#define JAXATTN_SM90_FWD_INSTANTIATE(HD)                                                          \
  template jaxattn::cuda::LaunchStatus jaxattn::sm90::run_fwd<HD, __nv_bfloat16>(                 \
      const jaxattn::AttnParams&, cudaStream_t, jaxattn::sm90::FwdVariant);                       \
  template jaxattn::cuda::LaunchStatus jaxattn::sm90::run_fwd<HD, __half>(const jaxattn::AttnParams&, \
                                                                          cudaStream_t,               \
                                                                          jaxattn::sm90::FwdVariant);
