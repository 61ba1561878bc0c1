// Hopper backward kernels for head dim 128 (bf16 and fp16).
#include "sm90/bwd_launch.cuh"

JAXATTN_SM90_BWD_INSTANTIATE(128)
