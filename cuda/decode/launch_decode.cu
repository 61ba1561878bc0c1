// Host side of the CUDA decode kernels: the version dispatch, the workspace
// rule, the combine launch, and version 1's plan and launches.
#include <algorithm>

#include "decode/decode_kernel.cuh"
#include "decode/launch_decode.h"

namespace jaxattn::cuda {

using decode::ceil_div;
using decode::DecodePlan;

namespace decode {

LaunchStatus launch_combine(const AttnParams& p, const DecodePlan& plan, cudaStream_t stream) {
  const dim3 grid(plan.rows, p.num_heads_k, p.batch);
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(p.head_dim, 1, 1);
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = plan.pdl ? 1 : 0;
  const cudaError_t e = p.dtype == DType::kBF16 ? cudaLaunchKernelEx(&cfg, decode_combine_kernel<true>, p, plan)
                                                : cudaLaunchKernelEx(&cfg, decode_combine_kernel<false>, p, plan);
  if (e != cudaSuccess) return {e, "decode_combine_kernel"};
  return {};
}

}  // namespace decode

namespace {

template <int H, int RB, int U, bool kBf16>
LaunchStatus launch(const AttnParams& p, const DecodePlan& plan, cudaStream_t stream) {
  const dim3 grid(plan.splits, p.num_heads_k, p.batch * plan.row_blocks);
  decode::decode_split_kernel<H, RB, U, kBf16><<<grid, decode::kThreads, 0, stream>>>(p, plan);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return {e, "decode_split_kernel"};
  return {};
}

// Rows per CTA (1, 2, 4 or 8; plan.row_blocks blocks of 8 above 4 rows) and
// keys per lane-group step (fewer with more rows: registers).
template <int H, bool kBf16>
LaunchStatus launch_rows(const AttnParams& p, const DecodePlan& plan, cudaStream_t stream) {
  if (plan.rows <= 1) return launch<H, 1, 4, kBf16>(p, plan, stream);
  if (plan.rows <= 2) return launch<H, 2, 4, kBf16>(p, plan, stream);
  if (plan.rows <= 4) return launch<H, 4, 4, kBf16>(p, plan, stream);
  return launch<H, 8, 2, kBf16>(p, plan, stream);
}

template <bool kBf16>
LaunchStatus launch_head_dim(const AttnParams& p, const DecodePlan& plan, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_rows<64, kBf16>(p, plan, stream);
    case 128: return launch_rows<128, kBf16>(p, plan, stream);
    default: return launch_rows<256, kBf16>(p, plan, stream);
  }
}

}  // namespace

const char* decode_unsupported_reason(const AttnParams& p) {
  if (p.dtype == DType::kF32) return "the CUDA decode kernel takes bfloat16 or float16";
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    return "the CUDA decode kernel takes head dims 64, 128 and 256";
  if (p.page_size < 0 || (p.block_table != nullptr && p.page_size % 16 != 0))
    return "the CUDA decode kernel needs a page size that is a multiple of 16";
  return "";
}

int decode_max_splits(int capacity, int forced_chunk) {
  // Enough chunks to fill the largest GPUs at batch 1, never a chunk above
  // kMaxChunk; and a forced chunk's count.
  capacity = std::max(capacity, 1);
  const int by_size = ceil_div(capacity, decode::kMinChunk);
  int splits = std::max(std::min(by_size, 64), ceil_div(capacity, decode::kMaxChunk));
  if (forced_chunk > 0) splits = std::max(splits, ceil_div(capacity, forced_chunk));
  return splits;
}

LaunchStatus decode_fwd_v1(const AttnParams& p, cudaStream_t stream, int forced_chunk) {
  DecodePlan plan{};
  plan.rows = p.seqlen_q * (p.num_heads / p.num_heads_k);
  const int rb = plan.rows <= 4 ? 1 : ceil_div(plan.rows, 8);
  const int64_t span = decode::key_span(p);
  // Two waves of CTAs over the SMs, chunks of at least kMinChunk keys, at
  // most the workspace's splits, at most kMaxChunk keys per chunk.
  const int64_t ctas = int64_t(p.batch) * p.num_heads_k * rb;
  int splits = ceil_div(2 * int64_t(device_sms()), ctas);
  splits = std::min(splits, ceil_div(span, decode::kMinChunk));
  splits = std::max(splits, ceil_div(span, decode::kMaxChunk));
  splits = std::max(1, std::min(splits, p.num_splits));
  if (p.split_o == nullptr || p.split_lse == nullptr) splits = 1;
  decode::set_chunks(plan, span, splits);
  if (forced_chunk > 0) {
    plan.chunk = forced_chunk;
    plan.splits = ceil_div(span, forced_chunk);
  }
  if (plan.splits > std::max(p.num_splits, 1) || (plan.splits > 1 && p.split_o == nullptr))
    return {cudaErrorInvalidValue, "decode_fwd (workspace too small for the row capacity)"};
  plan.row_blocks = rb;
  plan.adaptive = false;
  const LaunchStatus s =
      p.dtype == DType::kBF16 ? launch_head_dim<true>(p, plan, stream) : launch_head_dim<false>(p, plan, stream);
  if (!s.ok() || plan.splits == 1) return s;
  return decode::launch_combine(p, plan, stream);
}

LaunchStatus decode_fwd(const AttnParams& p, cudaStream_t stream, int version, int forced_chunk, int variant) {
  if (p.batch <= 0 || p.seqlen_q <= 0) return {};
  if (decode_unsupported_reason(p)[0] != '\0') return {cudaErrorInvalidValue, "decode_fwd (unsupported call)"};
  if (forced_chunk < 0 || forced_chunk > kDecodeMaxForcedChunk)
    return {cudaErrorInvalidValue, "decode_fwd (forced chunk out of range)"};
  switch (version) {
    case 1: return decode_fwd_v1(p, stream, forced_chunk);
    case 2:
      if (variant >= kV2VariantEnd) return {cudaErrorInvalidValue, "decode_fwd (variant out of range)"};
      return variant < 0 ? decode_fwd_v2(p, stream, forced_chunk) : decode_fwd_v2(p, stream, forced_chunk, variant);
    default: return {cudaErrorInvalidValue, "decode_fwd (unknown kernel version)"};
  }
}

}  // namespace jaxattn::cuda
