"""One jitted attention step, bracketed for a profiler: every GPU kernel it launches.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
        --csv python scripts/profile_step.py --impl jaxattn --heads 64 --seqlen 4096 --causal

The step (forward, or jax.grad of sum(out * dout) as in benchmarks/attention.py) is
compiled and run twice first; then profiling is switched on (cuProfilerStart on JAX's
primary context) for exactly one more run, so the profiler lists that run's kernels
and nothing of compilation, autotuning or input generation. Without a profiler it
just runs. B*T = 16384 and N*H = 2048, as in the benchmark grid; the step and its
inputs come from benchmarks/attention.py (build_function, make_inputs), so the
profiled step is the benchmark's.
"""

import argparse
import ctypes
import importlib.util
import os


def profiler(on: bool) -> None:
    """cuProfilerStart / cuProfilerStop on device 0's primary context (JAX's)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) != 0 or cuda.cuCtxSetCurrent(ctx) != 0:
        raise RuntimeError("no CUDA primary context on device 0")
    rc = cuda.cuProfilerStart() if on else cuda.cuProfilerStop()
    if rc != 0:
        raise RuntimeError(f"cuProfiler{'Start' if on else 'Stop'} returned {rc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", default="jaxattn", choices=["jaxattn", "jaxattn_sm80", "cudnn", "xla"])
    ap.add_argument("--heads", type=int, default=64, help="head dim H")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--pass", dest="pass_", default="fwdbwd", choices=["fwd", "fwdbwd"])
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    import jaxattn

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "attention.py")
    spec = importlib.util.spec_from_file_location("jaxattn_benchmark_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    H, T = args.heads, args.seqlen
    B, N = max(1, 16384 // T), max(1, 2048 // H)
    row = dict(pass_=args.pass_, dtype="bfloat16", B=B, T=T, S=T, N=N, K=N, H=H, causal=args.causal)
    fn = jax.jit(bench.build_function(jax, jnp, jaxattn, args.impl, row, None))
    inputs = bench.make_inputs(jax, jnp, row, jax.devices()[0], 1, 0)[0]
    call = lambda: fn(*inputs)  # noqa: E731

    on_gpu = jax.default_backend() == "gpu"
    for _ in range(2):
        jax.block_until_ready(call())
    if on_gpu:
        profiler(True)
    jax.block_until_ready(call())
    if on_gpu:
        profiler(False)
    print(f"profiled one {args.pass_} step: impl={args.impl} B={B} T={T} N={N} H={H} causal={args.causal}")


if __name__ == "__main__":
    main()
