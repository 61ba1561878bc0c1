"""Sharding checks on 8 simulated CPU devices, run in a subprocess by test_sharding.py.

Usage: python sharding_worker.py {shardy,gspmd} OUT.json [--gpu] [CHECK ...]

XLA_FLAGS must hold --xla_force_host_platform_device_count=8 before jax is
imported, which is why this runs apart from the rest of the test session.
With --gpu it runs ``gpu_checks`` instead: the CUDA kernels (default
implementation, bf16) sharded over 2 real GPUs (a 1-D mesh, axis "model"). Each
check records {"ok": bool, "detail": str} under its name in OUT.json; a check
that crashes records the exception instead of stopping the others.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback

GPU = "--gpu" in sys.argv
if not GPU:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxattn  # noqa: E402

# Collectives or slicing of operands: none may appear for a supported sharding.
_COMM = re.compile(r"\b(all-gather|all-to-all|collective-permute|dynamic-slice)(-start)?\(")

MESH = None  # set in main: 2 x 4 devices, axes ("data", "model")


def _inputs(B, T, S, N, K, H, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), dtype)
    v = jnp.asarray(rng.standard_normal((B, S, K, H)), dtype)
    return q, k, v


def _attn(impl, causal, **kw):
    def f(q, k, v):
        return jaxattn.flash_attention(q, k, v, is_causal=causal, return_residual=True, implementation=impl, **kw)

    return f


def _loss(f):
    # Uses out and lse, so both cotangents reach the backward kernel.
    def loss(q, k, v):
        out, lse = f(q, k, v)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))) + jnp.sum(jnp.cos(lse))

    return loss


def _comm_ops(compiled_text: str) -> list[str]:
    return sorted({m.group(1) for m in _COMM.finditer(compiled_text)})


def _close(a, b, tol):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    return err <= tol * max(1.0, float(np.max(np.abs(b)))), err


def check_sharded(q_spec, kv_spec, *, B=4, T=32, S=48, N=8, K=8, H=32, causal=False,
                  impl="cpu", dtype=jnp.float32, ring=False):
    """Forward and backward under jit with sharded inputs: same values as unsharded,
    outputs sharded like the inputs, no gathers/slices in the compiled HLO. With
    `ring` (sequence sharded: ring attention), collective-permutes and nothing else."""
    q, k, v = _inputs(B, T, S, N, K, H, dtype)
    qs, kvs = NamedSharding(MESH, q_spec), NamedSharding(MESH, kv_spec)
    shardings = (qs, kvs, kvs)
    args = [jax.device_put(x, s) for x, s in zip((q, k, v), shardings)]
    f = _attn(impl, causal)
    g = jax.grad(_loss(f), argnums=(0, 1, 2))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    details = []
    for name, fn in (("forward", f), ("backward", g)):
        jitted = jax.jit(fn, in_shardings=shardings)
        text = jitted.lower(*args).compile().as_text()
        ops = _comm_ops(text)
        if ops != (["collective-permute"] if ring else []):
            return False, f"{name}: compiled HLO has {ops}"
        got = jitted(*args)
        want = jax.jit(fn)(q, k, v)  # one device, unsharded
        for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            ok, err = _close(a, b, tol)
            if not ok:
                return False, f"{name} output {i}: max error {err:.3g}"
        if name == "forward":
            out, lse = got
            if not out.sharding.is_equivalent_to(qs, out.ndim):
                return False, f"forward: out sharded as {out.sharding.spec}, q as {q_spec}"
            lse_spec = tuple(q_spec)[:3]
            if not lse.sharding.is_equivalent_to(NamedSharding(MESH, P(*lse_spec)), lse.ndim):
                return False, f"forward: lse sharded as {lse.sharding.spec}, expected {P(*lse_spec)}"
        else:
            for grad, s in zip(got, shardings):
                if not grad.sharding.is_equivalent_to(s, grad.ndim):
                    return False, f"backward: gradient sharded as {grad.sharding.spec}, input as {s.spec}"
        details.append(f"{name} ok")
    return True, "; ".join(details)


def check_raises(q_spec, kv_spec, *, N=8, K=8, words=(), backward=False, causal=False, window=None):
    """An unsupported sharding fails at compile time with our message (never a gather)."""
    q, k, v = _inputs(4, 32, 48, N, K, 32)
    qs, kvs = NamedSharding(MESH, q_spec), NamedSharding(MESH, kv_spec)
    f = _attn("cpu", causal, local_window_size=window)
    fn = jax.grad(_loss(f), argnums=(0, 1, 2)) if backward else f
    try:
        text = jax.jit(fn, in_shardings=(qs, kvs, kvs)).lower(q, k, v).compile().as_text()
    except Exception as e:  # noqa: BLE001 - the partitioner wraps our exception
        msg = f"{type(e).__name__}: {e}"
        missing = [w for w in ("jaxattn.flash_attention", *words) if w not in msg]
        if missing:
            return False, f"error lacks {missing}: {msg[:2000]}"
        line = next(x for x in msg.splitlines() if "jaxattn.flash_attention" in x)
        return True, line.strip()[:400]
    return False, f"compiled without error; collectives: {_comm_ops(text)}"


def check_shard_map(*, N=8, K=8, causal=True, impl="cpu"):
    """flash_attention inside a user's shard_map sees local shapes; fwd and grad match."""
    q, k, v = _inputs(4, 32, 48, N, K, 32)
    f = _attn(impl, causal)
    spec = P("data", None, "model" if K % 4 == 0 else None)
    if K % 4:  # GQA with few kv heads: shard heads over the 2-device axis
        spec = P("model", None, "data")
    seen = []

    def local(q, k, v):
        seen.append((q.shape, k.shape))
        return f(q, k, v)

    sm = jax.shard_map(local, mesh=MESH, in_specs=(spec, spec, spec), out_specs=(spec, P(*tuple(spec)[:3])))
    got = jax.jit(sm)(q, k, v)
    want = f(q, k, v)
    for a, b in zip(got, want):
        ok, err = _close(a, b, 1e-5)
        if not ok:
            return False, f"forward: max error {err:.3g}"
    gl = jax.jit(jax.grad(_loss(sm), argnums=(0, 1, 2)))(q, k, v)
    gw = jax.grad(_loss(f), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(gl, gw):
        ok, err = _close(a, b, 1e-5)
        if not ok:
            return False, f"backward: max error {err:.3g}"
    return True, f"local shapes {seen[0]}"


def check_partial_shard_map():
    """shard_map manual over 'data' only, 'model' left automatic: correct values."""
    q, k, v = _inputs(4, 32, 48, 8, 8, 32)
    f = _attn("cpu", True)
    sm = jax.shard_map(f, mesh=MESH, in_specs=P("data"), out_specs=(P("data"), P("data")),
                       axis_names={"data"})
    s = NamedSharding(MESH, P("data", None, "model"))
    got = jax.jit(sm, in_shardings=(s, s, s))(q, k, v)
    want = f(q, k, v)
    for a, b in zip(got, want):
        ok, err = _close(a, b, 1e-5)
        if not ok:
            return False, f"max error {err:.3g}"
    g = jax.jit(jax.grad(_loss(sm), argnums=(0, 1, 2)), in_shardings=(s, s, s))(q, k, v)
    gw = jax.grad(_loss(f), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, gw):
        ok, err = _close(a, b, 1e-5)
        if not ok:
            return False, f"backward: max error {err:.3g}"
    return True, "ok"


def check_vmap(spec5, ring=False):
    """vmap over sharded inputs: the mapped dimension shards like the batch."""
    q, k, v = _inputs(4, 32, 32 if ring else 48, 8, 8, 32)
    q, k, v = (jnp.stack([x, 2 * x]) for x in (q, k, v))
    s = NamedSharding(MESH, spec5)
    f = jax.vmap(_attn("cpu", True))
    g = jax.grad(_loss(f), argnums=(0, 1, 2))
    for name, fn in (("forward", f), ("backward", g)):
        jitted = jax.jit(fn, in_shardings=(s, s, s))
        ops = _comm_ops(jitted.lower(q, k, v).compile().as_text())
        if ops != (["collective-permute"] if ring else []):
            return False, f"{name}: compiled HLO has {ops}"
        for a, b in zip(jax.tree.leaves(jitted(q, k, v)), jax.tree.leaves(jax.jit(fn)(q, k, v))):
            ok, err = _close(a, b, 1e-5)
            if not ok:
                return False, f"{name}: max error {err:.3g}"
    return True, "ok"


def check_output_sequence_sharded():
    """Replicated inputs, output requested sharded along T: runs (the output is sliced)."""
    q, k, v = _inputs(4, 32, 48, 8, 8, 32)
    f = lambda q, k, v: jaxattn.flash_attention(q, k, v, implementation="cpu")  # noqa: E731
    rep = NamedSharding(MESH, P())
    out = jax.jit(f, in_shardings=(rep, rep, rep), out_shardings=NamedSharding(MESH, P(None, "model")))(q, k, v)
    ok, err = _close(out, f(q, k, v), 1e-5)
    return ok, f"max error {err:.3g}"


def check_set_mesh():
    """device_put inputs + jax.sharding.set_mesh, no in_shardings; default implementation."""
    q, k, v = _inputs(4, 32, 48, 8, 8, 32)
    s = NamedSharding(MESH, P("data", None, "model"))
    f = lambda q, k, v: jaxattn.flash_attention(q, k, v, is_causal=True)  # noqa: E731
    g = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))
    with jax.sharding.set_mesh(MESH):
        args = [jax.device_put(x, s) for x in (q, k, v)]
        for name, fn in (("forward", f), ("backward", g)):
            text = jax.jit(fn).lower(*args).compile().as_text()
            ops = _comm_ops(text)
            if ops:
                return False, f"{name}: compiled HLO has {ops}"
            if "jaxattn_cpu" not in text:
                return False, f"{name}: no kernel call in the HLO"
            for a, b in zip(jax.tree.leaves(jax.jit(fn)(*args)), jax.tree.leaves(fn(q, k, v))):
                ok, err = _close(a, b, 1e-5)
                if not ok:
                    return False, f"{name}: max error {err:.3g}"
    return True, "ok"


def check_seq_set_mesh():
    """Sequence-sharded device_put inputs + set_mesh, default implementation, causal:
    the ring runs the kernels (no gathers) and matches the unsharded result."""
    q, k, v = _inputs(2, 32, 32, 8, 4, 32)
    s = NamedSharding(MESH, P("data", "model"))
    f = lambda q, k, v: jaxattn.flash_attention(q, k, v, is_causal=True)  # noqa: E731
    g = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))
    with jax.sharding.set_mesh(MESH):
        args = [jax.device_put(x, s) for x in (q, k, v)]
        for name, fn in (("forward", f), ("backward", g)):
            text = jax.jit(fn).lower(*args).compile().as_text()
            ops = _comm_ops(text)
            if ops != ["collective-permute"]:
                return False, f"{name}: compiled HLO has {ops}"
            if "jaxattn_cpu" not in text:
                return False, f"{name}: no kernel call in the HLO"
            for a, b in zip(jax.tree.leaves(jax.jit(fn)(*args)), jax.tree.leaves(fn(q, k, v))):
                ok, err = _close(a, b, 1e-5)
                if not ok:
                    return False, f"{name}: max error {err:.3g}"
    return True, "ok"


def check_seq_one_side(q_spec, kv_spec):
    """Only the query's (or only the key/value's) sequence sharded: the other side is
    sliced locally to match (a dynamic-slice) and the ring runs. (Results and
    gradients of the unsharded side may be gathered to the layout XLA picks for
    them, e.g. Shardy makes the gradient of a replicated input replicated, so the
    HLO may hold an all-gather here.)"""
    q, k, v = _inputs(4, 32, 32, 8, 8, 32)
    qs, kvs = NamedSharding(MESH, q_spec), NamedSharding(MESH, kv_spec)
    f = _attn("cpu", True)
    g = jax.grad(_loss(f), argnums=(0, 1, 2))
    for name, fn in (("forward", f), ("backward", g)):
        jitted = jax.jit(fn, in_shardings=(qs, kvs, kvs))
        ops = _comm_ops(jitted.lower(q, k, v).compile().as_text())
        if "collective-permute" not in ops:
            return False, f"{name}: no ring; compiled HLO has {ops}"
        for a, b in zip(jax.tree.leaves(jitted(q, k, v)), jax.tree.leaves(jax.jit(fn)(q, k, v))):
            ok, err = _close(a, b, 1e-5)
            if not ok:
                return False, f"{name}: max error {err:.3g}"
    return True, f"ops {ops}"


def check_explicit(q_spec, kv_spec, *, N=8, K=8, raises=None, words=(), ring=False):
    """Explicit-sharding mesh (shardings are types): runs under shard_map, or raises
    the real exception at trace time."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    q, k, v = _inputs(4, 32, 32 if ring else 48, N, K, 32)
    f = _attn(None, True)
    g = jax.grad(_loss(f), argnums=(0, 1, 2))
    want = [f(q, k, v), g(q, k, v)]
    with jax.sharding.set_mesh(mesh):
        qs, kvs = NamedSharding(mesh, q_spec), NamedSharding(mesh, kv_spec)
        args = [jax.device_put(q, qs), jax.device_put(k, kvs), jax.device_put(v, kvs)]
        if raises is not None:
            try:
                jax.jit(f)(*args)
            except raises as e:
                missing = [w for w in ("jaxattn.flash_attention", *words) if w not in str(e)]
                return not missing, f"{type(e).__name__}: {e}"[:400] + (f" lacks {missing}" if missing else "")
            return False, "no error"
        for name, fn, w in (("forward", f, want[0]), ("backward", g, want[1])):
            jitted = jax.jit(fn)
            ops = _comm_ops(jitted.lower(*args).compile().as_text())
            if ops != (["collective-permute"] if ring else []):
                return False, f"{name}: compiled HLO has {ops}"
            got = jitted(*args)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(w)):
                ok, err = _close(a, b, 1e-5)
                if not ok:
                    return False, f"{name}: max error {err:.3g}"
            if name == "backward":
                for grad, s in zip(got, (qs, kvs, kvs)):
                    if grad.sharding.spec != s.spec:
                        return False, f"gradient sharded as {grad.sharding.spec}, input as {s.spec}"
    return True, "ok"


def check_eager_and_size1_axis():
    """Outside jit, on sharded arrays: still partitioned (output stays sharded); a
    size-1 mesh axis on the head dimension H shards nothing and is accepted."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((4, 2, 1), ("data", "heads", "head_dim"), axis_types=(AxisType.Auto,) * 3)
    q, k, v = _inputs(4, 32, 48, 8, 2, 32)
    f = _attn("cpu", True)
    want = f(q, k, v)
    s = NamedSharding(mesh, P("data", None, "heads", "head_dim"))
    args = [jax.device_put(x, s) for x in (q, k, v)]
    got = f(*args)
    for a, b in zip(got, want):
        ok, err = _close(a, b, 1e-5)
        if not ok:
            return False, f"max error {err:.3g}"
    if not got[0].sharding.is_equivalent_to(s, 4):
        return False, f"eager output sharded as {got[0].sharding}"
    g = jax.grad(_loss(f), argnums=(0, 1, 2))(*args)
    gw = jax.grad(_loss(f), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, gw):
        ok, err = _close(a, b, 1e-5)
        if not ok:
            return False, f"backward: max error {err:.3g}"
    ops = _comm_ops(jax.jit(f).lower(*args).compile().as_text())
    return not ops, f"jit HLO has {ops}" if ops else "ok"


def checks():
    c = {}
    for causal in (False, True):
        sfx = "_causal" if causal else ""
        c["batch" + sfx] = lambda causal=causal: check_sharded(P("data"), P("data"), causal=causal)
        c["batch_8" + sfx] = lambda causal=causal: check_sharded(
            P(("data", "model")), P(("data", "model")), B=8, causal=causal)
        c["heads" + sfx] = lambda causal=causal: check_sharded(
            P(None, None, "model"), P(None, None, "model"), causal=causal)
        c["batch_heads" + sfx] = lambda causal=causal: check_sharded(
            P("data", None, "model"), P("data", None, "model"), causal=causal)
        c["gqa_heads" + sfx] = lambda causal=causal: check_sharded(
            P(None, None, "data"), P(None, None, "data"), N=8, K=2, causal=causal)
        c["gqa_batch_heads" + sfx] = lambda causal=causal: check_sharded(
            P("model", None, "data"), P("model", None, "data"), N=8, K=2, causal=causal)
    c["heads_over_8"] = lambda: check_sharded(
        P(None, None, ("data", "model")), P(None, None, ("data", "model")), N=8, K=8)
    c["mqa_batch"] = lambda: check_sharded(P(("data", "model")), P(("data", "model")), B=8, N=4, K=1)
    c["bf16_batch_heads"] = lambda: check_sharded(
        P("data", None, "model"), P("data", None, "model"), causal=True, dtype=jnp.bfloat16)
    c["reference_impl"] = lambda: check_sharded(
        P("data", None, "model"), P("data", None, "model"), causal=True, impl="reference")
    c["default_impl_set_mesh"] = check_set_mesh

    # Sequence sharding: ring attention over the sequence axes (jaxattn/ring/auto.py).
    c["seq"] = lambda: check_sharded(P(None, "model"), P(None, "model"), ring=True)  # T=32, S=48
    c["seq_causal_gqa"] = lambda: check_sharded(
        P(None, "model"), P(None, "model"), S=32, N=8, K=2, causal=True, ring=True)
    c["seq_causal_odd_local"] = lambda: check_sharded(  # 7 tokens a device: the contiguous ring
        P(None, "model"), P(None, "model"), T=28, S=28, causal=True, ring=True)
    c["seq_causal_mqa_bf16"] = lambda: check_sharded(
        P(None, "model"), P(None, "model"), S=32, N=4, K=1, causal=True, ring=True, dtype=jnp.bfloat16)
    c["seq_over_8_causal"] = lambda: check_sharded(
        P(None, ("data", "model")), P(None, ("data", "model")), T=64, S=64, causal=True, ring=True)
    c["batch_seq_causal"] = lambda: check_sharded(
        P("data", "model"), P("data", "model"), S=32, causal=True, ring=True)
    c["heads_seq_gqa_causal"] = lambda: check_sharded(
        P(None, "model", "data"), P(None, "model", "data"), S=32, N=8, K=2, causal=True, ring=True)
    c["seq_default_impl_set_mesh"] = check_seq_set_mesh
    c["seq_q_only"] = lambda: check_seq_one_side(P(None, "model"), P())
    c["seq_kv_only"] = lambda: check_seq_one_side(P(), P(None, "data"))
    c["vmap_seq"] = lambda: check_vmap(P(None, "data", "model"), ring=True)
    c["raises_seq_mismatch"] = lambda: check_raises(
        P(None, "model"), P(None, "data"), words=("ValueError", "sequence dimension S", "'data'", "'model'"))
    c["raises_seq_causal_cross"] = lambda: check_raises(
        P(None, "model"), P(None, "model"), causal=True,
        words=("NotImplementedError", "is_causal", "T=32 and S=48"))
    c["raises_seq_window"] = lambda: check_raises(
        P(None, "model"), P(None, "model"), window=4,
        words=("NotImplementedError", "sequence dimension T", "ring attention does not take local_window_size"))
    c["raises_head_dim"] = lambda: check_raises(
        P(None, None, None, "model"), P(None, None, None, "model"),
        words=("NotImplementedError", "head dimension H", "'model'"))
    c["raises_seq_backward"] = lambda: check_raises(
        P("data", "model"), P("data", "model"), window=4, backward=True,
        words=("NotImplementedError", "sequence dimension T", "'model'", "ring attention does not take"))
    c["raises_gqa_split"] = lambda: check_raises(
        P(None, None, "model"), P(), N=8, K=2, words=("ValueError", "'model'", "K % 4"))
    c["raises_mqa_split"] = lambda: check_raises(
        P(None, None, "data"), P(), N=8, K=1, words=("ValueError", "'data'", "K % 2"))

    c["shard_map"] = lambda: check_shard_map(N=8, K=8)
    c["shard_map_gqa"] = lambda: check_shard_map(N=8, K=2)
    c["shard_map_default_impl"] = lambda: check_shard_map(N=8, K=8, impl=None)
    c["shard_map_reference_impl"] = lambda: check_shard_map(N=8, K=2, impl="reference")
    c["shard_map_partial_manual"] = check_partial_shard_map
    c["vmap_batch_sharded"] = lambda: check_vmap(P(None, "data", None, "model"))
    c["vmap_mapped_dim_sharded"] = lambda: check_vmap(P("data", None, None, "model"))
    c["output_sequence_sharded"] = check_output_sequence_sharded
    c["eager_and_size1_axis"] = check_eager_and_size1_axis
    c["explicit_batch_heads"] = lambda: check_explicit(
        P("data", None, "model", None), P("data", None, "model", None))
    c["explicit_gqa"] = lambda: check_explicit(
        P("model", None, "data", None), P("model", None, "data", None), N=8, K=2)
    c["explicit_seq_causal"] = lambda: check_explicit(
        P(None, "model", None, None), P(None, "model", None, None), ring=True)
    c["explicit_raises_seq_mismatch"] = lambda: check_explicit(
        P(None, "model"), P(None, "data"), raises=ValueError, words=("sequence dimension S", "'data'"))
    c["explicit_raises_gqa_split"] = lambda: check_explicit(
        P(None, None, "model"), P(), N=8, K=2, raises=ValueError, words=("'model'", "K % 4"))
    return c


def gpu_checks():
    """Batch, heads and sequence (ring) sharding over 2 GPUs with the CUDA kernels."""
    kw = dict(impl=None, dtype=jnp.bfloat16, B=2, N=8, K=4, H=64)
    return {
        "gpu_batch_causal": lambda: check_sharded(P("model"), P("model"), T=256, S=256, causal=True, **kw),
        "gpu_heads_gqa_causal": lambda: check_sharded(
            P(None, None, "model"), P(None, None, "model"), T=256, S=256, causal=True, **kw),
        "gpu_seq_causal_gqa": lambda: check_sharded(
            P(None, "model"), P(None, "model"), T=1024, S=1024, causal=True, ring=True, **kw),
        "gpu_seq_cross": lambda: check_sharded(P(None, "model"), P(None, "model"), T=512, S=384, ring=True, **kw),
        "gpu_seq_causal_odd_local": lambda: check_sharded(  # 257 tokens a device: the contiguous ring
            P(None, "model"), P(None, "model"), T=514, S=514, causal=True, ring=True, **kw),
    }


def main():
    global MESH
    args = [a for a in sys.argv[1:] if a != "--gpu"]
    partitioner, out_path = args[0], args[1]
    jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
    if GPU:
        assert len(jax.devices("gpu")) >= 2, jax.devices()
        MESH = Mesh(np.array(jax.devices("gpu")[:2]), ("model",))
    else:
        assert jax.device_count() == 8, jax.devices()
        MESH = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    only = set(args[2:])
    results = {}
    for name, fn in (gpu_checks() if GPU else checks()).items():
        if only and name not in only:
            continue
        try:
            ok, detail = fn()
        except Exception:  # noqa: BLE001
            ok, detail = False, traceback.format_exc()[-3000:]
        results[name] = {"ok": bool(ok), "detail": detail}
        print(f"{name}: {'ok' if ok else 'FAIL'} {detail[:200]}", flush=True)
    with open(out_path, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
