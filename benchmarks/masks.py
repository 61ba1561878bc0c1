"""Masked attention on the GPU: packed documents and sliding windows, next to cuDNN.

    python3 benchmarks/masks.py [--out results] [--tokens 16384] [--heads 128] [--width 2048]

Rows (bf16, B*T = --tokens, N*H = --width), each for fwd and fwd+bwd:
  * packed:     documents of --doc-min..--doc-max tokens packed into one
                sequence with segment ids, per-document causal (jaxattn only:
                jax.nn has no segment ids);
  * separate:   the same documents as separate sequences: a batch padded to
                the longest one, with query/key-value lengths (jaxattn and
                cuDNN);
  * window:     causal with a sliding window of --window keys (jaxattn and
                cuDNN's local_window_size);
  * causal:     full causal attention at the same length (jaxattn and cuDNN).
TFLOP/s count only the visible (b, n, i, j) pairs (4 H flops each forward,
3.5x that for fwd+bwd), so the rows compare as work done; the cuDNN ratio is
jaxattn's time over cuDNN's inverted (>1: jaxattn faster), n/a where cuDNN
refuses the call. Writes DIR/masks.json. Runs in well under a minute on an H200.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import (log, packed_documents, prepare, sample, separate_documents,  # noqa: E402  (shared helpers)
                       stats_of)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results", help="output directory (default: results/)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=128, help="head dim H")
    p.add_argument("--width", type=int, default=2048, help="N * H")
    p.add_argument("--doc-min", type=int, default=512)
    p.add_argument("--doc-max", type=int, default=2048)
    p.add_argument("--window", type=int, default=4096, help="keys a query sees, itself included")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def visible_pairs_causal(lengths, window=None) -> int:
    """Visible (i, j) pairs of causal attention over sequences of these lengths, with
    query i seeing keys i - window + 1 .. i when a window is given."""
    total = 0
    for n in lengths:
        if window is None or window >= n:
            total += n * (n + 1) // 2
        else:
            total += window * (window + 1) // 2 + (n - window) * window
    return total


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxattn

    L, H = args.tokens, args.heads
    N = max(1, args.width // H)
    lens = packed_documents(L, args.doc_min, args.doc_max)
    rng = np.random.default_rng(0)

    def arrays(B, T):
        shape = (B, T, N, H)
        return tuple(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))  # q, k, v, dout

    ids = jnp.asarray(np.repeat(np.arange(len(lens)), lens)[None], jnp.int32)
    q1, k1, v1, do1 = arrays(1, L)
    # The documents as separate sequences: a padded batch with lengths.
    qs, ks, vs, dos = (jnp.asarray(x, jnp.bfloat16) for x in separate_documents((q1, k1, v1, do1), lens))
    seq_len = jnp.asarray(lens, jnp.int32)
    w = args.window

    # name -> (arrays, jaxattn kwargs, jax.nn kwargs or None, visible pairs per head)
    configs = {
        "packed": ((q1, k1, v1, do1), dict(q_segment_ids=ids, kv_segment_ids=ids), None,
                   visible_pairs_causal(lens)),
        "separate": ((qs, ks, vs, dos), dict(query_seq_lengths=seq_len, key_value_seq_lengths=seq_len),
                     dict(query_seq_lengths=seq_len, key_value_seq_lengths=seq_len), visible_pairs_causal(lens)),
        "window": ((q1, k1, v1, do1), dict(local_window_size=(w - 1, 0)), dict(local_window_size=(w - 1, 0)),
                   visible_pairs_causal([L], w)),
        "causal": ((q1, k1, v1, do1), {}, {}, visible_pairs_causal([L])),
    }

    def fn_for(attn, pass_):
        if pass_ == "fwd":
            return lambda q, k, v, dout: attn(q, k, v)

        def grads(q, k, v, dout):
            loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return grads

    # Every (row, implementation) is compiled and warmed up first, then all are timed
    # round robin (one sample of each per repetition): clock / thermal drift lands on
    # every row and implementation alike, so the packed / separate and cuDNN ratios
    # do not depend on what ran first.
    def failure(e):
        return {"median_ms": None, "tflops": None, "error": f"{type(e).__name__}: {str(e)[:200]}"}

    rows, timers = [], []
    for name, (arrs, kw, nn_kw, pairs) in configs.items():
        impls = {"jaxattn": lambda q, k, v, kw=kw: jaxattn.flash_attention(q, k, v, is_causal=True, **kw)}
        if nn_kw is not None:
            impls["cudnn"] = lambda q, k, v, nn_kw=nn_kw: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn", **nn_kw)
        kernel = jaxattn.kernel_for(*arrs[:3], is_causal=True, **kw)
        for pass_ in ("fwd", "fwdbwd"):
            flops = 4.0 * pairs * N * H * (3.5 if pass_ == "fwdbwd" else 1.0)
            row = {"config": name, "pass": pass_, "visible_pairs_per_head": pairs, "flops": flops,
                   "kernel": kernel, "results": {}}
            rows.append(row)
            for impl, attn in impls.items():
                try:
                    state, _ = prepare(jax, fn_for(attn, pass_), [arrs], args.warmup)
                    timers.append((row, impl, state, arrs))
                except Exception as e:  # noqa: BLE001  (cuDNN refuses some combinations)
                    row["results"][impl] = failure(e)
    for i in range(args.reps):
        for row, impl, state, arrs in timers:
            if impl in row["results"]:
                continue  # (failed in an earlier sample)
            try:
                sample(jax, state, [arrs], i)
            except Exception as e:  # noqa: BLE001
                row["results"][impl] = failure(e)
    for row, impl, state, _ in timers:
        if impl not in row["results"]:
            stats = stats_of(state)
            stats["tflops"] = round(row["flops"] / (stats["median_ms"] * 1e-3) / 1e12, 1)
            row["results"][impl] = stats
    del timers
    for row in rows:
        ours, theirs = row["results"]["jaxattn"], row["results"].get("cudnn")
        row["ratio_to_cudnn"] = (round(theirs["median_ms"] / ours["median_ms"], 3)
                                 if theirs and theirs["median_ms"] and ours["median_ms"] else None)
        fmt = lambda r: "n/a" if r is None or r["median_ms"] is None else f"{r['median_ms']:.2f} ms {r['tflops']} TF/s"
        log(f"{row['config']:9s} {row['pass']:6s} jaxattn {fmt(ours)} ({row['kernel']}) | cudnn {fmt(theirs)} | "
            f"ratio {row['ratio_to_cudnn'] if row['ratio_to_cudnn'] is not None else 'n/a'}")

    by = {(r["config"], r["pass"]): r for r in rows}
    summary = {}
    for pass_ in ("fwd", "fwdbwd"):
        p, s = by[("packed", pass_)]["results"]["jaxattn"], by[("separate", pass_)]["results"]["jaxattn"]
        if p["median_ms"] and s["median_ms"]:
            summary[f"packed_over_separate_{pass_}"] = round(p["median_ms"] / s["median_ms"], 3)
        wdw, c = by[("window", pass_)]["results"]["jaxattn"], by[("causal", pass_)]["results"]["jaxattn"]
        if wdw["median_ms"] and c["median_ms"]:
            summary[f"window_over_causal_{pass_}"] = round(wdw["median_ms"] / c["median_ms"], 3)
    log(f"summary: {summary}")
    doc = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "device": str(jax.devices()[0]),
           "jax": jax.__version__, "tokens": L, "N": N, "H": H, "documents": lens, "window": w,
           "rows": rows, "summary": summary}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "masks.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
