// Host side of the document tiles (layout: common/doc_tiles.h): when a Hopper kernel
// runs them, and the builder that fills the workspace on the kernel's stream.
#pragma once

#include <cuda_runtime.h>

#include "common/doc_tiles.h"
#include "common/params.h"

namespace jaxattn::sm90 {

// Whether a masked Hopper kernel whose tiles are `tile_rows` rows (query rows in the
// forward, keys in the backward) runs document tiles for `p`: the workspace is there,
// the call has segment ids with T == S, and the tiles are kDocTileRows long.
inline bool doc_tiles_apply(const AttnParams& p, int tile_rows) {
  return tile_rows == cuda::kDocTileRows && p.doc_tiles != nullptr && p.q_segment_ids != nullptr &&
         p.seqlen_q == p.seqlen_k && cuda::doc_tile_capacity(p.seqlen_q) <= cuda::kMaxDocTiles;
}

// Fills p.doc_tiles from the segment ids, one CTA per batch row (sm90/doc_tiles.cu);
// requires doc_tiles_apply. Records come longest first: by the key blocks their
// query rows see (the forward's query tiles) or, with key_tiles, by the query rows
// that see their keys (the backward's key tiles; causal: from the tile's first key
// to the document's end).
cudaError_t build_doc_tiles(const AttnParams& p, cudaStream_t stream, bool key_tiles = false);

}  // namespace jaxattn::sm90
