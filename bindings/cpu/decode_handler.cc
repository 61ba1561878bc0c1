// XLA FFI handler of the CPU decode kernel: jaxattn_cpu_decode.
#include "cpu/decode_handler.h"

#include "cpu/decode_cpu.h"
#include "decode_params.h"

namespace jaxattn {

static ffi::Error cpu_decode(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> kv_lengths,
                             ffi::Buffer<ffi::S32> block_table, ffi::Result<ffi::AnyBuffer> o,
                             ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, int32_t window_left,
                             float softcap, bool paged) {
  AttnParams p;
  if (auto e = fill_decode(p, q, k, v, kv_lengths, block_table, *o, *lse, scale, window_left, softcap, paged);
      e.failure())
    return e;
  cpu::decode_fwd(p);
  return ffi::Error::Success();
}

}  // namespace jaxattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnCpuDecode, jaxattn::cpu_decode,
                              jaxattn::bind_decode_options(jaxattn::bind_decode_buffers(xla::ffi::Ffi::Bind())));
