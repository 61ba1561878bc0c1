// Turns the XLA FFI buffers of a decode call (jaxattn.decode_attention) into
// the AttnParams every backend reads, validating them; and the argument list
// of the decode targets. Shared by every backend's decode handler, so all
// accept exactly the same calls.
//
// Buffers: q [B, Tq, N, H]; k, v caches [B, S_max, K, H] (contiguous) or
// [num_pages, page_size, K, H] (paged); kv_lengths int32 [B]; block_table
// int32 [B, max_pages] (paged; any int32 buffer, unread, when contiguous);
// outputs o [B, Tq, N, H] and lse f32 [B, Tq, N].
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "common/params.h"
#include "ffi_params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxattn {

// Decode limits (the Python wrapper checks the same at trace time).
constexpr int kDecodeMaxQueries = 16;
constexpr int kDecodeMinPageSize = 16;
constexpr int kDecodeMaxPageSize = 256;

// q, k_cache, v_cache, kv_lengths, block_table -> o, lse.
template <typename Binding>
auto bind_decode_buffers(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()                 // k_cache
      .template Arg<ffi::AnyBuffer>()                 // v_cache
      .template Arg<ffi::Buffer<ffi::S32>>()          // kv_lengths
      .template Arg<ffi::Buffer<ffi::S32>>()          // block_table
      .template Ret<ffi::AnyBuffer>()                 // o
      .template Ret<ffi::Buffer<ffi::F32>>();         // lse
}

// The options of every decode target (after its buffers).
template <typename Binding>
auto bind_decode_options(Binding b) {
  return std::move(b).template Attr<float>("scale")
      .template Attr<int32_t>("window_left")
      .template Attr<float>("softcap")
      .template Attr<bool>("paged");
}

inline ffi::Error fill_decode(AttnParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                              const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& kv_lengths,
                              const ffi::Buffer<ffi::S32>& block_table, ffi::AnyBuffer& o,
                              ffi::Buffer<ffi::F32>& lse, float scale, int32_t window_left, float softcap,
                              bool paged) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4) return invalid("decode query must be [B, Tq, N, H], got " + dims_str(qd));
  if (kd.size() != 4 || !same_dims(kd, vd))
    return invalid("decode key/value caches must be rank 4 and of one shape, got " + dims_str(kd) + " and " +
                   dims_str(vd));
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type())
    return invalid("query and the caches must share one dtype");
  if (!dtype_of(q.element_type(), &p.dtype)) return invalid("dtype must be float32, bfloat16 or float16");
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3], K = kd[2];
  if (kd[3] != H) return invalid("head dims of query " + dims_str(qd) + " and cache " + dims_str(kd) + " differ");
  if (K <= 0 || N % K != 0)
    return invalid("query heads must be a multiple of cache heads: " + dims_str(qd) + " vs " + dims_str(kd));
  if (H < 1 || H > 256) return invalid("head dim must be in [1, 256], got " + std::to_string(H));
  if (B < 1 || T < 1 || T > kDecodeMaxQueries)
    return invalid("decode query must have B >= 1 and 1 <= Tq <= 16, got " + dims_str(qd));
  if (static_cast<int64_t>(kv_lengths.element_count()) != B)
    return invalid("kv_lengths must hold one int32 per row (" + std::to_string(B) + "), got " +
                   dims_str(kv_lengths.dimensions()));
  if (!std::isfinite(scale)) return invalid("scale must be finite");
  if (window_left < -1) return invalid("window_left must be >= 0 (or -1 for unlimited)");
  if (!std::isfinite(softcap) || softcap < 0.f) return invalid("logits soft cap must be finite and >= 0 (0 = off)");
  if (!same_dims(o.dimensions(), qd) || o.element_type() != q.element_type())
    return invalid("output must have the query's shape and dtype");
  if (!is_row_stat_of(qd, lse.dimensions())) return invalid("lse must be [B, Tq, N], got " + dims_str(lse.dimensions()));
  const int64_t kIntMax = 2147483647;
  if (B > kIntMax || N > kIntMax || kd[0] > kIntMax || kd[1] > kIntMax) return invalid("sizes too large");

  p.batch = int(B), p.seqlen_q = int(T), p.num_heads = int(N), p.num_heads_k = int(K), p.head_dim = int(H);
  if (paged) {
    auto bd = block_table.dimensions();
    const int64_t P = kd[0], ps = kd[1];
    if (bd.size() != 2 || bd[0] != B || bd[1] < 1)
      return invalid("block_table must be int32 [B, max_pages] with B = " + std::to_string(B) + ", got " +
                     dims_str(bd));
    if (ps < kDecodeMinPageSize || ps > kDecodeMaxPageSize || ps % 16 != 0)
      return invalid("page size must be a multiple of 16 in [16, 256], got " + std::to_string(ps));
    if (P < 1) return invalid("the paged cache holds no page");
    if (bd[1] * ps > kIntMax) return invalid("max_pages * page_size too large");
    p.page_size = int(ps), p.max_pages = int(bd[1]), p.num_pages = int(P);
    p.seqlen_k = int(bd[1] * ps);
    p.block_table = block_table.typed_data();
  } else {
    if (kd[0] != B) return invalid("contiguous cache batch " + dims_str(kd) + " differs from the query's " + dims_str(qd));
    if (kd[1] < 1) return invalid("cache capacity must be at least 1");
    p.seqlen_k = int(kd[1]);
  }
  set_contiguous_strides(p);  // q, o; and k, v per row (batch stride fixed below)
  p.k_batch_stride = p.v_batch_stride = kd[1] * p.k_row_stride;  // row or page stride
  p.scale = scale;
  p.is_causal = true;
  p.window_left = window_left;
  p.window_right = -1;
  p.softcap = softcap;
  p.kv_lengths = kv_lengths.typed_data();
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.o = o.untyped_data();
  p.lse = lse.typed_data();
  return ffi::Error::Success();
}

}  // namespace jaxattn
