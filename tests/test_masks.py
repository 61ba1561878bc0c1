"""Mask options: local_window_size, query_seq_lengths, key_value_seq_lengths,
logits_soft_cap, q_segment_ids / kv_segment_ids, and the dense bias and mask.

The CPU kernel and the pure-JAX reference against the float64 reference
(tests/reference64.py), forward and gradients, each feature alone and in
pairs; rows with nothing to attend; bad input; the CUDA dispatch rule.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
import reference64
from conftest import assert_close, device_for, plain_attention, poison_allocator, random_inputs

IMPLS = ["cpu", "reference"]


@pytest.fixture(autouse=True)
def _on_cpu():
    """These tests run the CPU kernel and the reference: arrays live on the CPU even
    where the default backend is a GPU (test_masks_gpu.py has the CUDA kernels)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _lengths(values):
    return None if values is None else jnp.asarray(values, jnp.int32)


def _kwargs(window, ql, kl):
    return dict(local_window_size=window, query_seq_lengths=_lengths(ql), key_value_seq_lengths=_lengths(kl))


def _mask64(T, S, is_causal, window, ql, kl, segs=None, mask=None):
    """Visible keys for the plain-JAX yardstick: [T, S] / [B, T, S], or rank 4 with a dense mask."""
    qs, ks = segs if segs is not None else (None, None)
    vis = reference64._visible(T, S, is_causal, None, window, ql, kl, qs, ks)
    if mask is None:
        return vis
    mask = np.asarray(mask, bool)
    return reference64._bcast(vis) & mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def _dense_kwargs(segs, bias, mask):
    """flash_attention keywords of the segment ids / dense bias / mask (numpy -> jnp)."""
    kw = {}
    if segs is not None:
        kw.update(q_segment_ids=jnp.asarray(segs[0], jnp.int32), kv_segment_ids=jnp.asarray(segs[1], jnp.int32))
    if bias is not None:
        kw["bias"] = jnp.asarray(bias)
    if mask is not None:
        kw["mask"] = jnp.asarray(mask, bool)
    return kw


def check_forward(impl, B, T, S, N, K, H, dtype, *, is_causal=False, window=None, ql=None, kl=None,
                  softcap=None, segs=None, bias=None, mask=None):
    q, k, v = random_inputs((B, T, N, H), (B, S, K, H), dtype)
    scale = 1.0 / np.sqrt(H)
    dense = _dense_kwargs(segs, bias, mask)
    if impl.startswith("cuda"):  # (an output element a kernel forgets to write shows as NaN)
        poison_allocator(device_for(impl), 2 * q.size * q.dtype.itemsize + 4 * B * T * N)
    out, lse = jax.jit(lambda q, k, v, ql_, kl_, dense: jaxattn.flash_attention(
        q, k, v, is_causal=is_causal, return_residual=True, implementation=impl,
        local_window_size=window, query_seq_lengths=ql_, key_value_seq_lengths=kl_,
        logits_soft_cap=softcap, **dense))(
            q, k, v, _lengths(ql), _lengths(kl), dense)
    qs, ks = segs if segs is not None else (None, None)
    ref_out, ref_lse = reference64.forward(q, k, v, scale=scale, is_causal=is_causal, window=window,
                                           q_lengths=ql, kv_lengths=kl, softcap=softcap, q_segment_ids=qs,
                                           kv_segment_ids=ks, bias=bias, mask=mask)
    plain = plain_attention(q, k, v, scale=scale, is_causal=False,
                            mask=_mask64(T, S, is_causal, window, ql, kl, segs, mask), softcap=softcap,
                            bias=bias)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close("out", out, plain, ref_out, dtype)
    lse = np.asarray(lse)
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], atol=tol, rtol=tol)


def check_backward(impl, B, T, S, N, K, H, dtype, *, is_causal=False, window=None, ql=None, kl=None,
                   with_lse=False, softcap=None, segs=None, bias=None, mask=None, deterministic=False):
    """dq, dk, dv (and dbias with a bias) against the float64 reference."""
    q, k, v, dout = random_inputs((B, T, N, H), (B, S, K, H), dtype, count=4)
    scale = 1.0 / np.sqrt(H)
    dlse = jnp.asarray(np.random.default_rng(T + 7 * S).standard_normal((B, T, N)), jnp.float32)
    kw = dict(_kwargs(window, ql, kl), logits_soft_cap=softcap, **_dense_kwargs(segs, None, mask))
    b0 = jnp.zeros(()) if bias is None else jnp.asarray(bias)

    def loss(q, k, v, b):
        out, lse = jaxattn.flash_attention(q, k, v, is_causal=is_causal, return_residual=True,
                                           implementation=impl, bias=None if bias is None else b,
                                           deterministic=deterministic, **kw)
        total = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
        # lse is -inf on empty rows: its cotangent there must not matter.
        return total + (jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse) if with_lse else 0.0)

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    if impl.startswith("cuda"):  # (a gradient element a kernel forgets to write shows as NaN)
        poison_allocator(device_for(impl), 8 * (q.size + 2 * k.size) * q.dtype.itemsize)
    grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, b0)
    qs, ks = segs if segs is not None else (None, None)
    refs = reference64.backward(q, k, v, dout, scale=scale, is_causal=is_causal, window=window,
                                q_lengths=ql, kv_lengths=kl, dlse=np.asarray(dlse) if with_lse else None,
                                softcap=softcap, q_segment_ids=qs, kv_segment_ids=ks, bias=bias, mask=mask,
                                round_out=None if bias is None else (lambda x: jnp.asarray(x, dtype)))
    allowance = {}
    if bias is not None:  # dbias: D comes from the rounded output (reference64.backward)
        *refs, dbias_err = refs
        allowance["dbias"] = float(np.max(np.abs(dbias_err)))
    vis = _mask64(T, S, is_causal, window, ql, kl, segs, mask)
    if with_lse:
        plain_grads = tuple(jnp.asarray(r, dtype) for r in refs)
    else:
        plain_grads = jax.grad(
            lambda q, k, v, b: jnp.sum(plain_attention(q, k, v, scale=scale, is_causal=False, mask=vis,
                                                       softcap=softcap, bias=None if bias is None else b) * dout),
            argnums=argnums)(q, k, v, b0.astype(dtype))
    primals = (q, k, v, b0)
    for name, g, x, pg, r in zip(("dq", "dk", "dv", "dbias"), grads, primals, plain_grads, refs):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert_close(name, g, jnp.asarray(pg), r, dtype, allowance.get(name, 0.0))


# (is_causal, window, q lengths, kv lengths) for B = 2; T = 150, S = 300 span
# several query and key blocks of the CPU kernel, so block skipping is exercised.
CASES = {
    "window_int": (False, 40, None, None),
    "window_asym": (False, (100, 3), None, None),
    "window_right_only": (False, (0, 70), None, None),
    "window_zero": (False, (0, 0), None, None),
    "q_lengths": (False, None, [150, 37], None),
    "kv_lengths": (False, None, None, [300, 101]),
    "lengths": (False, None, [90, 150], [257, 64]),
    "window_causal": (True, (65, 10), None, None),
    "window_causal_int": (True, 129, None, None),
    "lengths_causal": (True, None, [120, 66], [100, 300]),
    "window_lengths": (False, (30, 30), [140, 70], [200, 75]),
    "all": (True, (50, 5), [150, 80], [130, 250]),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("T,S", [(150, 300), (300, 150)])
def test_forward(impl, case, T, S):
    is_causal, window, ql, kl = CASES[case]
    ql = None if ql is None else [min(x, T) for x in ql]
    kl = None if kl is None else [min(x, S) for x in kl]
    check_forward(impl, 2, T, S, 4, 2, 32, jnp.float32, is_causal=is_causal, window=window, ql=ql, kl=kl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_backward(impl, case):
    is_causal, window, ql, kl = CASES[case]
    check_backward(impl, 2, 150, 300, 4, 2, 32, jnp.float32, is_causal=is_causal, window=window, ql=ql, kl=kl)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", ["window_causal", "lengths", "all"])
def test_half_dtypes(case, dtype):
    is_causal, window, ql, kl = CASES[case]
    check_forward("cpu", 2, 150, 300, 4, 1, 64, dtype, is_causal=is_causal, window=window, ql=ql, kl=kl)
    check_backward("cpu", 2, 150, 300, 4, 1, 64, dtype, is_causal=is_causal, window=window, ql=ql, kl=kl)


@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_through_lse(impl):
    check_backward(impl, 2, 70, 90, 4, 2, 16, jnp.float32, is_causal=True, window=(20, 3),
                   ql=[70, 41], kl=[33, 90], with_lse=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kw", [
    dict(key_value_seq_lengths=[0, 0]),
    dict(query_seq_lengths=[0, 3]),
    dict(key_value_seq_lengths=[0, 5], query_seq_lengths=[9, 0]),
    # T > S: causal rows past the last key see none with a zero window.
    dict(local_window_size=(0, 0), T=40, S=20),
    dict(local_window_size=(0, 0), is_causal=True, T=40, S=20),
])
def test_rows_with_nothing_to_attend(impl, kw):
    kw = dict(kw)
    T, S = kw.pop("T", 9), kw.pop("S", 12)
    is_causal = kw.pop("is_causal", False)
    kw = {n: (jnp.asarray(x, jnp.int32) if isinstance(x, list) else x) for n, x in kw.items()}
    q, k, v, dout = random_inputs((2, T, 2, 8), (2, S, 1, 8), jnp.float32, count=4)

    def f(q, k, v):
        return jaxattn.flash_attention(q, k, v, is_causal=is_causal, return_residual=True,
                                       implementation=impl, **kw)

    out, lse = jax.jit(f)(q, k, v)
    ql = kw.get("query_seq_lengths")
    kl = kw.get("key_value_seq_lengths")
    ref_out, ref_lse = reference64.forward(q, k, v, scale=1 / np.sqrt(8), is_causal=is_causal,
                                           window=kw.get("local_window_size"), q_lengths=ql, kv_lengths=kl)
    empty = np.isneginf(ref_lse)
    assert empty.any()
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
    assert not np.isnan(np.asarray(lse)).any()
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)

    def loss(q, k, v):
        out, lse = f(q, k, v)
        # A cotangent on the -inf lse entries too: it must not leak NaN.
        return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    refs = reference64.backward(q, k, v, dout, scale=1 / np.sqrt(8), is_causal=is_causal,
                                window=kw.get("local_window_size"), q_lengths=ql, kv_lengths=kl,
                                dlse=np.ones((2, T, 2)))
    for g, r in zip(grads, refs):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), r, atol=1e-5)
    # Empty query rows get no gradient.
    dq = np.asarray(grads[0])
    np.testing.assert_array_equal(dq[empty], 0.0)


def test_window_int_is_symmetric_and_matches_jax_nn():
    q, k, v = random_inputs((2, 40, 2, 16), (2, 40, 2, 16), jnp.float32)
    ql, kl = jnp.asarray([40, 25], jnp.int32), jnp.asarray([33, 40], jnp.int32)
    for kw in (dict(local_window_size=5), dict(local_window_size=(7, 2), is_causal=True),
               dict(query_seq_lengths=ql, key_value_seq_lengths=kl, is_causal=True),
               dict(local_window_size=(3, 9), query_seq_lengths=ql, key_value_seq_lengths=kl)):
        ours = jaxattn.flash_attention(q, k, v, implementation="cpu", **kw)
        theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
        # Rows that see no key but are not padding: jax.nn averages the values
        # there (its mask is a large finite negative logit), we give 0.
        _, lse = reference64.forward(q, k, v, scale=0.25, is_causal=kw.get("is_causal", False),
                                     window=kw.get("local_window_size"), q_lengths=kw.get("query_seq_lengths"),
                                     kv_lengths=kw.get("key_value_seq_lengths"))
        padded = np.zeros(lse.shape, bool)
        if "query_seq_lengths" in kw:
            padded = np.arange(40)[None, :, None] >= np.asarray(ql)[:, None, None]
        keep = ~np.isneginf(lse) | padded
        np.testing.assert_allclose(np.asarray(ours)[keep], np.asarray(theirs)[keep], atol=1e-5, rtol=1e-5)
    a = jaxattn.flash_attention(q, k, v, local_window_size=5, implementation="cpu")
    b = jaxattn.flash_attention(q, k, v, local_window_size=(5, 5), implementation="cpu")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_lengths_and_vmap(impl):
    """Lengths are traced values under jit; under vmap they batch with the inputs."""
    q, k, v = random_inputs((3, 2, 33, 4, 16), (3, 2, 47, 2, 16), jnp.float32)
    ql = jnp.asarray([[33, 10], [5, 33], [0, 20]], jnp.int32)
    kl = jnp.asarray([[47, 1], [20, 47], [30, 0]], jnp.int32)

    def f(q, k, v, ql, kl):
        return jaxattn.flash_attention(q, k, v, is_causal=True, local_window_size=(9, 2), implementation=impl,
                                       query_seq_lengths=ql, key_value_seq_lengths=kl)

    out = jax.jit(jax.vmap(f))(q, k, v, ql, kl)
    for i in range(3):
        ref, _ = reference64.forward(q[i], k[i], v[i], scale=0.25, is_causal=True, window=(9, 2),
                                     q_lengths=np.asarray(ql[i]), kv_lengths=np.asarray(kl[i]))
        np.testing.assert_allclose(np.asarray(out[i]), ref, atol=1e-5)
    # Lengths shared across the vmapped axis (not batched).
    out2 = jax.vmap(f, in_axes=(0, 0, 0, None, None))(q, k, v, ql[1], kl[1])
    for i in range(3):
        ref, _ = reference64.forward(q[i], k[i], v[i], scale=0.25, is_causal=True, window=(9, 2),
                                     q_lengths=np.asarray(ql[1]), kv_lengths=np.asarray(kl[1]))
        np.testing.assert_allclose(np.asarray(out2[i]), ref, atol=1e-5)
    # Gradients through vmap against the reference implementation.
    loss = lambda fn: lambda q, k, v: jnp.sum(jax.vmap(fn)(q, k, v, ql, kl) ** 2)
    ref_fn = lambda q, k, v, ql, kl: jaxattn.flash_attention(
        q, k, v, is_causal=True, local_window_size=(9, 2), implementation="reference",
        query_seq_lengths=ql, key_value_seq_lengths=kl)
    g = jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)
    gr = jax.grad(loss(ref_fn), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=5e-5)


def test_unbatched_with_lengths():
    q, k, v = random_inputs((20, 2, 8), (30, 2, 8), jnp.float32)
    for ql, kl in ((jnp.int32(12), jnp.int32(7)), (jnp.asarray([12], jnp.int32), jnp.asarray([7], jnp.int32))):
        out = jaxattn.flash_attention(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, implementation="cpu")
        ref, _ = reference64.forward(q[None], k[None], v[None], scale=1 / np.sqrt(8), is_causal=False,
                                     q_lengths=[12], kv_lengths=[7])
        assert out.shape == q.shape
        np.testing.assert_allclose(np.asarray(out), ref[0], atol=1e-5)


def test_default_implementation_runs_cpu_kernel_with_masks():
    q, k, v = random_inputs((2, 20, 2, 8), (2, 30, 2, 8), jnp.float32)
    kw = dict(local_window_size=(4, 1), key_value_seq_lengths=jnp.asarray([30, 11], jnp.int32))
    assert jaxattn.kernel_for(q, k, v, platform="cpu", **kw) == "cpu:flash"
    a = jaxattn.flash_attention(q, k, v, **kw)
    b = jaxattn.flash_attention(q, k, v, implementation="reference", **kw)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


# ---- logits soft cap ----------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [None, "window_causal", "all"])
@pytest.mark.parametrize("softcap", [0.5, 3.0])
def test_softcap(impl, case, softcap):
    # scale 1/sqrt(H) with H = 32 and N(0, 1) inputs: logits of a few units,
    # so a cap of 0.5 or 3 bends them substantially.
    is_causal, window, ql, kl = CASES[case] if case else (False, None, None, None)
    kw = dict(is_causal=is_causal, window=window, ql=ql, kl=kl, softcap=softcap)
    check_forward(impl, 2, 150, 300, 4, 2, 32, jnp.float32, **kw)
    check_backward(impl, 2, 150, 300, 4, 2, 32, jnp.float32, **kw)


def test_softcap_half_and_lse_grad():
    check_forward("cpu", 2, 70, 90, 4, 2, 64, jnp.bfloat16, is_causal=True, softcap=2.0)
    check_backward("cpu", 2, 70, 90, 4, 2, 64, jnp.float16, is_causal=True, softcap=2.0)
    check_backward("cpu", 2, 70, 90, 4, 2, 16, jnp.float32, window=(9, 9), kl=[90, 40], softcap=1.5,
                   with_lse=True)


def test_softcap_large_is_identity():
    q, k, v = random_inputs((2, 30, 2, 16), (2, 30, 2, 16), jnp.float32)
    a = jaxattn.flash_attention(q, k, v, logits_soft_cap=1e6, implementation="cpu")
    b = jaxattn.flash_attention(q, k, v, implementation="cpu")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("cap,match", [
    (0.0, r"logits_soft_cap must be positive and finite"),
    (-1.0, r"logits_soft_cap must be positive and finite"),
    (float("inf"), r"logits_soft_cap must be positive and finite"),
    ("2", r"logits_soft_cap must be a static Python float, got str"),
    (True, r"logits_soft_cap must be a static Python float, got bool"),
    (jnp.float32(2.0), r"logits_soft_cap must be a static Python float, got a traced or device array"),
])
def test_bad_softcap(cap, match):
    with pytest.raises(ValueError, match=match):
        jaxattn.flash_attention(*_arrays(), logits_soft_cap=cap)


# ---- segment ids (packed documents) -------------------------------------------

def _packed(B, L, rng, min_len, max_len):
    """int32 [B, L] ids of documents of random lengths packed back to back (0, 0, 1, 1, 1, 2, ...)."""
    ids = np.zeros((B, L), np.int32)
    for b in range(B):
        pos, doc = 0, 0
        while pos < L:
            n = int(rng.integers(min_len, max_len + 1))
            ids[b, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return ids


def _segments(case, B, T, S):
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    if case == "unsorted":  # ids need not be contiguous runs
        return rng.integers(0, 3, (B, T)).astype(np.int32), rng.integers(0, 3, (B, S)).astype(np.int32)
    if T != S:  # different packings; some query documents have no key
        return _packed(B, T, rng, 20, 90), _packed(B, S, rng, 10, 200)
    ids = _packed(B, T, rng, 20, 130)
    return ids, ids


# (T, S, K, options) with B = 2, N = 4, H = 32.
SEG_CASES = {
    "packed": (300, 300, 2, {}),
    "packed_causal": (300, 300, 2, dict(is_causal=True)),
    "unsorted": (150, 300, 2, dict(is_causal=True)),
    "x_lengths": (300, 300, 2, dict(is_causal=True, ql=[250, 300], kl=[300, 170])),
    "x_window": (300, 300, 2, dict(window=(40, 10))),
    "x_gqa": (300, 300, 1, dict(is_causal=True)),
    "cross": (150, 300, 2, {}),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(SEG_CASES))
def test_segments(impl, case):
    T, S, K, kw = SEG_CASES[case]
    segs = _segments(case, 2, T, S)
    check_forward(impl, 2, T, S, 4, K, 32, jnp.float32, segs=segs, **kw)
    check_backward(impl, 2, T, S, 4, K, 32, jnp.float32, segs=segs, **kw)


def test_segments_half_and_lse_grad():
    segs = _segments("packed_causal", 2, 200, 200)
    check_forward("cpu", 2, 200, 200, 4, 2, 64, jnp.bfloat16, is_causal=True, segs=segs)
    check_backward("cpu", 2, 200, 200, 4, 2, 64, jnp.float16, is_causal=True, segs=segs)
    check_backward("cpu", 2, 200, 200, 4, 2, 16, jnp.float32, segs=segs, softcap=2.0, with_lse=True)


def test_segments_equal_separate_documents():
    """Packed documents give exactly what each document gives alone (causal)."""
    rng = np.random.default_rng(5)
    lens = [70, 130, 1, 99]
    L = sum(lens)
    ids = np.repeat(np.arange(len(lens)), lens)[None].astype(np.int32)
    q, k, v = random_inputs((1, L, 2, 16), (1, L, 2, 16), jnp.float32)
    seg = jnp.asarray(ids)
    packed = jaxattn.flash_attention(q, k, v, is_causal=True, q_segment_ids=seg, kv_segment_ids=seg,
                                     implementation="cpu")
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        alone = jaxattn.flash_attention(q[:, sl], k[:, sl], v[:, sl], is_causal=True, implementation="cpu")
        np.testing.assert_allclose(np.asarray(packed[:, sl]), np.asarray(alone), atol=2e-6, rtol=2e-6)
        start += n
    del rng


@pytest.mark.parametrize("kw,match", [
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32)), r"must be given together"),
    (dict(q_segment_ids=jnp.zeros((2, 9), jnp.int32), kv_segment_ids=jnp.zeros((2, 12), jnp.int32)),
     r"q_segment_ids must have shape \[B, T\] = \(2, 8\), got \(2, 9\)"),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32), kv_segment_ids=jnp.zeros((1, 12), jnp.int32)),
     r"kv_segment_ids must have shape \[B, S\] = \(2, 12\), got \(1, 12\)"),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.float32), kv_segment_ids=jnp.zeros((2, 12), jnp.int32)),
     r"q_segment_ids must be int32, got float32"),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32), kv_segment_ids=jnp.zeros((2, 12), jnp.int16)),
     r"kv_segment_ids must be int32, got int16"),
    (dict(q_segment_ids=np.zeros((2, 8), np.int64), kv_segment_ids=jnp.zeros((2, 12), jnp.int32)),
     r"q_segment_ids must be int32, got int64"),
    (dict(q_segment_ids=[[0] * 8] * 2, kv_segment_ids=jnp.zeros((2, 12), jnp.int32)),
     r"q_segment_ids must be an int32 array"),
])
def test_bad_segments(kw, match):
    with pytest.raises(ValueError, match=match):
        jaxattn.flash_attention(*_arrays(), **kw)


def test_segments_unbatched_and_vmap():
    q, k, v = random_inputs((3, 40, 2, 8), (3, 40, 1, 8), jnp.float32)
    ids = jnp.asarray(_packed(3, 40, np.random.default_rng(1), 3, 15))
    f = lambda impl: lambda q, k, v, s: jaxattn.flash_attention(q, k, v, is_causal=True, implementation=impl,
                                                                q_segment_ids=s, kv_segment_ids=s)
    out = jax.vmap(f("cpu"))(q, k, v, ids)  # unbatched [T, N, H] per call
    for i in range(3):
        ref, _ = reference64.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], scale=1 / np.sqrt(8), is_causal=True,
                                     q_segment_ids=ids[i:i + 1], kv_segment_ids=ids[i:i + 1])
        np.testing.assert_allclose(np.asarray(out[i]), ref[0], atol=1e-5)
    loss = lambda fn: lambda q, k, v: jnp.sum(jax.vmap(fn)(q, k, v, ids) ** 2)
    g = jax.grad(loss(f("cpu")), argnums=(0, 1, 2))(q, k, v)
    gr = jax.grad(loss(f("reference")), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=5e-5)


# ---- dense bias and mask --------------------------------------------------------

def _dense(shape, kind, seed):
    rng = np.random.default_rng(seed)
    if kind == "bias":
        return rng.standard_normal(shape).astype(np.float32)
    return rng.random(shape) > 0.3


# Shapes broadcastable to [B, N, T, S] = [2, 4, 150, 300] (rank < 4 means leading 1s).
DENSE_SHAPES = [(2, 4, 150, 300), (1, 4, 150, 300), (2, 1, 150, 300), (150, 300), (2, 1, 1, 300),
                (1, 4, 150, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=str)
def test_bias(impl, shape):
    bias = _dense(shape, "bias", len(shape) + sum(shape))
    check_forward(impl, 2, 150, 300, 4, 2, 32, jnp.float32, bias=bias)
    check_backward(impl, 2, 150, 300, 4, 2, 32, jnp.float32, bias=bias)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", DENSE_SHAPES[:-1], ids=str)
def test_mask(impl, shape):
    mask = _dense(shape, "mask", len(shape) + sum(shape))
    check_forward(impl, 2, 150, 300, 4, 2, 32, jnp.float32, mask=mask)
    check_backward(impl, 2, 150, 300, 4, 2, 32, jnp.float32, mask=mask)


# Pairs with B = 2, T = 150, S = 300, N = 4: (K, options, bias shape, mask shape).
DENSE_PAIRS = {
    "bias_mask": (2, {}, (1, 4, 150, 300), (2, 1, 150, 300)),
    "bias_causal": (2, dict(is_causal=True), (2, 4, 150, 300), None),
    "mask_gqa": (1, {}, None, (2, 4, 150, 300)),
    "mask_causal_window": (2, dict(is_causal=True, window=(60, 0)), None, (1, 1, 150, 300)),
    "bias_softcap": (2, dict(softcap=1.5), (1, 1, 150, 300), None),
    "bias_lengths": (2, dict(ql=[100, 150], kl=[300, 77]), (2, 1, 150, 300), None),
    "all": (1, dict(is_causal=True, window=(80, 3), softcap=3.0, kl=[290, 200]), (1, 4, 150, 300),
            (2, 1, 150, 300)),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(DENSE_PAIRS))
def test_dense_pairs(impl, case):
    K, kw, bshape, mshape = DENSE_PAIRS[case]
    bias = None if bshape is None else _dense(bshape, "bias", 1)
    mask = None if mshape is None else _dense(mshape, "mask", 2)
    check_forward(impl, 2, 150, 300, 4, K, 32, jnp.float32, bias=bias, mask=mask, **kw)
    check_backward(impl, 2, 150, 300, 4, K, 32, jnp.float32, bias=bias, mask=mask, **kw)


def test_bias_segments_and_lse_grad():
    segs = _segments("packed_causal", 2, 300, 300)
    bias = _dense((1, 4, 300, 300), "bias", 3)
    check_backward("cpu", 2, 300, 300, 4, 2, 32, jnp.float32, is_causal=True, segs=segs, bias=bias,
                   with_lse=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dense_half_dtypes(dtype):
    bias = _dense((1, 4, 150, 300), "bias", 4).astype(np.float32)
    mask = _dense((2, 1, 150, 300), "mask", 5)
    check_forward("cpu", 2, 150, 300, 4, 2, 64, dtype, bias=bias, mask=mask, is_causal=True)
    check_backward("cpu", 2, 150, 300, 4, 2, 64, dtype, bias=bias, mask=mask, is_causal=True)


def test_bias_dtype_follows_input():
    q, k, v = random_inputs((2, 20, 2, 16), (2, 30, 2, 16), jnp.float32)
    bias = jnp.asarray(_dense((2, 20, 30), "bias", 6), jnp.bfloat16)  # [N, T, S]
    g = jax.grad(lambda b: jnp.sum(jaxattn.flash_attention(q, k, v, b, implementation="cpu") ** 2))(bias)
    gr = jax.grad(lambda b: jnp.sum(jaxattn.flash_attention(q, k, v, b, implementation="reference") ** 2))(bias)
    assert g.dtype == jnp.bfloat16 and g.shape == bias.shape
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(gr, np.float32), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_dense_rows_with_nothing_to_attend(impl):
    """Rows masked out entirely by the mask, or by a -inf bias: 0, -inf, finite gradients."""
    T, S = 40, 70
    q, k, v, dout = random_inputs((2, T, 2, 8), (2, S, 1, 8), jnp.float32, count=4)
    mask = _dense((2, 1, T, S), "mask", 7)
    mask[0, 0, 3] = False
    mask[1, 0, 10:20] = False
    bias = _dense((1, 2, T, S), "bias", 8)
    bias[0, 1, 25] = -np.inf
    bias[0, 0, 30, 5:] = -np.inf  # partly -inf

    def f(q, k, v, b):
        return jaxattn.flash_attention(q, k, v, b, jnp.asarray(mask), return_residual=True, implementation=impl)

    out, lse = jax.jit(f)(q, k, v, jnp.asarray(bias))
    ref_out, ref_lse = reference64.forward(q, k, v, scale=1 / np.sqrt(8), is_causal=False, bias=bias, mask=mask)
    empty = np.isneginf(ref_lse)
    assert empty.sum() == 2 + 10 * 2 + 2  # row 3 (2 heads), rows 10..19 (2 heads), row 25 head 1 (2 batches)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)

    def loss(q, k, v, b):
        out, lse = f(q, k, v, b)
        return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, jnp.asarray(bias))
    refs = reference64.backward(q, k, v, dout, scale=1 / np.sqrt(8), is_causal=False, bias=bias, mask=mask,
                                dlse=np.ones((2, T, 2)))
    for g, r in zip(grads, refs):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), r, atol=1e-5)


def test_dense_vmap():
    """Under vmap: a batched bias / mask, and one shared across the mapped axis."""
    q, k, v = random_inputs((3, 2, 33, 4, 16), (3, 2, 47, 2, 16), jnp.float32)
    bias_b = jnp.asarray(_dense((3, 1, 4, 33, 47), "bias", 9))
    bias_s = jnp.asarray(_dense((2, 1, 33, 47), "bias", 10))
    mask_s = jnp.asarray(_dense((1, 4, 1, 47), "mask", 11))

    def f(impl):
        return lambda q, k, v, b, m: jaxattn.flash_attention(q, k, v, b, m, is_causal=True, implementation=impl)

    for bias, axes in ((bias_b, (0, 0, 0, 0, None)), (bias_s, (0, 0, 0, None, None))):
        loss = lambda fn: lambda q, k, v, b: jnp.sum(jax.vmap(fn, in_axes=axes)(q, k, v, b, mask_s) ** 2)
        got = jax.jit(jax.value_and_grad(loss(f("cpu")), argnums=(0, 1, 2, 3)))(q, k, v, bias)
        want = jax.value_and_grad(loss(f("reference")), argnums=(0, 1, 2, 3))(q, k, v, bias)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.shape == b.shape
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("kw,match", [
    (dict(bias=jnp.zeros((2, 2, 8, 11))), r"bias of shape \(2, 2, 8, 11\) does not broadcast to \[B, N, T, S\] = \(2, 2, 8, 12\)"),
    (dict(bias=jnp.zeros((3, 1, 8, 12))), r"bias of shape \(3, 1, 8, 12\) does not broadcast"),
    (dict(bias=jnp.zeros((1, 2, 2, 8, 12))), r"bias of shape \(1, 2, 2, 8, 12\) does not broadcast"),
    (dict(bias=jnp.zeros((2, 2, 8, 12), jnp.int32)), r"bias must have a floating dtype, got int32"),
    (dict(bias=1.0), r"bias must be an array, got float"),
    (dict(mask=jnp.ones((2, 3, 8, 12), bool)), r"mask of shape \(2, 3, 8, 12\) does not broadcast"),
    (dict(mask=jnp.ones((8, 12), jnp.float32)), r"mask must be a bool array \(True = attend\), got float32"),
    (dict(mask=jnp.ones((8, 12), jnp.int32)), r"mask must be a bool array"),
])
def test_bad_dense(kw, match):
    with pytest.raises(ValueError, match=match):
        jaxattn.flash_attention(*_arrays(), **kw)


def test_bad_dense_unbatched():
    q, k, v = (x[0] for x in _arrays())
    with pytest.raises(ValueError, match=r"bias of shape \(1, 2, 8, 12\) does not broadcast to \[N, T, S\]"):
        jaxattn.flash_attention(q, k, v, bias=jnp.zeros((1, 2, 8, 12)))
    out = jaxattn.flash_attention(q, k, v, bias=jnp.zeros((2, 8, 12)), mask=jnp.ones((12,), bool))
    assert out.shape == q.shape


# ---- bad input ---------------------------------------------------------------

def _arrays(B=2, T=8, S=12):
    return (jnp.ones((B, T, 2, 16)), jnp.ones((B, S, 2, 16)), jnp.ones((B, S, 2, 16)))


@pytest.mark.parametrize("window,match", [
    (-1, r"local_window_size must be non-negative"),
    ((3, -2), r"local_window_size must be non-negative"),
    (2.5, r"local_window_size must be None, a Python int or a \(left, right\) tuple"),
    ((1, 2, 3), r"local_window_size must be None, a Python int or a \(left, right\) tuple"),
    ((1.0, 2), r"local_window_size must be None, a Python int or a \(left, right\) tuple"),
    (True, r"local_window_size must be None, a Python int or a \(left, right\) tuple"),
    ("3", r"local_window_size must be None, a Python int or a \(left, right\) tuple"),
])
def test_bad_window(window, match):
    with pytest.raises(ValueError, match=match):
        jaxattn.flash_attention(*_arrays(), local_window_size=window)


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
@pytest.mark.parametrize("value,match", [
    (jnp.asarray([3, 4, 5], jnp.int32), r"must have shape \(2,\) \(the batch size\), got \(3,\)"),
    (jnp.asarray([[3, 4]], jnp.int32), r"must have shape \(2,\)"),
    (jnp.asarray([3.0, 4.0], jnp.float32), r"must be int32, got float32"),
    (jnp.asarray([3, 4], jnp.int16), r"must be int32, got int16"),
    ([3, 4], r"must be int32 arrays, not lists"),
    (3, r"must be an int32 array of shape \[B\], got int"),
])
def test_bad_lengths(name, value, match):
    with pytest.raises(ValueError, match=f"{name}.*{match}" if "lists" not in match else match):
        jaxattn.flash_attention(*_arrays(), **{name: value})


def test_bad_lengths_unbatched():
    q, k, v = (x[0] for x in _arrays())
    with pytest.raises(ValueError, match=r"query_seq_lengths must have shape \(\) or \(1,\)"):
        jaxattn.flash_attention(q, k, v, query_seq_lengths=jnp.asarray([1, 2], jnp.int32))


# ---- dispatch: which CUDA kernels masked calls run --------------------------------

MASKED = {
    "local_window_size": dict(local_window_size=4),
    "query_seq_lengths": dict(query_seq_lengths=jnp.asarray([3, 8], jnp.int32)),
    "key_value_seq_lengths": dict(key_value_seq_lengths=jnp.asarray([3, 8], jnp.int32)),
    "logits_soft_cap": dict(logits_soft_cap=30.0),
    "q_segment_ids/kv_segment_ids": dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32),
                                         kv_segment_ids=jnp.zeros((2, 12), jnp.int32)),
    "bias": dict(bias=jnp.zeros((1, 2, 8, 12))),
    "mask": dict(mask=jnp.ones((2, 1, 8, 12), bool)),
}
DENSE = ("bias", "mask")


def hopper_built() -> bool:
    """Whether this build has the Hopper kernels (the C++ rule asked for an unmasked call on 9.0)."""
    from jaxattn._extension import _jaxattn
    return jaxattn.dispatch.built_with_cuda() and _jaxattn.cuda_forward_kernel(1, 64, 64, 4, 4, 64, True, 0, 9, 0) == "sm90"


def expected_masked_kernels(feature: str, cc: tuple[int, int], deterministic: bool = False) -> str:
    """The rule, written out: on a Hopper (9.0) build and device, windows, lengths,
    segments and the soft cap run the Hopper forward and backward (deterministic mode
    too); a dense bias / mask, and every other GPU, the portable kernels."""
    del deterministic  # (the same kernels either way)
    hopper = cc == (9, 0) and hopper_built() and feature not in DENSE
    return f"cuda:fwd={'sm90' if hopper else 'sm80'},bwd={'sm90' if hopper else 'sm80'}"


@pytest.fixture
def as_if_built_with_cuda(monkeypatch):
    """The dispatch rule as a CUDA build sees it (the rule itself is host code)."""
    monkeypatch.setattr(jaxattn.dispatch, "built_with_cuda", lambda: True)


@pytest.mark.parametrize("feature", sorted(MASKED))
def test_kernel_for_cuda_platform_masked(feature, as_if_built_with_cuda):
    """kernel_for names the kernels of the rule for this machine's device."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _arrays())
    cc = jaxattn.dispatch._compute_capability()
    want = expected_masked_kernels(feature, cc)
    assert jaxattn.kernel_for(q, k, v, platform="cuda", **MASKED[feature]) == want
    assert jaxattn.kernel_for(q, k, v, platform="gpu", is_causal=True, **MASKED[feature]) == want
    assert (jaxattn.kernel_for(q, k, v, platform="gpu", deterministic=True, **MASKED[feature])
            == expected_masked_kernels(feature, cc, deterministic=True))
    assert jaxattn.kernel_for(q, k, v, implementation="cuda", **MASKED[feature]) == want
    assert jaxattn.kernel_for(q, k, v, implementation="cuda_sm80", **MASKED[feature]) == "cuda:fwd=sm80,bwd=sm80"
    assert jaxattn.kernel_for(q, k, v, platform="cpu", **MASKED[feature]) == "cpu:flash"
    # float32 stays on the reference on GPUs, masked or not; forcing the CUDA kernels says why.
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    assert jaxattn.kernel_for(q32, k32, v32, platform="cuda", **MASKED[feature]) == "reference"
    with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
        jaxattn.kernel_for(q32, k32, v32, implementation="cuda", **MASKED[feature])


@pytest.mark.parametrize("hopper", [False, True])
def test_kernel_names_masked(hopper):
    """The C++ rule (cuda::fwd_on_sm90 / bwd_on_sm90) asked directly for a given device:
    structured masks (1) on the Hopper kernels of a Hopper build, deterministic
    backward included; dense bias / mask (2) never."""
    from jaxattn._extension import _jaxattn
    cc = (9, 0) if hopper else (8, 0)
    sizes = (1, 256, 256, 4, 4, 128, True)
    on_hopper = "sm90" if hopper and hopper_built() else "sm80"
    assert _jaxattn.cuda_forward_kernel(*sizes, 1, *cc) == on_hopper
    assert _jaxattn.cuda_backward_kernel(*sizes, False, 1, *cc) == on_hopper
    assert _jaxattn.cuda_backward_kernel(*sizes, True, 1, *cc) == on_hopper
    assert _jaxattn.cuda_forward_kernel(*sizes, 2, *cc) == "sm80"
    assert _jaxattn.cuda_backward_kernel(*sizes, False, 2, *cc) == "sm80"
    assert _jaxattn.cuda_backward_kernel(*sizes, True, 0, *cc) == on_hopper  # (unmasked: ordered dQ adds)


# ---- sharding: lengths shard along the batch ------------------------------------

_SHARDED = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxattn
    jax.config.update("jax_use_shardy_partitioner", {shardy})
    mesh = jax.make_mesh((2, 2), ("b", "h"))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((4, 33, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((4, 47, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((4, 47, 2, 16)), jnp.float32)
    ql = jnp.asarray([33, 5, 0, 20], jnp.int32)
    kl = jnp.asarray([47, 1, 30, 0], jnp.int32)
    sh = NamedSharding(mesh, P("b", None, "h", None))
    lsh = NamedSharding(mesh, P("b"))
    args = [jax.device_put(x, s) for x, s in ((q, sh), (k, sh), (v, sh), (ql, lsh), (kl, lsh))]
    def f(impl):
        def fn(q, k, v, ql, kl):
            out = jaxattn.flash_attention(q, k, v, is_causal=True, local_window_size=(6, 2), implementation=impl,
                                          query_seq_lengths=ql, key_value_seq_lengths=kl)
            return out, jax.grad(lambda q, k, v: jnp.sum(jaxattn.flash_attention(
                q, k, v, is_causal=True, local_window_size=(6, 2), implementation=impl,
                query_seq_lengths=ql, key_value_seq_lengths=kl) ** 2), argnums=(0, 1, 2))(q, k, v)
        return fn
    got = jax.jit(f("cpu"))(*args)
    want = f("reference")(q, k, v, ql, kl)
    assert got[0].sharding.spec[0] == "b", got[0].sharding
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=5e-5)
    hlo = jax.jit(f("cpu")).lower(*args).compile().as_text()
    assert "all-gather" not in hlo, "inputs were gathered"
    print("OK")
""")


@pytest.mark.parametrize("shardy", [True, False])
def test_sharded_batch_with_lengths(shardy, tmp_path):
    script = tmp_path / "sharded.py"
    script.write_text(_SHARDED.format(shardy=shardy))
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"  # 4 simulated CPU devices, also on a GPU machine
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=str(tmp_path),
                       env=env, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


_SHARDED_DENSE = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"  # 4 CPU devices also on GPU machines
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxattn
    jax.config.update("jax_use_shardy_partitioner", {shardy})
    mesh = jax.make_mesh((2, 2), ("b", "h"))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((4, 33, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((4, 47, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((4, 47, 2, 16)), jnp.float32)
    qs = jnp.asarray(np.sort(rng.integers(0, 3, (4, 33)), axis=1), jnp.int32)
    ks = jnp.asarray(np.sort(rng.integers(0, 3, (4, 47)), axis=1), jnp.int32)
    # Broadcast over the sharded batch (its gradient sums over the "b" shards)
    # and full over the sharded heads; a mask full over the batch.
    bias = jnp.asarray(rng.standard_normal((1, 4, 33, 47)), jnp.float32)
    mask = jnp.asarray(rng.random((4, 1, 33, 47)) > 0.2)
    sh = NamedSharding(mesh, P("b", None, "h", None))
    ssh = NamedSharding(mesh, P("b", None))
    args = [jax.device_put(x, s) for x, s in ((q, sh), (k, sh), (v, sh), (qs, ssh), (ks, ssh),
            (bias, NamedSharding(mesh, P(None, "h"))), (mask, NamedSharding(mesh, P("b"))))]
    def f(impl):
        def attn(q, k, v, qs, ks, bias, mask):
            return jaxattn.flash_attention(q, k, v, bias, mask, is_causal=True, implementation=impl,
                                           q_segment_ids=qs, kv_segment_ids=ks)
        def fn(q, k, v, qs, ks, bias, mask):
            out = attn(q, k, v, qs, ks, bias, mask)
            return out, jax.grad(lambda q, k, v, b: jnp.sum(attn(q, k, v, qs, ks, b, mask) ** 2),
                                 argnums=(0, 1, 2, 3))(q, k, v, bias)
        return fn
    got = jax.jit(f("cpu"))(*args)
    want = f("reference")(q, k, v, qs, ks, bias, mask)
    assert got[0].sharding.spec[0] == "b", got[0].sharding
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=5e-5)
    hlo = jax.jit(f("cpu")).lower(*args).compile().as_text()
    assert "all-gather" not in hlo, "inputs were gathered"
    print("OK")
""")


@pytest.mark.parametrize("shardy", [True, False])
def test_sharded_segments_bias_mask(shardy, tmp_path):
    script = tmp_path / "sharded_dense.py"
    script.write_text(_SHARDED_DENSE.format(shardy=shardy))
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=str(tmp_path),
                       env=env, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_bias_gradient_only_when_differentiated():
    """A bias that is not differentiated costs no dbias (the kernel gets a placeholder)."""
    q, k, v = random_inputs((2, 40, 4, 16), (2, 50, 2, 16), jnp.float32)
    bias = jnp.asarray(_dense((1, 1, 40, 50), "bias", 12))
    f = lambda impl: lambda q, b: jnp.sum(jaxattn.flash_attention(q, k, v, b, implementation=impl) ** 2)

    def bwd_results(argnums):
        hlo = jax.jit(jax.grad(f("cpu"), argnums=argnums)).lower(q, bias).as_text()
        return [line.split("->")[-1] for line in hlo.splitlines() if "jaxattn_cpu_bwd" in line]

    assert all("tensor<1x1x40x50xf32>" not in r and "tensor<1xf32>" in r for r in bwd_results(0))
    assert all("tensor<1x1x40x50xf32>" in r for r in bwd_results(1))
    for argnums in (0, 1, (0, 1)):
        got = jax.grad(f("cpu"), argnums=argnums)(q, bias)
        want = jax.grad(f("reference"), argnums=argnums)(q, bias)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 200])
def test_segment_ranges_table(length):
    """The (min, max) per 64 ids that the CUDA kernels read (unsorted ids, a short last block)."""
    from jaxattn._ffi_calls import SEGMENT_BLOCK, segment_ranges
    ids = np.random.default_rng(length).integers(-5, 9, (3, length)).astype(np.int32)
    got = np.asarray(segment_ranges(jnp.asarray(ids)))
    blocks = -(-length // SEGMENT_BLOCK)
    assert got.shape == (3, blocks, 2) and got.dtype == np.int32
    for t in range(blocks):
        chunk = ids[:, t * SEGMENT_BLOCK:(t + 1) * SEGMENT_BLOCK]
        np.testing.assert_array_equal(got[:, t, 0], chunk.min(axis=1))
        np.testing.assert_array_equal(got[:, t, 1], chunk.max(axis=1))
