"""jaxattn.flax: the drop-in attention_fn, the linen/nnx layers, and the train_lm example."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jaxattn.flax as jf  # noqa: E402
from jaxattn.flax._common import rotary_embedding  # noqa: E402
from jaxattn.flax.attention_fn import _reset_fallback_warnings  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "train_lm.py")
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _on_cpu():
    """The drop-in equivalence tests compare with Flax's own attention in float32 to
    2e-5: on a GPU that attention's matmuls run in TF32 and float32 calls take the
    reference path, so these tests pin their arrays to the CPU (the GPU training path
    is exercised by examples/train_lm.py on the device; docs/perf.md)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees every fallback warning anew."""
    _reset_fallback_warnings()
    yield
    _reset_fallback_warnings()


def close(a, b, dtype, scale=1.0):
    tol = TOL[dtype] * scale
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=tol, rtol=tol)


def uses_jaxattn(fn, *args) -> bool:
    """Whether the compiled fn calls one of jaxattn's kernels."""
    return "jaxattn_" in jax.jit(fn).lower(*args).compile().as_text()


def fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, jf.FallbackWarning)]


@contextlib.contextmanager
def no_fallback():
    """A context in which a FallbackWarning is an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.FallbackWarning)
        yield


# ----------------------------------------------------------------------------- drop-in: linen

def _linen_pair(dtype, **kw):
    stock = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64, dtype=dtype, **kw)
    ours = stock.clone(attention_fn=jf.attention_fn)
    return stock, ours


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linen_dropin_matches_stock(dtype):
    x = jax.random.normal(jax.random.key(0), (2, 3, 19, 32))  # two batch dims
    stock, ours = _linen_pair(dtype)
    params = stock.init(jax.random.key(1), x)

    def loss(module):
        return lambda p, x: jnp.sum(jnp.sin(module.apply(p, x).astype(jnp.float32)))

    with no_fallback():
        assert uses_jaxattn(ours.apply, params, x)
        close(ours.apply(params, x), stock.apply(params, x), dtype)
        g_ours = jax.grad(loss(ours), argnums=(0, 1))(params, x)
    g_stock = jax.grad(loss(stock), argnums=(0, 1))(params, x)
    close(g_ours, g_stock, dtype, scale=5)


def test_linen_causal_via_is_causal_partial():
    T = 23
    x = jax.random.normal(jax.random.key(0), (2, T, 32))
    stock = nn.MultiHeadDotProductAttention(num_heads=4)
    ours = stock.clone(attention_fn=functools.partial(jf.attention_fn, is_causal=True))
    params = stock.init(jax.random.key(1), x)
    mask = nn.make_causal_mask(jnp.ones((2, T)))
    with no_fallback():
        assert uses_jaxattn(ours.apply, params, x)
        close(jax.jit(ours.apply)(params, x), stock.apply(params, x, mask=mask), jnp.float32)


def test_linen_dense_masks_run_jaxattn():
    """jax.Array masks (traced under jit) reach the kernel as its dense mask."""
    T = 17
    x = jax.random.normal(jax.random.key(0), (2, T, 32))
    stock, ours = _linen_pair(jnp.float32)
    params = stock.init(jax.random.key(1), x)
    causal = nn.make_causal_mask(jnp.ones((2, T)))
    keep = jnp.arange(T)[None, :] < jnp.asarray([[T], [11]])  # key padding of the second row
    padding = nn.make_attention_mask(jnp.ones((2, T), bool), keep)
    both = nn.combine_masks(causal, padding)
    with no_fallback():
        for mask in (causal, padding, both):
            fn = lambda p, x, m: ours.apply(p, x, mask=m)
            assert uses_jaxattn(fn, params, x, mask)
            close(jax.jit(fn)(params, x, mask), stock.apply(params, x, mask=mask), jnp.float32)
            g = jax.grad(lambda p: jnp.sum(jnp.sin(ours.apply(p, x, mask=mask))))(params)
            g_ref = jax.grad(lambda p: jnp.sum(jnp.sin(stock.apply(p, x, mask=mask))))(params)
            close(g, g_ref, jnp.float32, scale=5)


def test_query_padding_rows_are_zero():
    """Fully masked query rows give 0 (flax's stock function gives the mean of the values there)."""
    q, k, v = (jax.random.normal(key, (2, 9, 4, 8)) for key in jax.random.split(jax.random.key(0), 3))
    valid = jnp.arange(9)[None, :] < jnp.asarray([[9], [5]])
    mask = nn.make_attention_mask(valid, valid)  # [2, 1, 9, 9]
    with no_fallback():
        out = jf.attention_fn(q, k, v, mask=mask)
    ref = nn.dot_product_attention(q, k, v, mask=mask)
    rows = np.asarray(valid)  # [B, T]
    np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(ref)[rows], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(out)[~rows], 0.0)


def test_numpy_causal_mask_is_recognised():
    T = 17
    x = jax.random.normal(jax.random.key(0), (2, T, 32))
    stock, ours = _linen_pair(jnp.float32)
    params = stock.init(jax.random.key(1), x)
    causal = np.tril(np.ones((T, T), bool))[None, None]
    everything = np.ones((2, 1, T, T), bool)
    with no_fallback():
        for mask in (causal, everything):
            hlo = jax.jit(lambda p, x: ours.apply(p, x, mask=mask)).lower(params, x).as_text()
            # The recognised mask is not passed to the kernel (causal blocks are skipped instead).
            assert "jaxattn_" in hlo and "has_mask = false" in hlo and "has_mask = true" not in hlo
            close(ours.apply(params, x, mask=mask), stock.apply(params, x, mask=jnp.asarray(mask)), jnp.float32)
        # A NumPy mask that is neither runs as a dense mask, and matches.
        padding = np.ones((2, 1, T, T), bool)
        padding[:, :, :, -3:] = False
        hlo = jax.jit(lambda p, x: ours.apply(p, x, mask=padding)).lower(params, x).as_text()
        assert "has_mask = true" in hlo
        close(ours.apply(params, x, mask=padding), stock.apply(params, x, mask=padding), jnp.float32)


def test_dropout_falls_back_and_warns_once():
    x = jax.random.normal(jax.random.key(0), (2, 11, 32))
    stock, ours = _linen_pair(jnp.float32, dropout_rate=0.3)
    params = stock.init(jax.random.key(1), x, deterministic=True)
    rngs = {"dropout": jax.random.key(2)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out1 = ours.apply(params, x, deterministic=False, rngs=rngs)
        out2 = jax.jit(lambda p, x: ours.apply(p, x, deterministic=False, rngs=rngs))(params, x)
        det = ours.apply(params, x, deterministic=True)  # no dropout: jaxattn
    messages = fallback_warnings(record)
    assert len(messages) == 1 and "dropout" in messages[0], messages
    ref = stock.apply(params, x, deterministic=False, rngs=rngs)
    close(out1, ref, jnp.float32)
    close(out2, ref, jnp.float32)
    close(det, stock.apply(params, x, deterministic=True), jnp.float32)


def test_linen_sow_weights_falls_back():
    x = jax.random.normal(jax.random.key(0), (2, 7, 32))
    stock, ours = _linen_pair(jnp.float32)
    params = stock.init(jax.random.key(1), x)
    with pytest.warns(jf.FallbackWarning, match="sowing"):
        out, state = ours.apply(params, x, sow_weights=True, mutable=["intermediates"])
    ref, ref_state = stock.apply(params, x, sow_weights=True, mutable=["intermediates"])
    close(out, ref, jnp.float32)
    close(state, ref_state, jnp.float32)


@pytest.mark.parametrize("shape", [(2, 4, 9, 9), (1, 4, 9, 9), (2, 1, 1, 9), (9, 9)], ids=str)
def test_bias_runs_jaxattn_with_gradient(shape):
    q, k, v = (jax.random.normal(key, (2, 9, 4, 8)) for key in jax.random.split(jax.random.key(0), 3))
    bias = jax.random.normal(jax.random.key(1), shape)
    mask = jax.random.uniform(jax.random.key(2), (2, 1, 9, 9)) > 0.2
    mask = mask.at[:, :, :, 0].set(True)  # no fully masked row (flax averages those)
    loss = lambda fn: lambda q, k, v, b: jnp.sum(jnp.sin(fn(q, k, v, bias=b, mask=mask)))
    with no_fallback():
        assert uses_jaxattn(lambda b: jf.attention_fn(q, k, v, bias=b, mask=mask), bias)
        close(jf.attention_fn(q, k, v, bias=bias, mask=mask), nn.dot_product_attention(q, k, v, bias=bias, mask=mask),
              jnp.float32)
        g = jax.grad(loss(jf.attention_fn), argnums=(0, 1, 2, 3))(q, k, v, bias)
    g_ref = jax.grad(loss(nn.dot_product_attention), argnums=(0, 1, 2, 3))(q, k, v, bias)
    assert g[3].shape == bias.shape
    close(g, g_ref, jnp.float32, scale=5)


def test_bias_many_batch_dims_and_partial_broadcast():
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (2, 3, 9, 4, 8)) for key in keys[:3])
    for shape in [(2, 1, 4, 9, 9), (1, 3, 1, 9, 9), (1, 1, 1, 1, 9), (2, 3, 4, 9, 9)]:
        bias = jax.random.normal(keys[3], shape)
        with no_fallback():
            out = jf.attention_fn(q, k, v, bias=bias)
        close(out, nn.dot_product_attention(q, k, v, bias=bias), jnp.float32)


def test_bad_bias_and_unsupported_dtype_fall_back():
    q, k, v = (jax.random.normal(key, (2, 9, 4, 8)) for key in jax.random.split(jax.random.key(0), 3))
    bias = jax.random.normal(jax.random.key(1), (2, 4, 9, 1, 9))  # not [batch..., N, T, S]
    with pytest.warns(jf.FallbackWarning, match="bias of shape"):
        with pytest.raises(Exception):  # flax itself rejects it too
            jf.attention_fn(q, k, v, bias=bias)
    q16 = q.astype(jnp.float16)
    with no_fallback():
        out = jf.attention_fn(q16, k, v, dtype=jnp.bfloat16)  # dtype casts all three
    assert out.dtype == jnp.bfloat16
    close(out, nn.dot_product_attention(q, k, v), jnp.bfloat16)


def test_linen_fallback_takes_causal_and_gqa():
    """The flax.linen fallback (chosen by linen-only options) folds is_causal and GQA in."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 9, 4, 8))
    k, v = (jax.random.normal(key, (2, 9, 2, 8)) for key in keys[1:])
    with pytest.warns(jf.FallbackWarning, match="custom einsums"):
        out = jf.attention_fn(q, k, v, is_causal=True, force_fp32_for_softmax=True,
                              qk_attn_weights_einsum=functools.partial(jnp.einsum),
                              attn_weights_value_einsum=functools.partial(jnp.einsum))
    close(out, nnx.dot_product_attention(q, k, v, is_causal=True), jnp.float32)
    with no_fallback():
        close(jf.attention_fn(q, k, v, is_causal=True, force_fp32_for_softmax=True), out, jnp.float32)


def test_attention_fn_unbatched_and_many_batch_dims():
    keys = jax.random.split(jax.random.key(0), 3)
    for shape in [(9, 4, 8), (2, 3, 9, 4, 8)]:
        q, k, v = (jax.random.normal(key, shape) for key in keys)
        with no_fallback():
            out = jf.attention_fn(q, k, v)
        close(out, nn.dot_product_attention(q, k, v), jnp.float32)


# ----------------------------------------------------------------------------- drop-in: nnx

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_nnx_dropin_matches_stock_gqa(dtype, is_causal):
    kw = dict(num_heads=4, in_features=32, num_kv_heads=2, qkv_features=64, dtype=dtype, decode=False)
    stock = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kw, attention_fn=jf.attention_fn, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 21, 32))

    def loss(model, x):
        return jnp.sum(jnp.sin(model(x, is_causal=is_causal).astype(jnp.float32)))

    with no_fallback():
        close(ours(x, is_causal=is_causal), stock(x, is_causal=is_causal), dtype)
        g_ours = nnx.grad(loss, argnums=(0, 1))(ours, x)
    g_stock = nnx.grad(loss, argnums=(0, 1))(stock, x)
    close(nnx.state(g_ours[0]), nnx.state(g_stock[0]), dtype, scale=5)
    close(g_ours[1], g_stock[1], dtype, scale=5)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside:DeprecationWarning")
def test_nnx_mask_runs_jaxattn_and_sow_falls_back():
    kw = dict(num_heads=4, in_features=32, num_kv_heads=2, decode=False)
    stock = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kw, attention_fn=jf.attention_fn, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 13, 32))
    mask = nnx.combine_masks(nnx.make_causal_mask(jnp.ones((2, 13))),
                             nnx.make_attention_mask(jnp.ones((2, 13), bool), jnp.arange(13)[None] < 10))
    with no_fallback():
        close(ours(x, mask=mask), stock(x, mask=mask), jnp.float32)
    with pytest.warns(jf.FallbackWarning, match="sowing"):
        ours(x, sow_weights=True)
    stock(x, sow_weights=True)
    close(nnx.state(ours, nnx.Intermediate), nnx.state(stock, nnx.Intermediate), jnp.float32)


def test_nnx_stock_decode_cache_with_attention_fn():
    """Flax's own KV-cache decoding (decode=True, one token per call against the filled
    cache) with attention_fn=jaxattn's equals the stock attention, with no fallback."""
    kw = dict(num_heads=4, in_features=32, num_kv_heads=2, decode=True)
    stock = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kw, attention_fn=jf.attention_fn, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 32))
    for m in (stock, ours):
        m.init_cache((2, 6, 32))
    with no_fallback():
        got = jnp.concatenate([ours(x[:, t:t + 1]) for t in range(6)], axis=1)
    want = jnp.concatenate([stock(x[:, t:t + 1]) for t in range(6)], axis=1)
    close(got, want, jnp.float32)


# ----------------------------------------------------------------------------- jaxattn's layers

def plain_layer(params, x, *, num_heads, num_kv_heads, is_causal, rope_theta, window=None, softcap=None,
                segment_ids=None):
    """The same layer written independently in plain JAX (complex-number RoPE, explicit softmax;
    window (left, right), soft cap and segment ids as explicit masks)."""
    q = jnp.einsum("btd,dnh->btnh", x, params["query_kernel"])
    k = jnp.einsum("btd,dnh->btnh", x, params["key_kernel"])
    v = jnp.einsum("btd,dnh->btnh", x, params["value_kernel"])
    T, H = x.shape[1], q.shape[-1]
    if rope_theta is not None:
        freq = 1.0 / rope_theta ** (np.arange(0, H, 2) / H)
        rot = np.exp(1j * np.arange(T)[:, None] * freq[None, :])[:, None, :]  # [T, 1, H/2]

        def rope(a):
            z = (a[..., : H // 2] + 1j * a[..., H // 2:]) * rot
            return jnp.concatenate([z.real, z.imag], axis=-1).astype(a.dtype)

        q, k = rope(q), rope(k)
    g = num_heads // num_kv_heads
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = np.ones((T, T), bool)
    if is_causal:
        visible &= j <= i
    if window is not None:
        visible &= (j >= i - window[0]) & (j <= i + window[1])
    visible = jnp.asarray(visible)[None, None]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    s = jnp.where(visible, s, -np.inf)
    o = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)
    return jnp.einsum("btnh,nhf->btf", o, params["out_kernel"])


LAYER_CASES = [
    dict(num_heads=4, num_kv_heads=None, is_causal=False, rope_theta=None),
    dict(num_heads=4, num_kv_heads=2, is_causal=True, rope_theta=10_000.0),
    dict(num_heads=4, num_kv_heads=1, is_causal=True, rope_theta=None),
    dict(num_heads=2, num_kv_heads=2, is_causal=False, rope_theta=500.0),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_nnx_layer_matches_plain_jax(case):
    layer = jf.nnx.MultiHeadAttention(32, case["num_heads"], num_kv_heads=case["num_kv_heads"],
                                      is_causal=case["is_causal"], rope_theta=case["rope_theta"],
                                      rngs=nnx.Rngs(0))
    kv = case["num_kv_heads"] or case["num_heads"]
    head_dim = 32 // case["num_heads"]
    assert layer.key_kernel.shape == (32, kv, head_dim)
    x = jax.random.normal(jax.random.key(1), (3, 19, 32))
    ref_case = dict(case, num_kv_heads=kv)
    with no_fallback():
        out = layer(x)
    assert out.shape == x.shape and out.dtype == jnp.float32
    close(out, plain_layer(layer.params(), x, **ref_case), jnp.float32)

    def loss(params, x, fn):
        return jnp.sum(jnp.sin(fn(params, x)))

    graphdef, params = nnx.split(layer)
    ours = lambda p, x: nnx.merge(graphdef, p)(x)
    g = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(params, x, ours)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(g))
    g_ref = jax.grad(loss, argnums=(0, 1))(
        layer.params(), x, lambda p, x: plain_layer(p, x, **ref_case))
    close({k: v for k, v in nnx.to_pure_dict(g[0]).items()}, g_ref[0], jnp.float32, scale=5)
    close(g[1], g_ref[1], jnp.float32, scale=5)


@pytest.mark.parametrize("window,softcap", [((5, 0), None), ((3, 2), 5.0), (None, 2.0)])
def test_layer_window_softcap_segments_match_plain_jax(window, softcap):
    """Sliding window, soft cap and packed-document segment ids in jaxattn's own layers
    (nnx and linen), forward and gradients, against the plain-JAX layer."""
    kw = dict(num_kv_heads=2, is_causal=True, rope_theta=1e4, local_window_size=window, logits_soft_cap=softcap)
    layer = jf.nnx.MultiHeadAttention(32, 4, **kw, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 21, 32))
    seg = jnp.asarray([[0] * 8 + [1] * 9 + [2] * 4, [5] * 21], jnp.int32)
    ref_kw = dict(num_heads=4, num_kv_heads=2, is_causal=True, rope_theta=1e4, window=window, softcap=softcap,
                  segment_ids=seg)
    with no_fallback():
        out = layer(x, segment_ids=seg)
    close(out, plain_layer(layer.params(), x, **ref_kw), jnp.float32)
    g = jax.grad(lambda p: jnp.sum(jnp.sin(jf._common.multi_head_attention(
        layer.config, p, x, segment_ids=seg))))(layer.params())
    g_ref = jax.grad(lambda p: jnp.sum(jnp.sin(plain_layer(p, x, **ref_kw))))(layer.params())
    close(g, g_ref, jnp.float32, scale=5)
    # The linen twin with the same parameters computes the same.
    lin = jf.linen.MultiHeadAttention(num_heads=4, **kw)
    variables = {"params": layer.params()}
    close(lin.apply(variables, x, segment_ids=seg), out, jnp.float32)


def test_layer_bad_window_or_softcap():
    with pytest.raises(ValueError, match="local_window_size"):
        jf.nnx.MultiHeadAttention(32, 4, local_window_size=-1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="logits_soft_cap"):
        jf.nnx.MultiHeadAttention(32, 4, logits_soft_cap=0.0, rngs=nnx.Rngs(0))


def test_rope_positions_and_extra_batch_dims():
    layer = jf.nnx.MultiHeadAttention(16, 2, rope_theta=100.0, is_causal=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 3, 8, 16))
    out = layer(x)
    assert out.shape == x.shape
    close(out[1, 2], layer(x[1, 2]), jnp.float32)  # batch dims are independent
    close(layer(x, positions=jnp.arange(8)), out, jnp.float32)
    shifted = layer(x, positions=jnp.arange(8) + 5)  # RoPE is relative: a shift changes nothing
    close(shifted, out, jnp.float32, scale=10)
    # rotary_embedding at position 0 is the identity and preserves norms.
    a = jax.random.normal(jax.random.key(2), (5, 2, 8))
    r = rotary_embedding(a, jnp.arange(5), 10.0)
    close(r[0], a[0], jnp.float32)
    close(jnp.linalg.norm(r, axis=-1), jnp.linalg.norm(a, axis=-1), jnp.float32)


def test_linen_layer_matches_nnx_layer():
    kw = dict(num_kv_heads=2, head_dim=12, out_features=24, is_causal=True, rope_theta=1e4, use_bias=True)
    x = jax.random.normal(jax.random.key(1), (2, 15, 32))
    lin = jf.linen.MultiHeadAttention(num_heads=4, **kw)
    variables = lin.init(jax.random.key(0), x)
    layer = jf.nnx.MultiHeadAttention(32, 4, **kw, rngs=nnx.Rngs(0))
    assert set(variables["params"]) == set(layer.params())
    for name, value in variables["params"].items():  # same shapes; copy linen's values over
        assert getattr(layer, name).shape == value.shape, name
        getattr(layer, name)[...] = value + 0.01  # nonzero biases
    variables = {"params": jax.tree.map(lambda v: v + 0.01, variables["params"])}
    out = lin.apply(variables, x)
    assert out.shape == (2, 15, 24)
    close(out, layer(x), jnp.float32)


def test_layers_bf16_and_attention_fn_switch():
    layer = jf.nnx.MultiHeadAttention(32, 4, num_kv_heads=2, is_causal=True, dtype=jnp.bfloat16,
                                      rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    out = layer(x)
    assert out.dtype == jnp.bfloat16 and layer.query_kernel.dtype == jnp.float32
    layer.attention_fn = functools.partial(jax.nn.dot_product_attention, implementation="xla")
    close(layer(x), out, jnp.bfloat16)


def test_kernel_axes_annotations():
    axes = ("embed", "heads", "head_dim")
    x = jnp.ones((1, 4, 16))
    lin = jf.linen.MultiHeadAttention(num_heads=2, kernel_axes=axes, use_bias=True)
    specs = nn.get_partition_spec(lin.init(jax.random.key(0), x))["params"]
    assert specs["query_kernel"] == jax.sharding.PartitionSpec(*axes)
    assert specs["out_kernel"] == jax.sharding.PartitionSpec("heads", "head_dim", "embed")
    assert specs["out_bias"] == jax.sharding.PartitionSpec("embed")
    with nnx.use_eager_sharding(False):
        layer = jf.nnx.MultiHeadAttention(16, 2, kernel_axes=axes, rngs=nnx.Rngs(0))
    assert layer.key_kernel.get_metadata()["out_sharding"] == axes
    assert layer.out_kernel.get_metadata()["out_sharding"] == ("heads", "head_dim", "embed")
    # Eager sharding onto an (auto) mesh whose axes carry the logical names;
    # head_dim stays unsharded (jaxattn shards batch and heads only).
    mesh = jax.make_mesh((1, 1), ("embed", "heads"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        layer = jf.nnx.MultiHeadAttention(16, 2, kernel_axes=("embed", "heads", None), rngs=nnx.Rngs(0))
        assert layer(x).shape == x.shape
    assert layer.query_kernel[...].sharding.spec == jax.sharding.PartitionSpec("embed", "heads", None)


def test_layer_config_errors():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        jf.nnx.MultiHeadAttention(32, 4, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="even head_dim"):
        jf.nnx.MultiHeadAttention(30, 2, head_dim=15, rope_theta=1e4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="pass head_dim"):
        jf.nnx.MultiHeadAttention(30, 4, rngs=nnx.Rngs(0))
    layer = jf.nnx.MultiHeadAttention(32, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="expects 32"):
        layer(jnp.ones((1, 4, 16)))


# ----------------------------------------------------------------------------- the example

def _run_example(tmp_path, *args, devices=1):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, EXAMPLE, "--preset", "tiny", *args], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [float(line.split("loss ")[1].split()[0]) for line in run.stderr.splitlines()
              if line.startswith("step ")]
    return run.stdout, losses


@pytest.mark.slow
def test_train_lm_example_runs(tmp_path):
    pytest.importorskip("optax")
    ckpt = tmp_path / "lm.npz"
    out, losses = _run_example(tmp_path, "--steps", "5", "--plot", "", "--sample", "16", "--save", str(ckpt))
    assert "tokens/s" in out and "attention share" in out and "sample" in out
    assert len(losses) == 5 and all(np.isfinite(losses)), out
    assert losses[-1] < losses[0], losses
    # Data parallel over two (CPU) devices: the same losses. The plot is drawn
    # or skipped with a note.
    out, losses2 = _run_example(tmp_path, "--steps", "5", "--plot", "curve.png", "--sample", "0",
                                devices=2)
    np.testing.assert_allclose(losses2, losses, rtol=1e-3)
    assert (tmp_path / "curve.png").exists() or "matplotlib is not installed" in out
    # Restoring the checkpoint and only sampling.
    out, _ = _run_example(tmp_path, "--steps", "0", "--plot", "", "--sample", "8", "--restore", str(ckpt))
    assert "sample" in out
