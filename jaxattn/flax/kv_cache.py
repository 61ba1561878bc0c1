"""KV-cache decoding for jaxattn's Flax attention layers.

``KVCache`` holds a layer's cached keys and values (contiguous, or paged
with a block table) and the number of valid tokens per row;
``decode_attention_step`` is the layer math of one decoding step, shared by
the linen and nnx layers (``layer(x, cache=cache) -> (y, cache)``): project
the new tokens, rotate q and k by their positions in the sequence, write k
and v into the cache (``jaxattn.update_kv_cache``), attend with
``jaxattn.decode_attention``, project out.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..decode import MAX_QUERIES, decode_attention, update_kv_cache
from . import _common


class KVCache(NamedTuple):
    """One attention layer's cache (a pytree: pass it through ``jax.jit``, donate it).

    key, value: ``[B, S_max, K, H]`` (contiguous) or ``[num_pages,
    page_size, K, H]`` (paged, with ``block_table`` int32 ``[B,
    max_pages]``); lengths: int32 ``[B]``, tokens already cached per row.
    """

    key: jax.Array
    value: jax.Array
    lengths: jax.Array
    block_table: jax.Array | None = None

    @classmethod
    def create(cls, batch: int, max_length: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32):
        """An empty contiguous cache for ``max_length`` tokens per row."""
        shape = (batch, max_length, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @classmethod
    def create_paged(cls, block_table, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                     dtype=jnp.float32):
        """An empty paged cache: row b's tokens go to the pages ``block_table[b]`` names, in order."""
        table = jnp.asarray(block_table, jnp.int32)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((table.shape[0],), jnp.int32),
                   table)


def decode_attention_step(config: _common.AttentionConfig, params: dict, x: jax.Array, cache: KVCache, *,
                          dtype=None) -> tuple[jax.Array, KVCache]:
    """Causal self-attention of the new tokens x [B, Tq, in_features] (Tq <= 16)
    over the cache and themselves; returns (y [B, Tq, out_features], the cache
    with their keys/values appended). The cache's dtype is that of the
    computation (``dtype``, default the promoted dtype of x and the params)."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a jaxattn.flax.KVCache, got {type(cache).__name__}")
    if not config.is_causal:
        raise ValueError("KV-cache decoding needs a causal layer (is_causal=True)")
    if x.ndim != 3:
        raise ValueError(f"decoding takes x [B, Tq, in_features], got shape {tuple(x.shape)}")
    if not 1 <= x.shape[1] <= MAX_QUERIES:
        raise ValueError(f"decoding takes 1 to {MAX_QUERIES} new tokens per step, got {x.shape[1]}")
    want = (config.num_kv_heads, config.head_dim)
    if tuple(cache.key.shape[2:]) != want:
        raise ValueError(f"cache heads {tuple(cache.key.shape[2:])} do not match the layer's (K, H) = {want}")
    T = x.shape[1]
    q, k, v, p = _common.project_qkv(config, params, x, dtype=dtype)
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, Tq]
    if config.rope_theta is not None:
        q = _common.rotary_embedding(q, positions, config.rope_theta)
        k = _common.rotary_embedding(k, positions, config.rope_theta)
    k, v = k.astype(cache.key.dtype), v.astype(cache.value.dtype)
    keys, values = update_kv_cache(cache.key, cache.value, k, v, cache.lengths, block_table=cache.block_table)
    lengths = cache.lengths + T
    window = None if config.local_window_size is None else config.local_window_size[0]  # causal: left only
    o = decode_attention(q.astype(keys.dtype), keys, values, kv_lengths=lengths, block_table=cache.block_table,
                         local_window_size=window, logits_soft_cap=config.logits_soft_cap)
    y = _common.project_out(config, p, o.astype(q.dtype))
    return y, KVCache(keys, values, lengths, cache.block_table)
