// Internal entry points of the Hopper backward (below launch.h's flash_bwd_sm90):
// one launcher per head dim and element type (instantiated in bwd_hdim*.cu).
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "launch.h"

namespace jaxattn::sm90 {

// Enqueues preprocess, the main kernel and the dQ conversion; `p` already validated.
template <int kHeadDim, typename Elem>
cuda::LaunchStatus run_bwd(const AttnParams& p, cudaStream_t stream);

// Whether the Hopper backward has kernels for this head dim (the dispatch list).
bool bwd_head_dim_supported(int head_dim);

}  // namespace jaxattn::sm90
