"""jaxattn.flax.nnx.MultiHeadAttention: a flax.nnx self-attention layer on jaxattn's kernels."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from . import _common
from .kv_cache import KVCache, decode_attention_step


class MultiHeadAttention(nnx.Module):
    """Multi-head self-attention (GQA, causal, rotary) calling ``jaxattn.flash_attention``.

    x [batch..., T, in_features] -> [batch..., T, out_features]; the math is
    ``jaxattn.flax._common.multi_head_attention`` (shared with the linen
    layer, same parameter names and shapes):

    Args:
      in_features: input feature size.
      num_heads: query heads N.
      num_kv_heads: key/value heads K (N % K == 0); default N. Fewer is GQA/MQA.
      head_dim: size of each head; default in_features // num_heads.
      out_features: output feature size; default in_features.
      is_causal: query i attends to keys j <= i.
      rope_theta: base of the rotary position embedding applied to q and k;
        None (the default) turns it off.
      local_window_size: sliding window, an int or (left, right), as in
        ``jaxattn.flash_attention`` (Mistral / Gemma local layers).
      logits_soft_cap: soft cap of the logits (Gemma 2), as in
        ``jaxattn.flash_attention``.
      use_bias: biases on the four projections.
      dtype: computation dtype (default: promoted from input and params).
      param_dtype: dtype of the parameters.
      kernel_init: initializer ``(key, shape, dtype)`` of the kernels; default
        LeCun normal over the contracted axes.
      kernel_axes: logical names of the (embed, heads, head_dim) axes of the
        query/key/value kernels, e.g. ``("embed", "heads", "head_dim")``;
        the key/value kernels use the same names (their heads axis has
        num_kv_heads entries), the out kernel gets (heads, head_dim, embed),
        biases the names of their axes. They become
        ``nnx.with_partitioning`` annotations; flax then shards parameters
        eagerly, which needs a mesh context (``jax.set_mesh``) at creation,
        or create the layer under ``nnx.use_eager_sharding(False)``. Meshes
        of ``AxisType.Auto`` axes work; with ``Explicit`` axes the
        projections would need ``out_sharding`` arguments (not done yet).
        jaxattn shards attention over batch and heads only: leave head_dim
        unsharded (e.g. ``("embed", "heads", None)``).
      attention_fn: ``fn(q, k, v, is_causal=...)`` on [B, T, N, H] arrays;
        default ``jaxattn.flash_attention``. E.g.
        ``functools.partial(jax.nn.dot_product_attention, implementation="cudnn")``.
      rngs: the ``params`` stream initializes the kernels.

    Call with ``segment_ids`` [batch..., T] for packed documents (attention
    within each segment). No dropout. KV-cache decoding: ``layer(x, cache=cache)``.
    """

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        out_features: int | None = None,
        is_causal: bool = False,
        rope_theta: float | None = None,
        local_window_size: int | tuple[int, int] | None = None,
        logits_soft_cap: float | None = None,
        use_bias: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init: Callable | None = None,
        kernel_axes: tuple[str | None, str | None, str | None] | None = None,
        attention_fn: Callable | None = None,
        rngs: nnx.Rngs,
    ):
        self.config = _common.AttentionConfig.create(
            in_features=in_features, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, out_features=out_features, is_causal=is_causal,
            rope_theta=rope_theta, use_bias=use_bias, local_window_size=local_window_size,
            logits_soft_cap=logits_soft_cap,
        )
        self.dtype = dtype
        self.attention_fn = attention_fn
        for name in _common.PROJECTIONS:
            kernel_names, bias_names = _common.kernel_axes_for(name, kernel_axes)
            init = kernel_init or _common.default_kernel_init(_common.fan_in_axes(name))
            setattr(self, f"{name}_kernel", _param(
                init, kernel_names, rngs.params(), self.config.kernel_shape(name), param_dtype))
            if use_bias:
                setattr(self, f"{name}_bias", _param(
                    jax.nn.initializers.zeros, bias_names, rngs.params(),
                    self.config.bias_shape(name), param_dtype))

    def params(self) -> dict[str, jax.Array]:
        """The parameter values by name ("query_kernel", ..., "out_bias")."""
        names = [f"{n}_kernel" for n in _common.PROJECTIONS]
        if self.config.use_bias:
            names += [f"{n}_bias" for n in _common.PROJECTIONS]
        return {name: getattr(self, name)[...] for name in names}

    def __call__(self, x: jax.Array, *, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None):
        """Self-attention of x [batch..., T, in_features]; positions [batch..., T]
        or [T] feed the rotary embedding (default 0..T-1).

        With ``cache`` (a ``jaxattn.flax.KVCache``; causal layers only): x
        [B, Tq, in_features] are the next Tq <= 16 tokens, at positions
        ``cache.lengths + 0..Tq-1``; returns ``(y, cache)`` with their keys
        and values appended (``jaxattn.decode_attention``)."""
        if cache is not None:
            if positions is not None or segment_ids is not None:
                raise ValueError("with a cache, positions come from cache.lengths: do not pass positions "
                                 "or segment_ids")
            return decode_attention_step(self.config, self.params(), x, cache, dtype=self.dtype)
        return _common.multi_head_attention(
            self.config, self.params(), x, positions=positions, segment_ids=segment_ids, dtype=self.dtype,
            attention_fn=self.attention_fn,
        )


def _param(init, axes, key, shape, dtype) -> nnx.Param:
    """An nnx.Param from ``init``, annotated with logical ``axes`` when given."""
    if axes is not None:
        init = nnx.with_partitioning(init, axes)
    return nnx.Param(init(key, shape, dtype))
