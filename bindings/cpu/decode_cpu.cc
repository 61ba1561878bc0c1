// CPU decode attention: Tq (1..16) bottom-right aligned queries per row over
// a contiguous or paged KV cache.
//
// Design
//  * Split-KV: one task per (row b, chunk of keys). For each KV head the task
//    computes the attention of the G * Tq query rows that share it (GQA
//    packing: every cached key/value byte is read once per chunk) with an
//    online softmax in f32 (log2 units, Q pre-multiplied by scale * log2(e)).
//    With more than one chunk per row the tasks leave partial outputs and
//    their logsumexp, merged by a logsumexp-weighted sum (combine()); the
//    chunk count is chosen so that every thread has work even at batch 1.
//  * Tiles of 64 keys (32 or 16 when K * H > 1024, so that a tile's panels
//    stay in L2): the row offsets follow the pages without a division per key
//    (a page id is read, and clamped to the cache, when the walk enters its
//    page); every head's K rows are converted key by key and transposed into
//    [H x tile] panels through registers (store_transposed), the V rows
//    converted likewise, then each head's products run on the
//    register-blocked gemm of flash_cpu_kernels.h. Reading all heads of a key
//    together reads the cache in order: one head's rows alone lie K * H
//    elements apart, a stride that streams at half the read bandwidth (2-core
//    development machine, docs/perf.md).
//  * Visibility: query i of row b (position pos = len - Tq + i, len =
//    kv_lengths[b] clamped to the capacity) sees keys max(0, pos - wl) <= j
//    <= pos. Tiles entirely visible to every query skip the per-key test.
//  * Compiled per ISA (AVX-512, AVX2, SSE2), picked at run time (isa.h).

#include "cpu/decode_cpu.h"

#pragma GCC diagnostic ignored "-Wpsabi"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu/flash_cpu_kernels.h"
#include "cpu/isa.h"
#include "cpu/parallel_for.h"

namespace jaxattn::cpu {
namespace {

using namespace kern;

constexpr int kTile = 64;           // keys per tile at most: a multiple of every lane count
constexpr int kMinChunk = 4 * kTile;  // keys per split-KV chunk, at least
// Bytes of f32 K and V panels a tile may hold (every head), so they stay in a
// core's L2; wide rows (K * H > 1024) take shorter tiles, 16 keys at least.
constexpr int kPanelBytes = 512 << 10;

// How the keys of a row are cut into chunks.
struct Plan {
  int splits = 1;  // chunks per row
  int chunk = 0;   // keys per chunk, a multiple of kTile
  int tile = kTile;  // keys per tile: 16, 32 or 64
};

// The keys any query of row b may see: [lo, len).
struct RowKeys {
  int lo, len;
};

inline RowKeys row_keys(const AttnParams& p, int b) {
  const int len = std::clamp<int>(p.kv_lengths[b], 0, p.seqlen_k);
  int64_t lo = 0;
  if (p.window_left >= 0) lo = std::max<int64_t>(0, int64_t(len) - p.seqlen_q - p.window_left);
  return {int(std::min<int64_t>(lo, len)), len};
}

// Element offsets of keys j0 .. j0 + nk - 1 of row b (KV head 0) in the K and
// V caches: a contiguous cache's rows, or a walk along the row's pages (each
// page id clamped to the cache, so a bad id never reads out of bounds).
inline void key_offsets(const AttnParams& p, int b, int j0, int nk, int64_t* koff, int64_t* voff) {
  if (p.block_table == nullptr) {
    for (int jj = 0; jj < nk; ++jj) {
      koff[jj] = b * p.k_batch_stride + int64_t(j0 + jj) * p.k_row_stride;
      voff[jj] = b * p.v_batch_stride + int64_t(j0 + jj) * p.v_row_stride;
    }
    return;
  }
  const int32_t* pages = p.block_table + int64_t(b) * p.max_pages;
  int page_index = j0 / p.page_size, in_page = j0 % p.page_size;
  int64_t page = std::clamp<int32_t>(pages[page_index], 0, p.num_pages - 1);
  for (int jj = 0; jj < nk; ++jj, ++in_page) {
    if (in_page == p.page_size) {
      in_page = 0;
      page = std::clamp<int32_t>(pages[++page_index], 0, p.num_pages - 1);
    }
    koff[jj] = page * p.k_batch_stride + in_page * p.k_row_stride;
    voff[jj] = page * p.v_batch_stride + in_page * p.v_row_stride;
  }
}

// $JAXATTN_CPU_DECODE_CHUNK (keys, rounded up to a tile), for tests of the
// split path; 0 when unset.
int forced_chunk() {
  const char* env = std::getenv("JAXATTN_CPU_DECODE_CHUNK");
  if (env == nullptr) return 0;
  const long v = std::strtol(env, nullptr, 10);
  return v > 0 && v < (1 << 24) ? round_up(int(v), kTile) : 0;
}

Plan make_plan(const AttnParams& p, int threads) {
  // Keys one row may need at most.
  int64_t span = p.seqlen_k;
  if (p.window_left >= 0) span = std::min<int64_t>(span, int64_t(p.seqlen_q) + p.window_left);
  span = std::max<int64_t>(span, 1);
  const int64_t items = p.batch;  // a task runs every KV head of its row
  int64_t splits = (2 * int64_t(threads) + items - 1) / items;  // two tasks per thread
  splits = std::clamp<int64_t>(splits, 1, (span + kMinChunk - 1) / kMinChunk);
  Plan plan;
  plan.chunk = round_up(int((span + splits - 1) / splits), kTile);
  const int64_t fit = kPanelBytes / (8 * int64_t(p.num_heads_k) * p.head_dim);  // f32 K + V per key
  plan.tile = fit >= 64 ? 64 : fit >= 32 ? 32 : 16;
  if (const int c = forced_chunk()) plan.chunk = c;
  plan.splits = int((span + plan.chunk - 1) / plan.chunk);
  return plan;
}

// Logit soft cap on logits in log2 units: x (natural) -> cap * tanh(x / cap).
JAXATTN_AI void softcap_logits(float cap, int n, float* s) {
  const float in = kLn2 / cap, out = cap * kLog2e;
  for (int j = 0; j < n; ++j) s[j] = std::tanh(s[j] * in) * out;
}

// Per-task results: the final output (one chunk) or a split's partials.
struct Sink {
  float* split_o;    // [B, K, splits, rows, H] or null
  float* split_lse;  // [B, K, splits, rows], log2 units
};

template <class F, class I, int R, int CV, DType D>
JAXATTN_AI void decode_worker(const AttnParams& p, const Plan& plan, const Sink& sink, TaskCounter& tc) {
  constexpr int W = sizeof(F) / 4;
  const int T = p.seqlen_q, N = p.num_heads, K = p.num_heads_k, G = p.group_size();
  const int H = p.head_dim, Hp = round_up(H, W), rows = T * G;
  const int wl = p.window_left;
  const float qmul = p.scale * kLog2e;

  const int tile = plan.tile;
  // Per KV head kh: its query rows (qs), output accumulator (oacc) and
  // softmax state (m, l) at [kh * rows ...]; per tile every head's panels.
  Buf qs(size_t(K) * rows * Hp), oacc(size_t(K) * rows * Hp), mrow(size_t(K) * rows), lrow(size_t(K) * rows),
      kt(size_t(K) * H * tile), vr(size_t(K) * tile * Hp), st(size_t(rows) * tile), pack(size_t(K) * W * Hp),
      alpha(rows);
  int64_t koff[kTile], voff[kTile];

  for (int64_t t; (t = tc.next()) >= 0;) {
    const int s = int(t % plan.splits), b = int(t / plan.splits);
    const RowKeys rk = row_keys(p, b);
    const int j_begin = rk.lo + s * plan.chunk;
    const int j_end = std::min(rk.len, j_begin + plan.chunk);

    // Query rows kh * rows + r, r = i * G + g: query i of head kh * G + g.
    for (int kh = 0; kh < K; ++kh) {
      for (int i = 0; i < T; ++i) {
        for (int g = 0; g < G; ++g) {
          const int r = kh * rows + i * G + g;
          load_row<D>(p.q, b * p.q_batch_stride + i * p.q_row_stride + (kh * G + g) * p.q_head_stride, H, qmul,
                      qs.data() + size_t(r) * Hp);
          mrow[r] = -kInf;
          lrow[r] = 0.f;
        }
      }
    }
    std::memset(oacc.data(), 0, sizeof(float) * K * rows * Hp);

    for (int j0 = j_begin; j0 < j_end; j0 += tile) {
      const int nk = std::min(tile, j_end - j0);
      key_offsets(p, b, j0, nk, koff, voff);
      // Every key of the tile visible to every query?
      const bool full = j0 + nk - 1 <= rk.len - T && (wl < 0 || j0 >= rk.len - 1 - wl);
      // Every head's panels, gathered key by key (the cache in order).
      for (int j = 0; j < nk; j += W) {
        const int n = std::min(W, nk - j);
        for (int k = 0; k < W; ++k) {
          for (int kh = 0; kh < K; ++kh) {
            float* row = pack.data() + size_t(kh * W + k) * Hp;
            if (k < n) {
              load_row<D>(p.k, koff[j + k] + kh * p.k_head_stride, H, 1.f, row);
            } else {
              std::memset(row, 0, sizeof(float) * H);
            }
          }
        }
        for (int kh = 0; kh < K; ++kh) {
          store_transposed<F, I>(pack.data() + size_t(kh) * W * Hp, H, kt.data() + size_t(kh) * H * tile + j, tile);
        }
      }
      for (int jj = 0; jj < nk; ++jj) {
        for (int kh = 0; kh < K; ++kh) {
          load_row<D>(p.v, voff[jj] + kh * p.v_head_stride, H, 1.f, vr.data() + (size_t(kh) * tile + jj) * Hp);
        }
      }
      for (int kh = 0; kh < K; ++kh) {
        float* const q = qs.data() + size_t(kh) * rows * Hp;
        float* const o = oacc.data() + size_t(kh) * rows * Hp;
        float* const m = mrow.data() + size_t(kh) * rows;
        float* const l = lrow.data() + size_t(kh) * rows;
        const float* const khp = kt.data() + size_t(kh) * H * tile;
        const float* const vhp = vr.data() + size_t(kh) * tile * Hp;
        // S = Q K^T (log2 units); columns >= nk are masked below.
        gemm<F, R, CV, Acc::kSet>(rows, tile, H, q, Hp, 1, khp, tile, st.data(), tile);
        for (int r = 0; r < rows; ++r) {
          float* sr = st.data() + size_t(r) * tile;
          if (p.softcap > 0.f) softcap_logits(p.softcap, nk, sr);
          if (!full) {
            const int pos = rk.len - T + r / G;
            for (int jj = 0; jj < nk; ++jj) {
              const int j = j0 + jj;
              if (j > pos || (wl >= 0 && j < pos - wl)) sr[jj] = -kInf;
            }
          }
          for (int jj = nk; jj < tile; ++jj) sr[jj] = -kInf;
          alpha[r] = online_softmax_row<F, I>(sr, tile, m[r], l[r]);
        }
        // O = O * alpha + P V
        gemm<F, R, CV, Acc::kScaleAdd>(rows, Hp, nk, st.data(), tile, 1, vhp, Hp, o, Hp, alpha.data());
      }
    }

    for (int kh = 0; kh < K; ++kh) {
      for (int r = 0; r < rows; ++r) {
        const int kr = kh * rows + r;
        const float l = lrow[kr];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const float lse2 = l > 0.f ? mrow[kr] + std::log2(l) : -kInf;
        const int i = r / G, n = kh * G + r % G;
        if (sink.split_o == nullptr) {
          store_row<D>(oacc.data() + size_t(kr) * Hp, H, inv,
                       p.o, b * p.o_batch_stride + i * p.o_row_stride + n * p.o_head_stride);
          p.lse[(int64_t(b) * T + i) * N + n] = lse2 * kLn2;
        } else {
          const int64_t slot = ((int64_t(b) * K + kh) * plan.splits + s) * rows + r;
          store_row<DType::kF32>(oacc.data() + size_t(kr) * Hp, H, inv, sink.split_o, slot * H);
          sink.split_lse[slot] = lse2;
        }
      }
    }
  }
}

// Merges the splits of one (row, KV head) into o and lse.
template <DType D>
void combine(const AttnParams& p, const Plan& plan, const Sink& sink, int b, int kh, float* acc) {
  const int T = p.seqlen_q, N = p.num_heads, K = p.num_heads_k, G = p.group_size(), H = p.head_dim;
  const int rows = T * G;
  for (int r = 0; r < rows; ++r) {
    const int64_t slot0 = ((int64_t(b) * K + kh) * plan.splits) * rows + r;
    float m = -kInf;
    for (int s = 0; s < plan.splits; ++s) m = std::max(m, sink.split_lse[slot0 + int64_t(s) * rows]);
    std::fill(acc, acc + H, 0.f);
    float wsum = 0.f;
    if (m != -kInf) {
      for (int s = 0; s < plan.splits; ++s) {
        const int64_t slot = slot0 + int64_t(s) * rows;
        const float w = std::exp2(sink.split_lse[slot] - m);
        if (w == 0.f) continue;
        const float* o = sink.split_o + slot * H;
        for (int h = 0; h < H; ++h) acc[h] += w * o[h];
        wsum += w;
      }
    }
    const int i = r / G, n = kh * G + r % G;
    store_row<D>(acc, H, wsum > 0.f ? 1.f / wsum : 0.f, p.o,
                 b * p.o_batch_stride + i * p.o_row_stride + n * p.o_head_stride);
    p.lse[(int64_t(b) * T + i) * N + n] = wsum > 0.f ? (m + std::log2(wsum)) * kLn2 : -kInf;
  }
}

#define JAXATTN_DECODE_WORKER(NAME, TARGET, F, I, R, CV)                                       \
  TARGET void NAME(const AttnParams& p, const Plan& plan, const Sink& sink, TaskCounter& tc) { \
    switch (p.dtype) {                                                                         \
      case DType::kF32: return decode_worker<F, I, R, CV, DType::kF32>(p, plan, sink, tc);     \
      case DType::kBF16: return decode_worker<F, I, R, CV, DType::kBF16>(p, plan, sink, tc);   \
      case DType::kF16: return decode_worker<F, I, R, CV, DType::kF16>(p, plan, sink, tc);     \
    }                                                                                          \
  }

JAXATTN_DECODE_WORKER(decode_avx512, JAXATTN_TARGET_AVX512, f32x16, i32x16, 4, 4)
JAXATTN_DECODE_WORKER(decode_avx2, JAXATTN_TARGET_AVX2, f32x8, i32x8, 4, 3)
JAXATTN_DECODE_WORKER(decode_sse2, JAXATTN_TARGET_SSE2, f32x4, i32x4, 4, 3)

}  // namespace

void decode_fwd(const AttnParams& p) {
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.num_heads_k <= 0 || p.head_dim <= 0) return;
  const int threads = num_threads();
  const Plan plan = make_plan(p, threads);
  const int rows = p.seqlen_q * p.group_size();
  const int64_t heads = int64_t(p.batch) * p.num_heads_k;
  std::vector<float> split_o, split_lse;
  Sink sink{nullptr, nullptr};
  if (plan.splits > 1) {
    split_o.resize(size_t(heads) * plan.splits * rows * p.head_dim);
    split_lse.resize(size_t(heads) * plan.splits * rows);
    sink = {split_o.data(), split_lse.data()};
  }
  const int64_t ntasks = int64_t(p.batch) * plan.splits;
  // A thread per ~1 MB of cache read (thread start-up costs tens of microseconds).
  const double bytes = double(heads) * plan.splits * plan.chunk * p.head_dim * 2 * (p.dtype == DType::kF32 ? 4 : 2);
  const int workers = int(std::clamp<int64_t>(int64_t(bytes / 1e6) + 1, 1, std::min<int64_t>(threads, ntasks)));
  TaskCounter tc(ntasks);
  const CpuIsa isa = detect_cpu_isa();
  run_parallel(workers, [&](int) {
    switch (isa) {
      case CpuIsa::kAvx512: return decode_avx512(p, plan, sink, tc);
      case CpuIsa::kAvx2: return decode_avx2(p, plan, sink, tc);
      case CpuIsa::kSse2: return decode_sse2(p, plan, sink, tc);
    }
  });
  if (plan.splits > 1) {
    std::vector<float> acc(p.head_dim);
    for (int b = 0; b < p.batch; ++b) {
      for (int kh = 0; kh < p.num_heads_k; ++kh) {
        switch (p.dtype) {
          case DType::kF32: combine<DType::kF32>(p, plan, sink, b, kh, acc.data()); break;
          case DType::kBF16: combine<DType::kBF16>(p, plan, sink, b, kh, acc.data()); break;
          case DType::kF16: combine<DType::kF16>(p, plan, sink, b, kh, acc.data()); break;
        }
      }
    }
  }
}

}  // namespace jaxattn::cpu
