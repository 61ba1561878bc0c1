// Backward kernels for head dims up to 192 (bf16, fp16).
#include "sm80/bwd_kernel.cuh"

namespace jaxattn::cuda::sm80 {
template LaunchStatus run_bwd<192, __nv_bfloat16>(const AttnParams&, cudaStream_t);
template LaunchStatus run_bwd<192, __half>(const AttnParams&, cudaStream_t);
}  // namespace jaxattn::cuda::sm80
