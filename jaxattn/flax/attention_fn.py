"""jaxattn.flax.attention_fn: a drop-in ``attention_fn`` for flax's attention layers.

Pass it as ``attention_fn=`` to ``flax.linen.MultiHeadDotProductAttention``
or ``flax.nnx.MultiHeadAttention``. It runs ``jaxattn.flash_attention``
whenever the call is something jaxattn computes (masks and biases included;
no active dropout, no sowing of the weights) and otherwise the stock flax
function, warning once per reason with a ``FallbackWarning``.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from .._validation import check_inputs
from ..attention import flash_attention


class FallbackWarning(UserWarning):
    """attention_fn ran the stock flax attention, not jaxattn's kernels (the message says why)."""


_WARNED: set[str] = set()


def _reset_fallback_warnings() -> None:
    """Forgets which fallback reasons were already warned about (for tests)."""
    _WARNED.clear()


def _warn_once(reason: str) -> None:
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(
        f"jaxattn.flax.attention_fn falls back to flax's stock dot_product_attention: {reason}",
        FallbackWarning, stacklevel=3,
    )


def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    *,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    **kwargs,
):
    """``flax.linen.dot_product_attention`` / ``flax.nnx.dot_product_attention``, on jaxattn's kernels.

    Same arguments and result: query ``[batch..., T, N, H]``, key/value
    ``[batch..., S, K, H]`` (``N % K == 0``, GQA), output ``[batch..., T, N, H]``
    in the promoted dtype (``dtype`` when given), scale ``1/sqrt(H)``.

    jaxattn runs the call when there is no ``module`` (sowing the attention
    weights needs them explicitly), no active dropout (``dropout_rate == 0``
    or ``deterministic``) and no custom einsums; the dtype must be bfloat16,
    float16 or float32 and the head dim at most 256. Otherwise it
    runs the stock function and warns once per reason (``FallbackWarning``;
    silence it with ``warnings.filterwarnings("ignore", category=FallbackWarning)``).
    The stock function is flax.linen's when ``module`` is a linen Module or
    linen-only options are set (``force_fp32_for_softmax=True``, custom
    einsums), else flax.nnx's (it also takes ``is_causal`` and GQA).

    Masks and biases: ``mask`` and ``bias`` (broadcastable to
    ``[batch..., num_heads, T, S]``) go to the kernel as its dense ``mask``
    / ``bias``, read in place (broadcast dimensions are never expanded,
    except batch dimensions that are broadcast only partly), and the bias
    is differentiable. Causal masking is fastest as ``is_causal=True``
    (fully masked blocks are skipped: ``flax.nnx.MultiHeadAttention``
    passes its ``is_causal`` call argument; with linen use
    ``functools.partial(attention_fn, is_causal=True)``, or
    ``jaxattn.flax.linen.MultiHeadAttention``); a NumPy mask (on the host,
    inspected without a device-to-host copy) that is lower-triangular
    becomes ``is_causal=True`` and an all-True one is dropped. A query row
    whose keys are all masked gives 0 here, where flax's stock function
    (whose masked logits are a large finite negative number) gives the mean
    of the values: padded query rows differ, every other row matches.

    ``precision`` and ``force_fp32_for_softmax`` only affect the fallback:
    jaxattn's kernels always compute the softmax in float32. Other keyword
    arguments (``**kwargs``) are passed to the stock function.
    """
    reason = None
    if kwargs:
        reason = f"arguments jaxattn does not take: {sorted(kwargs)}"
    elif module is not None:
        reason = "sowing the attention weights (module=...) needs them explicitly"
    elif dropout_rate > 0.0 and not deterministic:
        reason = f"attention dropout (dropout_rate={dropout_rate}, deterministic=False)"
    elif qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        reason = "custom einsums (qk_attn_weights_einsum / attn_weights_value_einsum)"

    dense_mask = mask
    if reason is None and mask is not None:
        recognised = _static_mask_kind(mask, query.shape, key.shape)
        if recognised == "causal":
            dense_mask, is_causal = None, True
        elif recognised == "all":
            dense_mask = None

    if reason is None:
        query, key, value = nnx_dtypes.promote_dtype((query, key, value), dtype=dtype)
        flat = [_flatten_batch(x) for x in (query, key, value)]
        try:
            batch = query.shape[:-3]
            fbias = None if bias is None else _flatten_dense("bias", jnp.asarray(bias), batch)
            fmask = None if dense_mask is None else _flatten_dense("mask", jnp.asarray(dense_mask), batch)
            if fmask is not None and fmask.dtype != jnp.bool_:
                fmask = fmask.astype(jnp.bool_)  # flax masks out the falsy entries
            check_inputs(*flat, scale=None, is_causal=bool(is_causal), implementation=None, bias=fbias,
                         mask=fmask)
        except ValueError as e:
            reason = f"jaxattn cannot take these inputs: {e}"
        else:
            out = flash_attention(*flat, fbias, fmask, is_causal=bool(is_causal))
            return out.reshape(query.shape)

    _warn_once(reason)
    return _stock(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision, module, is_causal=is_causal,
        force_fp32_for_softmax=force_fp32_for_softmax,
        qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum, **kwargs,
    )


def _flatten_batch(x):
    """[batch..., L, heads, H] -> [prod(batch), L, heads, H] (a no-op reshape for rank 4)."""
    return x.reshape((math.prod(x.shape[:-3]), *x.shape[-3:])) if x.ndim >= 3 else x


def _flatten_dense(name: str, x, batch: tuple[int, ...]):
    """A flax mask / bias broadcastable to [batch..., N, T, S] -> broadcastable to
    [prod(batch), N, T, S] (rank 4, or rank 3 without batch dims).

    Batch dimensions that are all broadcast (or all full) fold without a
    copy; partly broadcast ones are expanded over the batch only.
    """
    rank = len(batch) + 3
    if x.ndim > rank:
        raise ValueError(f"{name} of shape {x.shape} has more dimensions than [batch..., heads, T, S]")
    x = x.reshape((1,) * (rank - x.ndim) + x.shape)
    if len(batch) == 0:
        return x
    lead = x.shape[:len(batch)]
    if any(d not in (1, b) for d, b in zip(lead, batch)):
        raise ValueError(f"{name} of shape {x.shape} does not broadcast to the batch {batch}")
    if all(d == 1 for d in lead):
        return x.reshape((1,) + x.shape[len(batch):])
    if tuple(lead) != tuple(batch):
        x = jnp.broadcast_to(x, tuple(batch) + x.shape[len(batch):])
    return x.reshape((math.prod(batch),) + x.shape[len(batch):])


def _static_mask_kind(mask, query_shape, key_shape) -> str | None:
    """'causal' or 'all' for a host (NumPy) mask that is top-left causal or all True; else None.

    Device arrays and tracers are never inspected (that would need a
    device-to-host copy, or is impossible under jit).
    """
    if isinstance(mask, (jax.Array, jax.core.Tracer)) or not isinstance(mask, (np.ndarray, np.bool_)):
        return None
    if len(query_shape) < 3 or len(key_shape) < 3:
        return None
    mask = np.asarray(mask)
    T, S = query_shape[-3], key_shape[-3]
    weights_shape = (*query_shape[:-3], query_shape[-2], T, S)
    try:
        if np.broadcast_shapes(mask.shape, weights_shape) != weights_shape:
            return None
    except ValueError:
        return None
    if mask.ndim < 2 or mask.shape[-2:] != (T, S):
        return "all" if mask.all() else None
    visible = mask.astype(bool)
    if visible.all():
        return "all"
    causal = np.arange(S)[None, :] <= np.arange(T)[:, None]
    return "causal" if np.array_equal(visible, np.broadcast_to(causal, visible.shape)) else None


def _stock(query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
           deterministic, dtype, precision, module, *, is_causal, force_fp32_for_softmax,
           qk_attn_weights_einsum, attn_weights_value_einsum, **kwargs):
    """The stock flax computation of the same call (see attention_fn's docstring for which)."""
    positional = (query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
                  deterministic, dtype, precision, module)
    linen_only = (force_fp32_for_softmax or qk_attn_weights_einsum is not None
                  or attn_weights_value_einsum is not None)
    if not (isinstance(module, linen.Module) or linen_only):
        return nnx.dot_product_attention(*positional, is_causal=is_causal, **kwargs)

    # flax.linen's function has no is_causal and no GQA: fold them in first.
    if is_causal:
        T, S = query.shape[-3], key.shape[-3]
        causal = np.arange(S)[None, :] <= np.arange(T)[:, None]
        causal = causal.reshape((1,) * (query.ndim - 2) + (T, S))
        mask = causal if mask is None else linen.combine_masks(mask, causal)
    groups = query.shape[-2] // key.shape[-2]
    if groups > 1:
        key, value = (x.repeat(groups, axis=-2) for x in (key, value))
    return linen.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision, module, force_fp32_for_softmax=force_fp32_for_softmax,
        qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum, **kwargs,
    )
