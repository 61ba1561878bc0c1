// Hopper backward kernels for head dim 256 (bf16 and fp16).
#include "sm90/bwd_launch.cuh"

JAXATTN_SM90_BWD_INSTANTIATE(256)
