// Host side of the CUDA decode kernels: the split plan and the launches.
#include <algorithm>

#include "decode/decode_kernel.cuh"
#include "decode/launch_decode.h"

namespace jaxattn::cuda {

using decode::DecodePlan;

namespace {

constexpr int kMinChunk = 256;  // keys per chunk, at least (below, the combine costs more than it gains)

int num_sms() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 108;
  return sms;
}

int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

template <int H, int RB, int U, bool kBf16>
LaunchStatus launch(const AttnParams& p, const DecodePlan& plan, cudaStream_t stream) {
  const dim3 grid(plan.splits, p.num_heads_k, p.batch * plan.row_blocks);
  decode::decode_split_kernel<H, RB, U, kBf16><<<grid, decode::kThreads, 0, stream>>>(p, plan);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return {e, "decode_split_kernel"};
  if (plan.splits > 1) {
    const dim3 cgrid(plan.rows, p.num_heads_k, p.batch);
    decode::decode_combine_kernel<kBf16><<<cgrid, H, 0, stream>>>(p, plan);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return {e, "decode_combine_kernel"};
  }
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

int decode_max_splits(int capacity) {
  // Enough chunks to fill the largest GPUs at batch 1, never a chunk above
  // kMaxChunk.
  const int by_size = ceil_div(std::max(capacity, 1), kMinChunk);
  return std::max(std::min(by_size, 64), ceil_div(std::max(capacity, 1), decode::kMaxChunk));
}

LaunchStatus decode_fwd(const AttnParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.seqlen_q <= 0) return {};
  if (decode_unsupported_reason(p)[0] != '\0') return {cudaErrorInvalidValue, "decode_fwd (unsupported call)"};
  DecodePlan plan{};
  plan.rows = p.seqlen_q * (p.num_heads / p.num_heads_k);
  const int rb = plan.rows <= 4 ? 1 : ceil_div(plan.rows, 8);
  // Keys one row may need at most.
  int64_t span = p.seqlen_k;
  if (p.window_left >= 0) span = std::min<int64_t>(span, int64_t(p.seqlen_q) + p.window_left);
  span = std::max<int64_t>(span, 1);
  // Two waves of CTAs over the SMs, chunks of at least kMinChunk keys, at
  // most the workspace's splits, at most kMaxChunk keys per chunk.
  const int64_t ctas = int64_t(p.batch) * p.num_heads_k * rb;
  int splits = ceil_div(2 * int64_t(num_sms()), ctas);
  splits = std::min(splits, ceil_div(span, kMinChunk));
  splits = std::max(splits, ceil_div(span, decode::kMaxChunk));
  splits = std::max(1, std::min(splits, p.num_splits));
  if (p.split_o == nullptr || p.split_lse == nullptr) splits = 1;
  plan.chunk = std::min<int64_t>(decode::kMaxChunk, ((ceil_div(span, splits) + 63) / 64) * 64);
  plan.splits = ceil_div(span, plan.chunk);
  if (plan.splits > std::max(p.num_splits, 1) || (plan.splits > 1 && p.split_o == nullptr))
    return {cudaErrorInvalidValue, "decode_fwd (workspace too small for the row capacity)"};
  plan.row_blocks = rb;
  return p.dtype == DType::kBF16 ? launch_head_dim<true>(p, plan, stream) : launch_head_dim<false>(p, plan, stream);
}

}  // namespace jaxattn::cuda
