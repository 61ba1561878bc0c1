// The decode register loop (cuda/decode/decode_reg_loop.cuh, kV2Regs) run on a CPU through
// warp_emu.h, against a float64 reference: one CTA of 8 emulated warps per (row, KV head,
// chunk), contiguous and paged caches (page sizes 16..256, shuffled pages), ragged lengths
// and tails, windows, soft caps, 1-8 query rows, several chunks merged by logsumexp, bf16 and
// fp16. What it checks is the loop's own logic (fragment mapping, group walk, page lookups,
// masks, online softmax, the zeroed value rows) and that no load leaves the caches; the
// kernel's prologue and warp merge are transcribed here (they are the other loops' too).
// Also the L2 warm-up before the PDL wait (reg_loop_warm_l2): the lines it prefetches are
// exactly those of each warp's first 1-3 groups, all inside the caches.
//   c++ -std=c++17 -O2 -pthread -Itests/cuda_emu -Icuda tests/cuda_emu/reg_loop_check.cc
// Prints one line per case and "N ok, M FAIL"; exit status 1 on any failure.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "decode/decode_reg_loop.cuh"

using namespace jaxattn;
using namespace jaxattn::cuda::decode;
using warp_emu::Bf16;
using warp_emu::F16;

namespace {

constexpr int H = 128, kThreads = kRegWarps * 32, kPitch = H + 8;

struct Case {
  int T, N, K, page_size;  // page_size 0: contiguous
  int capacity, length;
  int window;    // -1: none
  float softcap; // 0: none
  int chunk;     // keys per chunk (a multiple of 16); 0: one chunk
  bool bf16;
};

std::string describe(const Case& c) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "T=%d N=%d K=%d %s cap=%d len=%d win=%d softcap=%g chunk=%d %s", c.T, c.N, c.K,
                c.page_size ? ("page" + std::to_string(c.page_size)).c_str() : "contig", c.capacity, c.length,
                c.window, c.softcap, c.chunk, c.bf16 ? "bf16" : "fp16");
  return buf;
}

template <typename E>
bool run_case(const Case& c, uint64_t seed, double* err_out) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  const int B = 2, b = 1, G = c.N / c.K, rows = c.T * G;
  const bool paged = c.page_size > 0;
  const int ps = c.page_size, max_pages = paged ? c.capacity / ps : 0, num_pages = paged ? B * max_pages + 3 : 0;
  // Caches [B or pages, rows, K, H] as 16-bit bits; the rows no query sees (past the length, before
  // the window) hold NaN: they must not reach the output.
  const int slabs = paged ? num_pages : B, slab_rows = paged ? ps : c.capacity;
  std::vector<uint16_t> k(size_t(slabs) * slab_rows * c.K * H), v(k.size()), q(size_t(B) * c.T * c.N * H);
  for (auto& x : k) x = warp_emu::from_float<E>(nd(rng));
  for (auto& x : v) x = warp_emu::from_float<E>(nd(rng));
  for (auto& x : q) x = warp_emu::from_float<E>(nd(rng));
  std::vector<int32_t> table(size_t(B) * max_pages);
  if (paged) {
    std::vector<int32_t> perm(num_pages);
    for (int i = 0; i < num_pages; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (size_t i = 0; i < table.size(); ++i) table[i] = perm[i];
  }
  auto krow = [&](int j) -> size_t {  // element offset of key j of row b (head 0)
    return paged ? (size_t(table[b * max_pages + j / ps]) * ps + j % ps) * c.K * H : (size_t(b) * c.capacity + j) * c.K * H;
  };
  const uint16_t nan_bits = warp_emu::from_float<E>(NAN);
  const int first_seen = c.window >= 0 ? std::max(0, c.length - c.T - c.window) : 0;
  for (int j = 0; j < (paged ? max_pages * ps : c.capacity); ++j)
    if (j < first_seen || j >= c.length)
      for (int i = 0; i < c.K * H; ++i) k[krow(j) + i] = v[krow(j) + i] = nan_bits;

  AttnParams p;
  p.batch = B, p.seqlen_q = c.T, p.seqlen_k = paged ? max_pages * ps : c.capacity, p.num_heads = c.N;
  p.num_heads_k = c.K, p.head_dim = H, p.scale = 1.f / std::sqrt(float(H)), p.window_left = c.window;
  p.softcap = c.softcap, p.k = k.data(), p.v = v.data();
  p.k_row_stride = p.v_row_stride = int64_t(c.K) * H, p.k_head_stride = p.v_head_stride = H;
  p.k_batch_stride = p.v_batch_stride = int64_t(slab_rows) * c.K * H;
  if (paged) p.block_table = table.data(), p.page_size = ps, p.max_pages = max_pages, p.num_pages = num_pages;
  warp_emu::regions() = {{reinterpret_cast<const char*>(k.data()), k.size() * 2},
                         {reinterpret_cast<const char*>(v.data()), v.size() * 2}};
  warp_emu::oob_reads() = 0;

  // The kernel's prologue (decode_mma_kernel.cuh, kLoopRegs): visible keys, the first key
  // rounded down to a group, this chunk's keys, its page ids, the query rows.
  const int len = std::min(std::max(c.length, 0), p.seqlen_k);
  int lo = c.window >= 0 ? std::max(0, len - c.T - c.window) : 0;
  lo = std::min(lo, len);
  const int lo_keys = lo;
  lo = lo / kRegGroupKeys * kRegGroupKeys;
  const int chunk = c.chunk > 0 ? c.chunk : std::max(16, len - lo);
  std::vector<double> ref_o(size_t(rows) * H), got_o(size_t(rows) * H, 0.0);
  bool ok = warp_emu::oob_reads() == 0;
  double err = 0.0;
  for (int kh = 0; kh < c.K; ++kh) {
    std::vector<uint16_t> q_s(16 * kPitch, 0);
    for (int r = 0; r < rows; ++r)
      for (int d = 0; d < H; ++d) q_s[r * kPitch + d] = q[((size_t(b) * c.T + r / G) * c.N + kh * G + r % G) * H + d];
    // Per chunk: the 8 warps' (m, l, o) rows, merged over warps and chunks below.
    std::vector<double> M(rows, -INFINITY), L(rows, 0.0), O(size_t(rows) * H, 0.0);
    auto fold = [&](int r, double m, double l, const double* o) {  // adds one partial (log2 units)
      if (m == -INFINITY || l == 0.0) return;
      const double mn = std::max(M[r], m), a = std::exp2(M[r] - mn), w = std::exp2(m - mn);
      for (int d = 0; d < H; ++d) O[size_t(r) * H + d] = O[size_t(r) * H + d] * a + o[d] * w;
      L[r] = L[r] * a + l * w;
      M[r] = mn;
    };
    for (int split = 0; lo + split * chunk < std::max(len, lo + 1); ++split) {
      const int j_begin = std::min(len, lo + split * chunk), j_end = std::min(len, j_begin + chunk);
      const int page0 = paged ? j_begin / ps : 0;
      std::vector<int32_t> pages_s;
      if (paged && j_begin < j_end)
        for (int t = 0; t <= (j_end - 1) / ps - page0; ++t)
          pages_s.push_back(std::min(std::max(table[b * max_pages + page0 + t], 0), num_pages - 1));
      // The L2 warm-up (kV2WarmShift) with 1-3 groups a warp: exactly the K and V lines of
      // each warp's first groups (both 128-byte halves of every key row), nothing else.
      for (int groups = 1; groups <= 3; ++groups) {
        warp_emu::prefetched().clear();
        for (int t = 0; t < kThreads; ++t) {
          threadIdx.x = unsigned(t);
          reg_loop_warm_l2<H, E>(p, b, kh, j_begin, j_end, groups);
        }
        std::vector<const char*> want;
        for (int w = 0; w < kRegWarps; ++w)
          for (int i = 0; i < groups; ++i)
            for (int r = 0; r < kRegGroupKeys; ++r) {
              const int j = j_begin + (w + kRegWarps * i) * kRegGroupKeys + r;
              if (j >= j_end) continue;
              for (int half = 0; half < 2; ++half) {
                want.push_back(reinterpret_cast<const char*>(k.data() + krow(j) + kh * H + half * (H / 2)));
                want.push_back(reinterpret_cast<const char*>(v.data() + krow(j) + kh * H + half * (H / 2)));
              }
            }
        std::vector<const char*> got = warp_emu::prefetched();
        std::sort(want.begin(), want.end());
        std::sort(got.begin(), got.end());
        if (got != want) ok = false;
      }
      p.kv_lengths = nullptr;
      const RegLoopArgs args{static_cast<const uint16_t*>(p.k) + kh * p.k_head_stride,
                             static_cast<const uint16_t*>(p.v) + kh * p.v_head_stride,
                             pages_s.data(), q_s.data(), kPitch, b, page0, j_begin, j_end, lo_keys, len, c.T, G, 0,
                             rows};
      std::vector<RegLoopAcc<H>> acc(kThreads);
      std::vector<std::thread> threads;
      for (int t = 0; t < kThreads; ++t)
        threads.emplace_back([&, t] {
          threadIdx.x = unsigned(t);
          reg_loop<H, E>(p, args, acc[t]);
        });
      for (auto& th : threads) th.join();
      for (int w = 0; w < kRegWarps; ++w)
        for (int r = 0; r < rows; ++r) {
          const int t4 = r / 2, e = r % 2;
          double l = 0.0, o[H];
          const double m = acc[w * 32 + t4].m[e];
          for (int g = 0; g < 8; ++g) {
            const RegLoopAcc<H>& a = acc[w * 32 + 4 * g + t4];
            if (a.m[e] != acc[w * 32 + t4].m[e]) ok = false;  // the column shares its running max
            l += a.l[e];
            for (int mt = 0; mt < H / 16; ++mt) o[8 * g + mt] = a.o[mt][e], o[64 + 8 * g + mt] = a.o[mt][2 + e];
          }
          fold(r, m, l, o);
        }
    }
    // float64 reference over the keys each row sees.
    for (int r = 0; r < rows; ++r) {
      const int pos = len - c.T + r / G;
      std::vector<double> s;
      std::vector<int> js;
      for (int j = 0; j < len; ++j) {
        if (j > pos || (c.window >= 0 && j < pos - c.window)) continue;
        double x = 0.0;
        for (int d = 0; d < H; ++d)
          x += double(warp_emu::to_float<E>(q_s[r * kPitch + d])) * warp_emu::to_float<E>(k[krow(j) + kh * H + d]);
        x *= p.scale;
        if (c.softcap > 0.f) x = c.softcap * std::tanh(x / c.softcap);
        s.push_back(x), js.push_back(j);
      }
      double mx = -INFINITY, sum = 0.0;
      for (double x : s) mx = std::max(mx, x);
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int d = 0; d < H; ++d) {
        double o = 0.0;
        for (size_t i = 0; i < s.size(); ++i) o += s[i] / sum * warp_emu::to_float<E>(v[krow(js[i]) + kh * H + d]);
        const double got = L[r] > 0.0 ? O[size_t(r) * H + d] / L[r] : 0.0;
        if (!std::isfinite(got)) ok = false;
        err = std::max(err, std::fabs(got - (s.empty() ? 0.0 : o)));
      }
      if (s.empty() != (L[r] == 0.0)) ok = false;  // a row sees nothing iff nothing was summed
      else if (!s.empty() && std::fabs((M[r] + std::log2(L[r])) * std::log(2.0) - (mx + std::log(sum))) > 2e-2)
        ok = false;  // the logsumexp
    }
  }
  ok = ok && warp_emu::oob_reads() == 0 && err <= (c.bf16 ? 2e-2 : 4e-3);
  *err_out = err;
  return ok;
}

}  // namespace

int main() {
  std::vector<Case> cases;
  const int heads[][3] = {{1, 2, 2}, {1, 8, 2}, {1, 16, 2}, {2, 8, 2}, {4, 4, 2}, {2, 4, 1}};  // T, N, K: 1-8 rows
  const int layouts[][2] = {{0, 293}, {16, 192}, {48, 288}, {64, 448}, {256, 512}};           // page size, capacity
  int i = 0;
  for (const auto& lay : layouts)
    for (const auto& hd : heads) {
      const int cap = lay[1];
      const int lengths[] = {cap, 1 + i % 7, cap - 3 - i % 11, hd[0] + 17};
      for (int len : lengths) {
        ++i;
        Case c{hd[0], hd[1], hd[2], lay[0], cap, len, -1, 0.f, 0, i % 2 == 0};
        if (i % 3 == 0) c.window = 37 + i % 40, c.softcap = 5.f;
        if (i % 4 == 1) c.chunk = 80;
        if (i % 5 == 2) c.chunk = 128;
        cases.push_back(c);
      }
    }
  int failures = 0;
  uint64_t seed = 1;
  for (const Case& c : cases) {
    double err = 0.0;
    const bool ok = c.bf16 ? run_case<Bf16>(c, seed++, &err) : run_case<F16>(c, seed++, &err);
    failures += !ok;
    std::printf("%-4s %-70s err %.2e%s\n", ok ? "ok" : "FAIL", describe(c).c_str(), err,
                warp_emu::oob_reads() ? " (reads outside the caches)" : "");
  }
  std::printf("%zu ok, %d FAIL\n", cases.size() - failures, failures);
  return failures ? 1 : 0;
}
