// Host entry points of the CUDA backends: what the FFI handlers call.
//
// Each launcher enqueues its kernels on `stream` and returns at once: no host
// synchronisation, no allocation, so it can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace jaxattn::cuda {

// What a launch reports: the first CUDA error and the kernel that raised it.
struct LaunchStatus {
  cudaError_t error = cudaSuccess;
  const char* kernel = "";
  bool ok() const { return error == cudaSuccess; }
};

// Portable path (mma.sync, sm_80+). Supports bf16/fp16, head_dim % 8 == 0 and
// head_dim <= 256, any T, S, GQA/MQA, causal; local windows, per-batch lengths,
// segment ids, the soft cap, the dense bias (dbias when p.dbias is set) and mask.
// Forward writes o and lse.
LaunchStatus flash_fwd_sm80(const AttnParams& p, cudaStream_t stream);
// Backward reads q, k, v, o, lse, dout; uses dq_accum and dpsum (workspace);
// writes dq, dk, dv.
LaunchStatus flash_bwd_sm80(const AttnParams& p, cudaStream_t stream);

// Hopper path (TMA + wgmma, sm_90a; built only when sm_90 is targeted).
// Whether the Hopper forward covers `p` on a device of compute capability
// `cc_major`.`cc_minor` (the dispatch rule; everything else runs on sm80).
bool sm90_fwd_supports(const AttnParams& p, int cc_major, int cc_minor);
// Forward writes o and lse, like flash_fwd_sm80.
LaunchStatus flash_fwd_sm90(const AttnParams& p, cudaStream_t stream);
// Whether the Hopper backward covers `p` (same idea as sm90_fwd_supports).
bool sm90_bwd_supports(const AttnParams& p, int cc_major, int cc_minor);
// Backward, like flash_bwd_sm80 (same workspace).
LaunchStatus flash_bwd_sm90(const AttnParams& p, cudaStream_t stream);
// Rows per unit of the Hopper backward's tail-split partial sums (AttnParams::dkv_tail,
// sm90/bwd_tail.cuh).
int sm90_bwd_tail_rows();
// The dispatch rule between the Hopper and the portable kernels, asked by the
// FFI handlers and by jaxattn.kernel_for (bindings/module.cc): the Hopper
// kernel where it covers the call. Both take windows, lengths, segments and
// the soft cap (in deterministic mode too); the dense bias / mask runs the
// portable kernels.
inline bool fwd_on_sm90(const AttnParams& p, int cc_major, int cc_minor) {
#ifdef JAXATTN_WITH_SM90
  return sm90_fwd_supports(p, cc_major, cc_minor);
#else
  (void)p, (void)cc_major, (void)cc_minor;
  return false;
#endif
}
inline bool bwd_on_sm90(const AttnParams& p, int cc_major, int cc_minor) {
#ifdef JAXATTN_WITH_SM90
  return sm90_bwd_supports(p, cc_major, cc_minor);
#else
  (void)p, (void)cc_major, (void)cc_minor;
  return false;
#endif
}
// One-time host set-up of the Hopper path (looks up the driver's tensor-map
// encoder), done when the FFI targets are registered so that no such call
// happens while XLA captures a stream into a CUDA graph. Harmless without a
// driver.
void sm90_prepare();

}  // namespace jaxattn::cuda
