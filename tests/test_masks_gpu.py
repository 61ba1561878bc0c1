"""Masks on the CUDA kernels (windows, lengths, segment ids, soft cap, dense bias and mask), forward and
gradients against the float64 reference with the project's error bound; the
GPU dispatch rule. Skipped without a GPU (test_masks.py is the CPU side)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from conftest import CUDA_READY, random_inputs
from test_masks import (CASES, DENSE_PAIRS, DENSE_SHAPES, SEG_CASES, _dense, _packed, _segments, check_backward,
                        check_forward, expected_masked_kernels)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA_READY, reason="needs a CUDA GPU and the CUDA kernels")]

# (head dim, dtype): both half dtypes, H 64 / 128 and a head dim that runs on a
# padded kernel (80 -> 96); 32 / 192 / 256 below.
HEADS = [(64, jnp.bfloat16), (128, jnp.float16), (80, jnp.bfloat16)]
# (H, dtype, T, S): odd T != S both ways, several query and key blocks of every tile.
GRID = [(64, jnp.bfloat16, 333, 257), (128, jnp.float16, 257, 333), (80, jnp.bfloat16, 333, 257),
        (128, jnp.bfloat16, 333, 257)]


def cycled(cases, configs, per_case: int):
    """Each case with `per_case` of the configs, taken in turn (every config is
    used, the GPU time stays small): [(case, *config), ...]."""
    return [(c, *configs[(i * per_case + j) % len(configs)]) for i, c in enumerate(cases) for j in range(per_case)]


@pytest.mark.parametrize("impl", ["cuda", "cuda_sm80"])
def test_masked_calls_dispatch(impl):
    """On this GPU: structured masks on the Hopper kernels of an H100/H200, dense ones
    (and everything on other GPUs, or forced) on the portable kernels."""
    q, k, v = random_inputs((2, 64, 4, 128), (2, 64, 2, 128), jnp.bfloat16)
    lengths = jnp.asarray([30, 64], jnp.int32)
    seg = jnp.zeros((2, 64), jnp.int32)
    cc = jaxattn.dispatch._compute_capability()
    for feature, kw in (("window", dict(local_window_size=8)), ("lengths", dict(query_seq_lengths=lengths)),
                        ("lengths", dict(key_value_seq_lengths=lengths)), ("softcap", dict(logits_soft_cap=20.0)),
                        ("segments", dict(q_segment_ids=seg, kv_segment_ids=seg)),
                        ("bias", dict(bias=jnp.zeros((1, 4, 64, 64)))), ("mask", dict(mask=jnp.ones((64, 64), bool)))):
        want = expected_masked_kernels(feature, cc) if impl == "cuda" else "cuda:fwd=sm80,bwd=sm80"
        assert jaxattn.kernel_for(q, k, v, **kw) == expected_masked_kernels(feature, cc)
        assert jaxattn.kernel_for(q, k, v, implementation=impl, is_causal=True, **kw) == want


@pytest.mark.parametrize("case,H,dtype,T,S", cycled(sorted(CASES), GRID, 2))
def test_window_lengths(case, H, dtype, T, S):
    """Windows (symmetric, one-sided, zero) and lengths, alone and x causal."""
    is_causal, window, ql, kl = CASES[case]
    ql = None if ql is None else [min(x, T) for x in ql]
    kl = None if kl is None else [min(x, S) for x in kl]
    kw = dict(is_causal=is_causal, window=window, ql=ql, kl=kl)
    check_forward("cuda", 2, T, S, 4, 2, H, dtype, **kw)
    check_backward("cuda", 2, T, S, 4, 2, H, dtype, **kw)


@pytest.mark.parametrize("case", ["window_causal", "all"])
def test_forced_portable_kernels(case):
    is_causal, window, ql, kl = CASES[case]
    kw = dict(is_causal=is_causal, window=window, ql=ql, kl=kl)
    check_forward("cuda_sm80", 2, 150, 300, 4, 2, 64, jnp.bfloat16, **kw)
    check_backward("cuda_sm80", 2, 150, 300, 4, 2, 64, jnp.bfloat16, **kw)


@pytest.mark.parametrize("case", ["window_causal", "all", "lengths"])
@pytest.mark.parametrize("H", [32, 192, 256])
def test_window_lengths_other_head_dims(case, H):
    is_causal, window, ql, kl = CASES[case]
    kw = dict(is_causal=is_causal, window=window, ql=ql, kl=kl)
    check_forward("cuda", 2, 150, 300, 4, 2, H, jnp.bfloat16, **kw)
    check_backward("cuda", 2, 150, 300, 4, 2, H, jnp.float16, **kw)


@pytest.mark.parametrize("case,H,dtype", cycled(sorted(SEG_CASES), HEADS, 2))
def test_segments(case, H, dtype):
    """Segments alone and x causal, x padding (lengths), x window, x GQA; unsorted ids."""
    T, S, K, kw = SEG_CASES[case]
    segs = _segments(case, 2, T, S)
    check_forward("cuda", 2, T, S, 4, K, H, dtype, segs=segs, **kw)
    check_backward("cuda", 2, T, S, 4, K, H, dtype, segs=segs, **kw)


@pytest.mark.parametrize("softcap", [2.0, 30.0])
@pytest.mark.parametrize("H,dtype", HEADS)
def test_softcap_gqa(softcap, H, dtype):
    """Soft cap x GQA (4 query heads per key head), x causal, x the lse gradient."""
    check_forward("cuda", 2, 333, 257, 8, 2, H, dtype, softcap=softcap, is_causal=True)
    check_backward("cuda", 2, 333, 257, 8, 2, H, dtype, softcap=softcap, is_causal=True)
    check_backward("cuda", 2, 257, 333, 4, 1, H, dtype, softcap=softcap, with_lse=True)


# Dense bias / mask shapes of test_masks (broadcast against [2, 4, 150, 300]).
@pytest.mark.parametrize("shape,H,dtype", cycled(DENSE_SHAPES, HEADS, 1), ids=str)
def test_bias(shape, H, dtype):
    """The bias read through its broadcast strides; dbias summed over the broadcast dims."""
    bias = _dense(shape, "bias", len(shape) + sum(shape))
    check_forward("cuda", 2, 150, 300, 4, 2, H, dtype, bias=bias)
    check_backward("cuda", 2, 150, 300, 4, 2, H, dtype, bias=bias)


@pytest.mark.parametrize("shape,H,dtype", cycled(DENSE_SHAPES[:-1], HEADS, 1), ids=str)
def test_mask(shape, H, dtype):
    mask = _dense(shape, "mask", len(shape) + sum(shape))
    check_forward("cuda", 2, 150, 300, 4, 2, H, dtype, mask=mask)
    check_backward("cuda", 2, 150, 300, 4, 2, H, dtype, mask=mask)


@pytest.mark.parametrize("case,H,dtype", cycled(sorted(DENSE_PAIRS), HEADS, 2))
def test_dense_pairs(case, H, dtype):
    """Bias x mask, x causal, x window, x GQA, x soft cap, x lengths."""
    K, kw, bshape, mshape = DENSE_PAIRS[case]
    bias = None if bshape is None else _dense(bshape, "bias", 1)
    mask = None if mshape is None else _dense(mshape, "mask", 2)
    check_forward("cuda", 2, 150, 300, 4, K, H, dtype, bias=bias, mask=mask, **kw)
    check_backward("cuda", 2, 150, 300, 4, K, H, dtype, bias=bias, mask=mask, **kw)


@pytest.mark.parametrize("H", [32, 256])
def test_bias_segments_other_head_dims(H):
    segs = _segments("packed_causal", 2, 300, 300)
    bias = _dense((1, 4, 300, 300), "bias", 3)
    check_backward("cuda", 2, 300, 300, 4, 2, H, jnp.bfloat16, is_causal=True, segs=segs, bias=bias, with_lse=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_everything_at_once(dtype):
    segs = _segments("x_lengths", 2, 300, 300)
    kw = dict(is_causal=True, window=(90, 7), ql=[250, 300], kl=[300, 170], softcap=5.0, segs=segs,
              bias=_dense((2, 1, 300, 300), "bias", 8), mask=_dense((1, 8, 300, 300), "mask", 9))
    check_forward("cuda", 2, 300, 300, 8, 2, 128, dtype, **kw)
    check_backward("cuda", 2, 300, 300, 8, 2, 128, dtype, with_lse=True, **kw)


@pytest.mark.parametrize("kw", [
    dict(query_seq_lengths=jnp.asarray([0, 5], jnp.int32)),
    dict(key_value_seq_lengths=jnp.asarray([0, 200], jnp.int32)),
    dict(local_window_size=(0, 0), key_value_seq_lengths=jnp.asarray([100, 200], jnp.int32)),
    dict(q_segment_ids=jnp.asarray(np.repeat([[0, 1, 2]], 2, 0).repeat(100, 1), jnp.int32),
         kv_segment_ids=jnp.asarray(np.repeat([[1, 3]], 2, 0).repeat(100, 1), jnp.int32)),
    dict(mask=jnp.asarray(np.arange(300)[:, None] % 3 != 0).repeat(200, 1)),  # every 3rd row masked
    dict(bias=jnp.where(jnp.arange(300)[:, None] % 4 == 1, -jnp.inf, 0.0).repeat(200, 1)),  # -inf bias rows
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rows_with_nothing_to_attend(kw, dtype):
    """Rows that see no key: output 0, lse -inf, zero gradients, no NaN anywhere."""
    q, k, v, dout = random_inputs((2, 300, 4, 64), (2, 200, 2, 64), dtype, count=4)

    def f(q, k, v):
        return jaxattn.flash_attention(q, k, v, is_causal=True, return_residual=True, **kw)

    out, lse = jax.jit(f)(q, k, v)
    ref, ref_lse = jaxattn.flash_attention(q, k, v, is_causal=True, return_residual=True, implementation="reference",
                                           **kw)
    empty = np.isneginf(np.asarray(ref_lse))
    assert empty.any()
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
    out32 = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out32)) and np.all(out32[empty] == 0)

    def loss(q, k, v):
        o, l = f(q, k, v)
        return jnp.sum(o.astype(jnp.float32) * dout.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0))

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
    dq = np.asarray(dq, np.float32)  # [B, T, N, H]; empty is [B, T, N]
    np.testing.assert_array_equal(dq[np.broadcast_to(empty[..., None], dq.shape)], 0.0)


def test_packed_documents_equal_separate_sequences():
    """4K tokens packed from documents of 100..700 tokens, per-document causal: the same
    output and gradients as each document run alone."""
    ids = _packed(1, 4096, np.random.default_rng(3), 100, 700)
    q, k, v, dout = random_inputs((1, 4096, 8, 128), (1, 4096, 2, 128), jnp.bfloat16, count=4)

    def value_and_grads(q, k, v, dout, **kw):
        def loss(q, k, v):
            out = jaxattn.flash_attention(q, k, v, is_causal=True, **kw)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out, *grads)

    seg = jnp.asarray(ids)
    packed = jax.jit(lambda *a: value_and_grads(*a, q_segment_ids=seg, kv_segment_ids=seg))(q, k, v, dout)
    alone = jax.jit(value_and_grads)
    starts = np.flatnonzero(np.diff(np.r_[-1, ids[0]]))
    for a, b in zip(starts, np.r_[starts[1:], 4096]):
        sl = slice(int(a), int(b))
        for name, x, y in zip(("out", "dq", "dk", "dv"), packed, alone(q[:, sl], k[:, sl], v[:, sl], dout[:, sl])):
            np.testing.assert_allclose(np.asarray(x[:, sl], np.float32), np.asarray(y, np.float32), atol=2e-2,
                                       rtol=2e-2, err_msg=name)


@pytest.mark.parametrize("H", [64, 128, 256])
def test_deterministic_masked_gradients_are_identical_bits(H):
    """deterministic=True with masks (the Hopper backward on an H100/H200, else the
    portable one): identical bits run to run, and the values of the default mode."""
    segs = _segments("packed_causal", 2, 300, 300)
    q, k, v, dout = random_inputs((2, 300, 8, H), (2, 300, 2, H), jnp.bfloat16, count=4)
    qs, ks = (jnp.asarray(s) for s in segs)

    def grads(deterministic):
        def loss(q, k, v):
            out = jaxattn.flash_attention(q, k, v, is_causal=True, local_window_size=(100, 0), q_segment_ids=qs,
                                          kv_segment_ids=ks, logits_soft_cap=10.0, deterministic=deterministic)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    f = grads(True)
    first = [np.asarray(x).view(np.uint16) for x in f(q, k, v)]
    for _ in range(5):
        for a, b in zip(first, f(q, k, v)):
            np.testing.assert_array_equal(a, np.asarray(b).view(np.uint16))
    for name, a, b in zip(("dq", "dk", "dv"), f(q, k, v), grads(False)(q, k, v)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2, rtol=2e-2,
                                   err_msg=name)


# (window, lengths, soft cap, causal, GQA K, ids) of the deterministic masked backward's cases
DETERMINISTIC_CASES = {
    "window_causal": dict(window=(70, 0), is_causal=True),
    "window_both": dict(window=(90, 40)),
    "lengths": dict(ql=[333, 200], kl=[257, 100]),
    "segments_causal_gqa": dict(segs="packed_causal", is_causal=True, K=1),
    "softcap_window_lengths": dict(softcap=15.0, window=(150, 0), is_causal=True, kl=[300, 180]),
}


@pytest.mark.parametrize("case", sorted(DETERMINISTIC_CASES))
@pytest.mark.parametrize("H", [64, 128, 256])
def test_deterministic_masked_backward(case, H):
    """deterministic=True with every structured mask against the float64 reference:
    each key block waits for exactly the blocks of its run above it (a wrong count
    hangs or races, a wrong range gives wrong values). The Hopper backward on an
    H100/H200 (the portable one: test_deterministic_masked_backward_portable)."""
    kw = dict(DETERMINISTIC_CASES[case])
    K = kw.pop("K", 2)
    T = S = 333
    if "segs" in kw:
        kw["segs"] = _segments(kw["segs"], 2, T, S)
    check_backward("cuda", 2, T, S, 4, K, H, jnp.bfloat16, deterministic=True, **kw)


@pytest.mark.parametrize("case", sorted(DETERMINISTIC_CASES))
def test_deterministic_masked_backward_portable(case):
    """The same cases on the portable backward (every GPU but the H100/H200, and
    head dims the Hopper kernels do not cover), whose dQ order is the same."""
    kw = dict(DETERMINISTIC_CASES[case])
    K = kw.pop("K", 2)
    T = S = 333
    if "segs" in kw:
        kw["segs"] = _segments(kw["segs"], 2, T, S)
    check_backward("cuda_sm80", 2, T, S, 4, K, 128, jnp.bfloat16, deterministic=True, **kw)


# ---- document tiles of the Hopper forward (cuda/common/doc_tiles.h) ----------------
def _documents(B, T, rng, lo, hi, pad=0, pad_id=-1):
    """Sorted ids of documents of lo..hi tokens packed back to back, then `pad`
    positions of padding with an id of its own (int32 [B, T])."""
    ids = _packed(B, T - pad, rng, lo, hi)
    return np.concatenate([ids, np.full((B, pad), pad_id, np.int32)], 1)


# name: (T, shortest and longest document, padding, qualifies, options)
DOC_CASES = {
    "causal": (1000, 60, 400, 0, True, dict(is_causal=True)),
    "full": (1000, 60, 400, 0, True, {}),
    "aligned_causal": (1024, 128, 128, 0, True, dict(is_causal=True)),
    "padded_causal": (777, 100, 300, 77, True, dict(is_causal=True)),
    "padding_id_0": (700, 90, 200, 50, True, dict(is_causal=True, pad_id=0, first_id=1)),
    "window_gqa": (1000, 60, 400, 0, True, dict(is_causal=True, window=(150, 0), K=1)),
    "window_both": (900, 200, 500, 0, True, dict(window=(100, 60))),
    "lengths_softcap": (1000, 128, 256, 0, True, dict(is_causal=True, ql=[900, 1000], kl=[1000, 640],
                                                      softcap=20.0)),
    "tiny_documents": (700, 1, 12, 0, False, dict(is_causal=True)),  # more tiles than slots: the usual tiles
}


def _doc_case(case):
    T, lo, hi, pad, qualifies, kw = DOC_CASES[case]
    kw = dict(kw)
    K = kw.pop("K", 2)
    pad_id, first = kw.pop("pad_id", -1), kw.pop("first_id", 0)
    ids = _documents(2, T, np.random.default_rng(len(case) + T), lo, hi, pad, pad_id)
    ids = np.where(np.arange(T) < T - pad, ids + first, ids).astype(np.int32)
    return T, K, ids, qualifies, kw


def _doc_tiles(ids, is_causal, H=128, backward=False):
    """The document tiles' workspace the Hopper forward (backward) writes for these ids."""
    from jaxattn import _ffi_calls
    B, T = ids.shape
    q, k, v, dout = random_inputs((B, T, 2, H), (B, T, 2, H), jnp.bfloat16, count=4)
    seg = jnp.asarray(ids)
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, scale=0.1, is_causal=is_causal, return_doc_tiles=True)

    def run(q, k, v, dout):
        out, lse, tiles = _ffi_calls.cuda_forward(q, k, v, **kw)
        if backward:
            *_, tiles = _ffi_calls.cuda_backward(q, k, v, out, lse, dout, jnp.zeros_like(lse), **kw)
        return tiles
    return np.asarray(jax.jit(run)(q, k, v, dout)).reshape(B, -1, 4)


def _hopper():
    from test_masks import hopper_built
    return jaxattn.dispatch._compute_capability() == (9, 0) and hopper_built()


@pytest.mark.parametrize("case", sorted(DOC_CASES))
@pytest.mark.parametrize("backward", [False, True])
def test_document_tiles_cover_the_documents(case, backward):
    """On the Hopper forward (backward, H=64), qualifying rows get tiles that lie inside
    one document each, cover every row once, start at kDocTileRows multiples from their
    document's start, and come longest first (forward: key blocks seen; backward: query
    rows seeing the keys); the other rows (count -1) keep the usual tiles."""
    if not _hopper():
        pytest.skip("document tiles are the Hopper kernels'")
    T, _, ids, qualifies, kw = _doc_case(case)
    causal = kw.get("is_causal", False)
    tiles = _doc_tiles(ids, causal, H=64 if backward else 128, backward=backward)
    for b in range(ids.shape[0]):
        count = int(tiles[b, 0, 0])
        if not qualifies:
            assert count == -1
            continue
        assert count > 0
        rec = tiles[b, 1:1 + count]
        assert len(rec) == count
        covered = np.zeros(T, int)
        for row0, row_end, ds, de in rec:
            assert 0 <= ds <= row0 < row_end <= de <= T and row_end - row0 <= 128 and (row0 - ds) % 128 == 0
            assert np.all(ids[b, ds:de] == ids[b, row0])  # one document, and all of it
            assert (ds == 0 or ids[b, ds - 1] != ids[b, ds]) and (de == T or ids[b, de] != ids[b, de - 1])
            covered[row0:row_end] += 1
        np.testing.assert_array_equal(covered, 1)
        rows = rec[:, 3] - rec[:, 2]  # the whole document
        if causal:
            rows = rec[:, 3] - rec[:, 0] if backward else rec[:, 1] - rec[:, 2]
        work = -(-rows // 128)
        assert np.all(np.diff(work) <= 0), "longest first"


@pytest.mark.parametrize("case", sorted(DOC_CASES))
@pytest.mark.parametrize("H,dtype", [(64, jnp.bfloat16), (128, jnp.float16), (256, jnp.bfloat16)])
def test_document_tiles(case, H, dtype):
    """Packed documents on document tiles (and rows that do not qualify on the usual
    ones) against the float64 reference, forward (outputs poisoned first) and
    gradients: x causal, x window, x lengths, x soft cap, x GQA, padding ids."""
    T, K, ids, _, kw = _doc_case(case)
    segs = (ids, ids)
    check_forward("cuda", 2, T, T, 4, K, H, dtype, segs=segs, **kw)
    check_backward("cuda", 2, T, T, 4, K, H, dtype, segs=segs, **kw)


def test_document_tiles_fall_back():
    """Ids that are not one run per document, different query and key ids, and
    T != S run the usual tiles (count -1, or no workspace) and stay exact."""
    rng = np.random.default_rng(3)
    T = 640
    docs = _documents(2, T, rng, 50, 200)
    repeated = np.where(np.arange(T) >= T - 100, 0, docs).astype(np.int32)  # id 0 twice: two runs
    if _hopper():
        assert np.all(_doc_tiles(repeated, True)[:, 0, 0] == -1)
        assert np.all(_doc_tiles(repeated, True, H=64, backward=True)[:, 0, 0] == -1)
    check_forward("cuda", 2, T, T, 4, 2, 128, jnp.bfloat16, segs=(repeated, repeated), is_causal=True)
    check_backward("cuda", 2, T, T, 4, 2, 128, jnp.bfloat16, segs=(repeated, repeated), is_causal=True)
    other = _documents(2, T, rng, 50, 200)
    check_forward("cuda", 2, T, T, 4, 2, 128, jnp.bfloat16, segs=(docs, other), is_causal=True)
    check_forward("cuda", 2, T, T + 33, 4, 2, 64, jnp.bfloat16,
                  segs=(docs, _documents(2, T + 33, rng, 50, 200)))
