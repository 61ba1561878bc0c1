// Host side of decode version 2 (decode_mma_kernel.cuh): its split plan,
// the one-time per-device set-up of each kernel (shared-memory limit,
// resident CTAs per SM) and the launches.
#include <algorithm>
#include <atomic>

#include "decode/decode_mma_kernel.cuh"
#include "decode/launch_decode.h"

namespace jaxattn::cuda {

using decode::ceil_div;
using decode::DecodePlan;

namespace {

constexpr int kMaxDevices = 64;
constexpr int kRowsPerCta = decode::MmaLayout<64>::kRows;

// CTAs of decode_mma_kernel<H, kBf16> resident per SM on the current device,
// or -1 when a CTA's shared memory does not fit there (GPUs with less than
// ~110 KB per block: version 1 runs instead); the first call per device also
// raises the kernel's dynamic shared-memory limit there. No synchronisation
// (attribute and occupancy queries only).
template <int H, bool kBf16>
int resident_ctas(cudaError_t* err) {
  static std::atomic<int> cache[kMaxDevices];  // 0 = not set up yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  const int slot = std::min(std::max(dev, 0), kMaxDevices - 1);
  int n = cache[slot].load(std::memory_order_acquire);
  if (n != 0) return n;
  using L = decode::MmaLayout<H>;
  int optin = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
      optin < L::kSmemBytes) {
    cache[slot].store(-1, std::memory_order_release);
    return -1;
  }
  auto kernel = decode::decode_mma_kernel<H, kBf16>;
  *err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmemBytes);
  if (*err != cudaSuccess) return 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, L::kThreads, L::kSmemBytes) != cudaSuccess || n < 1)
    n = 1;
  cache[slot].store(n, std::memory_order_release);
  return n;
}

// The split count: at least ~2 waves of CTAs over the resident slots (SMs x
// CTAs per SM): s0 = the fewest splits giving >= 1.9 waves, then among
// [s0, 2 s0] the count whose last wave is the fullest (the fewest on a tie:
// one split needs no combine kernel); chunks of kMinChunk..kMaxChunk keys,
// at most the workspace's splits. A forced chunk overrides. `variant`: the
// loader (kV2* bits), whatever the cache.
DecodePlan plan_v2(const AttnParams& p, int slots, int forced_chunk, int variant) {
  DecodePlan plan{};
  plan.hoist = (variant & kV2Hoist) != 0;
  plan.touch = (variant & kV2Touch) != 0;
  plan.prefetch = (variant >> kV2PrefetchShift) & 15;
  plan.rows = p.seqlen_q * (p.num_heads / p.num_heads_k);
  plan.row_blocks = ceil_div(plan.rows, kRowsPerCta);
  const int64_t span = decode::key_span(p);
  if (forced_chunk > 0) {
    plan.chunk = forced_chunk;
    plan.splits = ceil_div(span, forced_chunk);
    plan.adaptive = false;
    return plan;
  }
  plan.adaptive = true;
  const int64_t pairs = int64_t(p.batch) * p.num_heads_k * plan.row_blocks;
  const int lo = ceil_div(span, decode::kMaxChunk);
  int hi = std::min(std::max(p.num_splits, 1), ceil_div(span, decode::kMinChunk));
  if (p.split_o == nullptr || p.split_lse == nullptr) hi = 1;
  hi = std::max(hi, lo);
  const int s0 = std::min(std::max(ceil_div(19 * int64_t(slots), 10 * pairs), lo), hi);
  double best_eff = -1.0;
  for (int s = s0; s <= std::min(hi, 2 * s0); ++s) {
    DecodePlan cand = plan;
    decode::set_chunks(cand, span, s);
    const double waves = double(pairs) * cand.splits / slots;
    const double eff = waves / std::ceil(waves);
    if (eff > best_eff + 1e-9) {
      best_eff = eff;
      plan.chunk = cand.chunk;
      plan.splits = cand.splits;
    }
  }
  return plan;
}

template <int H, bool kBf16>
LaunchStatus launch(const AttnParams& p, cudaStream_t stream, int forced_chunk, int variant) {
  using L = decode::MmaLayout<H>;
  cudaError_t err = cudaSuccess;
  const int per_sm = resident_ctas<H, kBf16>(&err);
  if (err != cudaSuccess) return {err, "decode_mma_kernel (shared-memory attribute)"};
  if (per_sm < 0) return decode_fwd_v1(p, stream, forced_chunk);  // too little shared memory here
  const DecodePlan plan = plan_v2(p, decode::device_sms() * per_sm, forced_chunk, variant);
  if (plan.splits > std::max(p.num_splits, 1) || (plan.splits > 1 && p.split_o == nullptr))
    return {cudaErrorInvalidValue, "decode_fwd (workspace too small for the row capacity)"};
  if (p.batch > 65535 || p.num_heads_k > 65535) return {cudaErrorInvalidValue, "decode_fwd (grid too large)"};
  const dim3 grid(plan.splits * plan.row_blocks, p.num_heads_k, p.batch);
  decode::decode_mma_kernel<H, kBf16><<<grid, L::kThreads, L::kSmemBytes, stream>>>(p, plan);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return {e, "decode_mma_kernel"};
  if (plan.splits == 1) return {};
  return decode::launch_combine(p, plan, stream);
}

template <bool kBf16>
LaunchStatus launch_head_dim(const AttnParams& p, cudaStream_t stream, int forced_chunk, int variant) {
  switch (p.head_dim) {
    case 64: return launch<64, kBf16>(p, stream, forced_chunk, variant);
    case 128: return launch<128, kBf16>(p, stream, forced_chunk, variant);
    default: return launch<256, kBf16>(p, stream, forced_chunk, variant);
  }
}

}  // namespace

LaunchStatus decode_fwd_v2(const AttnParams& p, cudaStream_t stream, int forced_chunk, int variant) {
  return p.dtype == DType::kBF16 ? launch_head_dim<true>(p, stream, forced_chunk, variant)
                                 : launch_head_dim<false>(p, stream, forced_chunk, variant);
}

}  // namespace jaxattn::cuda
