"""Pure-JAX decode attention: gather the cache, then masked softmax in float32.

The portable implementation of ``jaxattn.decode_attention`` (``implementation="xla"``,
and what GPUs run until a CUDA decode kernel lands). Same semantics as the
kernels: bottom-right aligned queries, lengths clamped to the capacity, page
ids clamped to the cache. It materializes each row's cache ([B, capacity, K,
H]) and the [B, N, Tq, capacity] logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import masked_softmax


def gather_cache(cache, block_table=None):
    """The cache as contiguous rows [B, capacity, K, H].

    Contiguous caches are returned as they are; a paged cache [P, page_size,
    K, H] is gathered through ``block_table`` int32 [B, max_pages] (ids
    clamped to [0, P)), giving capacity = max_pages * page_size.
    """
    if block_table is None:
        return cache
    P, ps, K, H = cache.shape
    B, max_pages = block_table.shape
    pages = jnp.clip(block_table, 0, P - 1)
    return cache[pages].reshape(B, max_pages * ps, K, H)


def visible(kv_lengths, seqlen_q: int, capacity: int, window_left: int | None = None):
    """[B, Tq, capacity] bool: which cached keys each query sees.

    Query i of row b sits at position ``len - Tq + i`` (``len`` =
    ``kv_lengths[b]`` clamped to [0, capacity]) and sees keys
    ``pos - window_left <= j <= pos``.
    """
    lengths = jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, capacity)
    pos = lengths[:, None] - seqlen_q + jnp.arange(seqlen_q)[None, :]  # [B, Tq]
    j = jnp.arange(capacity)[None, None, :]
    vis = j <= pos[..., None]
    if window_left is not None:
        vis = vis & (j >= pos[..., None] - window_left)
    return vis


def attention(query, key_cache, value_cache, kv_lengths, block_table=None, *, scale: float,
              window_left: int | None = None, softcap: float | None = None):
    """(out [B, Tq, N, H] in the query dtype, lse [B, Tq, N] float32); a query
    that sees no key gets output 0 and lse -inf."""
    k = gather_cache(key_cache, block_table)
    v = gather_cache(value_cache, block_table)
    B, T, N, H = query.shape
    S, K = k.shape[1], k.shape[2]
    g = N // K
    q = query.reshape(B, T, K, g, H)
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32,
                        precision=hi) * jnp.float32(scale)
    if softcap is not None:
        logits = jnp.float32(softcap) * jnp.tanh(logits / jnp.float32(softcap))
    vis = visible(kv_lengths, T, S, window_left)  # [B, T, S]
    mask = vis[:, None, None]  # [B, 1, 1, T, S]
    logits = jnp.where(mask, logits, -jnp.inf)
    # Value rows no query sees are zeroed, not just weighted by 0: past a row's length the
    # cache may hold anything (a reused page's old contents, NaN included), and 0 * NaN is NaN.
    v = jnp.where(vis.any(axis=1)[:, :, None, None], v, jnp.zeros((), v.dtype))
    probs, lse = masked_softmax(logits)  # lse [B, K, g, T]
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32,
                     precision=hi)
    out = out.reshape(B, T, N, H).astype(query.dtype)
    lse = lse.reshape(B, N, T).transpose(0, 2, 1)
    return out, lse
