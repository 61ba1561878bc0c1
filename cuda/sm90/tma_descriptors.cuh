// Host side: CUDA tensor maps (TMA descriptors) for the [B, rows, heads, H]
// tensors of the Hopper kernels. cuTensorMapEncodeTiled is a driver API call;
// it is fetched at run time through the runtime (cudaGetDriverEntryPointByVersion)
// so that nothing links libcuda and the extension imports without a driver.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only (header types, no linking)
#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace jaxattn::sm90 {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled (ABI of CUDA 12.0), or null when no driver has it.
inline EncodeTiledFn get_encode_tiled() {
  static EncodeTiledFn fn = []() -> EncodeTiledFn {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

// Tensor map over a [batch, rows, heads, head_dim] tensor (element strides given, head dim
// contiguous) of `esz`-byte elements, seen as 5D (chunk, rows, head_dim/chunk, heads, batch)
// with chunk = 128 / esz elements, so that one box (chunk, box_rows, box_chunks, 1, 1) lands in
// shared memory as box_chunks column chunks of [box_rows][128 bytes], 128B-swizzled: the
// layout the wgmma descriptors expect. Rows past `rows` read as zero and are not written
// by stores or reductions.
inline cudaError_t make_tmap_rows(CUtensorMap* map, CUtensorMapDataType dt, int64_t esz, const void* base,
                                  int batch, int rows, int heads, int head_dim, int64_t batch_stride,
                                  int64_t row_stride, int64_t head_stride, int box_rows, int box_chunks) {
  EncodeTiledFn encode = get_encode_tiled();
  if (!encode) return cudaErrorNotSupported;
  const int64_t chunk = 128 / esz;
  // A stride of a size-1 dimension is never used; give it a legal value.
  if (batch == 1) batch_stride = 16 / esz;
  if (heads == 1) head_stride = 16 / esz;
  if (rows == 1) row_stride = 16 / esz;
  const cuuint64_t dims[5] = {(cuuint64_t)chunk, (cuuint64_t)rows, (cuuint64_t)(head_dim / chunk),
                              (cuuint64_t)heads, (cuuint64_t)batch};
  const cuuint64_t strides[4] = {(cuuint64_t)(row_stride * esz), 128, (cuuint64_t)(head_stride * esz),
                                 (cuuint64_t)(batch_stride * esz)};
  const cuuint32_t box[5] = {(cuuint32_t)chunk, (cuuint32_t)box_rows, (cuuint32_t)box_chunks, 1, 1};
  const cuuint32_t estr[5] = {1, 1, 1, 1, 1};
  CUresult r = encode(map, dt, 5, const_cast<void*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// make_tmap_rows for the 16-bit q, k, v, o, dout, dq, dk, dv tensors (64-element chunks).
inline cudaError_t make_tmap_bshd(CUtensorMap* map, const void* base, DType dtype, int batch, int rows,
                                  int heads, int head_dim, int64_t batch_stride, int64_t row_stride,
                                  int64_t head_stride, int box_rows, int box_chunks) {
  const CUtensorMapDataType dt =
      dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return make_tmap_rows(map, dt, 2, base, batch, rows, heads, head_dim, batch_stride, row_stride, head_stride,
                        box_rows, box_chunks);
}

// make_tmap_rows for a contiguous f32 [batch, rows, heads, head_dim] tensor (the dQ
// accumulator; 32-element chunks).
inline cudaError_t make_tmap_bshd_f32(CUtensorMap* map, const float* base, int batch, int rows, int heads,
                                      int head_dim, int box_rows, int box_chunks) {
  const int64_t head_stride = head_dim, row_stride = int64_t(head_dim) * heads;
  return make_tmap_rows(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, batch, rows, heads, head_dim,
                        row_stride * rows, row_stride, head_stride, box_rows, box_chunks);
}

// Whether make_tmap_bshd can describe a tensor with these strides and base address.
// (The stride of a dimension of size 1 is ignored.)
inline bool tmap_bshd_ok(const void* base, int batch, int rows, int heads, int64_t batch_stride,
                         int64_t row_stride, int64_t head_stride) {
  const int64_t esz = 2;
  auto ok = [&](int size, int64_t s) {
    return size == 1 || (s > 0 && (s * esz) % 16 == 0 && s * esz < (int64_t(1) << 40));
  };
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && ok(batch, batch_stride) && ok(rows, row_stride) &&
         ok(heads, head_stride);
}

}  // namespace jaxattn::sm90
