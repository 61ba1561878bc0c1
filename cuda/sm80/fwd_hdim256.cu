// Forward kernels for head dims up to 256 (bf16, fp16).
#include "sm80/fwd_kernel.cuh"

namespace jaxattn::cuda::sm80 {
template LaunchStatus run_fwd<256, __nv_bfloat16>(const AttnParams&, cudaStream_t);
template LaunchStatus run_fwd<256, __half>(const AttnParams&, cudaStream_t);
}  // namespace jaxattn::cuda::sm80
