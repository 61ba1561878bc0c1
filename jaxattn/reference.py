"""Pure-JAX attention: the "reference" implementation and the fallback.

Same layout and semantics as jaxattn.flash_attention: logits and softmax in
float32, output in the input dtype, logsumexp residual in float32. It builds
the [B, N, T, S] logits, so it is for checking and small problems.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible(seqlen_q: int, seqlen_k: int, is_causal: bool) -> jax.Array | None:
    """[T, S] bool: which keys each query sees (None: all). Causal is top-left aligned."""
    if not is_causal:
        return None
    rows = jnp.arange(seqlen_q)[:, None]
    cols = jnp.arange(seqlen_k)[None, :]
    return cols <= rows


def attention(query, key, value, *, scale: float, is_causal: bool):
    """Returns (out [B, T, N, H] in the input dtype, lse [B, T, N] float32)."""
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    g = N // K
    q = query.reshape(B, T, K, g, H)
    # HIGHEST: no TF32 for float32 inputs on GPUs; this is the reference.
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum(
        "btkgh,bskh->bkgts", q, key, preferred_element_type=jnp.float32, precision=hi
    ) * jnp.float32(scale)
    mask = visible(T, S, is_causal)
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, K, g, T]
    finite = jnp.isfinite(lse)
    probs = jnp.where(finite[..., None], jnp.exp(logits - jnp.where(finite, lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum(
        "bkgts,bskh->btkgh", probs.astype(value.dtype), value, preferred_element_type=jnp.float32,
        precision=hi,
    )
    out = out.reshape(B, T, N, H).astype(query.dtype)
    lse = lse.reshape(B, N, T).transpose(0, 2, 1)
    return out, lse
