"""What deterministic=True costs: fwd+bwd time through JAX of the default mode, the
deterministic mode, and the deterministic mode on the portable kernels
(implementation="cuda_sm80"), for unmasked and masked calls at 16K tokens
(B=1, T=16384, N*H=2048, bf16). Prints one line per (row, mode) and the ratios.

  python3 scripts/deterministic_cost.py [--heads 128] [--seqlen 16384] [--reps 7]

Both backward kernels add dQ in descending key-block order in deterministic mode
(H200, session 24: deterministic / default 1.18-1.77, the portable kernel another
~2x; docs/perf.md).
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn


def rows(T):
    return {
        "causal": dict(is_causal=True),
        "full": dict(is_causal=False),
        "window4096": dict(is_causal=True, local_window_size=(4095, 0)),
        "kv_lengths": dict(is_causal=True, key_value_seq_lengths=jnp.asarray([T * 3 // 4], jnp.int32)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=128, help="head dim H")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rows", default=None, help="comma-separated subset of: causal,full,window4096,kv_lengths")
    a = ap.parse_args()
    H, T = a.heads, a.seqlen
    N = 2048 // H
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (1, T, N, H), jnp.bfloat16) for kk in keys)
    modes = (("default", False, None), ("deterministic", True, None), ("portable_det", True, "cuda_sm80"))
    table = rows(T)
    for name in (a.rows.split(",") if a.rows else table):
        kw = table[name]
        ms = {}
        for mode, det, impl in modes:
            def loss(q, k, v, det=det, impl=impl):
                out = jaxattn.flash_attention(q, k, v, deterministic=det, implementation=impl, **kw)
                return jnp.sum(out.astype(jnp.float32) * do)
            f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            for _ in range(2):
                jax.block_until_ready(f(q, k, v))
            ts = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                jax.block_until_ready(f(q, k, v))
                ts.append(time.perf_counter() - t0)
            ms[mode] = float(np.median(ts)) * 1e3
            kernel = jaxattn.kernel_for(q, k, v, deterministic=det, implementation=impl, **kw)
            print(f"{name:11s} {mode:14s} {ms[mode]:8.2f} ms  ({kernel})", flush=True)
        print(f"{name:11s} deterministic / default {ms['deterministic'] / ms['default']:.2f}, "
              f"portable_det / deterministic {ms['portable_det'] / ms['deterministic']:.2f}", flush=True)


if __name__ == "__main__":
    main()
