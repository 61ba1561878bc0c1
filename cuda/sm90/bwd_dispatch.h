// Internal entry points of the Hopper backward (below launch.h's flash_bwd_sm90):
// one launcher per head dim and element type (instantiated in bwd_hdim*.cu).
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "launch.h"

namespace jaxattn::sm90 {

// Schedules of the Hopper backward: kSplitHeadDim issues each step's dQ one step late
// (BwdTraits::kSkewDq; head dims 64 / 128); kPingpong (head dim 64; elsewhere the same
// as kSplitHeadDim) keeps dQ in its step and has the two consumer warpgroups take
// turns issuing their wgmma bursts; kRows (head dim 64, causal, unmasked and not
// deterministic; the others take the kernel kDefault would) steps of 128 query rows
// (bwd_mainloop_rows.cuh). kDefault: the measured best (see default_bwd_variant).
enum class BwdVariant : int { kSplitHeadDim = 0, kPingpong = 1, kRows = 2, kDefault = 3 };
constexpr int kNumBwdVariants = 3;  // the explicit ones

// Enqueues preprocess, the main kernel and the dQ conversion; `p` already validated.
template <int kHeadDim, typename Elem>
cuda::LaunchStatus run_bwd(const AttnParams& p, cudaStream_t stream, BwdVariant variant);

// flash_bwd_sm90 with a chosen variant.
cuda::LaunchStatus flash_bwd_sm90_variant(const AttnParams& p, cudaStream_t stream, BwdVariant variant);

// Whether the Hopper backward has kernels for this head dim (the dispatch list).
bool bwd_head_dim_supported(int head_dim);

}  // namespace jaxattn::sm90
