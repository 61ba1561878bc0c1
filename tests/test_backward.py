"""Gradients (dq, dk, dv, through out and lse) against the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
import reference64
from conftest import (IMPLS, assert_close, device_for, dtypes_for, gpu, plain_attention,
                      poison_allocator, random_inputs)


def check_backward(impl, B, T, S, N, K, H, dtype, is_causal, with_lse=False):
    dev = device_for(impl)
    q, k, v, dout = random_inputs((B, T, N, H), (B, S, K, H), dtype, device=dev, count=4)
    scale = 1.0 / np.sqrt(H)
    dlse = jax.device_put(jnp.asarray(np.random.default_rng(T * S + H).standard_normal((B, T, N)), jnp.float32), dev)

    def loss(q, k, v):
        out, lse = jaxattn.flash_attention(q, k, v, is_causal=is_causal, return_residual=True, implementation=impl)
        total = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
        return total + (jnp.sum(lse * dlse) if with_lse else 0.0)

    poison_allocator(dev, 4 * q.size * 4)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    refs = reference64.backward(q, k, v, dout, scale=scale, is_causal=is_causal,
                                dlse=np.asarray(dlse) if with_lse else None)

    def plain_loss(q, k, v):
        # Gradients of attention computed entirely in the input dtype.
        out = plain_attention(q, k, v, scale=scale, is_causal=is_causal)
        return jnp.sum(out * dout)

    if with_lse:
        # Plain attention has no lse: the yardstick is the reference rounded to the dtype.
        plain_grads = tuple(jnp.asarray(r, dtype) for r in refs)
    else:
        plain_grads = jax.grad(plain_loss, argnums=(0, 1, 2))(q, k, v)
    for name, g, x, pg, r in zip(("dq", "dk", "dv"), grads, (q, k, v), plain_grads, refs):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert_close(name, g, jnp.asarray(pg), r, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("T,S", [(1, 1), (7, 7), (129, 129), (1000, 1000), (7, 129), (129, 7)])
def test_lengths(impl, T, S, is_causal):
    for dtype in dtypes_for(impl):
        check_backward(impl, 2, T, S, 4, 2, 64, dtype, is_causal)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("H", [8, 40, 64, 128, 256])
def test_head_dims(impl, H):
    for dtype in dtypes_for(impl):
        check_backward(impl, 1, 97, 65, 2, 1, H, dtype, is_causal=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("N,K", [(4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa(impl, N, K, is_causal):
    check_backward(impl, 2, 65, 97, N, K, 64, jnp.bfloat16, is_causal)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("N,K", [(8, 8), (16, 8)])
def test_tail_split_mixed_grid(H, N, K):
    """More key-block units than an H100 / H200 has SMs, with a remainder (160 units of
    128 keys on 132 SMs: 132 run whole, the last 28 are cut into query-range slices whose
    dK / dV go through the f32 partial sums, cuda/sm90/bwd_tail.cuh), a partial last key
    block and T not a multiple of the 64-row query blocks: the Hopper backward's mixed grid."""
    check_backward("cuda", 2, 1200, 1200, N, K, H, jnp.bfloat16, False)


@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_through_lse(impl):
    check_backward(impl, 2, 33, 47, 4, 2, 32, dtypes_for(impl)[-1], is_causal=True, with_lse=True)


def test_cpu_odd_head_dim_grad():
    check_backward("cpu", 1, 20, 30, 2, 1, 13, jnp.float32, is_causal=False)


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_flag(impl):
    """deterministic=True gives the same gradients as the default (bit-identical runs are
    checked on the GPU in test_gpu.py; the CPU kernel is deterministic either way)."""
    dtype = dtypes_for(impl)[-1]
    q, k, v = random_inputs((2, 65, 4, 64), (2, 70, 2, 64), dtype, device=device_for(impl))

    def grads(det):
        return jax.grad(lambda q, k, v: jnp.sum(jaxattn.flash_attention(
            q, k, v, is_causal=True, implementation=impl, deterministic=det).astype(jnp.float32) ** 2),
            argnums=(0, 1, 2))(q, k, v)

    for a, b in zip(grads(True), grads(False)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
