// Host entry point of the CUDA decode kernels (jaxattn.decode_attention):
// split-KV attention of Tq <= 16 queries per row over a contiguous or paged
// KV cache, then a logsumexp combine.
//
// Two versions, picked per call by the caller (jaxattn/decode.py reads the
// choice at trace time; the handler never reads the environment):
//  1: CUDA cores, register-only pipelining (decode_kernel.cuh);
//  2: cp.async shared-memory ring + mma.sync tensor cores (decode_mma_kernel.cuh).
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "launch.h"

namespace jaxattn::cuda {

// Whether the decode kernels take `p` (a decode call, see the decode block of
// AttnParams): bf16/fp16, head dim 64, 128 or 256. Empty string when they do,
// else why not.
const char* decode_unsupported_reason(const AttnParams& p);

// Largest forced chunk (keys) a caller may ask for.
constexpr int kDecodeMaxForcedChunk = 8192;

// Splits of one (row, KV head) the workspace must hold for a row capacity of
// `capacity` keys (and a forced chunk of `forced_chunk` keys, 0 = none): no
// version ever uses more. The Python wrapper sizes split_o / split_lse with
// this function (jaxattn/decode.py).
int decode_max_splits(int capacity, int forced_chunk = 0);

// Writes p.o and p.lse; uses p.split_o [B, K, max_splits, Tq * G, H] and
// p.split_lse [B, K, max_splits, Tq * G] (p.num_splits = max_splits) when it
// splits a row's keys. `version`: 1 or 2 (above). `forced_chunk` > 0 (at
// most kDecodeMaxForcedChunk) cuts every row into chunks of exactly that
// many keys (tests: many splits at small sizes); 0 = the launcher's plan.
// Enqueues on `stream` only (CUDA-graph safe).
LaunchStatus decode_fwd(const AttnParams& p, cudaStream_t stream, int version = 1, int forced_chunk = 0);

// The two versions (decode_fwd dispatches; same contract).
LaunchStatus decode_fwd_v1(const AttnParams& p, cudaStream_t stream, int forced_chunk);
LaunchStatus decode_fwd_v2(const AttnParams& p, cudaStream_t stream, int forced_chunk);

}  // namespace jaxattn::cuda
