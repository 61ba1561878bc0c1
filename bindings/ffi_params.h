// Turns the XLA FFI buffers of a call into the one AttnParams every backend
// reads, validating shapes and dtypes on the way. Shared by the CPU and CUDA
// handlers, so both accept exactly the same calls.
//
// Buffers: q [..., T, N, H], k and v [..., S, K, H], every leading dimension
// folded into the batch (vmap adds leading dimensions).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "common/params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxattn {

namespace ffi = xla::ffi;

inline std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jaxattn: " + what);
}

inline bool dtype_of(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    default: return false;
  }
}

// True when `b` has exactly the dimensions `want`.
inline bool same_dims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// `b` must be `ref` without its last dimension (lse, dlse against q).
inline bool is_row_stat_of(ffi::AnyBuffer::Dimensions ref, ffi::AnyBuffer::Dimensions b) {
  if (b.size() + 1 != ref.size()) return false;
  for (size_t i = 0; i < b.size(); ++i)
    if (b[i] != ref[i]) return false;
  return true;
}

// Sizes, dtype and options from q, k, v; strides of contiguous buffers.
inline ffi::Error fill_sizes(AttnParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                             const ffi::AnyBuffer& v, float scale, bool is_causal) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() < 4) return invalid("query must have rank >= 4, got " + dims_str(qd));
  if (kd.size() != qd.size() || vd.size() != qd.size())
    return invalid("query, key, value ranks differ: " + dims_str(qd) + ", " + dims_str(kd) + ", " + dims_str(vd));
  if (!same_dims(kd, vd)) return invalid("key and value shapes differ: " + dims_str(kd) + " vs " + dims_str(vd));
  const size_t r = qd.size();
  int64_t batch = 1;
  for (size_t i = 0; i + 3 < r; ++i) {
    if (qd[i] != kd[i]) return invalid("batch dimensions of query " + dims_str(qd) + " and key " + dims_str(kd) + " differ");
    batch *= qd[i];
  }
  if (qd[r - 1] != kd[r - 1]) return invalid("head dims of query " + dims_str(qd) + " and key " + dims_str(kd) + " differ");
  const int64_t N = qd[r - 2], K = kd[r - 2];
  if (K <= 0 || N % K != 0) return invalid("query heads must be a multiple of key heads: " + dims_str(qd) + " vs " + dims_str(kd));
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type())
    return invalid("query, key and value must share one dtype");
  if (!dtype_of(q.element_type(), &p.dtype)) return invalid("dtype must be float32, bfloat16 or float16");
  const int64_t T = qd[r - 3], S = kd[r - 3], H = qd[r - 1];
  if (H < 1 || H > 256) return invalid("head dim must be in [1, 256], got " + std::to_string(H));
  if (S < 1) return invalid("key/value sequence must not be empty");
  // Empty queries or batches never reach a kernel: the Python wrapper
  // returns zeros without a call, so an empty call here is a caller's bug.
  if (batch < 1 || T < 1 || N < 1) return invalid("query must not be empty, got " + dims_str(qd));
  if (!std::isfinite(scale)) return invalid("scale must be finite");
  const int64_t kIntMax = 2147483647;
  if (batch > kIntMax || T > kIntMax || S > kIntMax || N > kIntMax)
    return invalid("sizes too large");
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(T);
  p.seqlen_k = static_cast<int>(S);
  p.num_heads = static_cast<int>(N);
  p.num_heads_k = static_cast<int>(K);
  p.head_dim = static_cast<int>(H);
  p.scale = scale;
  p.is_causal = is_causal;
  set_contiguous_strides(p);
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  return ffi::Error::Success();
}

// The forward call: q, k, v -> o, lse.
inline ffi::Error fill_forward(AttnParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                               const ffi::AnyBuffer& v, ffi::AnyBuffer& o, ffi::Buffer<ffi::F32>& lse,
                               float scale, bool is_causal) {
  if (auto e = fill_sizes(p, q, k, v, scale, is_causal); e.failure()) return e;
  if (!same_dims(o.dimensions(), q.dimensions()) || o.element_type() != q.element_type())
    return invalid("output must have the query's shape and dtype");
  if (!is_row_stat_of(q.dimensions(), lse.dimensions()))
    return invalid("lse must have shape " + dims_str(q.dimensions()) + " without its last dimension, got " + dims_str(lse.dimensions()));
  p.o = o.untyped_data();
  p.lse = lse.typed_data();
  return ffi::Error::Success();
}

// The backward call: q, k, v, o, lse, dout, dlse -> dq, dk, dv.
inline ffi::Error fill_backward(AttnParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                const ffi::AnyBuffer& v, const ffi::AnyBuffer& o,
                                const ffi::Buffer<ffi::F32>& lse, const ffi::AnyBuffer& dout,
                                const ffi::Buffer<ffi::F32>& dlse, ffi::AnyBuffer& dq, ffi::AnyBuffer& dk,
                                ffi::AnyBuffer& dv, float scale, bool is_causal) {
  if (auto e = fill_sizes(p, q, k, v, scale, is_causal); e.failure()) return e;
  auto qd = q.dimensions();
  for (const ffi::AnyBuffer* b : {&o, &dout, static_cast<const ffi::AnyBuffer*>(&dq)})
    if (!same_dims(b->dimensions(), qd) || b->element_type() != q.element_type())
      return invalid("out, d_out and d_query must have the query's shape and dtype");
  for (const ffi::AnyBuffer* b : {&dk, &dv})
    if (!same_dims(b->dimensions(), k.dimensions()) || b->element_type() != k.element_type())
      return invalid("d_key and d_value must have the key's shape and dtype");
  if (!is_row_stat_of(qd, lse.dimensions()) || !is_row_stat_of(qd, dlse.dimensions()))
    return invalid("lse and d_lse must have shape " + dims_str(qd) + " without its last dimension");
  p.o = const_cast<void*>(o.untyped_data());
  p.lse = const_cast<float*>(lse.typed_data());
  p.dout = dout.untyped_data();
  p.dlse = dlse.typed_data();
  p.dq = dq.untyped_data();
  p.dk = dk.untyped_data();
  p.dv = dv.untyped_data();
  return ffi::Error::Success();
}

// The masking inputs of a call (after fill_forward / fill_backward): per-batch
// lengths, int32 with one element per folded batch entry (when has_lengths;
// else placeholders, not read), and the window.
inline ffi::Error fill_masks(AttnParams& p, const ffi::Buffer<ffi::S32>& q_lengths,
                             const ffi::Buffer<ffi::S32>& kv_lengths, bool has_lengths, int32_t window_left,
                             int32_t window_right, float softcap) {
  if (has_lengths && (static_cast<int64_t>(q_lengths.element_count()) != p.batch ||
                      static_cast<int64_t>(kv_lengths.element_count()) != p.batch))
    return invalid("query/key-value lengths must hold one int32 per batch entry (" + std::to_string(p.batch) +
                   "), got " + dims_str(q_lengths.dimensions()) + " and " + dims_str(kv_lengths.dimensions()));
  if (window_left < -1 || window_right < -1)
    return invalid("window sizes must be >= 0 (or -1 for unlimited), got (" + std::to_string(window_left) + ", " +
                   std::to_string(window_right) + ")");
  if (!std::isfinite(softcap) || softcap < 0.f)
    return invalid("logits soft cap must be finite and >= 0 (0 = off), got " + std::to_string(softcap));
  p.softcap = softcap;
  if (has_lengths) {
    p.q_lengths = q_lengths.typed_data();
    p.kv_lengths = kv_lengths.typed_data();
  }
  p.window_left = window_left;
  p.window_right = window_right;
  return ffi::Error::Success();
}

// Dims [E, Bb, Nb, Tb, Sb] of a dense bias / mask buffer [..., Bb, Nb, Tb, Sb]
// against the call (every leading dimension folds into E, which must divide
// the folded batch); empty string when it broadcasts, else why not.
inline std::string dense_dims(const AttnParams& p, ffi::AnyBuffer::Dimensions d, int out[5]) {
  if (d.size() < 4) return "must have rank >= 4, got " + dims_str(d);
  const size_t r = d.size();
  int64_t outer = 1;
  for (size_t i = 0; i + 4 < r; ++i) outer *= d[i];
  if (outer < 1 || p.batch % outer != 0)
    return "leading dimensions " + dims_str(d) + " do not divide the batch " + std::to_string(p.batch);
  const int64_t inner = p.batch / outer;
  const int64_t want[4] = {inner, p.num_heads, p.seqlen_q, p.seqlen_k};
  for (int i = 0; i < 4; ++i) {
    const int64_t x = d[r - 4 + i];
    if (x != 1 && x != want[i])
      return "dims " + dims_str(d) + " do not broadcast to [batch, heads, T, S] = [" + std::to_string(inner) +
             ", " + std::to_string(p.num_heads) + ", " + std::to_string(p.seqlen_q) + ", " +
             std::to_string(p.seqlen_k) + "]";
  }
  out[0] = static_cast<int>(outer);
  for (int i = 0; i < 4; ++i) out[1 + i] = static_cast<int>(d[r - 4 + i]);
  return "";
}

// Segment ids and the dense bias / mask (after fill_masks); each flag says
// whether its buffers are real (else they are placeholders, not read).
inline ffi::Error fill_dense_masks(AttnParams& p, const ffi::Buffer<ffi::S32>& q_seg,
                                   const ffi::Buffer<ffi::S32>& kv_seg, const ffi::Buffer<ffi::S32>& q_seg_ranges,
                                   const ffi::Buffer<ffi::S32>& kv_seg_ranges, const ffi::Buffer<ffi::F32>& bias,
                                   const ffi::Buffer<ffi::PRED>& mask, bool has_segments, bool has_bias,
                                   bool has_mask) {
  if (has_segments) {
    if (static_cast<int64_t>(q_seg.element_count()) != int64_t(p.batch) * p.seqlen_q ||
        static_cast<int64_t>(kv_seg.element_count()) != int64_t(p.batch) * p.seqlen_k)
      return invalid("segment ids must be int32 [batch, T] and [batch, S], got " + dims_str(q_seg.dimensions()) +
                     " and " + dims_str(kv_seg.dimensions()));
    p.q_segment_ids = q_seg.typed_data();
    p.kv_segment_ids = kv_seg.typed_data();
    // The (min, max) tables are optional (a [1] placeholder: the kernels scan the ids).
    const int64_t tq = (p.seqlen_q + kSegmentBlock - 1) / kSegmentBlock;
    const int64_t ts = (p.seqlen_k + kSegmentBlock - 1) / kSegmentBlock;
    const int64_t nq = static_cast<int64_t>(q_seg_ranges.element_count());
    const int64_t nk = static_cast<int64_t>(kv_seg_ranges.element_count());
    if (nq != 1 || nk != 1) {
      if (nq != 2 * tq * p.batch || nk != 2 * ts * p.batch)
        return invalid("segment id range tables must be int32 [batch, ceil(T / " + std::to_string(kSegmentBlock) +
                       "), 2] and [batch, ceil(S / " + std::to_string(kSegmentBlock) + "), 2], got " +
                       dims_str(q_seg_ranges.dimensions()) + " and " + dims_str(kv_seg_ranges.dimensions()));
      p.q_segment_ranges = q_seg_ranges.typed_data();
      p.kv_segment_ranges = kv_seg_ranges.typed_data();
    }
  }
  if (has_bias) {
    const std::string why = dense_dims(p, bias.dimensions(), p.bias_dims);
    if (!why.empty()) return invalid("bias " + why);
    p.bias = bias.typed_data();
  }
  if (has_mask) {
    const std::string why = dense_dims(p, mask.dimensions(), p.mask_dims);
    if (!why.empty()) return invalid("mask " + why);
    p.mask = mask.typed_data();
  }
  return ffi::Error::Success();
}

// Every masking operand and option of bind_mask_args (after fill_forward /
// fill_backward): the one decoding the CPU and CUDA handlers share.
inline ffi::Error fill_mask_args(AttnParams& p, const ffi::Buffer<ffi::S32>& q_lengths,
                                 const ffi::Buffer<ffi::S32>& kv_lengths, int32_t window_left, int32_t window_right,
                                 float softcap, const ffi::Buffer<ffi::S32>& q_seg, const ffi::Buffer<ffi::S32>& kv_seg,
                                 const ffi::Buffer<ffi::S32>& q_seg_ranges, const ffi::Buffer<ffi::S32>& kv_seg_ranges,
                                 const ffi::Buffer<ffi::F32>& bias, const ffi::Buffer<ffi::PRED>& mask,
                                 bool has_segments, bool has_bias, bool has_mask, bool has_lengths) {
  if (auto e = fill_masks(p, q_lengths, kv_lengths, has_lengths, window_left, window_right, softcap); e.failure())
    return e;
  return fill_dense_masks(p, q_seg, kv_seg, q_seg_ranges, kv_seg_ranges, bias, mask, has_segments, has_bias,
                          has_mask);
}

// The backward's dbias result (after fill_dense_masks): the bias's shape when
// the bias gradient is wanted; a rank-1 placeholder (or no bias) says it is not.
inline ffi::Error fill_dbias(AttnParams& p, const ffi::Buffer<ffi::F32>& bias, ffi::Buffer<ffi::F32>& dbias) {
  if (p.bias == nullptr || dbias.dimensions().size() == 1) return ffi::Error::Success();
  if (!same_dims(bias.dimensions(), dbias.dimensions()))
    return invalid("dbias must have the bias's shape " + dims_str(bias.dimensions()) + ", got " +
                   dims_str(dbias.dimensions()));
  p.dbias = dbias.typed_data();
  return ffi::Error::Success();
}

}  // namespace jaxattn
