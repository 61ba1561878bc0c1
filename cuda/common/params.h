// The one description of an attention call that every backend reads.
//
// Plain C++ (no CUDA types): included by the XLA FFI handlers in bindings/,
// by the CPU kernels and by the CUDA kernels alike. The handlers fill it from
// the XLA buffers; a kernel reads nothing else.
#pragma once

#include <cstdint>

namespace jaxattn {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Query rows per dQ-ordering counter of the deterministic backward (the smallest
// query block of any backward kernel).
constexpr int kDqSemaphoreRows = 32;

// Items (queries or keys) per entry of the segment-id range tables
// (AttnParams::q_segment_ranges / kv_segment_ranges).
constexpr int kSegmentBlock = 64;

struct AttnParams {
  // ---- sizes ------------------------------------------------------------
  // batch folds every leading dimension of the buffers (vmap adds some).
  int batch = 0;
  int seqlen_q = 0;     // T
  int seqlen_k = 0;     // S
  int num_heads = 0;    // N (query heads)
  int num_heads_k = 0;  // K (key/value heads), N % K == 0
  int head_dim = 0;     // H
  DType dtype = DType::kF32;  // of q, k, v, o, dout, dq, dk, dv

  // ---- options ----------------------------------------------------------
  float scale = 1.f;       // logits = scale * q.k
  bool is_causal = false;  // top-left aligned: query i attends keys j <= i
  // Local window (as jax.nn.dot_product_attention's local_window_size):
  // query i sees keys i - window_left <= j <= i + window_right; -1 = unlimited.
  int window_left = -1;
  int window_right = -1;
  // Per-batch valid lengths, int32 [batch] (null = full T / S). Query rows
  // i >= q_lengths[b] see no key (output 0, lse -inf); keys j >=
  // kv_lengths[b] are invisible. Values are clamped to [0, T] / [0, S].
  const int32_t* q_lengths = nullptr;
  const int32_t* kv_lengths = nullptr;
  // Logit soft cap: logits become softcap * tanh(logits / softcap) before
  // masking; 0 = off.
  float softcap = 0.f;

  // ---- masks, stage 2: document segments, dense bias and mask ------------
  // Segment ids, int32 [batch, T] / [batch, S], both or neither (null):
  // query i sees key j only when q_segment_ids[b, i] == kv_segment_ids[b, j].
  const int32_t* q_segment_ids = nullptr;
  const int32_t* kv_segment_ids = nullptr;
  // Optional, with the segment ids: (min, max) id of each block of
  // kSegmentBlock consecutive queries / keys, int32 [batch, ceil(T / 64), 2] /
  // [batch, ceil(S / 64), 2] (jaxattn computes them; null = absent). With them
  // a CTA finds the keys (queries) its rows' documents can see by reading
  // S / 64 pairs instead of scanning S ids (common/mask.cuh cta_segment_span).
  const int32_t* q_segment_ranges = nullptr;
  const int32_t* kv_segment_ranges = nullptr;
  // Dense additive bias (f32) and boolean mask (true = attend), each a
  // contiguous array of dims [E, Bb, Nb, Tb, Sb] read broadcast against
  // [batch, N, T, S]: the folded batch is E * (batch / E) entries (E folds
  // vmapped dimensions), Bb is 1 or batch / E, Nb is 1 or N, Tb 1 or T, Sb 1
  // or S; a dimension of size 1 is read with stride 0 (never expanded).
  // logits = softcap(scale * q.k) + bias, then masked. null = none.
  const float* bias = nullptr;
  int bias_dims[5] = {1, 1, 1, 1, 1};
  const bool* mask = nullptr;
  int mask_dims[5] = {1, 1, 1, 1, 1};
  // Backward only: the gradient of the bias (f32, bias_dims, contiguous),
  // d(loss)/d(logits) summed over the broadcast dimensions; null = not wanted.
  float* dbias = nullptr;

  // ---- forward tensors --------------------------------------------------
  // q, o, dout, dq: [B, T, N, H]; k, v, dk, dv: [B, S, K, H]; head dim
  // contiguous. Strides are in elements.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // [B, T, N], natural log; -inf for a row with no key
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  // lse is contiguous [B, T, N].

  // ---- backward tensors -------------------------------------------------
  const void* dout = nullptr;  // strides: o_*
  // Cotangent of lse, [B, T, N] contiguous f32, or null for zero. It enters
  // the backward only through dpsum: D = rowsum(dout * o) - dlse.
  const float* dlse = nullptr;
  void* dq = nullptr;          // strides: q_*
  void* dk = nullptr;          // strides: k_*
  void* dv = nullptr;          // strides: v_*

  // ---- workspace (f32, extra outputs of the ffi_call; may be null) -------
  float* dq_accum = nullptr;  // [B, T, N, H] contiguous
  float* dpsum = nullptr;     // [B, N, T] contiguous: rowsum(dout * o) - dlse
  // Deterministic backward: the key blocks add their dQ into dq_accum in a fixed
  // order (key block 0, 1, ...), sequenced by one int32 counter per (b, n, block
  // of kDqSemaphoreRows query rows), which the launcher zeroes. Null otherwise.
  bool deterministic = false;
  int32_t* dq_semaphore = nullptr;  // [B, N, ceil(T / kDqSemaphoreRows)]
  // Forward with segment ids, T == S: the document tiles' workspace, int32 [B,
  // doc_tile_ints(T)] (common/doc_tiles.h), or null. The Hopper forward fills it
  // and reads it back; the other kernels ignore it.
  int32_t* doc_tiles = nullptr;

  // ==== decode: attention over a KV cache (jaxattn.decode_attention) =====
  // Set only by the decode handlers (bindings/decode_params.h); the flash
  // kernels never read this block. In a decode call:
  //  * seqlen_q (Tq, 1..16) queries per row are bottom-right aligned: query i
  //    of row b sits at position kv_lengths[b] - seqlen_q + i and sees keys
  //    pos - window_left <= j <= pos (is_causal, window_right and q_lengths
  //    are not used; a query with pos < 0 sees nothing: output 0, lse -inf).
  //  * seqlen_k is the capacity of one row: S_max (contiguous) or
  //    max_pages * page_size (paged). kv_lengths (never null) are clamped to
  //    [0, seqlen_k].
  //  * Contiguous cache (block_table null): k/v [B, S_max, K, H], strides as
  //    in the forward. Paged cache: k/v [num_pages, page_size, K, H]; key j of
  //    row b is row j % page_size of page block_table[b * max_pages + j /
  //    page_size], an id clamped to [0, num_pages); k_batch_stride /
  //    v_batch_stride are the page strides. Only the pages holding keys
  //    below the row's length are looked up.
  const int32_t* block_table = nullptr;  // int32 [B, max_pages], or null
  int page_size = 0;                     // keys per page, 16..256 (paged)
  int max_pages = 0;                     // block_table columns (paged)
  int num_pages = 0;                     // pages in the cache (paged)
  // Split-KV workspace (f32, may be null: a kernel that needs it then
  // allocates its own): partial outputs [B, K, num_splits, Tq * G, H] and
  // their logsumexp (log2 units) [B, K, num_splits, Tq * G].
  int num_splits = 0;
  float* split_o = nullptr;
  float* split_lse = nullptr;
  // ==== end of the decode block ============================================

  // (Last, so that the members above keep their offsets in the kernels' parameters.)
  // Hopper backward's tail split (sm90/bwd_tail.cuh): f32
  // [dkv_tail_units][2][128][H], the dK / dV partial sums of the key blocks whose query
  // range is split over several CTAs in the grid's last wave, or null (no split).
  float* dkv_tail = nullptr;
  int dkv_tail_units = 0;

  int group_size() const { return num_heads / num_heads_k; }
  // Whether the call uses any option beyond is_causal (window, lengths, soft
  // cap, segments, dense bias or mask): the masked kernels' cue.
  bool has_masks() const {
    return window_left >= 0 || window_right >= 0 || q_lengths || kv_lengths || softcap > 0.f || q_segment_ids ||
           bias || mask;
  }
};

// Fills the strides of contiguous [B, T, N, H] / [B, S, K, H] buffers.
inline void set_contiguous_strides(AttnParams& p) {
  const int64_t H = p.head_dim;
  p.q_head_stride = H;
  p.q_row_stride = H * p.num_heads;
  p.q_batch_stride = p.q_row_stride * p.seqlen_q;
  p.o_head_stride = p.q_head_stride;
  p.o_row_stride = p.q_row_stride;
  p.o_batch_stride = p.q_batch_stride;
  p.k_head_stride = H;
  p.k_row_stride = H * p.num_heads_k;
  p.k_batch_stride = p.k_row_stride * p.seqlen_k;
  p.v_head_stride = p.k_head_stride;
  p.v_row_stride = p.k_row_stride;
  p.v_batch_stride = p.k_batch_stride;
}

}  // namespace jaxattn
