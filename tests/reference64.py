"""Float64 numpy attention, forward and backward: the ground truth of the tests."""

from __future__ import annotations

import numpy as np


def _visible(T: int, S: int, is_causal: bool, rows=None, window=None, q_lengths=None,
             kv_lengths=None, q_segment_ids=None, kv_segment_ids=None) -> np.ndarray:
    """[T', S] bool without lengths or segments, [B, T', S] with them (T' = len(rows) or T)."""
    rows = np.arange(T) if rows is None else np.asarray(rows)
    r = rows[:, None]
    c = np.arange(S)[None, :]
    vis = np.ones((len(rows), S), bool)
    if is_causal:
        vis &= c <= r
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        vis &= (c >= r - left) & (c <= r + right)
    if q_lengths is not None or kv_lengths is not None:
        vis = vis[None]
        if q_lengths is not None:
            vis = vis & (r[None] < np.asarray(q_lengths)[:, None, None])
        if kv_lengths is not None:
            vis = vis & (c[None] < np.asarray(kv_lengths)[:, None, None])
    if q_segment_ids is not None:
        qs = np.asarray(q_segment_ids)[:, rows]
        vis = vis & (qs[:, :, None] == np.asarray(kv_segment_ids)[:, None, :])
    return vis


def _logits_mask(s, vis, bias, mask):
    """Adds the dense bias to logits [B, N, T, S] and applies the visibility and dense mask."""
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    vis = _bcast(vis)
    if mask is not None:
        vis = vis & np.asarray(mask, bool)
    return np.where(vis, s, -np.inf)


def _reduce_to(x: np.ndarray, shape) -> np.ndarray:
    """Sums x over the dimensions that broadcasting `shape` to x.shape expanded."""
    shape = (1,) * (x.ndim - len(shape)) + tuple(shape)
    axes = tuple(i for i, (a, b) in enumerate(zip(shape, x.shape)) if a == 1 and b != 1)
    return x.sum(axis=axes, keepdims=True)


def _bcast(vis: np.ndarray) -> np.ndarray:
    """[T, S] or [B, T, S] -> broadcastable to [B, N, T, S]."""
    return vis[None, None] if vis.ndim == 2 else vis[:, None]


def _expand(x: np.ndarray, group: int) -> np.ndarray:
    """[B, S, K, H] -> [B, S, K*group, H]: each key head serves `group` query heads."""
    return np.repeat(x, group, axis=2)


def _probs(s):
    """Softmax over the last axis that gives 0 on rows with no finite logit."""
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l = e.sum(-1, keepdims=True)
    p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
    return p, m, l


def forward(q, k, v, *, scale: float, is_causal: bool, rows=None, window=None, q_lengths=None,
            kv_lengths=None, softcap=None, q_segment_ids=None, kv_segment_ids=None, bias=None, mask=None):
    """(out [B, T', N, H], lse [B, T', N]) in float64; `rows` picks query rows.

    Logits: softcap(scale * q.k) + bias, then masked; bias and mask
    broadcastable to [B, N, T, S] (not with `rows`)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T = q.shape[1]
    if rows is not None:
        q = q[:, rows]
    g = q.shape[2] // k.shape[2]
    k, v = _expand(k, g), _expand(v, g)
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    vis = _visible(T, k.shape[1], is_causal, rows, window, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
    s = _logits_mask(s, vis, bias, mask)
    p, m, l = _probs(s)
    out = np.einsum("bnts,bsnh->btnh", p, v)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + m[..., 0], -np.inf)
    return out, lse.transpose(0, 2, 1)


def backward(q, k, v, dout, *, scale: float, is_causal: bool, dlse=None, window=None, q_lengths=None,
             kv_lengths=None, softcap=None, q_segment_ids=None, kv_segment_ids=None, bias=None, mask=None,
             round_out=None):
    """(dq, dk, dv) in float64 of sum(out * dout) + sum(lse * dlse); with a
    bias also dbias (summed to the bias's shape).

    round_out (with a bias): a function rounding an array to the output dtype; then a
    fifth value is returned, the dbias error that a flash backward makes by design:
    it takes D = rowsum(dout * out) from the output rounded to its dtype, so each
    dS_ij is off by -P_ij (D_rounded - D)_i, and a bias broadcast over rows sums
    those errors (a scalar bias sums every row's, where the exact dS cancel to ~0)."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    g = N // K
    ke, ve = _expand(k, g), _expand(v, g)
    s = np.einsum("btnh,bsnh->bnts", q, ke) * scale
    if softcap is not None:
        t = np.tanh(s / softcap)
        s = softcap * t
    vis = _visible(T, S, is_causal, None, window, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
    s = _logits_mask(s, vis, bias, mask)
    p, _, _ = _probs(s)
    dv = np.einsum("bnts,btnh->bsnh", p, dout)
    dp = np.einsum("btnh,bsnh->bnts", dout, ve)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    if dlse is not None:
        ds += p * np.asarray(dlse, np.float64).transpose(0, 2, 1)[..., None]
    dbias = None if bias is None else _reduce_to(ds, np.shape(bias)).reshape(np.shape(bias))
    if softcap is not None:
        ds = ds * (1 - t * t)
    dq = np.einsum("bnts,bsnh->btnh", ds, ke) * scale
    dk = np.einsum("bnts,btnh->bsnh", ds, q) * scale
    dk = dk.reshape(B, S, K, g, H).sum(3)
    dv = dv.reshape(B, S, K, g, H).sum(3)
    if bias is None:
        return dq, dk, dv
    if round_out is None:
        return dq, dk, dv, dbias
    out = np.einsum("bnts,bsnh->btnh", p, ve)
    d_err = (dout * (np.asarray(round_out(out), np.float64) - out)).sum(-1)  # [B, T, N]
    dbias_err = _reduce_to(-p * d_err.transpose(0, 2, 1)[..., None], np.shape(bias)).reshape(np.shape(bias))
    return dq, dk, dv, dbias, dbias_err
