#!/usr/bin/env python3
"""Decode attention at the memory limit: bytes read per second, Tq = 1.

For each row (batch B, context length L): jaxattn.decode_attention on a
paged cache (page size 64 by default) and on a contiguous one, beside
jax.nn.dot_product_attention (cuDNN where it runs, XLA) on the same keys and
values as a contiguous [B, L, K, H] cache, and on the paged cache itself
("cudnn paged", "xla paged": jax.nn has no block table, so a JAX user gathers
the row's pages into a contiguous cache first, `key_cache[block_table]`, and
that gather is part of the timed call); every row full (kv_lengths = L).
Default grid (GPU): B in {16, 64} (the ends of the bar; `--batches 16,32,64`
for more), L in {4K, 16K, 64K}, N = 32 query heads over K = 8 KV heads,
H = 128, bfloat16; `--cpu` runs a small grid.

Bytes read per call: K and V (B * L * K * H each), Q and O (B * N * H each),
times the element size. GB/s = bytes / median time; "of peak" divides by the
read bandwidth measured here (a jitted sum over a 4 GiB buffer on GPUs),
because the bar is a fraction of what the chip can read.

On GPUs both versions of the CUDA kernel run (``cuda_v1``: CUDA cores;
``cuda_v2``: cp.async ring + tensor cores), paged, and version 2 also on the
contiguous cache. The last two columns: version 2 paged over the faster of
"cudnn paged" and "xla paged" (the same paged cache through jax.nn, gather
included: issue 9's bar, >= 2x, and >= 85% of the read bandwidth), and version
2 contiguous over the faster of cuDNN and XLA on the contiguous cache (jax.nn's
best case, which no paged-cache user gets).

Each timed call is one jitted step of `--layers` decode calls (default 8 on
GPUs, 1 on the CPU), each layer with its own query and the layers cycling
through as many distinct caches as make >= 1 GiB, the way a model's decode
step runs its layers in one executable; times and bytes are per call (per
layer). With one call per dispatch the short rows measured the host: at B=16
L=4K the H200 machine's host took 92 us to enqueue each 97 us call (session 16;
`--layers 1` still measures that way).

Timing: jitted, compiled ahead of time, `--warmup` untimed calls, then
`--rep-batches` rounds (default 5); in each, every implementation of the row in turn (round
robin) runs a batch of `--reps` steps issued back to back and one
block_until_ready, then a batch of twice as many (by default as many steps as
make the first batch ~20 ms, 3..400). The time of a step is the median over the
rounds of (T(2 reps) - T(reps)) / reps: what a step adds to a device kept busy, as
in a serving loop. A batch's fixed cost (the first step's dispatch while the
device idles, the wake-up after the sync) cancels; before session 46 one batch
was timed alone (T(reps) / reps), which charged that cost to the calls (a few
percent at the short rows' ~10 ms batches). The JSON keeps that "lone batch" time
and the fixed cost per implementation, and the read bandwidth is measured the
same way (the slope over batches of 10 and 20 sums). Rows stop
starting after `--time-budget` seconds (default 80: the default grid takes
about a minute on an H200). A failing
implementation (unsupported by cuDNN, out of memory, no such kernel) is
recorded with its reason and the run goes on. Every implementation's output
is compared with jaxattn's "xla" path (max |a - b| / max |b| <= 2e-2).

Writes DIR/decode.json and prints a markdown table.

  python3 benchmarks/decode.py                 # GPU grid
  python3 benchmarks/decode.py --cpu           # CPU smoke grid
  python3 benchmarks/decode.py --batches 16 --contexts 4096,65536
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from unittest import mock


def csv_ints(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (small grid)")
    p.add_argument("--batches", type=csv_ints, default=None)
    p.add_argument("--contexts", type=csv_ints, default=None)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--queries", type=int, default=1, help="Tq")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=0,
                   help="jitted steps per batch; 0: as many as make a batch ~20 ms (3..400)")
    p.add_argument("--rep-batches", type=int, default=5,
                   help="rounds (each: a batch of reps and one of 2 reps per implementation)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--time-budget", type=float, default=80.0, help="seconds; later rows are skipped")
    p.add_argument("--v2-variants", default="",
                   help="extra columns NAME=BITS[/CHUNK],...: cuda_v2 paged with those kV2* loader bits "
                        "(JAXATTN_CUDA_DECODE_VARIANT; cuda/decode/launch_decode.h; -1 = the default) and, "
                        "after a slash, chunks of exactly CHUNK keys (JAXATTN_CUDA_DECODE_CHUNK), for a "
                        "same-run A/B")
    p.add_argument("--layers", type=int, default=None,
                   help="decode calls per jitted step (a model's layers), each with its own query; "
                        "default 8 on GPUs, 1 on the CPU")
    p.add_argument("--caches", type=int, default=0,
                   help="caches the layers cycle through; 0: as many as make >= 1 GiB (each layer then "
                        "reads a cache no recent call read; 1: every layer reads one cache, whose "
                        "address translations stay warm)")
    p.add_argument("--impls", default="",
                   help="comma-separated names of the columns to run (default: all)")
    p.add_argument("--out", default="results/decode")
    return p.parse_args(argv)


def batch_time(jax, fn, args, n, enqueue=None):
    """(seconds for `n` back-to-back calls and one sync, output); `enqueue` gets the
    host's time per call up to the last call's return (before the sync)."""
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    if enqueue is not None:
        enqueue.append((t1 - t0) / n)
    return time.perf_counter() - t0, out


def measure(jax, fn, args, reps, warmup, batches=3, enqueue=None, fixed=None, per_batch=None):
    """(seconds per call, output): the median over `batches` of the slope between a
    batch of `reps` and one of 2 `reps` back-to-back calls, (T(2 reps) - T(reps)) /
    reps: what a call adds to a stream that is kept busy, as in a serving loop. A
    batch's fixed cost -- the first call's dispatch while the device idles, the
    wake-up after the last -- is in both and cancels (session 46: with one batch
    timed alone, it was a few percent of the short rows' ~10 ms batches).
    `fixed` gets each pair's T(reps) - reps * slope (that fixed cost), `per_batch`
    T(reps) / reps (the time per call of a lone batch: the method before session 46)."""
    out = None
    for _ in range(warmup):
        out = jax.block_until_ready(fn(*args))
    slopes = []
    for _ in range(batches):
        t1, out = batch_time(jax, fn, args, reps, enqueue)
        t2, out = batch_time(jax, fn, args, 2 * reps)
        slope = max(t2 - t1, 1e-12) / reps
        slopes.append(slope)
        if fixed is not None:
            fixed.append(t1 - reps * slope)
        if per_batch is not None:
            per_batch.append(t1 / reps)
    return statistics.median(slopes), out


def reps_for(jax, fn, args, target_s=20e-3, lo=3, hi=400):
    """Calls per batch so that a batch lasts about `target_s` (one timed call decides)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    return int(min(hi, max(lo, round(target_s / one))))


def layered(fn, layers):
    """One jitted step of `layers` decode calls, as a model's decode step runs its
    layers: call i takes query i and cache i % (number of caches); the outputs are
    stacked. Timing a step instead of one call per dispatch keeps the host's
    per-dispatch cost (~50-90 us on the H200 machine) out of a ~60-100 us kernel."""
    import jax
    import jax.numpy as jnp

    def step(qs, kps, vps, kcs, vcs, lengths, table):
        c, outs, prev = len(kps), [], ()
        for i in range(layers):
            # Each layer's operands pass through their own barrier (with the layer's
            # query and the previous layer's output), so XLA can neither merge layers
            # that read the same cache nor reorder them: without it, XLA's einsums over
            # one cache read it once for all layers (1.2-1.7x the read bandwidth).
            _, q, kp, vp, kc, vc = jax.lax.optimization_barrier(
                (prev, qs[i], kps[i % c], vps[i % c], kcs[i % c], vcs[i % c]))
            prev = fn(q, kp, vp, kc, vc, lengths, table)
            outs.append(prev)
        return jnp.stack(outs)
    return step


def compile_step(jax, fn, layers, inputs, warmup):
    """(compiled step of `layers` calls, its output after `warmup` (>= 1) calls)."""
    step = jax.jit(layered(fn, layers)).lower(*inputs).compile()
    out = None
    for _ in range(max(warmup, 1)):
        out = jax.block_until_ready(step(*inputs))
    return step, out


def failure(e) -> dict:
    """The record of an implementation that failed (unsupported, out of memory, ...)."""
    return {"ms": None, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}


def gather_pages(pages, table):
    """A paged cache [num_pages, page_size, K, H] as the contiguous [B, max_pages *
    page_size, K, H] cache of the rows of `table` [B, max_pages] (what a caller of
    jax.nn.dot_product_attention has to do with a paged cache)."""
    B, P = table.shape
    return pages[table].reshape(B, P * pages.shape[1], *pages.shape[2:])


def read_bandwidth(jax, jnp, device, nbytes):
    """Bytes/s of a jitted reduction over `nbytes` (what the chip can read)."""
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
    fn = jax.jit(lambda x: jnp.sum(x))
    t, _ = measure(jax, fn, (x,), 10, 2)  # (the same slope as the calls it divides)
    return nbytes / t


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxattn

    platform = "cpu" if args.cpu else jax.default_backend()
    device = jax.devices("cpu" if args.cpu else None)[0]
    batches = args.batches or ([1, 4] if args.cpu else [16, 64])
    contexts = args.contexts or ([1024, 4096] if args.cpu else [4096, 16384, 65536])
    dtype = jnp.dtype(args.dtype)
    N, K, H, ps, T = args.heads, args.kv_heads, args.head_dim, args.page_size, args.queries
    layers = args.layers or (1 if args.cpu else 8)
    if layers < 1:
        raise SystemExit("--layers must be >= 1")
    if args.caches < 0:
        raise SystemExit("--caches must be >= 0 (0: as many as make >= 1 GiB)")
    peak = read_bandwidth(jax, jnp, device, (256 << 20) if args.cpu else (4 << 30))
    print(f"# {device.device_kind}: measured read bandwidth {peak / 1e9:.0f} GB/s", file=sys.stderr)
    default_loop = ""
    if not args.cpu:
        from jaxattn._extension import _jaxattn
        if _jaxattn.built_with_cuda:
            # Which H=128 loop version 2 runs by default here (cuda/decode/launch_decode.h).
            gbs = _jaxattn.cuda_device_peak_dram_gbs()
            loop = "register" if gbs >= _jaxattn.cuda_decode_regs_min_gbs else "drift"
            default_loop = f"; peak DRAM {gbs} GB/s (device attributes): cuda_v2's default H=128 loop is the {loop} loop"

    impls = {"jaxattn xla paged": lambda q, kp, vp, kc, vc, L, t: jaxattn.decode_attention(
        q, kp, vp, kv_lengths=L, block_table=t, implementation="xla")}
    if args.cpu:
        impls["jaxattn paged"] = lambda q, kp, vp, kc, vc, L, t: jaxattn.decode_attention(
            q, kp, vp, kv_lengths=L, block_table=t)
        impls["jaxattn contiguous"] = lambda q, kp, vp, kc, vc, L, t: jaxattn.decode_attention(q, kc, vc, kv_lengths=L)
    else:
        for version in (1, 2):
            impl = f"cuda_v{version}"
            impls[f"{impl} paged"] = lambda q, kp, vp, kc, vc, L, t, impl=impl: jaxattn.decode_attention(
                q, kp, vp, kv_lengths=L, block_table=t, implementation=impl)
        for item in filter(None, args.v2_variants.split(",")):
            vname, spec = item.split("=")
            bits, _, chunk = spec.partition("/")
            knobs = {"JAXATTN_CUDA_DECODE_VARIANT": bits, **({"JAXATTN_CUDA_DECODE_CHUNK": chunk} if chunk else {})}

            def traced_with(fn, knobs=knobs):
                # The knobs are read while the call is traced (inside jax.jit's lowering).
                def run(*a):
                    with mock.patch.dict(os.environ, knobs):
                        return fn(*a)
                return run
            impls[f"cuda_v2 paged [{vname}]"] = traced_with(lambda q, kp, vp, kc, vc, L, t: jaxattn.decode_attention(
                q, kp, vp, kv_lengths=L, block_table=t, implementation="cuda_v2"))
        impls["cuda_v2 contiguous"] = lambda q, kp, vp, kc, vc, L, t: jaxattn.decode_attention(
            q, kc, vc, kv_lengths=L, implementation="cuda_v2")
        impls["cudnn"] = lambda q, kp, vp, kc, vc, L, t: jax.nn.dot_product_attention(
            q, kc, vc, key_value_seq_lengths=L, implementation="cudnn")
        impls["cudnn paged"] = lambda q, kp, vp, kc, vc, L, t: jax.nn.dot_product_attention(
            q, gather_pages(kp, t), gather_pages(vp, t), key_value_seq_lengths=L, implementation="cudnn")
    impls["xla"] = lambda q, kp, vp, kc, vc, L, t: jax.nn.dot_product_attention(
        q, kc, vc, key_value_seq_lengths=L, implementation="xla")
    impls["xla paged"] = lambda q, kp, vp, kc, vc, L, t: jax.nn.dot_product_attention(
        q, gather_pages(kp, t), gather_pages(vp, t), key_value_seq_lengths=L, implementation="xla")
    if args.impls:
        wanted = [w.strip() for w in args.impls.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in impls]
        if unknown:
            raise SystemExit(f"--impls: unknown {unknown}; known: {list(impls)}")
        impls = {name: impls[name] for name in wanted}
    start = time.perf_counter()
    rows = []
    for B in batches:
        for L in contexts:
            if time.perf_counter() - start > args.time_budget:
                print(f"B={B} L={L}: skipped (time budget {args.time_budget:.0f} s spent)", file=sys.stderr)
                rows.append({"B": B, "L": L, "skipped": "time budget", "impls": {}})
                continue
            key = jax.random.PRNGKey(B * 1000003 + L)
            k1, k4, kcache = jax.random.split(key, 3)
            pages = -(-L // ps)
            # One query per layer; the layers cycle through `ncache` caches (as many as
            # make >= 1 GiB of keys and values, so no layer reads its cache from L2).
            qs = list(jax.random.normal(k1, (layers, B, T, N, H), dtype))
            cache_bytes = 2 * B * pages * ps * K * H * dtype.itemsize
            ncache = args.caches or max(1, min(layers, -(-(1 << 30) // cache_bytes)))
            # The same keys as a paged cache, pages shuffled (one table for all caches).
            perm = jax.random.permutation(k4, B * pages).astype(jnp.int32)
            table = perm.reshape(B, pages)
            inv = jnp.argsort(perm)
            kcs, vcs, kps, vps = [], [], [], []
            for kc_key in jax.random.split(kcache, ncache):
                k2, k3 = jax.random.split(kc_key)
                kcs.append(jax.random.normal(k2, (B, pages * ps, K, H), dtype))
                vcs.append(jax.random.normal(k3, (B, pages * ps, K, H), dtype))
                kps.append(kcs[-1].reshape(B * pages, ps, K, H)[inv])
                vps.append(vcs[-1].reshape(B * pages, ps, K, H)[inv])
            lengths = jnp.full((B,), L, jnp.int32)
            inputs = jax.device_put((qs, kps, vps, kcs, vcs, lengths, table), device)
            q, kp, vp, kc, vc = qs[0], kps[0], vps[0], kcs[0], vcs[0]
            nbytes = (2 * B * L * K * H + 2 * B * T * N * H) * dtype.itemsize  # per call (layer)
            row = {"B": B, "L": L, "N": N, "K": K, "H": H, "Tq": T, "page_size": ps, "bytes": nbytes,
                   "layers": layers, "caches": ncache, "impls": {}}
            # Every implementation is compiled, warmed up and checked first, then all
            # are timed round robin (one batch of each per repetition), so clock /
            # thermal drift lands on all columns alike (sequential timing read the
            # same kernel up to 11 points of bandwidth apart, session 6).
            ref, compiled, times, reps, enqueue, fixed, per_batch = None, {}, {}, {}, {}, {}, {}
            for name in impls:  # "jaxattn xla paged" first: the reference of the others
                try:
                    try:
                        n_layers, fn, out = layers, *compile_step(jax, impls[name], layers, inputs, args.warmup)
                    except Exception as e:  # noqa: BLE001
                        # jax.nn on the paged cache gathers each layer's cache (17 GB at B=64
                        # L=64K): when the step does not fit, that column runs one layer a step.
                        if layers == 1 or "RESOURCE_EXHAUSTED" not in str(e):
                            raise
                        n_layers, fn, out = 1, *compile_step(jax, impls[name], 1, inputs, args.warmup)
                    rec = {"layers": n_layers}
                    if name != "jaxattn xla paged" and ref is not None:
                        m = min(out.shape[0], ref.shape[0])  # layers both ran (one may have fallen back to 1)
                        o32, r32 = (np.asarray(x[:m].astype(jnp.float32)) for x in (out, ref))
                        rec["rel_err"] = float(np.max(np.abs(o32 - r32)) / max(np.max(np.abs(r32)), 1e-30))
                        rec["check_ok"] = rec["rel_err"] <= 2e-2
                    else:
                        ref = out
                    if name.startswith(("jaxattn", "cuda_")) and name != "jaxattn xla paged":
                        impl = name.split()[0] if name.startswith("cuda_") else None
                        paged = name.endswith("paged")
                        rec["kernel"] = jaxattn.decode_kernel_for(
                            q, kp if paged else kc, vp if paged else vc, kv_lengths=lengths,
                            block_table=table if paged else None, implementation=impl, platform=platform)
                    compiled[name], times[name] = fn, []
                    reps[name] = args.reps or reps_for(jax, fn, inputs)
                    enqueue[name], fixed[name], per_batch[name] = [], [], []
                except Exception as e:  # noqa: BLE001 - record and go on
                    rec = failure(e)
                row["impls"][name] = rec
            for _ in range(args.rep_batches):
                for name, fn in list(compiled.items()):
                    try:
                        t, _ = measure(jax, fn, inputs, reps[name], 0, batches=1, enqueue=enqueue[name],
                                       fixed=fixed[name], per_batch=per_batch[name])
                        times[name].append(t)
                    except Exception as e:  # noqa: BLE001
                        row["impls"][name] = failure(e)
                        del compiled[name]
            for name in compiled:
                n_layers = row["impls"][name]["layers"]
                t = statistics.median(times[name]) / n_layers  # per call
                row["impls"][name].update({"ms": t * 1e3, "GB/s": nbytes / t / 1e9, "of_peak": nbytes / t / peak,
                                           "calls_per_batch": reps[name],
                                           "host_enqueue_ms": statistics.median(enqueue[name]) * 1e3 / n_layers,
                                           "batch_fixed_ms": statistics.median(fixed[name]) * 1e3,
                                           "lone_batch_ms": statistics.median(per_batch[name]) * 1e3 / n_layers})
            for name in impls:
                print(f"B={B} L={L} {name}: {row['impls'].get(name)}", file=sys.stderr)
            del compiled, ref
            rows.append(row)
            del inputs, q, kc, vc, kp, vp, qs, kcs, vcs, kps, vps
    os.makedirs(args.out, exist_ok=True)
    doc = {"device": device.device_kind, "platform": platform, "read_bandwidth_GBps": peak / 1e9,
           "dtype": str(dtype), "default_loop": default_loop, "rows": rows}
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(doc, f, indent=1)
    names = list(impls)
    speedup = "cuda_v2 paged" in impls and "cudnn" in impls
    # (v2 paged vs the same paged cache through jax.nn; v2 contiguous vs jax.nn contiguous)
    pairs = (("cuda_v2 paged", ("cudnn paged", "xla paged")), ("cuda_v2 contiguous", ("cudnn", "xla")))
    print(f"# {device.device_kind}, read bandwidth {peak / 1e9:.0f} GB/s; N={N} K={K} H={H} Tq={T} "
          f"page size {ps}, {dtype}; {layers} calls (layers) per jitted step; GB/s (% of read bandwidth)"
          f"{default_loop}")
    print("| B | L | " + " | ".join(names) +
          (" | v2 paged / best(jax.nn paged) | v2 contiguous / best(jax.nn contiguous) |" if speedup else " |"))
    print("|---|---|" + "---|" * (len(names) + 2 * speedup))
    for r in rows:
        cells = []
        for n in names:
            rec = r["impls"].get(n, {})
            if rec.get("ms") is None:
                cells.append("skipped" if r.get("skipped") else "n/a")
            else:
                flag = "" if rec.get("check_ok", True) else " MISMATCH"
                if rec.get("layers", layers) != layers:
                    flag += f" [{rec['layers']} layer a step: out of memory at {layers}]"
                cells.append(f"{rec['GB/s']:.0f} ({rec['of_peak']:.0%}){flag}")
        if speedup:
            for mine, bases in pairs:
                ours = r["impls"].get(mine, {}).get("ms")
                theirs = [r["impls"].get(n, {}).get("ms") for n in bases]
                theirs = [t for t in theirs if t is not None]
                cells.append(f"{min(theirs) / ours:.2f}x" if ours and theirs else "n/a")
        print(f"| {r['B']} | {r['L']} | " + " | ".join(cells) + " |")
    if "cuda_v2 paged" in impls:
        # Host-bound check: a batch whose calls are enqueued about as slowly as they
        # complete measures the host's dispatch, not the kernel.
        # The lone-batch time (the method before session 46) and a batch's fixed cost show
        # what the slope leaves out.
        print("\n| B | L | cuda_v2 paged us / call | lone batch us / call | batch fixed cost us | "
              "host enqueue us / call | steps per batch |\n|---|---|---|---|---|---|---|")
        for r in rows:
            rec = r["impls"].get("cuda_v2 paged", {})
            if rec.get("ms") is not None:
                print(f"| {r['B']} | {r['L']} | {rec['ms'] * 1e3:.1f} | {rec['lone_batch_ms'] * 1e3:.1f} | "
                      f"{rec['batch_fixed_ms'] * 1e3:.0f} | {rec['host_enqueue_ms'] * 1e3:.1f} | "
                      f"{rec['calls_per_batch']} |")
    bad = any(not rec.get("check_ok", True) for r in rows for rec in r["impls"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
