// Internal entry points of the Hopper forward (below launch.h's flash_fwd_sm90):
// one launcher per head dim and element type (instantiated in fwd_hdim*.cu), and a
// variant selector for tests and benchmarks.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "launch.h"

namespace jaxattn::sm90 {

// Main-loop schedule. kOverlap: QK(n) and PV(n-1) in flight together; kSerial:
// S -> softmax -> PV one block after the other (simplest, for checking). The
// *Pingpong forms add turn-taking of the two consumer warpgroups' wgmma issue.
// kDefault: the measured best for the shape (default_variant, default_persistent).
// kOverlap3: kOverlap with three consumer warpgroups (192-row tiles) at head dim 64;
// the same as kOverlap at other head dims.
// kPersistent: the default schedule on a persistent grid (one CTA per SM looping
// over the tiles, the next tile's loads overlapping this one's epilogue).
// kChained: the persistent grid's two-warpgroup pingpong with chained tiles and two Q
// buffers (FwdMainloop::consume) at H 64 / 128, at every T (the default runs the
// three-warpgroup kernel at H=64 T >= 2048 and chains the pingpong only where it
// measured faster: default_chained); at H=256 the same as kPersistent.
enum class FwdVariant : int {
  kOverlap = 0,
  kSerial = 1,
  kOverlapPingpong = 2,
  kSerialPingpong = 3,
  kOverlap3 = 4,
  kPersistent = 5,
  kWideKeys = 6,  // wider key blocks: overlap + pingpong with 176 keys at head dim 128
                  // (FA3's non-causal tile), overlap with 80 at 256 (FA3's tile there);
                  // overlap + pingpong with 128 at 64
  kChained = 7,
  kDefault = 8
};
constexpr int kNumFwdVariants = 8;  // the explicit ones

// Launches the forward for one head dim / element type; `p` already validated.
// Masked calls (p.has_masks()) run their own instantiation whatever `variant` says.
template <int kHeadDim, typename Elem>
cuda::LaunchStatus run_fwd(const AttnParams& p, cudaStream_t stream, FwdVariant variant);

// flash_fwd_sm90 with a chosen main-loop schedule.
cuda::LaunchStatus flash_fwd_sm90_variant(const AttnParams& p, cudaStream_t stream, FwdVariant variant);

// Whether the Hopper forward has kernels for this head dim (the dispatch list).
bool fwd_head_dim_supported(int head_dim);

}  // namespace jaxattn::sm90
