"""jaxattn.flax.linen.MultiHeadAttention: a flax.linen self-attention layer on jaxattn's kernels."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from . import _common
from .kv_cache import KVCache, decode_attention_step


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention (GQA, causal, rotary) calling ``jaxattn.flash_attention``.

    The linen twin of ``jaxattn.flax.nnx.MultiHeadAttention``: same
    arguments (less ``rngs``), same parameter names and shapes, same math
    (``jaxattn.flax._common.multi_head_attention``). ``in_features`` is
    taken from the input when left None. ``kernel_axes`` become
    ``nn.with_logical_partitioning`` annotations (see
    ``flax.linen.get_partition_spec`` / ``nn.logical_to_mesh_sharding``).
    """

    num_heads: int
    in_features: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    out_features: int | None = None
    is_causal: bool = False
    rope_theta: float | None = None
    local_window_size: int | tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable | None = None
    kernel_axes: tuple[str | None, str | None, str | None] | None = None
    attention_fn: Callable | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None):
        """Self-attention of x [batch..., T, in_features]; positions [batch..., T]
        or [T] feed the rotary embedding (default 0..T-1); segment_ids
        [batch..., T] restrict attention to each segment. With ``cache``:
        KV-cache decoding of the next Tq <= 16 tokens, returns ``(y, cache)``
        (as the nnx layer)."""
        config = _common.AttentionConfig.create(
            in_features=self.in_features or x.shape[-1], num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            out_features=self.out_features, is_causal=self.is_causal,
            rope_theta=self.rope_theta, use_bias=self.use_bias, local_window_size=self.local_window_size,
            logits_soft_cap=self.logits_soft_cap,
        )
        params = {}
        for name in _common.PROJECTIONS:
            kernel_names, bias_names = _common.kernel_axes_for(name, self.kernel_axes)
            init = self.kernel_init or _common.default_kernel_init(_common.fan_in_axes(name))
            params[f"{name}_kernel"] = self.param(
                f"{name}_kernel", _annotated(init, kernel_names), config.kernel_shape(name),
                self.param_dtype)
            if config.use_bias:
                params[f"{name}_bias"] = self.param(
                    f"{name}_bias", _annotated(jax.nn.initializers.zeros, bias_names),
                    config.bias_shape(name), self.param_dtype)
        if cache is not None:
            if positions is not None or segment_ids is not None:
                raise ValueError("with a cache, positions come from cache.lengths: do not pass positions "
                                 "or segment_ids")
            return decode_attention_step(config, params, x, cache, dtype=self.dtype)
        return _common.multi_head_attention(
            config, params, x, positions=positions, segment_ids=segment_ids, dtype=self.dtype,
            attention_fn=self.attention_fn,
        )


def _annotated(init, axes):
    """``init`` with logical partitioning metadata when ``axes`` are given."""
    return init if axes is None else nn.with_logical_partitioning(init, axes)
