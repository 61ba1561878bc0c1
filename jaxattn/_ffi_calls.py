"""The jax.ffi.ffi_call of each compiled kernel: output types, workspace, attributes.

Each takes rank-4 arrays [B, T, N, H] / [B, S, K, H]. Under vmap the calls
get extra leading dimensions ("broadcast_all"), which the C++ handlers fold
into the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._extension import _jaxattn, register_targets
from .dispatch import _compute_capability

_VMAP = "broadcast_all"
# Query rows per dQ-ordering counter of the deterministic backward
# (kDqSemaphoreRows in cuda/common/params.h).
DQ_SEMAPHORE_ROWS = 32


def _attrs(scale: float, is_causal: bool) -> dict:
    # Exact C++ types of the handlers' attributes: float and bool.
    return {"scale": np.float32(scale), "is_causal": bool(is_causal)}


def _forward(target: str, q, k, v, scale: float, is_causal: bool, *operands, workspace=(), **extra):
    """(out, lse, *workspace) of a forward ffi_call (`workspace`: the types of extra outputs)."""
    register_targets()
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32),
    ) + tuple(workspace)
    return tuple(jax.ffi.ffi_call(target, out_types, vmap_method=_VMAP)(
        q, k, v, *operands, **_attrs(scale, is_causal), **extra
    ))


# Rows per document tile of the Hopper forward and the slots per row
# (kDocTileRows, doc_tile_capacity in cuda/common/doc_tiles.h).
DOC_TILE_ROWS = 128


def doc_tile_ints(T: int) -> int:
    """int32 per batch row of the document tiles' workspace (cuda/common/doc_tiles.h)."""
    m = -(-T // DOC_TILE_ROWS)
    return 4 * (m + m // 4 + 4 + 1)


# Items per entry of the segment-id (min, max) tables (cuda/common/params.h kSegmentBlock).
SEGMENT_BLOCK = 64


def segment_ranges(ids):
    """(min, max) of each block of SEGMENT_BLOCK consecutive segment ids:
    int32 [..., ceil(L / SEGMENT_BLOCK), 2] from ids [..., L] (the last block may
    be short). The CUDA kernels read these L / 64 pairs to find the keys
    (queries) a tile's documents can see instead of scanning all L ids. Only the
    last axis is sliced, so the batch may be sharded."""
    ids = ids.astype(jnp.int32)
    length = ids.shape[-1]
    full = length // SEGMENT_BLOCK
    parts = []
    if full:
        tiles = ids[..., :full * SEGMENT_BLOCK].reshape(ids.shape[:-1] + (full, SEGMENT_BLOCK))
        parts.append(jnp.stack([tiles.min(axis=-1), tiles.max(axis=-1)], axis=-1))
    if length > full * SEGMENT_BLOCK:
        tail = ids[..., full * SEGMENT_BLOCK:]
        parts.append(jnp.stack([tail.min(axis=-1), tail.max(axis=-1)], axis=-1)[..., None, :])
    if not parts:  # (no ids: an empty table)
        return jnp.zeros(ids.shape[:-1] + (0, 2), jnp.int32)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-2)


def _mask_operands(q, k, q_lengths, kv_lengths, window, softcap, q_segment_ids, kv_segment_ids, bias, mask):
    """The masking operands and attributes every target takes (CPU and CUDA
    alike; bindings/ffi_bindings.h bind_mask_args): lengths int32 [B] (a
    missing one of the two is the full length; a placeholder [1] when neither),
    segment ids int32 [B, T] / [B, S], the dense bias f32 and mask bool (a
    placeholder [1, 1, 1, 1] when absent) and the ids' (min, max) tables
    (segment_ranges; placeholders [1] without segments), with has_* False for a placeholder;
    the window (-1: unlimited) and the soft cap (0: off)."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    has_lengths = q_lengths is not None or kv_lengths is not None
    if not has_lengths:
        q_lengths = kv_lengths = jnp.zeros((1,), jnp.int32)
    if q_lengths is None:
        q_lengths = jnp.full((B,), T, jnp.int32)
    if kv_lengths is None:
        kv_lengths = jnp.full((B,), S, jnp.int32)
    has_segments = q_segment_ids is not None
    if has_segments:
        q_ranges, kv_ranges = segment_ranges(q_segment_ids), segment_ranges(kv_segment_ids)
    else:
        q_segment_ids = kv_segment_ids = q_ranges = kv_ranges = jnp.zeros((1,), jnp.int32)
    has_bias, has_mask = bias is not None, mask is not None
    bias = jnp.zeros((1, 1, 1, 1), jnp.float32) if bias is None else bias.astype(jnp.float32)
    mask = jnp.ones((1, 1, 1, 1), jnp.bool_) if mask is None else mask.astype(jnp.bool_)
    left, right = (-1, -1) if window is None else window
    attrs = {"window_left": np.int32(left), "window_right": np.int32(right),
             "softcap": np.float32(0.0 if softcap is None else softcap),
             "has_segments": has_segments, "has_bias": has_bias, "has_mask": has_mask,
             "has_lengths": has_lengths}
    operands = (q_lengths.astype(jnp.int32), kv_lengths.astype(jnp.int32), q_segment_ids.astype(jnp.int32),
                kv_segment_ids.astype(jnp.int32), q_ranges, kv_ranges, bias, mask)
    return operands, attrs


def cpu_forward(q, k, v, q_lengths=None, kv_lengths=None, q_segment_ids=None, kv_segment_ids=None, bias=None,
                mask=None, *, scale: float, is_causal: bool, window=None, softcap=None):
    """(out, lse) from the C++ CPU kernel."""
    operands, attrs = _mask_operands(q, k, q_lengths, kv_lengths, window, softcap, q_segment_ids,
                                     kv_segment_ids, bias, mask)
    return _forward("jaxattn_cpu_fwd", q, k, v, scale, is_causal, *operands, **attrs)[:2]


def cuda_forward(q, k, v, q_lengths=None, kv_lengths=None, q_segment_ids=None, kv_segment_ids=None, bias=None,
                 mask=None, *, scale: float, is_causal: bool, window=None, softcap=None, portable_only: bool = False,
                 return_doc_tiles: bool = False):
    """(out, lse) from the CUDA kernels: the Hopper one where it covers the call,
    else the portable one (always the portable one with `portable_only`, and
    for dense bias and mask). With `return_doc_tiles` (tests) also the document
    tiles' workspace, int32 [..., doc_tile_ints(T)] (cuda/common/doc_tiles.h:
    per row a header {count, 0, 0, 0}, count -1 for the usual tiles, then
    records {row0, row_end, ds, de}): written by the Hopper forward only, and
    only for segment ids with T == S (else unwritten, or a placeholder [1])."""
    operands, attrs = _mask_operands(q, k, q_lengths, kv_lengths, window, softcap, q_segment_ids,
                                     kv_segment_ids, bias, mask)
    out, lse, tiles = _forward("jaxattn_cuda_fwd", q, k, v, scale, is_causal, *operands,
                               workspace=(_doc_tiles_type(q, k, q_segment_ids),),
                               portable_only=bool(portable_only), **attrs)
    return (out, lse, tiles) if return_doc_tiles else (out, lse)


def _doc_tiles_type(q, k, q_segment_ids):
    """The document tiles' workspace (cuda/common/doc_tiles.h) of a forward or
    backward call: [..., doc_tile_ints(T)] int32 for packed documents (segment
    ids with T == S), else a placeholder [1]."""
    T = q.shape[-3]
    docs = q_segment_ids is not None and T == k.shape[-3]
    return jax.ShapeDtypeStruct(q.shape[:-3] + (doc_tile_ints(T),) if docs else (1,), jnp.int32)


def cuda_sm80_forward(q, k, v, *masks, **kwargs):
    """(out, lse) from the portable (sm_80+) CUDA kernel only."""
    return cuda_forward(q, k, v, *masks, **kwargs, portable_only=True)


def _grad_types(q, k):
    return (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
    )


def cpu_backward(q, k, v, out, lse, dout, dlse, q_lengths=None, kv_lengths=None, q_segment_ids=None,
                 kv_segment_ids=None, bias=None, mask=None, *, scale: float, is_causal: bool, window=None,
                 softcap=None, bias_grad: bool = True):
    """(dq, dk, dv), plus dbias (float32, the bias's shape) with a bias and
    `bias_grad`, from the C++ CPU kernel (no workspace)."""
    register_targets()
    operands, attrs = _mask_operands(q, k, q_lengths, kv_lengths, window, softcap, q_segment_ids,
                                     kv_segment_ids, bias, mask)
    want = bias is not None and bias_grad
    dbias_type = jax.ShapeDtypeStruct(bias.shape if want else (1,), jnp.float32)
    dq, dk, dv, dbias = jax.ffi.ffi_call("jaxattn_cpu_bwd", _grad_types(q, k) + (dbias_type,), vmap_method=_VMAP)(
        q, k, v, out, lse, dout, dlse, *operands, **_attrs(scale, is_causal), **attrs
    )
    return (dq, dk, dv, dbias) if want else (dq, dk, dv)


# Units the Hopper backward's tail-split workspace holds at most: the split units are
# fewer than the SMs (cuda/sm90/bwd_tail.cuh; 132 on H100 / H200).
TAIL_MAX_UNITS = 132


def _has_masks(attrs) -> bool:
    """Whether _mask_operands' attributes ask for any option beyond is_causal: the
    same rule as C++ AttnParams::has_masks (cuda/common/params.h)."""
    return bool(attrs["window_left"] >= 0 or attrs["window_right"] >= 0 or attrs["softcap"] > 0 or any(
        attrs[name] for name in ("has_segments", "has_bias", "has_mask", "has_lengths")))


def _dkv_tail_type(k, *, split: bool):
    """The Hopper backward's tail-split workspace (cuda/sm90/bwd_tail.cuh): f32 [units, 2,
    rows, H] for calls that may split (`split`: unmasked, non-causal, not deterministic)
    at head dims 64 / 128 when the Hopper kernels were built (rows > 0) and the GPU is a
    Hopper one, else a placeholder [1] the kernels never see."""
    rows = int(getattr(_jaxattn, "cuda_bwd_tail_rows", lambda: 0)())
    B, S, K, H = k.shape
    if rows == 0 or not split or H not in (64, 128) or _compute_capability()[0] != 9:
        return jax.ShapeDtypeStruct((1,), jnp.float32)
    units = -(-S // 128) * K * B  # (key blocks of 128 at these head dims)
    return jax.ShapeDtypeStruct((max(1, min(units, TAIL_MAX_UNITS)), 2, rows, H), jnp.float32)


def cuda_backward(q, k, v, out, lse, dout, dlse, q_lengths=None, kv_lengths=None, q_segment_ids=None,
                  kv_segment_ids=None, bias=None, mask=None, *, scale: float, is_causal: bool, window=None,
                  softcap=None, portable_only: bool = False, deterministic: bool = False, bias_grad: bool = True,
                  return_doc_tiles: bool = False):
    """(dq, dk, dv), plus dbias (float32, the bias's shape) with a bias and
    `bias_grad`, from the CUDA kernels: the Hopper one where it covers the
    call, else the portable one (always the portable one with `portable_only`
    and for dense bias and mask). With `return_doc_tiles` (tests) also the
    document tiles' workspace, as cuda_forward's: written by the Hopper
    backward at head dims 64 / 128 (key tiles, most query rows first), not
    in deterministic mode.

    dq_accum, dpsum, dq_semaphore, doc_tiles and dkv_tail are workspace outputs. `deterministic`
    orders the dQ accumulation so dq, dk, dv are identical bit for bit from
    run to run (dbias is summed with f32 atomics: not bit-reproducible)."""
    register_targets()
    operands, attrs = _mask_operands(q, k, q_lengths, kv_lengths, window, softcap, q_segment_ids,
                                     kv_segment_ids, bias, mask)
    want = bias is not None and bias_grad
    B, T, N, _ = q.shape
    workspace = (
        jax.ShapeDtypeStruct(q.shape, jnp.float32),  # dq_accum
        jax.ShapeDtypeStruct((B, N, T), jnp.float32),  # dpsum
        jax.ShapeDtypeStruct((B, N, -(-T // DQ_SEMAPHORE_ROWS)), jnp.int32),  # dq_semaphore
        jax.ShapeDtypeStruct(bias.shape if want else (1,), jnp.float32),  # dbias ([1]: not wanted)
        _doc_tiles_type(q, k, q_segment_ids),
        _dkv_tail_type(k, split=not (is_causal or deterministic or portable_only or _has_masks(attrs))),
    )
    dq, dk, dv, *_, dbias, tiles, _ = jax.ffi.ffi_call(
        "jaxattn_cuda_bwd", _grad_types(q, k) + workspace, vmap_method=_VMAP
    )(q, k, v, out, lse, dout, dlse, *operands, **_attrs(scale, is_causal), portable_only=bool(portable_only),
      deterministic=bool(deterministic), **attrs)
    grads = (dq, dk, dv, dbias) if want else (dq, dk, dv)
    return (*grads, tiles) if return_doc_tiles else grads


def cuda_sm80_backward(q, k, v, out, lse, dout, dlse, *masks, **kwargs):
    """(dq, dk, dv) from the portable (sm_80+) CUDA kernel only."""
    return cuda_backward(q, k, v, out, lse, dout, dlse, *masks, **kwargs, portable_only=True)
