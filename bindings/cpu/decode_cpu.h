// The CPU decode kernel: attention of a few queries per row over a
// contiguous or paged KV cache (jaxattn.decode_attention).
#pragma once

#include "common/params.h"

namespace jaxattn::cpu {

// Writes p.o and p.lse from p.q and the cache p.k, p.v (the decode block of
// AttnParams says how the cache is laid out and which keys each query sees).
// p.split_o / p.split_lse are not read: the kernel keeps its own workspace.
void decode_fwd(const AttnParams& p);

}  // namespace jaxattn::cpu
