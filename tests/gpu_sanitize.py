#!/usr/bin/env python3
"""A tiny CUDA fwd + bwd run for compute-sanitizer (memcheck, racecheck, ...).

Not a pytest module (pytest does not collect it): scripts/gpu_check.sh runs

  compute-sanitizer --tool memcheck python3 tests/gpu_sanitize.py

B=1, T=S=200 (ragged: not a multiple of any tile), N=4, K=2 (GQA), H=64,
bfloat16, causal, implementation="cuda" forced; then the same with masks (the
masked kernels: a window, key-value lengths, two packed documents and a soft
cap; --no-masks skips it). It checks out, lse, dq, dk, dv against the float64
reference (tests/reference64.py) and exits 1 on a mismatch or a non-finite
value, 2 when the CUDA kernels cannot run here.

On sm_90 "cuda" runs the Hopper kernels; `--implementation cuda_sm80 --H 128 --T 300`
runs the portable ones (at H=128 their backward uses the staggered warp-pair layout),
e.g. under `compute-sanitizer --tool racecheck --kernel-name kns=flash_bwd_kernel`.

For the sanitizer to see out-of-bounds accesses, every buffer should be its
own cudaMalloc: run with XLA_PYTHON_CLIENT_ALLOCATOR=platform (the script
sets it, and XLA_PYTHON_CLIENT_PREALLOCATE=false, unless already set).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=200)
    p.add_argument("--S", type=int, default=None, help="default: T")
    p.add_argument("--N", type=int, default=4)
    p.add_argument("--K", type=int, default=2)
    p.add_argument("--H", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--noncausal", action="store_true")
    p.add_argument("--implementation", default="cuda", choices=("cuda", "cuda_sm80", "cpu"),
                   help="cuda_sm80: the portable kernels; cpu: check this script's plumbing on a "
                        "machine without a GPU")
    p.add_argument("--no-masks", action="store_true", help="skip the masked run")
    p.add_argument("--tol", type=float, default=2e-2,
                   help="max |ours - ref| / max |ref| per array (bf16: ~4e-3 expected)")
    a = p.parse_args(argv)
    S = a.S or a.T
    causal = not a.noncausal

    import jax
    import jax.numpy as jnp

    import jaxattn
    import reference64

    print(f"gpu_sanitize: jax {jax.__version__}, jaxattn from {os.path.dirname(jaxattn.__file__)}, "
          f"devices {jax.devices()}", flush=True)
    impl = a.implementation
    if impl in ("cuda", "cuda_sm80"):
        try:
            device = jax.devices("gpu")[0]
        except RuntimeError as e:
            print(f"gpu_sanitize: no GPU ({e})", flush=True)
            return 2
        if not jaxattn.built_with_cuda():
            print("gpu_sanitize: jaxattn was built without the CUDA kernels", flush=True)
            return 2
    else:
        device = jax.devices("cpu")[0]

    dtype = jnp.dtype(a.dtype)
    rng = np.random.default_rng(1234)
    shapes = {"q": (1, a.T, a.N, a.H), "k": (1, S, a.K, a.H), "v": (1, S, a.K, a.H), "dout": (1, a.T, a.N, a.H)}
    host = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    dev = {n: jax.device_put(jnp.asarray(x, dtype), device) for n, x in host.items()}
    # The reference sees exactly the rounded inputs.
    rounded = {n: np.asarray(x.astype(jnp.float32)) for n, x in dev.items()}
    scale = 1.0 / np.sqrt(a.H)

    # The masked run: no row is left without a key (lse stays finite).
    cut = a.T * 3 // 5
    q_ids = np.repeat([[0, 1]], [cut, a.T - cut], axis=1).astype(np.int32)
    kv_ids = np.repeat([[0, 1]], [min(cut, S), S - min(cut, S)], axis=1).astype(np.int32)
    kv_len = [max(1, S - 10)]
    masks = dict(window=(50, 3), kv_lengths=kv_len, softcap=5.0, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    jax_masks = dict(local_window_size=(50, 3), key_value_seq_lengths=jnp.asarray(kv_len, jnp.int32),
                     logits_soft_cap=5.0, q_segment_ids=jnp.asarray(q_ids), kv_segment_ids=jnp.asarray(kv_ids))
    failures = []
    report = []
    for masked in (False, True) if not a.no_masks else (False,):
        kw = jax_masks if masked else {}
        mkw = masks if masked else {}
        tag = "masked " if masked else ""

        def fwd(q, k, v):
            return jaxattn.flash_attention(q, k, v, is_causal=causal, return_residual=True, implementation=impl,
                                           **kw)

        def loss(q, k, v, dout):
            out = jaxattn.flash_attention(q, k, v, is_causal=causal, implementation=impl, **kw)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

        out, lse = jax.jit(fwd)(dev["q"], dev["k"], dev["v"])
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(dev["q"], dev["k"], dev["v"], dev["dout"])
        jax.block_until_ready((out, lse, grads))

        ref_out, ref_lse = reference64.forward(rounded["q"], rounded["k"], rounded["v"], scale=scale,
                                               is_causal=causal, **mkw)
        ref_grads = reference64.backward(rounded["q"], rounded["k"], rounded["v"], rounded["dout"],
                                         scale=scale, is_causal=causal, **mkw)
        check_all(tag, out, lse, grads, ref_out, ref_lse, ref_grads, failures, report, a.tol)

    shape = f"{impl}: B=1 T={a.T} S={S} N={a.N} K={a.K} H={a.H} {a.dtype} causal={causal}"
    if failures:
        print(f"gpu_sanitize: MISMATCH ({shape}): " + "; ".join(failures), flush=True)
        return 1
    print(f"gpu_sanitize: OK ({shape}): " + ", ".join(report), flush=True)
    return 0


def check_all(tag, out, lse, grads, ref_out, ref_lse, ref_grads, failures, report, tol):
    """Appends to `failures` / `report` the comparison of one run with the reference."""
    import jax.numpy as jnp

    def check(name, ours, ref, tol, relative=True):
        ours = np.asarray(jnp.asarray(ours).astype(jnp.float32), np.float64)
        if ours.shape != ref.shape:
            failures.append(f"{name}: shape {ours.shape} != {ref.shape}")
            return
        if not np.all(np.isfinite(ours)):
            failures.append(f"{name}: {int(np.sum(~np.isfinite(ours)))} non-finite values")
            return
        err = float(np.max(np.abs(ours - ref))) if ours.size else 0.0
        if relative:
            err /= max(float(np.max(np.abs(ref))), 1e-30)
        report.append(f"{name} {err:.2e}")
        if not err <= tol:
            failures.append(f"{name}: {'relative ' if relative else ''}error {err:.3g} > {tol:g}")

    check(tag + "out", out, ref_out, tol)
    check(tag + "lse", lse, ref_lse, 2e-2, relative=False)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        check(tag + name, g, r, tol)


if __name__ == "__main__":
    sys.exit(main())
