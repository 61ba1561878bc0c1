// CUDA decode kernels: split-KV attention over a KV cache, on CUDA cores.
//
// decode_split_kernel<H, RB, U, kBf16>: one CTA per (chunk of keys, KV head,
// row b x block of RB query rows). The query rows of a CTA are the G heads
// that share the KV head times the Tq queries (row r = i * G + g), so a
// KV byte is read once for all of them (GQA packing; more than 8 rows take
// several row blocks). A KV row of H halves is read by H / 8 lanes, 16 bytes
// each, straight into registers (no shared-memory staging: each byte is used
// once); a warp reads 32 / (H / 8) keys at a time and each lane group walks
// its own keys, U consecutive keys per step with the next step's loads in
// flight (register double buffering). The page ids of the CTA's chunk are
// read once into shared memory before the loop (page lookups hoisted).
// Each lane group keeps an online softmax (log2 units) per row; at the end
// the groups are merged through shared memory. One chunk: o and lse are
// written directly; several: the normalised partial output and its
// logsumexp go to the workspace and decode_combine_kernel merges them.
//
// Future work: tensor cores (mma.sync) for groups of >= 4 rows, cp.async /
// TMA staging for deeper pipelines.
#pragma once

#include "decode/decode_common.cuh"

namespace jaxattn::cuda::decode {

constexpr int kThreads = 128;

// The 8 halves of a 16-byte load as floats.
template <bool kBf16>
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kBf16) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      __half2 h;
      memcpy(&h, &w[i], 4);
      const float2 x = __half22float2(h);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
}

template <int H, int RB, int U, bool kBf16>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(const __grid_constant__ AttnParams p,
                                                                const DecodePlan plan) {
  static_assert(H == 64 || H == 128 || H == 256, "head dims 64, 128, 256");
  constexpr int kLanes = H / 8;                  // lanes reading one key row
  constexpr int kKeysPerWarp = 32 / kLanes;
  constexpr int kGroups = (kThreads / 32) * kKeysPerWarp;  // lane groups per CTA

  __shared__ int32_t pages_s[kMaxChunkPages];
  __shared__ float red_m[kGroups], red_l[kGroups];
  __shared__ __align__(16) float red_o[kGroups][H];

  const int split = blockIdx.x, kh = blockIdx.y;
  const int b = blockIdx.z / plan.row_blocks, r0 = (blockIdx.z % plan.row_blocks) * RB;
  const int T = p.seqlen_q, G = p.num_heads / p.num_heads_k, K = p.num_heads_k;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int sub = lane % kLanes;  // this lane's head-dim slice: [sub * 8, sub * 8 + 8)
  const int group = warp * kKeysPerWarp + lane / kLanes;
  const int wl = p.window_left;

  int lo, len;
  row_keys(p, b, &lo, &len);
  const int j_begin = lo + split * plan.chunk;
  const int j_end = min(len, j_begin + plan.chunk);
  const bool paged = p.block_table != nullptr;
  const int page0 = paged ? j_begin / p.page_size : 0;
  if (paged && j_begin < j_end) {
    const int npages = (j_end - 1) / p.page_size - page0 + 1;
    for (int t = threadIdx.x; t < npages; t += kThreads) {
      const int32_t id = p.block_table[int64_t(b) * p.max_pages + page0 + t];
      pages_s[t] = min(max(id, 0), p.num_pages - 1);
    }
  }

  // This lane's slice of the query rows, in log2 units; rows past the last
  // are zero and masked.
  const float qmul = p.scale * kLog2e;
  float q[RB][8], acc[RB][8], m[RB], l[RB];
  int pos[RB];
  bool row_ok[RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int row = r0 + r;
    row_ok[r] = row < plan.rows;
    const int i = row / G, n = kh * G + row % G;
    pos[r] = len - T + i;
    if (row_ok[r]) {
      const uint16_t* qp = static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride + i * p.q_row_stride +
                           n * p.q_head_stride + sub * 8;
      unpack8<kBf16>(*reinterpret_cast<const uint4*>(qp), q[r]);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      q[r][e] = row_ok[r] ? q[r][e] * qmul : 0.f;
      acc[r][e] = 0.f;
    }
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  __syncthreads();  // pages_s

  const uint16_t* kbase = static_cast<const uint16_t*>(p.k) + kh * p.k_head_stride + sub * 8;
  const uint16_t* vbase = static_cast<const uint16_t*>(p.v) + kh * p.v_head_stride + sub * 8;
  auto load = [&](int jb, uint4 (&kr)[U], uint4 (&vr)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = jb + u;
      if (j < j_end) {
        int64_t ko, vo;
        if (paged) {
          const int64_t page = pages_s[j / p.page_size - page0];
          const int row = j % p.page_size;
          ko = page * p.k_batch_stride + row * p.k_row_stride;
          vo = page * p.v_batch_stride + row * p.v_row_stride;
        } else {
          ko = b * p.k_batch_stride + int64_t(j) * p.k_row_stride;
          vo = b * p.v_batch_stride + int64_t(j) * p.v_row_stride;
        }
        kr[u] = __ldg(reinterpret_cast<const uint4*>(kbase + ko));
        vr[u] = __ldg(reinterpret_cast<const uint4*>(vbase + vo));
      } else {
        kr[u] = make_uint4(0, 0, 0, 0);
        vr[u] = make_uint4(0, 0, 0, 0);
      }
    }
  };

  // A warp walks keys [jw, jw + kKeysPerWarp * U) per step, its lane group
  // gi keys jb = jw + gi * U + [0, U): the loop condition is uniform across
  // the warp (the shuffles below need every lane), loads past j_end are
  // predicated off.
  constexpr int kStep = kGroups * U;
  uint4 kc[U], vc[U];
  int jw = j_begin + warp * kKeysPerWarp * U;
  const int goff = (lane / kLanes) * U;
  if (jw < j_end) load(jw + goff, kc, vc);
  for (; jw < j_end; jw += kStep) {
    const int jb = jw + goff;
    uint4 kn[U], vn[U];
    if (jw + kStep < j_end) load(jb + kStep, kn, vn);

    float s[RB][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      unpack8<kBf16>(kc[u], kf);
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d = fmaf(q[r][e], kf[e], d);
#pragma unroll
        for (int off = kLanes / 2; off > 0; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
        s[r][u] = d;
      }
    }
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = jb + u;
        float x = s[r][u];
        if (p.softcap > 0.f) x = p.softcap * kLog2e * tanhf(x * (kLn2 / p.softcap));
        const bool ok = row_ok[r] && j < j_end && j <= pos[r] && (wl < 0 || j >= pos[r] - wl);
        s[r][u] = ok ? x : -INFINITY;
        mx = fmaxf(mx, s[r][u]);
      }
      const float m_new = fmaxf(m[r], mx);
      if (m_new == -INFINITY) continue;  // nothing visible yet
      const float alpha = exp2f(m[r] - m_new);  // 0 when m[r] = -inf
      m[r] = m_new;
      l[r] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float pu = exp2f(s[r][u] - m_new);
        l[r] += pu;
        float vf[8];
        unpack8<kBf16>(vc[u], vf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(pu, vf[e], acc[r][e]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      kc[u] = kn[u];
      vc[u] = vn[u];
    }
  }

  // Merge the lane groups, row by row; one thread per head-dim element writes.
  const int rows_here = min(RB, plan.rows - r0);
  for (int r = 0; r < rows_here; ++r) {
    // (r is uniform across the CTA, so the register arrays are indexed
    // through a fully unrolled select.)
    float mr = -INFINITY, lr = 0.f, ar[8];
#pragma unroll
    for (int rr = 0; rr < RB; ++rr) {
      if (rr == r) {
        mr = m[rr];
        lr = l[rr];
#pragma unroll
        for (int e = 0; e < 8; ++e) ar[e] = acc[rr][e];
      }
    }
    if (sub == 0) {
      red_m[group] = mr;
      red_l[group] = lr;
    }
    __syncthreads();
    float M = -INFINITY;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) M = fmaxf(M, red_m[g]);
    const float w = M == -INFINITY ? 0.f : exp2f(mr - M);
#pragma unroll
    for (int e = 0; e < 8; ++e) red_o[group][sub * 8 + e] = ar[e] * w;
    __syncthreads();
    float L = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) L += M == -INFINITY ? 0.f : red_l[g] * exp2f(red_m[g] - M);
    const float inv = L > 0.f ? 1.f / L : 0.f;
    const float lse2 = L > 0.f ? M + log2f(L) : -INFINITY;
    const int row = r0 + r, i = row / G, n = kh * G + row % G;
    for (int h = threadIdx.x; h < H; h += kThreads) {
      float o = 0.f;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) o += red_o[g][h];
      o *= inv;
      if (plan.splits == 1) {
        static_cast<uint16_t*>(p.o)[b * p.o_batch_stride + i * p.o_row_stride + n * p.o_head_stride + h] =
            to_half_bits<kBf16>(o);
      } else {
        const int64_t slot = ((int64_t(b) * K + kh) * p.num_splits + split) * plan.rows + row;
        p.split_o[slot * H + h] = o;
      }
    }
    if (threadIdx.x == 0) {
      if (plan.splits == 1) {
        p.lse[(int64_t(b) * T + i) * p.num_heads + n] = lse2 * kLn2;
      } else {
        p.split_lse[((int64_t(b) * K + kh) * p.num_splits + split) * plan.rows + row] = lse2;
      }
    }
    __syncthreads();  // red_* are reused by the next row
  }
}

}  // namespace jaxattn::cuda::decode
