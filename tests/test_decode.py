"""jaxattn.decode_attention and jaxattn.update_kv_cache.

The CPU kernel and the pure-JAX ("xla") implementation against a float64
reference: contiguous and paged caches (random page tables of shuffled
pages), ragged lengths from 1 to the capacity, GQA groups 1/4/8 and MQA, Tq
1 and 4, head dims 64/128/256, every dtype; the split-KV path; windows and
soft caps; run-time clamping of lengths and page ids; bad input; the
dispatch rule; cache writes (in place under donation); and a token-by-token
decode that must equal causal flash attention over the whole sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
import reference64
from jaxattn import decode as d
from conftest import assert_close, device_for, gpu, plain_attention, run_with_command_buffers

# Both versions of the CUDA kernel (1: CUDA cores; 2: cp.async ring + tensor
# cores) run every GPU test.
CUDA_V1 = pytest.param("cuda_v1", marks=[gpu, pytest.mark.gpu])
CUDA_V2 = pytest.param("cuda_v2", marks=[gpu, pytest.mark.gpu])
CUDA = [CUDA_V1, CUDA_V2]
IMPLS = ["cpu", "xla", *CUDA]


def _is_cuda(impl) -> bool:
    return impl is not None and impl.startswith("cuda")


@pytest.fixture(autouse=True)
def _device_of_impl(request, monkeypatch):
    """New arrays live where the implementation under test runs (the CPU
    when a test names none). The CUDA kernels' outputs and split workspace
    start as NaN (JAXATTN_CUDA_DECODE_POISON), so an element they fail to
    write shows."""
    monkeypatch.setenv("JAXATTN_CUDA_DECODE_POISON", "1")
    callspec = getattr(request.node, "callspec", None)
    impl = callspec.params.get("impl", "cpu") if callspec else "cpu"
    with jax.default_device(device_for("cuda" if _is_cuda(impl) else impl)):
        yield


# ---- inputs and the float64 reference --------------------------------------------------------


def make_case(B, T, N, K, H, capacity, dtype, *, page_size=None, seed=0, lengths=None):
    """q, k_cache, v_cache, kv_lengths, block_table (None when contiguous).

    Paged: capacity / page_size pages per row, drawn without replacement
    from a shuffled pool with spare pages; table entries past a row's
    length are garbage (never read).
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    if lengths is None:
        lengths = rng.integers(1, capacity + 1, B)
        lengths[0] = capacity
        if B > 1:
            lengths[1] = 1
    lengths = np.asarray(lengths, np.int32)
    if page_size is None:
        k = rng.standard_normal((B, capacity, K, H)).astype(np.float32)
        v = rng.standard_normal((B, capacity, K, H)).astype(np.float32)
        table = None
    else:
        assert capacity % page_size == 0
        max_pages = capacity // page_size
        num_pages = B * max_pages + 3
        k = rng.standard_normal((num_pages, page_size, K, H)).astype(np.float32)
        v = rng.standard_normal((num_pages, page_size, K, H)).astype(np.float32)
        table = rng.permutation(num_pages)[: B * max_pages].reshape(B, max_pages).astype(np.int32)
        for b in range(B):  # pages past the length: out-of-range ids, never looked up
            used = -(-int(lengths[b]) // page_size)
            table[b, used:] = 10**6
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), jnp.asarray(lengths),
            None if table is None else jnp.asarray(table))


def contiguous64(cache, table):
    cache = np.asarray(cache.astype(jnp.float32), np.float64)
    if table is None:
        return cache
    t = np.clip(np.asarray(table), 0, cache.shape[0] - 1)
    B, mp = t.shape
    return cache[t].reshape(B, mp * cache.shape[1], *cache.shape[2:])


def visible64(lengths, T, S, window_left=None):
    """[B, T, S]: query i of row b at position len - T + i sees keys up to it."""
    lengths = np.clip(np.asarray(lengths), 0, S)
    pos = lengths[:, None] - T + np.arange(T)[None]
    j = np.arange(S)[None, None]
    vis = j <= pos[..., None]
    if window_left is not None:
        vis &= j >= pos[..., None] - window_left
    return vis


def reference_decode(q, k_cache, v_cache, lengths, table, *, scale, window_left=None, softcap=None):
    """(out, lse) float64, and the plain-JAX yardstick in the input dtype."""
    k, v = contiguous64(k_cache, table), contiguous64(v_cache, table)
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    B, T, N, H = q64.shape
    g = N // k.shape[2]
    s = np.einsum("btnh,bsnh->bnts", q64, np.repeat(k, g, 2)) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    vis = visible64(lengths, T, k.shape[1], window_left)
    s = np.where(vis[:, None], s, -np.inf)
    p, m, l = reference64._probs(s)
    out = np.einsum("bnts,bsnh->btnh", p, np.repeat(v, g, 2))
    l, m = l[..., 0], m[..., 0]
    lse = np.where(l > 0, np.log(np.where(l > 0, l, 1.0)) + m, -np.inf).transpose(0, 2, 1)
    kd, vd = (jnp.asarray(x, q.dtype) for x in (k, v))
    plain = plain_attention(q, kd, vd, scale=scale, is_causal=False, mask=vis, softcap=softcap)
    return out, lse, plain


def _dt(impl):
    """float32, or bfloat16 for the half-only CUDA kernel."""
    return jnp.bfloat16 if _is_cuda(impl) else jnp.float32


def check(impl, q, k, v, lengths, table, dtype, **kw):
    if _is_cuda(impl) and dtype == jnp.float32:  # the CUDA kernel is half-only
        q, k, v, dtype = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), jnp.bfloat16
    H = q.shape[-1]
    scale = kw.pop("scale", 1.0 / np.sqrt(H))
    window = kw.get("local_window_size")
    window = window[0] if isinstance(window, tuple) else window  # the right extent does not matter
    softcap = kw.get("logits_soft_cap")
    fn = jax.jit(lambda q, k, v, L, t: jaxattn.decode_attention(
        q, k, v, kv_lengths=L, block_table=t, scale=scale, return_residual=True, implementation=impl, **kw))
    out, lse = fn(q, k, v, lengths, table)
    ref_out, ref_lse, plain = reference_decode(q, k, v, lengths, table, scale=scale, window_left=window,
                                               softcap=softcap)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == jnp.float32
    assert_close("out", out, plain, ref_out, dtype)
    lse = np.asarray(lse)
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], atol=tol, rtol=tol)
    return empty


# ---- against the reference --------------------------------------------------------------------

# (N, K): GQA groups 1, 4, 8 and MQA.
HEADS = [(2, 2), (8, 2), (8, 1), (4, 1)]
LAYOUTS = [None, 16, 64]  # contiguous, paged with page size 16 / 64


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["contiguous", "page16", "page64"])
@pytest.mark.parametrize("heads", HEADS, ids=["g1", "g4", "g8", "mqa"])
@pytest.mark.parametrize("T", [1, 4])
def test_matches_reference(impl, layout, heads, T):
    N, K = heads
    i = LAYOUTS.index(layout) + HEADS.index(heads)
    H = (64, 128, 256)[i % 3]
    dtype = (jnp.float32, jnp.bfloat16, jnp.float16)[(i + T) % 3]
    capacity = 192 if layout != 64 else 256
    case = make_case(3, T, N, K, H, capacity, dtype, page_size=layout, seed=7 * i + T)
    check(impl, *case, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("H", [64, 128, 256, 40])
def test_dtypes_and_head_dims(dtype, H):
    case = make_case(2, 2, 4, 2, H, 96, dtype, page_size=32, seed=H)
    check("cpu", *case, dtype)


@pytest.mark.parametrize("chunk", ["64", "128"])
@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "page16"])
def test_split_kv(monkeypatch, chunk, layout):
    """Many chunks per row, merged by logsumexp (the chunk size is forced)."""
    monkeypatch.setenv("JAXATTN_CPU_DECODE_CHUNK", chunk)
    case = make_case(2, 4, 8, 2, 64, 640, jnp.float32, page_size=layout, seed=3, lengths=[640, 200])
    check("cpu", *case, jnp.float32)
    case = make_case(2, 1, 4, 4, 128, 640, jnp.bfloat16, page_size=layout, seed=4, lengths=[65, 639])
    check("cpu", *case, jnp.bfloat16)


@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("K,H", [(8, 256), (16, 256)], ids=["tile32", "tile16"])
def test_cpu_wide_rows(layout, K, H):
    """Rows of K * H > 1024 elements, which the CPU kernel walks in 32- or 16-key tiles."""
    case = make_case(2, 4, 2 * K, K, H, 240, jnp.bfloat16, page_size=layout, seed=K, lengths=[240, 97])
    check("cpu", *case, jnp.bfloat16, local_window_size=150)


@pytest.mark.parametrize("impl", ["cpu", *CUDA])
@pytest.mark.parametrize("layout", [None, 64], ids=["contiguous", "page64"])
@pytest.mark.parametrize("T", [1, 4])
def test_long_context(impl, layout, T):
    """Rows long enough to be split (on a GPU: the combine kernel)."""
    case = make_case(2, T, 8, 2, 128, 4096, jnp.bfloat16, page_size=layout, seed=T, lengths=[4096, 1500])
    check(impl, *case, jnp.bfloat16)


# The CUDA kernels over page sizes x head dims, each with a different query
# group (rows G * Tq = 1, 2, 4, 8, 16, 32: one or two 16-row tiles in
# version 2, CUDA-core rows in version 1), alternating dtypes, ragged lengths
# 1..capacity on shuffled pages, some with a window / soft cap; "auto" takes
# the launcher's split plan, "chunk80" forces chunks of 80 keys (many splits,
# chunk ends inside a key tile).
CUDA_LAYOUTS = [None, 16, 64, 256]
CUDA_GROUPS = [(4, 4, 1), (8, 4, 1), (32, 8, 1), (8, 1, 1), (8, 2, 4), (8, 1, 4)]  # (N, K, Tq)


@pytest.mark.parametrize("impl", CUDA)
@pytest.mark.parametrize("chunk", ["auto", "chunk80"])
@pytest.mark.parametrize("H", [64, 128, 256])
@pytest.mark.parametrize("layout", CUDA_LAYOUTS, ids=["contiguous", "page16", "page64", "page256"])
def test_cuda_kernels(monkeypatch, impl, chunk, H, layout):
    i = CUDA_LAYOUTS.index(layout) * 3 + (64, 128, 256).index(H)
    N, K, T = CUDA_GROUPS[i % len(CUDA_GROUPS)]
    dtype = (jnp.bfloat16, jnp.float16)[i % 2]
    if chunk != "auto":
        monkeypatch.setenv("JAXATTN_CUDA_DECODE_CHUNK", chunk[len("chunk"):])
    capacity = 3 * (layout or 96)
    B = 4
    lengths = np.random.default_rng(i).integers(1, capacity + 1, B)
    lengths[:3] = [capacity, 1, T + 1]
    case = make_case(B, T, N, K, H, capacity, dtype, page_size=layout, seed=100 + i, lengths=lengths)
    extra = {}
    if i % 4 == 3:
        extra = dict(local_window_size=37, logits_soft_cap=5.0)
    check(impl, *case, dtype, **extra)


# Version 2's loader variants (kV2* bits, cuda/decode/launch_decode.h): the
# session-3 loader, hoisted lookups, kV2Short, kV2Short with the lean loader,
# with PDL, the default without the drift loop (the cp.async loop at H=128), the default,
# the drift loop (the default before session 45, without the register loop), the drift
# loop with A and B swapped (kV2SwapAB), the default's register-streaming loop spelled out
# with kV2RegsAnywhere (the register loop on any GPU: the default takes it only where the
# peak DRAM bandwidth is >= 4 TB/s, e.g. the H200; the drift loop where it cannot run).
V2_VARIANTS = {"old": 0, "hoist": 1, "short": 769, "short_lean": 769 | 4096, "short_pdl": 769 | 2048,
               "default_cpasync": 769 | 4096 | 2048, "default": -1,
               "drift": 769 | 4096 | 2048 | 8192,
               "drift_swap": 769 | 4096 | 2048 | 8192 | 16384,
               "default_regs": 769 | 4096 | 2048 | 8192 | 32768 | 65536,
               # ... with 1 (the default's) or 2 groups a warp prefetched into L2 before the PDL wait
               "regs_warm1": 769 | 4096 | 2048 | 8192 | 32768 | 65536 | (1 << 17),
               "regs_warm2": 769 | 4096 | 2048 | 8192 | 32768 | 65536 | (2 << 17)}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(V2_VARIANTS))
@pytest.mark.parametrize("layout", [None, 16, 64], ids=["contiguous", "page16", "page64"])
def test_cuda_v2_variants(monkeypatch, variant, layout):
    """Every loader variant of version 2 (selected with JAXATTN_CUDA_DECODE_VARIANT)
    matches the float64 reference, ragged rows and forced splits included."""
    monkeypatch.setenv("JAXATTN_CUDA_DECODE_VARIANT", str(V2_VARIANTS[variant]))
    capacity = 5 * (layout or 64) + 64
    lengths = np.array([capacity, 1, 70, capacity - 3])
    with jax.default_device(device_for("cuda")):
        case = make_case(4, 2, 16, 4, 128, capacity, jnp.bfloat16, page_size=layout, seed=7, lengths=lengths)
        check("cuda_v2", *case, jnp.bfloat16)
        monkeypatch.setenv("JAXATTN_CUDA_DECODE_CHUNK", "128")
        check("cuda_v2", *case, jnp.bfloat16, local_window_size=100)
        # A window over three forced chunks, its first key inside a 64-key tile.
        check("cuda_v2", *case, jnp.bfloat16, local_window_size=300)


# The register loop (kV2Regs, H=128): G * Tq <= 8 query rows per KV head run it, more
# fall back to the drift loop; (N, K, Tq) with 1, 4, 8 and 16 rows.
REG_GROUPS = [(8, 8, 1), (32, 8, 1), (8, 1, 1), (8, 2, 2), (16, 2, 2)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("chunk", ["auto", "chunk80"])
@pytest.mark.parametrize("layout", [None, 16, 48, 64, 256], ids=["contiguous", "page16", "page48", "page64",
                                                               "page256"])
def test_cuda_register_loop(monkeypatch, chunk, layout):
    """kV2Regs against the float64 reference: every page size (a 16-key group in one
    page), a contiguous capacity that is no multiple of 16 (the last group's rows past
    the cache are not read), ragged rows, forced 80-key chunks (a chunk ends inside a
    group), 1-16 query rows per KV head, bf16 / fp16, windows and soft caps."""
    monkeypatch.setenv("JAXATTN_CUDA_DECODE_VARIANT", str(V2_VARIANTS["default_regs"]))
    if chunk != "auto":
        monkeypatch.setenv("JAXATTN_CUDA_DECODE_CHUNK", "80")
    capacity = 4 * layout if layout else 293
    with jax.default_device(device_for("cuda")):
        for i, (N, K, T) in enumerate(REG_GROUPS):
            dtype = (jnp.bfloat16, jnp.float16)[i % 2]
            lengths = np.random.default_rng(i).integers(1, capacity + 1, 5)
            lengths[:3] = [capacity, 1, T + 1]
            case = make_case(5, T, N, K, 128, capacity, dtype, page_size=layout, seed=300 + i, lengths=lengths)
            check("cuda_v2", *case, dtype)
            check("cuda_v2", *case, dtype, local_window_size=37 + 16 * i, logits_soft_cap=5.0)


@gpu
@pytest.mark.gpu
def test_cuda_v2_default_loop_follows_the_peak_bandwidth(monkeypatch):
    """At H=128 with <= 8 query rows per KV head, version 2's default runs the register loop
    where the device's peak DRAM bandwidth (as the launcher reads it) is at least
    cuda_decode_regs_min_gbs, e.g. on an H200, and the drift loop below, e.g. on an H100:
    its output is bit for bit that loop's, and not the other loop's (the two sum in other
    orders, so some bf16 outputs differ)."""
    from jaxattn._extension import _jaxattn
    regs_here = _jaxattn.cuda_device_peak_dram_gbs() >= _jaxattn.cuda_decode_regs_min_gbs
    with jax.default_device(device_for("cuda")):
        q, k, v, lengths, table = make_case(4, 1, 32, 8, 128, 2048, jnp.bfloat16, page_size=64, seed=12)
        outs = {}
        for name in ("default", "default_regs", "drift"):
            monkeypatch.setenv("JAXATTN_CUDA_DECODE_VARIANT", str(V2_VARIANTS[name]))
            fn = jax.jit(lambda q, k, v, L, t: jaxattn.decode_attention(
                q, k, v, kv_lengths=L, block_table=t, implementation="cuda_v2"))
            outs[name] = np.asarray(fn(q, k, v, lengths, table), np.float32)
    mine, other = ("default_regs", "drift") if regs_here else ("drift", "default_regs")
    np.testing.assert_array_equal(outs["default"], outs[mine])
    assert not np.array_equal(outs["default"], outs[other])


@pytest.mark.parametrize("impl, variant", [
    ("cpu", None), ("xla", None),
    *(pytest.param(i, v, marks=[gpu, pytest.mark.gpu], id=f"{i}_{v}")
      for i, v in [("cuda_v1", None), ("cuda_v2", None), ("cuda_v2", "default_cpasync"), ("cuda_v2", "drift")])])
@pytest.mark.parametrize("layout", [None, 64], ids=["contiguous", "page64"])
def test_cache_rows_past_the_length_never_reach_the_output(monkeypatch, impl, variant, layout):
    """Cache rows a call does not see (past a row's length, in pages no row uses) may
    hold anything, NaN included (a freed page's old contents), and so may the rows
    before a window: they never reach the output (P = 0 times a NaN value row would),
    and the result is bit for bit the one on a clean cache."""
    if variant is not None:
        monkeypatch.setenv("JAXATTN_CUDA_DECODE_VARIANT", str(V2_VARIANTS[variant]))
    capacity = 4 * (layout or 80)
    lengths = np.array([capacity, 1, 70, 2 * 64 + 5])
    dtype = jnp.float32 if impl in ("cpu", "xla") else jnp.bfloat16
    q, k, v, L, table = make_case(4, 2, 32, 8, 128, capacity, dtype, page_size=layout, seed=5, lengths=lengths)
    def poisoned(window):  # NaN in every row no query of the call sees
        k32, v32 = np.array(k, np.float32), np.array(v, np.float32)
        seen = np.zeros(k32.shape[:2], bool)
        for b, n in enumerate(lengths):
            for j in range(max(0, n - 2 - window) if window is not None else 0, n):
                seen[(b, j) if table is None else (table[b, j // layout], j % layout)] = True
        k32[~seen], v32[~seen] = np.nan, np.nan
        return jnp.asarray(k32, dtype), jnp.asarray(v32, dtype)

    for window in (None, 100):
        kn, vn = poisoned(window)
        fn = jax.jit(lambda k, v: jaxattn.decode_attention(q, k, v, kv_lengths=L, block_table=table,
                                                           local_window_size=window, implementation=impl))
        got, want = np.asarray(fn(kn, vn), np.float32), np.asarray(fn(k, v), np.float32)
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", CUDA)
@pytest.mark.parametrize("knob, bad_values", [("JAXATTN_CUDA_DECODE_CHUNK", ("-1", "9000", "x")),
                                              ("JAXATTN_CUDA_DECODE_VARIANT", ("-2", str(1 << 19), "x"))],
                         ids=["chunk", "variant"])
def test_cuda_bad_knob(monkeypatch, impl, knob, bad_values):
    """The test knobs (forced chunk, loader variant) are checked at trace time."""
    case = make_case(2, 1, 4, 2, 64, 64, jnp.bfloat16)
    for bad in bad_values:
        monkeypatch.setenv(knob, bad)
        with pytest.raises(ValueError, match=knob):
            jaxattn.decode_attention(case[0], case[1], case[2], kv_lengths=case[3], implementation=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [0, 5, 100])
def test_local_window(impl, window):
    case = make_case(3, 4, 4, 2, 64, 256, jnp.float32, page_size=16, seed=window, lengths=[256, 70, 3])
    check(impl, *case, jnp.float32, local_window_size=window)


@pytest.mark.parametrize("impl", IMPLS)
def test_window_tuple_right_ignored(impl):
    case = make_case(2, 4, 4, 2, 64, 128, jnp.float32, seed=1)
    check(impl, *case, jnp.float32, local_window_size=(7, 3))


@pytest.mark.parametrize("impl", IMPLS)
def test_soft_cap_and_scale(impl):
    case = make_case(2, 4, 8, 2, 64, 128, jnp.bfloat16, page_size=32, seed=2)
    check(impl, *case, jnp.bfloat16, logits_soft_cap=3.0, scale=0.5)
    case = make_case(2, 1, 8, 2, 64, 128, jnp.float32, seed=3)
    check(impl, *case, jnp.float32, logits_soft_cap=2.0, local_window_size=16)


# ---- run-time values out of range ----------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_queries_before_the_cache_see_nothing(impl):
    """kv_lengths < Tq: queries at negative positions give 0 and lse -inf."""
    case = make_case(3, 4, 4, 2, 64, 64, jnp.float32, page_size=16, lengths=[2, 0, 4])
    empty = check(impl, *case, jnp.float32)
    assert empty[0, :2].all() and not empty[0, 2:].any()
    assert empty[1].all() and not empty[2].any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "page16"])
def test_lengths_are_clamped(impl, layout):
    """Lengths above the capacity act as the capacity, negative ones as 0."""
    q, k, v, _, table = make_case(3, 2, 4, 2, 64, 64, _dt(impl), page_size=layout)
    big = jnp.asarray([64 + 1, 10**9, -5], jnp.int32)
    out = jaxattn.decode_attention(q, k, v, kv_lengths=big, block_table=table, implementation=impl)
    want = jaxattn.decode_attention(q, k, v, kv_lengths=jnp.asarray([64, 64, 0], jnp.int32),
                                    block_table=table, implementation=impl)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert np.all(np.asarray(out)[2] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_page_ids_are_clamped(impl):
    """Page ids outside [0, num_pages) read the nearest page, never out of bounds."""
    q, k, v, lengths, table = make_case(2, 1, 4, 2, 64, 64, _dt(impl), page_size=16, lengths=[64, 64])
    P = k.shape[0]
    bad = np.asarray(table).copy()
    bad[0, 1], bad[1, 0], bad[1, 3] = -7, P, 2**31 - 1
    clamped = np.clip(bad, 0, P - 1)
    out = jaxattn.decode_attention(q, k, v, kv_lengths=lengths, block_table=jnp.asarray(bad), implementation=impl)
    want = jaxattn.decode_attention(q, k, v, kv_lengths=lengths, block_table=jnp.asarray(clamped),
                                    implementation=impl)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    check(impl, q, k, v, lengths, jnp.asarray(bad), _dt(impl))


# ---- bad input ---------------------------------------------------------------------------------


def _args(**over):
    q = jnp.ones((2, 1, 4, 64), jnp.float32)
    kc = jnp.ones((6, 16, 2, 64), jnp.float32)
    a = dict(query=q, key_cache=kc, value_cache=kc, kv_lengths=jnp.ones((2,), jnp.int32),
             block_table=jnp.zeros((2, 3), jnp.int32))
    a.update(over)
    return a


BAD = {
    "Tq > 16": (dict(query=jnp.ones((2, 17, 4, 64))), "1 to 16 queries"),
    "rank": (dict(query=jnp.ones((1, 4, 64))), "rank 4"),
    "int dtype": (dict(query=jnp.ones((2, 1, 4, 64), jnp.int32)), "bfloat16, float16 or float32"),
    "mixed dtype": (dict(query=jnp.ones((2, 1, 4, 64), jnp.bfloat16)), "one dtype"),
    "k/v shapes": (dict(value_cache=jnp.ones((6, 16, 1, 64))), "one shape"),
    "heads": (dict(query=jnp.ones((2, 1, 3, 64))), "multiple of cache heads"),
    "head dim": (dict(query=jnp.ones((2, 1, 4, 32))), "head dim"),
    "big head dim": (dict(query=jnp.ones((2, 1, 4, 512)), key_cache=jnp.ones((6, 16, 2, 512)),
                      value_cache=jnp.ones((6, 16, 2, 512))), "head dim"),
    "no lengths": (dict(kv_lengths=None), "kv_lengths"),
    "lengths dtype": (dict(kv_lengths=jnp.ones((2,), jnp.float32)), "int32"),
    "lengths shape": (dict(kv_lengths=jnp.ones((3,), jnp.int32)), r"shape \(2,\)"),
    "table dtype": (dict(block_table=jnp.zeros((2, 3), jnp.float32)), "int32"),
    "table shape": (dict(block_table=jnp.zeros((3, 3), jnp.int32)), "block_table must have shape"),
    "page size 8": (dict(key_cache=jnp.ones((6, 8, 2, 64)), value_cache=jnp.ones((6, 8, 2, 64))), "page size"),
    "page size 512": (dict(key_cache=jnp.ones((2, 512, 2, 64)), value_cache=jnp.ones((2, 512, 2, 64))),
                      "page size"),
    "page size 24": (dict(key_cache=jnp.ones((2, 24, 2, 64)), value_cache=jnp.ones((2, 24, 2, 64))),
                     "page size"),
    "contiguous batch": (dict(block_table=None), "batch"),
    "window": (dict(local_window_size=-1), "non-negative"),
    "softcap": (dict(logits_soft_cap=0.0), "positive"),
    "scale": (dict(scale=jnp.float32(1.0)), "static"),
    "implementation": (dict(implementation="triton"), "implementation"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input(name):
    over, match = BAD[name]
    with pytest.raises(ValueError, match=match):
        jaxattn.decode_attention(**_args(**over))
    with pytest.raises(ValueError, match=match):
        jaxattn.decode_kernel_for(**_args(**over))


def test_not_differentiable():
    a = _args()
    with pytest.raises(NotImplementedError, match="not differentiable"):
        jax.grad(lambda q: jaxattn.decode_attention(
            q, a["key_cache"], a["value_cache"], kv_lengths=a["kv_lengths"], block_table=a["block_table"]).sum())(
                a["query"])


def test_ffi_handler_rejects_bad_buffers():
    """The C++ handler validates on its own (a caller bypassing the wrapper)."""
    a = _args(key_cache=jnp.ones((6, 8, 2, 64)), value_cache=jnp.ones((6, 8, 2, 64)))
    spec = d.DecodeSpec(batch=2, seqlen_q=1, num_heads=4, num_heads_k=2, head_dim=64, capacity=24,
                        page_size=8, dtype=jnp.dtype(jnp.float32), scale=1.0, window_left=None, softcap=None)
    with pytest.raises(Exception, match="page size must be a multiple of 16"):
        jax.block_until_ready(d._cpu_decode(a["query"], a["key_cache"], a["value_cache"], a["kv_lengths"],
                                            a["block_table"], spec=spec))


# ---- dispatch ----------------------------------------------------------------------------------


def test_dispatch_rule():
    a = _args()
    assert jaxattn.decode_kernel_for(**a, platform="cpu") == "cpu:decode"
    # float32 is not the CUDA kernel's: the XLA path on GPUs.
    assert jaxattn.decode_kernel_for(**a, platform="gpu") == "xla"
    assert jaxattn.decode_kernel_for(**a, platform="cuda") == "xla"
    assert jaxattn.decode_kernel_for(**a, platform="cpu", implementation="xla") == "xla"
    assert jaxattn.decode_kernel_for(**a, platform="cuda", implementation="cpu") == "cpu:decode"
    half = {k: (x.astype(jnp.bfloat16) if k in ("query", "key_cache", "value_cache") else x) for k, x in a.items()}
    assert jaxattn.decode_kernel_for(**half, platform="rocm") == "xla"
    if jaxattn.built_with_cuda():
        # 16-bit caches on CUDA GPUs run the CUDA kernel by default, in the version
        # measured faster for the cache (version 2, paged with short rows included).
        assert half["block_table"] is not None
        default = d.CUDA_KERNEL_NAMES[d.default_cuda_version(None)]
        assert default == "cuda:decode_v2"
        assert jaxattn.decode_kernel_for(**half, platform="cuda") == default
        assert jaxattn.decode_kernel_for(**half, platform="gpu") == default
        assert jaxattn.decode_kernel_for(**half, implementation="cuda") == default
        assert jaxattn.decode_kernel_for(**half, implementation="cuda_v1") == "cuda:decode"
        assert jaxattn.decode_kernel_for(**half, implementation="cuda_v2") == "cuda:decode_v2"
        with pytest.raises(NotImplementedError, match="float32"):
            jaxattn.decode_kernel_for(**a, implementation="cuda")
        h32 = jnp.ones((6, 16, 2, 32), jnp.bfloat16)
        with pytest.raises(NotImplementedError, match="head dims"):
            jaxattn.decode_kernel_for(**_args(query=jnp.ones((2, 1, 4, 32), jnp.bfloat16), key_cache=h32,
                                              value_cache=h32), implementation="cuda_v2")
    else:
        for impl in ("cuda", "cuda_v1", "cuda_v2"):
            with pytest.raises(NotImplementedError, match="without CUDA"):
                jaxattn.decode_attention(**half, implementation=impl)


def test_cuda_version_choice(monkeypatch):
    """Which CUDA kernel version a call runs: forced by the implementation name,
    else CUDA_DEFAULT_VERSION, which JAXATTN_CUDA_DECODE_VERSION overrides; bad
    values are a ValueError naming the variable."""
    assert d.cuda_version("cuda_v1") == 1 and d.cuda_version("cuda_v2") == 2
    monkeypatch.delenv("JAXATTN_CUDA_DECODE_VERSION", raising=False)
    assert d.cuda_version() == d.cuda_version("cuda") == d.CUDA_DEFAULT_VERSION
    # With a cache: version 2, paged or not (measured on the H200).
    def spec(page_size, capacity):
        return d.DecodeSpec(batch=16, seqlen_q=1, num_heads=32, num_heads_k=8, head_dim=128, capacity=capacity,
                            page_size=page_size, dtype=jnp.bfloat16, scale=0.1, window_left=None, softcap=None)
    assert d.cuda_version(spec=spec(None, 4096)) == 2
    assert d.cuda_version(spec=spec(64, 4096)) == 2
    assert d.cuda_version(spec=spec(16, 256)) == 2
    assert d.cuda_version("cuda_v2", spec(64, 4096)) == 2
    monkeypatch.setenv("JAXATTN_CUDA_DECODE_VERSION", "2")
    assert d.cuda_version(spec=spec(64, 4096)) == 2
    for v in (1, 2):
        monkeypatch.setenv("JAXATTN_CUDA_DECODE_VERSION", str(v))
        assert d.cuda_version() == d.cuda_version("cuda") == v
        assert d.cuda_version("cuda_v1") == 1
    for bad in ("3", "0", "two"):
        monkeypatch.setenv("JAXATTN_CUDA_DECODE_VERSION", bad)
        with pytest.raises(ValueError, match="JAXATTN_CUDA_DECODE_VERSION"):
            d.cuda_version()


def test_default_runs_the_cpu_kernel_on_cpu():
    a = _args()
    hlo = jax.jit(lambda q, k, v, L, t: jaxattn.decode_attention(q, k, v, kv_lengths=L, block_table=t)).lower(
        a["query"], a["key_cache"], a["value_cache"], a["kv_lengths"], a["block_table"]).as_text()
    assert "jaxattn_cpu_decode" in hlo


@gpu
@pytest.mark.gpu
def test_gpu_default_is_cuda_kernel():
    """On a CUDA GPU, implementation=None runs the CUDA decode kernel (version 2, for
    paged caches too) for 16-bit caches and the pure-JAX path for float32."""
    dev = jax.devices("gpu")[0]
    case = [None if x is None else jax.device_put(x, dev)
            for x in make_case(2, 4, 8, 2, 128, 256, jnp.bfloat16, page_size=64)]
    assert jaxattn.decode_kernel_for(*case[:3], kv_lengths=case[3], block_table=case[4]) == "cuda:decode_v2"
    check(None, *case, jnp.bfloat16)
    case32 = [None if x is None else jax.device_put(x, dev)
              for x in make_case(2, 4, 8, 2, 128, 256, jnp.float32, page_size=64)]
    assert jaxattn.decode_kernel_for(*case32[:3], kv_lengths=case32[3], block_table=case32[4]) == "xla"


def test_vmap():
    q, k, v, lengths, _ = make_case(2, 2, 4, 2, 64, 64, jnp.float32)
    qs, ks, vs = (jnp.stack([x, x * 0.5]) for x in (q, k, v))
    ls = jnp.stack([lengths, jnp.maximum(lengths - 3, 0)])
    out = jax.vmap(lambda q, k, v, L: jaxattn.decode_attention(q, k, v, kv_lengths=L, implementation="cpu"))(
        qs, ks, vs, ls)
    for i in range(2):
        want = jaxattn.decode_attention(qs[i], ks[i], vs[i], kv_lengths=ls[i], implementation="cpu")
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(want), rtol=1e-6, atol=1e-6)


# ---- writing the cache --------------------------------------------------------------------------


def test_update_contiguous():
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((3, 10, 2, 8)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((3, 3, 2, 8)), jnp.float32)
    pos = jnp.asarray([0, 8, -1], jnp.int32)  # row 1 partly past the end, row 2 partly before 0
    kc, vc = jaxattn.update_kv_cache(cache, cache * 2, new, new * 3, pos)
    want = np.asarray(cache).copy()
    for b, p in enumerate([0, 8, -1]):
        for i in range(3):
            if 0 <= p + i < 10:
                want[b, p + i] = np.asarray(new)[b, i]
    np.testing.assert_array_equal(np.asarray(kc), want)
    want_v = np.asarray(cache * 2).copy()
    mask = np.asarray(kc) != np.asarray(cache)
    want_v[mask] = np.asarray(kc)[mask] * 3
    np.testing.assert_array_equal(np.asarray(vc), want_v)


def test_update_paged():
    rng = np.random.default_rng(1)
    P, ps, K, H = 7, 16, 2, 8
    cache = jnp.asarray(rng.standard_normal((P, ps, K, H)), jnp.bfloat16)
    table = np.asarray([[3, 0, 5], [6, 1, 99]], np.int32)  # 99: out of range, dropped
    new = jnp.asarray(rng.standard_normal((2, 4, K, H)), jnp.bfloat16)
    pos = np.asarray([14, 30], np.int32)
    kc, _ = jaxattn.update_kv_cache(cache, cache, new, new, jnp.asarray(pos), block_table=jnp.asarray(table))
    want = np.asarray(cache.astype(jnp.float32)).copy()
    for b in range(2):
        for i in range(4):
            p = pos[b] + i
            if p // ps < 3 and 0 <= table[b, p // ps] < P:
                want[table[b, p // ps], p % ps] = np.asarray(new.astype(jnp.float32))[b, i]
    np.testing.assert_array_equal(np.asarray(kc.astype(jnp.float32)), want)


def test_update_in_place_when_donated():
    cache = jnp.asarray(np.random.default_rng(2).standard_normal((8, 16, 2, 8)), jnp.float32)
    vcache = cache + 1
    new = jnp.ones((2, 1, 2, 8), jnp.float32)
    table = jnp.asarray([[1, 2], [4, 5]], jnp.int32)
    fn = jax.jit(lambda k, v, n, p, t: jaxattn.update_kv_cache(k, v, n, n, p, block_table=t), donate_argnums=(0, 1))
    compiled = fn.lower(cache, vcache, new, jnp.zeros((2,), jnp.int32), table).compile()
    assert "input_output_alias" in compiled.as_text()
    ptr = cache.unsafe_buffer_pointer()
    kc, vc = fn(cache, vcache, new, jnp.asarray([3, 20], jnp.int32), table)
    assert cache.is_deleted()
    assert kc.unsafe_buffer_pointer() == ptr
    np.testing.assert_array_equal(np.asarray(kc[1, 3]), 1.0)
    np.testing.assert_array_equal(np.asarray(kc[5, 4]), 1.0)


def test_update_bad_input():
    c = jnp.ones((2, 16, 2, 8))
    with pytest.raises(ValueError, match="one dtype"):
        jaxattn.update_kv_cache(c, c, jnp.ones((2, 1, 2, 8), jnp.bfloat16), jnp.ones((2, 1, 2, 8), jnp.bfloat16),
                                jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="heads"):
        jaxattn.update_kv_cache(c, c, jnp.ones((2, 1, 1, 8)), jnp.ones((2, 1, 1, 8)), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="positions"):
        jaxattn.update_kv_cache(c, c, jnp.ones((2, 1, 2, 8)), jnp.ones((2, 1, 2, 8)), jnp.zeros((3,), jnp.int32))


# ---- decoding token by token equals causal attention over the sequence ---------------------------


@pytest.mark.parametrize("impl", ["cpu", "xla"])
@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "page16"])
def test_incremental_decode_matches_flash_attention(impl, layout):
    """Prefill 5 tokens, then write and attend 1, 3, 1 tokens at a time
    (ragged rows): every step's output equals the matching rows of causal
    attention over the whole sequence."""
    rng = np.random.default_rng(5)
    B, N, K, H, total = 2, 8, 2, 64, 10
    q = jnp.asarray(rng.standard_normal((B, total, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, total, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, total, K, H)), jnp.float32)
    want = jaxattn.flash_attention(q, k, v, is_causal=True)
    if layout is None:
        kc, vc = jnp.zeros((B, 32, K, H), jnp.float32), jnp.zeros((B, 32, K, H), jnp.float32)
        table = None
    else:
        kc, vc = jnp.zeros((6, layout, K, H), jnp.float32), jnp.zeros((6, layout, K, H), jnp.float32)
        table = jnp.asarray([[4, 1], [0, 5]], jnp.int32)
    step = jax.jit(lambda kc, vc, nk, nv, qq, pos, t: _step(kc, vc, nk, nv, qq, pos, t, impl), donate_argnums=(0, 1))
    start = 0
    for n in (5, 1, 3, 1):
        sl = slice(start, start + n)
        pos = jnp.full((B,), start, jnp.int32)
        kc, vc, out = step(kc, vc, k[:, sl], v[:, sl], q[:, sl], pos, table)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want[:, sl]), rtol=2e-5, atol=2e-5)
        start += n


def _step(kc, vc, nk, nv, qq, pos, table, impl):
    kc, vc = jaxattn.update_kv_cache(kc, vc, nk, nv, pos, block_table=table)
    lengths = pos + nk.shape[1]
    return kc, vc, jaxattn.decode_attention(qq, kc, vc, kv_lengths=lengths, block_table=table, implementation=impl)


# ---- Flax layers: KV-cache decoding ------------------------------------------------------------


def _decode_in_steps(call, x, cache, steps):
    outs = []
    start = 0
    for n in steps:
        y, cache = call(x[:, start:start + n], cache)
        outs.append(y)
        start += n
    return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("paged,window,softcap", [(False, None, None), (True, None, None), (False, 3, 4.0),
                                                  (True, (4, 0), None)],
                         ids=["contiguous", "paged", "contiguous-window-softcap", "paged-window"])
def test_flax_nnx_cached_decoding_matches_full_forward(paged, window, softcap):
    """Prefill + token-by-token decoding with the cache equals one causal
    forward over the whole sequence (GQA, rotary embeddings, biases; sliding
    window and soft cap)."""
    pytest.importorskip("flax")
    from flax import nnx

    import jaxattn.flax as jf

    layer = jf.nnx.MultiHeadAttention(32, 4, num_kv_heads=2, head_dim=16, is_causal=True, rope_theta=1e4,
                                      use_bias=True, local_window_size=window, logits_soft_cap=softcap,
                                      rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 12, 32))
    full = layer(x)
    if paged:
        cache = jf.KVCache.create_paged(jnp.asarray([[3, 0], [1, 4]]), 5, 16, 2, 16)
    else:
        cache = jf.KVCache.create(2, 20, 2, 16)
    step = nnx.jit(lambda layer, x, cache: layer(x, cache=cache))
    got, cache = _decode_in_steps(lambda x, c: step(layer, x, c), x, cache, (5, 1, 4, 1, 1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [12, 12])


def test_flax_linen_cached_decoding_matches_full_forward():
    pytest.importorskip("flax")
    import jaxattn.flax as jf

    lin = jf.linen.MultiHeadAttention(num_heads=8, num_kv_heads=1, head_dim=8, is_causal=True, rope_theta=1e4)
    x = jax.random.normal(jax.random.key(2), (3, 9, 24))
    variables = lin.init(jax.random.key(0), x)
    full = lin.apply(variables, x)
    step = jax.jit(lambda v, x, c: lin.apply(v, x, cache=c), donate_argnums=(2,))
    got, _ = _decode_in_steps(lambda x, c: step(variables, x, c), x, jf.KVCache.create(3, 16, 1, 8), (4, 1, 3, 1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=2e-5, atol=2e-5)


def test_flax_cache_errors():
    pytest.importorskip("flax")
    from flax import nnx

    import jaxattn.flax as jf

    layer = jf.nnx.MultiHeadAttention(16, 2, is_causal=True, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 2, 16))
    with pytest.raises(ValueError, match="cache heads"):
        layer(x, cache=jf.KVCache.create(1, 8, 1, 8))
    with pytest.raises(ValueError, match="1 to 16 new tokens"):
        layer(jnp.ones((1, 17, 16)), cache=jf.KVCache.create(1, 32, 2, 8))
    with pytest.raises(ValueError, match="positions"):
        layer(x, cache=jf.KVCache.create(1, 8, 2, 8), positions=jnp.arange(2))
    noncausal = jf.nnx.MultiHeadAttention(16, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="causal"):
        noncausal(x, cache=jf.KVCache.create(1, 8, 2, 8))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["default", "drift", "drift_swap", "default_regs", "regs_warm1", "regs_warm2"])
def test_cuda_decode_reads_the_cache_update_before_it(monkeypatch, variant):
    """A jitted step writes each row's next token into a paged cache, then decodes
    with a query that points at that token (its score dominates): the output is the
    new token's value, as on the XLA path, step after step. The decode kernel is
    launched programmatically right after the cache update, so it must wait for the
    update before it reads the cache (a read of the old row would show at once); the
    register loop's L2 warm-up (regs_warm*) reads the lengths (pos + 1, computed just
    before) and page ids before that wait, as hints only."""
    if variant != "default":
        monkeypatch.setenv("JAXATTN_CUDA_DECODE_VARIANT", str(V2_VARIANTS[variant]))
    with jax.default_device(device_for("cuda")):
        _decode_after_cache_update()


def _decode_after_cache_update():
    rng = np.random.default_rng(11)
    B, N, K, H, ps, pages = 3, 32, 8, 128, 64, 16
    kc = jnp.asarray(rng.standard_normal((B * pages + 2, ps, K, H)), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((B * pages + 2, ps, K, H)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(B * pages + 2)[: B * pages].reshape(B, pages), jnp.int32)
    pos = np.array([63, 500, 959], np.int32)

    def step(kc, vc, nk, nv, q, pos, impl):
        kc, vc = jaxattn.update_kv_cache(kc, vc, nk, nv, pos, block_table=table)
        return kc, vc, jaxattn.decode_attention(q, kc, vc, kv_lengths=pos + 1, block_table=table, implementation=impl)

    cuda_step = jax.jit(lambda *a: step(*a, "cuda_v2"), donate_argnums=(0, 1))
    xla_step = jax.jit(lambda *a: step(*a, "xla"))
    kx, vx = kc, vc
    kc, vc = jnp.copy(kc), jnp.copy(vc)
    for _ in range(4):
        nk = jnp.asarray(rng.standard_normal((B, 1, K, H)), jnp.bfloat16)
        nv = jnp.asarray(rng.standard_normal((B, 1, K, H)), jnp.bfloat16)
        q = 2.0 * jnp.repeat(nk, N // K, axis=2)  # each head's query: its KV head's new key, doubled
        kx, vx, want = xla_step(kx, vx, nk, nv, q, jnp.asarray(pos))
        kc, vc, got = cuda_step(kc, vc, nk, nv, q, jnp.asarray(pos))
        want32, got32 = (np.asarray(x, np.float32) for x in (want, got))
        new_v = np.repeat(np.asarray(nv, np.float32), N // K, axis=2)
        assert np.max(np.abs(want32 - new_v)) < 0.1  # the new token dominates: a stale read would show
        np.testing.assert_allclose(got32, want32, atol=3e-2, rtol=3e-2)
        pos = pos + 1


_GRAPH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, jaxattn
rng = np.random.default_rng(3)
B, N, K, H, ps, pages = 3, 8, 2, 128, 64, 20
q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.bfloat16)
kc = jnp.asarray(rng.standard_normal((B * pages, ps, K, H)), jnp.bfloat16)
vc = jnp.asarray(rng.standard_normal((B * pages, ps, K, H)), jnp.bfloat16)
table = jnp.asarray(rng.permutation(B * pages).reshape(B, pages), jnp.int32)
lengths = jnp.asarray([1, 700, pages * ps], jnp.int32)
def step(q, kc, vc, lengths, table):
    # Two decode calls back to back: the second is launched programmatically
    # after the first (PDL) inside the graph.
    a = jaxattn.decode_attention(q, kc, vc, kv_lengths=lengths, block_table=table, implementation="cuda_v2")
    b = jaxattn.decode_attention(a, kc, vc, kv_lengths=lengths, block_table=table, implementation="cuda_v2")
    return a, b
f = jax.jit(step)
outs = [f(q, kc, vc, lengths, table) for _ in range(4)]
jax.block_until_ready(outs)
hlo = f.lower(q, kc, vc, lengths, table).compile().as_text()
print("COMMAND_BUFFER" if "command_buffer" in hlo else "NO_COMMAND_BUFFER")
ref = jax.jit(lambda *a: jaxattn.decode_attention(*a[:3], kv_lengths=a[3], block_table=a[4], implementation="xla"))
ra = ref(q, kc, vc, lengths, table)
rb = ref(ra, kc, vc, lengths, table)
err = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))) / jnp.max(jnp.abs(y.astype(jnp.float32))))
          for o in outs for x, y in zip(o, (ra, rb)))
same = all(bool(jnp.array_equal(o[1], outs[0][1])) for o in outs)
print("ERR", err, "SAME", same)
"""


@gpu
@pytest.mark.gpu
def test_cuda_decode_inside_cuda_graphs():
    """With XLA command buffers on for custom calls, two chained decode calls (the
    second launched programmatically after the first) run as a CUDA graph and
    match the XLA path, run after run."""
    res = run_with_command_buffers(_GRAPH_SCRIPT, drop_env=("JAXATTN_CUDA_DECODE_POISON",))
    line = [x for x in res.stdout.splitlines() if x.startswith("ERR")][0].split()
    assert float(line[1]) <= 2e-2 and line[3] == "True", line


def test_decode_benchmark_layered_step_on_cpu(tmp_path):
    """benchmarks/decode.py's jitted multi-layer step: every column of a small CPU row
    is timed and agrees with jaxattn's XLA path, per call (per layer), each layer
    on its own query (a step that reused one query would still agree; the stacked
    outputs must then differ between layers)."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "decode.py")
    spec = importlib.util.spec_from_file_location("decode_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rc = bench.main(["--cpu", "--batches", "2", "--contexts", "200", "--layers", "3", "--reps", "1",
                     "--rep-batches", "1", "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    (row,) = json.load(open(tmp_path / "decode.json"))["rows"]
    assert row["layers"] == 3 and row["caches"] == 3
    assert {"jaxattn paged", "jaxattn contiguous", "xla", "xla paged"} <= set(row["impls"])
    for name, rec in row["impls"].items():
        assert rec["ms"] > 0 and rec.get("check_ok", True), (name, rec)
    # A column whose multi-layer step runs out of memory falls back to one layer a
    # step, and is still compared with the others (here: the reference column).
    real, calls = bench.compile_step, []

    def tight(jax_, fn, layers, inputs, warmup):
        calls.append(layers)
        if len(calls) == 1:  # the first column ("jaxattn xla paged"), at 2 layers
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory (test)")
        return real(jax_, fn, layers, inputs, warmup)
    bench.compile_step = tight
    try:
        rc = bench.main(["--cpu", "--batches", "1", "--contexts", "130", "--layers", "2", "--reps", "1",
                         "--rep-batches", "1", "--warmup", "1", "--out", str(tmp_path / "oom")])
    finally:
        bench.compile_step = real
    assert rc == 0
    (row,) = json.load(open(tmp_path / "oom" / "decode.json"))["rows"]
    assert row["impls"]["jaxattn xla paged"]["layers"] == 1 and row["impls"]["xla"]["layers"] == 2
    for name, rec in row["impls"].items():
        assert rec["ms"] > 0 and rec.get("check_ok", True), (name, rec)
    qs = [jnp.ones((1, 1, 4, 8)) * (i + 1) for i in range(2)]
    kc = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 2, 8))
    step = bench.layered(lambda q, kp, vp, kc, vc, L, t: jaxattn.decode_attention(q, kc, vc, kv_lengths=L), 2)
    out = step(qs, [kc], [kc], [kc], [kc * 2], jnp.array([16], jnp.int32), None)
    assert out.shape == (2, 1, 1, 4, 8) and not np.allclose(out[0], out[1])


def test_decode_benchmark_times_the_slope_not_the_batch_overhead():
    """benchmarks/decode.py's measure(): the time of a call is the slope between a batch of
    n and one of 2n back-to-back calls, so a batch's fixed cost (here a 30 ms sync against
    4 ms calls) is reported apart and not charged to the calls."""
    import importlib.util
    import os
    import statistics
    import time
    import types

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "decode.py")
    spec = importlib.util.spec_from_file_location("decode_benchmark_slope", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fake_jax = types.SimpleNamespace(block_until_ready=lambda x: (time.sleep(0.03), x)[1])

    def call():
        time.sleep(0.004)
        return 1

    fixed, lone = [], []
    t, out = bench.measure(fake_jax, call, (), 5, 0, batches=3, fixed=fixed, per_batch=lone)
    assert out == 1
    assert 0.0035 < t < 0.0055, t                              # the call's own 4 ms
    assert 0.025 < statistics.median(fixed) < 0.04, fixed      # the sync, apart
    assert statistics.median(lone) > 0.009, lone               # a lone batch: 4 + 30 / 5 ms a call
