// Forward flash attention on mma.sync (sm_80+): o = softmax(scale q k^T) v
// and the row logsumexp, one CTA per (query block, query head, batch).
// kMasked instantiates the masked variant (window, lengths, segments, soft
// cap, dense bias and mask: common/mask.cuh); the unmasked one is the plain
// causal / full kernel.
#pragma once

#include <cuda_runtime.h>

#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.h"
#include "launch.h"
#include "sm80/smem_tile.cuh"
#include "sm80/softmax.cuh"
#include "sm80/tile_config.cuh"

namespace jaxattn::cuda::sm80 {

// kDense (implies kMasked): the call has a dense bias or mask (its own
// instantiation: their reads need registers, so it may stream fewer keys a step).
template <class Tile, typename Elem, bool kMasked, bool kDense = false>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocks)
    flash_fwd_kernel(const AttnParams p) {
  static_assert(kMasked || !kDense, "a dense bias / mask is a mask option");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
  constexpr int kBNMasked = kDense ? Tile::kBlockNDense : Tile::kBlockNMasked;
  constexpr int kBN = kMasked ? kBNMasked : Tile::kBlockNSm100;  // (see FwdTile)
#else
  constexpr int kBN = kDense ? Tile::kBlockNDense : kMasked ? Tile::kBlockNMasked : Tile::kBlockN;
#endif
  constexpr int kH = Tile::kHeadDim, kBM = Tile::kBlockM;
  constexpr int kM = Tile::kMTiles, kPitch = Tile::kPitch, kThreads = Tile::kThreads;
  // kPipe (unmasked kernels of a tile with kPipelineS): S of the next key
  // block is computed before the softmax of the current one (two K and V
  // buffers, one barrier a step).
  constexpr bool kPipe = Tile::kPipelineS && !kMasked;
  constexpr int kStages = kPipe ? 2 : Tile::kKVStages;
  extern __shared__ __align__(16) unsigned char smem[];
  Elem* sQ = reinterpret_cast<Elem*>(smem);
  Elem* sK = sQ + Tile::kSmemQ;                // [kStages][kSmemKV]
  Elem* sV = sK + kStages * Tile::kSmemKV;     // [kStages][kSmemKV]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int T = p.seqlen_q, S = p.seqlen_k, hd = p.head_dim;
  const bool causal = p.is_causal;
  // Causal: the longest rows (last blocks) start first.
  const int m_block = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int head = blockIdx.y, b = blockIdx.z;
  const int kv_head = head / (p.num_heads / p.num_heads_k);
  const int m0 = m_block * kBM;

  const Elem* q = static_cast<const Elem*>(p.q) + b * p.q_batch_stride +
                  int64_t(m0) * p.q_row_stride + head * p.q_head_stride;
  const Elem* k = static_cast<const Elem*>(p.k) + b * p.k_batch_stride + kv_head * p.k_head_stride;
  const Elem* v = static_cast<const Elem*>(p.v) + b * p.v_batch_stride + kv_head * p.v_head_stride;

  // Keys [n_begin, n_end) are visible to some row of the block: key blocks
  // nb_lo .. nb run (none: o = 0 and lse = -inf).
  int n_end = causal ? min(S, m0 + kBM) : S;
  int nb_lo = 0;
  // The mask state lives in shared memory (read where needed, not held in
  // registers across the MMAs); the soft cap is read from the parameters.
  __shared__ MaskView mask_smem;  // (unused, so not allocated, when unmasked)
  const MaskView& mask = mask_smem;
  bool segments = false;
  const float softcap = kMasked ? p.softcap : 0.f;
  if constexpr (kMasked) {
    __shared__ int red[2];
    if (threadIdx.x == 0) mask_smem = MaskView::of(p, b);
    __syncthreads();
    segments = mask.q_seg != nullptr;
    // (with segments: only keys whose ids fall in the block's id range)
    const int2 keys = cta_segment_span(mask.key_range(m0, m0 + kBM), mask.q_seg, mask.q_seg_ranges, m0,
                                       min(m0 + kBM, mask.q_len), mask.kv_seg, mask.kv_seg_ranges, red);
    n_end = keys.y;
    nb_lo = keys.x / kBN;
  }
  int nb = (n_end + kBN - 1) / kBN - 1;

  // K(n) / V(n) into buffer `slot` (a no-op past the last key block).
  // (kPipe: the base pointers are recomputed from the parameters, which
  // costs a few integer ops a step but frees registers.)
  auto load_kv = [&](Elem* dst, const void* base, int64_t batch_stride, int64_t head_stride, int64_t row_stride,
                     const Elem* fixed, int n, int slot) {
    const Elem* src = kPipe ? static_cast<const Elem*>(base) + b * batch_stride +
                                  int(blockIdx.y) / (p.num_heads / p.num_heads_k) * head_stride
                            : fixed;
    load_tile_async<kBN, kH, kPitch, kThreads>(dst + slot * Tile::kSmemKV, src + int64_t(n) * kBN * row_stride,
                                               row_stride, S - n * kBN, hd);
  };
  auto load_k = [&](int n, int slot) {
    load_kv(sK, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, k, n, slot);
  };
  auto load_v = [&](int n, int slot) {
    load_kv(sV, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, v, n, slot);
  };
  load_tile_async<kBM, kH, kPitch, kThreads>(sQ, q, p.q_row_stride, T - m0, hd);
  if constexpr (kPipe) {
    // Group 0: Q, K(nb); group 1: K(nb-1), V(nb) (K(n), V(n) in buffer n & 1).
    if (nb >= nb_lo) load_k(nb, nb & 1);
    ptx::cp_async_commit();
    if (nb >= nb_lo) {
      if (nb > nb_lo) load_k(nb - 1, (nb - 1) & 1);
      load_v(nb, nb & 1);
    }
    ptx::cp_async_commit();
  } else {
    if (nb >= nb_lo) {  // (S = 0: no key, o = 0 and lse = -inf)
      load_k(nb, 0);
      if constexpr (kStages == 2) load_v(nb, 0);
    }
    ptx::cp_async_commit();
  }

  float o[kM][kH / 8][4];
  clear(o);
  OnlineSoftmax<kM> softmax;
  softmax.init();
  // With a soft cap or a bias the logits are scaled (capped, biased) before
  // the softmax, which then scales by 1.
  const bool prescaled = kMasked && (softcap > 0.f || (kDense && p.bias != nullptr));
  const float scale_log2 = (prescaled ? 1.f : p.scale) * kLog2e;

  const int warp_row = warp * kM * 16;
  const uint32_t q_addr = ptx::smem_addr(sQ) + warp_row * kPitch * 2 + lane_offset_a<kPitch>(lane);
  const uint32_t k_addr = ptx::smem_addr(sK) + lane_offset_b<kPitch>(lane);
  const uint32_t v_addr = ptx::smem_addr(sV) + lane_offset_a<kPitch>(lane);

  if constexpr (kPipe) {
    // S(n-1) = Q K(n-1)^T is issued before the softmax and P V of block n, so that
    // the tensor cores work on it while the warp does the softmax of block n.
    // At the step of block n (one barrier): K(n-1) and V(n) have landed;
    // K(n-2) and V(n-1) start loading (into the buffers of K(n) and V(n+1),
    // read in the previous step).
    // (S(n-1) is computed even in the last step, from a stale buffer, and
    // masked only at the next step: the MMAs and the softmax then form one
    // branch-free block that ptxas can interleave.)
    auto s_of = [&](float (&s)[kM][kBN / 8][4], int n) {
      clear(s);
      gemm_ss_abt<Elem, kM, kBN / 8, kH, kPitch, kPitch>(s, q_addr, k_addr + (n & 1) * Tile::kSmemKV * 2);
    };
    auto mask_of = [&](float (&s)[kM][kBN / 8][4], int n) {
      const int n0 = n * kBN;
      if (n0 + kBN > S || (causal && n0 + kBN - 1 > m0))
        apply_mask(s, m0 + warp_row, n0, lane, [&](int row, int col) { return col >= S || (causal && col > row); });
    };
    auto step = [&](float (&s_cur)[kM][kBN / 8][4], float (&s_next)[kM][kBN / 8][4], int n) {
      ptx::cp_async_wait<0>();  // K(n-1), V(n) landed ...
      __syncthreads();          // ... for all threads, and the previous step's tiles are no longer read
      if (n - 2 >= nb_lo) load_k(n - 2, n & 1);
      if (n - 1 >= nb_lo) load_v(n - 1, (n - 1) & 1);
      ptx::cp_async_commit();
      mask_of(s_cur, n);
      s_of(s_next, n - 1);
      softmax.template update<true>(s_cur, o, scale_log2);
      uint32_t pa[kM][kBN / 16][4];
      acc_to_a_frags<Elem>(s_cur, pa);
      gemm_rs_ab<Elem, kM, kH / 8, kBN / 16, kPitch>(o, pa, v_addr + (n & 1) * Tile::kSmemKV * 2);
    };
    float s_a[kM][kBN / 8][4], s_b[kM][kBN / 8][4];
    if (nb >= nb_lo) {
      ptx::cp_async_wait<1>();  // Q, K(nb) landed ...
      __syncthreads();          // ... for all threads
      s_of(s_a, nb);
    }
    while (nb >= nb_lo) {
      step(s_a, s_b, nb);
      if (--nb < nb_lo) break;
      step(s_b, s_a, nb);
      --nb;
    }
  } else
  // Key blocks from the last: the ones that need masking come first.
  for (int it = 0; nb >= nb_lo; --nb, ++it) {
    const int n0 = nb * kBN;
    // (kStages = 2: buffer it & 1 holds K(nb), V(nb); the other one is filled
    // with K(nb-1), V(nb-1) during this step.)
    const uint32_t kv_off = kStages == 2 ? (it & 1) * Tile::kSmemKV * 2 : 0;
    ptx::cp_async_wait<0>();  // K(nb) (and V(nb) with kStages = 2) landed ...
    __syncthreads();          // ... for all threads, and the previous step's tiles are no longer read
    if constexpr (kStages == 2) {
      if (nb > nb_lo) {
        const int nx = (it & 1) ^ 1;
        load_tile_async<kBN, kH, kPitch, kThreads>(sK + nx * Tile::kSmemKV, k + int64_t(n0 - kBN) * p.k_row_stride,
                                                   p.k_row_stride, S - (n0 - kBN), hd);
        load_tile_async<kBN, kH, kPitch, kThreads>(sV + nx * Tile::kSmemKV, v + int64_t(n0 - kBN) * p.v_row_stride,
                                                   p.v_row_stride, S - (n0 - kBN), hd);
        ptx::cp_async_commit();
      }
    } else {
      load_tile_async<kBN, kH, kPitch, kThreads>(sV, v + int64_t(n0) * p.v_row_stride,
                                                 p.v_row_stride, S - n0, hd);
      ptx::cp_async_commit();
    }

    float s[kM][kBN / 8][4];
    clear(s);
    gemm_ss_abt<Elem, kM, kBN / 8, kH, kPitch, kPitch>(s, q_addr, k_addr + kv_off);
    if constexpr (kMasked) {
      if (kDense && p.bias != nullptr) {
        prescale_logits<true>(s, m0 + warp_row, n0, lane, p.scale, softcap,
                              [&](int row) { return mask.bias_row(head, row); }, mask.bias_at.col, mask.kv_len);
      } else if (softcap > 0.f) {
        prescale_logits<false>(s, m0 + warp_row, n0, lane, p.scale, softcap, [](int) { return nullptr; }, 0, 0);
      }
      if (segments || mask.tile_partial(m0 + warp_row, m0 + warp_row + kM * 16, n0, n0 + kBN))
        apply_visibility(s, m0 + warp_row, n0, lane, mask.q_seg, mask.q_len, mask.kv_seg, mask.kv_len,
                         [&](int row, int col) {
                           return mask.visible(row, col) && (!kDense || mask.dense_ok(head, row, col));
                         });
    } else if (n0 + kBN > S || (causal && n0 + kBN - 1 > m0)) {
      apply_mask(s, m0 + warp_row, n0, lane,
                 [&](int row, int col) { return col >= S || (causal && col > row); });
    }

    if constexpr (kStages == 1) {
      ptx::cp_async_wait<0>();  // V(nb) landed ...
      __syncthreads();          // ... for all threads, and K(nb) is no longer read
      if (nb > nb_lo) {
        load_tile_async<kBN, kH, kPitch, kThreads>(sK, k + int64_t(n0 - kBN) * p.k_row_stride,
                                                   p.k_row_stride, S - (n0 - kBN), hd);
        ptx::cp_async_commit();
      }
    }

    softmax.update(s, o, scale_log2);
    uint32_t pa[kM][kBN / 16][4];
    acc_to_a_frags<Elem>(s, pa);
    gemm_rs_ab<Elem, kM, kH / 8, kBN / 16, kPitch>(o, pa, v_addr + kv_off);
  }

  float inv[kM][2], lse[kM][2];
  softmax.finish(prescaled ? 1.f : p.scale, inv, lse);
  if ((lane & 3) == 0) {
#pragma unroll
    for (int i = 0; i < kM; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + warp_row + i * 16 + lane / 4 + 8 * h;
        if (row < T) p.lse[(int64_t(b) * T + row) * p.num_heads + head] = lse[i][h];
      }
  }
  if constexpr (kMasked || kStages == 2 || kPipe) {  // (no key block ran: the Q copies may still be in flight)
    ptx::cp_async_wait<0>();
    __syncthreads();
  }
  // O goes through the warp's own Q rows (only this warp read them).
  acc_to_smem<Elem, kPitch>(o, inv, sQ + warp_row * kPitch, lane);
  __syncthreads();
  Elem* out = static_cast<Elem*>(p.o) + b * p.o_batch_stride + int64_t(m0) * p.o_row_stride +
              head * p.o_head_stride;
  store_tile<kBM, kH, kPitch, kThreads>(sQ, out, p.o_row_stride, T - m0, hd);
}

// Enqueues the forward kernel for head dims up to kHeadDim.
template <int kHeadDim, typename Elem>
LaunchStatus run_fwd(const AttnParams& p, cudaStream_t stream) {
  using Tile = typename FwdTileFor<kHeadDim>::type;
  auto kernel = p.bias != nullptr || p.mask != nullptr ? flash_fwd_kernel<Tile, Elem, true, true>
                : p.has_masks()   ? flash_fwd_kernel<Tile, Elem, true, false>
                                  : flash_fwd_kernel<Tile, Elem, false, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Tile::kSmemBytes);
  if (err != cudaSuccess) return {err, "flash_fwd_sm80 (set smem)"};
  const dim3 grid((p.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM, p.num_heads, p.batch);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return {cudaGetLastError(), "flash_fwd_sm80"};
}

}  // namespace jaxattn::cuda::sm80
