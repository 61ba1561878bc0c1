// The CUDA backend's XLA FFI handler symbols (built only with JAXATTN_WITH_CUDA).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxattnCudaFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxattnCudaBwd);
