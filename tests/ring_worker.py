"""Ring attention checks on 8 simulated CPU devices, run in a subprocess by test_ring.py.

Usage: python ring_worker.py OUT.json [--gpu] [CHECK ...]

XLA_FLAGS must hold --xla_force_host_platform_device_count=8 before jax is
imported, which is why this runs apart from the rest of the test session.
With --gpu it runs the GPU checks instead (``gpu_checks``: the CUDA kernels on
the real GPUs, 2 or more). Each
check records {"ok": bool, "detail": str} under its name in OUT.json; a check
that fails (AssertionError) or crashes records why instead of stopping the
others.

Every value check runs on the global arrays in natural token order: permute
(zigzag) on the host, shard the sequence over the ring axis, run
``jaxattn.ring_attention`` in ``jax.shard_map`` under ``jax.jit``, unpermute,
and compare with the float64 reference (tests/reference64.py) under the
error bound of the rest of the suite (conftest.assert_close: at most 2x
plain JAX's error in the input dtype).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxattn  # noqa: E402
import reference64  # noqa: E402
from conftest import assert_close, plain_attention, random_inputs  # noqa: E402
from jaxattn.ring import zigzag_permute, zigzag_unpermute  # noqa: E402

_GATHERS = re.compile(r"\b(all-gather|all-to-all)(-start)?\(")
_PERMUTE = re.compile(r"\bcollective-permute(-start)?\(")


def _mesh(shape, names):
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _lse_close(lse, ref_lse, dtype):
    lse = np.asarray(lse, np.float64)
    assert np.all(np.isfinite(lse)), "lse has non-finite values"
    tol = (2e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-4) * (1 + np.abs(ref_lse))
    err = np.abs(lse - ref_lse)
    assert np.all(err <= tol), f"lse error {np.max(err):.3g}"


class Setup:
    """A ring over `seq` (a mesh axis name or tuple) of `mesh`, with the token order
    of `layout`; `spec` shards [B, T, ...] arrays (the batch, heads too if asked)."""

    def __init__(self, mesh, seq, layout, spec, lse_spec, unbatched=False):
        self.mesh, self.seq, self.layout = mesh, seq, layout
        self.P = int(np.prod([mesh.shape[a] for a in (seq if isinstance(seq, tuple) else (seq,))]))
        self.spec, self.lse_spec = spec, lse_spec
        self.axis = 0 if unbatched else 1

    def permute(self, x):
        return zigzag_permute(x, self.P, axis=self.axis) if self.layout == "zigzag" else x

    def unpermute(self, x):
        return zigzag_unpermute(x, self.P, axis=self.axis) if self.layout == "zigzag" else x

    def put(self, x, spec):
        return jax.device_put(self.permute(jnp.asarray(x)), NamedSharding(self.mesh, spec))

    def ring(self, **kw):
        """(q, k, v) -> (out, lse), sharded; the shard_map of ring_attention."""
        fn = lambda q, k, v: jaxattn.ring_attention(  # noqa: E731
            q, k, v, axis_name=self.seq, layout=self.layout, return_residual=True, **kw)
        s = self.spec
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(s, s, s), out_specs=(s, self.lse_spec))


def _compiled(fn, *args):
    """fn compiled for args, and its HLO checked: collective-permutes, no gathers of q/k/v."""
    c = jax.jit(fn).lower(*args).compile()
    text = c.as_text()
    gathers = sorted({m.group(1) for m in _GATHERS.finditer(text)})
    assert not gathers, f"compiled HLO has {gathers}"
    return c, len(_PERMUTE.findall(text))


def check_ring(setup: Setup, *, B=2, Tl=6, Sl=None, N=4, K=2, H=16, dtype=jnp.float32, causal=False,
               impl="cpu", with_lse=False, unbatched=False, seed=0, **ring_kw):
    """Forward (out, lse) and gradients (dq, dk, dv) of the sharded ring against the
    float64 reference; also reports the distance to the unsharded flash_attention."""
    Sl = Tl if Sl is None else Sl
    T, S = Tl * setup.P, Sl * setup.P
    q, k, v, dout = random_inputs((B, T, N, H), (B, S, K, H), dtype, count=4, seed=seed)
    dlse = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((B, T, N)), jnp.float32)
    if unbatched:
        q, k, v, dout, dlse = q[0], k[0], v[0], dout[0], dlse[0]
    scale = 1.0 / np.sqrt(H)
    ring = setup.ring(is_causal=causal, implementation=impl, **ring_kw)
    sq, slse = setup.spec, setup.lse_spec
    args = (setup.put(q, sq), setup.put(k, sq), setup.put(v, sq))
    cts = (setup.put(dout, sq), setup.put(dlse, slse))

    fwd, n_fwd = _compiled(ring, *args)
    out, lse = fwd(*args)
    assert out.dtype == q.dtype and out.shape == q.shape, (out.dtype, out.shape)
    assert lse.dtype == jnp.float32 and lse.shape == q.shape[:-1], (lse.dtype, lse.shape)
    out, lse = setup.unpermute(out), setup.unpermute(lse)

    def loss(q, k, v, dout, dlse):
        o, l = ring(q, k, v)
        total = jnp.sum(o.astype(jnp.float32) * dout.astype(jnp.float32))
        return total + (jnp.sum(l * dlse) if with_lse else 0.0)

    bwd, n_bwd = _compiled(jax.grad(loss, argnums=(0, 1, 2)), *args, *cts)
    grads = [setup.unpermute(g) for g in bwd(*args, *cts)]
    if setup.P > 1:
        assert n_fwd > 0 and n_bwd > 0, f"no collective-permute (forward {n_fwd}, backward {n_bwd})"

    batched = (lambda x: x[None]) if unbatched else (lambda x: x)  # noqa: E731
    qb, kb, vb, doutb, dlseb = (batched(x) for x in (q, k, v, dout, dlse))
    ref_out, ref_lse = reference64.forward(qb, kb, vb, scale=scale, is_causal=causal)
    plain = plain_attention(qb, kb, vb, scale=scale, is_causal=causal)
    assert_close("out", batched(out), plain, ref_out, dtype)
    _lse_close(batched(lse), ref_lse, dtype)

    refs = reference64.backward(qb, kb, vb, doutb, scale=scale, is_causal=causal,
                                dlse=np.asarray(dlseb) if with_lse else None)
    if with_lse:  # plain attention has no lse: the yardstick is the reference rounded to the dtype
        plain_grads = [jnp.asarray(r, dtype) for r in refs]
    else:
        plain_grads = jax.grad(
            lambda q, k, v: jnp.sum(plain_attention(q, k, v, scale=scale, is_causal=causal) * doutb),
            argnums=(0, 1, 2))(qb, kb, vb)
    for name, g, x, pg, r in zip(("dq", "dk", "dv"), grads, (q, k, v), plain_grads, refs):
        assert g.dtype == x.dtype and g.shape == x.shape, (name, g.dtype, g.shape)
        assert_close(name, batched(g), pg, r, dtype)

    # The unsharded kernel, for the record (the assertion is the reference bound).
    flash_out = jaxattn.flash_attention(q, k, v, is_causal=causal)
    diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - flash_out.astype(jnp.float32))))
    return f"P={setup.P} T={T} S={S}: ok; collective-permutes fwd {n_fwd} bwd {n_bwd}; |out - flash| {diff:.2g}"


def seq_setup(P, layout, unbatched=False):
    spec = _seq_spec(("seq",), unbatched)
    return Setup(_mesh((P,), ("seq",)), "seq", layout, spec, spec, unbatched)


def _seq_spec(seq_axes, unbatched):
    seq = seq_axes[0] if len(seq_axes) == 1 else seq_axes
    return P(seq) if unbatched else P(None, seq)


def check_raises(fn, exc, words):
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w not in str(e)]
        assert not missing, f"message lacks {missing}: {e}"
        return f"{type(e).__name__}: {e}"[:300]
    raise AssertionError(f"no {exc.__name__}")


def check_bad_zigzag_length():
    """Global T = 12 over 4 devices: 3 tokens each, not two equal chunks."""
    setup = seq_setup(4, "zigzag")
    q = jnp.ones((1, 12, 2, 8))
    ring = setup.ring(is_causal=True)
    return check_raises(lambda: jax.jit(ring)(q, q, q), ValueError, ("zigzag", "even", "2 * 4 = 8"))


def check_bad_causal_cross():
    setup = seq_setup(4, "contiguous")
    q, k = jnp.ones((1, 8, 2, 8)), jnp.ones((1, 16, 2, 8))
    fn = jax.shard_map(lambda q, k: jaxattn.ring_attention(q, k, k, axis_name="seq", is_causal=True),
                       mesh=setup.mesh, in_specs=(setup.spec, setup.spec), out_specs=setup.spec)
    return check_raises(lambda: jax.jit(fn)(q, k), ValueError, ("is_causal", "2 queries", "4 keys"))


def check_bad_axis_name():
    """The sequence is sharded over 'seq' but the call names 'sequence' (not bound)."""
    setup = seq_setup(2, "contiguous")
    q = jnp.ones((1, 8, 2, 8))
    fn = jax.shard_map(lambda q: jaxattn.ring_attention(q, q, q, axis_name="sequence"),
                       mesh=setup.mesh, in_specs=setup.spec, out_specs=setup.spec)
    return check_raises(lambda: jax.jit(fn)(q), ValueError, ("'sequence'", "not bound", "shard_map"))


def check_memory_flat_in_devices():
    """Per-device temporary memory of the gradient does not grow with the ring size
    (same local shapes on 4 and 8 devices): no step's key/value block is saved."""
    temps = {}
    for P_n in (4, 8):
        setup = seq_setup(P_n, "zigzag")
        ring = setup.ring(is_causal=True, implementation="cpu")
        q = jax.ShapeDtypeStruct((1, 64 * P_n, 4, 32), jnp.float32)
        k = jax.ShapeDtypeStruct((1, 64 * P_n, 2, 32), jnp.float32)
        g = jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v)[0]), argnums=(0, 1, 2))
        c = jax.jit(g).lower(q, k, k).compile()
        temps[P_n] = c.memory_analysis().temp_size_in_bytes
    kv_block = 64 * 2 * 32 * 4 * 2  # one device's k and v
    assert temps[8] <= temps[4] + kv_block // 2, f"temp bytes grow with the ring: {temps}"
    return f"temp bytes per device {temps}"


def _sub_jaxprs(eqn):
    """The jaxprs nested in an equation's parameters (loop bodies, cond branches, calls)."""
    for value in eqn.params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(x, "jaxpr") and hasattr(x, "consts"):  # a ClosedJaxpr
                yield x.jaxpr
            elif hasattr(x, "eqns"):  # a Jaxpr
                yield x


def _holds(eqn, pred) -> bool:
    """Whether eqn, or any equation nested in it, satisfies pred."""
    return pred(eqn) or any(_holds(e, pred) for j in _sub_jaxprs(eqn) for e in j.eqns)


def check_permute_before_kernel():
    """Each ring issues its key/value ppermute before its first kernel call, at
    step 0 and in the loop body of steps 1..P-2: the transfer of the next block
    does not wait for the current block's kernel. Read from the jaxpr (the
    program order the lowering keeps), where a kernel call is its ffi_call or a
    cond choosing among kernel calls (no ppermute inside); the lowered text's
    function structure differs between jax versions (jax 0.11 inlines the loop
    bodies that 0.10 lowers as closed_call functions)."""
    setup = seq_setup(4, "zigzag")
    ring = setup.ring(is_causal=True, implementation="cpu")
    q = jax.ShapeDtypeStruct((1, 32, 2, 8), jnp.float32)
    grad = jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v)[0]), argnums=(0, 1, 2))
    top = jax.make_jaxpr(grad)(q, q, q).jaxpr
    kernels = ("jaxattn_cpu_fwd", "jaxattn_cpu_bwd")
    is_permute = lambda e: e.primitive.name == "ppermute"  # noqa: E731

    def call_site(eqn, kernel):
        calls = lambda e: e.primitive.name == "ffi_call" and e.params.get("target_name") == kernel  # noqa: E731
        return calls(eqn) or (eqn.primitive.name == "cond" and _holds(eqn, calls) and not _holds(eqn, is_permute))

    checked = []

    def visit(jaxpr, path):
        eqns = jaxpr.eqns
        for kernel, other in (kernels, kernels[::-1]):
            sites = [i for i, e in enumerate(eqns) if call_site(e, kernel)]
            if not sites:
                continue
            first = sites[0]
            prev = max([i for i, e in enumerate(eqns[:first]) if call_site(e, other)], default=-1)
            assert any(is_permute(e) for e in eqns[prev + 1:first]), f"{path}: {kernel} before its ring's ppermute"
            checked.append(f"{path}:{kernel[8:]}")
        for e in eqns:
            if not call_site(e, kernels[0]) and not call_site(e, kernels[1]):
                for sub in _sub_jaxprs(e):
                    visit(sub, f"{path}/{e.primitive.name}")

    visit(top, "top")
    want = {"cpu_fwd", "cpu_bwd"}
    loops = {c.split(":")[1] for c in checked if c.split(":")[0].rsplit("/", 1)[-1] in ("scan", "while")}
    assert loops == want and len(checked) >= 4, f"checked only {checked}"
    return f"checked {checked}"


def check_relayout(P_n):
    """auto.to_zigzag / from_zigzag (the collective re-layout that balances causal
    sequence-sharded flash_attention) inside shard_map: contiguous shards of the
    natural order become exactly the shards of zigzag_permute, and back; rank 3
    (lse) and rank 4 arrays; collective-permutes only."""
    from jaxattn.ring import auto

    setup = seq_setup(P_n, "contiguous")
    rng = np.random.default_rng(P_n)
    out = []
    for shape in ((2, 4 * P_n, 3, 5), (2, 2 * P_n, 3)):
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        spec = P(None, "seq")
        fwd = jax.jit(jax.shard_map(lambda a: auto.to_zigzag(a, "seq", P_n), mesh=setup.mesh,
                                    in_specs=spec, out_specs=spec))
        back = jax.jit(jax.shard_map(lambda a: auto.from_zigzag(a, "seq", P_n), mesh=setup.mesh,
                                     in_specs=spec, out_specs=spec))
        z = fwd(x)
        np.testing.assert_array_equal(np.asarray(z), np.asarray(zigzag_permute(x, P_n)))
        np.testing.assert_array_equal(np.asarray(back(z)), np.asarray(x))
        for f in (fwd, back):
            text = f.lower(x).compile().as_text()
            gathers = sorted({m.group(1) for m in _GATHERS.finditer(text)})
            assert not gathers and _PERMUTE.search(text), f"HLO: gathers {gathers}"
        out.append(str(shape))
    return f"exact for {', '.join(out)}"


def checks():
    c = {}
    for P_n in (2, 4, 8):
        c[f"relayout_p{P_n}"] = lambda P_n=P_n: check_relayout(P_n)
    for P_n in (2, 4, 8):
        for layout in ("contiguous", "zigzag"):
            for causal in (False, True):
                # Odd per-device lengths where the layout allows them (zigzag: odd chunks).
                Tl = 7 if layout == "contiguous" else 10
                name = f"p{P_n}_{layout}{'_causal' if causal else ''}"
                c[name] = lambda P_n=P_n, layout=layout, causal=causal, Tl=Tl: check_ring(
                    seq_setup(P_n, layout), Tl=Tl, causal=causal, seed=P_n)
    c["p4_zigzag_causal_bf16"] = lambda: check_ring(
        seq_setup(4, "zigzag"), Tl=8, dtype=jnp.bfloat16, causal=True, H=32)
    c["p4_contiguous_bf16"] = lambda: check_ring(seq_setup(4, "contiguous"), Tl=5, dtype=jnp.bfloat16)
    c["p2_zigzag_causal_f16"] = lambda: check_ring(
        seq_setup(2, "zigzag"), Tl=6, dtype=jnp.float16, causal=True)
    c["p4_zigzag_causal_mqa"] = lambda: check_ring(seq_setup(4, "zigzag"), Tl=6, N=6, K=1, causal=True)
    c["p4_zigzag_causal_no_gqa"] = lambda: check_ring(seq_setup(4, "zigzag"), Tl=6, N=3, K=3, causal=True)
    c["p8_cross_attention"] = lambda: check_ring(seq_setup(8, "contiguous"), Tl=3, Sl=5, H=24)
    c["p4_zigzag_causal_lse_grad"] = lambda: check_ring(
        seq_setup(4, "zigzag"), Tl=6, causal=True, with_lse=True)
    c["p4_zigzag_causal_reference_impl"] = lambda: check_ring(
        seq_setup(4, "zigzag"), Tl=6, causal=True, impl="reference", with_lse=True)
    c["p4_contiguous_causal_default_impl"] = lambda: check_ring(
        seq_setup(4, "contiguous"), Tl=6, causal=True, impl=None)
    c["p4_zigzag_causal_no_overlap"] = lambda: check_ring(  # the measuring mode: same results
        seq_setup(4, "zigzag"), Tl=6, causal=True, with_lse=True, overlap_communication=False)
    c["p2_zigzag_causal_unbatched"] = lambda: check_ring(
        seq_setup(2, "zigzag", unbatched=True), Tl=6, causal=True, unbatched=True)
    c["data_x_seq_zigzag_causal"] = lambda: check_ring(
        Setup(_mesh((2, 4), ("data", "seq")), "seq", "zigzag", P("data", "seq"), P("data", "seq")),
        B=4, Tl=6, causal=True)
    c["heads_x_seq_gqa_zigzag_causal"] = lambda: check_ring(
        Setup(_mesh((2, 4), ("heads", "seq")), "seq", "zigzag", P(None, "seq", "heads"),
              P(None, "seq", "heads")), Tl=6, N=8, K=2, causal=True)
    c["seq_over_two_axes_zigzag_causal"] = lambda: check_ring(
        Setup(_mesh((2, 4), ("a", "b")), ("a", "b"), "zigzag", P(None, ("a", "b")), P(None, ("a", "b"))),
        Tl=4, causal=True)
    c["raises_zigzag_odd_length"] = check_bad_zigzag_length
    c["raises_causal_cross"] = check_bad_causal_cross
    c["raises_unbound_axis"] = check_bad_axis_name
    c["memory_flat_in_devices"] = check_memory_flat_in_devices
    c["permute_before_kernel"] = check_permute_before_kernel
    return c


def gpu_checks():
    """The CUDA kernels in the ring, on every ring size the GPUs allow (2, 4, 8)."""
    c = {}
    n = len(jax.devices("gpu"))
    for P_n in (p for p in (2, 4, 8) if p <= n):
        c[f"gpu_p{P_n}_zigzag_causal_bf16"] = lambda P_n=P_n: check_ring(
            seq_setup(P_n, "zigzag"), B=2, Tl=256, N=8, K=2, H=64, dtype=jnp.bfloat16, causal=True,
            impl="cuda", with_lse=True)
        c[f"gpu_p{P_n}_contiguous_f16"] = lambda P_n=P_n: check_ring(
            seq_setup(P_n, "contiguous"), B=1, Tl=200, Sl=136, N=4, K=4, H=128, dtype=jnp.float16,
            impl="cuda")
        c[f"gpu_p{P_n}_contiguous_causal_default_impl"] = lambda P_n=P_n: check_ring(
            seq_setup(P_n, "contiguous"), B=1, Tl=130, N=4, K=1, H=64, dtype=jnp.bfloat16, causal=True,
            impl=None)
    c["gpu_p2_zigzag_causal_f32_reference_fallback"] = lambda: check_ring(
        seq_setup(2, "zigzag"), Tl=34, N=4, K=2, H=32, dtype=jnp.float32, causal=True, impl=None)
    return c


def main():
    args = [a for a in sys.argv[1:] if a != "--gpu"]
    out_path = args[0]
    only = set(args[1:])
    if GPU:
        assert len(jax.devices("gpu")) >= 2, jax.devices()
    else:
        assert jax.device_count() == 8, jax.devices()
    results = {}
    for name, fn in (gpu_checks() if GPU else checks()).items():
        if only and name not in only:
            continue
        try:
            ok, detail = True, fn()
        except AssertionError as e:
            ok, detail = False, f"AssertionError: {e}"
        except Exception:  # noqa: BLE001
            ok, detail = False, traceback.format_exc()[-3000:]
        results[name] = {"ok": bool(ok), "detail": str(detail)}
        print(f"{name}: {'ok' if ok else 'FAIL'} {str(detail)[:300]}", flush=True)
    with open(out_path, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
