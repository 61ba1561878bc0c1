// XLA FFI handler of the CUDA decode kernels: jaxattn_cuda_decode.
//
// Like the other CUDA handlers it only enqueues kernels on XLA's stream (no
// synchronisation, no allocation: the split-KV workspace is two extra
// outputs of the ffi_call). Attributes beyond the common decode options:
// `version` (1: CUDA cores, 2: cp.async + tensor cores; chosen in Python,
// jaxattn/decode.py), `chunk` (keys per split, 0 = the launcher's plan;
// tests force many splits with it), `variant` (version 2's kV2* bits, -1 =
// the default; benchmarks compare variants through JAX) and `poison` (tests:
// fill the outputs and
// the workspace with NaN first, so an element a kernel fails to write shows).
#include "cuda_decode_handler.h"

#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "decode/launch_decode.h"
#include "decode_params.h"

namespace jaxattn {

static ffi::Error cuda_decode(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::S32> kv_lengths, ffi::Buffer<ffi::S32> block_table,
                              ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                              ffi::Result<ffi::Buffer<ffi::F32>> split_o, ffi::Result<ffi::Buffer<ffi::F32>> split_lse,
                              float scale, int32_t window_left, float softcap, bool paged, int32_t version,
                              int32_t chunk, int32_t variant, bool poison) {
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
  if (version != 1 && version != 2) return invalid("decode kernel version must be 1 or 2, got " + std::to_string(version));
  if (chunk < 0 || chunk > cuda::kDecodeMaxForcedChunk)
    return invalid("decode chunk must be in [0, " + std::to_string(cuda::kDecodeMaxForcedChunk) + "], got " +
                   std::to_string(chunk));
  if (sd[2] < cuda::decode_max_splits(p.seqlen_k, chunk))
    return invalid("decode workspace holds " + std::to_string(sd[2]) + " splits, the forced chunk needs " +
                   std::to_string(cuda::decode_max_splits(p.seqlen_k, chunk)));
  p.num_splits = int(sd[2]);
  p.split_o = split_o->typed_data();
  p.split_lse = split_lse->typed_data();
  if (poison) {
    for (auto [ptr, bytes] : {std::pair<void*, size_t>{o->untyped_data(), o->size_bytes()},
                              {lse->untyped_data(), lse->size_bytes()},
                              {split_o->untyped_data(), split_o->size_bytes()},
                              {split_lse->untyped_data(), split_lse->size_bytes()}}) {
      if (cudaError_t e = cudaMemsetAsync(ptr, 0xFF, bytes, stream); e != cudaSuccess)  // NaN in f32/bf16/f16
        return ffi::Error::Internal(std::string("jaxattn: CUDA error poisoning the decode outputs: ") +
                                    cudaGetErrorName(e));
    }
  }
  if (variant < -1 || variant >= cuda::kV2VariantEnd)
    return invalid("decode variant must be -1 (default) or in [0, " + std::to_string(cuda::kV2VariantEnd) +
                   "), got " + std::to_string(variant));
  const cuda::LaunchStatus s = cuda::decode_fwd(p, stream, version, chunk, variant);
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxattn: CUDA error in ") + s.kernel + ": " + cudaGetErrorName(s.error));
}

}  // namespace jaxattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxattnCudaDecode, jaxattn::cuda_decode,
    jaxattn::bind_decode_options(
        jaxattn::bind_decode_buffers(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
            .Ret<xla::ffi::Buffer<xla::ffi::F32>>()    // split_o
            .Ret<xla::ffi::Buffer<xla::ffi::F32>>())  // split_lse
        .Attr<int32_t>("version")
        .Attr<int32_t>("chunk")
        .Attr<int32_t>("variant")
        .Attr<bool>("poison"),
    {xla::ffi::Traits::kCmdBufferCompatible});
