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


def target_names() -> list[str]:
    """The names of every FFI target this build registers (CPU, and CUDA when built with it)."""
    return sorted(set(_jaxattn.cpu_targets()) | set(_jaxattn.cuda_targets()))


def export_safety_checks() -> list:
    """The ``jax.export`` safety checks to disable so that code calling jaxattn exports.

    ``jax.export`` refuses custom calls whose targets carry no compatibility
    guarantee, which every jaxattn kernel is. Pass this list as
    ``disabled_checks`` to ``jax.export.export``; the exported module then runs
    (``Exported.call``, or after ``serialize`` / ``deserialize``) in any process
    that has imported the same jaxattn version, whose kernels it names::

        exported = jax.export.export(jax.jit(step), disabled_checks=jaxattn.export_safety_checks())(*args)

    The FFI attributes and buffers of the kernels may change between jaxattn
    versions: load what you serialize with the version that wrote it. Sharded
    steps export when written with ``jax.shard_map``; under ``jax.jit``
    shardings jaxattn places its kernels with ``custom_partitioning``
    callbacks, which ``jax.export`` refuses to serialize.
    """
    from jax import export

    return [export.DisabledSafetyCheck.custom_call(name) for name in target_names()]

