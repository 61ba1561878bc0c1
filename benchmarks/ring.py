#!/usr/bin/env python3
"""Ring attention throughput per device vs single-device flash_attention at T/P.

Issue 7's bar: ring attention at global length T on P GPUs reaches at least
80% of the per-GPU throughput of flash_attention at T/P on one GPU. The ring
does ``flops(T) / P`` per device (P times the work of flash at T/P, plus the
communication), so the comparison is in TFLOP/s per device:

  ring:   flops(B, T, N, H, causal) / P / time
  single: flops(B, T/P, N, H, causal) / time   (one device, unsharded)

FLOPs as in benchmarks/attention.py: fwd = 4*B*N*T*S*H, halved when causal;
fwd+bwd = 3.5x fwd. Each function is jitted, compiled ahead of time, run
``--warmup`` times, then ``--reps`` timed runs (median, each ending with
block_until_ready).

Examples:
  python3 benchmarks/ring.py                        # all GPUs, T=65536, bf16, causal zigzag
  python3 benchmarks/ring.py --seqlen 131072 --pass fwd
  python3 benchmarks/ring.py --cpu --devices 4 --seqlen 512 --heads 2 --head-dim 32   # smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=65536, help="global T = S")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16, help="query heads N")
    p.add_argument("--kv-heads", type=int, default=None, help="K (default N)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--pass", dest="passes", default="fwd,fwd+bwd")
    p.add_argument("--devices", type=int, default=None, help="ring size P (default: all devices)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="simulated CPU devices (a smoke test, not a benchmark)")
    return p.parse_args()


def main():
    args = parse()
    if args.cpu:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices or 8}")
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxattn

    devices = jax.devices()[: args.devices or len(jax.devices())]
    Pn = len(devices)
    B, T, N, H = args.batch, args.seqlen, args.heads, args.head_dim
    K = args.kv_heads or N
    causal = not args.no_causal
    dtype = jnp.dtype(args.dtype)
    mesh = Mesh(np.array(devices), ("seq",))
    spec = P(None, "seq")

    def ring_fn(q, k, v):
        return jaxattn.ring_attention(q, k, v, axis_name="seq", is_causal=causal, layout=args.layout)

    ring = jax.shard_map(ring_fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    def single(q, k, v):
        return jaxattn.flash_attention(q, k, v, is_causal=causal)

    def with_grad(f):
        def loss(q, k, v, dout):
            return jnp.sum(f(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))

    def inputs(t, sharding):
        rng = np.random.default_rng(0)
        shapes = [(B, t, N, H), (B, t, K, H), (B, t, K, H), (B, t, N, H)]
        return [jax.device_put(jnp.asarray(rng.standard_normal(s), dtype), sharding) for s in shapes]

    def timed(fn, xs):
        c = jax.jit(fn).lower(*xs).compile()
        for _ in range(args.warmup):
            jax.block_until_ready(c(*xs))
        samples = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(c(*xs))
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def flops(t, fwd_bwd):
        f = 4 * B * N * t * t * H * (0.5 if causal else 1.0)
        return f * (3.5 if fwd_bwd else 1.0)

    ring_in = inputs(T, NamedSharding(mesh, spec))  # the order does not matter for timing
    single_in = inputs(T // Pn, devices[0])
    print(f"P={Pn} T={T} B={B} N={N} K={K} H={H} {dtype} causal={causal} layout={args.layout} "
          f"on {devices[0].platform}", file=sys.stderr)
    print("| pass | ring ms | ring TFLOP/s/dev | single T/P ms | single TFLOP/s | ratio |")
    print("|---|---|---|---|---|---|")
    for name in args.passes.split(","):
        fwd_bwd = name == "fwd+bwd"
        rf = with_grad(ring) if fwd_bwd else (lambda q, k, v, d: ring(q, k, v))
        sf = with_grad(single) if fwd_bwd else (lambda q, k, v, d: single(q, k, v))
        tr, ts = timed(rf, ring_in), timed(sf, single_in)
        ring_tf = flops(T, fwd_bwd) / Pn / tr / 1e12
        single_tf = flops(T // Pn, fwd_bwd) / ts / 1e12
        print(f"| {name} | {tr * 1e3:.2f} | {ring_tf:.1f} | {ts * 1e3:.2f} | {single_tf:.1f} | "
              f"{ring_tf / single_tf:.2f} |", flush=True)


if __name__ == "__main__":
    main()
