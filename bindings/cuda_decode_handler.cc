// XLA FFI handler of the CUDA decode kernels: jaxattn_cuda_decode.
//
// Like the other CUDA handlers it only enqueues kernels on XLA's stream (no
// synchronisation, no allocation: the split-KV workspace is two extra
// outputs of the ffi_call). Reached only through implementation="cuda"
// (jaxattn/decode.py): not yet validated on a GPU, so off the default path.
#include "cuda_decode_handler.h"

#include <cuda_runtime.h>

#include <string>

#include "decode/launch_decode.h"
#include "decode_params.h"

namespace jaxattn {

static ffi::Error cuda_decode(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::S32> kv_lengths, ffi::Buffer<ffi::S32> block_table,
                              ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                              ffi::Result<ffi::Buffer<ffi::F32>> split_o, ffi::Result<ffi::Buffer<ffi::F32>> split_lse,
                              float scale, int32_t window_left, float softcap, bool paged) {
  AttnParams p;
  if (auto e = fill_decode(p, q, k, v, kv_lengths, block_table, *o, *lse, scale, window_left, softcap, paged);
      e.failure())
    return e;
  const char* why = cuda::decode_unsupported_reason(p);
  if (why[0] != '\0') return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string("jaxattn: ") + why);
  // Workspace: split_o [B, K, splits, Tq * G, H], split_lse [B, K, splits, Tq * G].
  auto sd = split_o->dimensions(), ld = split_lse->dimensions();
  const int64_t rows = int64_t(p.seqlen_q) * p.group_size();
  if (sd.size() != 5 || sd[0] != p.batch || sd[1] != p.num_heads_k || sd[3] != rows || sd[4] != p.head_dim ||
      ld.size() != 4 || ld[0] != sd[0] || ld[1] != sd[1] || ld[2] != sd[2] || ld[3] != sd[3] ||
      sd[2] < cuda::decode_max_splits(p.seqlen_k))
    return invalid("decode workspace must be split_o [B, K, splits, Tq * G, H] and split_lse [B, K, splits, Tq * G] "
                   "with splits >= " + std::to_string(cuda::decode_max_splits(p.seqlen_k)) + ", got " +
                   dims_str(sd) + " and " + dims_str(ld));
  p.num_splits = int(sd[2]);
  p.split_o = split_o->typed_data();
  p.split_lse = split_lse->typed_data();
  const cuda::LaunchStatus s = cuda::decode_fwd(p, stream);
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxattn: CUDA error in ") + s.kernel + ": " + cudaGetErrorName(s.error));
}

}  // namespace jaxattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxattnCudaDecode, jaxattn::cuda_decode,
    jaxattn::bind_decode_options(
        jaxattn::bind_decode_buffers(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
            .Ret<xla::ffi::Buffer<xla::ffi::F32>>()    // split_o
            .Ret<xla::ffi::Buffer<xla::ffi::F32>>()),  // split_lse
    {xla::ffi::Traits::kCmdBufferCompatible});
