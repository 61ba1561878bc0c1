// The CUDA decode target's XLA FFI handler symbol (jaxattn_cuda_decode).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxattnCudaDecode);
