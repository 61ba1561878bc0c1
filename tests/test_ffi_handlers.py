"""The C++ handlers validate their buffers too: a malformed call returns an error, not a crash."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn._extension import register_targets


def _call(target, out_types, *args, **attrs):
    register_targets()
    return jax.ffi.ffi_call(target, out_types)(*args, **attrs)


def _attrs():
    return {"scale": np.float32(0.25), "is_causal": False, "window_left": np.int32(-1),
            "window_right": np.int32(-1), "softcap": np.float32(0.0), "has_segments": False,
            "has_bias": False, "has_mask": False, "has_lengths": True}


def _lengths(q, k, segments=None, bias=None, mask=None):
    """The CPU targets' mask operands: full lengths, then segment ids and their
    (min, max) tables (segments: ids only, or ids and tables), bias, mask
    (placeholders where None)."""
    B = q.shape[0]
    none = jnp.zeros((1,), jnp.int32)
    segments = (none, none) if segments is None else tuple(segments)
    if len(segments) == 2:
        segments += (none, none)
    return (jnp.full((B,), q.shape[1], jnp.int32), jnp.full((B,), k.shape[1], jnp.int32), *segments,
            jnp.zeros((1, 1, 1, 1), jnp.float32) if bias is None else bias,
            jnp.ones((1, 1, 1, 1), bool) if mask is None else mask)


def test_cpu_handler_rejects_mismatched_heads():
    q = jnp.ones((1, 4, 3, 8), jnp.float32)
    k = jnp.ones((1, 4, 2, 8), jnp.float32)
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32))
    with pytest.raises(Exception, match=r"query heads must be a multiple of key heads"):
        jax.block_until_ready(jax.jit(lambda q, k: _call("jaxattn_cpu_fwd", outs, q, k, k, *_lengths(q, k), **_attrs()))(q, k))


def test_cpu_handler_rejects_wrong_lse_shape():
    q = jnp.ones((1, 4, 2, 8), jnp.float32)
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 4, 3), jnp.float32))
    with pytest.raises(Exception, match=r"lse must have shape"):
        jax.block_until_ready(jax.jit(lambda q: _call("jaxattn_cpu_fwd", outs, q, q, q, *_lengths(q, q), **_attrs()))(q))


def test_cpu_handler_rejects_integer_inputs():
    q = jnp.ones((1, 4, 2, 8), jnp.int32)
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32))
    with pytest.raises(Exception, match=r"dtype must be float32, bfloat16 or float16"):
        jax.block_until_ready(jax.jit(lambda q: _call("jaxattn_cpu_fwd", outs, q, q, q, *_lengths(q, q), **_attrs()))(q))


def test_cpu_handler_rejects_bad_mask_inputs():
    q = jnp.ones((2, 4, 2, 8), jnp.float32)
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32))
    short = jnp.full((1,), 4, jnp.int32)
    with pytest.raises(Exception, match=r"lengths must hold one int32 per batch entry"):
        jax.block_until_ready(jax.jit(lambda q: _call("jaxattn_cpu_fwd", outs, q, q, q, short, short,
                                                      *_lengths(q, q)[2:], **_attrs()))(q))
    bad = dict(_attrs(), window_left=np.int32(-2))
    with pytest.raises(Exception, match=r"window sizes must be >= 0"):
        jax.block_until_ready(jax.jit(lambda q: _call("jaxattn_cpu_fwd", outs, q, q, q, *_lengths(q, q), **bad))(q))
    bad = dict(_attrs(), softcap=np.float32(-1.0))
    with pytest.raises(Exception, match=r"soft cap must be finite and >= 0"):
        jax.block_until_ready(jax.jit(lambda q: _call("jaxattn_cpu_fwd", outs, q, q, q, *_lengths(q, q), **bad))(q))


@pytest.mark.parametrize("what,operands,match", [
    ("has_segments", dict(segments=(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 4), jnp.int32))),
     r"segment ids must be int32 \[batch, T\] and \[batch, S\]"),
    ("has_segments", dict(segments=(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.int32),
                                    jnp.zeros((2, 2, 2), jnp.int32), jnp.zeros((2, 1, 2), jnp.int32))),
     r"segment id range tables must be int32 \[batch, ceil\(T / 64\), 2\]"),
    ("has_bias", dict(bias=jnp.zeros((2, 2, 4, 3), jnp.float32)), r"bias dims \[2, 2, 4, 3\] do not broadcast"),
    ("has_bias", dict(bias=jnp.zeros((4, 3), jnp.float32)), r"bias must have rank >= 4"),
    ("has_mask", dict(mask=jnp.ones((3, 1, 1, 1, 1), bool)), r"mask leading dimensions .* do not divide the batch 2"),
])
def test_cpu_handler_rejects_bad_dense_masks(what, operands, match):
    q = jnp.ones((2, 4, 2, 8), jnp.float32)
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32))
    attrs = dict(_attrs(), **{what: True})
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(jax.jit(lambda q: _call("jaxattn_cpu_fwd", outs, q, q, q, *_lengths(q, q, **operands),
                                                      **attrs))(q))


def test_backward_tail_split_workspace_shape(monkeypatch):
    """The Hopper backward's tail-split workspace (cuda/sm90/bwd_tail.cuh): whole units of
    [2, rows, H] f32, at most TAIL_MAX_UNITS of them, only for calls that may split at head
    dims 64 / 128 in a build with the Hopper kernels on a Hopper GPU; a placeholder [1] otherwise."""
    from jaxattn import _ffi_calls

    k = jax.ShapeDtypeStruct((2, 1000, 4, 128), jnp.bfloat16)  # 8 key blocks x 4 heads x 2 rows
    monkeypatch.setattr(_ffi_calls._jaxattn, "cuda_bwd_tail_rows", lambda: 128, raising=False)
    monkeypatch.setattr(_ffi_calls, "_compute_capability", lambda: (9, 0))
    assert _ffi_calls._dkv_tail_type(k, split=True).shape == (64, 2, 128, 128)
    big = jax.ShapeDtypeStruct((4, 16384, 8, 64), jnp.bfloat16)  # 512 units: capped
    assert _ffi_calls._dkv_tail_type(big, split=True).shape == (_ffi_calls.TAIL_MAX_UNITS, 2, 128, 64)
    assert _ffi_calls._dkv_tail_type(k, split=False).shape == (1,)
    assert _ffi_calls._dkv_tail_type(jax.ShapeDtypeStruct((1, 512, 2, 256), jnp.bfloat16), split=True).shape == (1,)
    monkeypatch.setattr(_ffi_calls, "_compute_capability", lambda: (8, 0))  # an A100: no Hopper kernels run
    assert _ffi_calls._dkv_tail_type(k, split=True).shape == (1,)
    monkeypatch.setattr(_ffi_calls, "_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(_ffi_calls._jaxattn, "cuda_bwd_tail_rows", lambda: 0, raising=False)
    assert _ffi_calls._dkv_tail_type(k, split=True).shape == (1,)


def test_has_masks_matches_every_mask_option():
    """_has_masks (which keeps masked calls off the tail split's workspace) is true for each
    option _mask_operands carries and false for none, as C++ AttnParams::has_masks."""
    from jaxattn import _ffi_calls

    q = jnp.ones((2, 16, 4, 64), jnp.bfloat16)
    lengths = jnp.array([16, 9], jnp.int32)
    ids = jnp.zeros((2, 16), jnp.int32)
    options = {
        "q_lengths": dict(q_lengths=lengths), "kv_lengths": dict(kv_lengths=lengths),
        "window": dict(window=(4, -1)), "window_right": dict(window=(-1, 0)), "softcap": dict(softcap=30.0),
        "segments": dict(q_segment_ids=ids, kv_segment_ids=ids),
        "bias": dict(bias=jnp.zeros((1, 1, 16, 16))), "mask": dict(mask=jnp.ones((1, 1, 16, 16), bool)),
    }
    base = dict(q_lengths=None, kv_lengths=None, window=None, softcap=None, q_segment_ids=None,
                kv_segment_ids=None, bias=None, mask=None)
    assert not _ffi_calls._has_masks(_ffi_calls._mask_operands(q, q, **base)[1])
    for name, option in options.items():
        _, attrs = _ffi_calls._mask_operands(q, q, **{**base, **option})
        assert _ffi_calls._has_masks(attrs), name
