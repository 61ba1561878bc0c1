"""Loads the compiled extension and registers its XLA FFI targets with JAX."""

from __future__ import annotations

import functools

import jax

try:
    from . import _jaxattn
except ImportError as e:  # pragma: no cover - only when the package was not built
    raise ImportError(
        "jaxattn's compiled extension is missing: install the package with "
        "`pip install .` (it builds the C++/CUDA kernels)"
    ) from e


@functools.cache
def register_targets() -> None:
    """Registers every FFI handler once: CPU targets and, if built, CUDA ones."""
    for name, capsule in _jaxattn.cpu_targets().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    for name, capsule in _jaxattn.cuda_targets().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def built_with_cuda() -> bool:
    """Whether the extension holds the CUDA kernels (nvcc was found at build time)."""
    return bool(_jaxattn.built_with_cuda)
