// The argument lists of the FFI targets, shared by every backend so that the
// CPU and CUDA handlers of one pass take exactly the same buffers and options.
// Each helper appends to a binding (which may already hold a Ctx).
#pragma once

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxattn {

namespace ffi = xla::ffi;

// Forward: q, k, v -> o, lse.
template <typename Binding>
auto bind_forward_buffers(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()          // k
      .template Arg<ffi::AnyBuffer>()          // v
      .template Ret<ffi::AnyBuffer>()          // o
      .template Ret<ffi::Buffer<ffi::F32>>();  // lse
}

// Backward: q, k, v, o, lse, dout, dlse -> dq, dk, dv.
template <typename Binding>
auto bind_backward_buffers(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()          // k
      .template Arg<ffi::AnyBuffer>()          // v
      .template Arg<ffi::AnyBuffer>()          // o
      .template Arg<ffi::Buffer<ffi::F32>>()   // lse
      .template Arg<ffi::AnyBuffer>()          // dout
      .template Arg<ffi::Buffer<ffi::F32>>()   // dlse
      .template Ret<ffi::AnyBuffer>()          // dq
      .template Ret<ffi::AnyBuffer>()          // dk
      .template Ret<ffi::AnyBuffer>();         // dv
}

// The static options every pass takes, as attributes of exact C++ types.
template <typename Binding>
auto bind_options(Binding b) {
  return std::move(b).template Attr<float>("scale").template Attr<bool>("is_causal");
}

// The masking inputs and options of the CPU and CUDA handlers (appended
// after the pass's buffers and options; decoded by fill_mask_args): q_lengths,
// kv_lengths int32 [...batch] buffers, the local window attributes (-1 =
// unlimited), the logit soft cap (0 = off); then q_segment_ids [...batch, T]
// and kv_segment_ids [...batch, S] int32 with their per-64-item (min, max)
// tables q_segment_ranges [...batch, ceil(T / 64), 2] and kv_segment_ranges
// [...batch, ceil(S / 64), 2] (AttnParams), the dense bias (f32) and mask
// (pred), each broadcastable as AttnParams describes, and the flags that say
// which of the lengths, segments, bias and mask are real (an absent one is a
// placeholder buffer the handler does not read).
template <typename Binding>
auto bind_mask_args(Binding b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::S32>>()  // q_lengths
      .template Arg<ffi::Buffer<ffi::S32>>()                 // kv_lengths
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right")
      .template Attr<float>("softcap")
      .template Arg<ffi::Buffer<ffi::S32>>()   // q_segment_ids
      .template Arg<ffi::Buffer<ffi::S32>>()   // kv_segment_ids
      .template Arg<ffi::Buffer<ffi::S32>>()   // q_segment_ranges
      .template Arg<ffi::Buffer<ffi::S32>>()   // kv_segment_ranges
      .template Arg<ffi::Buffer<ffi::F32>>()   // bias
      .template Arg<ffi::Buffer<ffi::PRED>>()  // mask
      .template Attr<bool>("has_segments")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("has_mask")
      .template Attr<bool>("has_lengths");
}

// The backward's extra result: dbias, f32 with the bias's shape when the
// bias gradient is wanted (a placeholder [1] when not, or without a bias).
template <typename Binding>
auto bind_dbias_ret(Binding b) {
  return std::move(b).template Ret<ffi::Buffer<ffi::F32>>();  // dbias
}

}  // namespace jaxattn
