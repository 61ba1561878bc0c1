"""GPU kernel timelines of jitted calls through jax.profiler (Perfetto JSON).

kernel_trace(step) prints every GPU kernel of `steps` calls of `step`: count,
median duration, median idle gap since the previous kernel on its stream
ended, and a stretch of the busiest stream in order -- what XLA runs around a
custom call, and what each piece costs.

As a script, the attention benchmark's rows (benchmarks/attention.py's
inputs and functions: B*T = 16K tokens, N*H = 2048):
  python3 scripts/kernel_trace.py --heads 64 --seqlen 1024 --causal 0 --pass fwd --impls jaxattn,cudnn
--settle-s S runs each implementation alone for S seconds before its trace, so it is
traced at the clock its own power draw sets under the cap (not an idle chip's), and
prints the SM clock and board power nvidia-smi reads at the end of the settling.
And, with --masks, benchmarks/masks.py's packed and separate rows (jaxattn,
causal; documents of --doc-min..--doc-max tokens in --seqlen tokens):
  python3 scripts/kernel_trace.py --masks --heads 128 --seqlen 16384 --pass fwd
"""
import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
import tempfile

import jax


def kernel_trace(step, steps=20):
    """GPU kernels of `steps` calls of `step` (jax.profiler, Perfetto JSON): per
    kernel name the count, median duration and median gap since the previous
    kernel on the same stream ended; then a stretch of the busiest stream in order."""
    jax.block_until_ready(step())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            outs = [step() for _ in range(steps)]
            jax.block_until_ready(outs)
        paths = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)
        if not paths:
            print("trace: no perfetto_trace.json.gz written")
            return
        with gzip.open(paths[0]) as f:
            data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    pname = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = [e for e in events if e.get("ph") == "X" and "GPU" in pname.get(e.get("pid"), "")]
    if not gpu:
        print("trace: no GPU process among", sorted(set(pname.values()))[:20])
    streams = collections.defaultdict(list)
    for e in gpu:
        streams[(e["pid"], e.get("tid"))].append(e)
    print(f"trace: {len(gpu)} GPU events on {len(streams)} streams; processes: "
          f"{sorted(set(pname.get(e['pid']) for e in gpu))}")
    stats = collections.defaultdict(lambda: ([], []))
    longest = []
    for evs in streams.values():
        evs.sort(key=lambda e: e["ts"])
        if len(evs) > len(longest):
            longest = evs
        for prev, e in zip([None] + evs[:-1], evs):
            durs, gaps = stats[e["name"][:60]]
            durs.append(e.get("dur", 0.0))
            if prev is not None:
                gaps.append(e["ts"] - prev["ts"] - prev.get("dur", 0.0))
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    print(f"{'kernel':60s} {'count':>6s} {'dur us':>8s} {'gap us':>8s}")
    for name, (durs, gaps) in sorted(stats.items(), key=lambda kv: -len(kv[1][0])):
        print(f"{name:60s} {len(durs):6d} {med(durs):8.1f} {med(gaps):8.1f}")
    # The launch details the profiler records with each kernel (grid, block,
    # registers, shared memory where it gives them), once per kernel name.
    seen = set()
    for e in gpu:
        if e["name"][:60] not in seen and e.get("args"):
            seen.add(e["name"][:60])
            details = {k: v for k, v in e["args"].items() if k not in ("correlation_id", "group_id")}
            print(f"  {e['name'][:60]}: {str(details)[:300]}")
    mid = len(longest) // 2
    print("one stretch of the busiest stream (name, dur us, gap before us):")
    for prev, e in zip(longest[mid - 1:mid + 11], longest[mid:mid + 12]):
        print(f"  {e['name'][:110]:110s} {e.get('dur', 0.0):8.1f} {e['ts'] - prev['ts'] - prev.get('dur', 0.0):8.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=64, help="head dim H")
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=("fwd", "fwdbwd"))
    ap.add_argument("--impls", default="jaxattn,cudnn")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="run each implementation alone this long before tracing it")
    ap.add_argument("--masks", action="store_true", help="masks.py's packed / separate rows instead")
    ap.add_argument("--doc-min", type=int, default=512)
    ap.add_argument("--doc-max", type=int, default=2048)
    a = ap.parse_args()
    if a.masks:
        return trace_masks(a)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import attention as bench  # noqa: E402
    import jax.numpy as jnp
    import jaxattn
    H, T = a.heads, a.seqlen
    row = dict(pass_=a.pass_, dtype="bfloat16", B=max(1, 16384 // T), T=T, S=T, N=2048 // H, K=2048 // H, H=H,
               causal=bool(a.causal))
    args = bench.make_inputs(jax, jnp, row, jax.devices()[0], 1, 0)[0]
    for impl in a.impls.split(","):
        f = jax.jit(bench.build_function(jax, jnp, jaxattn, impl, row, None))
        print(f"== {impl}: {a.pass_} H={H} T={T} B={row['B']} N={row['N']} causal={a.causal}")
        if a.settle_s > 0:
            settle(lambda: f(*args), a.settle_s)
        kernel_trace(lambda: f(*args), a.steps)


def settle(step, seconds):
    """Runs `step` back to back for `seconds` (a sync every ~10 calls), then prints the
    calls made and nvidia-smi's SM clock and power draw, read while the last calls run."""
    jax.block_until_ready(step())
    t0, calls, smi = time.perf_counter(), 0, None
    while time.perf_counter() - t0 < seconds:
        jax.block_until_ready([step() for _ in range(10)])
        calls += 10
        if smi is None and time.perf_counter() - t0 > 0.8 * seconds:
            try:
                smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                                        "--format=csv,noheader"], stdout=subprocess.PIPE, text=True)
            except OSError:
                smi = False
    dt = time.perf_counter() - t0
    reading = smi.communicate()[0].strip() if smi else "n/a"
    print(f"settled: {calls} calls in {dt:.2f} s ({1e3 * dt / calls:.3f} ms a call); "
          f"nvidia-smi near the end: {reading}")


def trace_masks(a):
    """Kernel timelines of masks.py's packed (segment ids) and separate (padded batch
    with lengths) rows: the same documents, causal, jaxattn."""
    import jax.numpy as jnp
    import numpy as np

    import jaxattn
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    from attention import packed_documents, separate_documents  # noqa: E402
    L, H = a.seqlen, a.heads
    N = 2048 // H
    lens = packed_documents(L, a.doc_min, a.doc_max)
    rng = np.random.default_rng(0)
    packed = [rng.standard_normal((1, L, N, H)).astype(np.float32) for _ in range(4)]
    separate = separate_documents(packed, lens)
    ids = jnp.asarray(np.repeat(np.arange(len(lens)), lens)[None], jnp.int32)
    seq = jnp.asarray(lens, jnp.int32)
    rows = {"packed": (packed, dict(q_segment_ids=ids, kv_segment_ids=ids)),
            "separate": (separate, dict(query_seq_lengths=seq, key_value_seq_lengths=seq))}
    for name, (arrs, kw) in rows.items():
        q, k, v, dout = (jnp.asarray(x, jnp.bfloat16) for x in arrs)
        attn = lambda q, k, v, kw=kw: jaxattn.flash_attention(q, k, v, is_causal=True, **kw)  # noqa: E731
        if a.pass_ == "fwd":
            f = jax.jit(attn)
        else:
            f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * dout), (0, 1, 2)))
        print(f"== {name}: {a.pass_} H={H} tokens={L} documents={len(lens)} N={N}")
        kernel_trace(lambda: f(q, k, v), a.steps)


if __name__ == "__main__":
    main()
