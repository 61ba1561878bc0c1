"""flash_attention under jit, vmap, grad, value_and_grad, checkpoint; residuals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from conftest import IMPLS, device_for, dtypes_for, random_inputs


def _ref(q, k, v, causal=False):
    return jaxattn.flash_attention(q, k, v, is_causal=causal, implementation="reference")


def _tol(dtype):
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_extra_batch_dims(impl):
    dtype = dtypes_for(impl)[-1]
    q, k, v = random_inputs((3, 2, 17, 4, 32), (3, 2, 23, 2, 32), dtype, device=device_for(impl))
    f = lambda q, k, v: jaxattn.flash_attention(q, k, v, is_causal=True, implementation=impl)
    out = jax.jit(jax.vmap(f))(q, k, v)
    ref = jax.vmap(lambda q, k, v: _ref(q, k, v, True))(q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=_tol(dtype), rtol=_tol(dtype))
    # Only the query batched: key/value broadcast.
    out2 = jax.vmap(f, in_axes=(0, None, None))(q, k[0], v[0])
    ref2 = jax.vmap(lambda q: _ref(q, k[0], v[0], True))(q)
    np.testing.assert_allclose(np.asarray(out2, np.float32), np.asarray(ref2, np.float32), atol=_tol(dtype), rtol=_tol(dtype))
    # Gradients through vmap.
    g = jax.grad(lambda q, k, v: jnp.sum(jax.vmap(f)(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))(q, k, v)
    gr = jax.grad(lambda q, k, v: jnp.sum(jax.vmap(lambda *a: _ref(*a, True))(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, gr):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=5 * _tol(dtype), rtol=5 * _tol(dtype))


@pytest.mark.parametrize("impl", IMPLS)
def test_value_and_grad_and_checkpoint(impl):
    dtype = dtypes_for(impl)[-1]
    q, k, v = random_inputs((2, 31, 4, 16), (2, 31, 4, 16), dtype, device=device_for(impl))

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.tanh(fn(q, k, v).astype(jnp.float32)))

    flash = lambda q, k, v: jaxattn.flash_attention(q, k, v, implementation=impl)
    val, grads = jax.jit(jax.value_and_grad(loss(flash), argnums=(0, 1, 2)))(q, k, v)
    val_c, grads_c = jax.jit(jax.value_and_grad(loss(jax.checkpoint(flash)), argnums=(0, 1, 2)))(q, k, v)
    val_r, grads_r = jax.value_and_grad(loss(_ref), argnums=(0, 1, 2))(q, k, v)
    if dtype == jnp.float32:
        np.testing.assert_allclose(float(val), float(val_r), rtol=1e-4)
    else:
        # The loss sums ~4K tanh(out) of both signs (it nearly cancels), so a relative
        # bound on it is meaningless: each 16-bit output is rounded (up to half an ulp,
        # 2^-9 relative) and the roundings add up like a random walk. Bound: twice the
        # error of plain JAX attention in the input dtype plus four "standard errors"
        # of the rounding (2^-9 rms relative per element).
        o_ref = np.asarray(_ref(q, k, v), np.float64)
        plain = jax.nn.dot_product_attention(q, k, v, implementation="xla")
        err_plain = abs(float(loss(lambda *a: plain)(q, k, v)) - float(val_r))
        spread = 4 * 2.0**-9 * float(np.sqrt(np.sum(np.tanh(o_ref) ** 2)))
        assert abs(float(val) - float(val_r)) <= 2 * err_plain + spread, (float(val), float(val_r), err_plain, spread)
    np.testing.assert_allclose(float(val_c), float(val), rtol=1e-6)
    for a, b, c in zip(grads, grads_c, grads_r):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32), atol=5 * _tol(dtype), rtol=5 * _tol(dtype))


@pytest.mark.parametrize("impl", IMPLS)
def test_residuals_are_linear_in_size(impl):
    """The backward saves q, k, v, out, lse: no [T, S] residual in the jaxpr."""
    T, S = 96, 112
    q, k, v = random_inputs((1, T, 2, 16), (1, S, 2, 16), dtypes_for(impl)[-1], device=device_for(impl))
    f = lambda q, k, v: jaxattn.flash_attention(q, k, v, implementation=impl)
    _, f_vjp = jax.vjp(f, q, k, v)
    residual_sizes = [np.prod(x.shape) for x in jax.tree_util.tree_leaves(f_vjp)]
    assert max(residual_sizes) <= max(q.size, k.size), residual_sizes
    hlo = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert f"{T}x{S}" not in hlo and f"{S}x{T}" not in hlo


def test_default_implementation_uses_kernel():
    q, k, v = random_inputs((1, 16, 2, 32), (1, 16, 2, 32), jnp.bfloat16)
    hlo = jax.jit(lambda q, k, v: jaxattn.flash_attention(q, k, v)).lower(q, k, v).as_text()
    platform = jax.default_backend()
    if platform == "cpu":
        assert "jaxattn_cpu_fwd" in hlo and "jaxattn_cuda_fwd" not in hlo
    elif platform == "gpu" and jaxattn.built_with_cuda():
        assert "jaxattn_cuda_fwd" in hlo and "jaxattn_cpu_fwd" not in hlo


def test_kernel_for():
    q, k, v = random_inputs((1, 16, 2, 32), (1, 16, 2, 32), jnp.bfloat16)
    assert jaxattn.kernel_for(q, k, v, platform="cpu") == "cpu:flash"
    assert jaxattn.kernel_for(q, k, v, implementation="reference") == "reference"
    assert jaxattn.kernel_for(q, k, v, platform="tpu") == "reference"
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    assert jaxattn.kernel_for(q32, k32, v32, platform="cuda") == "reference"
    if jaxattn.built_with_cuda():
        assert jaxattn.kernel_for(q, k, v, platform="cuda").startswith("cuda:")
    else:
        assert jaxattn.kernel_for(q, k, v, platform="cuda") == "reference"
