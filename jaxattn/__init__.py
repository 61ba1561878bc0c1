"""jaxattn: hand-written CUDA and CPU flash-attention kernels for JAX, through XLA FFI."""

from __future__ import annotations

import jax

from . import dispatch as _dispatch
from . import reference
from ._extension import built_with_cuda
from ._validation import check_inputs as _check_inputs
from .attention import flash_attention

__version__ = "0.1.0"


def kernel_for(query, key, value, bias=None, mask=None, *, is_causal=False, scale=None, implementation=None,
               platform=None, local_window_size=None, query_seq_lengths=None, key_value_seq_lengths=None,
               logits_soft_cap=None, q_segment_ids=None, kv_segment_ids=None) -> str:
    """Names the kernel that ``flash_attention`` would use for these arguments.

    ``platform`` defaults to ``jax.default_backend()``. Returns e.g.
    ``"cuda:sm80_flash"``, ``"cpu:flash"`` or ``"reference"``. Raises what
    ``flash_attention`` would raise for the same arguments.
    """
    spec = _check_inputs(
        query, key, value, scale=scale, is_causal=is_causal, implementation=implementation,
        local_window_size=local_window_size, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, bias=bias, mask=mask,
    )
    _dispatch.check_forced(spec, implementation)
    if implementation == "reference":
        return "reference"
    if implementation == "cpu":
        return "cpu:flash"
    if implementation == "cuda":
        return _dispatch.cuda_kernel_name(spec)
    if implementation == "cuda_sm80":
        return "cuda:fwd=sm80,bwd=sm80"
    return _dispatch.kernel_for(spec, platform or jax.default_backend())


__all__ = ["flash_attention", "kernel_for", "built_with_cuda", "reference", "__version__"]
