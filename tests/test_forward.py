"""Forward pass and logsumexp residual against the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
import reference64
from conftest import (IMPLS, assert_close, device_for, dtypes_for, plain_attention,
                      poison_allocator, random_inputs)


def check_forward(impl, B, T, S, N, K, H, dtype, is_causal, scale=None):
    dev = device_for(impl)
    q, k, v = random_inputs((B, T, N, H), (B, S, K, H), dtype, device=dev)
    scale_val = scale if scale is not None else 1.0 / np.sqrt(H)
    poison_allocator(dev, 2 * q.size * q.dtype.itemsize + 4 * B * T * N)
    fn = jax.jit(lambda q, k, v: jaxattn.flash_attention(
        q, k, v, scale=scale, is_causal=is_causal, return_residual=True, implementation=impl))
    out, lse = fn(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (B, T, N) and lse.dtype == jnp.float32
    ref_out, ref_lse = reference64.forward(q, k, v, scale=scale_val, is_causal=is_causal)
    plain = plain_attention(q, k, v, scale=scale_val, is_causal=is_causal)
    assert_close("out", out, plain, ref_out, dtype)
    lse = np.asarray(lse, np.float64)
    assert np.all(np.isfinite(lse)), "lse has non-finite values"
    tol = (2e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-4) * (1 + np.abs(ref_lse))
    assert np.all(np.abs(lse - ref_lse) <= tol), f"lse error {np.max(np.abs(lse - ref_lse)):.3g}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("T,S", [(1, 1), (7, 7), (129, 129), (1000, 1000), (1, 129), (7, 1000), (129, 7), (1000, 33)])
def test_lengths(impl, T, S, is_causal):
    for dtype in dtypes_for(impl):
        check_forward(impl, 2, T, S, 4, 2, 64, dtype, is_causal)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("H", [8, 16, 40, 64, 96, 128, 136, 192, 256])
def test_head_dims(impl, H):
    for dtype in dtypes_for(impl):
        check_forward(impl, 1, 129, 77, 2, 1, H, dtype, is_causal=True)


@pytest.mark.parametrize("H", [1, 3, 13, 250])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_odd_head_dims(H, dtype):
    check_forward("cpu", 1, 33, 65, 2, 1, H, dtype, is_causal=False)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (8, 2), (8, 1), (16, 2)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa(impl, N, K, is_causal):
    dtype = jnp.float32 if impl == "cpu" else jnp.bfloat16
    check_forward(impl, 2, 65, 97, N, K, 64, dtype, is_causal)
    check_forward(impl, 1, 65, 97, N, K, 64, jnp.bfloat16, is_causal)


@pytest.mark.parametrize("impl", IMPLS)
def test_custom_scale(impl):
    check_forward(impl, 1, 50, 60, 2, 2, 32, dtypes_for(impl)[0], is_causal=False, scale=0.37)


@pytest.mark.parametrize("impl", IMPLS)
def test_unbatched(impl):
    dev = device_for(impl)
    q, k, v = random_inputs((33, 4, 32), (41, 2, 32), jnp.bfloat16, device=dev)
    out, lse = jaxattn.flash_attention(q, k, v, return_residual=True, implementation=impl)
    assert out.shape == (33, 4, 32) and lse.shape == (33, 4)
    batched = jaxattn.flash_attention(q[None], k[None], v[None], implementation=impl)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(batched[0], np.float32))


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
def test_matches_jax_nn(impl):
    """Same answer as jax.nn.dot_product_attention, causal semantics included (T != S)."""
    dev = device_for(impl if impl != "reference" else "cpu")
    for T, S in [(40, 70), (70, 40)]:
        q, k, v = random_inputs((2, T, 4, 32), (2, S, 2, 32), jnp.float32 if impl in ("cpu", "reference") else jnp.float16, device=dev)
        for causal in (False, True):
            ours = jaxattn.flash_attention(q, k, v, is_causal=causal, implementation=impl)
            theirs = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
            tol = 1e-5 if q.dtype == jnp.float32 else 2e-3
            np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), atol=tol, rtol=tol)


def test_reference_implementation():
    check_forward("reference", 2, 31, 45, 4, 2, 16, jnp.float32, True)
    check_forward("reference", 2, 31, 45, 4, 2, 16, jnp.bfloat16, False)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_queries(impl):
    dev = device_for(impl)
    q, k, v = random_inputs((2, 0, 4, 32), (2, 5, 2, 32), jnp.bfloat16, device=dev)
    out, lse = jaxattn.flash_attention(q, k, v, return_residual=True, implementation=impl)
    assert out.shape == (2, 0, 4, 32) and lse.shape == (2, 0, 4)
