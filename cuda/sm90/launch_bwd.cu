// Host entry points of the Hopper backward: the dispatch rule (sm90_bwd_supports)
// and flash_bwd_sm90, which picks the head-dim / element-type instantiation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch.h"
#include "sm90/bwd_dispatch.h"
#include "sm90/bwd_tail.cuh"
#include "sm90/tma_descriptors.cuh"

namespace jaxattn::sm90 {

bool bwd_head_dim_supported(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

cuda::LaunchStatus flash_bwd_sm90_variant(const AttnParams& p, cudaStream_t stream, BwdVariant variant) {
  const bool bf16 = p.dtype == DType::kBF16;
  switch (p.head_dim) {
    case 64:
      return bf16 ? run_bwd<64, __nv_bfloat16>(p, stream, variant) : run_bwd<64, __half>(p, stream, variant);
    case 128:
      return bf16 ? run_bwd<128, __nv_bfloat16>(p, stream, variant) : run_bwd<128, __half>(p, stream, variant);
    case 256:
      return bf16 ? run_bwd<256, __nv_bfloat16>(p, stream, variant) : run_bwd<256, __half>(p, stream, variant);
    default:
      return {cudaErrorInvalidValue, "flash_bwd_sm90 (unsupported head dim)"};
  }
}

}  // namespace jaxattn::sm90

namespace jaxattn::cuda {

bool sm90_bwd_supports(const AttnParams& p, int cc_major, int cc_minor) {
  if (cc_major != 9 || cc_minor != 0) return false;  // sm_90a code runs on 9.0 only
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) return false;
  if (!sm90::bwd_head_dim_supported(p.head_dim)) return false;
  if (p.num_heads_k <= 0 || p.num_heads <= 0 || p.num_heads % p.num_heads_k != 0) return false;
  if (p.batch < 0 || p.batch > 65535 || p.num_heads_k > 65535) return false;
  if (p.seqlen_q < 0 || p.seqlen_k < 1) return false;  // S = 0 (dq = 0): the portable path
  if (p.batch == 0 || p.seqlen_q == 0) return false;   // nothing to compute: the portable path
  if (!p.lse || !p.dout || !p.dq || !p.dk || !p.dv || !p.dq_accum || !p.dpsum) return false;
  if (reinterpret_cast<uintptr_t>(p.dq_accum) % 16 != 0) return false;
  if (p.deterministic && !p.dq_semaphore) return false;
  if (p.bias || p.mask || p.dbias) return false;  // dense bias / mask: the portable kernels
  using sm90::tmap_bshd_ok;
  const int B = p.batch, T = p.seqlen_q, S = p.seqlen_k, N = p.num_heads, K = p.num_heads_k;
  if (!tmap_bshd_ok(p.q, B, T, N, p.q_batch_stride, p.q_row_stride, p.q_head_stride) ||
      !tmap_bshd_ok(p.dout, B, T, N, p.o_batch_stride, p.o_row_stride, p.o_head_stride) ||
      !tmap_bshd_ok(p.k, B, S, K, p.k_batch_stride, p.k_row_stride, p.k_head_stride) ||
      !tmap_bshd_ok(p.v, B, S, K, p.v_batch_stride, p.v_row_stride, p.v_head_stride) ||
      !tmap_bshd_ok(p.dk, B, S, K, p.k_batch_stride, p.k_row_stride, p.k_head_stride) ||
      !tmap_bshd_ok(p.dv, B, S, K, p.v_batch_stride, p.v_row_stride, p.v_head_stride))
    return false;
  // The preprocess / convert kernels read o and write dq with 16-byte accesses.
  if (reinterpret_cast<uintptr_t>(p.o) % 16 != 0 || reinterpret_cast<uintptr_t>(p.dq) % 16 != 0) return false;
  return sm90::get_encode_tiled() != nullptr;  // a driver with TMA tensor maps
}

int sm90_bwd_tail_rows() { return sm90::kTailRows; }

LaunchStatus flash_bwd_sm90(const AttnParams& p, cudaStream_t stream) {
  return sm90::flash_bwd_sm90_variant(p, stream, sm90::BwdVariant::kDefault);
}

}  // namespace jaxattn::cuda
