"""Bad input raises a clear error at trace time, naming the argument and shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn

B, T, S, N, K, H = 2, 8, 12, 4, 2, 16


def arrays(q=(B, T, N, H), k=(B, S, K, H), v=None, dtype=jnp.float32):
    v = k if v is None else v
    return (jnp.ones(q, dtype), jnp.ones(k, dtype), jnp.ones(v, dtype))


@pytest.mark.parametrize(
    "args,match",
    [
        (arrays(q=(T, H), k=(S, H)), r"query must have rank 4 \[B, T, N, H\] or rank 3.*\(8, 16\)"),
        (arrays(q=(1, B, T, N, H), k=(1, B, S, K, H)), r"query must have rank 4.*\(1, 2, 8, 4, 16\)"),
        (arrays(k=(S, K, H)), r"key must have the query's rank 4.*\(12, 2, 16\)"),
        (arrays(v=(B, S + 1, K, H)), r"key and value must have the same shape.*\(2, 12, 2, 16\).*\(2, 13, 2, 16\)"),
        (arrays(v=(B, S, K, H + 8)), r"key and value must have the same shape"),
        (arrays(k=(B + 1, S, K, H)), r"key batch size 3 differs from query batch size 2"),
        (arrays(k=(B, S, K, H + 1)), r"key head dim 17 differs from query head dim 16"),
        (arrays(k=(B, S, 3, H)), r"query heads N=4 must be a multiple of key/value heads K=3"),
        (arrays(q=(B, T, N, 257), k=(B, S, K, 257)), r"head dim 257 is too large: at most 256"),
        (arrays(k=(B, 0, K, H)), r"key/value sequence length must be at least 1"),
    ],
)
def test_bad_shapes(args, match):
    with pytest.raises(ValueError, match=match):
        jaxattn.flash_attention(*args)


def test_integer_dtype():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"query must be bfloat16, float16 or float32, got int32"):
        jaxattn.flash_attention(q.astype(jnp.int32), k, v)
    with pytest.raises(ValueError, match=r"value must be bfloat16, float16 or float32, got float64|value must be"):
        jaxattn.flash_attention(q, k, np.ones(v.shape, np.float64))


def test_mixed_dtypes():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"must share one dtype, got float32, bfloat16, float32"):
        jaxattn.flash_attention(q, k.astype(jnp.bfloat16), v)


def test_not_an_array():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"key must be an array, got list"):
        jaxattn.flash_attention(q, [[1.0]], v)


def test_non_static_scale():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"scale must be a static Python float"):
        jax.jit(lambda s: jaxattn.flash_attention(q, k, v, scale=s))(0.5)
    with pytest.raises(ValueError, match=r"scale must be a static Python float"):
        jaxattn.flash_attention(q, k, v, scale=jnp.float32(0.5))
    with pytest.raises(ValueError, match=r"scale must be a static Python float, got str"):
        jaxattn.flash_attention(q, k, v, scale="0.5")
    with pytest.raises(ValueError, match=r"scale must be finite"):
        jaxattn.flash_attention(q, k, v, scale=float("nan"))
    # A numpy scalar is static: accepted.
    jaxattn.flash_attention(q, k, v, scale=np.float32(0.5))


def test_bad_options():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"is_causal must be a Python bool, got int"):
        jaxattn.flash_attention(q, k, v, is_causal=1)
    with pytest.raises(ValueError, match=r"implementation must be one of.*'triton'"):
        jaxattn.flash_attention(q, k, v, implementation="triton")


def test_checks_run_at_trace_time():
    """The error comes from tracing under jit, before any compilation."""
    q, k, v = arrays(k=(B, S, 3, H))
    with pytest.raises(ValueError, match=r"multiple of key/value heads"):
        jax.jit(jaxattn.flash_attention).trace(q, k, v)


@pytest.mark.skipif(jaxattn.built_with_cuda(), reason="checks the CPU-only build")
def test_cuda_unavailable_is_not_implemented():
    q, k, v = arrays(dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"built without CUDA"):
        jaxattn.flash_attention(q, k, v, implementation="cuda")


@pytest.mark.skipif(not jaxattn.built_with_cuda(), reason="needs the CUDA kernels built")
def test_cuda_rejects_float32_and_odd_head_dims():
    q, k, v = arrays(dtype=jnp.float32)
    with pytest.raises(NotImplementedError, match=r"bfloat16 or float16, not float32"):
        jaxattn.flash_attention(q, k, v, implementation="cuda")
    q, k, v = arrays(q=(B, T, N, 12), k=(B, S, K, 12), dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"multiple of 8, got 12"):
        jaxattn.flash_attention(q, k, v, implementation="cuda")
