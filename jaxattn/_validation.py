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
    # Local window (left, right), None for none; and whether per-batch
    # query / key-value lengths were given (their values may be traced).
    window: tuple[int, int] | None = None
    has_q_lengths: bool = False
    has_kv_lengths: bool = False
    softcap: float | None = None  # logits_soft_cap
    has_segments: bool = False  # q_segment_ids / kv_segment_ids (always both)
    # Shapes of the dense bias / mask, left-padded to rank 4 (broadcastable
    # to [B, N, T, S]); None when absent.
    bias_shape: tuple[int, int, int, int] | None = None
    mask_shape: tuple[int, int, int, int] | None = None

    @property
    def masked(self) -> bool:
        """Uses an option beyond is_causal (window, lengths, segments, soft cap, bias or mask)."""
        return bool(self.mask_features())

    @property
    def mask_kind(self) -> int:
        """0: no mask option; 1: window / lengths / segments / soft cap only; 2: a
        dense bias or mask too (the CUDA dispatch rule's cue)."""
        if self.bias_shape is not None or self.mask_shape is not None:
            return 2
        return 1 if self.masked else 0

    def mask_features(self) -> list[str]:
        names = []
        if self.window is not None:
            names.append("local_window_size")
        if self.has_q_lengths:
            names.append("query_seq_lengths")
        if self.has_kv_lengths:
            names.append("key_value_seq_lengths")
        if self.softcap is not None:
            names.append("logits_soft_cap")
        if self.has_segments:
            names.append("q_segment_ids/kv_segment_ids")
        if self.bias_shape is not None:
            names.append("bias")
        if self.mask_shape is not None:
            names.append("mask")
        return names

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


def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def static_window(local_window_size) -> tuple[int, int] | None:
    """local_window_size as (left, right) Python ints >= 0, or None."""
    w = local_window_size
    if w is None:
        return None
    if _is_int(w):
        w = (w, w)
    if not isinstance(w, (tuple, list)) or len(w) != 2 or not all(_is_int(x) for x in w):
        raise ValueError(
            "local_window_size must be None, a Python int or a (left, right) tuple of Python ints, "
            f"got {local_window_size!r}"
        )
    left, right = int(w[0]), int(w[1])
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size must be non-negative, got {(left, right)}")
    if left > 2**31 - 1 or right > 2**31 - 1:
        raise ValueError(f"local_window_size is too large, got {(left, right)}")
    return left, right


def static_softcap(cap) -> float | None:
    """logits_soft_cap as a positive finite Python float, or None."""
    if cap is None:
        return None
    if isinstance(cap, jax.core.Tracer) or isinstance(cap, jax.Array):
        raise ValueError("logits_soft_cap must be a static Python float, got a traced or device array")
    if isinstance(cap, (bool, np.bool_)) or not isinstance(cap, numbers.Real):
        raise ValueError(f"logits_soft_cap must be a static Python float, got {type(cap).__name__}")
    value = float(cap)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"logits_soft_cap must be positive and finite, got {value}")
    return value


def _check_lengths(name: str, x, batch: int, unbatched: bool) -> None:
    if x is None:
        return
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an int32 array of shape [B], got {type(x).__name__}")
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        raise ValueError(f"{name} must be int32, got {jnp.dtype(x.dtype)}")
    ok = tuple(x.shape) in (((), (1,)) if unbatched else ((batch,),))
    if not ok:
        want = "() or (1,) for an unbatched query" if unbatched else f"({batch},) (the batch size)"
        raise ValueError(f"{name} must have shape {want}, got {_shape(x)}")


def _check_segments(q_ids, kv_ids, B: int, T: int, S: int, unbatched: bool) -> bool:
    """Validates q_segment_ids [B, T] / kv_segment_ids [B, S]; True when given."""
    if q_ids is None and kv_ids is None:
        return False
    if q_ids is None or kv_ids is None:
        raise ValueError("q_segment_ids and kv_segment_ids must be given together (or neither)")
    for name, x, L, what in (("q_segment_ids", q_ids, T, "T"), ("kv_segment_ids", kv_ids, S, "S")):
        want = (L,) if unbatched else (B, L)
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an int32 array of shape {list(want)}, got {type(x).__name__}")
        if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
            raise ValueError(f"{name} must be int32, got {jnp.dtype(x.dtype)}")
        if tuple(x.shape) != want:
            shape = f"[{what}]" if unbatched else f"[B, {what}]"
            raise ValueError(f"{name} must have shape {shape} = {want}, got {_shape(x)}")
    return True


def _check_dense(name: str, x, target: tuple[int, ...], kind: str) -> tuple[int, int, int, int] | None:
    """Validates a dense bias / mask broadcastable to `target` ([B, N, T, S], or
    [N, T, S] unbatched); returns its shape left-padded to rank 4."""
    if x is None:
        return None
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    dtype = jnp.dtype(x.dtype)
    if kind == "float" and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {dtype}")
    if kind == "bool" and dtype != jnp.dtype(jnp.bool_):
        raise ValueError(f"{name} must be a bool array (True = attend), got {dtype}")
    shape = tuple(x.shape)
    ok = len(shape) <= len(target) and all(
        d in (1, t) for d, t in zip(shape[::-1], target[::-1]))
    if not ok:
        dims = "[B, N, T, S]" if len(target) == 4 else "[N, T, S]"
        raise ValueError(f"{name} of shape {shape} does not broadcast to {dims} = {target}")
    return (1,) * (4 - len(shape)) + shape


def check_inputs(query, key, value, *, scale, is_causal, implementation, local_window_size=None,
                 query_seq_lengths=None, key_value_seq_lengths=None,
                 logits_soft_cap=None, q_segment_ids=None, kv_segment_ids=None, bias=None,
                 mask=None) -> AttentionSpec:
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
    window = static_window(local_window_size)
    if isinstance(query_seq_lengths, (list, tuple)) or isinstance(key_value_seq_lengths, (list, tuple)):
        raise ValueError("query_seq_lengths / key_value_seq_lengths must be int32 arrays, not lists")
    _check_lengths("query_seq_lengths", query_seq_lengths, B, query.ndim == 3)
    _check_lengths("key_value_seq_lengths", key_value_seq_lengths, B, query.ndim == 3)
    unbatched = query.ndim == 3
    has_segments = _check_segments(q_segment_ids, kv_segment_ids, B, T, S, unbatched)
    target = (N, T, S) if unbatched else (B, N, T, S)
    bias_shape = _check_dense("bias", bias, target, "float")
    mask_shape = _check_dense("mask", mask, target, "bool")
    return AttentionSpec(
        batch=B, seqlen_q=T, seqlen_k=S, num_heads=N, num_heads_k=K, head_dim=H,
        dtype=jnp.dtype(query.dtype), scale=static_scale(scale, H), is_causal=bool(is_causal),
        window=window, has_q_lengths=query_seq_lengths is not None,
        has_kv_lengths=key_value_seq_lengths is not None,
        softcap=static_softcap(logits_soft_cap), has_segments=has_segments,
        bias_shape=bias_shape, mask_shape=mask_shape,
    )
