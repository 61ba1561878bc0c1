// Hopper forward kernels for head dim 64 (bf16 and fp16).
#include "sm90/fwd_launch.cuh"

JAXATTN_SM90_FWD_INSTANTIATE(64)
