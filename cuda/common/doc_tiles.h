// Document tiles of a packed forward (segment ids, one row of ids for queries and
// keys): query tiles that start where a document starts, so a packed batch of
// documents costs what the documents cost one by one. Without them the query tiles
// of kBlockM rows cut across documents, and so do key blocks: a tile that straddles
// two documents runs the first one's keys for the second one's rows, and every tile
// of a document that starts inside a key block reads one block more and tests its
// segment ids per element (packed / separate: 1.22 through JAX, session 8).
//
// A row qualifies when its query and key ids are the same ids and every id is one
// run of the row: ids that never decrease, then optionally a last run whose id occurs
// nowhere before (documents packed back to back, any lengths, then padding with an
// id of its own such as 0 or -1).
// Its tiles: every document [ds, de) is cut into tiles of kDocTileRows rows from ds
// (the last one shorter), so each tile lies inside one document and sees only keys
// [ds, de): no id test at all, key blocks aligned with the tile from ds, as if the
// document were alone. Built on the device by build_doc_tiles (sm90/doc_tiles.cu)
// into a workspace output of the forward's ffi_call, [batch, doc_tile_ints(T)]
// int32, per row: a header int4 {count, 0, 0, 0} and up to doc_tile_capacity(T)
// records int4 {row0, row_end, ds, de}, the longest (most key blocks) first. count
// -1: the row did not qualify, or needs more tiles than the capacity (documents much
// shorter than a tile), and runs the usual kBlockM-row tiles with the id test.
// Plain C++ apart from the device accessor (the FFI handlers size the workspace).
#pragma once

#include <cstdint>

namespace jaxattn::cuda {

constexpr int kDocTileRows = 128;  // the masked Hopper forward's kBlockM at every head dim
// Tiles the builder sorts in shared memory at most (16 bytes each); longer rows
// (T above ~400K) run without document tiles.
constexpr int kMaxDocTiles = 4096;

// Record slots per row: ceil(T / 128) tiles plus a quarter for the documents' short
// last tiles (with documents of >= ~512 tokens every row fits), plus 4. The grid has
// this many CTAs per (row, head); the ones past the row's count exit at once.
inline constexpr int doc_tile_capacity(int T) {
  const int m = (T + kDocTileRows - 1) / kDocTileRows;
  return m + m / 4 + 4;
}
// int32 per row of the workspace: the header and the records.
inline constexpr int doc_tile_ints(int T) { return 4 * (doc_tile_capacity(T) + 1); }

#ifdef __CUDACC__
// Row b's header (element 0) and records (1 ..) in the workspace.
__device__ __forceinline__ const int4* doc_tile_records(const int32_t* doc_tiles, int b, int T) {
  return reinterpret_cast<const int4*>(doc_tiles) + int64_t(b) * (doc_tile_capacity(T) + 1);
}
#endif

}  // namespace jaxattn::cuda
