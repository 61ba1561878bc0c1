// Which tiles a forward CTA runs, and in what order: the tile of a CTA of the
// (query tiles, heads, batch) grid, and the tile sequence of a CTA of the
// persistent grid (causal: from a plan the host builds once per call, FwdSchedule).
#pragma once

#include "common/doc_tiles.h"
#include "common/fast_div.h"
#include "sm90/causal_groups.h"
#include "sm90/fwd_smem.cuh"
#include "sm90/fwd_traits.cuh"

namespace jaxattn::sm90 {

// The key blocks a tile needs (causal: up to its last row's diagonal).
template <class Tr, bool kCausal>
__device__ __forceinline__ int fwd_tile_key_blocks(const FwdArgs& a, int m_block) {
  int n_blocks = (a.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  if (kCausal) {
    const int last_row = min(m_block * Tr::kBlockM + Tr::kBlockM - 1, a.seqlen_q - 1);
    n_blocks = min(n_blocks, last_row / Tr::kBlockN + 1);
  }
  return n_blocks;
}

// Non-causal tile number `idx` of the persistent grid: query tile fastest, so the
// tiles in flight share a few heads' K / V (CTA c runs c, c + g, ...).
template <class Tr>
__device__ __forceinline__ FwdTile fwd_tile(const FwdArgs& a, int idx) {
  const int m_tiles = (a.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  FwdTile tile;
  tile.m_block = idx % m_tiles;
  tile.head = (idx / m_tiles) % a.num_heads;
  tile.batch = idx / (m_tiles * a.num_heads);
  tile.n_blocks = fwd_tile_key_blocks<Tr, false>(a, tile.m_block);
  return tile;
}

// The causal order of the persistent grid: the j-th tile of CTA c as its query tile
// and its (batch * heads + head) index; false past the CTA's last tile. May step j
// past a tile that does not exist (odd M), so a caller's loop advances j by one
// after each tile it runs.
// Units of two query tiles of one (batch, head), M - 1 - p and p of M, cost the same
// whatever p (M + 1 key blocks with square tiles). They go out in rounds of g, one
// per CTA, the long tile first: in round k CTA c takes unit k g + (c + k) mod g (the
// rotation moves every CTA through every p even when g is a multiple of M / 2; an
// odd M counts as M + 1 whose tile M does not exist, so its unit p = 0 is tile 0
// alone, and without the rotation the same CTAs drew it every round: -11% at H=64
// causal T=2K, 11 tiles of 192 rows). Every CTA gets about the same work, and the
// tiles in flight cover ~g / (M / 2) heads, whose K / V stay in L2. (Longest-first
// over all heads, the previous order, put 132 different heads in flight: at H=64
// causal T=1K the profile read ~700 MB from DRAM for 128 MB of K / V and 64 MB of Q;
// rotated pairs: H=128 causal T=1K / 2K / 4K / 16K +19 / +22 / +17 / +6%, H=64 +9 /
// +5 / +6 / 0%, session 12 run 4.)
// (Host and device: the checker verifies the cover on the host.)
JAXATTN_HD bool causal_persistent_tile(const FwdSchedule& s, int c, int& j, int& m_block, int& bh) {
  const int k = j >> 1, r = c + k;
  const int u = k * s.grid + r - (int)s.div_grid.div(r) * s.grid;
  if (u >= s.pairs) return false;
  bh = s.div_half.div(u);
  const int p = u - bh * s.half;
  if (p == 0 && (j & 1) == 0 && 2 * s.half != s.m_tiles) ++j;  // (tile M of an odd M)
  m_block = (j & 1) ? p : 2 * s.half - 1 - p;
  return true;
}

// The j-th tile of causal persistent CTA c (causal_persistent_tile); false past its last.
template <class Tr>
__device__ __forceinline__ bool fwd_causal_cta_tile(const FwdArgs& a, int c, int& j, FwdTile& tile) {
  int bh;
  if (!causal_persistent_tile(a.sched, c, j, tile.m_block, bh)) return false;
  tile.batch = a.sched.div_heads.div(bh);
  tile.head = bh - tile.batch * a.num_heads;
  tile.n_blocks = fwd_tile_key_blocks<Tr, true>(a, tile.m_block);
  return true;
}

// The host's plan for a grid of `grid` persistent CTAs (or a plain grid: unused).
inline FwdSchedule make_fwd_schedule(int m_tiles, int num_heads, int batch, int group, int grid) {
  FwdSchedule s;
  s.m_tiles = m_tiles;
  s.grid = grid;
  const int bh = num_heads * batch;
  s.half = (m_tiles + 1) / 2;
  s.pairs = bh * s.half;
  s.div_half = FastDiv(s.half > 0 ? s.half : 1);
  s.div_heads = FastDiv(num_heads);
  s.div_group = FastDiv(group);
  s.div_grid = FastDiv(grid > 0 ? grid : 1);
  return s;
}

// The tile of a CTA of the non-persistent grid (query tiles, heads, batch), or of
// its causal grouped form (a 1-D grid: FwdArgs::causal_groups).
template <class Tr, bool kCausal>
__device__ __forceinline__ FwdTile fwd_tile_from_block(const FwdArgs& a) {
  FwdTile tile;
  if (kCausal && kFwdCausalGroupsF10 > 0 && a.causal_groups > 0) {
    const int m_tiles = (a.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
    int pos, bh;
    causal_group_unit((int)blockIdx.x, a.num_heads * a.batch, m_tiles, a.causal_groups, pos, bh);
    tile.m_block = m_tiles - 1 - pos;
    tile.head = bh % a.num_heads;
    tile.batch = bh / a.num_heads;
  } else {
    tile.m_block = kCausal ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    tile.head = blockIdx.y;
    tile.batch = blockIdx.z;
  }
  tile.n_blocks = fwd_tile_key_blocks<Tr, kCausal>(a, tile.m_block);
  return tile;
}

// The masked kernels' tile of a CTA of the (tile slots, heads, batch) grid. With
// document tiles (AttnParams::doc_tiles, built by build_doc_tiles just before) slot x
// of row b is that row's x-th tile (longest first; `doc` set, its document's keys in
// doc_keys) or nothing past the row's count; a row whose ids did not qualify (count
// -1) takes the query tiles of kBlockM rows, last first when causal, in its first
// ceil(T / kBlockM) slots. Key blocks are left to fwd_mask_tile. false: no tile.
template <class Tr, bool kCausal>
__device__ __forceinline__ bool fwd_masked_tile_from_block(const FwdArgs& a, FwdTile& tile, bool& doc,
                                                           int2& doc_keys) {
  const int m_tiles = (a.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int x = (int)blockIdx.x;
  tile.head = blockIdx.y;
  tile.batch = blockIdx.z;
  tile.n_blocks = 0;
  doc = false;
  if (a.attn.doc_tiles != nullptr) {
    const int4* rec = cuda::doc_tile_records(a.attn.doc_tiles, tile.batch, a.seqlen_q);
    const int count = __ldg(&rec[0].x);
    const int4 r = __ldg(rec + 1 + x);  // (x < the capacity: the grid's slots; one round trip with the count)
    if (count >= 0) {
      if (x >= count) return false;
      tile.m_block = 0;
      tile.row0 = r.x;
      tile.row_end = r.y;
      doc_keys = make_int2(r.z, r.w);
      doc = true;
      return true;
    }
  }
  if (x >= m_tiles) return false;
  tile.m_block = kCausal ? m_tiles - 1 - x : x;
  tile.row0 = tile.m_block * Tr::kBlockM;
  tile.row_end = min(tile.row0 + Tr::kBlockM, a.seqlen_q);
  return true;
}

}  // namespace jaxattn::sm90
