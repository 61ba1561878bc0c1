// Host stand-in for cuda/decode/decode_common.cuh (tests/cuda_emu): the constants the
// register loop reads; the combine kernel and 16-bit rounding stay GPU-only.
#pragma once

#include "common/params.h"
#include "common/ptx.h"

namespace jaxattn::cuda::decode {
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;
}  // namespace jaxattn::cuda::decode
