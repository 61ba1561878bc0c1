// The CPU flash-attention kernels: tiled, online softmax, f32 accumulation,
// memory O((T + S) * H) per thread, parallel over batch x heads.
#pragma once

#include "common/params.h"

namespace jaxattn::cpu {

// Writes p.o and p.lse from p.q, p.k, p.v.
void flash_fwd(const AttnParams& p);

// Writes p.dq, p.dk, p.dv from p.q, p.k, p.v, p.o, p.lse, p.dout.
// Needs no workspace.
void flash_bwd(const AttnParams& p);

}  // namespace jaxattn::cpu
