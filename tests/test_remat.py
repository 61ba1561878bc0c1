"""jax.checkpoint (remat) policies and the attention residuals' names.

A policy that saves ``jaxattn.CHECKPOINT_NAMES`` keeps the attention output and
logsumexp, so the backward pass of a checkpointed layer does not run the
forward kernel again (jaxattn/remat.py). Counted in the lowered module of a scan
over checkpointed layers: one forward kernel call (the forward loop's) with the
names saved, two without (the backward loop's too, which also shows that the
count can fail); the gradients are the same bits either way, and the same as
without remat. The tests run on the default backend (the CUDA kernels on a GPU,
with deterministic=True so that the bits compare).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxattn
from conftest import random_inputs

POLICIES = jax.checkpoint_policies
NAMES = POLICIES.save_only_these_names(*jaxattn.CHECKPOINT_NAMES)


def _kernel_calls(module: str, kind: str) -> int:
    """Custom calls of jaxattn's forward or backward kernels (any backend) in a lowered
    module: what JAX asks XLA to run (XLA's GPU loop passes may copy a loop body)."""
    return len(re.findall(rf"custom_call @jaxattn_\w+_{kind}\b", module))


def _model(attention, B=2, T=96, N=4, K=2, H=32, L=3, dtype=jnp.bfloat16):
    """(loss(params, x), params, x) of L residual attention layers in a scan, the layer
    under `checkpoint` (as in most large-model training code: outside a loop, XLA
    merges a recomputed kernel call with the forward's own)."""
    D = N * H
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((B, T, D)), dtype)
    ws = [jnp.asarray(rng.standard_normal((L, D, D)) * 0.1, dtype) for _ in range(4)]

    def layer(ws, x):
        q = (x @ ws[0]).reshape(B, T, N, H)
        k = (x @ ws[1])[..., : K * H].reshape(B, T, K, H)
        v = (x @ ws[2])[..., : K * H].reshape(B, T, K, H)
        o = attention(q, k, v)
        return x + jnp.tanh(o.reshape(B, T, D) @ ws[3])

    def loss(ws, x, policy="none"):
        f = layer if policy == "none" else jax.checkpoint(layer, policy=policy)
        y, _ = jax.lax.scan(lambda x, w: (f(w, x), None), x, ws)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return loss, ws, x


def _check(loss, ws, x, exact=True):
    results = {}
    for name, policy in [("none", "none"), ("recompute", None), ("names", NAMES),
                         ("dots_and_names", POLICIES.save_from_both_policies(POLICIES.dots_saveable, NAMES))]:
        g = jax.jit(jax.grad(lambda ws, x, policy=policy: loss(ws, x, policy)))
        hlo = g.lower(ws, x).as_text()
        results[name] = (_kernel_calls(hlo, "fwd"), _kernel_calls(hlo, "bwd"), g(ws, x))
    counts = {name: r[:2] for name, r in results.items()}  # (forward, backward) calls in the HLO
    # One of each in the scan bodies; the backward body re-runs the forward kernel unless saved.
    assert counts == {"none": (1, 1), "recompute": (2, 1), "names": (1, 1), "dots_and_names": (1, 1)}, counts
    for name in ("recompute", "names", "dots_and_names"):
        # With dots saved, XLA's GPU compiler fuses the projections differently (a saved
        # dot output is rounded to bf16 where the unsaved one fed its fusion directly), so
        # on GPUs that policy's gradients differ from no remat in bf16 roundings, which
        # four tanh layers amplify (H200, session 42: ~1.5 in values of ~30, the kernel
        # call counts as asserted above). Exact on the CPU, where they do not.
        rounding = name == "dots_and_names" and jax.default_backend() != "cpu"
        for a, b in zip(results["none"][2], results[name][2]):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            if exact and not rounding:
                np.testing.assert_array_equal(a, b, err_msg=name)
            elif rounding:
                rel = np.linalg.norm(a - b) / np.linalg.norm(a)
                assert rel <= 3e-2, (name, rel)
            else:  # a backward that adds dq with atomics: bf16 roundings may differ
                np.testing.assert_allclose(a, b, rtol=2e-2, atol=2**-7 * np.abs(a).max(), err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_flash_attention_names(dtype):
    if dtype == jnp.float32 and jax.default_backend() != "cpu":
        pytest.skip("the CUDA kernels take bf16 / f16 (f32 runs the pure-JAX reference)")
    _check(*_model(lambda q, k, v: jaxattn.flash_attention(q, k, v, is_causal=True, deterministic=True),
                   dtype=dtype))


def test_masked_and_unbatched():
    lengths = jnp.asarray([96, 50], jnp.int32)
    _check(*_model(lambda q, k, v: jaxattn.flash_attention(q, k, v, local_window_size=(20, 5),
                                                           key_value_seq_lengths=lengths, logits_soft_cap=3.0,
                                                           deterministic=True)))

    def unbatched(q, k, v):  # [T, N, H] inputs through vmap
        attention = functools.partial(jaxattn.flash_attention, is_causal=True, deterministic=True)
        return jax.vmap(attention)(q, k, v)

    _check(*_model(unbatched))


def test_ring_attention_names():
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    spec = P(None, "seq")
    ring = jax.shard_map(lambda q, k, v: jaxattn.ring_attention(q, k, v, axis_name="seq", is_causal=True),
                         mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    # The ring's CUDA backward has no deterministic mode: exact on the CPU only.
    _check(*_model(ring), exact=jax.default_backend() == "cpu")


def test_names_are_what_the_forward_rule_tags():
    q, k, v = random_inputs((1, 8, 2, 16), (1, 8, 2, 16), jnp.float32)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda q: jnp.sum(jaxattn.flash_attention(q, k, v))))(q))
    for name in jaxattn.CHECKPOINT_NAMES:
        assert f"name={name}" in jaxpr
