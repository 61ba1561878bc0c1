"""Where a paged decode call's time goes through JAX (issue 9 diagnosis).

Times jaxattn.decode_attention (CUDA version 2) on one issue-9 row through
jax.jit, round robin, ~20 ms batches: the paged cache through a shuffled
page table (as benchmarks/decode.py builds it), the same pages through the
identity table (a contiguous layout read by the paged code), the
contiguous cache, and jax.nn's cuDNN attention on the contiguous cache. --only NAME runs one of them for a profiler
(ncu -k regex:decode_mma --launch-skip ...).

  python3 scripts/decode_jax_probe.py --B 64 --L 4096 [--only paged|identity|contiguous|cudnn]
  python3 scripts/decode_jax_probe.py --B 16 --L 4096 --trace 8 [--trace-impl cudnn]  # GPU kernel timeline

--trace LAYERS: jitted steps of LAYERS paged calls (each its own query, as
benchmarks/decode.py times them) under jax.profiler; prints every GPU kernel's
count, median duration and the median idle gap before it on its stream, and
a stretch of the busiest stream in order. Run it under different XLA_FLAGS (e.g. command
buffers for custom calls) to see what XLA puts between the decode kernels.
"""
import argparse
import os
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp

import jaxattn
from kernel_trace import kernel_trace


def timeline(cases, B, calls, nbytes, K=8, max_splits=16, skip=10):
    """The kernel's own per-CTA stamps (start, prologue done, first tile in, middle
    tile, loop done, end; decode_mma_kernel.cuh) over `calls` back-to-back jitted
    calls per case: medians over the calls after `skip` of the span (first CTA start
    to last CTA end), the gap to the next call's first CTA, the period, and the phases."""
    import numpy as np
    from jaxattn import _jaxattn as ext
    marks, ctas = 8, B * K * max_splits
    for name, f in cases.items():
        buf = jnp.zeros((calls * ctas * marks * 2,), jnp.uint32)
        cnt = jnp.zeros((ctas,), jnp.uint32)
        jax.block_until_ready((buf, cnt))
        ext.decode_timeline_set(buf.unsafe_buffer_pointer(), cnt.unsafe_buffer_pointer(), calls, ctas)
        outs = [f() for _ in range(calls)]
        jax.block_until_ready(outs)
        ext.decode_timeline_set(0, 0, 0, 0)
        h = np.asarray(buf).view(np.uint64).reshape(calls, ctas, marks).astype(np.float64) * 1e-3  # us
        used = h[0, :, 0] > 0
        h = h[:, used, :]
        spans, gaps, periods, pro, first, loop, epi = [], [], [], [], [], [], []
        for c in range(skip, calls - 1):
            s0, end, nxt = h[c, :, 0].min(), h[c, :, 5].max(), h[c + 1, :, 0].min()
            spans.append(end - s0), gaps.append(nxt - end), periods.append(nxt - s0)
            pro.append(np.median(h[c, :, 1] - h[c, :, 0])), first.append(np.median(h[c, :, 2] - h[c, :, 1]))
            loop.append(np.median(h[c, :, 4] - h[c, :, 2])), epi.append(np.median(h[c, :, 5] - h[c, :, 4]))
        med = lambda v: float(np.median(v))  # noqa: E731
        print(f"timeline {name}: CTAs {int(used.sum())}, span {med(spans):.1f} us, gap {med(gaps):.1f}, "
              f"period {med(periods):.1f} ({nbytes / med(periods) / 1e3:.0f} GB/s); prologue {med(pro):.1f}, "
              f"first tile {med(first):.1f}, loop {med(loop):.1f}, epilogue {med(epi):.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--only", default=None)
    ap.add_argument("--calls", type=int, default=40, help="calls with --only")
    ap.add_argument("--variant", type=int, default=None, help="also run with this JAXATTN_CUDA_DECODE_VARIANT")
    ap.add_argument("--trace", type=int, default=0,
                    help="LAYERS: kernel timeline of jitted steps of LAYERS paged calls (jax.profiler)")
    ap.add_argument("--trace-impl", default="paged", choices=("paged", "contiguous", "cudnn"),
                    help="what --trace steps call: jaxattn on the paged or contiguous cache, or "
                         "jax.nn.dot_product_attention(implementation='cudnn') on the contiguous cache")
    ap.add_argument("--timeline", action="store_true",
                    help="per-CTA phase stamps of back-to-back jitted calls (needs a -DJAXATTN_DECODE_TIMELINE build)")
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
    cud = jax.jit(lambda q, k, v, L: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=L,
                                                                   implementation="cudnn"))
    cases = {"paged": lambda: dec(q, kp, vp, lengths, table),
             "identity": lambda: dec(q, kpi, vpi, lengths, ident),
             "contiguous": lambda: con(q, kc, vc, lengths),
             "cudnn": lambda: cud(q, kc, vc, lengths)}
    for f in cases.values():  # traced now, without the variable
        jax.block_until_ready(f())
    if a.variant is not None:  # paged and contiguous with JAXATTN_CUDA_DECODE_VARIANT=a.variant
        env = mock.patch.dict(os.environ, {"JAXATTN_CUDA_DECODE_VARIANT": str(a.variant)})
        env.start()
        dec2 = jax.jit(lambda q, k, v, L, t: jaxattn.decode_attention(q, k, v, kv_lengths=L, block_table=t,
                                                                      implementation="cuda_v2"))
        con2 = jax.jit(lambda q, k, v, L: jaxattn.decode_attention(q, k, v, kv_lengths=L, implementation="cuda_v2"))
        cases.update({f"paged [{a.variant}]": lambda: dec2(q, kp, vp, lengths, table),
                      f"contiguous [{a.variant}]": lambda: con2(q, kc, vc, lengths)})
        for name in (f"paged [{a.variant}]", f"contiguous [{a.variant}]"):  # traced while it is set
            jax.block_until_ready(cases[name]())
        env.stop()
    ref = jax.block_until_ready(cases["contiguous"]())
    for name, f in cases.items():
        out = jax.block_until_ready(f())
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        assert err < 5e-2, (name, err)
    if a.trace:
        qs = [jax.random.normal(jax.random.PRNGKey(7 + i), q.shape, q.dtype) for i in range(a.trace)]
        # The caches go in as arguments (a closure would make them constants of the jitted step).
        one, args = {
            "paged": (lambda x, k, v: jaxattn.decode_attention(x, k, v, kv_lengths=lengths, block_table=table,
                                                                implementation="cuda_v2"), (kp, vp)),
            "contiguous": (lambda x, k, v: jaxattn.decode_attention(x, k, v, kv_lengths=lengths,
                                                                     implementation="cuda_v2"), (kc, vc)),
            "cudnn": (lambda x, k, v: jax.nn.dot_product_attention(x, k, v, key_value_seq_lengths=lengths,
                                                                    implementation="cudnn"), (kc, vc)),
        }[a.trace_impl]
        step = jax.jit(lambda qs, k, v: [one(x, k, v) for x in qs])
        print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} trace: {a.trace_impl}")
        kernel_trace(lambda: step(qs, *args))
        return
    if a.timeline:
        timeline(cases, B, a.calls, nbytes=(2 * B * L * K * H + 2 * B * N * H) * 2)
        return
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
