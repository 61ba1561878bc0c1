// Host entry point of the sm80 forward.
#include "launch.h"
#include "sm80/dispatch.cuh"

namespace jaxattn::cuda {
namespace {
template <int kHeadDim, typename Elem>
struct RunFwd {
  static LaunchStatus run(const AttnParams& p, cudaStream_t s) {
    return sm80::run_fwd<kHeadDim, Elem>(p, s);
  }
};
}  // namespace

LaunchStatus flash_fwd_sm80(const AttnParams& p, cudaStream_t stream) {
  if (!sm80::params_supported(p, /*backward=*/false))
    return {cudaErrorInvalidValue, "flash_fwd_sm80 (unsupported params)"};
  if (p.batch == 0 || p.seqlen_q == 0) return {};
  return sm80::dispatch<RunFwd>(p, stream);
}

}  // namespace jaxattn::cuda
