// The Hopper (sm_90a) flash-attention forward kernel: warp-specialised, one CTA
// per 128-row query tile of one (batch, head).
//
// Threads: warpgroup 0 = producer (setmaxnreg.dec to 24; one thread issues every
// TMA load), warpgroups 1..2 = consumers (setmaxnreg.inc to 240; wgmma + softmax
// + epilogue on 64 query rows each). The tile comes from a trivial scheduler
// (blockIdx); a persistent scheduler would loop over FwdTile values here.
#pragma once

#include <cuda.h>

#include "common/hopper_ptx.h"
#include "common/ptx.h"
#include "sm90/fwd_epilogue.cuh"
#include "sm90/fwd_mainloop.cuh"
#include "sm90/fwd_smem.cuh"
#include "sm90/fwd_traits.cuh"

namespace jaxattn::sm90 {

// Kernel parameters: tensor maps first (64-byte aligned), then the plain arguments.
struct FwdParams {
  CUtensorMap tm_q;  // box (64, kBlockM, kChunks, 1, 1)
  CUtensorMap tm_k;  // box (64, kBlockN, kChunks, 1, 1)
  CUtensorMap tm_v;  // box (64, kBlockN, kChunks, 1, 1)
  CUtensorMap tm_o;  // box (64, 64, 1, 1, 1): one chunk of one warpgroup's rows
  FwdArgs args;
};

// The tile of this CTA: causal grids run the longest (last) query tiles first.
template <class Tr, bool kCausal>
__device__ __forceinline__ FwdTile fwd_tile_from_block(const FwdArgs& a) {
  FwdTile tile;
  tile.m_block = kCausal ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
  tile.head = blockIdx.y;
  tile.batch = blockIdx.z;
  int n_blocks = (a.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  if (kCausal) {
    const int last_row = min(tile.m_block * Tr::kBlockM + Tr::kBlockM - 1, a.seqlen_q - 1);
    n_blocks = min(n_blocks, last_row / Tr::kBlockN + 1);
  }
  tile.n_blocks = n_blocks;
  return tile;
}

template <class Tr, bool kCausal, bool kOverlap, bool kPingpong>
__global__ void __launch_bounds__(Tr::kThreads, 1) flash_fwd_sm90_kernel(const __grid_constant__ FwdParams params) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const FwdSmem<Tr> sm{(ptx::smem_addr(smem_raw) + 1023u) & ~1023u};
  const FwdArgs& args = params.args;
  const FwdTile tile = fwd_tile_from_block<Tr, kCausal>(args);

  // Warp-uniform warpgroup index (the compiler then knows the role branch is uniform).
  const int warpgroup = __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0);

  if (threadIdx.x == 0) {
    hptx::mbar_init(sm.bar_q(), 1);
#pragma unroll
    for (int s = 0; s < Tr::kStages; ++s) {
      hptx::mbar_init(sm.bar_k_full(s), 1);
      hptx::mbar_init(sm.bar_v_full(s), 1);
      hptx::mbar_init(sm.bar_k_empty(s), 4 * Tr::kConsumerWarpgroups);
      hptx::mbar_init(sm.bar_v_empty(s), 4 * Tr::kConsumerWarpgroups);
    }
    hptx::mbar_init_fence();
  }
  __syncthreads();

  if (warpgroup == 0) {
    hptx::setmaxnreg_dec<Tr::kProducerRegs>();
    if (threadIdx.x == 0) {
      hptx::prefetch_tmap(&params.tm_q);
      hptx::prefetch_tmap(&params.tm_k);
      hptx::prefetch_tmap(&params.tm_v);
      const int kv_head = tile.head / args.group;
      FwdMainloop<Tr>::produce(&params.tm_q, &params.tm_k, &params.tm_v, sm, tile, kv_head);
    }
  } else {
    hptx::setmaxnreg_inc<Tr::kConsumerRegs>();
    const int wg = warpgroup - 1;
    const int tid = threadIdx.x % 128;
    float o[Tr::kHeadDim / 2];
    OnlineSoftmax<Tr::kBlockN> softmax;
    FwdMainloop<Tr>::template consume<kCausal, kOverlap, kPingpong>(o, softmax, sm, tile, args, wg, tid);
    FwdEpilogue<Tr>::store(o, softmax, &params.tm_o, sm, tile, args, wg, tid);
  }
}

}  // namespace jaxattn::sm90
