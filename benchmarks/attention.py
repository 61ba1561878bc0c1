#!/usr/bin/env python3
"""jaxattn vs jax.nn.dot_product_attention (cuDNN and XLA): time and TFLOP/s.

All implementations run in ONE process on the SAME inputs, row by row.

GPU grid (default): B*T = 16384 tokens, N*H = 2048 (N = 2048 / H), K = N,
T = S in {512 ... 16384}, H in {64, 128, 256}, causal and not, passes fwd
and fwd+bwd, bfloat16. The fwd+bwd pass is jax.grad of sum(out * dout) with
respect to (q, k, v), under jit.

FLOPs: fwd = 4*B*N*T*S*H (two matmuls), halved when causal; fwd+bwd counts
3.5x fwd (bwd = 2.5x fwd: five matmuls against the forward's two).

Timing: each function is jitted and compiled ahead of time (compile time is
recorded separately), run `--warmup` times untimed (the first run's output
is kept for the cross-check), then `--reps` timed runs, each ending with
block_until_ready; the median is reported. A sample is 3-40 back-to-back
calls (~20 ms; one call when a call takes >= 50 ms) and one sync, so host
dispatch overlaps device work as in a training loop; the sync's cost (and
the dispatch cost, measured once on a trivial jitted function,
`dispatch_overhead_us` in the JSON) matters only for the smallest rows.
The implementations of a row take turns (round robin), one sample each per
turn by default, the order rotating by one every turn. (With a fixed order,
cuDNN, always right after the portable kernel, read H=128 T=16K fwd+bwd at
598 TFLOP/s against 539 when settled alone, while jaxattn read 573 / 568:
session 26, docs/perf.md.) The H200 runs power-capped (~700 W) and sets its clock from
a ~1 s average of the power, so in that round robin every implementation runs
at the clock the mix sets: an implementation that draws less power per clock
(the portable kernels) is timed below its own clock, the hungriest above it.
`--settle-ms 1500 --turn-samples 5` runs each implementation untimed for
1.5 s before each of its turns, measuring each at its own clock (session 17:
the portable H=128 T=16K forward read 324 TFLOP/s beside cuDNN at 1 sample a
turn and 348 alone). `--cool-ms 2500` instead leaves the GPU idle that long before
each turn, so every implementation is timed from a cool power average at its burst
clock (up to 1980 MHz): what a short call sees, and how the peers table behind the
project's bars (20 jitted calls from the host, one implementation at a time) was
measured. Say which mode a number comes from: cuDNN's H=128 T=16K non-causal fwd+bwd
read 610 TFLOP/s in that table and 534-548 settled (docs/perf.md, sessions 37-39).
`--clocks` samples the SM clock and board power through NVML
during the timed samples (benchmarks/gpu_clock.py) and reports each implementation's
medians beside its time ("clock" in the JSON, a column of the table).
Inputs rotate over 3 sets when one set (q, k, v[, dout]) is smaller than
`--rotate-below-mib` (default 128 MiB, about 2x an H200's L2), so that no
timed run finds its inputs in a warm L2. At the default GPU sizes a single
q is already 64 MiB (a set is >= 192 MiB), so one set is used.

An implementation that cannot run a row (cuDNN unsupported shape, XLA out of
memory, anything raising) is recorded with null time and TFLOP/s and the
reason; the run goes on. XLA is skipped up front for T >= 16384 or when its
[B, N, T, S] float32 logits exceed --xla-max-logits-gib (8 GiB). After a
fatal device error (illegal address, launch failure) the remaining rows are
recorded as skipped: the CUDA context cannot be trusted any more.

jaxattn's output (fwd) or gradients (fwd+bwd) are also compared with the
first baseline that ran (cuDNN, else XLA): max |a - b| / max |b| per array
must be <= --check-tol, else the row is flagged (a fast wrong kernel is not
a result).

Outputs: DIR/attention.json (environment and rows, rewritten after every
row, so a killed run keeps what it measured), DIR/attention.png (when
matplotlib imports), DIR/attention.md (the table), and the table printed
last on stdout. Progress goes to stderr.

Exit status: 0, or 1 when a jaxattn measurement failed, a cross-check
failed, or the device hit a fatal error; 130 when interrupted.

Examples:
  python3 benchmarks/attention.py                      # full GPU grid
  python3 benchmarks/attention.py --quick              # smoke subset
  python3 benchmarks/attention.py --pass fwd --heads 128 --seqlens 4096,8192
  python3 benchmarks/attention.py --cpu                # the CPU row
  python3 benchmarks/attention.py --cpu --packed       # packed documents vs separate sequences

--packed: B*T = --tokens (default 16384) tokens packed from documents of
random lengths in [--doc-min, --doc-max] (default 512..2048) into one
sequence with q/kv_segment_ids (per-document causal unless --causal 0),
timed against the same documents run as separate sequences (one call per
document, the sum of their medians) and against the unsegmented sequence
(what computing every block and masking it afterwards would cost). The
packed output is checked against the separate ones. Writes DIR/packed.json
and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback

# jaxattn_sm80: jaxattn forced onto its portable (sm_80+) CUDA kernels.
IMPLS = ("jaxattn", "jaxattn_sm80", "cudnn", "xla")
GIB = 1 << 30
MIB = 1 << 20

# Substrings of errors after which the CUDA context is unusable.
FATAL_MARKERS = (
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "illegal memory access",
    "CUDA_ERROR_LAUNCH_FAILED",
    "unspecified launch failure",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "misaligned address",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "illegal instruction",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ASSERT",
    "device-side assert",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


# ---------------------------------------------------------------- arguments --


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="jaxattn vs jax.nn.dot_product_attention (cudnn, xla) benchmark",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="small subset for a smoke run (GPU: H 64,128; T 1024,4096; "
                        "on a CPU backend also tokens 2048, width 256, T 256,1024)")
    p.add_argument("--cpu", action="store_true",
                   help="the CPU row: B=1, T=S=4096, N=K=8, H=64, float32 and bfloat16, "
                        "jaxattn vs xla, fwd and fwd+bwd, few repetitions")
    p.add_argument("--pass", dest="passes", choices=("fwd", "fwdbwd", "both"), default="both")
    p.add_argument("--causal", choices=("0", "1", "both"), default=None,
                   help="default: both (GPU), 0 (--cpu)")
    p.add_argument("--heads", type=csv_ints, default=None, help="head dims H, e.g. 64,128")
    p.add_argument("--seqlens", type=csv_ints, default=None, help="sequence lengths T = S")
    p.add_argument("--dtypes", default=None,
                   help="comma list of dtypes; default bfloat16 (GPU), float32,bfloat16 (--cpu)")
    p.add_argument("--out", default="results", help="output directory (default: results/)")
    p.add_argument("--implementation", default=None, choices=("none", "cuda", "cpu", "reference"),
                   help="jaxattn implementation= argument (default: None, the platform's pick)")
    p.add_argument("--impls", default=None,
                   help="which implementations to run, comma list of jaxattn,cudnn,xla "
                        "(default: all three; --cpu: jaxattn,xla)")
    p.add_argument("--tokens", type=int, default=None, help="B*T per row (default 16384)")
    p.add_argument("--width", type=int, default=None, help="N*H per row (default 2048)")
    p.add_argument("--reps", type=int, default=None, help="timed runs (default 10; --cpu 3)")
    p.add_argument("--settle-ms", type=float, default=0.0,
                   help="untimed calls of an implementation for this long before each of its turns "
                        "(default 0); the H200 runs power-capped and its clock follows a ~1 s average "
                        "of the power, so in a round robin of ~20 ms samples every implementation "
                        "runs at the clock the mix sets; ~1500 measures each at its own")
    p.add_argument("--cool-ms", type=float, default=0.0,
                   help="idle this long before each implementation's turn (default 0): each is timed "
                        "from a cool power average, at its burst clock; exclusive with --settle-ms")
    p.add_argument("--clocks", action="store_true",
                   help="GPU: sample the SM clock and board power (NVML, benchmarks/gpu_clock.py) "
                        "during the timed samples; per implementation medians in the JSON ('clock') "
                        "and the table")
    p.add_argument("--turn-samples", type=int, default=1,
                   help="timed samples per implementation per round-robin turn (default 1)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed runs after compiling (default 2; --cpu 1)")
    p.add_argument("--xla-max-logits-gib", type=float, default=8.0,
                   help="skip xla when its f32 logits [B,N,T,S] exceed this (default 8)")
    p.add_argument("--xla-max-seqlen", type=int, default=16384,
                   help="skip xla for T >= this (default 16384)")
    p.add_argument("--rotate-below-mib", type=float, default=128.0,
                   help="rotate 3 input sets when one set is smaller than this (default 128)")
    p.add_argument("--check-tol", type=float, default=0.05,
                   help="max |jaxattn - baseline| / max |baseline| allowed (default 0.05)")
    p.add_argument("--no-check", action="store_true", help="skip the cross-check")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; rows not started in time are recorded as skipped")
    p.add_argument("--compile-cache", default=None,
                   help="JAX persistent compilation cache directory (speeds up reruns)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    p.add_argument("--packed", action="store_true",
                   help="the packed-documents comparison instead of the grid (see above)")
    p.add_argument("--doc-min", type=int, default=512, help="--packed: shortest document")
    p.add_argument("--doc-max", type=int, default=2048, help="--packed: longest document")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="measure nothing: redraw the plot and table of an attention.json into --out")
    args = p.parse_args(argv)

    if args.cool_ms < 0 or args.settle_ms < 0:
        p.error("--cool-ms and --settle-ms must be >= 0")
    if args.cool_ms > 0 and args.settle_ms > 0:
        p.error("--cool-ms and --settle-ms are exclusive (one measures the burst clock, the other the settled one)")
    if args.implementation == "none":
        args.implementation = None
    args.pass_list = ["fwd", "fwdbwd"] if args.passes == "both" else [args.passes]
    return args


def resolve_grid(args, backend: str) -> None:
    """Fills the mode-dependent defaults in `args`."""
    on_cpu_backend = args.cpu or backend == "cpu"
    if args.cpu:
        args.heads = args.heads or [64]
        args.seqlens = args.seqlens or [4096]
        args.dtype_list = (args.dtypes or "float32,bfloat16").split(",")
        args.impl_list = (args.impls or "jaxattn,xla").split(",")
        args.causal_list = {"0": [False], "1": [True], "both": [False, True]}[args.causal or "0"]
        args.reps = args.reps or 3
        args.warmup = 1 if args.warmup is None else args.warmup
        args.fixed_batch, args.fixed_heads = 1, 8
        if args.implementation is None:
            args.implementation = "cpu"
    else:
        quick_cpu = args.quick and on_cpu_backend
        if args.quick:
            args.heads = args.heads or [64, 128]
            args.seqlens = args.seqlens or ([256, 1024] if quick_cpu else [1024, 4096])
        args.heads = args.heads or [64, 128, 256]
        args.seqlens = args.seqlens or [512, 1024, 2048, 4096, 8192, 16384]
        args.tokens = args.tokens or (2048 if quick_cpu else 16384)
        args.width = args.width or (256 if quick_cpu else 2048)
        args.dtype_list = (args.dtypes or "bfloat16").split(",")
        args.impl_list = (args.impls or ",".join(IMPLS)).split(",")
        args.causal_list = {"0": [False], "1": [True], "both": [False, True]}[args.causal or "both"]
        args.reps = args.reps or 10
        args.warmup = 2 if args.warmup is None else args.warmup
        args.fixed_batch = args.fixed_heads = None
    for name in args.impl_list:
        if name not in IMPLS:
            raise SystemExit(f"unknown implementation {name!r}; pick from {IMPLS}")
    args.reps = max(1, args.reps)
    args.warmup = max(1, args.warmup)  # the first run is also the cross-check's output


def make_rows(args) -> list[dict]:
    """The grid in measuring order: both passes of a shape one after the other, so a
    time budget that runs out leaves whole shapes unmeasured, not a whole pass (the
    table groups the rows by pass again)."""
    rows = []
    for dtype in args.dtype_list:
        for H in args.heads:
            for causal in args.causal_list:
                for T in args.seqlens:
                    if args.fixed_batch is not None:
                        B, N = args.fixed_batch, args.fixed_heads
                    else:
                        B = max(1, args.tokens // T)
                        N = max(1, args.width // H)
                    for pass_ in args.pass_list:
                        rows.append(dict(
                            pass_=pass_, dtype=dtype, B=B, T=T, S=T, N=N, K=N, H=H, causal=causal))
    return rows


def fwd_flops(r: dict) -> float:
    f = 4.0 * r["B"] * r["N"] * r["T"] * r["S"] * r["H"]
    return f / 2 if r["causal"] else f


def row_flops(r: dict) -> float:
    return fwd_flops(r) * (3.5 if r["pass_"] == "fwdbwd" else 1.0)


# --------------------------------------------------------------- environment --


def environment(args, jax, jaxattn, device) -> dict:
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": device.device_kind,
        "device_platform": device.platform,
        "device_count": len(jax.devices(device.platform)),
        "jaxattn": getattr(jaxattn, "__version__", "?"),
        "jaxattn_file": os.path.dirname(jaxattn.__file__),
        "jaxattn_built_with_cuda": bool(jaxattn.built_with_cuda()),
        "argv": sys.argv[1:],
        "mode": "cpu" if args.cpu else ("quick" if args.quick else "full"),
    }
    try:
        import jaxlib

        env["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        from jax._src.lib import cuda_versions  # private: best effort

        if cuda_versions is not None:
            env["cudnn"] = cuda_versions.cudnn_get_version()
            env["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
    except Exception:  # noqa: BLE001
        pass
    if device.platform == "gpu":
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            if smi.returncode == 0:
                env["nvidia_smi"] = smi.stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            pass
    else:
        env["cpu_count"] = os.cpu_count()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        env["cpu_model"] = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
    env["env_vars"] = {k: v for k, v in os.environ.items()
                       if k.startswith(("XLA_", "JAX_", "JAXATTN_", "CUDA_VISIBLE", "TF_CPP"))}
    return env


def dispatch_overhead_us(jax, jnp, device) -> float:
    """Median host time of launching + syncing a trivial jitted function."""
    f = jax.jit(lambda x: x + 1)
    x = jax.device_put(jnp.zeros((8,), jnp.float32), device)
    for _ in range(5):
        f(x).block_until_ready()
    ts = []
    for _ in range(50):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


# ----------------------------------------------------------------- measuring --


class Fatal(Exception):
    """The device is in an error state: stop measuring."""


def short_reason(e: BaseException) -> str:
    text = str(e).strip()
    # XLA errors often carry a long first line; keep what names the cause.
    first = text.splitlines()[0] if text else ""
    for marker in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory"):
        if marker in text and marker not in first:
            first = marker + ": " + first
    reason = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return reason[:400]


def is_fatal(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return any(m in text for m in FATAL_MARKERS)


def build_function(jax, jnp, jaxattn, impl: str, row: dict, jaxattn_impl):
    causal = row["causal"]
    if impl == "jaxattn":
        def attn(q, k, v):
            return jaxattn.flash_attention(q, k, v, is_causal=causal, implementation=jaxattn_impl)
    elif impl == "jaxattn_sm80":
        def attn(q, k, v):
            return jaxattn.flash_attention(q, k, v, is_causal=causal, implementation="cuda_sm80")
    else:
        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)

    if row["pass_"] == "fwd":
        def fn(q, k, v):
            return attn(q, k, v)
    else:
        def fn(q, k, v, dout):
            def loss(q, k, v):
                out = attn(q, k, v)
                return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return fn


def prepare(jax, fn, arg_sets, warmup: int) -> tuple[dict, object]:
    """Compiles fn and runs it `warmup` times. Returns (timer state for sample(), first output).

    Raises with `phase` set on the exception: lower, compile or run.
    """
    phase = "lower"
    try:
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(*arg_sets[0])
        phase = "compile"
        compiled = lowered.compile()
        t1 = time.perf_counter()
        phase = "run"
        first = compiled(*arg_sets[0])
        jax.block_until_ready(first)
        t2 = time.perf_counter()
        n = len(arg_sets)
        for i in range(1, warmup):
            jax.block_until_ready(compiled(*arg_sets[i % n]))
        # Each sample times `inner` back-to-back calls and one final sync, so
        # host dispatch overlaps device work as in a training loop; `inner`
        # makes a sample last ~20 ms and is at least 3 below 50 ms a call
        # (with one call per sample, the ~80 us of dispatch and wake-up were
        # 3% of a 3 ms row; CPU rows of seconds keep one call).
        t = time.perf_counter()
        jax.block_until_ready(compiled(*arg_sets[0]))
        one = max(time.perf_counter() - t, 1e-6)
        inner = int(min(40, max(3 if one < 0.05 else 1, round(20e-3 / one))))
    except Exception as e:  # noqa: BLE001
        e.phase = phase  # type: ignore[attr-defined]
        raise
    state = {"compiled": compiled, "inner": inner, "times": [], "compile_s": round(t1 - t0, 3),
             "first_run_s": round(t2 - t1, 4), "input_sets": len(arg_sets)}
    return state, first


def sample(jax, state: dict, arg_sets, i: int) -> None:
    """One timed sample (`inner` back-to-back calls, one sync) appended to state["times"]."""
    compiled, inner, n = state["compiled"], state["inner"], len(arg_sets)
    try:
        t = time.perf_counter()
        outs = [compiled(*arg_sets[(i * inner + j) % n]) for j in range(inner)]
        jax.block_until_ready(outs)
        t_end = time.perf_counter()
        state["times"].append((t_end - t) / inner)
        state.setdefault("windows", []).append((t, t_end))  # (for --clocks)
        del outs
    except Exception as e:  # noqa: BLE001
        e.phase = "run"  # type: ignore[attr-defined]
        raise


def settle(jax, state: dict, arg_sets, seconds: float) -> None:
    """Untimed back-to-back calls for `seconds` (the clock settles to this implementation)."""
    compiled, n = state["compiled"], len(arg_sets)
    t0, i = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        jax.block_until_ready([compiled(*arg_sets[(i + j) % n]) for j in range(state["inner"])])
        i += state["inner"]


def stats_of(state: dict) -> dict:
    ms = sorted(x * 1e3 for x in state["times"])
    return {
        "median_ms": round(statistics.median(ms), 5),
        "min_ms": round(ms[0], 5),
        "max_ms": round(ms[-1], 5),
        "times_ms": [round(x, 4) for x in ms],
        "compile_s": state["compile_s"],
        "first_run_s": state["first_run_s"],
        "input_sets": state["input_sets"],
        "calls_per_sample": state["inner"],
    }


def measure(jax, fn, arg_sets, reps: int, warmup: int) -> tuple[dict, object]:
    """Compiles fn, runs it `warmup` times, then times `reps` samples. Returns (stats, first output).
    (run_row times its implementations round robin with prepare / sample instead.)"""
    state, first = prepare(jax, fn, arg_sets, warmup)
    for i in range(reps):
        sample(jax, state, arg_sets, i)
    return stats_of(state), first


def make_inputs(jax, jnp, row: dict, device, n_sets: int, seed: int):
    dtype = jnp.dtype(row["dtype"])
    qshape = (row["B"], row["T"], row["N"], row["H"])
    kshape = (row["B"], row["S"], row["K"], row["H"])
    with_dout = row["pass_"] == "fwdbwd"

    @jax.jit
    def gen(key):
        kq, kk, kv, kd = jax.random.split(key, 4)
        q = jax.random.normal(kq, qshape, jnp.float32).astype(dtype)
        k = jax.random.normal(kk, kshape, jnp.float32).astype(dtype)
        v = jax.random.normal(kv, kshape, jnp.float32).astype(dtype)
        d = jax.random.normal(kd, qshape, jnp.float32).astype(dtype)
        return q, k, v, d

    sets = []
    for i in range(n_sets):
        key = jax.device_put(jax.random.key(seed * 7919 + i), device)
        q, k, v, d = gen(key)
        sets.append((q, k, v, d) if with_dout else (q, k, v))
        if not with_dout:
            del d
    jax.block_until_ready(sets)
    return sets


def set_bytes(jnp, row: dict) -> int:
    """Bytes of one input set: q, k, v and (fwd+bwd) dout."""
    item = jnp.dtype(row["dtype"]).itemsize
    q = row["B"] * row["T"] * row["N"] * row["H"]
    kv = row["B"] * row["S"] * row["K"] * row["H"]
    return item * (q * (2 if row["pass_"] == "fwdbwd" else 1) + 2 * kv)


def xla_skip_reason(args, row: dict) -> str | None:
    if row["T"] >= args.xla_max_seqlen:
        return f"skipped: T >= {args.xla_max_seqlen} (XLA materializes the logits)"
    logits = 4 * row["B"] * row["N"] * row["T"] * row["S"]
    if logits > args.xla_max_logits_gib * GIB:
        return (f"skipped: f32 logits [B,N,T,S] = {logits / GIB:.1f} GiB "
                f"> {args.xla_max_logits_gib:g} GiB")
    return None


def compare(jax, jnp, ours, theirs) -> dict:
    """max |a - b| / max |b| per output array (nan when ours is not finite)."""
    @jax.jit
    def rel(a, b):
        a = a.astype(jnp.float32)
        b = b.astype(jnp.float32)
        err = jnp.max(jnp.abs(a - b))
        err = jnp.where(jnp.all(jnp.isfinite(a)), err, jnp.nan)
        return err / jnp.maximum(jnp.max(jnp.abs(b)), jnp.float32(1e-30))

    if isinstance(ours, (tuple, list)):
        names = ("dq", "dk", "dv")[: len(ours)]
        return {n: float(rel(a, b)) for n, a, b in zip(names, ours, theirs)}
    return {"out": float(rel(ours, theirs))}


def fmt_tf(x) -> str:
    if x is None:
        return "n/a"
    return f"{x:.1f}" if x >= 10 else (f"{x:.2f}" if x >= 1 else f"{x:.3g}")


def run_row(args, jax, jnp, jaxattn, device, row: dict, idx: int) -> tuple[dict, bool]:
    """Measures one row with every implementation. Returns (record, fatal)."""
    flops = row_flops(row)
    rec = {
        "pass": row["pass_"], "dtype": row["dtype"], "B": row["B"], "T": row["T"], "S": row["S"],
        "N": row["N"], "K": row["K"], "H": row["H"], "causal": row["causal"],
        "flops": flops, "kernel": None, "results": {}, "check": None,
    }
    jaxattn_impl = args.implementation
    fatal = False

    # Inputs shared by every implementation of this row.
    nbytes = set_bytes(jnp, row)
    n_sets = 3 if nbytes < args.rotate_below_mib * MIB else 1
    rec["input_set_mib"] = round(nbytes / MIB, 2)
    try:
        arg_sets = make_inputs(jax, jnp, row, device, n_sets, seed=idx)
    except Exception as e:  # noqa: BLE001
        reason = "inputs: " + short_reason(e)
        for impl in args.impl_list:
            rec["results"][impl] = {"median_ms": None, "tflops": None, "error": reason, "phase": "inputs"}
        return rec, is_fatal(e)

    try:
        q0, k0, v0 = arg_sets[0][:3]
        platform_name = "cpu" if args.cpu else device.platform
        platform_name = "cuda" if platform_name == "gpu" else platform_name
        rec["kernel"] = jaxattn.kernel_for(q0, k0, v0, is_causal=row["causal"],
                                           implementation=jaxattn_impl, platform=platform_name)
    except Exception as e:  # noqa: BLE001
        rec["kernel"] = "error: " + short_reason(e)

    # Every implementation is compiled and warmed up first, then timed round robin
    # (each repetition samples each implementation once), so clock / thermal drift
    # during the row lands on all of them alike: timed one after the other, the
    # same kernel read up to 10% apart in one run (session 6).
    outputs, states = {}, {}

    def failed(impl, e):
        reason = short_reason(e)
        phase = getattr(e, "phase", "?")
        rec["results"][impl] = {"median_ms": None, "tflops": None, "error": reason, "phase": phase}
        if args.verbose:
            traceback.print_exc()
        if not is_fatal(e):
            return False
        rec["results"][impl]["fatal"] = True
        for rest in args.impl_list:
            rec["results"].setdefault(rest, {"median_ms": None, "tflops": None,
                                             "skipped": "skipped: device in an error state"})
        return True

    for impl in args.impl_list:
        if impl == "xla":
            skip = xla_skip_reason(args, row)
            if skip:
                rec["results"][impl] = {"median_ms": None, "tflops": None, "skipped": skip}
                continue
        fn = build_function(jax, jnp, jaxattn, impl, row, jaxattn_impl)
        try:
            states[impl], outputs[impl] = prepare(jax, fn, arg_sets, args.warmup)
        except Exception as e:  # noqa: BLE001
            if failed(impl, e):
                fatal = True
                break
    per_turn = max(1, args.turn_samples)
    sampler = getattr(args, "clock_sampler", None)
    if sampler is not None:
        sampler.clear()
    for turn in range(-(-args.reps // per_turn)):
        if fatal:
            break
        # The order rotates every turn, so that no implementation always runs right
        # after the same one (the clock under the power cap follows what ran before).
        order = list(states)
        order = order[turn % len(order):] + order[:turn % len(order)] if order else order
        for impl in order:
            if impl not in states:
                continue
            try:
                if args.settle_ms > 0:
                    settle(jax, states[impl], arg_sets, args.settle_ms * 1e-3)
                elif args.cool_ms > 0:
                    time.sleep(args.cool_ms * 1e-3)
                for i in range(turn * per_turn, min(args.reps, (turn + 1) * per_turn)):
                    sample(jax, states[impl], arg_sets, i)
            except Exception as e:  # noqa: BLE001
                del states[impl]
                outputs.pop(impl, None)
                if failed(impl, e):
                    fatal = True
                    break
    for impl, state in states.items():
        if impl in rec["results"]:
            continue
        stats = stats_of(state)
        stats["tflops"] = flops / (stats["median_ms"] * 1e-3) / 1e12
        if sampler is not None:
            stats["clock"] = sampler.stats(state.get("windows", []))
        rec["results"][impl] = stats
    del states

    # Cross-check jaxattn against the first baseline that ran.
    if not args.no_check and not fatal and "jaxattn" in outputs:
        for base in ("cudnn", "xla"):
            if base in outputs:
                try:
                    diffs = compare(jax, jnp, outputs["jaxattn"], outputs[base])
                    worst = max(diffs.values())
                    ok = all(d <= args.check_tol for d in diffs.values())  # nan fails
                    rec["check"] = {"against": base, "max_rel_diff": diffs,
                                    "worst": None if math.isnan(worst) else worst,
                                    "tol": args.check_tol, "ok": ok}
                except Exception as e:  # noqa: BLE001
                    rec["check"] = {"against": base, "error": short_reason(e), "ok": False}
                    fatal = fatal or is_fatal(e)
                break
    del outputs, arg_sets

    res = rec["results"]
    for base in ("cudnn", "xla"):
        a, b = res.get("jaxattn") or {}, res.get(base) or {}
        rec[f"ratio_to_{base}"] = (
            a["tflops"] / b["tflops"] if a.get("tflops") and b.get("tflops") else None)
    return rec, fatal


# ------------------------------------------------------------------- outputs --


def ratio_base(impl_list) -> str:
    return "cudnn" if "cudnn" in impl_list else "xla"


def fmt_clock(c) -> str:
    if not c or c.get("sm_clock_mhz") is None:
        return "-"
    return f"{c['sm_clock_mhz']:.0f} / {c['power_w']:.0f}"


def markdown_table(records: list[dict], impl_list) -> str:
    base = ratio_base(impl_list)
    show_dtype = len({r["dtype"] for r in records}) > 1
    head = ["pass"] + (["dtype"] if show_dtype else []) + ["H", "T", "causal", "jaxattn TFLOP/s"]
    head += [i for i in ("jaxattn_sm80", "cudnn", "xla") if i in impl_list]
    head += [f"ratio to {base}"]
    clocks = any((r["results"].get(i) or {}).get("clock") for r in records for i in ("jaxattn", base))
    if clocks:
        head += [f"SM MHz / W jaxattn, {base}"]
    head += ["kernel"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    notes: dict[tuple[str, str], int] = {}
    bad_checks = []
    # Grouped by pass (forward rows first), in measuring order within a pass.
    for r in sorted(records, key=lambda r: r["pass"] != "fwd"):
        res = r["results"]
        cells = ["fwd+bwd" if r["pass"] == "fwdbwd" else "fwd"]
        if show_dtype:
            cells.append(r["dtype"])
        cells += [str(r["H"]), str(r["T"]), "yes" if r["causal"] else "no"]
        for impl in ["jaxattn"] + [i for i in ("jaxattn_sm80", "cudnn", "xla") if i in impl_list]:
            e = res.get(impl) or {}
            cells.append(fmt_tf(e.get("tflops")))
            why = e.get("skipped") or e.get("error")
            if why:
                notes[(impl, why)] = notes.get((impl, why), 0) + 1
        ratio = r.get(f"ratio_to_{base}")
        cells.append("n/a" if ratio is None else f"{ratio:.2f}")
        if clocks:
            cells.append(", ".join(fmt_clock((res.get(i) or {}).get("clock")) for i in ("jaxattn", base)))
        kernel = r.get("kernel") or "-"
        if kernel.startswith("error:"):
            kernel = "n/a (error)"
        chk = r.get("check")
        if chk and not chk.get("ok"):
            kernel += " MISMATCH"
            bad_checks.append(r)
        cells.append(kernel)
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    if notes:
        by_reason: dict[str, dict[str, int]] = {}
        for (impl, why), n in notes.items():
            by_reason.setdefault(why, {})[impl] = n
        items = []
        for why, per in by_reason.items():
            counts = set(per.values())
            if len(counts) == 1:
                n = counts.pop()
                who = f"{', '.join(per)} ({n} row{'s' if n > 1 else ''})"
            else:
                who = ", ".join(f"{impl} ({n})" for impl, n in per.items())
            items.append(f"- {who}: {why}")
        out += "\n\nn/a:\n" + "\n".join(items)
    if bad_checks:
        out += "\n\ncross-check failures (max |jaxattn - base| / max |base|):\n" + "\n".join(
            f"- {r['pass']} H={r['H']} T={r['T']} causal={int(r['causal'])} vs {r['check'].get('against')}: "
            + (", ".join(f"{k} {v:.3g}" for k, v in r["check"]["max_rel_diff"].items())
               if r["check"].get("max_rel_diff") else str(r["check"].get("error")))
            for r in bad_checks)
    return out


def plot(records: list[dict], impl_list, path: str, title: str = "") -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"matplotlib unavailable ({type(e).__name__}); no plot"
    passes = [p for p in ("fwd", "fwdbwd") if any(r["pass"] == p for r in records)]
    panels = []
    for r in records:
        key = (r["dtype"], r["H"], r["causal"])
        if key not in panels:
            panels.append(key)
    if not passes or not panels:
        return "nothing to plot"
    fig, axes = plt.subplots(len(passes), len(panels), figsize=(3.6 * len(panels), 3.2 * len(passes)),
                             squeeze=False, sharey="row")
    colors = {"jaxattn": "tab:red", "jaxattn_sm80": "tab:orange", "cudnn": "tab:green", "xla": "tab:blue"}
    for i, p in enumerate(passes):
        for j, (dtype, H, causal) in enumerate(panels):
            ax = axes[i][j]
            sel = sorted((r for r in records if r["pass"] == p and r["dtype"] == dtype
                          and r["H"] == H and r["causal"] == causal), key=lambda r: r["T"])
            for impl in impl_list:
                xs = [r["T"] for r in sel if (r["results"].get(impl) or {}).get("tflops")]
                ys = [r["results"][impl]["tflops"] for r in sel if (r["results"].get(impl) or {}).get("tflops")]
                if xs:
                    ax.plot(xs, ys, marker="o", label=impl, color=colors.get(impl))
            ax.set_xscale("log", base=2)
            ts = sorted({r["T"] for r in sel})
            if ts:
                ax.set_xticks(ts)
                ax.set_xticklabels([f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t) for t in ts],
                                   fontsize=7)
                ax.minorticks_off()
            ax.set_title(f"{'fwd+bwd' if p == 'fwdbwd' else 'fwd'} H={H} {'causal' if causal else 'full'}"
                         + (f" {dtype}" if len({r['dtype'] for r in records}) > 1 else ""), fontsize=9)
            ax.grid(True, alpha=0.3)
            if i == len(passes) - 1:
                ax.set_xlabel("T = S")
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=7)
        axes[i][0].set_ylim(bottom=0)  # after the whole row: the y axis is shared
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_json(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


# ------------------------------------------------------------ packed documents --


def packed_documents(total: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Random document lengths in [lo, hi] summing to `total` (the last one cut to fit)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < total:
        lens.append(int(min(rng.integers(lo, hi + 1), total - sum(lens))))
    return lens


def separate_documents(arrays, lens):
    """Packed arrays [1, sum(lens), ...] as separate sequences: numpy float32 arrays
    [len(lens), max(lens), ...], document b in row b, zeros past its length."""
    import numpy as np

    out = []
    for x in arrays:
        x = np.asarray(x, np.float32)
        sep = np.zeros((len(lens), max(lens)) + x.shape[2:], np.float32)
        start = 0
        for b, n in enumerate(lens):
            sep[b, :n] = x[0, start:start + n]
            start += n
        out.append(sep)
    return out


def run_packed(args, jax, jnp, jaxattn, device) -> tuple[dict, str]:
    """Times packed documents (segment ids) against separate sequences; returns (record, table)."""
    import numpy as np

    L = args.tokens or 16384
    H = args.heads[0]
    N = args.fixed_heads or max(1, (args.width or 2048) // H)
    dtype = args.dtype_list[0]
    causal = args.causal != "0"
    lens = packed_documents(L, args.doc_min, args.doc_max)
    ids = jnp.asarray(np.repeat(np.arange(len(lens)), lens)[None], jnp.int32)
    impl = args.implementation if args.implementation != "none" else None

    def fn_for(pass_, **kw):
        def attn(q, k, v):
            return jaxattn.flash_attention(q, k, v, is_causal=causal, implementation=impl, **kw)
        if pass_ == "fwd":
            return attn
        def grads(q, k, v, dout):
            loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return grads

    def inputs(pass_, T, seed):
        row = dict(pass_=pass_, dtype=dtype, B=1, T=T, S=T, N=N, K=N, H=H)
        return make_inputs(jax, jnp, row, device, 1, seed)[0]

    record = {"tokens": L, "documents": lens, "N": N, "H": H, "dtype": dtype, "causal": causal,
              "kernel": jaxattn.kernel_for(*inputs("fwd", 8, 0), q_segment_ids=ids[:, :8],
                                           kv_segment_ids=ids[:, :8], implementation=impl), "passes": {}}
    lines = ["| pass | packed (segment ids) ms | separate sequences ms | packed / separate | "
             "unsegmented ms | max rel diff |", "|---|---|---|---|---|---|"]
    for pass_ in args.pass_list:
        full = inputs(pass_, L, 1)
        packed, out = measure(jax, fn_for(pass_, q_segment_ids=ids, kv_segment_ids=ids), [full],
                              args.reps, args.warmup)
        dense, _ = measure(jax, fn_for(pass_), [full], args.reps, args.warmup)
        sep_ms, worst, start = 0.0, 0.0, 0
        for n in lens:
            part = tuple(x[:, start:start + n] for x in full)
            stats, ref = measure(jax, fn_for(pass_), [part], args.reps, args.warmup)
            sep_ms += stats["median_ms"]
            got = out[:, start:start + n] if pass_ == "fwd" else tuple(g[:, start:start + n] for g in out)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
                a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                worst = max(worst, float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30)))
            start += n
        ratio = packed["median_ms"] / sep_ms
        record["passes"][pass_] = {"packed": packed, "unsegmented": dense, "separate_ms": round(sep_ms, 4),
                                   "packed_over_separate": round(ratio, 3), "max_rel_diff": worst}
        lines.append(f"| {'fwd+bwd' if pass_ == 'fwdbwd' else 'fwd'} | {packed['median_ms']:.1f} | "
                     f"{sep_ms:.1f} | {ratio:.2f} | {dense['median_ms']:.1f} | {worst:.2g} |")
        log(lines[-1])
    header = (f"{len(lens)} documents of {args.doc_min}..{args.doc_max} tokens packed into {L}; N={N} H={H} "
              f"{dtype}, {'per-document causal' if causal else 'full within documents'}, kernel "
              f"{record['kernel']}")
    return record, header + "\n\n" + "\n".join(lines)


# ---------------------------------------------------------------------- main --


def skipped_record(row: dict, impl_list, reason: str) -> dict:
    return {"pass": row["pass_"], "dtype": row["dtype"], "B": row["B"], "T": row["T"], "S": row["S"],
            "N": row["N"], "K": row["K"], "H": row["H"], "causal": row["causal"], "flops": row_flops(row),
            "kernel": None, "check": None, "ratio_to_cudnn": None, "ratio_to_xla": None,
            "results": {i: {"median_ms": None, "tflops": None, "skipped": reason} for i in impl_list}}


def _raise_interrupt(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def timing_mode(config: dict) -> str:
    """How the run's samples were taken (settled, cooled or plain round robin), for the table header."""
    samples = f"{config.get('turn_samples', 1)} samples a turn"
    if config.get("settle_ms"):
        return f"settle {config['settle_ms']:.0f} ms, {samples}"
    if config.get("cool_ms"):
        return f"cool {config['cool_ms']:.0f} ms before each turn, {samples}"
    return "round robin, 1 sample a turn"


def report(doc: dict, out_dir: str) -> str:
    """Writes attention.png (if matplotlib imports) and attention.md; returns the table text."""
    env, impl_list = doc["environment"], doc["config"]["impls"]
    png_path = os.path.join(out_dir, "attention.png")
    md_path = os.path.join(out_dir, "attention.md")
    title = f"{env['device']}, jax {env['jax']}, {env['date']}"
    note = plot(doc["rows"], impl_list, png_path, title) if doc["rows"] else "no rows"
    if note:
        log(note)
    table = markdown_table(doc["rows"], impl_list)
    header = (f"{env['device']} | jax {env['jax']} | jaxattn implementation="
              f"{doc['config']['jaxattn_implementation']} | {env['date']} | {doc.get('elapsed_s')} s"
              f" | {timing_mode(doc['config'])}" + ("" if doc.get("complete") else " | INCOMPLETE"))
    with open(md_path, "w") as f:
        f.write(header + "\n\n" + table + "\n")
    log(f"wrote {md_path}" + ("" if note else f", {png_path}"))
    return header + "\n\n" + table


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
        os.makedirs(args.out, exist_ok=True)
        print(report(doc, args.out), flush=True)
        return 0
    if args.cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.compile_cache:
        os.makedirs(args.compile_cache, exist_ok=True)

    import jax
    import jax.numpy as jnp

    if args.compile_cache:
        try:
            jax.config.update("jax_compilation_cache_dir", args.compile_cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        except Exception as e:  # noqa: BLE001 - an option renamed in some jax version
            log(f"warning: compilation cache not enabled ({short_reason(e)})")

    import jaxattn

    device = jax.devices("cpu")[0] if args.cpu else jax.devices()[0]
    resolve_grid(args, device.platform)
    if not args.cpu and device.platform == "cpu" and not args.quick:
        log("warning: no GPU found; the full GPU grid on CPU will take very long (use --cpu or --quick)")

    os.makedirs(args.out, exist_ok=True)
    if args.packed:
        record, table = run_packed(args, jax, jnp, jaxattn, device)
        record["environment"] = environment(args, jax, jaxattn, device)
        write_json(os.path.join(args.out, "packed.json"), record)
        print(table, flush=True)
        return 0
    json_path = os.path.join(args.out, "attention.json")

    env = environment(args, jax, jaxattn, device)
    env["dispatch_overhead_us"] = round(dispatch_overhead_us(jax, jnp, device), 1)
    config = {
        "passes": args.pass_list, "dtypes": args.dtype_list, "heads": args.heads, "seqlens": args.seqlens,
        "causal": args.causal_list, "impls": args.impl_list, "jaxattn_implementation": args.implementation,
        "tokens": None if args.cpu else args.tokens, "width": None if args.cpu else args.width,
        "reps": args.reps, "warmup": args.warmup, "settle_ms": args.settle_ms, "cool_ms": args.cool_ms,
        "turn_samples": args.turn_samples,
        "xla_max_logits_gib": args.xla_max_logits_gib,
        "xla_max_seqlen": args.xla_max_seqlen, "rotate_below_mib": args.rotate_below_mib,
        "check_tol": None if args.no_check else args.check_tol, "time_budget_s": args.time_budget,
        "flops": "fwd = 4*B*N*T*S*H (halved if causal); fwd+bwd = 3.5 x fwd",
        "timing": "median of reps runs, each block_until_ready, after compile + warmup runs",
    }
    rows = make_rows(args)
    doc = {"environment": env, "config": config, "rows": [], "complete": False}
    log(f"jaxattn benchmark: {len(rows)} rows on {env['device']} ({env['backend']}), jax {env['jax']}, "
        f"jaxattn from {env['jaxattn_file']} (cuda kernels: {env['jaxattn_built_with_cuda']}), "
        f"dispatch overhead {env['dispatch_overhead_us']} us")

    args.clock_sampler = None
    if args.clocks:
        if device.platform != "gpu":
            log("--clocks: not a GPU run, no clock sampling")
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gpu_clock

            try:
                args.clock_sampler = gpu_clock.ClockSampler(gpu_clock.nvml_index(device.id))
            except (OSError, RuntimeError, AttributeError) as e:
                log(f"--clocks: NVML unavailable ({short_reason(e)}); no clock sampling")
    config["clocks"] = args.clock_sampler is not None

    signal.signal(signal.SIGTERM, _raise_interrupt)
    start = time.perf_counter()
    status = 0
    stop_reason = None
    try:
        for idx, row in enumerate(rows):
            elapsed = time.perf_counter() - start
            if stop_reason is None and args.time_budget is not None and elapsed > args.time_budget:
                stop_reason = f"skipped: time budget {args.time_budget:g} s spent"
            if stop_reason is not None:
                doc["rows"].append(skipped_record(row, args.impl_list, stop_reason))
                continue
            t_row = time.perf_counter()
            rec, fatal = run_row(args, jax, jnp, jaxattn, device, row, idx)
            rec["row_s"] = round(time.perf_counter() - t_row, 2)
            doc["rows"].append(rec)
            write_json(json_path, doc)
            parts = []
            for impl in args.impl_list:
                e = rec["results"].get(impl) or {}
                if e.get("tflops") is not None:
                    clock = f" @ {fmt_clock(e['clock'])}" if e.get("clock") else ""
                    parts.append(f"{impl} {e['median_ms']:.3f} ms {fmt_tf(e['tflops'])} TF/s{clock}")
                else:
                    parts.append(f"{impl} n/a ({(e.get('skipped') or e.get('error') or '?')[:80]})")
            base = ratio_base(args.impl_list)
            ratio = rec.get(f"ratio_to_{base}")
            chk = rec.get("check")
            chk_s = "" if not chk else (f" check vs {chk['against']}: "
                                        + ("ok " if chk.get("ok") else "MISMATCH ")
                                        + (f"{chk['worst']:.2g}" if chk.get("worst") is not None else ""))
            log(f"[{idx + 1:3d}/{len(rows)}] {row['pass_']:6s} {row['dtype']} H={row['H']:<3d} "
                f"T={row['T']:<5d} B={row['B']:<3d} N={row['N']:<3d} causal={int(row['causal'])} | "
                + " | ".join(parts)
                + (f" | ratio to {base} {ratio:.2f}" if ratio is not None else "")
                + chk_s + f" ({rec['row_s']:.1f} s)")
            ja = rec["results"].get("jaxattn")
            if ja is not None and ja.get("error"):
                status = 1
            if chk is not None and not chk.get("ok"):
                status = 1
            if fatal:
                status = 1
                stop_reason = "skipped: device in an error state after a fatal error in an earlier row"
                log("fatal device error: the remaining rows are skipped")
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}); writing what was measured")
        status = 130
        doc["interrupted"] = True
        for row in rows[len(doc["rows"]):]:
            doc["rows"].append(skipped_record(row, args.impl_list, "skipped: interrupted"))
    if args.clock_sampler is not None:
        args.clock_sampler.close()
    doc["complete"] = status != 130 and stop_reason is None
    doc["stopped"] = stop_reason
    doc["elapsed_s"] = round(time.perf_counter() - start, 1)
    write_json(json_path, doc)

    log(f"wrote {json_path}")
    print(report(doc, args.out), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
