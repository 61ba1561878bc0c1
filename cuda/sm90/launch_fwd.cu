// Host entry points of the Hopper forward: the dispatch rule (sm90_fwd_supports)
// and flash_fwd_sm90, which picks the head-dim / element-type instantiation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch.h"
#include "sm90/fwd_dispatch.h"
#include "sm90/tma_descriptors.cuh"

namespace jaxattn::sm90 {

bool fwd_head_dim_supported(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

cuda::LaunchStatus flash_fwd_sm90_variant(const AttnParams& p, cudaStream_t stream, FwdVariant variant) {
  if (p.batch == 0 || p.seqlen_q == 0) return {};
  const bool bf16 = p.dtype == DType::kBF16;
  switch (p.head_dim) {
    case 64:
      return bf16 ? run_fwd<64, __nv_bfloat16>(p, stream, variant) : run_fwd<64, __half>(p, stream, variant);
    case 128:
      return bf16 ? run_fwd<128, __nv_bfloat16>(p, stream, variant) : run_fwd<128, __half>(p, stream, variant);
    case 256:
      return bf16 ? run_fwd<256, __nv_bfloat16>(p, stream, variant) : run_fwd<256, __half>(p, stream, variant);
    default:
      return {cudaErrorInvalidValue, "flash_fwd_sm90 (unsupported head dim)"};
  }
}

}  // namespace jaxattn::sm90

namespace jaxattn::cuda {

bool sm90_fwd_supports(const AttnParams& p, int cc_major, int cc_minor) {
  if (cc_major != 9 || cc_minor != 0) return false;  // sm_90a code runs on 9.0 only
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) return false;
  if (!sm90::fwd_head_dim_supported(p.head_dim)) return false;
  if (p.num_heads_k <= 0 || p.num_heads <= 0 || p.num_heads % p.num_heads_k != 0) return false;
  if (p.batch < 0 || p.batch > 65535 || p.num_heads > 65535) return false;
  if (p.seqlen_q < 0 || p.seqlen_k < 1) return false;
  if (p.bias || p.mask) return false;  // dense bias / mask: the portable kernels
  if (p.batch == 0 || p.seqlen_q == 0) return true;  // nothing to launch
  if (!p.lse || !p.o) return false;
  using sm90::tmap_bshd_ok;
  if (!tmap_bshd_ok(p.q, p.batch, p.seqlen_q, p.num_heads, p.q_batch_stride, p.q_row_stride, p.q_head_stride) ||
      !tmap_bshd_ok(p.o, p.batch, p.seqlen_q, p.num_heads, p.o_batch_stride, p.o_row_stride, p.o_head_stride) ||
      !tmap_bshd_ok(p.k, p.batch, p.seqlen_k, p.num_heads_k, p.k_batch_stride, p.k_row_stride, p.k_head_stride) ||
      !tmap_bshd_ok(p.v, p.batch, p.seqlen_k, p.num_heads_k, p.v_batch_stride, p.v_row_stride, p.v_head_stride))
    return false;
  return sm90::get_encode_tiled() != nullptr;  // a driver with TMA tensor maps
}

void sm90_prepare() { (void)sm90::get_encode_tiled(); }

LaunchStatus flash_fwd_sm90(const AttnParams& p, cudaStream_t stream) {
  return sm90::flash_fwd_sm90_variant(p, stream, sm90::FwdVariant::kDefault);
}

}  // namespace jaxattn::cuda
