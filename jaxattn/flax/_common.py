"""The math the linen and nnx attention modules share: shapes, rotary embeddings, the forward.

Both modules only create parameters (their own way) and call
``multi_head_attention`` with them, so the two compute exactly the same
function of the same named parameters:

    query_kernel  [in_features, num_heads, head_dim]
    key_kernel    [in_features, num_kv_heads, head_dim]
    value_kernel  [in_features, num_kv_heads, head_dim]
    out_kernel    [num_heads, head_dim, out_features]
    query_bias, key_bias, value_bias [heads, head_dim], out_bias [out_features]
                  (only with use_bias=True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from ..attention import flash_attention

PROJECTIONS = ("query", "key", "value", "out")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Validated sizes and options of one multi-head attention layer."""

    in_features: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    out_features: int
    is_causal: bool
    rope_theta: float | None
    use_bias: bool
    local_window_size: tuple[int, int] | None = None  # (left, right), as flash_attention's
    logits_soft_cap: float | None = None

    @classmethod
    def create(cls, *, in_features, num_heads, num_kv_heads=None, head_dim=None,
               out_features=None, is_causal=False, rope_theta=None, use_bias=False,
               local_window_size=None, logits_soft_cap=None) -> "AttentionConfig":
        """Fills the defaults (num_kv_heads=num_heads, head_dim=in_features//num_heads,
        out_features=in_features) and raises ValueError on inconsistent sizes or options."""
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None:
            if in_features % num_heads != 0:
                raise ValueError(
                    f"in_features={in_features} is not a multiple of num_heads={num_heads}: pass head_dim"
                )
            head_dim = in_features // num_heads
        for name, value in (("in_features", in_features), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if rope_theta is not None:
            if head_dim % 2 != 0:
                raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
            if not rope_theta > 0:
                raise ValueError(f"rope_theta must be positive (or None for no rotary embeddings), got {rope_theta}")
            rope_theta = float(rope_theta)
        window = local_window_size
        if window is not None:
            window = (window, window) if isinstance(window, int) else tuple(window)
            if len(window) != 2 or not all(isinstance(w, int) and w >= 0 for w in window):
                raise ValueError(
                    f"local_window_size must be a non-negative int or a (left, right) pair of them, "
                    f"got {local_window_size!r}")
        if logits_soft_cap is not None:
            if not isinstance(logits_soft_cap, (int, float)) or not logits_soft_cap > 0:
                raise ValueError(f"logits_soft_cap must be a positive float or None, got {logits_soft_cap!r}")
            logits_soft_cap = float(logits_soft_cap)
        return cls(in_features=in_features, num_heads=num_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, out_features=in_features if out_features is None else out_features,
                   is_causal=bool(is_causal), rope_theta=rope_theta, use_bias=bool(use_bias),
                   local_window_size=window, logits_soft_cap=logits_soft_cap)

    def mask_kwargs(self) -> dict:
        """The attention options beyond is_causal, as flash_attention keywords (only those set)."""
        kw = {}
        if self.local_window_size is not None:
            kw["local_window_size"] = self.local_window_size
        if self.logits_soft_cap is not None:
            kw["logits_soft_cap"] = self.logits_soft_cap
        return kw

    def kernel_shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``{name}_kernel`` for name in PROJECTIONS."""
        heads = {"query": self.num_heads, "key": self.num_kv_heads, "value": self.num_kv_heads}
        if name == "out":
            return (self.num_heads, self.head_dim, self.out_features)
        return (self.in_features, heads[name], self.head_dim)

    def bias_shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``{name}_bias`` for name in PROJECTIONS."""
        return self.kernel_shape(name)[-1:] if name == "out" else self.kernel_shape(name)[1:]


def kernel_axes_for(name: str, kernel_axes: tuple[str | None, str | None, str | None] | None):
    """Logical axis names of ``{name}_kernel`` and ``{name}_bias`` from the
    (embed, heads, head_dim) names of the query/key/value kernels, or (None, None)."""
    if kernel_axes is None:
        return None, None
    if len(kernel_axes) != 3:
        raise ValueError(f"kernel_axes must name 3 axes (embed, heads, head_dim), got {kernel_axes!r}")
    embed, heads, head_dim = kernel_axes
    if name == "out":
        return (heads, head_dim, embed), (embed,)
    return (embed, heads, head_dim), (heads, head_dim)


def default_kernel_init(fan_in_axes: int):
    """LeCun-normal over the first ``fan_in_axes`` axes (the contracted ones)."""
    return jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=tuple(range(fan_in_axes)),
        out_axis=-1, batch_axis=(),
    )


def fan_in_axes(name: str) -> int:
    """How many leading axes of ``{name}_kernel`` are contracted with the input."""
    return 2 if name == "out" else 1


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (RoPE, rotate-half convention as in GPT-NeoX / LLaMA).

    x: [batch..., T, heads, head_dim]; positions: [batch..., T] (or [T]),
    integers or floats. Angles are computed in float32; returns x's dtype.
    """
    head_dim = x.shape[-1]
    half = head_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch..., T, half]
    cos = jnp.cos(angles)[..., None, :]  # broadcast over heads
    sin = jnp.sin(angles)[..., None, :]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attend(q, k, v, *, is_causal: bool, attention_fn: Callable | None = None, segment_ids=None, **options):
    """Attention over [batch..., T, heads, head_dim] arrays with any number of
    batch dims (flattened to one around the call).

    attention_fn(q, k, v, is_causal=..., **options) takes [B, T, N, H] arrays;
    None is ``jaxattn.flash_attention``. ``jax.nn.dot_product_attention``
    (optionally with ``functools.partial(..., implementation="cudnn")``) fits
    too when no jaxattn-only option (soft cap, segment ids) is used.
    segment_ids [batch..., T]: self-attention within each segment (packed
    documents), passed as both q_segment_ids and kv_segment_ids.
    """
    fn = flash_attention if attention_fn is None else attention_fn
    batch = q.shape[:-3]
    flat = lambda x: x.reshape((math.prod(batch), *x.shape[-3:]))
    if segment_ids is not None:
        seg = jnp.broadcast_to(jnp.asarray(segment_ids), (*batch, q.shape[-3])).reshape(math.prod(batch), -1)
        options = dict(options, q_segment_ids=seg, kv_segment_ids=seg)
    out = fn(flat(q), flat(k), flat(v), is_causal=is_causal, **options)
    return out.reshape(q.shape)


def multi_head_attention(config: AttentionConfig, params: dict, x: jax.Array, *,
                         positions: jax.Array | None = None, segment_ids: jax.Array | None = None, dtype=None,
                         attention_fn: Callable | None = None) -> jax.Array:
    """Self-attention of x [batch..., T, in_features] -> [batch..., T, out_features].

    params maps "{name}_kernel" (and "{name}_bias" with use_bias) to arrays,
    see the module docstring. Everything is computed in ``dtype`` (default:
    the promoted dtype of x and the params); rotary embeddings, when
    ``config.rope_theta`` is set, rotate q and k by ``positions`` (default
    0..T-1) before the attention. ``segment_ids`` [batch..., T] (int32)
    restricts attention to tokens of the same segment (packed documents;
    per-document causal with is_causal); the config's window and soft cap
    apply too.
    """
    q, k, v, p = project_qkv(config, params, x, dtype=dtype)
    if config.rope_theta is not None:
        if positions is None:
            positions = jnp.arange(x.shape[-2])
        q = rotary_embedding(q, positions, config.rope_theta)
        k = rotary_embedding(k, positions, config.rope_theta)
    o = attend(q, k, v, is_causal=config.is_causal, attention_fn=attention_fn, segment_ids=segment_ids,
               **config.mask_kwargs())
    return project_out(config, p, o)


def project_qkv(config: AttentionConfig, params: dict, x: jax.Array, *, dtype=None):
    """(q, k, v, params cast to the computation dtype) from x [batch..., T, in_features]."""
    if x.shape[-1] != config.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the layer expects {config.in_features}")
    if dtype is None:
        dtype = jnp.result_type(x, *params.values())
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.float32
    x = x.astype(dtype)
    p = {name: value.astype(dtype) for name, value in params.items()}

    def project(name):
        y = jnp.einsum("...d,dnh->...nh", x, p[f"{name}_kernel"])
        return y + p[f"{name}_bias"] if config.use_bias else y

    return project("query"), project("key"), project("value"), p


def project_out(config: AttentionConfig, p: dict, o: jax.Array) -> jax.Array:
    """The output projection of o [batch..., T, heads, head_dim] (params from project_qkv)."""
    out = jnp.einsum("...nh,nhf->...f", o, p["out_kernel"])
    return out + p["out_bias"] if config.use_bias else out
