"""One ring step's kernel calls, and the logsumexp algebra that combines them.

Forward: each `Block` (see layout.py) runs jaxattn's per-device forward
kernel, giving a partial ``(out_b, lse_b)`` over the keys of that block; the
partials merge by logsumexp into float32 accumulators.

Backward: with the *global* ``out`` and ``lse`` of the whole row, the
softmax probabilities of a block are ``p = exp(s - lse)`` and
``dS = p * (dP - D)`` with ``D = rowsum(dout * out) - dlse`` -- exactly what
the compiled backward kernels compute from the ``out``/``lse`` they are
given. So each block's backward is one kernel call on the block's keys with
the row's global residuals and cotangents, and the block gradients simply add
up. ``reference_block_backward`` is the same computation in pure JAX, for
the platforms (and ``implementation="reference"``) where no kernel runs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import attention
from .layout import Block


def _rows(x, rows: tuple[int, int]):
    """x[:, start:stop] (the sequence axis of [B, T, ...] arrays)."""
    start, stop = rows
    if (start, stop) == (0, x.shape[1]):
        return x
    return jax.lax.slice_in_dim(x, start, stop, axis=1)


def _put(x, rows: tuple[int, int], new):
    """x with rows start:stop replaced by `new`."""
    if rows == (0, x.shape[1]):
        return new
    return jax.lax.dynamic_update_slice_in_dim(x, new, rows[0], axis=1)


def _plan(plan, causal: bool):
    return plan if plan.is_causal == causal else dataclasses.replace(plan, is_causal=causal)


def attend(plan, blocks: tuple[Block, ...], q, k, v, acc):
    """Merges the partial attention of each block into ``acc = (out f32, lse f32)``."""
    for b in blocks:
        out, lse = attention.forward_kernel(_plan(plan, b.causal))(
            _rows(q, b.q), _rows(k, b.kv), _rows(v, b.kv))
        acc = merge(acc, b.q, out, lse)
    return acc


def first(plan, block: Block, q, k, v):
    """The accumulators from the step-0 block (which covers every query row)."""
    out, lse = attention.forward_kernel(_plan(plan, block.causal))(q, k, v)
    return out.astype(jnp.float32), lse


def merge(acc, rows, out, lse):
    """``acc`` with rows `rows` combined with a partial ``(out, lse)`` over other keys."""
    acc_out, acc_lse = acc
    a_out, a_lse = _rows(acc_out, rows), _rows(acc_lse, rows)
    new_lse = jnp.logaddexp(a_lse, lse)
    # Rows that see no key yet (lse -inf on both sides) stay 0 / -inf, no NaN.
    ref = jnp.where(jnp.isfinite(new_lse), new_lse, 0.0)
    wa = jnp.exp(a_lse - ref)[..., None]
    wb = jnp.exp(lse - ref)[..., None]
    new_out = wa * a_out + wb * out.astype(jnp.float32)
    return _put(acc_out, rows, new_out), _put(acc_lse, rows, new_lse)


def gradients(plan, blocks: tuple[Block, ...], q, k, v, out, lse, dout, dlse, dq):
    """``(dq, (dk, dv))``: the float32 accumulator ``dq`` plus each block's query
    gradients, and this step's float32 key/value gradients (all rows of the block
    held; zero where no block reaches)."""
    dk = jnp.zeros_like(k, jnp.float32)
    dv = jnp.zeros_like(v, jnp.float32)
    for b in blocks:
        bq, bk, bv = backward(plan, b, q, k, v, out, lse, dout, dlse)
        dq = _put(dq, b.q, _rows(dq, b.q) + bq.astype(jnp.float32))
        dk = _put(dk, b.kv, _rows(dk, b.kv) + bk.astype(jnp.float32))
        dv = _put(dv, b.kv, _rows(dv, b.kv) + bv.astype(jnp.float32))
    return dq, (dk, dv)


def backward(plan, b: Block, q, k, v, out, lse, dout, dlse):
    """One block's (dq rows b.q, dk rows b.kv, dv rows b.kv), in the inputs' dtypes."""
    kernel = attention.backward_kernel(_plan(plan, b.causal), reference_block_backward)
    qr = lambda x: _rows(x, b.q)  # noqa: E731
    return kernel(qr(q), _rows(k, b.kv), _rows(v, b.kv), qr(out), qr(lse), qr(dout), qr(dlse))


def reference_block_backward(q, k, v, out, lse, dout, dlse, *, scale: float, is_causal: bool,
                             window=None, softcap=None):
    """(dq, dk, dv) of attention over these keys, given the row's global out/lse (pure JAX).

    Unlike ``jax.vjp`` of the reference (which would normalise over these
    keys only), this takes the softmax statistics from `out` and `lse`, as
    the compiled backward kernels do.
    """
    if window is not None or softcap is not None:  # ring attention passes neither
        raise NotImplementedError("reference_block_backward: masks other than is_causal")
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    g = N // K
    hi = jax.lax.Precision.HIGHEST
    f32 = jnp.float32
    qg = q.reshape(B, T, K, g, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=f32, precision=hi) * f32(scale)
    lse_g = lse.reshape(B, T, K, g).transpose(0, 2, 3, 1)[..., None]  # [B, K, g, T, 1]
    p = jnp.where(jnp.isfinite(lse_g), jnp.exp(s - jnp.where(jnp.isfinite(lse_g), lse_g, 0.0)), 0.0)
    if is_causal:
        p = jnp.where(jnp.arange(S)[None, :] <= jnp.arange(T)[:, None], p, 0.0)
    do = dout.reshape(B, T, K, g, H)
    d = (jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1) - dlse.astype(f32))
    d = d.reshape(B, T, K, g).transpose(0, 2, 3, 1)[..., None]
    dp = jnp.einsum("btkgh,bskh->bkgts", do, v, preferred_element_type=f32, precision=hi)
    ds = p * (dp - d)
    dq = jnp.einsum("bkgts,bskh->btkgh", ds, k.astype(f32), precision=hi) * f32(scale)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, qg.astype(f32), precision=hi) * f32(scale)
    dv = jnp.einsum("bkgts,btkgh->bskh", p, do.astype(f32), precision=hi)
    return dq.reshape(B, T, N, H).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
