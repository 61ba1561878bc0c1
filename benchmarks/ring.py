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

Variants, per mask (causal / not) and pass (fwd / fwd+bwd), all in one process:

* ``single``: flash_attention at T/P on the first device;
* ``ring``: jaxattn.ring_attention in shard_map (zig-zag token order when causal);
* ``no_overlap``: the same ring with ``overlap_communication=False`` (every
  transfer waits for the previous step's kernels): ``no_overlap - ring`` is
  the communication time the overlap hides;
* ``auto``: flash_attention under plain jax.jit on inputs sharded along the
  sequence in natural order (the partitioner runs the ring; causal calls move
  the tokens to the zig-zag order and back around it);
* ``comm``: the transfers alone (P-1 ppermutes of a key/value block, the
  forward's traffic), for the overlap summary.

Examples:
  python3 benchmarks/ring.py                        # all GPUs, T=65536, bf16, causal and not
  python3 benchmarks/ring.py --json ring.json --md ring.md --time-budget 150
  python3 benchmarks/ring.py --cpu --devices 4 --seqlen 512 --heads 2 --head-dim 32 --reps 2   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=65536, help="global T = S")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16, help="query heads N")
    p.add_argument("--kv-heads", type=int, default=None, help="K (default N)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--masks", default="causal,full", help="comma list of causal, full")
    p.add_argument("--pass", dest="passes", default="fwd,fwd+bwd")
    p.add_argument("--variants", default="single,ring,no_overlap,auto,comm")
    p.add_argument("--devices", type=int, default=None, help="ring size P (default: all devices)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: rows that would start later are recorded as skipped")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--md", help="write the markdown table here")
    p.add_argument("--cpu", action="store_true", help="simulated CPU devices (a smoke test, not a benchmark)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    start = time.perf_counter()
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
    dtype = jnp.dtype(args.dtype)
    mesh = Mesh(np.array(devices), ("seq",))
    spec = P(None, "seq")
    seq_sharding = NamedSharding(mesh, spec)

    def ring(causal, overlap=True):
        layout = "zigzag" if causal else "contiguous"
        fn = lambda q, k, v: jaxattn.ring_attention(  # noqa: E731
            q, k, v, axis_name="seq", is_causal=causal, layout=layout, overlap_communication=overlap)
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    def flash(causal):
        return lambda q, k, v: jaxattn.flash_attention(q, k, v, is_causal=causal)  # noqa: E731

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

    def flops(t, causal, fwd_bwd):
        f = 4 * B * N * t * t * H * (0.5 if causal else 1.0)
        return f * (3.5 if fwd_bwd else 1.0)

    def comm_fn(k, v):
        def body(k, v):
            for _ in range(Pn - 1):
                k, v = (jax.lax.ppermute(x, "seq", [(i, (i + 1) % Pn) for i in range(Pn)]) for x in (k, v))
            return k, v

        return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))(k, v)

    ring_in = inputs(T, seq_sharding)  # the token order does not matter for timing
    single_in = inputs(T // Pn, devices[0])
    variants = args.variants.split(",")
    env = {"devices": Pn, "device_kind": devices[0].device_kind, "platform": devices[0].platform,
           "jax": jax.__version__, "T": T, "B": B, "N": N, "K": K, "H": H, "dtype": dtype.name}
    print(f"P={Pn} T={T} B={B} N={N} K={K} H={H} {dtype} on {Pn} x {devices[0].device_kind}", file=sys.stderr)

    rows = []

    def measure(row, name, fn, xs, work):
        if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
            row[name] = {"skipped": "time budget"}
            return
        try:
            t = timed(fn, xs)
            row[name] = {"ms": t * 1e3, "tflops_per_device": work / t / 1e12}
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
            row[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"  {row.get('mask', '')} {row.get('pass', '')} {name}: {row[name]}", file=sys.stderr, flush=True)

    comm = {}
    if "comm" in variants and Pn > 1:
        measure(comm, "comm", comm_fn, ring_in[1:3], 0.0)
        comm = comm.get("comm", {})
    for mask in args.masks.split(","):
        causal = mask == "causal"
        for name in args.passes.split(","):
            fwd_bwd = name == "fwd+bwd"
            wrap = with_grad if fwd_bwd else (lambda f: lambda q, k, v, d: f(q, k, v))
            row = {"mask": mask, "pass": name}
            ring_work = flops(T, causal, fwd_bwd) / Pn
            todo = {"single": (flash(causal), single_in, flops(T // Pn, causal, fwd_bwd)),
                    "ring": (ring(causal), ring_in, ring_work),
                    "no_overlap": (ring(causal, overlap=False), ring_in, ring_work),
                    "auto": (flash(causal), ring_in, ring_work)}
            for variant, (f, xs, work) in todo.items():
                if variant in variants:
                    measure(row, variant, wrap(f), xs, work)
            single = row.get("single", {}).get("tflops_per_device")
            for variant in ("ring", "auto"):
                tf = row.get(variant, {}).get("tflops_per_device")
                if single and tf:
                    row[f"{variant}_ratio"] = tf / single
            if "ms" in row.get("ring", {}) and "ms" in row.get("no_overlap", {}):
                row["hidden_ms"] = row["no_overlap"]["ms"] - row["ring"]["ms"]
            rows.append(row)

    def cell(row, key, field):
        x = row.get(key, {})
        return f"{x[field]:.4g}" if field in x else (x.get("skipped") or ("error" if "error" in x else "-"))

    lines = [f"ring attention, P={Pn} x {devices[0].device_kind}, T={T} (single: T/P={T // Pn}), B={B}, "
             f"N={N}, K={K}, H={H}, {dtype.name}; TFLOP/s per device (ms)", "",
             "| mask | pass | single T/P | ring | ratio | auto (jit) | ratio | ring without overlap | hidden ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = lambda key: f" ({r[key]['ms']:.2f})" if "ms" in r.get(key, {}) else ""  # noqa: E731
        ratio = lambda key: f"{r[key]:.2f}" if key in r else "-"  # noqa: E731
        lines.append(
            f"| {r['mask']} | {r['pass']} | {cell(r, 'single', 'tflops_per_device')}{ms('single')} | "
            f"{cell(r, 'ring', 'tflops_per_device')}{ms('ring')} | {ratio('ring_ratio')} | "
            f"{cell(r, 'auto', 'tflops_per_device')}{ms('auto')} | {ratio('auto_ratio')} | "
            f"{cell(r, 'no_overlap', 'tflops_per_device')}{ms('no_overlap')} | "
            + (f"{r['hidden_ms']:.2f} |" if "hidden_ms" in r else "- |"))
    if "ms" in comm:
        lines.append("")
        lines.append(f"transfers alone (P-1 = {Pn - 1} key/value blocks): {comm['ms']:.2f} ms; "
                     "'hidden ms' is how much of it (and of the backward's transfers) the overlap hides. "
                     "Bar: ratio >= 0.8.")
    table = "\n".join(lines)
    doc = {"environment": env, "rows": rows, "comm": comm, "table": table,
           "seconds": time.perf_counter() - start}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(table + "\n")
    print(table, flush=True)
    return doc


if __name__ == "__main__":
    main()
