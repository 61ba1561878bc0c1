"""Where a paged decode call's time goes through JAX (issue 9 diagnosis).

Times jaxattn.decode_attention (CUDA version 2) on one issue-9 row through
jax.jit, round robin, ~20 ms batches: the paged cache through a shuffled
page table (as benchmarks/decode.py builds it), the same pages through the
identity table (a contiguous layout read by the paged code), and the
contiguous cache. --only NAME runs one of them for a profiler
(ncu -k regex:decode_mma --launch-skip ...).

  python3 scripts/decode_jax_probe.py --B 64 --L 4096 [--only paged|identity|contiguous]
"""
import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

import jaxattn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--only", default=None)
    ap.add_argument("--calls", type=int, default=40, help="calls with --only")
    ap.add_argument("--variant", type=int, default=None, help="also run with this JAXATTN_CUDA_DECODE_VARIANT")
    a = ap.parse_args()
    B, L, N, K, H, ps = a.B, a.L, 32, 8, 128, 64
    pages = L // ps
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(B * 1000003 + L), 4)
    q = jax.random.normal(k1, (B, 1, N, H), jnp.bfloat16)
    kc = jax.random.normal(k2, (B, L, K, H), jnp.bfloat16)
    vc = jax.random.normal(k3, (B, L, K, H), jnp.bfloat16)
    perm = jax.random.permutation(k4, B * pages).astype(jnp.int32)
    inv = jnp.argsort(perm)
    kp = kc.reshape(B * pages, ps, K, H)[inv]
    vp = vc.reshape(B * pages, ps, K, H)[inv]
    table = perm.reshape(B, pages)
    ident = jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)
    kpi = kc.reshape(B * pages, ps, K, H)
    vpi = vc.reshape(B * pages, ps, K, H)
    lengths = jnp.full((B,), L, jnp.int32)
    dec = jax.jit(lambda q, k, v, L, t: jaxattn.decode_attention(q, k, v, kv_lengths=L, block_table=t,
                                                                 implementation="cuda_v2"))
    con = jax.jit(lambda q, k, v, L: jaxattn.decode_attention(q, k, v, kv_lengths=L, implementation="cuda_v2"))
    cases = {"paged": lambda: dec(q, kp, vp, lengths, table),
             "identity": lambda: dec(q, kpi, vpi, lengths, ident),
             "contiguous": lambda: con(q, kc, vc, lengths)}
    for f in cases.values():  # traced now, without the variable
        jax.block_until_ready(f())
    if a.variant is not None:  # paged and contiguous with JAXATTN_CUDA_DECODE_VARIANT=a.variant
        os.environ["JAXATTN_CUDA_DECODE_VARIANT"] = str(a.variant)
        dec2 = jax.jit(lambda q, k, v, L, t: jaxattn.decode_attention(q, k, v, kv_lengths=L, block_table=t,
                                                                      implementation="cuda_v2"))
        con2 = jax.jit(lambda q, k, v, L: jaxattn.decode_attention(q, k, v, kv_lengths=L, implementation="cuda_v2"))
        cases.update({f"paged [{a.variant}]": lambda: dec2(q, kp, vp, lengths, table),
                      f"contiguous [{a.variant}]": lambda: con2(q, kc, vc, lengths)})
        for name in (f"paged [{a.variant}]", f"contiguous [{a.variant}]"):  # traced while it is set
            jax.block_until_ready(cases[name]())
        del os.environ["JAXATTN_CUDA_DECODE_VARIANT"]
    ref = jax.block_until_ready(cases["contiguous"]())
    for name, f in cases.items():
        out = jax.block_until_ready(f())
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        assert err < 5e-2, (name, err)
    if a.only:
        f = cases[a.only]
        outs = [f() for _ in range(a.calls)]
        jax.block_until_ready(outs)
        return
    nbytes = (2 * B * L * K * H + 2 * B * N * H) * 2
    reps = 0
    times = {n: [] for n in cases}
    for r in range(8):
        for name, f in cases.items():
            if reps == 0:
                t = time.perf_counter()
                jax.block_until_ready(f())
                reps = max(10, min(400, round(20e-3 / (time.perf_counter() - t))))
            t = time.perf_counter()
            outs = [f() for _ in range(reps)]
            jax.block_until_ready(outs)
            times[name].append((time.perf_counter() - t) / reps)
    for name in cases:
        t = statistics.median(times[name])
        print(f"B={B} L={L} {name}: {t * 1e6:.1f} us/call, {nbytes / t / 1e9:.0f} GB/s")


if __name__ == "__main__":
    main()
