// The CPU backend's XLA FFI handler symbols.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxattnCpuFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxattnCpuBwd);
