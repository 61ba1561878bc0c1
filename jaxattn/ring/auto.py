"""Ring attention picked by the partitioner: ``flash_attention`` on sequence-sharded inputs.

Under ``jax.jit``, when the query's ``T`` and the key/value's ``S`` are
sharded over the same mesh axes, jaxattn/sharding.py runs the function of
``forward_rule(plan)`` / ``backward_rule(plan)`` on every device, with those
mesh axes bound (inside the ``custom_partitioning`` partition callback, or a
``shard_map`` on Explicit meshes): the ring of ring_attention.py over them.

Token order. An array in natural order, sharded along the sequence, gives
device ``d`` the contiguous tokens ``[d*T/P, (d+1)*T/P)``. Without a causal
mask the ring runs on them as they are. With ``is_causal`` contiguous chunks
are unbalanced (device ``P-1`` has ``P`` blocks to attend, device ``0`` one),
so when the local length is even the inputs first move to the zig-zag order
(``to_zigzag``: each device keeps or sends each half of its tokens, two
collective-permutes per array, no gather), the balanced zig-zag ring runs,
and the results move back (``from_zigzag``). This costs one half-shard of
traffic per array and pass (forward: q, k, v in, out and lse back; backward:
q, k, v, out, lse, dout, dlse in, dq, dk, dv back), a few percent of the
ring's own traffic and compute at long lengths. An odd local length runs the
unbalanced contiguous causal ring (correct, slower).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..sharding import SequenceRule
from .ring_attention import _backward as _ring_backward
from .ring_attention import _forward as _ring_forward
from .ring_attention import _Ring


def _holder(chunk: int, P: int) -> int:
    """The device holding `chunk` (of 2P) in zig-zag order."""
    return chunk if chunk < P else 2 * P - 1 - chunk


def _halves(x):
    c = x.shape[1] // 2
    return x[:, :c], x[:, c:]


def to_zigzag(x, axis_name, P: int):
    """This device's contiguous shard of ``x`` ([B, L, ...], L even: natural
    chunks ``2d, 2d+1`` of ``2P``) -> its zig-zag shard (chunks ``d, 2P-1-d``).

    Inside a context that binds `axis_name` (shard_map, or the partitioner's
    per-device function); two collective-permutes."""
    first, second = _halves(x)
    even = jax.lax.ppermute(first, axis_name, [(d, _holder(2 * d, P)) for d in range(P)])
    odd = jax.lax.ppermute(second, axis_name, [(d, _holder(2 * d + 1, P)) for d in range(P)])
    own_even = jax.lax.axis_index(axis_name) % 2 == 0  # zig-zag chunk d is even when d is
    return jnp.concatenate([jnp.where(own_even, even, odd), jnp.where(own_even, odd, even)], axis=1)


def from_zigzag(x, axis_name, P: int):
    """Inverse of `to_zigzag`: this device's zig-zag shard -> its contiguous shard."""
    a, b = _halves(x)  # chunks d and 2P-1-d
    own_even = jax.lax.axis_index(axis_name) % 2 == 0
    even, odd = jnp.where(own_even, a, b), jnp.where(own_even, b, a)
    # Chunk c belongs to device c // 2 in natural order.
    chunks = [(d, 2 * P - 1 - d) if d % 2 == 0 else (2 * P - 1 - d, d) for d in range(P)]
    first = jax.lax.ppermute(even, axis_name, [(d, c[0] // 2) for d, c in enumerate(chunks)])
    second = jax.lax.ppermute(odd, axis_name, [(d, c[1] // 2) for d, c in enumerate(chunks)])
    return jnp.concatenate([first, second], axis=1)


def _why_not(plan) -> str:
    """Why ring attention cannot run `plan` ("" when it can)."""
    features = [name for name, on in (
        ("local_window_size", plan.window is not None),
        ("query/key_value_seq_lengths", plan.has_lengths),
        ("logits_soft_cap", plan.softcap is not None),
        ("segment ids", plan.has_segments),
        ("bias", plan.bias_kind is not None),
        ("mask", plan.mask_kind is not None),
    ) if on]
    return f"ring attention does not take {', '.join(features)}" if features else ""


def _setup(plan, axes, seqlen_q: int, seqlen_kv: int):
    """(ring, balanced): the ring over `axes` for these local lengths; `balanced`
    when the causal inputs are moved to the zig-zag order around it."""
    axis_name = axes[0] if len(axes) == 1 else tuple(axes)
    P = int(jax.lax.axis_size(axis_name))
    if plan.is_causal and seqlen_q != seqlen_kv:
        raise NotImplementedError(
            f"jaxattn.flash_attention: is_causal with the sequence sharded over mesh axis "
            f"{', '.join(map(repr, axes))} (ring attention) needs as many queries as keys, got "
            f"T={seqlen_q * P} and S={seqlen_kv * P}; replicate the sequence dimension."
        )
    balanced = plan.is_causal and P > 1 and seqlen_q % 2 == 0
    ring = _Ring(axis_name=axis_name, size=P, layout="zigzag" if balanced else "contiguous",
                       seqlen_q=seqlen_q, seqlen_kv=seqlen_kv, plan=plan)
    return ring, balanced


def _forward(plan, axes, q, k, v):
    ring, balanced = _setup(plan, axes, q.shape[1], k.shape[1])
    if balanced:
        q, k, v = (to_zigzag(x, ring.axis_name, ring.size) for x in (q, k, v))
    out, lse = _ring_forward(ring, q, k, v)
    if balanced:
        out, lse = (from_zigzag(x, ring.axis_name, ring.size) for x in (out, lse))
    return out, lse


def _backward(plan, axes, q, k, v, out, lse, dout, dlse):
    ring, balanced = _setup(plan, axes, q.shape[1], k.shape[1])
    args = (q, k, v, out, lse, dout, dlse)
    if balanced:
        args = tuple(to_zigzag(x, ring.axis_name, ring.size) for x in args)
    grads = _ring_backward(ring, *args)
    if balanced:
        grads = tuple(from_zigzag(x, ring.axis_name, ring.size) for x in grads)
    return grads


def _rule(plan, fn) -> SequenceRule:
    why = _why_not(plan)
    if why:
        return SequenceRule(None, why)
    return SequenceRule(lambda axes: functools.partial(fn, plan, tuple(axes)))


@functools.lru_cache(maxsize=256)
def forward_rule(plan) -> SequenceRule:
    """The sequence-sharded forward of `plan`: ``(q, k, v) -> (out, lse)`` per device."""
    return _rule(plan, _forward)


@functools.lru_cache(maxsize=256)
def backward_rule(plan) -> SequenceRule:
    """The sequence-sharded backward of `plan`: ``(q, k, v, out, lse, dout, dlse) -> (dq, dk, dv)``."""
    return _rule(plan, _backward)
