"""Float64 numpy attention, forward and backward: the ground truth of the tests."""

from __future__ import annotations

import numpy as np


def _visible(T: int, S: int, is_causal: bool, rows=None) -> np.ndarray:
    rows = np.arange(T) if rows is None else np.asarray(rows)
    if not is_causal:
        return np.ones((len(rows), S), bool)
    return np.arange(S)[None, :] <= rows[:, None]


def _expand(x: np.ndarray, group: int) -> np.ndarray:
    """[B, S, K, H] -> [B, S, K*group, H]: each key head serves `group` query heads."""
    return np.repeat(x, group, axis=2)


def forward(q, k, v, *, scale: float, is_causal: bool, rows=None):
    """(out [B, T', N, H], lse [B, T', N]) in float64; `rows` picks query rows."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if rows is not None:
        q = q[:, rows]
    g = q.shape[2] // k.shape[2]
    k, v = _expand(k, g), _expand(v, g)
    T = q.shape[1] if rows is None else None
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    vis = _visible(T if rows is None else 0, k.shape[1], is_causal, rows)
    s = np.where(vis[None, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l = e.sum(-1, keepdims=True)
    p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
    out = np.einsum("bnts,bsnh->btnh", p, v)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + m[..., 0], -np.inf)
    return out, lse.transpose(0, 2, 1)


def backward(q, k, v, dout, *, scale: float, is_causal: bool, dlse=None):
    """(dq, dk, dv) in float64 of sum(out * dout) + sum(lse * dlse)."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    g = N // K
    ke, ve = _expand(k, g), _expand(v, g)
    s = np.einsum("btnh,bsnh->bnts", q, ke) * scale
    vis = _visible(T, S, is_causal)
    s = np.where(vis[None, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    p /= p.sum(-1, keepdims=True)
    dv = np.einsum("bnts,btnh->bsnh", p, dout)
    dp = np.einsum("btnh,bsnh->bnts", dout, ve)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    if dlse is not None:
        ds += p * np.asarray(dlse, np.float64).transpose(0, 2, 1)[..., None]
    dq = np.einsum("bnts,bsnh->btnh", ds, ke) * scale
    dk = np.einsum("bnts,btnh->bsnh", ds, q) * scale
    dk = dk.reshape(B, S, K, g, H).sum(3)
    dv = dv.reshape(B, S, K, g, H).sum(3)
    return dq, dk, dv
