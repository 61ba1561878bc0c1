"""The CPU backward's two forms, fused and two-pass.

The CPU backward runs fused: one task per (batch, kv head), and each tile's P
and dS, computed once, feed dq, dk and dv (5 matrix products). It runs two
passes instead (dq, then dk / dv: 7 products in finer tasks) when a bias
gradient is wanted or when the (batch, kv head) pairs are too few to share
evenly between the threads. JAXATTN_CPU_BWD=fused|two_pass forces one (read
at each call). The other test files run whichever form the rule picks; here
each form runs against the float64 reference, and the two forms must agree
bit for bit: both sum every gradient element in the same order, so the thread
count, which picks the form, never changes a gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
import reference64
import test_backward as backward
import test_masks as masks
from conftest import assert_close, plain_attention, random_inputs

FORMS = ["fused", "two_pass"]


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(params=FORMS)
def form(request, monkeypatch):
    monkeypatch.setenv("JAXATTN_CPU_BWD", request.param)
    return request.param


def test_plain(form):
    # B * K = 1: the rule alone would pick two passes on any machine with 2+ threads.
    backward.check_backward("cpu", 1, 83, 131, 4, 1, 40, "float32", is_causal=True)
    backward.check_backward("cpu", 2, 37, 300, 4, 2, 40, "bfloat16", is_causal=False, with_lse=True)
    backward.check_backward("cpu", 3, 65, 70, 6, 3, 128, "float16", is_causal=True)


@pytest.mark.parametrize("case", ["all", "lengths", "window_asym"])
def test_masks(form, case):
    is_causal, window, ql, kl = masks.CASES[case]
    masks.check_backward("cpu", 2, 150, 300, 4, 2, 32, jnp.float32, is_causal=is_causal, window=window,
                         ql=ql, kl=kl)


def test_segments_softcap_mask(form):
    segs = masks._segments("packed_causal", 2, 300, 300)
    masks.check_backward("cpu", 2, 300, 300, 4, 1, 32, jnp.bfloat16, is_causal=True, segs=segs)
    masks.check_backward("cpu", 2, 70, 90, 4, 2, 16, jnp.float32, window=(9, 9), kl=[90, 40], softcap=1.5,
                         with_lse=True)
    masks.check_backward("cpu", 2, 150, 300, 4, 2, 32, jnp.float32, is_causal=True,
                         mask=masks._dense((2, 1, 150, 300), "mask", 5))


def test_constant_bias(form):
    """A bias that is not differentiated computes no dbias, so it runs either form."""
    B, T, S, N, K, H = 2, 100, 140, 4, 2, 32
    q, k, v, dout = random_inputs((B, T, N, H), (B, S, K, H), jnp.float32, count=4)
    bias = masks._dense((1, N, T, S), "bias", 9)
    scale = 1.0 / np.sqrt(H)

    def loss(q, k, v):
        out = jaxattn.flash_attention(q, k, v, jnp.asarray(bias), is_causal=True, implementation="cpu")
        return jnp.sum(out * dout)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    refs = reference64.backward(q, k, v, dout, scale=scale, is_causal=True, bias=bias)[:3]
    vis = masks._mask64(T, S, True, None, None, None)
    plain = jax.grad(lambda q, k, v: jnp.sum(plain_attention(q, k, v, scale=scale, is_causal=False, mask=vis,
                                                             bias=jnp.asarray(bias)) * dout),
                     argnums=(0, 1, 2))(q, k, v)
    for name, g, pg, r in zip(("dq", "dk", "dv"), grads, plain, refs):
        assert_close(name, g, pg, r, jnp.float32)


# Name -> (B, T, S, N, K, H, dtype, flash_attention keywords); the dense
# operands are numpy here and converted in _grads.
IDENTITY_CASES = {
    "plain_gqa": (2, 300, 300, 8, 2, 64, "bfloat16", {}),
    "causal_odd": (3, 97, 203, 4, 4, 40, "float32", dict(is_causal=True)),
    "masks_all": (2, 150, 300, 4, 2, 32, "float32",
                  dict(is_causal=True, local_window_size=(50, 5), query_seq_lengths=[150, 80],
                       key_value_seq_lengths=[130, 250])),
    "segments": (2, 300, 300, 4, 1, 32, "float16", "segments"),
    "softcap_window": (2, 150, 300, 4, 2, 128, "bfloat16", dict(logits_soft_cap=2.0, local_window_size=(40, 7))),
    "dense_mask_bias": (2, 150, 300, 4, 2, 32, "float32",
                        dict(mask=masks._dense((1, 4, 150, 300), "mask", 6),
                             bias=masks._dense((2, 1, 150, 300), "bias", 7))),
}


def _grads(case, env, monkeypatch):
    B, T, S, N, K, H, dtype, kw = IDENTITY_CASES[case]
    if kw == "segments":
        qs, ks = masks._segments("packed_causal", B, T, S)
        kw = dict(is_causal=True, q_segment_ids=qs, kv_segment_ids=ks)
    kw = {name: jnp.asarray(x) if isinstance(x, (list, np.ndarray)) else x for name, x in kw.items()}
    q, k, v, dout = random_inputs((B, T, N, H), (B, S, K, H), dtype, count=4, seed=T * S + H)
    dlse = jnp.asarray(np.random.default_rng(7).standard_normal((B, T, N)), jnp.float32)

    def loss(q, k, v):
        out, lse = jaxattn.flash_attention(q, k, v, implementation="cpu", return_residual=True, **kw)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)) + jnp.sum(
            jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    out = []
    for name, value in env:
        monkeypatch.setenv(name, value)
        out.append([np.asarray(g.astype(jnp.float32)) for g in fn(q, k, v)])
    return out


@pytest.mark.parametrize("case", sorted(IDENTITY_CASES))
def test_forms_bit_identical(case, monkeypatch):
    fused, two_pass = _grads(case, [("JAXATTN_CPU_BWD", "fused"), ("JAXATTN_CPU_BWD", "two_pass")], monkeypatch)
    for name, a, b in zip(("dq", "dk", "dv"), fused, two_pass):
        assert np.all(np.isfinite(a)), name
        assert np.any(a != 0), name
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_thread_count_does_not_change_gradients(monkeypatch):
    # B * K = 2 tasks: fused on 1 or 2 threads, two passes on 3 (one thread would idle).
    monkeypatch.delenv("JAXATTN_CPU_BWD", raising=False)
    runs = _grads("plain_gqa", [("JAXATTN_CPU_THREADS", n) for n in ("1", "2", "3")], monkeypatch)
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
            np.testing.assert_array_equal(a, b, err_msg=name)
