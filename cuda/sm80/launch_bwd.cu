// Host entry point of the sm80 backward.
#include "launch.h"
#include "sm80/dispatch.cuh"

namespace jaxattn::cuda {
namespace {
template <int kHeadDim, typename Elem>
struct RunBwd {
  static LaunchStatus run(const AttnParams& p, cudaStream_t s) {
    return sm80::run_bwd<kHeadDim, Elem>(p, s);
  }
};
}  // namespace

LaunchStatus flash_bwd_sm80(const AttnParams& p, cudaStream_t stream) {
  if (!sm80::params_supported(p, /*backward=*/true))
    return {cudaErrorInvalidValue, "flash_bwd_sm80 (unsupported params)"};
  if (p.batch == 0 || p.seqlen_q == 0) return {};  // empty outputs; S = 0 gives dq = 0
  return sm80::dispatch<RunBwd>(p, stream);
}

}  // namespace jaxattn::cuda
