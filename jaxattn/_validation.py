"""Trace-time checks of flash_attention's arguments.

Everything here runs on shapes and dtypes only, so bad input raises a
ValueError naming the argument before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MAX_HEAD_DIM = 256
IMPLEMENTATIONS = (None, "cuda", "cuda_sm80", "cpu", "reference")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static description of one call (hashable: it parameterises custom_vjp)."""

    batch: int
    seqlen_q: int  # T
    seqlen_k: int  # S
    num_heads: int  # N
    num_heads_k: int  # K
    head_dim: int  # H
    dtype: jnp.dtype
    scale: float
    is_causal: bool

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_heads_k


def _shape(x) -> str:
    return str(tuple(x.shape))


def _check_array(name: str, x) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    dtype = jnp.dtype(x.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name} must be bfloat16, float16 or float32, got {dtype} with shape {_shape(x)}"
        )


def static_scale(scale, head_dim: int) -> float:
    """The softmax scale as a Python float: 1/sqrt(H) when None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, jax.core.Tracer) or isinstance(scale, jax.Array):
        raise ValueError(
            "scale must be a static Python float, got a traced or device array; "
            "pass a Python number (it becomes a kernel attribute)"
        )
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a static Python float, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def check_inputs(query, key, value, *, scale, is_causal, implementation) -> AttentionSpec:
    """Validates rank, shapes, dtypes and options; returns the call's spec.

    query is [B, T, N, H] (or unbatched [T, N, H]), key/value [B, S, K, H].
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_array(name, x)
    if query.ndim not in (3, 4):
        raise ValueError(
            f"query must have rank 4 [B, T, N, H] or rank 3 [T, N, H], got shape {_shape(query)}"
        )
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(
                f"{name} must have the query's rank {query.ndim}, got {name} shape {_shape(x)} "
                f"and query shape {_shape(query)}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    q = query.shape if query.ndim == 4 else (1, *query.shape)
    k = key.shape if key.ndim == 4 else (1, *key.shape)
    v = value.shape if value.ndim == 4 else (1, *value.shape)
    B, T, N, H = q
    if k != v:
        raise ValueError(
            f"key and value must have the same shape, got key {_shape(key)} and value {_shape(value)}"
        )
    if k[0] != B:
        raise ValueError(
            f"key batch size {k[0]} differs from query batch size {B} "
            f"(query {_shape(query)}, key {_shape(key)})"
        )
    if k[3] != H:
        raise ValueError(
            f"key head dim {k[3]} differs from query head dim {H} "
            f"(query {_shape(query)}, key {_shape(key)})"
        )
    S, K = k[1], k[2]
    if K == 0 or N % K != 0:
        raise ValueError(
            f"query heads N={N} must be a multiple of key/value heads K={K} "
            f"(query {_shape(query)}, key {_shape(key)})"
        )
    if H < 1:
        raise ValueError(f"head dim must be at least 1, got query shape {_shape(query)}")
    if H > MAX_HEAD_DIM:
        raise ValueError(
            f"head dim {H} is too large: at most {MAX_HEAD_DIM} (query shape {_shape(query)})"
        )
    if S < 1:
        raise ValueError(f"key/value sequence length must be at least 1, got key shape {_shape(key)}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise ValueError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    return AttentionSpec(
        batch=B, seqlen_q=T, seqlen_k=S, num_heads=N, num_heads_k=K, head_dim=H,
        dtype=jnp.dtype(query.dtype), scale=static_scale(scale, H), is_causal=bool(is_causal),
    )
