// XLA FFI handlers of the CPU backend: jaxattn_cpu_fwd and jaxattn_cpu_bwd.
#include "cpu_handlers.h"

#include "cpu/flash_cpu.h"
#include "ffi_bindings.h"
#include "ffi_params.h"

namespace jaxattn {

static ffi::Error cpu_fwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                          float scale, bool is_causal, ffi::Buffer<ffi::S32> q_lengths,
                          ffi::Buffer<ffi::S32> kv_lengths, int32_t window_left, int32_t window_right, float softcap,
                          ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                          ffi::Buffer<ffi::S32> q_seg_ranges, ffi::Buffer<ffi::S32> kv_seg_ranges,
                          ffi::Buffer<ffi::F32> bias,
                          ffi::Buffer<ffi::PRED> mask, bool has_segments, bool has_bias, bool has_mask,
                          bool has_lengths) {
  AttnParams p;
  if (auto e = fill_forward(p, q, k, v, *o, *lse, scale, is_causal); e.failure()) return e;
  if (auto e = fill_mask_args(p, q_lengths, kv_lengths, window_left, window_right, softcap, q_seg, kv_seg,
                              q_seg_ranges, kv_seg_ranges, bias, mask, has_segments, has_bias, has_mask,
                              has_lengths);
      e.failure())
    return e;
  cpu::flash_fwd(p);
  return ffi::Error::Success();
}

static ffi::Error cpu_bwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                          ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
                          ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                          ffi::Result<ffi::AnyBuffer> dv, float scale, bool is_causal,
                          ffi::Buffer<ffi::S32> q_lengths, ffi::Buffer<ffi::S32> kv_lengths,
                          int32_t window_left, int32_t window_right, float softcap, ffi::Buffer<ffi::S32> q_seg,
                          ffi::Buffer<ffi::S32> kv_seg,
                          ffi::Buffer<ffi::S32> q_seg_ranges, ffi::Buffer<ffi::S32> kv_seg_ranges,
                          ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask,
                          bool has_segments, bool has_bias, bool has_mask, bool has_lengths,
                          ffi::Result<ffi::Buffer<ffi::F32>> dbias) {
  AttnParams p;
  if (auto e = fill_backward(p, q, k, v, o, lse, dout, dlse, *dq, *dk, *dv, scale, is_causal); e.failure())
    return e;
  if (auto e = fill_mask_args(p, q_lengths, kv_lengths, window_left, window_right, softcap, q_seg, kv_seg,
                              q_seg_ranges, kv_seg_ranges, bias, mask, has_segments, has_bias, has_mask,
                              has_lengths);
      e.failure())
    return e;
  if (auto e = fill_dbias(p, bias, *dbias); e.failure()) return e;
  cpu::flash_bwd(p);
  return ffi::Error::Success();
}

}  // namespace jaxattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnCpuFwd, jaxattn::cpu_fwd,
                              jaxattn::bind_mask_args(jaxattn::bind_options(
                                  jaxattn::bind_forward_buffers(xla::ffi::Ffi::Bind()))));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnCpuBwd, jaxattn::cpu_bwd,
                              jaxattn::bind_dbias_ret(jaxattn::bind_mask_args(jaxattn::bind_options(
                                  jaxattn::bind_backward_buffers(xla::ffi::Ffi::Bind())))));
