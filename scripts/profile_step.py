"""One jitted attention step, bracketed for a profiler: every GPU kernel it launches.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
        --csv python scripts/profile_step.py --impl jaxattn --heads 64 --seqlen 4096 --causal

The step (forward, or jax.grad of sum(out * dout) as in benchmarks/attention.py) is
compiled and run twice first; then profiling is switched on (cuProfilerStart on JAX's
primary context) for exactly one more run, so the profiler lists that run's kernels
and nothing of compilation, autotuning or input generation. Without a profiler it
just runs. B*T = 16384 and N*H = 2048, as in the benchmark grid.
"""

import argparse
import ctypes


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
    ap.add_argument("--impl", default="jaxattn", choices=["jaxattn", "cudnn", "xla"])
    ap.add_argument("--heads", type=int, default=64, help="head dim H")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--pass", dest="pass_", default="fwdbwd", choices=["fwd", "fwdbwd"])
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    import jaxattn

    H, T = args.heads, args.seqlen
    B, N = max(1, 16384 // T), 2048 // H
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.random.normal(kk, (B, T, N, H), jnp.bfloat16) for kk in keys)

    if args.impl == "jaxattn":
        def attn(q, k, v):
            return jaxattn.flash_attention(q, k, v, is_causal=args.causal)
    else:
        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=args.causal, implementation=args.impl)

    if args.pass_ == "fwd":
        fn = jax.jit(attn)
        call = lambda: fn(q, k, v)  # noqa: E731
    else:
        def grads(q, k, v, dout):
            return jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * dout), argnums=(0, 1, 2))(q, k, v)
        fn = jax.jit(grads)
        call = lambda: fn(q, k, v, dout)  # noqa: E731

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
