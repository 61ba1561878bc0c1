// Host side of decode version 2 (decode_mma_kernel.cuh): its split plan,
// the one-time per-device set-up of each kernel (shared-memory limit,
// resident CTAs per SM) and the launches.
#include <algorithm>
#include <atomic>

#include "decode/decode_mma_kernel.cuh"
#include "decode/launch_decode.h"
#include "sm90/tma_descriptors.cuh"

namespace jaxattn::cuda {

using decode::ceil_div;
using decode::DecodePlan;

namespace {

constexpr int kRowsPerCta = decode::MmaLayout<64>::kRows;

// CTAs of decode_mma_kernel<H, kBf16, kD> resident per SM on the current device,
// or -1 when a CTA's shared memory does not fit there (GPUs with less than
// ~110 KB per block: version 1 runs instead); the first call per device also
// raises the kernel's dynamic shared-memory limit there. No synchronisation
// (attribute and occupancy queries only).
template <int H, bool kBf16, int kD = decode::kLoopCpAsync, bool kS = false>
int resident_ctas(cudaError_t* err) {
  static std::atomic<int> cache[kMaxDevices];
  return per_device_cached(cache, [err](int dev) {
    using L = decode::MmaLayout<H, kD>;
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
        optin < L::kSmemBytes)
      return -1;
    auto kernel = decode::decode_mma_kernel<H, kBf16, kD, kS>;
    *err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmemBytes);
    if (*err != cudaSuccess) return 0;  // (not cached: set up again on the next call)
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, L::kThreads, L::kSmemBytes) != cudaSuccess || n < 1)
      n = 1;
    return n;
  });
}

// The launch configuration of decode_mma_kernel<H, *, kD> on `grid`: in clusters of
// `splits` CTAs along x when splits > 1, with programmatic stream serialization
// when pdl (`attrs` holds the attributes the config points to).
template <int H, int kD = decode::kLoopCpAsync>
cudaLaunchConfig_t launch_config(dim3 grid, int splits, bool pdl, cudaStream_t stream, cudaLaunchAttribute (&attrs)[2]) {
  using L = decode::MmaLayout<H, kD>;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(L::kThreads, 1, 1);
  cfg.dynamicSmemBytes = L::kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = attrs;
  if (splits > 1) {
    cudaLaunchAttribute& a = attrs[cfg.numAttrs++];
    a = cudaLaunchAttribute{};
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = splits;
    a.val.clusterDim.y = 1;
    a.val.clusterDim.z = 1;
  }
  if (pdl) {
    cudaLaunchAttribute& a = attrs[cfg.numAttrs++];
    a = cudaLaunchAttribute{};
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
  }
  return cfg;
}

// Whether decode_mma_kernel<H, kBf16, kD> can merge its chunks in a thread block
// cluster of `splits` CTAs on the current device (kV2Cluster): a device of
// compute capability 9+ with cluster launch, a kernel compiled for sm_90+
// (its PTX version: a build without sm_90 code JIT-compiles the sm_80 PTX,
// which has no cluster code), and at least one such cluster resident at once.
// Queried once per device and cluster size. Call after resident_ctas.
template <int H, bool kBf16, int kD = decode::kLoopCpAsync, bool kS = false>
bool cluster_ok(int splits) {
  if (splits < 2 || splits > decode::kMaxClusterSplits) return false;
  static std::atomic<int> cache[decode::kMaxClusterSplits + 1][kMaxDevices];  // 1 yes, -1 no
  return per_device_cached(cache[splits], [splits](int dev) {
    auto kernel = decode::decode_mma_kernel<H, kBf16, kD, kS>;
    bool ok = false, failed = false;
    int major = 0, launch = 0;
    cudaFuncAttributes fa{};
    auto good = [&](cudaError_t e) { failed |= e != cudaSuccess; return e == cudaSuccess; };
    if (good(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev)) && major >= 9 &&
        good(cudaDeviceGetAttribute(&launch, cudaDevAttrClusterLaunch, dev)) && launch &&
        good(cudaFuncGetAttributes(&fa, kernel)) && fa.ptxVersion >= 90) {
      cudaLaunchAttribute attrs[2];
      const cudaLaunchConfig_t cfg = launch_config<H, kD>(dim3(splits, 1, 1), splits, false, nullptr, attrs);
      int clusters = 0;
      ok = good(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg)) && clusters > 0;
    }
    if (failed) cudaGetLastError();  // a failed query leaves no error behind for the next launch check
    return ok ? 1 : -1;
  }) > 0;
}

// Whether decode_mma_kernel<H, kBf16, kD> may be launched with programmatic
// stream serialization (kV2Pdl): its code on this device was compiled for
// sm_90+ (binary and PTX), where it waits for the previous grid itself
// (griddepcontrol.wait; compiled out below sm_90). Queried once per device.
template <int H, bool kBf16, int kD = decode::kLoopCpAsync, bool kS = false>
bool pdl_ok() {
  static std::atomic<int> cache[kMaxDevices];  // 1 yes, -1 no
  return per_device_cached(cache, [](int dev) {
    cudaFuncAttributes fa{};
    int major = 0;
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                    major >= 9 &&
                    cudaFuncGetAttributes(&fa, decode::decode_mma_kernel<H, kBf16, kD, kS>) == cudaSuccess &&
                    fa.binaryVersion >= 90 && fa.ptxVersion >= 90;
    if (!ok) cudaGetLastError();
    return ok ? 1 : -1;
  }) > 0;
}

// kV2Cluster merges chunks in a cluster only at this many splits: on the H200
// clusters of 3-8 CTAs (110 KB of shared memory each, 2 per SM) ran 10-25%
// slower than the combine kernel, 2 ran 0-7% faster.
constexpr int kClusterSplits = 2;

// kV2LongChunks: the longest chunk (keys, a multiple of 64) the kernel's
// shared page list holds at this call's page size (a chunk may start inside a
// page: (chunk - 1) / ps + 2 ids); unbounded for contiguous caches. Never
// below kMaxChunk (whose 513 ids fit any page size >= 16).
int64_t long_chunk_limit(const AttnParams& p) {
  if (p.block_table == nullptr) return int64_t(1) << 30;
  return std::max<int64_t>(decode::kMaxChunk, int64_t(decode::kMaxChunkPages - 2) * p.page_size / 64 * 64);
}

// The split count: at least ~2 waves of CTAs over the resident slots (SMs x
// CTAs per SM): s0 = the fewest splits giving >= 1.9 waves, then among
// [s0, 2 s0] the count whose last wave is the fullest (the fewest on a tie:
// one split needs no combine kernel); chunks of kMinChunk..kMaxChunk keys,
// at most the workspace's splits. A forced chunk overrides. `variant`: the
// loader (kV2* bits), whatever the cache.
// kV2Waves: >= 0.9 waves instead of 1.9; kV2LongChunks: chunks up to
// long_chunk_limit; kV2Cluster: plan.cluster at kClusterSplits splits where
// cluster(splits) says yes.
template <typename ClusterOk>
DecodePlan plan_v2(const AttnParams& p, int slots, int forced_chunk, int variant, ClusterOk cluster) {
  DecodePlan plan{};
  plan.hoist = (variant & kV2Hoist) != 0;
  plan.touch = (variant & kV2Touch) != 0;
  plan.prefetch = (variant >> kV2PrefetchShift) & 15;
  plan.refill = (variant & kV2Refill) != 0;
  plan.lean = (variant & kV2Lean) != 0;
  const bool want_cluster = (variant & kV2Cluster) != 0;
  auto finish = [&](DecodePlan& pl) {
    pl.cluster = want_cluster && pl.splits == kClusterSplits && cluster(pl.splits);
    return pl;
  };
  plan.rows = p.seqlen_q * (p.num_heads / p.num_heads_k);
  plan.row_blocks = ceil_div(plan.rows, kRowsPerCta);
  const int64_t span = decode::key_span(p);
  if (forced_chunk > 0) {
    plan.chunk = forced_chunk;
    plan.splits = ceil_div(span, forced_chunk);
    plan.adaptive = false;
    return finish(plan);
  }
  plan.adaptive = true;
  const int64_t pairs = int64_t(p.batch) * p.num_heads_k * plan.row_blocks;
  const int64_t max_chunk = (variant & kV2LongChunks) ? long_chunk_limit(p) : decode::kMaxChunk;
  const int lo = ceil_div(span, max_chunk);
  int hi = std::min(std::max(p.num_splits, 1), ceil_div(span, decode::kMinChunk));
  if (p.split_o == nullptr || p.split_lse == nullptr) hi = 1;
  hi = std::max(hi, lo);
  const int min_tenths = (variant & kV2Waves) ? 9 : 19;  // waves of CTAs wanted, in tenths
  const int s0 = std::min(std::max(ceil_div(min_tenths * int64_t(slots), 10 * pairs), lo), hi);
  double best_eff = -1.0;
  for (int s = s0; s <= std::min(hi, 2 * s0); ++s) {
    DecodePlan cand = plan;
    decode::set_chunks(cand, span, s, max_chunk);
    const double waves = double(pairs) * cand.splits / slots;
    const double eff = waves / std::ceil(waves);
    if (eff > best_eff + 1e-9) {
      best_eff = eff;
      plan.chunk = cand.chunk;
      plan.splits = cand.splits;
    }
  }
  return finish(plan);
}

// Whether `plan`'s chunks cover a row's visible keys when the kernel rounds the first
// one down to a multiple of `align` keys (the drift loop's 64-key tiles, the register
// loop's 16-key groups): always without a window; with one, the span widened by
// align - 1 keys (at most the capacity).
bool chunks_cover_rounded_span(const AttnParams& p, const DecodePlan& plan, int align) {
  const int64_t widened = std::min<int64_t>(p.seqlen_k, decode::key_span(p) + align - 1);
  return p.window_left < 0 || int64_t(plan.splits) * plan.chunk >= widened;
}

// The drift loop's plan and tensor maps for `p` (H=128, kV2Drift), or false when
// it cannot run this call: no sm_90 code on this device (pdl_ok's test), a tile
// that would straddle a page (pages or chunks not multiples of 64 keys), strides no
// tensor map takes, or a window whose span, widened by the kernel's rounding of its
// first key down to 64, the chunks do not cover. *err: a failed set-up query.
template <int H, bool kBf16, bool kS = false>
bool drift_plan(const AttnParams& p, int forced_chunk, int variant, DecodePlan* plan, decode::DecodeTma* tma,
                cudaError_t* err) {
  if constexpr (H != 128) {
    (void)p, (void)forced_chunk, (void)variant, (void)plan, (void)tma, (void)err;
    return false;
  } else {
    if (!pdl_ok<H, kBf16, decode::kLoopDrift, kS>()) return false;
    const int per_sm = resident_ctas<H, kBf16, decode::kLoopDrift, kS>(err);
    if (*err != cudaSuccess || per_sm < 0) return false;
    *plan = plan_v2(p, device_sms() * per_sm, forced_chunk, variant,
                    [](int s) { return cluster_ok<H, kBf16, decode::kLoopDrift, kS>(s); });
    plan->pdl = (variant & kV2Pdl) != 0;
    const bool paged = p.block_table != nullptr;
    const int nb = paged ? p.num_pages : p.batch, rows = paged ? p.page_size : p.seqlen_k;
    // A tensor map of the K or V cache, when its strides allow one.
    auto map = [&](CUtensorMap* m, const void* base, int64_t bs, int64_t rs, int64_t hs) {
      using L = decode::MmaLayout<H, decode::kLoopDrift>;
      return sm90::tmap_bshd_ok(base, nb, rows, p.num_heads_k, bs, rs, hs) &&
             sm90::make_tmap_bshd(m, base, p.dtype, nb, rows, p.num_heads_k, H, bs, rs, hs, L::kBlockN, H / 64) ==
                 cudaSuccess;
    };
    return chunks_cover_rounded_span(p, *plan, 64) && (!paged || (p.page_size % 64 == 0 && plan->chunk % 64 == 0)) &&
           map(&tma->k, p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride) &&
           map(&tma->v, p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  }
}

// Whether `variant` asks for the register loop on this device: kV2RegsAnywhere, or kV2Regs
// where the peak DRAM bandwidth is at least kRegsMinPeakGBs (launch_decode.h).
bool wants_register_loop(int variant) {
  return (variant & kV2RegsAnywhere) || ((variant & kV2Regs) && device_peak_dram_gbs() >= kRegsMinPeakGBs);
}

// The register loop's plan for `p` (H=128, kV2Regs), or false when it cannot run
// this call: more than kRegMaxRows query rows per KV head, chunks not multiples of
// its 16-key groups (a forced chunk), a window whose span, widened by the kernel's
// rounding of its first key down to 16, the chunks do not cover, or a CTA that does
// not fit the device. *err: a failed set-up query.
template <int H, bool kBf16>
bool reg_plan(const AttnParams& p, int forced_chunk, int variant, DecodePlan* plan, cudaError_t* err) {
  if constexpr (H != 128) {
    (void)p, (void)forced_chunk, (void)variant, (void)plan, (void)err;
    return false;
  } else {
    constexpr int kG = decode::kRegGroupKeys;
    if (p.seqlen_q * (p.num_heads / p.num_heads_k) > decode::kRegMaxRows) return false;
    const int per_sm = resident_ctas<H, kBf16, decode::kLoopRegs>(err);
    if (*err != cudaSuccess || per_sm < 0) return false;
    *plan = plan_v2(p, device_sms() * per_sm, forced_chunk, variant,
                    [](int s) { return cluster_ok<H, kBf16, decode::kLoopRegs>(s); });
    plan->pdl = (variant & kV2Pdl) != 0 && pdl_ok<H, kBf16, decode::kLoopRegs>();
    plan->warm = plan->pdl ? (variant >> kV2WarmShift) & 3 : 0;  // (the other loops have none)
    return chunks_cover_rounded_span(p, *plan, kG) && plan->chunk % kG == 0;
  }
}

// Launches decode_mma_kernel<H, kBf16, kD> on `plan` (and the combine kernel
// when its chunks merge neither in one CTA nor in a cluster).
template <int H, bool kBf16, int kD, bool kS = false>
LaunchStatus launch_plan(const AttnParams& p, const DecodePlan& plan, const decode::DecodeTma& tma,
                         cudaStream_t stream) {
  using L = decode::MmaLayout<H, kD>;
  if (plan.splits > std::max(p.num_splits, 1) || (plan.splits > 1 && p.split_o == nullptr))
    return {cudaErrorInvalidValue, "decode_fwd (workspace too small for the row capacity)"};
  if (p.batch > 65535 || p.num_heads_k > 65535) return {cudaErrorInvalidValue, "decode_fwd (grid too large)"};
  const dim3 grid(plan.splits * plan.row_blocks, p.num_heads_k, p.batch);
  if (plan.cluster || plan.pdl) {
    cudaLaunchAttribute attrs[2];
    const cudaLaunchConfig_t cfg = launch_config<H, kD>(grid, plan.cluster ? plan.splits : 1, plan.pdl, stream, attrs);
    if (cudaError_t e = cudaLaunchKernelEx(&cfg, decode::decode_mma_kernel<H, kBf16, kD, kS>, p, plan, tma);
        e != cudaSuccess)
      return {e, plan.cluster ? "decode_mma_kernel (cluster launch)" : "decode_mma_kernel (programmatic launch)"};
  } else {
    decode::decode_mma_kernel<H, kBf16, kD, kS><<<grid, L::kThreads, L::kSmemBytes, stream>>>(p, plan, tma);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return {e, "decode_mma_kernel"};
  }
  if (plan.splits == 1 || plan.cluster) return {};  // (cluster: merged in the kernel)
  return decode::launch_combine(p, plan, stream);
}

// The plan of the cp.async loop (resident CTAs from its own layout); *per_sm < 0
// when its shared memory does not fit this device (version 1 runs instead).
template <int H, bool kBf16>
DecodePlan cpasync_plan(const AttnParams& p, int forced_chunk, int variant, int* per_sm, cudaError_t* err) {
  *per_sm = resident_ctas<H, kBf16>(err);
  if (*err != cudaSuccess || *per_sm < 0) return {};
  DecodePlan plan = plan_v2(p, device_sms() * *per_sm, forced_chunk, variant,
                            [](int s) { return cluster_ok<H, kBf16>(s); });
  plan.pdl = (variant & kV2Pdl) != 0 && pdl_ok<H, kBf16>();
  return plan;
}

template <int H, bool kBf16>
LaunchStatus launch(const AttnParams& p, cudaStream_t stream, int forced_chunk, int variant) {
  cudaError_t err = cudaSuccess;
  decode::DecodeTma tma{};
  if constexpr (H == 128) {  // (the drift and register loops' layouts exist at H=128 only)
    DecodePlan plan{};
    if (wants_register_loop(variant)) {
      if (reg_plan<H, kBf16>(p, forced_chunk, variant, &plan, &err))
        return launch_plan<H, kBf16, decode::kLoopRegs>(p, plan, tma, stream);
      if (err != cudaSuccess) return {err, "decode_mma_kernel (register loop: shared-memory attribute)"};
    }
    if (variant & kV2Drift) {  // the drift loop's instance: swapped (kV2SwapAB) or not
      const bool swap = (variant & kV2SwapAB) != 0;
      if (swap ? drift_plan<H, kBf16, true>(p, forced_chunk, variant, &plan, &tma, &err)
               : drift_plan<H, kBf16>(p, forced_chunk, variant, &plan, &tma, &err))
        return swap ? launch_plan<H, kBf16, decode::kLoopDrift, true>(p, plan, tma, stream)
                    : launch_plan<H, kBf16, decode::kLoopDrift>(p, plan, tma, stream);
      if (err != cudaSuccess) return {err, "decode_mma_kernel (drift loop: shared-memory attribute)"};
    }
  }
  int per_sm = 0;
  const DecodePlan plan = cpasync_plan<H, kBf16>(p, forced_chunk, variant, &per_sm, &err);
  if (err != cudaSuccess) return {err, "decode_mma_kernel (shared-memory attribute)"};
  if (per_sm < 0) return decode_fwd_v1(p, stream, forced_chunk);  // too little shared memory here
  return launch_plan<H, kBf16, decode::kLoopCpAsync>(p, plan, tma, stream);
}

template <bool kBf16>
LaunchStatus launch_head_dim(const AttnParams& p, cudaStream_t stream, int forced_chunk, int variant) {
  switch (p.head_dim) {
    case 64: return launch<64, kBf16>(p, stream, forced_chunk, variant);
    case 128: return launch<128, kBf16>(p, stream, forced_chunk, variant);
    default: return launch<256, kBf16>(p, stream, forced_chunk, variant);
  }
}

template <int H, bool kBf16>
int plan_splits(const AttnParams& p, int forced_chunk, int variant, bool* cluster) {
  cudaError_t err = cudaSuccess;
  DecodePlan plan{};
  decode::DecodeTma tma{};
  int per_sm = 0;
  const bool regs = wants_register_loop(variant) && reg_plan<H, kBf16>(p, forced_chunk, variant, &plan, &err);
  if (!regs && !((variant & kV2Drift) && drift_plan<H, kBf16>(p, forced_chunk, variant, &plan, &tma, &err))) {
    err = cudaSuccess;
    plan = cpasync_plan<H, kBf16>(p, forced_chunk, variant, &per_sm, &err);
    if (err != cudaSuccess || per_sm < 0) return 0;
  }
  *cluster = plan.cluster;
  return plan.splits;
}

}  // namespace

int decode_v2_plan_splits(const AttnParams& p, int forced_chunk, int variant, bool* cluster) {
  *cluster = false;
  const bool bf16 = p.dtype == DType::kBF16;
  switch (p.head_dim) {
    case 64: return bf16 ? plan_splits<64, true>(p, forced_chunk, variant, cluster)
                         : plan_splits<64, false>(p, forced_chunk, variant, cluster);
    case 128: return bf16 ? plan_splits<128, true>(p, forced_chunk, variant, cluster)
                          : plan_splits<128, false>(p, forced_chunk, variant, cluster);
    default: return bf16 ? plan_splits<256, true>(p, forced_chunk, variant, cluster)
                         : plan_splits<256, false>(p, forced_chunk, variant, cluster);
  }
}

#ifdef JAXATTN_DECODE_TIMELINE
static_assert(decode::kTimelineMarks == decode::kTimelineMarksHost, "timeline record size");
cudaError_t decode_timeline_set(unsigned long long* buf, unsigned* calls, int max_calls, int ctas) {
  const decode::DecodeTimeline t{buf, calls, max_calls, ctas};
  return cudaMemcpyToSymbol(decode::g_decode_timeline, &t, sizeof t);
}
#endif

LaunchStatus decode_fwd_v2(const AttnParams& p, cudaStream_t stream, int forced_chunk, int variant) {
  return p.dtype == DType::kBF16 ? launch_head_dim<true>(p, stream, forced_chunk, variant)
                                 : launch_head_dim<false>(p, stream, forced_chunk, variant);
}

}  // namespace jaxattn::cuda
