// Head-dim / dtype dispatch of the sm80 launchers, and the checks they make
// before enqueueing anything. run_fwd / run_bwd are defined in fwd_kernel.cuh
// and bwd_kernel.cuh and instantiated one head dim per .cu file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"
#include "launch.h"
#include "sm80/tile_config.cuh"

namespace jaxattn::cuda::sm80 {

template <int kHeadDim, typename Elem>
LaunchStatus run_fwd(const AttnParams& p, cudaStream_t stream);
template <int kHeadDim, typename Elem>
LaunchStatus run_bwd(const AttnParams& p, cudaStream_t stream);

// What the kernels assume of the call: 16-bit dtype, head_dim % 8 == 0 and
// <= 256, N % K == 0, 16-byte aligned tensors and rows (strides % 8 == 0),
// grid dims within limits; the backward also needs its workspace.
inline bool params_supported(const AttnParams& p, bool backward) {
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) return false;
  if (p.head_dim < 8 || p.head_dim > 256 || p.head_dim % 8 != 0) return false;
  if (p.num_heads <= 0 || p.num_heads_k <= 0 || p.num_heads % p.num_heads_k != 0) return false;
  if (p.batch > 65535 || p.num_heads > 65535 || p.seqlen_q < 0 || p.seqlen_k < 0) return false;
  auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  auto strides_ok = [](int64_t a, int64_t b, int64_t c) {
    return a % 8 == 0 && b % 8 == 0 && c % 8 == 0;
  };
  if (!aligned(p.q) || !aligned(p.k) || !aligned(p.v) || !aligned(p.o)) return false;
  if (!strides_ok(p.q_batch_stride, p.q_row_stride, p.q_head_stride) ||
      !strides_ok(p.k_batch_stride, p.k_row_stride, p.k_head_stride) ||
      !strides_ok(p.v_batch_stride, p.v_row_stride, p.v_head_stride) ||
      !strides_ok(p.o_batch_stride, p.o_row_stride, p.o_head_stride))
    return false;
  if (backward) {
    if (!aligned(p.dout) || !aligned(p.dq) || !aligned(p.dk) || !aligned(p.dv)) return false;
    if (p.dq_accum == nullptr || p.dpsum == nullptr || !aligned(p.dq_accum)) return false;
    if (p.deterministic && p.dq_semaphore == nullptr) return false;
  } else if (p.lse == nullptr) {
    return false;
  }
  return true;
}

// Calls Run<kHeadDim, Elem>::run for p's dtype.
template <template <int, typename> class Run, int kHeadDim>
LaunchStatus dispatch_dtype(const AttnParams& p, cudaStream_t stream) {
  return p.dtype == DType::kBF16 ? Run<kHeadDim, __nv_bfloat16>::run(p, stream)
                                 : Run<kHeadDim, __half>::run(p, stream);
}

// Calls Run<kHeadDim, Elem>::run for the kernel family covering p.head_dim.
template <template <int, typename> class Run>
LaunchStatus dispatch(const AttnParams& p, cudaStream_t stream) {
  switch (padded_head_dim(p.head_dim)) {
    case 32: return dispatch_dtype<Run, 32>(p, stream);
    case 64: return dispatch_dtype<Run, 64>(p, stream);
    case 96: return dispatch_dtype<Run, 96>(p, stream);
    case 128: return dispatch_dtype<Run, 128>(p, stream);
    case 192: return dispatch_dtype<Run, 192>(p, stream);
    default: return dispatch_dtype<Run, 256>(p, stream);
  }
}

}  // namespace jaxattn::cuda::sm80
