"""jaxattn.decode_attention: a few new queries against a (paged) KV cache.

Decoding reads the whole cache for one or a few query tokens per row, so it
is memory-bound; the kernels cut each row's cache into chunks (split-KV) and
process the N/K query heads of one KV head together so that every cached
byte is read once. Also ``update_kv_cache``, which writes new keys/values
into either cache layout (in place under ``jax.jit`` with donated caches).

Which implementation runs (``implementation=None``), decided when XLA lowers
the call: the C++ kernel on CPU (``"cpu"``); on CUDA GPUs the CUDA split-KV
kernel (cuda/decode/; bf16/f16, H 64/128/256) where it covers the call; the
pure-JAX gather-then-attend implementation everywhere else (``"xla"``,
jaxattn/decode_reference.py). ``decode_kernel_for`` names the choice.

The CUDA kernel comes in two versions: 1 (CUDA cores, register pipelining) and 2
(cp.async shared-memory ring + mma.sync tensor cores, built for read bandwidth).
``"cuda_v1"`` / ``"cuda_v2"`` force one; ``"cuda"`` and the default take the
measured faster one for the cache (``default_cuda_version``), which the
environment variable ``JAXATTN_CUDA_DECODE_VERSION`` (1 or 2) overrides when a
call is traced.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from . import decode_reference
from ._extension import _jaxattn, built_with_cuda, register_targets
from ._validation import SUPPORTED_DTYPES, MAX_HEAD_DIM, static_scale, static_softcap, static_window

MAX_QUERIES = 16  # Tq
MIN_PAGE_SIZE, MAX_PAGE_SIZE, PAGE_SIZE_MULTIPLE = 16, 256, 16
IMPLEMENTATIONS = (None, "cpu", "xla", "cuda", "cuda_v1", "cuda_v2")
# The CUDA kernel version "cuda" and the default run when no cache is given
# (JAXATTN_CUDA_DECODE_VERSION overrides at trace time); with a cache,
# default_cuda_version decides.
CUDA_DEFAULT_VERSION = 2
# Version 2 runs every cache since its paged loader reads page ids once per tile
# (H200, session 4, benchmarks/decode.py, N=32/K=8, H=128, page size 64: v2 paged
# 2685-4054 GB/s, 1.8-2.8x v1's 1305-1840 at B=16/64, L=4K-64K; contiguous caches:
# v2 1.9-2.8x v1 in session 3). Session 3's v2 paged was slower than v1 at B=16 L=4K.
PAGED_V2_MIN_CAPACITY = 0
CUDA_KERNEL_NAMES = {1: "cuda:decode", 2: "cuda:decode_v2"}


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """The static description of one decode call."""

    batch: int  # B
    seqlen_q: int  # Tq
    num_heads: int  # N
    num_heads_k: int  # K
    head_dim: int  # H
    capacity: int  # keys one row can hold: S_max, or max_pages * page_size
    page_size: int | None  # None: contiguous cache
    dtype: jnp.dtype
    scale: float
    window_left: int | None
    softcap: float | None

    @property
    def paged(self) -> bool:
        return self.page_size is not None


def _shape(x) -> str:
    return str(tuple(x.shape))


def _check_int32(name: str, x, shape: tuple | None, what: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an int32 array {what}, got {type(x).__name__}")
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        raise ValueError(f"{name} must be int32, got {jnp.dtype(x.dtype)}")
    if shape is not None and tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} {what}, got {_shape(x)}")


def check_decode_inputs(query, key_cache, value_cache, *, kv_lengths, block_table=None, scale=None,
                        local_window_size=None, logits_soft_cap=None, implementation=None) -> DecodeSpec:
    """Validates shapes, dtypes and options at trace time; returns the call's spec."""
    for name, x in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be bfloat16, float16 or float32, got {jnp.dtype(x.dtype)}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4, got shape {_shape(x)}")
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise ValueError(f"query and the caches must share one dtype, got {query.dtype}, "
                         f"{key_cache.dtype}, {value_cache.dtype}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache and value_cache must have one shape, got {_shape(key_cache)} and "
                         f"{_shape(value_cache)}")
    B, T, N, H = query.shape
    if not 1 <= T <= MAX_QUERIES:
        raise ValueError(f"decode_attention takes 1 to {MAX_QUERIES} queries per row, got Tq={T} "
                         f"(query {_shape(query)}); use flash_attention for longer queries")
    if key_cache.shape[3] != H:
        raise ValueError(f"cache head dim {key_cache.shape[3]} differs from query head dim {H}")
    if not 1 <= H <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {MAX_HEAD_DIM}], got {H}")
    K = key_cache.shape[2]
    if K == 0 or N % K != 0:
        raise ValueError(f"query heads N={N} must be a multiple of cache heads K={K} "
                         f"(query {_shape(query)}, cache {_shape(key_cache)})")
    if B == 0 or N == 0:
        raise ValueError(f"query must not be empty, got {_shape(query)}")
    if kv_lengths is None:
        raise ValueError("kv_lengths (int32 [B]) is required: the number of valid cached keys per row, "
                         "the new queries' keys included")
    _check_int32("kv_lengths", kv_lengths, (B,), "(one length per row)")
    if block_table is None:
        if key_cache.shape[0] != B:
            raise ValueError(f"contiguous cache [B, S_max, K, H] must have the query's batch {B}, got "
                             f"{_shape(key_cache)} (pass block_table for a paged cache)")
        capacity, page_size = key_cache.shape[1], None
        if capacity < 1:
            raise ValueError(f"cache capacity must be at least 1, got {_shape(key_cache)}")
    else:
        _check_int32("block_table", block_table, None, "[B, max_pages]")
        if block_table.ndim != 2 or block_table.shape[0] != B or block_table.shape[1] < 1:
            raise ValueError(f"block_table must have shape [B={B}, max_pages >= 1], got {_shape(block_table)}")
        num_pages, page_size = key_cache.shape[0], key_cache.shape[1]
        if not (MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE and page_size % PAGE_SIZE_MULTIPLE == 0):
            raise ValueError(f"page size (key_cache.shape[1]) must be a multiple of {PAGE_SIZE_MULTIPLE} in "
                             f"[{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}], got {page_size}")
        if num_pages < 1:
            raise ValueError(f"paged cache holds no page: {_shape(key_cache)}")
        capacity = block_table.shape[1] * page_size
        if capacity > 2**31 - 1:
            raise ValueError("max_pages * page_size is too large")
    window = static_window(local_window_size)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return DecodeSpec(
        batch=B, seqlen_q=T, num_heads=N, num_heads_k=K, head_dim=H, capacity=capacity,
        page_size=page_size, dtype=jnp.dtype(query.dtype), scale=static_scale(scale, H),
        window_left=None if window is None else window[0], softcap=static_softcap(logits_soft_cap),
    )


# ---- dispatch -----------------------------------------------------------------------------


CUDA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDA_HEAD_DIMS = (64, 128, 256)


def cuda_unsupported_reason(spec: DecodeSpec) -> str | None:
    """Why the CUDA decode kernel cannot run `spec`, or None when it can."""
    if not built_with_cuda():
        return "jaxattn was built without CUDA kernels (nvcc was not found at build time)"
    if spec.dtype not in CUDA_DTYPES:
        return f"the CUDA decode kernel takes bfloat16 or float16, not {spec.dtype}"
    if spec.head_dim not in CUDA_HEAD_DIMS:
        return f"the CUDA decode kernel takes head dims {CUDA_HEAD_DIMS}, got {spec.head_dim}"
    return None


def _env_int(name: str, default: int, allowed) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value not in allowed:
        raise ValueError(f"environment variable {name}={text!r} must be an integer in {allowed}")
    return value


def default_cuda_version(spec: DecodeSpec | None) -> int:
    """The measured faster CUDA kernel version for a cache: 2 (paged caches with rows
    below PAGED_V2_MIN_CAPACITY keys: 1; no such rows since session 4);
    CUDA_DEFAULT_VERSION without a spec."""
    if spec is None:
        return CUDA_DEFAULT_VERSION
    return 1 if spec.paged and spec.capacity < PAGED_V2_MIN_CAPACITY else 2


def cuda_version(implementation=None, spec: DecodeSpec | None = None) -> int:
    """The CUDA decode kernel version a call with this `implementation` (and cache
    `spec`) runs."""
    if implementation == "cuda_v1":
        return 1
    if implementation == "cuda_v2":
        return 2
    return _env_int("JAXATTN_CUDA_DECODE_VERSION", default_cuda_version(spec), range(1, 3))


def kernel_for_spec(spec: DecodeSpec, platform: str) -> str:
    """The implementation `implementation=None` uses on `platform`: 'cpu:decode' on CPUs,
    the CUDA kernel ('cuda:decode', or 'cuda:decode_v2' for version 2) on CUDA GPUs
    where it covers the call, else 'xla'."""
    if platform == "cpu":
        return "cpu:decode"
    if platform in ("cuda", "gpu") and cuda_unsupported_reason(spec) is None:
        return CUDA_KERNEL_NAMES[cuda_version(spec=spec)]
    return "xla"


def decode_kernel_for(query, key_cache, value_cache, *, kv_lengths, block_table=None, scale=None,
                      local_window_size=None, logits_soft_cap=None, implementation=None,
                      platform=None) -> str:
    """Names the implementation ``decode_attention`` uses for these arguments.

    ``platform`` defaults to ``jax.default_backend()``. Raises what
    ``decode_attention`` would raise.
    """
    spec = check_decode_inputs(query, key_cache, value_cache, kv_lengths=kv_lengths, block_table=block_table,
                               scale=scale, local_window_size=local_window_size,
                               logits_soft_cap=logits_soft_cap, implementation=implementation)
    _check_forced(spec, implementation)
    if implementation == "cpu":
        return "cpu:decode"
    if implementation == "xla":
        return "xla"
    if implementation in ("cuda", "cuda_v1", "cuda_v2"):
        return CUDA_KERNEL_NAMES[cuda_version(implementation, spec)]
    return kernel_for_spec(spec, platform or jax.default_backend())


def _check_forced(spec: DecodeSpec, implementation) -> None:
    if implementation in ("cuda", "cuda_v1", "cuda_v2"):
        reason = cuda_unsupported_reason(spec)
        if reason is not None:
            raise NotImplementedError(f"implementation={implementation!r} is unsupported here: {reason}")


# ---- the implementations ------------------------------------------------------------------


def _decode_attrs(spec: DecodeSpec) -> dict:
    """The decode targets' attributes, as their exact C++ types."""
    return dict(
        scale=np.float32(spec.scale),
        window_left=np.int32(-1 if spec.window_left is None else spec.window_left),
        softcap=np.float32(0.0 if spec.softcap is None else spec.softcap),
        paged=bool(spec.paged),
    )


# block_table is an unread int32 [1] for a contiguous cache.
def _cpu_decode(q, k, v, kv_lengths, block_table, *, spec: DecodeSpec):
    register_targets()
    out_types = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32))
    # The handler takes exactly [B, Tq, N, H]: under vmap, one call per entry.
    return jax.ffi.ffi_call("jaxattn_cpu_decode", out_types, vmap_method="sequential")(
        q, k, v, kv_lengths, block_table, **_decode_attrs(spec))


def _cuda_debug_options() -> tuple[int, bool, int]:
    """Test knobs of the CUDA decode kernels, read at trace time:
    JAXATTN_CUDA_DECODE_CHUNK=n cuts every row into chunks of n keys (many
    splits at small sizes; 0 = the launcher's plan), JAXATTN_CUDA_DECODE_POISON=1
    fills the outputs and the split workspace with NaN before the kernels run,
    JAXATTN_CUDA_DECODE_VARIANT=bits runs version 2 with those kV2* loader bits
    (cuda/decode/launch_decode.h; -1 = the default; benchmarks' A/B)."""
    chunk = _env_int("JAXATTN_CUDA_DECODE_CHUNK", 0, range(0, _jaxattn.cuda_decode_max_forced_chunk + 1))
    poison = _env_int("JAXATTN_CUDA_DECODE_POISON", 0, range(0, 2)) == 1
    variant = _env_int("JAXATTN_CUDA_DECODE_VARIANT", -1, range(-1, _jaxattn.cuda_decode_variant_end))
    return chunk, poison, variant


def _cuda_decode(q, k, v, kv_lengths, block_table, *, spec: DecodeSpec, version: int):
    register_targets()
    B, T, N, H = q.shape
    K = spec.num_heads_k
    rows = T * (N // K)
    chunk, poison, variant = _cuda_debug_options()
    splits = _jaxattn.cuda_decode_max_splits(spec.capacity, chunk)
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32),
        jax.ShapeDtypeStruct((B, K, splits, rows, H), jnp.float32),  # split-KV workspace
        jax.ShapeDtypeStruct((B, K, splits, rows), jnp.float32),
    )
    out, lse, _, _ = jax.ffi.ffi_call("jaxattn_cuda_decode", out_types, vmap_method="sequential")(
        q, k, v, kv_lengths, block_table, **_decode_attrs(spec), version=np.int32(version),
        chunk=np.int32(chunk), variant=np.int32(variant), poison=bool(poison))
    return out, lse


def _xla_decode(q, k, v, kv_lengths, block_table, *, spec: DecodeSpec):
    return decode_reference.attention(q, k, v, kv_lengths, block_table if spec.paged else None,
                                      scale=spec.scale, window_left=spec.window_left, softcap=spec.softcap)


def _no_gradient(fn):
    """fn, with a JVP that raises: decoding is inference-only."""
    wrapped = jax.custom_jvp(fn)

    def jvp(primals, tangents):
        raise NotImplementedError("decode_attention is not differentiable (an inference kernel); "
                                  "use flash_attention for training")

    wrapped.defjvp(jvp)
    return wrapped


def decode_attention(query, key_cache, value_cache, *, kv_lengths, block_table=None, scale=None,
                     local_window_size=None, logits_soft_cap=None, return_residual=False,
                     implementation=None):
    """Attention of a few new queries per row over a contiguous or paged KV cache.

    Args:
      query: ``[B, Tq, N, H]``, 1 <= Tq <= 16, bfloat16, float16 or float32.
        Query ``i`` of row ``b`` sits at position ``kv_lengths[b] - Tq + i``
        and attends causally to the cached keys up to it (bottom-right
        aligned: the new tokens' own keys must already be in the cache, see
        ``update_kv_cache``).
      key_cache, value_cache: contiguous ``[B, S_max, K, H]``, or paged
        ``[num_pages, page_size, K, H]`` with ``block_table``; ``N % K == 0``
        (GQA/MQA); the query's dtype. Page size: a multiple of 16 in [16, 256].
      kv_lengths: int32 ``[B]``, valid keys per row (traced values allowed).
      block_table: int32 ``[B, max_pages]``, the pages of each row in order
        (key ``j`` is row ``j % page_size`` of page ``block_table[b, j //
        page_size]``), or None for a contiguous cache.
      scale: static float multiplying ``q.k``; default ``1/sqrt(H)``.
      local_window_size: None, ``w`` or ``(w, right)``: a query at position
        ``pos`` sees keys ``pos - w <= j <= pos`` (``right`` does not matter:
        the queries are causal).
      logits_soft_cap: static positive ``c``: logits become
        ``c * tanh(logits / c)``.
      return_residual: also return the natural-log logsumexp, float32
        ``[B, Tq, N]``.
      implementation: None (per platform: ``"cpu"`` on CPU, the CUDA kernel
        on CUDA GPUs where it covers the call, else ``"xla"``), ``"cpu"``,
        ``"xla"`` (pure JAX: gathers the pages, then attends) or ``"cuda"``
        (the CUDA split-KV kernel, bfloat16/float16, H in 64/128/256, version
        ``CUDA_DEFAULT_VERSION``; ``"cuda_v1"`` / ``"cuda_v2"`` force a
        version; NotImplementedError where it cannot run).

    Values known only at run time never make the kernels read out of bounds:
    ``kv_lengths`` are clamped to [0, capacity] (capacity = ``S_max`` or
    ``max_pages * page_size``); page ids are clamped to [0, num_pages), and
    only the pages below a row's length are looked up; a query whose
    position is negative (``kv_lengths[b] < Tq``) sees no key and gets
    output 0 and lse ``-inf``. Not differentiable.

    Returns:
      ``out`` with the query's shape and dtype, or ``(out, lse)``.
    """
    spec = check_decode_inputs(query, key_cache, value_cache, kv_lengths=kv_lengths, block_table=block_table,
                               scale=scale, local_window_size=local_window_size,
                               logits_soft_cap=logits_soft_cap, implementation=implementation)
    _check_forced(spec, implementation)
    if not isinstance(return_residual, (bool, np.bool_)):
        raise ValueError(f"return_residual must be a Python bool, got {type(return_residual).__name__}")
    cpu = functools.partial(_cpu_decode, spec=spec)
    xla = functools.partial(_xla_decode, spec=spec)
    if implementation == "cpu":
        fn = cpu
    elif implementation in ("cuda", "cuda_v1", "cuda_v2"):
        fn = functools.partial(_cuda_decode, spec=spec, version=cuda_version(implementation, spec))
    elif implementation == "xla":
        fn = xla
    else:
        cuda = (functools.partial(_cuda_decode, spec=spec, version=cuda_version(spec=spec))
                if cuda_unsupported_reason(spec) is None else xla)

        def fn(*args):
            return jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=xla)
    table = block_table if spec.paged else jnp.zeros((1,), jnp.int32)
    out, lse = _no_gradient(fn)(query, key_cache, value_cache, kv_lengths, table)
    return (out, lse) if return_residual else out


# ---- writing the cache --------------------------------------------------------------------


def update_kv_cache(key_cache, value_cache, new_key, new_value, positions, *, block_table=None):
    """Writes ``new_key`` / ``new_value`` ``[B, Tn, K, H]`` into the caches.

    Token ``i`` of row ``b`` goes to position ``positions[b] + i`` of that
    row (``positions``: int32 ``[B]``, typically the lengths before the
    write); in a paged cache position ``p`` is row ``p % page_size`` of page
    ``block_table[b, p // page_size]``. Writes outside a row's capacity, or
    to a page id outside [0, num_pages), are dropped. Returns the new
    ``(key_cache, value_cache)``; under ``jax.jit`` with the caches donated
    (``donate_argnums``) XLA updates them in place.
    """
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache), ("new_key", new_key),
                    ("new_value", new_value)):
        if not hasattr(x, "shape") or x.ndim != 4:
            raise ValueError(f"{name} must be a rank-4 array, got {getattr(x, 'shape', type(x).__name__)}")
    if key_cache.shape != value_cache.shape or new_key.shape != new_value.shape:
        raise ValueError(f"key/value shapes differ: caches {_shape(key_cache)}, {_shape(value_cache)}; "
                         f"new {_shape(new_key)}, {_shape(new_value)}")
    if not (key_cache.dtype == value_cache.dtype == new_key.dtype == new_value.dtype):
        raise ValueError(f"the caches and the new keys/values must share one dtype, got {key_cache.dtype}, "
                         f"{value_cache.dtype}, {new_key.dtype}, {new_value.dtype}")
    B, Tn, K, H = new_key.shape
    if key_cache.shape[2:] != (K, H):
        raise ValueError(f"new keys [B, Tn, K, H] {_shape(new_key)} do not match the cache's heads "
                         f"{_shape(key_cache)}")
    _check_int32("positions", positions, (B,), "(one start position per row)")
    pos = positions[:, None] + jnp.arange(Tn, dtype=jnp.int32)[None, :]  # [B, Tn]
    if block_table is None:
        if key_cache.shape[0] != B:
            raise ValueError(f"contiguous cache [B, S_max, K, H] must have batch {B}, got {_shape(key_cache)}")
        S = key_cache.shape[1]
        valid = (pos >= 0) & (pos < S)
        flat = jnp.arange(B, dtype=jnp.int32)[:, None] * S + pos
        total = B * S
    else:
        _check_int32("block_table", block_table, None, "[B, max_pages]")
        if block_table.ndim != 2 or block_table.shape[0] != B:
            raise ValueError(f"block_table must have shape [B={B}, max_pages], got {_shape(block_table)}")
        P, ps = key_cache.shape[:2]
        max_pages = block_table.shape[1]
        slot = pos // ps
        valid = (pos >= 0) & (slot < max_pages)
        page = jnp.take_along_axis(block_table, jnp.clip(slot, 0, max_pages - 1), axis=1)
        valid = valid & (page >= 0) & (page < P)
        flat = page * ps + pos % ps
        total = P * ps
    # Dropped writes go to index `total`, out of bounds (mode="drop").
    flat = jnp.where(valid, flat, total).reshape(-1)

    def write(cache, new):
        rows = cache.reshape(total, K, H).at[flat].set(new.reshape(B * Tn, K, H), mode="drop")
        return rows.reshape(cache.shape)

    return write(key_cache, new_key), write(value_cache, new_value)
