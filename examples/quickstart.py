"""jaxattn in one minute: attention forward and backward on the available backend,
checked against the pure-JAX reference and timed next to jax.nn.dot_product_attention.

    python examples/quickstart.py            # CPU-sized defaults, or GPU-sized on a GPU
    python examples/quickstart.py --seqlen 4096 --heads 8 --head-dim 64
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn


def timed(fn, *args, reps: int) -> float:
    """Median wall time of a jitted call, after a warm-up that compiles it."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2 if on_gpu else 1)
    parser.add_argument("--seqlen", type=int, default=4096 if on_gpu else 1024)
    parser.add_argument("--heads", type=int, default=16 if on_gpu else 8)
    parser.add_argument("--kv-heads", type=int, default=None, help="fewer key/value heads: GQA")
    parser.add_argument("--head-dim", type=int, default=128 if on_gpu else 64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--reps", type=int, default=10 if on_gpu else 3)
    args = parser.parse_args()

    B, T, N, H = args.batch, args.seqlen, args.heads, args.head_dim
    K = args.kv_heads or N
    dtype = jnp.dtype(args.dtype)
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, T, N, H), dtype)
    k = jax.random.normal(kk, (B, T, K, H), dtype)
    v = jax.random.normal(kv, (B, T, K, H), dtype)
    dout = jax.random.normal(kd, (B, T, N, H), dtype)

    kernel = jaxattn.kernel_for(q, k, v, is_causal=args.causal)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; jaxattn kernel: {kernel}")
    print(f"q {q.shape}, k/v {k.shape}, {dtype}, causal={args.causal}")

    def fwd_bwd(attn):
        def loss(q, k, v):
            return jnp.sum(attn(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    flash = lambda q, k, v: jaxattn.flash_attention(q, k, v, is_causal=args.causal)
    ref = lambda q, k, v: jaxattn.flash_attention(q, k, v, is_causal=args.causal, implementation="reference")
    stock = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=args.causal)

    # Correctness: output and gradients against the pure-JAX reference.
    out, out_ref = jax.jit(flash)(q, k, v), jax.jit(ref)(q, k, v)
    (_, grads), (_, grads_ref) = fwd_bwd(flash)(q, k, v), fwd_bwd(ref)(q, k, v)
    def rel(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    errs = {"out": rel(out, out_ref)} | {n: rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, grads_ref)}
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    ok = all(e < tol for e in errs.values())
    print("relative error vs reference: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()),
          "-> OK" if ok else "-> MISMATCH")

    # Timing, side by side with jax.nn.dot_product_attention.
    flops = 4 * B * N * T * T * H / (2 if args.causal else 1)
    print(f"\n{'':28s}{'fwd ms':>10s}{'TFLOP/s':>10s}{'fwd+bwd ms':>12s}{'TFLOP/s':>10s}")
    for name, fn in (("jaxattn.flash_attention", flash), ("jax.nn.dot_product_attention", stock)):
        try:
            t_f = timed(jax.jit(fn), q, k, v, reps=args.reps)
            t_fb = timed(fwd_bwd(fn), q, k, v, reps=args.reps)
        except Exception as e:  # e.g. no cuDNN for this shape
            print(f"{name:28s} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        print(f"{name:28s}{t_f * 1e3:10.2f}{flops / t_f / 1e12:10.2f}{t_fb * 1e3:12.2f}{3.5 * flops / t_fb / 1e12:10.2f}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
