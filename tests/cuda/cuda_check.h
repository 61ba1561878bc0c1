// Error checks of the standalone CUDA checkers: CUDA_CHECK (runtime calls) and
// check_launch (a jaxattn launcher's status); both print and exit(2) on failure.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "launch.h"

#define CUDA_CHECK(x)                                                                              \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));     \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

static inline void check_launch(const jaxattn::cuda::LaunchStatus& st) {
  if (!st.ok()) {
    std::fprintf(stderr, "launch failed in %s: %s\n", st.kernel, cudaGetErrorString(st.error));
    std::exit(2);
  }
}
