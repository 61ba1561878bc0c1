// Host entry point of the CUDA decode kernels (jaxattn.decode_attention):
// split-KV attention of Tq <= 16 queries per row over a contiguous or paged
// KV cache, then a logsumexp combine.
//
// NOT on the dispatch path: it runs only for implementation="cuda" and has
// not been validated on a GPU yet (tests/test_decode.py::*cuda* are the check).
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "launch.h"

namespace jaxattn::cuda {

// Whether the decode kernels take `p` (a decode call, see the decode block of
// AttnParams): bf16/fp16, head dim 64, 128 or 256. Empty string when they do,
// else why not.
const char* decode_unsupported_reason(const AttnParams& p);

// Splits of one (row, KV head) the workspace must hold for a row capacity of
// `capacity` keys: the launcher never uses more. The Python wrapper sizes
// split_o / split_lse with the same function's rule (jaxattn/decode.py).
int decode_max_splits(int capacity);

// Writes p.o and p.lse; uses p.split_o [B, K, max_splits, Tq * G, H] and
// p.split_lse [B, K, max_splits, Tq * G] (p.num_splits = max_splits) when it
// splits a row's keys. Enqueues on `stream` only (CUDA-graph safe).
LaunchStatus decode_fwd(const AttnParams& p, cudaStream_t stream);

}  // namespace jaxattn::cuda
