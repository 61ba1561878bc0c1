"""Pure-JAX attention: the "reference" implementation and the fallback.

Same layout and semantics as jaxattn.flash_attention: logits and softmax in
float32, output in the input dtype, logsumexp residual in float32. It builds
the [B, N, T, S] logits, so it is for checking and small problems.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible(seqlen_q: int, seqlen_k: int, is_causal: bool, window=None, q_lengths=None,
            kv_lengths=None, q_segment_ids=None, kv_segment_ids=None) -> jax.Array | None:
    """Which keys each query sees, or None (all).

    [T, S] bool without lengths or segments, [B, T, S] with them. Causal is
    top-left aligned (key j <= query i); ``window=(left, right)`` keeps keys
    ``i - left <= j <= i + right``; query rows ``i >= q_lengths[b]`` see no
    key, keys ``j >= kv_lengths[b]`` are invisible (all as in
    ``jax.nn.dot_product_attention``); with segment ids [B, T] / [B, S] a
    query sees only keys of its own segment.
    """
    rows = jnp.arange(seqlen_q)[:, None]
    cols = jnp.arange(seqlen_k)[None, :]
    mask = None

    def both(a, b):
        return b if a is None else a & b

    if is_causal:
        mask = both(mask, cols <= rows)
    if window is not None:
        left, right = window
        mask = both(mask, (cols >= rows - left) & (cols <= rows + right))
    if q_lengths is not None:
        mask = both(mask, rows[None] < jnp.asarray(q_lengths)[:, None, None])
    if kv_lengths is not None:
        mask = both(mask, cols[None] < jnp.asarray(kv_lengths)[:, None, None])
    if q_segment_ids is not None:
        mask = both(mask, jnp.asarray(q_segment_ids)[:, :, None] == jnp.asarray(kv_segment_ids)[:, None, :])
    return mask


def masked_softmax(logits):
    """(softmax over the last axis, logsumexp without it) of f32 logits where masked
    entries are -inf: rows with no visible entry give probabilities 0 and lse -inf,
    and a gradient that stays finite (zero) there."""
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    nonempty = l > 0
    l_safe = jnp.where(nonempty, l, 1.0)
    return e / l_safe, jnp.where(nonempty, jnp.log(l_safe) + m, -jnp.inf)[..., 0]


def _by_kv_head(x, K: int, g: int):
    """A dense [Bb, Nb, Tb, Sb] array (Nb = 1 or K * g) -> broadcastable to [B, K, g, T, S]."""
    Bb, Nb, Tb, Sb = x.shape
    return x[:, :, None] if Nb == 1 else x.reshape(Bb, K, g, Tb, Sb)


def attention(query, key, value, *, scale: float, is_causal: bool, window=None, q_lengths=None,
              kv_lengths=None, softcap=None, q_segment_ids=None, kv_segment_ids=None, bias=None, mask=None):
    """Returns (out [B, T, N, H] in the input dtype, lse [B, T, N] float32).

    A row that sees no key gets output 0 and lse -inf, with zero (finite)
    gradients. The logits are ``softcap(scale * q.k) + bias`` (``softcap``:
    ``x -> softcap * tanh(x / softcap)``), then masked. ``bias`` (float) and
    ``mask`` (bool, True = attend) are rank 4, broadcastable to [B, N, T, S].
    """
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    g = N // K
    q = query.reshape(B, T, K, g, H)
    # HIGHEST: no TF32 for float32 inputs on GPUs; this is the reference.
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum(
        "btkgh,bskh->bkgts", q, key, preferred_element_type=jnp.float32, precision=hi
    ) * jnp.float32(scale)
    if softcap is not None:
        logits = jnp.float32(softcap) * jnp.tanh(logits / jnp.float32(softcap))
    if bias is not None:
        logits = logits + _by_kv_head(bias.astype(jnp.float32), K, g)
    vis = visible(T, S, is_causal, window, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
    if vis is not None and vis.ndim == 3:  # [B, T, S]
        vis = vis[:, None, None]
    if mask is not None:
        dense = _by_kv_head(mask.astype(jnp.bool_), K, g)
        vis = dense if vis is None else vis & dense
    if vis is not None:
        logits = jnp.where(vis, logits, -jnp.inf)
    probs, lse = masked_softmax(logits)  # lse [B, K, g, T]
    out = jnp.einsum(
        "bkgts,bskh->btkgh", probs.astype(value.dtype), value, preferred_element_type=jnp.float32,
        precision=hi,
    )
    out = out.reshape(B, T, N, H).astype(query.dtype)
    lse = lse.reshape(B, N, T).transpose(0, 2, 1)
    return out, lse
