// CPU flash attention, forward and backward.
//
// Design
//  * Everything is computed in f32 on f32 scratch tiles; inputs of any
//    dtype are converted tile by tile (K, V once per head and thread).
//  * Logits are kept in log2 units: Q is pre-multiplied by scale * log2(e)
//    so that softmax weights are exp2(s - m), computed by a vectorized
//    polynomial exp2 (fast_exp.h) that maps -inf to exactly 0.
//  * The products run on a register-blocked kernel over GCC vector types
//    (flash_cpu_kernels.h): S = Q K^T reads a K^T panel [H x BK] (keys
//    contiguous), O += P V reads V rows [BK x Hp] (head dim contiguous).
//  * Forward: one task per (batch, query head, block of BQ queries), online
//    softmax over key blocks of BK. Memory per thread: K^T and V of one kv
//    head (O(S * H)) plus O(BQ * (BK + H)) tiles.
//  * Backward, deterministic, no atomics, in one of two forms with the same
//    sums in the same order (so bit-identical; use_fused_bwd picks one):
//    fused, one task per (batch, kv head) walks its query heads and query
//    blocks, recomputes P and dS once per tile and accumulates dq in the
//    query block's tile, dk and dv over every key in the task's buffers (5
//    matrix products); two passes when a bias gradient is wanted or the
//    (batch, kv head) pairs are too few for the threads: pass 1, one task per
//    (batch, query head, query block), recomputes P and dP and accumulates dq
//    over the keys (it also writes D_i = dout_i . o_i); pass 2, one task per
//    (batch, kv head, key block), recomputes P and dP for every query of the
//    group's heads and accumulates dk, dv (7 products).
//  * Logit soft cap (p.softcap > 0): logits become cap * tanh(logit / cap)
//    before masking; the backward multiplies dS by 1 - tanh^2.
//  * Visibility of key j to query i is Mask::visible (causal, window,
//    lengths, segment ids, dense mask); Mask::classify and the range helpers
//    only let whole blocks be skipped or run unmasked. Segment ids skip a
//    block when the id ranges of its queries and keys do not overlap (with
//    sorted ids the key / query ranges are found by binary search), and a
//    partial block is narrowed to the columns (forward, dq pass) or rows (dk,
//    dv pass) that can be visible, so a batch of packed documents costs
//    about what its documents cost.
//  * A dense bias / mask is read in place through broadcast strides (Dense).
//    The bias gradient is summed in the dq pass, whose tasks then group the
//    (batch, head) pairs that share one bias slice (deterministic, no
//    atomics); a bias broadcast over T sums per query block, then in order.
//  * The workers are compiled three times (AVX-512, AVX2+FMA, SSE2) with
//    GCC target attributes and picked at run time (JAXATTN_CPU_ISA=sse2,
//    avx2 or avx512 forces one, for testing).
//  * Threads: std::thread workers pulling tasks from an atomic counter
//    (parallel_for.h), one per CPU of the caller's affinity mask;
//    JAXATTN_CPU_THREADS overrides the count.

#include "cpu/flash_cpu.h"

// The vector helpers pass GCC vector types by value; they are always inlined
// into workers of the matching target, so the psABI notes do not apply.
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

// ---- masking -----------------------------------------------------------------

enum class BlockKind { kNone, kFull, kPartial };

// A contiguous [E, Bb, Nb, Tb, Sb] array (AttnParams::bias_dims) read as if
// broadcast to [batch, N, T, S]: stride 0 on its size-1 dimensions.
template <class E>
struct Dense {
  const E* data = nullptr;
  int inner = 1;                                   // batch entries per outer entry
  int64_t so = 0, sb = 0, sn = 0, st = 0, ss = 0;  // outer, batch, head, row, col

  Dense() = default;
  Dense(const E* d, const int dims[5], int batch) : data(d) {
    const int64_t B = dims[1], N = dims[2], T = dims[3], S = dims[4];
    inner = batch / dims[0];
    ss = S > 1 ? 1 : 0;
    st = T > 1 ? S : 0;
    sn = N > 1 ? T * S : 0;
    sb = B > 1 ? N * T * S : 0;
    so = B * N * T * S;
  }
  // Element (b, n, 0, 0); then row i, column j at + i * st + j * ss.
  const E* at(int b, int n) const { return data + (b / inner) * so + (b % inner) * sb + n * sn; }
};

inline void min_max(const int32_t* x, int n, int32_t* lo, int32_t* hi) {
  int32_t a = x[0], b = x[0];
  for (int i = 1; i < n; ++i) {
    a = std::min(a, x[i]);
    b = std::max(b, x[i]);
  }
  *lo = a;
  *hi = b;
}

struct Mask {
  int T = 0, S = 0;
  bool causal = false;
  int wl = -1, wr = -1;  // local window (-1: unlimited)
  int ql = 0, kl = 0;    // valid query rows / keys of the current batch entry
  const int32_t* q_lengths = nullptr;
  const int32_t* kv_lengths = nullptr;
  const int32_t* qseg = nullptr;  // segment ids of the current batch entry (null: none)
  const int32_t* kseg = nullptr;
  bool sorted = false;            // both non-decreasing (packed documents)
  Dense<bool> dense;              // dense mask (dense.data null: none)
  const bool* dm = nullptr;       // ... at the current (batch, head)
  int b = -1;
  const AttnParams* p = nullptr;

  explicit Mask(const AttnParams& p)
      : T(p.seqlen_q), S(p.seqlen_k), causal(p.is_causal), wl(p.window_left), wr(p.window_right),
        ql(p.seqlen_q), kl(p.seqlen_k), q_lengths(p.q_lengths), kv_lengths(p.kv_lengths), p(&p) {
    if (p.mask) dense = Dense<bool>(p.mask, p.mask_dims, p.batch);
  }

  // Selects batch entry b (its lengths and segments); call before the other
  // methods, then set_head.
  void set_batch(int b_) {
    const bool same = b_ == b;
    b = b_;
    ql = q_lengths ? std::clamp<int>(q_lengths[b], 0, T) : T;
    kl = kv_lengths ? std::clamp<int>(kv_lengths[b], 0, S) : S;
    if (p->q_segment_ids && !same) {
      qseg = p->q_segment_ids + int64_t(b) * T;
      kseg = p->kv_segment_ids + int64_t(b) * S;
      sorted = std::is_sorted(qseg, qseg + T) && std::is_sorted(kseg, kseg + S);
    }
  }
  // Selects query head n (the dense mask's slice).
  void set_head(int n) {
    if (dense.data) dm = dense.at(b, n);
  }

  // The one visibility predicate: does query i see key j? (The definition:
  // mask_row applies it a row at a time, through row_keys.)
  bool visible(int i, int j) const {
    return i < ql && j < kl && (!causal || j <= i) && (wl < 0 || j >= i - wl) &&
           (wr < 0 || j <= i + wr) && (!qseg || qseg[i] == kseg[j]) &&
           (!dm || dm[i * dense.st + j * dense.ss]);
  }

  // The keys [lo, hi) that query i may see by the positional rules (causal,
  // window, lengths): visible(i, j) is j in [lo, hi) && the segment ids
  // match && the dense mask allows it.
  void row_keys(int i, int* lo, int* hi) const {
    int64_t l = 0, h = i < ql ? kl : 0;
    if (causal) h = std::min<int64_t>(h, int64_t(i) + 1);
    if (wr >= 0) h = std::min<int64_t>(h, int64_t(i) + wr + 1);
    if (wl >= 0) l = std::max<int64_t>(l, int64_t(i) - wl);
    *lo = int(std::min<int64_t>(l, S));
    *hi = int(std::max<int64_t>(h, 0));
  }

  // Rows [i0, i1) x keys [j0, j1), both non-empty: kNone if no pair is
  // visible, kFull if all are, else kPartial (then visible() is asked per
  // pair). Must agree with visible(); erring towards kPartial is safe.
  // Each constraint alone is a half-plane (or a bound on i or j): no pair
  // passes all of them if one excludes the whole block; all pairs pass when
  // every one includes the whole block. Segments: no pair when the id
  // ranges of the rows and keys are disjoint; all when both hold one id.
  BlockKind classify(int i0, int i1, int j0, int j1) const {
    if (i0 >= ql || j0 >= kl) return BlockKind::kNone;
    bool full = i1 <= ql && j1 <= kl;
    if (causal) {
      if (j0 > i1 - 1) return BlockKind::kNone;
      full = full && j1 - 1 <= i0;
    }
    if (wl >= 0) {  // j >= i - wl
      if (j1 - 1 < i0 - wl) return BlockKind::kNone;
      full = full && j0 >= i1 - 1 - wl;
    }
    if (wr >= 0) {  // j <= i + wr
      if (j0 > i1 - 1 + wr) return BlockKind::kNone;
      full = full && j1 - 1 <= i0 + wr;
    }
    if (qseg) {
      int32_t qlo, qhi, klo, khi;
      min_max(qseg + i0, i1 - i0, &qlo, &qhi);
      min_max(kseg + j0, j1 - j0, &klo, &khi);
      if (qhi < klo || khi < qlo) return BlockKind::kNone;
      full = full && qlo == qhi && klo == khi && qlo == klo;
    }
    if (dm) full = false;
    return full ? BlockKind::kFull : BlockKind::kPartial;
  }

  // Keys that queries [i0, i1) may see lie in [lo, hi) (hi <= lo: none).
  void key_range(int i0, int i1, int* lo, int* hi) const {
    *lo = 0;
    *hi = kl;
    if (i0 >= ql) { *hi = 0; return; }
    if (causal) *hi = std::min(*hi, i1);
    if (wr >= 0) *hi = std::min<int64_t>(*hi, int64_t(i1) + wr);
    if (wl >= 0) *lo = std::max(0, i0 - wl);
    if (sorted) {  // the keys of the tile's documents are one interval
      *lo = std::max<int>(*lo, std::lower_bound(kseg, kseg + S, qseg[i0]) - kseg);
      *hi = std::min<int>(*hi, std::upper_bound(kseg, kseg + S, qseg[i1 - 1]) - kseg);
    }
    *lo = std::min(*lo, *hi);
  }

  // Queries that may see keys [j0, j1) lie in [lo, hi) (hi <= lo: none).
  void query_range(int j0, int j1, int* lo, int* hi) const {
    *lo = 0;
    *hi = ql;
    if (j0 >= kl) { *hi = 0; return; }
    if (causal) *lo = std::max(*lo, j0);
    if (wr >= 0) *lo = std::max(*lo, j0 - wr);
    if (wl >= 0) *hi = std::min<int64_t>(*hi, int64_t(j1) + wl);
    if (sorted) {  // the queries of the block's documents are one interval
      *lo = std::max<int>(*lo, std::lower_bound(qseg, qseg + T, kseg[j0]) - qseg);
      *hi = std::min<int>(*hi, std::upper_bound(qseg, qseg + T, kseg[j1 - 1]) - qseg);
    }
    *lo = std::min(*lo, T);
    *hi = std::max(*hi, *lo);
  }

  // The narrowest keys [lo, hi) within [j0, j1) holding every key that some
  // query of [i0, i1) may see (hi <= lo: none): the positional range, then
  // keys whose segment id lies outside the queries' id range are trimmed
  // from both ends.
  void key_span(int i0, int i1, int j0, int j1, int* lo, int* hi) const {
    int a, b;
    key_range(i0, i1, &a, &b);
    a = std::max(a, j0);
    b = std::min(b, j1);
    if (qseg && a < b) {
      int32_t mn, mx;
      min_max(qseg + i0, i1 - i0, &mn, &mx);
      while (a < b && (kseg[a] < mn || kseg[a] > mx)) ++a;
      while (b > a && (kseg[b - 1] < mn || kseg[b - 1] > mx)) --b;
    }
    *lo = a;
    *hi = b;
  }

  // The same for the queries [lo, hi) within [i0, i1) that may see a key of [j0, j1).
  void query_span(int i0, int i1, int j0, int j1, int* lo, int* hi) const {
    int a, b;
    query_range(j0, j1, &a, &b);
    a = std::max(a, i0);
    b = std::min(b, i1);
    if (qseg && a < b) {
      int32_t mn, mx;
      min_max(kseg + j0, j1 - j0, &mn, &mx);
      while (a < b && (qseg[a] < mn || qseg[a] > mx)) ++a;
      while (b > a && (qseg[b - 1] < mn || qseg[b - 1] > mx)) --b;
    }
    *lo = a;
    *hi = b;
  }
};

// Sets masked and padding logits of row i (keys j0 + [0, nk)) to -inf;
// nk keys are real. Mask::visible decomposed into loops the compiler
// vectorizes: the positional rules give one key interval, then segment ids
// and the dense mask are compared key by key.
JAXATTN_AI void mask_row(const Mask& mask, BlockKind kind, int i, int j0, int nk, int bk,
                         float* s) {
  if (kind == BlockKind::kPartial) {
    int lo, hi;
    mask.row_keys(i, &lo, &hi);
    lo = std::clamp(lo - j0, 0, nk);
    hi = std::clamp(hi - j0, lo, nk);
    for (int j = 0; j < lo; ++j) s[j] = -kInf;
    for (int j = hi; j < nk; ++j) s[j] = -kInf;
    if (mask.qseg) {
      const int32_t id = mask.qseg[i];
      const int32_t* ks = mask.kseg + j0;
      for (int j = lo; j < hi; ++j) s[j] = ks[j] == id ? s[j] : -kInf;
    }
    if (mask.dm) {
      const bool* m = mask.dm + i * mask.dense.st + j0 * mask.dense.ss;
      if (mask.dense.ss) {
        for (int j = lo; j < hi; ++j) s[j] = m[j] ? s[j] : -kInf;
      } else if (!m[0]) {
        for (int j = lo; j < hi; ++j) s[j] = -kInf;
      }
    }
  }
  for (int j = nk; j < bk; ++j) s[j] = -kInf;
}

// Logit soft cap of row logits in log2 units (keys [0, nk)): the natural
// logit x becomes cap * tanh(x / cap). t, when given, receives tanh (0 on the
// padding columns [nk, bk)) for the backward's factor 1 - tanh^2.
JAXATTN_AI void softcap_row(float cap, int nk, int bk, float* s, float* t) {
  const float in = kLn2 / cap, out = cap * kLog2e;
  for (int j = 0; j < nk; ++j) {
    const float th = std::tanh(s[j] * in);
    s[j] = th * out;
    if (t) t[j] = th;
  }
  if (t) {
    for (int j = nk; j < bk; ++j) t[j] = 0.f;
  }
}

// dS of the raw logits from dS of the capped ones: times 1 - tanh^2.
JAXATTN_AI void softcap_grad_row(int bk, const float* t, float* ds) {
  for (int j = 0; j < bk; ++j) ds[j] *= 1.f - t[j] * t[j];
}

// Adds the bias of row i (keys j0 + [0, nk)) to logits in log2 units; bp is
// the bias at (batch, head) (Dense::at), null for none.
JAXATTN_AI void bias_row(const Dense<float>& bias, const float* bp, int i, int j0, int nk, float* s) {
  if (!bp) return;
  const float* src = bp + i * bias.st;
  if (bias.ss) {
    src += j0;
    for (int j = 0; j < nk; ++j) s[j] += src[j] * kLog2e;
  } else {
    const float x = src[0] * kLog2e;
    for (int j = 0; j < nk; ++j) s[j] += x;
  }
}

// The columns of a key block that a query tile computes: [c0, c0 + cw) of
// its bk (multiples of the lane count W), the first cn of them real keys.
// A partial block is narrowed to the keys its queries may see (a packed
// document's first block is mostly the previous document's keys).
struct Span {
  int c0 = 0, cw = 0, cn = 0;
};

template <int W>
JAXATTN_AI Span block_span(const Mask& mask, BlockKind kind, int i0, int i1, int j0, int nk, int bk) {
  if (kind != BlockKind::kPartial) return Span{0, bk, nk};
  int lo, hi;
  mask.key_span(i0, i1, j0, j0 + nk, &lo, &hi);
  if (lo >= hi) return Span{};
  const int c0 = (lo - j0) / W * W;
  const int c1 = std::min(bk, round_up(hi - j0, W));
  return Span{c0, c1 - c0, std::min(nk, c1) - c0};
}

// One key block a query tile computes: block kb of bk keys, its kind, the
// span of its columns computed (block_span) and jc, the first computed key.
struct KeyBlock {
  int kb = 0, jc = 0;
  BlockKind kind = BlockKind::kNone;
  Span sp;
};

// The key blocks of bk keys that queries [i0, i0 + nq) may see, in order,
// skipping those the mask hides: for (KeyBlock kb; walk.next(&kb);) { ... }.
template <int W>
class KeyBlockWalk {
 public:
  KeyBlockWalk(const Mask& mask, int i0, int nq, int S, int bk)
      : mask_(mask), i0_(i0), i1_(i0 + nq), S_(S), bk_(bk) {
    int klo;
    mask.key_range(i0_, i1_, &klo, &khi_);
    kb_ = klo / bk;
  }
  JAXATTN_AI bool next(KeyBlock* out) {
    for (; kb_ * bk_ < khi_; ++kb_) {
      const int j0 = kb_ * bk_, nk = std::min(bk_, S_ - j0);
      const BlockKind kind = mask_.classify(i0_, i1_, j0, j0 + nk);
      if (kind == BlockKind::kNone) continue;
      const Span sp = block_span<W>(mask_, kind, i0_, i1_, j0, nk, bk_);
      if (sp.cw == 0) continue;
      *out = KeyBlock{kb_, j0 + sp.c0, kind, sp};
      ++kb_;
      return true;
    }
    return false;
  }

 private:
  const Mask& mask_;
  int i0_, i1_, S_, bk_, khi_ = 0, kb_ = 0;
};

// ---- per-ISA configuration ----------------------------------------------------

struct IsaAvx512 {
  using F = f32x16;
  using I = i32x16;
  static constexpr int R = 4, CV = 4;  // 16 zmm accumulators
};
struct IsaAvx2 {
  using F = f32x8;
  using I = i32x8;
  static constexpr int R = 4, CV = 3;
};
struct IsaSse2 {
  using F = f32x4;
  using I = i32x4;
  static constexpr int R = 4, CV = 3;
};

// Tile sizes (compile-time tuning knobs; the defaults were the fastest on a
// Zen 4 for H = 64).
#ifndef JAXATTN_CPU_BQ
#define JAXATTN_CPU_BQ 64
#endif
#ifndef JAXATTN_CPU_BK
#define JAXATTN_CPU_BK 256
#endif
#ifndef JAXATTN_CPU_BK2
#define JAXATTN_CPU_BK2 64
#endif
constexpr int kBQ = JAXATTN_CPU_BQ;  // queries per tile
// Keys per tile in the forward and the dq pass: at most kBKMax, fewer for a
// short S (a multiple of the lane count either way).
constexpr int kBKMax = JAXATTN_CPU_BK;
// Keys per task (and tile) in the dk/dv pass; a multiple of every lane count.
constexpr int kBK2 = JAXATTN_CPU_BK2;

inline int key_tile(int S, int lanes) { return std::min(kBKMax, round_up(std::max(S, 1), lanes)); }

// Packs keys [j0, j0 + nk) of one head (x[b, j, h_kv, :], base = the offset
// of (b, 0, h_kv)) as a transposed panel dst[h * bk + jj] (kern::pack_panel_t;
// row: scratch of W * Hp floats).
template <class F, class I, DType D>
JAXATTN_AI void pack_keys_t(const void* x, int64_t base, int64_t row_stride, int j0, int nk, int H, int bk,
                            float* __restrict row, float* __restrict dst) {
  pack_panel_t<F, I, D>(x, [&](int jj) { return base + int64_t(j0 + jj) * row_stride; }, nk, H, row, dst, bk);
}

// ---- forward ---------------------------------------------------------------------

template <class Isa, DType D>
JAXATTN_AI void fwd_worker(const AttnParams& p, TaskCounter& tc) {
  using F = typename Isa::F;
  using I = typename Isa::I;
  constexpr int W = sizeof(F) / 4, R = Isa::R, CV = Isa::CV;
  const int T = p.seqlen_q, S = p.seqlen_k, N = p.num_heads, G = p.group_size();
  const int H = p.head_dim, Hp = round_up(H, W);
  const int bk = key_tile(S, W);
  const int nqb = ceil_div(T, kBQ), nkb = ceil_div(S, bk);
  Mask mask(p);
  const Dense<float> bias = p.bias ? Dense<float>(p.bias, p.bias_dims, p.batch) : Dense<float>();
  const float qmul = p.scale * kLog2e;

  Buf kt(size_t(nkb) * H * bk), vr(size_t(nkb) * bk * Hp), qs(size_t(kBQ) * Hp),
      st(size_t(kBQ) * bk), oacc(size_t(kBQ) * Hp), row(size_t(W) * Hp), mrow(kBQ), lrow(kBQ), alpha(kBQ);
  int cached_b = -1, cached_kh = -1;

  for (int64_t t; (t = tc.next()) >= 0;) {
    int qb = int(t % nqb);
    const int n = int((t / nqb) % N), b = int(t / nqb / N);
    if (p.is_causal) qb = nqb - 1 - qb;  // heaviest first
    mask.set_batch(b);
    mask.set_head(n);
    const float* bp = bias.data ? bias.at(b, n) : nullptr;
    const int kh = n / G;
    if (b != cached_b || kh != cached_kh) {
      const int64_t kbase = b * p.k_batch_stride + kh * p.k_head_stride;
      const int64_t vbase = b * p.v_batch_stride + kh * p.v_head_stride;
      for (int kb = 0; kb < nkb; ++kb) {
        const int j0 = kb * bk, nk = std::min(bk, S - j0);
        pack_keys_t<F, I, D>(p.k, kbase, p.k_row_stride, j0, nk, H, bk, row.data(),
                             kt.data() + size_t(kb) * H * bk);
      }
      for (int j = 0; j < S; ++j) {
        load_row<D>(p.v, vbase + j * p.v_row_stride, H, 1.f, vr.data() + size_t(j) * Hp);
      }
      cached_b = b;
      cached_kh = kh;
    }

    const int i0 = qb * kBQ, nq = std::min(kBQ, T - i0);
    const int64_t qbase = b * p.q_batch_stride + n * p.q_head_stride;
    for (int r = 0; r < nq; ++r) {
      load_row<D>(p.q, qbase + (i0 + r) * p.q_row_stride, H, qmul, qs.data() + r * Hp);
      mrow[r] = -kInf;
      lrow[r] = 0.f;
    }
    std::memset(oacc.data(), 0, sizeof(float) * nq * Hp);

    KeyBlockWalk<W> walk(mask, i0, nq, S, bk);
    for (KeyBlock blk; walk.next(&blk);) {
      const int kb = blk.kb, jc = blk.jc;  // jc: first computed key
      const BlockKind kind = blk.kind;
      const Span sp = blk.sp;
      // S = Q K^T (log2 units), columns [c0, c0 + cw) of the block
      gemm<F, R, CV, Acc::kSet>(nq, sp.cw, H, qs.data(), Hp, 1, kt.data() + size_t(kb) * H * bk + sp.c0,
                                bk, st.data() + sp.c0, bk);
      // online softmax
      for (int r = 0; r < nq; ++r) {
        float* s = st.data() + r * bk + sp.c0;
        if (p.softcap > 0.f) softcap_row(p.softcap, sp.cn, sp.cw, s, nullptr);
        bias_row(bias, bp, i0 + r, jc, sp.cn, s);
        if (kind == BlockKind::kPartial || sp.cn < sp.cw) mask_row(mask, kind, i0 + r, jc, sp.cn, sp.cw, s);
        alpha[r] = online_softmax_row<F, I>(s, sp.cw, mrow[r], lrow[r]);
      }
      // O = O * alpha + P V
      gemm<F, R, CV, Acc::kScaleAdd>(nq, Hp, sp.cn, st.data() + sp.c0, bk, 1, vr.data() + size_t(jc) * Hp,
                                     Hp, oacc.data(), Hp, alpha.data());
    }

    const int64_t obase = b * p.o_batch_stride + n * p.o_head_stride;
    for (int r = 0; r < nq; ++r) {
      const float l = lrow[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      store_row<D>(oacc.data() + r * Hp, H, inv, p.o, obase + (i0 + r) * p.o_row_stride);
      if (p.lse) {
        p.lse[(int64_t(b) * T + i0 + r) * N + n] =
            l > 0.f ? (mrow[r] + std::log2(l)) * kLn2 : -kInf;
      }
    }
  }
}

// ---- backward ----------------------------------------------------------------------

// Loads the rows of one query tile that every backward pass needs: Q scaled
// to log2 units, dout, and the per-row lse in log2 units (+inf for a row
// with no visible key, so that its P is exp2(-inf) = 0).
template <DType D>
JAXATTN_AI void load_bwd_tile(const AttnParams& p, int b, int n, int i0, int nq, int Hp,
                              float* qs, float* dos, float* lse2) {
  const int H = p.head_dim, T = p.seqlen_q, N = p.num_heads;
  const float qmul = p.scale * kLog2e;
  const int64_t qbase = b * p.q_batch_stride + n * p.q_head_stride;
  const int64_t obase = b * p.o_batch_stride + n * p.o_head_stride;
  for (int r = 0; r < nq; ++r) {
    load_row<D>(p.q, qbase + (i0 + r) * p.q_row_stride, H, qmul, qs + r * Hp);
    load_row<D>(p.dout, obase + (i0 + r) * p.o_row_stride, H, 1.f, dos + r * Hp);
    const float l = p.lse[(int64_t(b) * T + i0 + r) * N + n];
    lse2[r] = l == -kInf ? kInf : l * kLog2e;
  }
}

// Rows of P = exp2(S - lse2) (masked) in st, then dS = P * (dP - D) in dp.
template <class F, class I>
JAXATTN_AI void p_row(const Mask& mask, BlockKind kind, int i, int j0, int nk, int bk,
                      float lse2, float* s) {
  constexpr int W = sizeof(F) / 4;
  if (kind == BlockKind::kPartial || nk < bk) mask_row(mask, kind, i, j0, nk, bk, s);
  for (int j = 0; j < bk; j += W) vstore(s + j, vexp2<F, I>(vload<F>(s + j) - lse2));
}

template <class F>
JAXATTN_AI void ds_row(int bk, const float* pr, float d, float* dp) {
  constexpr int W = sizeof(F) / 4;
  for (int j = 0; j < bk; j += W) vstore(dp + j, vload<F>(pr + j) * (vload<F>(dp + j) - d));
}

// Packs one kv head's keys and values for tasks that walk query blocks over
// every key block of bk: K^T and V^T panels per block (kt, vt: H x bk each)
// and K rows (kr: Hp floats each), as S = Q K^T, dP = dO V^T and dQ += dS K
// read them. row: scratch of W * Hp floats.
template <class F, class I, DType D>
JAXATTN_AI void pack_head_kv(const AttnParams& p, int b, int kh, int bk, float* row, float* kt,
                             float* vt, float* kr) {
  const int S = p.seqlen_k, H = p.head_dim, Hp = round_up(H, int(sizeof(F) / 4));
  const int64_t kbase = b * p.k_batch_stride + kh * p.k_head_stride;
  const int64_t vbase = b * p.v_batch_stride + kh * p.v_head_stride;
  for (int kb = 0; kb * bk < S; ++kb) {
    const int j0 = kb * bk, nk = std::min(bk, S - j0);
    pack_keys_t<F, I, D>(p.k, kbase, p.k_row_stride, j0, nk, H, bk, row, kt + size_t(kb) * H * bk);
    pack_keys_t<F, I, D>(p.v, vbase, p.v_row_stride, j0, nk, H, bk, row, vt + size_t(kb) * H * bk);
  }
  for (int j = 0; j < S; ++j) load_row<D>(p.k, kbase + j * p.k_row_stride, H, 1.f, kr + size_t(j) * Hp);
}

// D_i = dout_i . o_i for rows [i0, i0 + nq) of head n (dos: the tile's dout),
// less the lse cotangent, which enters only here: dS = P * (dP - (D - dlse)).
// row: scratch of H floats.
template <DType D>
JAXATTN_AI void d_rows(const AttnParams& p, int b, int n, int i0, int nq, int Hp, const float* dos,
                       float* row, float* drow) {
  const int H = p.head_dim, T = p.seqlen_q, N = p.num_heads;
  const int64_t obase = b * p.o_batch_stride + n * p.o_head_stride;
  for (int r = 0; r < nq; ++r) {
    load_row<D>(p.o, obase + (i0 + r) * p.o_row_stride, H, 1.f, row);
    const float* dor = dos + r * Hp;
    float d = 0.f;
    for (int h = 0; h < H; ++h) d += dor[h] * row[h];
    if (p.dlse) d -= p.dlse[(int64_t(b) * T + i0 + r) * N + n];
    drow[r] = d;
  }
}

// One (query tile, key block) tile of the backward: queries [i0, i0 + nq),
// computed keys [j0, j0 + cw) of which the first cn are real; tile rows are
// ld floats apart.
struct Tile {
  int i0, nq, j0, cn, cw, ld;
};

// P (in st) and dS (in dp) of a tile, whose K^T / V^T panels start at ktp /
// vtp (rows ld apart): S = Q K^T and dP = dO V^T, then per row the soft cap,
// the bias, the mask, P = exp2(S - lse) and dS = P * (dP - D). on_ds(r, dS
// row) sees dS of the biased logits (the bias gradient) before the soft
// cap's factor 1 - tanh^2 (tb: the tanh scratch, used with a soft cap).
template <class F, class I, int R, int CV, class OnDs>
JAXATTN_AI void p_ds_tile(const AttnParams& p, const Mask& mask, BlockKind kind, const Dense<float>& bias,
                          const float* bp, const Tile& t, const float* qs, const float* dos,
                          const float* ktp, const float* vtp, const float* lse2, const float* drow,
                          float* st, float* dp, float* tb, OnDs&& on_ds) {
  const int H = p.head_dim, Hp = round_up(H, int(sizeof(F) / 4));
  gemm<F, R, CV, Acc::kSet>(t.nq, t.cw, H, qs, Hp, 1, ktp, t.ld, st, t.ld);
  gemm<F, R, CV, Acc::kSet>(t.nq, t.cw, H, dos, Hp, 1, vtp, t.ld, dp, t.ld);
  for (int r = 0; r < t.nq; ++r) {
    float* sr = st + r * t.ld;
    float* dr = dp + r * t.ld;
    float* tr = p.softcap > 0.f ? tb + r * t.ld : nullptr;
    if (tr) softcap_row(p.softcap, t.cn, t.cw, sr, tr);
    bias_row(bias, bp, t.i0 + r, t.j0, t.cn, sr);
    p_row<F, I>(mask, kind, t.i0 + r, t.j0, t.cn, t.cw, lse2[r], sr);
    ds_row<F>(t.cw, sr, drow[r], dr);
    on_ds(r, dr);
    if (tr) softcap_grad_row(t.cw, tr, dr);
  }
}

// The dq pass's tasks: (group of batch entries, group of heads, query
// block). Without a bias gradient every group is one (batch, head); with one,
// a group is every (batch, head) that reads one bias slice, so one task owns
// (and sums into) each dbias element of its query block.
struct DqGroups {
  int num_b = 0, num_n = 0;      // groups along the batch and the heads
  int b_count = 1, n_count = 1;  // members of each group
  int bias_b = 1, inner = 1;     // Bb and batch entries per outer entry

  explicit DqGroups(const AttnParams& p) : num_b(p.batch), num_n(p.num_heads) {
    if (!p.dbias) return;
    bias_b = p.bias_dims[1];
    inner = p.batch / p.bias_dims[0];
    num_b = p.bias_dims[0] * bias_b;
    b_count = bias_b == 1 ? inner : 1;
    num_n = p.bias_dims[2];
    n_count = num_n == 1 ? p.num_heads : 1;
  }
  int first_b(int g) const { return (g / bias_b) * inner + (bias_b == 1 ? 0 : g % bias_b); }
  int first_n(int g) const { return n_count == 1 ? g : 0; }
};

// Pass 1: dq, D, and dbias (when wanted) for the task's query block, summed
// in dba: rows [0, nq) when the bias has T rows, else row 0.
template <class Isa, DType D>
JAXATTN_AI void bwd_dq_worker(const AttnParams& p, float* dsum, float* dbias_part, TaskCounter& tc) {
  using F = typename Isa::F;
  using I = typename Isa::I;
  constexpr int W = sizeof(F) / 4, R = Isa::R, CV = Isa::CV;
  const int T = p.seqlen_q, S = p.seqlen_k, N = p.num_heads, G = p.group_size();
  const int H = p.head_dim, Hp = round_up(H, W);
  const int bk = key_tile(S, W);
  const int nqb = ceil_div(T, kBQ), nkb = ceil_div(S, bk);
  Mask mask(p);
  const Dense<float> bias = p.bias ? Dense<float>(p.bias, p.bias_dims, p.batch) : Dense<float>();
  const DqGroups grp(p);
  const int Tb = p.bias_dims[3], Sb = p.bias_dims[4];

  Buf kt(size_t(nkb) * H * bk), vt(size_t(nkb) * H * bk), kr(size_t(nkb) * bk * Hp),
      qs(size_t(kBQ) * Hp), dos(size_t(kBQ) * Hp), st(size_t(kBQ) * bk), dp(size_t(kBQ) * bk),
      dqacc(size_t(kBQ) * Hp), row(size_t(W) * Hp), lse2(kBQ), drow(kBQ),
      tb(size_t(kBQ) * bk),
      dba(p.dbias ? size_t(Tb > 1 ? kBQ : 1) * Sb : 0);
  int cached_b = -1, cached_kh = -1;

  for (int64_t t; (t = tc.next()) >= 0;) {
    int qb = int(t % nqb);
    const int gn = int((t / nqb) % grp.num_n), gb = int(t / nqb / grp.num_n);
    if (p.is_causal) qb = nqb - 1 - qb;
    const int i0 = qb * kBQ, nq = std::min(kBQ, T - i0);
    if (p.dbias) std::memset(dba.data(), 0, sizeof(float) * (Tb > 1 ? nq : 1) * Sb);

    for (int bi = 0; bi < grp.b_count; ++bi) {
      const int b = grp.first_b(gb) + bi;
      mask.set_batch(b);
      for (int ni = 0; ni < grp.n_count; ++ni) {
        const int n = grp.first_n(gn) + ni;
        mask.set_head(n);
        const float* bp = bias.data ? bias.at(b, n) : nullptr;
        const int kh = n / G;
        if (b != cached_b || kh != cached_kh) {
          pack_head_kv<F, I, D>(p, b, kh, bk, row.data(), kt.data(), vt.data(), kr.data());
          cached_b = b;
          cached_kh = kh;
        }

        load_bwd_tile<D>(p, b, n, i0, nq, Hp, qs.data(), dos.data(), lse2.data());
        d_rows<D>(p, b, n, i0, nq, Hp, dos.data(), row.data(), drow.data());
        std::memcpy(dsum + (int64_t(b) * N + n) * T + i0, drow.data(), sizeof(float) * nq);
        std::memset(dqacc.data(), 0, sizeof(float) * nq * Hp);

        KeyBlockWalk<W> walk(mask, i0, nq, S, bk);
        for (KeyBlock blk; walk.next(&blk);) {
          const int kb = blk.kb, jc = blk.jc;  // jc: first computed key
          const BlockKind kind = blk.kind;
          const Span sp = blk.sp;
          const Tile tile{i0, nq, jc, sp.cn, sp.cw, bk};
          p_ds_tile<F, I, R, CV>(p, mask, kind, bias, bp, tile, qs.data(), dos.data(),
                                 kt.data() + size_t(kb) * H * bk + sp.c0,
                                 vt.data() + size_t(kb) * H * bk + sp.c0, lse2.data(), drow.data(),
                                 st.data() + sp.c0, dp.data() + sp.c0, tb.data() + sp.c0,
                                 [&](int r, const float* dr) {
            if (!p.dbias) return;  // dbias = dS of the biased logits, summed over broadcast dims
            float* a = dba.data() + size_t(Tb > 1 ? r : 0) * Sb;
            if (Sb > 1) {
              for (int j = 0; j < sp.cn; ++j) a[jc + j] += dr[j];
            } else {
              float sum = 0.f;
              for (int j = 0; j < sp.cn; ++j) sum += dr[j];
              a[0] += sum;
            }
          });
          gemm<F, R, CV, Acc::kAdd>(nq, Hp, sp.cn, dp.data() + sp.c0, bk, 1, kr.data() + size_t(jc) * Hp, Hp,
                                    dqacc.data(), Hp);
        }

        const int64_t qbase = b * p.q_batch_stride + n * p.q_head_stride;
        for (int r = 0; r < nq; ++r) {
          store_row<D>(dqacc.data() + r * Hp, H, p.scale, p.dq, qbase + (i0 + r) * p.q_row_stride);
        }
      }
    }

    if (p.dbias) {
      // [E * Bb, Nb, Tb, Sb]: rows of this block, or this block's partial sum
      // of the single row ([groups, nqb, Sb], summed in order afterwards).
      const int64_t slice = (int64_t(gb) * grp.num_n + gn);
      if (Tb > 1) {
        std::memcpy(p.dbias + (slice * T + i0) * Sb, dba.data(), sizeof(float) * nq * Sb);
      } else {
        std::memcpy(dbias_part + (slice * nqb + qb) * Sb, dba.data(), sizeof(float) * Sb);
      }
    }
  }
}

// Pass 2: dk, dv. dsum holds D from pass 1.
template <class Isa, DType D>
JAXATTN_AI void bwd_dkdv_worker(const AttnParams& p, const float* dsum, TaskCounter& tc) {
  using F = typename Isa::F;
  using I = typename Isa::I;
  constexpr int W = sizeof(F) / 4, R = Isa::R, CV = Isa::CV;
  const int T = p.seqlen_q, S = p.seqlen_k, N = p.num_heads, K = p.num_heads_k;
  const int G = p.group_size();
  const int H = p.head_dim, Hp = round_up(H, W);
  const int bk = kBK2;
  const int nkb = ceil_div(S, bk);
  Mask mask(p);
  const Dense<float> bias = p.bias ? Dense<float>(p.bias, p.bias_dims, p.batch) : Dense<float>();

  Buf kt(size_t(H) * bk), vt(size_t(H) * bk), qs(size_t(kBQ) * Hp), dos(size_t(kBQ) * Hp),
      st(size_t(kBQ) * bk), dp(size_t(kBQ) * bk), dkacc(size_t(bk) * Hp),
      dvacc(size_t(bk) * Hp), row(size_t(W) * Hp), lse2(kBQ), tb(size_t(kBQ) * bk);

  for (int64_t t; (t = tc.next()) >= 0;) {
    int kb = int(t % nkb);
    const int kh = int((t / nkb) % K), b = int(t / nkb / K);
    if (p.is_causal) kb = nkb - 1 - kb;  // reversed: heaviest (first keys) last
    mask.set_batch(b);
    const int j0 = kb * bk, nk = std::min(bk, S - j0);
    const int64_t kbase = b * p.k_batch_stride + kh * p.k_head_stride;
    const int64_t vbase = b * p.v_batch_stride + kh * p.v_head_stride;
    // Padding columns must be 0 (finite): this buffer is reused across blocks.
    if (nk < bk) {
      std::memset(kt.data(), 0, sizeof(float) * H * bk);
      std::memset(vt.data(), 0, sizeof(float) * H * bk);
    }
    pack_keys_t<F, I, D>(p.k, kbase, p.k_row_stride, j0, nk, H, bk, row.data(), kt.data());
    pack_keys_t<F, I, D>(p.v, vbase, p.v_row_stride, j0, nk, H, bk, row.data(), vt.data());
    std::memset(dkacc.data(), 0, sizeof(float) * bk * Hp);
    std::memset(dvacc.data(), 0, sizeof(float) * bk * Hp);

    int qlo, qhi;
    mask.query_range(j0, j0 + nk, &qlo, &qhi);
    for (int g = 0; g < G; ++g) {
      const int n = kh * G + g;
      mask.set_head(n);
      const float* bp = bias.data ? bias.at(b, n) : nullptr;
      for (int t0 = qlo; t0 < qhi; t0 += kBQ) {
        const int tn = std::min(kBQ, qhi - t0);
        const BlockKind kind = mask.classify(t0, t0 + tn, j0, j0 + nk);
        if (kind == BlockKind::kNone) continue;
        // A partial tile narrowed to the queries that may see this block.
        int i0 = t0, i1 = t0 + tn;
        if (kind == BlockKind::kPartial) mask.query_span(t0, t0 + tn, j0, j0 + nk, &i0, &i1);
        if (i1 <= i0) continue;
        const int nq = i1 - i0;
        load_bwd_tile<D>(p, b, n, i0, nq, Hp, qs.data(), dos.data(), lse2.data());
        const float* drow = dsum + (int64_t(b) * N + n) * T + i0;
        p_ds_tile<F, I, R, CV>(p, mask, kind, bias, bp, Tile{i0, nq, j0, nk, bk, bk}, qs.data(),
                               dos.data(), kt.data(), vt.data(), lse2.data(), drow, st.data(),
                               dp.data(), tb.data(), [](int, const float*) {});
        // dV += P^T dout; dK += dS^T Q (Q in log2 units: rescaled at the end)
        gemm<F, R, CV, Acc::kAdd>(nk, Hp, nq, st.data(), 1, bk, dos.data(), Hp, dvacc.data(), Hp);
        gemm<F, R, CV, Acc::kAdd>(nk, Hp, nq, dp.data(), 1, bk, qs.data(), Hp, dkacc.data(), Hp);
      }
    }

    for (int jj = 0; jj < nk; ++jj) {
      store_row<D>(dkacc.data() + jj * Hp, H, kLn2, p.dk, kbase + (j0 + jj) * p.k_row_stride);
      store_row<D>(dvacc.data() + jj * Hp, H, 1.f, p.dv, vbase + (j0 + jj) * p.v_row_stride);
    }
  }
}

// The fused backward (no bias gradient): one task per (batch, kv head) walks
// the group's query heads and their query blocks in order, and each tile's P
// and dS feed all three products: dq into the query block's tile, dk and dv
// into the task's accumulators over every key. 5 matrix products instead of
// the two passes' 7, each output summed by one task in a fixed order.
template <class Isa, DType D>
JAXATTN_AI void bwd_fused_worker(const AttnParams& p, TaskCounter& tc) {
  using F = typename Isa::F;
  using I = typename Isa::I;
  constexpr int W = sizeof(F) / 4, R = Isa::R, CV = Isa::CV;
  const int T = p.seqlen_q, S = p.seqlen_k, K = p.num_heads_k, G = p.group_size();
  const int H = p.head_dim, Hp = round_up(H, W);
  const int bk = key_tile(S, W);  // the dq pass's tiles: the same sums in the same order
  const int nqb = ceil_div(T, kBQ), nkb = ceil_div(S, bk);
  Mask mask(p);
  const Dense<float> bias = p.bias ? Dense<float>(p.bias, p.bias_dims, p.batch) : Dense<float>();

  Buf kt(size_t(nkb) * H * bk), vt(size_t(nkb) * H * bk), kr(size_t(nkb) * bk * Hp),
      dkacc(size_t(nkb) * bk * Hp), dvacc(size_t(nkb) * bk * Hp), qs(size_t(kBQ) * Hp),
      dos(size_t(kBQ) * Hp), st(size_t(kBQ) * bk), dp(size_t(kBQ) * bk), dqacc(size_t(kBQ) * Hp),
      row(size_t(W) * Hp), lse2(kBQ), drow(kBQ), tb(size_t(kBQ) * bk);

  for (int64_t t; (t = tc.next()) >= 0;) {
    const int kh = int(t % K), b = int(t / K);
    mask.set_batch(b);
    pack_head_kv<F, I, D>(p, b, kh, bk, row.data(), kt.data(), vt.data(), kr.data());
    std::memset(dkacc.data(), 0, sizeof(float) * S * Hp);
    std::memset(dvacc.data(), 0, sizeof(float) * S * Hp);

    for (int g = 0; g < G; ++g) {
      const int n = kh * G + g;
      mask.set_head(n);
      const float* bp = bias.data ? bias.at(b, n) : nullptr;
      for (int qb = 0; qb < nqb; ++qb) {
        const int i0 = qb * kBQ, nq = std::min(kBQ, T - i0);
        load_bwd_tile<D>(p, b, n, i0, nq, Hp, qs.data(), dos.data(), lse2.data());
        d_rows<D>(p, b, n, i0, nq, Hp, dos.data(), row.data(), drow.data());
        std::memset(dqacc.data(), 0, sizeof(float) * nq * Hp);

        KeyBlockWalk<W> walk(mask, i0, nq, S, bk);
        for (KeyBlock blk; walk.next(&blk);) {
          const int kb = blk.kb, jc = blk.jc;  // jc: first computed key
          const BlockKind kind = blk.kind;
          const Span sp = blk.sp;
          float* sc = st.data() + sp.c0;
          float* dc = dp.data() + sp.c0;
          p_ds_tile<F, I, R, CV>(p, mask, kind, bias, bp, Tile{i0, nq, jc, sp.cn, sp.cw, bk}, qs.data(),
                                 dos.data(), kt.data() + size_t(kb) * H * bk + sp.c0,
                                 vt.data() + size_t(kb) * H * bk + sp.c0, lse2.data(), drow.data(), sc, dc,
                                 tb.data() + sp.c0, [](int, const float*) {});
          // dV += P^T dout, dK += dS^T Q (Q in log2 units: rescaled at the end), dQ += dS K
          gemm<F, R, CV, Acc::kAdd>(sp.cn, Hp, nq, sc, 1, bk, dos.data(), Hp, dvacc.data() + size_t(jc) * Hp, Hp);
          gemm<F, R, CV, Acc::kAdd>(sp.cn, Hp, nq, dc, 1, bk, qs.data(), Hp, dkacc.data() + size_t(jc) * Hp, Hp);
          gemm<F, R, CV, Acc::kAdd>(nq, Hp, sp.cn, dc, bk, 1, kr.data() + size_t(jc) * Hp, Hp, dqacc.data(), Hp);
        }

        const int64_t qbase = b * p.q_batch_stride + n * p.q_head_stride;
        for (int r = 0; r < nq; ++r) {
          store_row<D>(dqacc.data() + r * Hp, H, p.scale, p.dq, qbase + (i0 + r) * p.q_row_stride);
        }
      }
    }

    const int64_t kbase = b * p.k_batch_stride + kh * p.k_head_stride;
    const int64_t vbase = b * p.v_batch_stride + kh * p.v_head_stride;
    for (int j = 0; j < S; ++j) {
      store_row<D>(dkacc.data() + size_t(j) * Hp, H, kLn2, p.dk, kbase + j * p.k_row_stride);
      store_row<D>(dvacc.data() + size_t(j) * Hp, H, 1.f, p.dv, vbase + j * p.v_row_stride);
    }
  }
}

// ---- ISA dispatch ---------------------------------------------------------------

#define JAXATTN_DEFINE_WORKERS(ISA, TARGET)                                              \
  TARGET void fwd_##ISA(const AttnParams& p, TaskCounter& tc) {                          \
    switch (p.dtype) {                                                                   \
      case DType::kF32: return fwd_worker<ISA, DType::kF32>(p, tc);                      \
      case DType::kBF16: return fwd_worker<ISA, DType::kBF16>(p, tc);                    \
      case DType::kF16: return fwd_worker<ISA, DType::kF16>(p, tc);                      \
    }                                                                                    \
  }                                                                                      \
  TARGET void bwd_dq_##ISA(const AttnParams& p, float* dsum, float* part, TaskCounter& tc) { \
    switch (p.dtype) {                                                                   \
      case DType::kF32: return bwd_dq_worker<ISA, DType::kF32>(p, dsum, part, tc);       \
      case DType::kBF16: return bwd_dq_worker<ISA, DType::kBF16>(p, dsum, part, tc);     \
      case DType::kF16: return bwd_dq_worker<ISA, DType::kF16>(p, dsum, part, tc);       \
    }                                                                                    \
  }                                                                                      \
  TARGET void bwd_dkdv_##ISA(const AttnParams& p, const float* dsum, TaskCounter& tc) {  \
    switch (p.dtype) {                                                                   \
      case DType::kF32: return bwd_dkdv_worker<ISA, DType::kF32>(p, dsum, tc);           \
      case DType::kBF16: return bwd_dkdv_worker<ISA, DType::kBF16>(p, dsum, tc);         \
      case DType::kF16: return bwd_dkdv_worker<ISA, DType::kF16>(p, dsum, tc);           \
    }                                                                                    \
  }                                                                                    \
  TARGET void bwd_fused_##ISA(const AttnParams& p, TaskCounter& tc) {                    \
    switch (p.dtype) {                                                                   \
      case DType::kF32: return bwd_fused_worker<ISA, DType::kF32>(p, tc);                \
      case DType::kBF16: return bwd_fused_worker<ISA, DType::kBF16>(p, tc);              \
      case DType::kF16: return bwd_fused_worker<ISA, DType::kF16>(p, tc);                \
    }                                                                                    \
  }

JAXATTN_DEFINE_WORKERS(IsaAvx512, JAXATTN_TARGET_AVX512)
JAXATTN_DEFINE_WORKERS(IsaAvx2, JAXATTN_TARGET_AVX2)
JAXATTN_DEFINE_WORKERS(IsaSse2, JAXATTN_TARGET_SSE2)

// Workers for ntasks tasks of about flops_per_task each: a single thread for
// small problems (thread start-up costs tens of microseconds).
int workers_for(int64_t ntasks, double flops_per_task) {
  const int64_t by_work = int64_t(double(ntasks) * flops_per_task / 2e6) + 1;
  return int(std::max<int64_t>(1, std::min<int64_t>({int64_t(num_threads()), ntasks, by_work})));
}

bool empty_problem(const AttnParams& p) {
  return p.batch <= 0 || p.num_heads <= 0 || p.num_heads_k <= 0 || p.head_dim <= 0;
}

// The backward's form: fused (bwd_fused_worker) unless a bias gradient is
// wanted (its sums need the dq pass's task groups), the (batch, kv head)
// tasks are too few to share evenly between the workers (the fused form does
// 5/7 of the two passes' products, but in tasks that are whole heads), or its
// per-thread buffers (five of S x H floats; the dq pass holds three) would
// take more than kFusedBytesMax over all threads.
// JAXATTN_CPU_BWD=fused|two_pass forces one (for tests; read at each call);
// a bias gradient always takes the two passes.
constexpr double kFusedBytesMax = 2.0 * (1 << 30);

bool use_fused_bwd(const AttnParams& p) {
  if (p.dbias) return false;
  if (const char* env = std::getenv("JAXATTN_CPU_BWD")) {
    if (std::strcmp(env, "fused") == 0) return true;
    if (std::strcmp(env, "two_pass") == 0) return false;
  }
  const int64_t tasks = int64_t(p.batch) * p.num_heads_k;
  const int64_t threads = num_threads();
  const int64_t rounds = (tasks + threads - 1) / threads;
  const double bytes = 5.0 * 4.0 * (double(p.seqlen_k) + kBKMax) * (p.head_dim + 16) * std::min(threads, tasks);
  return 4 * rounds * threads <= 5 * tasks  // the last round's idle share at most 1/5
         && bytes <= kFusedBytesMax;
}

}  // namespace

void flash_fwd(const AttnParams& p) {
  if (empty_problem(p) || p.seqlen_q <= 0) return;
  const int64_t ntasks = int64_t(p.batch) * p.num_heads * ceil_div(p.seqlen_q, kBQ);
  TaskCounter tc(ntasks);
  const double flops = 4.0 * kBQ * std::max(p.seqlen_k, 1) * p.head_dim;
  const CpuIsa isa = detect_cpu_isa();
  run_parallel(workers_for(ntasks, flops), [&](int) {
    switch (isa) {
      case CpuIsa::kAvx512: return fwd_IsaAvx512(p, tc);
      case CpuIsa::kAvx2: return fwd_IsaAvx2(p, tc);
      case CpuIsa::kSse2: return fwd_IsaSse2(p, tc);
    }
  });
}

void flash_bwd(const AttnParams& p) {
  if (empty_problem(p)) return;
  const CpuIsa isa = detect_cpu_isa();
  const int T = p.seqlen_q, S = p.seqlen_k;
  if (T > 0 && S > 0 && use_fused_bwd(p)) {
    const int64_t ntasks = int64_t(p.batch) * p.num_heads_k;
    TaskCounter tc(ntasks);
    const double flops = 10.0 * T * S * p.head_dim * p.group_size();
    run_parallel(workers_for(ntasks, flops), [&](int) {
      switch (isa) {
        case CpuIsa::kAvx512: return bwd_fused_IsaAvx512(p, tc);
        case CpuIsa::kAvx2: return bwd_fused_IsaAvx2(p, tc);
        case CpuIsa::kSse2: return bwd_fused_IsaSse2(p, tc);
      }
    });
    return;
  }
  std::vector<float> dsum_own;
  float* dsum = p.dpsum;
  if (dsum == nullptr && T > 0) {
    dsum_own.assign(size_t(p.batch) * p.num_heads * T, 0.f);
    dsum = dsum_own.data();
  }
  if (T > 0) {
    const DqGroups grp(p);
    const int nqb = ceil_div(T, kBQ);
    const int64_t ngroups = int64_t(grp.num_b) * grp.num_n;
    const int64_t ntasks = ngroups * nqb;
    // A bias broadcast over T: per-block partial sums of its one row.
    const int Sb = p.bias_dims[4];
    std::vector<float> part;
    if (p.dbias && p.bias_dims[3] == 1) part.assign(size_t(ntasks) * Sb, 0.f);
    TaskCounter tc(ntasks);
    const double flops =
        6.0 * kBQ * std::max(S, 1) * p.head_dim * grp.b_count * grp.n_count;
    run_parallel(workers_for(ntasks, flops), [&](int) {
      switch (isa) {
        case CpuIsa::kAvx512: return bwd_dq_IsaAvx512(p, dsum, part.data(), tc);
        case CpuIsa::kAvx2: return bwd_dq_IsaAvx2(p, dsum, part.data(), tc);
        case CpuIsa::kSse2: return bwd_dq_IsaSse2(p, dsum, part.data(), tc);
      }
    });
    if (!part.empty()) {
      for (int64_t g = 0; g < ngroups; ++g) {
        float* dst = p.dbias + g * Sb;
        std::memcpy(dst, part.data() + g * nqb * Sb, sizeof(float) * Sb);
        for (int qb = 1; qb < nqb; ++qb) {
          const float* src = part.data() + (g * nqb + qb) * Sb;
          for (int j = 0; j < Sb; ++j) dst[j] += src[j];
        }
      }
    }
  }
  if (S > 0) {
    const int64_t ntasks = int64_t(p.batch) * p.num_heads_k * ceil_div(S, kBK2);
    TaskCounter tc(ntasks);
    const double flops = 8.0 * kBK2 * std::max(T, 1) * p.head_dim * p.group_size();
    run_parallel(workers_for(ntasks, flops), [&](int) {
      switch (isa) {
        case CpuIsa::kAvx512: return bwd_dkdv_IsaAvx512(p, dsum, tc);
        case CpuIsa::kAvx2: return bwd_dkdv_IsaAvx2(p, dsum, tc);
        case CpuIsa::kSse2: return bwd_dkdv_IsaSse2(p, dsum, tc);
      }
    });
  }
}

}  // namespace jaxattn::cpu
