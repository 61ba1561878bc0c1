// Tail split of the Hopper backward (head dims 64 / 128; unmasked, non-causal,
// non-deterministic calls with AttnParams::dkv_tail set; session 32: +0.3-2.9% fwd+bwd
// through JAX at T 2K-16K, docs/perf.md).
//
// The grid has one CTA per unit (key block, kv head, batch) of equal work, and the
// benchmark's shapes give 2^k units on 132 SMs: 15.5 or 31.03 waves, so in the last
// wave 64 (or 128) SMs idle for up to a whole unit's time (Nsight Compute: SM active
// 96.6-97.1% of the kernel's cycles at H=64 / 256, T=16K). With the split, the first
// units run whole as before and each of the last R = units mod SMs is cut into
// `slices` slices of its query blocks, one CTA each, so the last wave is
// ceil(R slices / SMs) slices long instead of one unit. A slice adds its dK (times the
// scale) and dV from registers into f32 partial sums (AttnParams::dkv_tail, zeroed
// first); a small kernel afterwards converts them into dK / dV. dQ is added as always.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "common/ptx.h"
#include "sm90/bwd_traits.cuh"

namespace jaxattn::sm90 {

// Rows of one unit in dkv_tail (the largest kBlockN).
constexpr int kTailRows = 128;

// The unit of CTA blockIdx.x on the split grid (BwdArgs::tail_slices > 0): its key
// block, kv head and batch row in `tile`, with tail_slot (its unit's partial sums) and
// its slice of the unit's query blocks when it is one of a split unit's CTAs.
__device__ __forceinline__ void bwd_tail_unit(const BwdArgs& a, BwdTile& tile, int& slice, int& slices) {
  int unit = (int)blockIdx.x;
  if (unit >= a.tail_first) {
    const int i = unit - a.tail_first;
    tile.tail_slot = i / a.tail_slices;
    slice = i % a.tail_slices;
    slices = a.tail_slices;
    unit = a.tail_first + tile.tail_slot;
  }
  const int K = a.attn.num_heads_k;
  tile.n_block = unit % a.n_kblocks;
  tile.kv_head = (unit / a.n_kblocks) % K;
  tile.batch = unit / (a.n_kblocks * K);
}

// A slice's dK (times the scale) and dV, wgmma accumulator layout (acc[4 j + 2 h + e]:
// key row 16 warp + g + 8 h of the warpgroup's rows, column 8 j + 2 t + e of its
// columns), added into its unit's partial sums.
template <class Tr>
__device__ __forceinline__ void bwd_tail_add_partial(const float (&dk)[Tr::kAccRegs], const float (&dv)[Tr::kAccRegs],
                                                     const BwdArgs& args, int slot, int wg, int warp, int g, int t) {
  static_assert(!Tr::kWide, "no tail split at head dim 256 (its dK / dV live in different warpgroups)");
  constexpr int H = Tr::kHeadDim;
  float* const dk_sum = args.attn.dkv_tail + (size_t)slot * 2 * kTailRows * H;
  float* const dv_sum = dk_sum + kTailRows * H;
  const int row0 = wg * 64 + warp * 16 + g;
  const float scale = args.scale;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int j = 0; j < Tr::kKvCols / 8; ++j) {
      const int at = (row0 + 8 * h) * H + 8 * j + 2 * t;
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dk_sum + at), "f"(dk[4 * j + 2 * h] * scale),
                   "f"(dk[4 * j + 2 * h + 1] * scale)
                   : "memory");
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dv_sum + at), "f"(dv[4 * j + 2 * h]),
                   "f"(dv[4 * j + 2 * h + 1])
                   : "memory");
    }
  }
}

// dK / dV of the split units from their partial sums: block (slot, 0 = dK / 1 = dV),
// 8 columns a thread.
template <typename Elem, int kBlockN, int H>
__global__ void __launch_bounds__(256) bwd_tail_convert_kernel(const AttnParams p, int tail_first, int n_kblocks) {
  const int slot = blockIdx.x, which = blockIdx.y;
  const int unit = tail_first + slot, K = p.num_heads_k;
  const int n_block = unit % n_kblocks, kv_head = (unit / n_kblocks) % K, b = unit / (n_kblocks * K);
  const float* src = p.dkv_tail + ((size_t)slot * 2 + which) * kTailRows * H;
  Elem* dst = static_cast<Elem*>(which ? p.dv : p.dk);
  const int64_t bs = which ? p.v_batch_stride : p.k_batch_stride, rs = which ? p.v_row_stride : p.k_row_stride,
                hs = which ? p.v_head_stride : p.k_head_stride;
  for (int i = threadIdx.x; i < kBlockN * (H / 8); i += blockDim.x) {
    const int r = i / (H / 8), c = (i % (H / 8)) * 8, key = n_block * kBlockN + r;
    if (key >= p.seqlen_k) continue;
    const float4 x = *reinterpret_cast<const float4*>(src + r * H + c);
    const float4 y = *reinterpret_cast<const float4*>(src + r * H + c + 4);
    uint4 o;
    o.x = ptx::pack2<Elem>(x.x, x.y), o.y = ptx::pack2<Elem>(x.z, x.w);
    o.z = ptx::pack2<Elem>(y.x, y.y), o.w = ptx::pack2<Elem>(y.z, y.w);
    *reinterpret_cast<uint4*>(dst + b * bs + (int64_t)key * rs + kv_head * hs + c) = o;
  }
}

// How to split a grid of `units` equal units on `sms` SMs, each unit `m_blocks` query
// blocks: slices per split unit (0: no split). The last wave then takes
// ceil(R k / sms) rounds of m_blocks / k + `overhead` query-block steps (R = units mod
// sms; the overhead: a slice's K / V load and partial-sum adds) instead of m_blocks;
// the k (2..64, >= 2 query blocks a slice) with the shortest. Overheads from session 31
// runs 4-5 (standalone, non-causal): at head dim 64, 3 steps (+0.5 / +1.4 / +1.6-3.8 /
// +3.2 / +2.8-3.2% at T = 1K / 2K / 4K / 8K / 16K); at 128, 3 steps split T=2K in 3
// and lost 3.5% (+0.7-2.2% at 4K-16K), so 8 there (no split at 1K / 2K).
inline int bwd_tail_slices(int units, int sms, int m_blocks, int capacity, double overhead) {
  const int R = units % sms;
  if (R == 0 || R > capacity) return 0;
  int best = 0;
  double best_len = m_blocks;
  for (int k = 2; k <= 64 && 2 * k <= m_blocks; ++k) {
    const double len = double((R * k + sms - 1) / sms) * (double(m_blocks) / k + overhead);
    if (len < best_len - 1e-9) best_len = len, best = k;
  }
  return best;
}

}  // namespace jaxattn::sm90
