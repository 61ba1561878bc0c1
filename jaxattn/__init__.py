"""jaxattn: hand-written CUDA and CPU flash-attention kernels for JAX, through XLA FFI."""

from __future__ import annotations

import jax

from . import dispatch as _dispatch
from . import reference
from ._extension import built_with_cuda, export_safety_checks
from ._validation import check_inputs as _check_inputs
from . import ring
from .attention import flash_attention
from .decode import decode_attention, decode_kernel_for, update_kv_cache
from .remat import CHECKPOINT_NAMES
from .ring import ring_attention

__version__ = "0.1.0"


def kernel_for(query, key, value, bias=None, mask=None, *, is_causal=False, scale=None, implementation=None,
               platform=None, local_window_size=None, query_seq_lengths=None, key_value_seq_lengths=None,
               logits_soft_cap=None, q_segment_ids=None, kv_segment_ids=None, deterministic=False) -> str:
    """Names the kernel that ``flash_attention`` would use for these arguments.

    ``platform`` defaults to ``jax.default_backend()``. Returns e.g.
    ``"cuda:fwd=sm90,bwd=sm90"`` (the kernel of each pass), ``"cpu:flash"``
    or ``"reference"``. Raises what
    ``flash_attention`` would raise for the same arguments.
    """
    spec = _check_inputs(
        query, key, value, scale=scale, is_causal=is_causal, implementation=implementation,
        local_window_size=local_window_size, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, bias=bias, mask=mask,
    )
    _dispatch.check_forced(spec, implementation)
    return _dispatch.kernel_for(spec, platform or jax.default_backend(), deterministic, implementation)


__all__ = ["flash_attention", "ring_attention", "ring", "decode_attention", "decode_kernel_for", "update_kv_cache",
           "kernel_for", "built_with_cuda", "export_safety_checks", "reference", "CHECKPOINT_NAMES", "__version__"]
