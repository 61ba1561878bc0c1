// XLA FFI handlers of the CUDA backend: jaxattn_cuda_fwd and jaxattn_cuda_bwd.
//
// They only enqueue kernels on XLA's stream: no host synchronisation, no
// allocation (workspace buffers are extra outputs of the ffi_call), so they
// are declared compatible with command buffers (CUDA graphs).
#include "cuda_handlers.h"

#include <cuda_runtime.h>

#include <string>

#include "common/doc_tiles.h"
#include "ffi_bindings.h"
#include "ffi_params.h"
#include "launch.h"

namespace jaxattn {

// What the portable kernels cover; the Python dispatch rule mirrors it
// (jaxattn/dispatch.py) so unsupported calls never reach here.
static ffi::Error check_cuda_supported(const AttnParams& p) {
  if (p.dtype == DType::kF32)
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "jaxattn: the CUDA kernels take bfloat16 or float16, not float32");
  if (p.head_dim % 8 != 0)
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "jaxattn: the CUDA kernels need a head dim that is a multiple of 8, got " + std::to_string(p.head_dim));
  return ffi::Error::Success();
}

// Compute capability of the current device (XLA makes the stream's device
// current). Only queries that are legal while XLA captures the stream into a
// CUDA graph: no stream queries.
static void device_cc(int* major, int* minor) {
  int dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, dev);
}

// The forward's dispatch rule (cuda::fwd_on_sm90): the Hopper kernel where it
// covers the call, else the portable one.
static cuda::LaunchStatus launch_forward(const AttnParams& p, cudaStream_t stream, bool portable_only) {
#ifdef JAXATTN_WITH_SM90
  int major = 0, minor = 0;
  if (portable_only) return cuda::flash_fwd_sm80(p, stream);
  device_cc(&major, &minor);
  if (cuda::fwd_on_sm90(p, major, minor)) return cuda::flash_fwd_sm90(p, stream);
#endif
  (void)portable_only;
  return cuda::flash_fwd_sm80(p, stream);
}

// Workspace of the document tiles (common/doc_tiles.h), forward and backward:
// [..., doc_tile_ints(T)] int32 with segment ids and T == S, else a placeholder [1]
// the kernels never see.
static ffi::Error set_doc_tiles(AttnParams& p, ffi::Buffer<ffi::S32>& doc_tiles) {
  if (p.q_segment_ids && p.seqlen_q == p.seqlen_k) {
    const int64_t want = static_cast<int64_t>(p.batch) * cuda::doc_tile_ints(p.seqlen_q);
    if (static_cast<int64_t>(doc_tiles.element_count()) != want)
      return invalid("doc_tiles workspace must hold batch * doc_tile_ints(T) int32");
    p.doc_tiles = doc_tiles.typed_data();
  }
  return ffi::Error::Success();
}

// Workspace of the Hopper backward's tail split (sm90/bwd_tail.cuh): whole units of
// [2][rows][H] f32 when the Hopper kernels are built (cuda::sm90_bwd_tail_rows() > 0)
// and the call may split, else a placeholder [1] the kernels never see.
static ffi::Error set_dkv_tail(AttnParams& p, ffi::Buffer<ffi::F32>& dkv_tail) {
#ifdef JAXATTN_WITH_SM90
  const int64_t unit = 2LL * cuda::sm90_bwd_tail_rows() * p.head_dim;
  const int64_t have = static_cast<int64_t>(dkv_tail.element_count());
  if (unit > 0 && have >= unit) {
    if (have % unit != 0) return invalid("dkv_tail workspace must hold whole units of 2 * rows * H floats");
    p.dkv_tail = dkv_tail.typed_data();
    p.dkv_tail_units = static_cast<int>(have / unit);
  }
#else
  (void)p, (void)dkv_tail;
#endif
  return ffi::Error::Success();
}

static ffi::Error to_ffi_error(const cuda::LaunchStatus& s) {
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxattn: CUDA error in ") + s.kernel + ": " + cudaGetErrorName(s.error) +
                              " (" + cudaGetErrorString(s.error) + ")");
}

static ffi::Error cuda_fwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale,
                           bool is_causal, ffi::Buffer<ffi::S32> q_lengths, ffi::Buffer<ffi::S32> kv_lengths,
                           int32_t window_left, int32_t window_right, float softcap, ffi::Buffer<ffi::S32> q_seg,
                           ffi::Buffer<ffi::S32> kv_seg,
                           ffi::Buffer<ffi::S32> q_seg_ranges, ffi::Buffer<ffi::S32> kv_seg_ranges,
                           ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask,
                           bool has_segments, bool has_bias, bool has_mask, bool has_lengths, bool portable_only,
                           ffi::Result<ffi::Buffer<ffi::S32>> doc_tiles) {
  AttnParams p;
  if (auto e = fill_forward(p, q, k, v, *o, *lse, scale, is_causal); e.failure()) return e;
  if (auto e = fill_mask_args(p, q_lengths, kv_lengths, window_left, window_right, softcap, q_seg, kv_seg,
                              q_seg_ranges, kv_seg_ranges, bias, mask, has_segments, has_bias, has_mask,
                              has_lengths);
      e.failure())
    return e;
  if (auto e = check_cuda_supported(p); e.failure()) return e;
  if (auto e = set_doc_tiles(p, *doc_tiles); e.failure()) return e;
  return to_ffi_error(launch_forward(p, stream, portable_only));
}

// The backward's dispatch rule, like the forward's.
static cuda::LaunchStatus launch_backward(const AttnParams& p, cudaStream_t stream, bool portable_only) {
#ifdef JAXATTN_WITH_SM90
  int major = 0, minor = 0;
  if (portable_only) return cuda::flash_bwd_sm80(p, stream);
  device_cc(&major, &minor);
  if (cuda::bwd_on_sm90(p, major, minor)) return cuda::flash_bwd_sm90(p, stream);
#endif
  (void)portable_only;
  return cuda::flash_bwd_sm80(p, stream);
}

static ffi::Error cuda_bwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                           ffi::Buffer<ffi::F32> dlse, ffi::Result<ffi::AnyBuffer> dq,
                           ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                           ffi::Result<ffi::Buffer<ffi::F32>> dq_accum, ffi::Result<ffi::Buffer<ffi::F32>> dpsum,
                           ffi::Result<ffi::Buffer<ffi::S32>> dq_semaphore, float scale, bool is_causal,
                           ffi::Buffer<ffi::S32> q_lengths, ffi::Buffer<ffi::S32> kv_lengths, int32_t window_left,
                           int32_t window_right, float softcap, ffi::Buffer<ffi::S32> q_seg,
                           ffi::Buffer<ffi::S32> kv_seg,
                           ffi::Buffer<ffi::S32> q_seg_ranges, ffi::Buffer<ffi::S32> kv_seg_ranges,
                           ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask,
                           bool has_segments, bool has_bias, bool has_mask, bool has_lengths,
                           ffi::Result<ffi::Buffer<ffi::F32>> dbias,
                           ffi::Result<ffi::Buffer<ffi::S32>> doc_tiles, ffi::Result<ffi::Buffer<ffi::F32>> dkv_tail,
                           bool portable_only, bool deterministic) {
  AttnParams p;
  if (auto e = fill_backward(p, q, k, v, o, lse, dout, dlse, *dq, *dk, *dv, scale, is_causal); e.failure())
    return e;
  if (auto e = fill_mask_args(p, q_lengths, kv_lengths, window_left, window_right, softcap, q_seg, kv_seg,
                              q_seg_ranges, kv_seg_ranges, bias, mask, has_segments, has_bias, has_mask,
                              has_lengths);
      e.failure())
    return e;
  if (auto e = fill_dbias(p, bias, *dbias); e.failure()) return e;
  if (auto e = check_cuda_supported(p); e.failure()) return e;
  // Workspace: dq_accum is q-shaped, dpsum is [..., N, T], dq_semaphore [..., N, ceil(T / 32)].
  if (!same_dims(dq_accum->dimensions(), q.dimensions()))
    return invalid("dq_accum workspace must have the query's shape");
  const int64_t want_dpsum = static_cast<int64_t>(p.batch) * p.num_heads * p.seqlen_q;
  if (static_cast<int64_t>(dpsum->element_count()) != want_dpsum)
    return invalid("dpsum workspace must hold batch * heads * T floats");
  const int64_t want_sem = static_cast<int64_t>(p.batch) * p.num_heads *
                           ((p.seqlen_q + kDqSemaphoreRows - 1) / kDqSemaphoreRows);
  if (static_cast<int64_t>(dq_semaphore->element_count()) != want_sem)
    return invalid("dq_semaphore workspace must hold batch * heads * ceil(T / 32) int32");
  p.dq_accum = dq_accum->typed_data();
  p.dpsum = dpsum->typed_data();
  p.dq_semaphore = dq_semaphore->typed_data();
  p.deterministic = deterministic;
  if (auto e = set_doc_tiles(p, *doc_tiles); e.failure()) return e;
  if (auto e = set_dkv_tail(p, *dkv_tail); e.failure()) return e;
  return to_ffi_error(launch_backward(p, stream, portable_only));
}

}  // namespace jaxattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxattnCudaFwd, jaxattn::cuda_fwd,
    jaxattn::bind_mask_args(jaxattn::bind_options(jaxattn::bind_forward_buffers(
                                xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())))
        .Attr<bool>("portable_only")  // skip the Hopper kernel
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>(),  // doc_tiles (workspace)
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxattnCudaBwd, jaxattn::cuda_bwd,
    jaxattn::bind_dbias_ret(jaxattn::bind_mask_args(jaxattn::bind_options(
        jaxattn::bind_backward_buffers(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
            .Ret<xla::ffi::Buffer<xla::ffi::F32>>()      // dq_accum (workspace)
            .Ret<xla::ffi::Buffer<xla::ffi::F32>>()      // dpsum (workspace)
            .Ret<xla::ffi::Buffer<xla::ffi::S32>>())))   // dq_semaphore (workspace)
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // doc_tiles (workspace)
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()      // dkv_tail (workspace)
        .Attr<bool>("portable_only")   // skip the Hopper kernel
        .Attr<bool>("deterministic"),  // ordered dQ accumulation: identical bits run to run
    {xla::ffi::Traits::kCmdBufferCompatible});
