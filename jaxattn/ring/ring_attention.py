"""jaxattn.ring_attention: attention over a sequence sharded along a mesh axis.

Called inside ``jax.shard_map``: each of the ``P`` devices of ``axis_name``
holds ``T/P`` queries and ``S/P`` keys/values. The key/value blocks travel
around the ring with ``jax.lax.ppermute`` (device ``i`` sends to ``i + 1``);
at step ``s`` device ``r`` attends its queries to the block of device
``(r - s) mod P`` with jaxattn's per-device kernel and merges the partial
results by logsumexp (blocks.py). The next block's ``ppermute`` is issued
before the current block's kernel call, so the two are independent and XLA
can overlap them.

The backward is a ``custom_vjp`` ring too: the key/value blocks make the
same trip, each followed one step behind by its float32 ``(dk, dv)``
accumulator, to which every device adds its block gradients (computed while
the accumulator is in flight) before passing it on; one more hop brings the
accumulator home. ``dq`` accumulates locally. The residuals
are the local ``q, k, v, out, lse``, and the ring steps run in a
``fori_loop`` that holds two key/value blocks at a time, so memory per device
stays O(T/P) for any ``P``.

Which sub-blocks a step computes (all, none, or parts, with or without the
causal mask) comes from layout.step_blocks; with a causal mask the choice
depends on whether the block held precedes the device's own (``s <= r``), a
per-device ``lax.cond``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .. import dispatch, remat
from .._validation import check_inputs
from ..attention import _Plan
from . import blocks
from .layout import LAYOUTS, step_blocks


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of one ring call (a custom_vjp non-differentiable argument)."""

    axis_name: str | tuple[str, ...]
    size: int  # P, devices along axis_name
    layout: str
    seqlen_q: int  # local T/P
    seqlen_kv: int  # local S/P
    plan: _Plan
    # False: every transfer waits for the previous step's kernels (nothing
    # overlaps), to measure what the overlap saves.
    overlap: bool = True

    def blocks(self, held: str):
        return step_blocks(self.layout, self.plan.is_causal, self.seqlen_q, self.seqlen_kv, held)

    def send(self, x):
        """Each device's `x` to the next device of the ring."""
        perm = [(i, (i + 1) % self.size) for i in range(self.size)]
        return jax.lax.ppermute(x, self.axis_name, perm)

    def per_step(self, step, fn, *operands):
        """``fn(blocks, *operands)`` with this device's blocks of `step` (>= 1)."""
        earlier, later = self.blocks("earlier"), self.blocks("later")
        if earlier == later:
            return fn(earlier, *operands)
        # The block held is device (r - step)'s: it precedes ours when step <= r.
        r = jax.lax.axis_index(self.axis_name)
        return jax.lax.cond(step <= r, lambda *a: fn(earlier, *a), lambda *a: fn(later, *a), *operands)


def _ring_loop(ring: _Ring, kv, first, step_fn):
    """``state = first()`` on the own key/value block `kv`, then ``state =
    step_fn(step, kv, state)`` for steps 1..P-1 with the block received during
    the previous step (its ppermute issued before that step's kernels). Steps
    1..P-2 run in a fori_loop, which keeps two key/value blocks live."""
    P = ring.size
    if not ring.overlap:
        state = first()
        for step in range(1, P):
            kv, state = jax.lax.optimization_barrier((kv, state))  # the send waits for the kernels
            kv = ring.send(kv)
            state = step_fn(step, kv, state)
        return state
    nxt = ring.send(kv) if P > 1 else None
    state = first()
    if P == 1:
        return state

    def body(step, carry):
        kv, state = carry
        nxt = ring.send(kv)  # for step + 1
        return nxt, step_fn(step, kv, state)

    kv, state = jax.lax.fori_loop(1, P - 1, body, (nxt, state)) if P > 2 else (nxt, state)
    return step_fn(P - 1, kv, state)  # the last block: nothing more to send


def _forward(ring: _Ring, q, k, v):
    def first():
        return blocks.first(ring.plan, ring.blocks("own")[0], q, k, v)

    def step(s, kv, acc):
        return ring.per_step(s, lambda bl, kv, acc: blocks.attend(ring.plan, bl, q, *kv, acc), kv, acc)

    out, lse = _ring_loop(ring, (k, v), first, step)
    return out.astype(q.dtype), lse


def _backward(ring: _Ring, q, k, v, out, lse, dout, dlse):
    res = (q, out, lse, dout, dlse)

    def grads(bl, kv, dq):
        q, out, lse, dout, dlse = res
        return blocks.gradients(ring.plan, bl, q, kv[0], kv[1], out, lse, dout, dlse, dq)

    f32 = jnp.float32

    def first():
        dq, dk, dv = blocks.backward(ring.plan, ring.blocks("own")[0], q, k, v, out, lse, dout, dlse)
        return (dk.astype(f32), dv.astype(f32)), dq.astype(f32)

    def step(s, kv, state):
        dkv, dq = state
        if ring.overlap:
            # The previous block's accumulator travels on to where that block is
            # now; this step's kernels do not wait for it.
            arrived = ring.send(dkv)
            dq, new = ring.per_step(s, grads, kv, dq)
        else:
            dq, new = ring.per_step(s, grads, kv, dq)
            dkv, new = jax.lax.optimization_barrier((dkv, new))
            arrived = ring.send(dkv)
        return jax.tree.map(jnp.add, arrived, new), dq

    dkv, dq = _ring_loop(ring, (k, v), first, step)
    if ring.size > 1:
        dkv = ring.send(dkv)  # one more hop: the accumulator of our own block comes home
    dk, dv = dkv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v):
    return _forward(ring, q, k, v)


def _ring_fwd(ring, q, k, v):
    out, lse = remat.name_residuals(*_ring(ring, q, k, v))  # (jaxattn/remat.py)
    return (out, lse), (q, k, v, out, lse)


def _ring_bwd(ring, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    return _backward(ring, q, k, v, out, lse, dout.astype(q.dtype), dlse.astype(jnp.float32))


_ring.defvjp(_ring_fwd, _ring_bwd)


def _axis_size(axis_name) -> int:
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"ring_attention: axis_name must be a mesh axis name (str) or a tuple of them, "
                         f"got {axis_name!r}")
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"ring_attention: axis_name {axis_name!r} is not bound here ({e}); call ring_attention "
            "inside jax.shard_map over a mesh with that axis, with the sequence dimension of the "
            "query, key and value sharded over it, e.g. in_specs=PartitionSpec(None, "
            f"{axis_name!r})"
        ) from None


def ring_attention(
    query,
    key,
    value,
    *,
    axis_name,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    return_residual: bool = False,
    implementation: str | None = None,
    overlap_communication: bool = True,
):
    """Ring attention (context parallelism), called inside ``jax.shard_map``.

    The query's sequence dimension ``T`` and the key/value's ``S`` are
    sharded over the mesh axis `axis_name`: this device's arrays are
    ``query [B, T/P, N, H]`` and ``key``/``value`` ``[B, S/P, K, H]`` (or
    unbatched ``[T/P, N, H]`` ...), and the result is this device's rows of
    ``flash_attention`` over the whole sequence. Other mesh axes (batch,
    heads) may shard the other dimensions as usual.

    Args:
      query, key, value: this device's shards, as for ``flash_attention``
        (bfloat16, float16 or float32; GQA/MQA with ``N % K == 0``).
      axis_name: the mesh axis (or tuple of axes) the sequence is sharded
        over, bound by an enclosing ``jax.shard_map``.
      is_causal: causal mask over the global positions (query ``i`` sees keys
        ``j <= i``); needs ``T == S``.
      scale: static float, default ``1/sqrt(H)``.
      layout: the token order of the sharded sequence: ``"contiguous"``
        (device ``d`` holds the ``d``-th block of ``T/P`` tokens) or
        ``"zigzag"`` (device ``d`` holds chunks ``d`` and ``2P-1-d`` of ``2P``
        chunks: see ``jaxattn.ring.zigzag_permute``), which balances the
        causal work across devices; it needs an even local length.
      return_residual: also return this device's rows of the logsumexp
        (natural log, float32 ``[B, T/P, N]``).
      implementation: as for ``flash_attention`` (the per-block kernel).
      overlap_communication: ``True`` (default) issues each step's transfers
        before its kernels so that they overlap; ``False`` makes every
        transfer wait for the previous step's kernels (same results; for
        measuring what the overlap saves, e.g. benchmarks/ring.py).

    Raises ``ValueError`` for an unbound `axis_name`, an unknown `layout`,
    causal attention with ``T != S``, or an odd local length with
    ``"zigzag"``; the usual ``flash_attention`` errors for bad arrays.
    """
    spec = check_inputs(query, key, value, scale=scale, is_causal=is_causal, implementation=implementation)
    dispatch.check_forced(spec, implementation)
    P = _axis_size(axis_name)
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention: layout must be one of {LAYOUTS}, got {layout!r}")
    Tl, Sl = spec.seqlen_q, spec.seqlen_k
    if spec.is_causal and Tl != Sl:
        raise ValueError(
            f"ring_attention: is_causal needs as many queries as keys per device, got {Tl} queries "
            f"and {Sl} keys/values on each of the {P} devices of axis {axis_name!r}"
        )
    if layout == "zigzag" and (Tl % 2 or Sl % 2):
        raise ValueError(
            f"ring_attention: layout='zigzag' holds two equal chunks per device, so the local "
            f"sequence lengths must be even (the global length divisible by 2 * {P} = {2 * P}), "
            f"got {Tl} queries and {Sl} keys/values per device on axis {axis_name!r}"
        )
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    if spec.batch == 0 or Tl == 0:
        out, lse = query * 0, jnp.zeros(query.shape[:-1], jnp.float32)
    else:
        plan = _Plan(scale=spec.scale, is_causal=spec.is_causal, implementation=implementation,
                     cuda_ok=dispatch.cuda_unsupported_reason(spec) is None)
        ring = _Ring(axis_name=axis_name, size=P, layout=layout, seqlen_q=Tl, seqlen_kv=Sl, plan=plan,
                     overlap=bool(overlap_communication))
        out, lse = _ring(ring, query, key, value)
    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_residual else out
