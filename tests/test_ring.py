"""Ring attention (jaxattn.ring_attention) and its token layouts.

The multi-device checks need 8 simulated CPU devices, configured before jax is
imported: they run in a subprocess (tests/ring_worker.py) and each is reported
here as its own test. The layout arithmetic (which sub-blocks each ring step
computes, the zig-zag permutation) and the single-device and error paths run
in-process. See docs/sharding.md.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxattn
import reference64
from conftest import CUDA_READY, assert_close, gpu_count, plain_attention, random_inputs, run_worker
from jaxattn.ring import layout as ring_layout
from jaxattn.ring import zigzag_indices, zigzag_permute, zigzag_unpermute

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_worker.py")

# The checks of ring_worker.checks(), by name.
CHECKS = [
    *(f"p{p}_{layout}{c}" for p in (2, 4, 8) for layout in ("contiguous", "zigzag") for c in ("", "_causal")),
    "p4_zigzag_causal_bf16",
    "p4_contiguous_bf16",
    "p2_zigzag_causal_f16",
    "p4_zigzag_causal_mqa",
    "p4_zigzag_causal_no_gqa",
    "p8_cross_attention",
    "p4_zigzag_causal_lse_grad",
    "p4_zigzag_causal_reference_impl",
    "p4_contiguous_causal_default_impl",
    "p4_zigzag_causal_no_overlap",
    "p2_zigzag_causal_unbatched",
    "data_x_seq_zigzag_causal",
    "heads_x_seq_gqa_zigzag_causal",
    "seq_over_two_axes_zigzag_causal",
    "raises_zigzag_odd_length",
    "raises_causal_cross",
    "raises_unbound_axis",
    "memory_flat_in_devices",
    "permute_before_kernel",
    "relayout_p2",
    "relayout_p4",
    "relayout_p8",
]

_results: dict = {}


def _worker(tmp_dir, gpu: bool = False) -> dict:
    """Runs ring_worker.py (8 simulated CPU devices, or the GPUs) and returns its results."""
    return run_worker(WORKER, os.path.join(str(tmp_dir), "ring_gpu.json" if gpu else "ring.json"), gpu=gpu)


def _run_worker(tmp_dir) -> dict:
    if not _results:
        _results.update(_worker(tmp_dir))
    return _results


@pytest.fixture(scope="module")
def worker_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ring")


def test_worker_ran_every_check(worker_dir):
    res = _run_worker(worker_dir)
    assert "__error__" not in res, res.get("__error__")
    assert sorted(res) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_ring_8_devices(check, worker_dir):
    res = _run_worker(worker_dir)
    assert "__error__" not in res, res.get("__error__")
    assert check in res, f"the worker did not run {check}"
    assert res[check]["ok"], res[check]["detail"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_READY or gpu_count() < 2, reason="needs 2+ CUDA GPUs and the CUDA kernels")
def test_ring_gpus(tmp_path):
    """The CUDA kernels in the ring on the real GPUs (ring_worker.gpu_checks)."""
    res = _worker(tmp_path, gpu=True)
    assert "__error__" not in res, res.get("__error__")
    failed = {k: v["detail"] for k, v in res.items() if not v["ok"]}
    assert res and not failed, failed


# --- The schedule: which (query, key) pairs each ring step computes. ---

def _computed(blocks, Tl, Sl):
    """How often each local (query row, key row) pair is visited by `blocks`."""
    count = np.zeros((Tl, Sl), int)
    for b in blocks:
        (q0, q1), (k0, k1) = b.q, b.kv
        sub = np.ones((q1 - q0, k1 - k0), int)
        if b.causal:
            sub = np.tril(sub)  # the kernel's top-left aligned causal mask
        count[q0:q1, k0:k1] += sub
    return count


def _held(step, device):
    return "own" if step == 0 else ("earlier" if step <= device else "later")


@pytest.mark.parametrize("layout", ring_layout.LAYOUTS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("num_devices", [1, 2, 3, 4, 7, 8])
def test_steps_cover_exactly_the_visible_pairs(layout, is_causal, num_devices):
    """Every visible pair is computed exactly once over the ring, no invisible one."""
    Tl = 6
    for r in range(num_devices):
        qpos = ring_layout.global_positions(layout, num_devices, r, Tl)
        for s in range(num_devices):
            src = (r - s) % num_devices
            kpos = ring_layout.global_positions(layout, num_devices, src, Tl)
            visible = (kpos[None, :] <= qpos[:, None]) if is_causal else np.ones((Tl, Tl), bool)
            blocks = ring_layout.step_blocks(layout, is_causal, Tl, Tl, _held(s, r))
            np.testing.assert_array_equal(_computed(blocks, Tl, Tl), visible.astype(int),
                                          err_msg=f"device {r} step {s}")


def _work(layout, P_n, Tl=8):
    """[device, step]: (query, key) pairs visited."""
    return np.array([[_computed(ring_layout.step_blocks(layout, True, Tl, Tl, _held(s, r)), Tl, Tl).sum()
                      for s in range(P_n)] for r in range(P_n)])


@pytest.mark.parametrize("num_devices", [2, 4, 8])
def test_zigzag_balances_causal_work(num_devices):
    work = _work("zigzag", num_devices)
    # Every device does the same work at every step (no device idles in a step).
    assert np.all(work == work[0:1, :]), work
    # The contiguous layout does not: device d has d + 1 blocks to attend.
    contiguous = _work("contiguous", num_devices)
    assert len(set(contiguous.sum(1))) == num_devices, contiguous


def test_step_blocks_rejects_unknown_held():
    with pytest.raises(ValueError, match="held"):
        ring_layout.step_blocks("zigzag", True, 4, 4, "mine")


# --- The zig-zag permutation helpers. ---

def test_zigzag_order():
    x = np.arange(16)
    got = np.asarray(zigzag_permute(x, 4, axis=0))
    # Chunks of 2: device d holds chunks d and 7 - d.
    assert got.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    np.testing.assert_array_equal(zigzag_indices(16, 4), got)
    for d in range(4):
        np.testing.assert_array_equal(got[4 * d:4 * (d + 1)], ring_layout.global_positions("zigzag", 4, d, 4))


@pytest.mark.parametrize("axis", [0, 1, -2])
@pytest.mark.parametrize("num_devices", [1, 3, 8])
def test_zigzag_roundtrip(axis, num_devices):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2 * num_devices * 3, 2 * num_devices * 5, 3)))
    y = zigzag_permute(x, num_devices, axis=axis)
    idx = zigzag_indices(x.shape[axis], num_devices)
    np.testing.assert_array_equal(np.asarray(y), np.take(np.asarray(x), idx, axis=axis))
    np.testing.assert_array_equal(np.asarray(zigzag_unpermute(y, num_devices, axis=axis)), np.asarray(x))


def test_zigzag_helpers_reject_bad_lengths():
    with pytest.raises(ValueError, match="divisible by 8"):
        zigzag_permute(jnp.ones((1, 12)), 4)
    with pytest.raises(ValueError, match="divisible by 6"):
        zigzag_unpermute(jnp.ones((1, 8)), 3)
    with pytest.raises(ValueError, match="num_devices"):
        zigzag_indices(8, 0)


# --- One device (an axis of size 1): the ring is one causal/full kernel call. ---

def _one_device_ring(device=None, **kw):
    mesh = Mesh(np.array([device] if device is not None else jax.devices()[:1]), ("seq",))
    fn = lambda q, k, v: jaxattn.ring_attention(q, k, v, axis_name="seq", return_residual=True, **kw)  # noqa: E731
    spec = P(None, "seq")
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec)))


@pytest.mark.parametrize("layout", ring_layout.LAYOUTS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_single_device_ring(layout, is_causal):
    B, T, N, K, H = 2, 10, 4, 2, 16
    # implementation="cpu" runs on a CPU device, also where the default backend is a GPU.
    cpu = jax.devices("cpu")[0]
    q, k, v, dout = (jax.device_put(x, cpu)
                     for x in random_inputs((B, T, N, H), (B, T, K, H), jnp.float32, count=4))
    ring = _one_device_ring(cpu, is_causal=is_causal, layout=layout, implementation="cpu")
    out, lse = ring(q, k, v)
    scale = 1 / np.sqrt(H)
    ref_out, ref_lse = reference64.forward(q, k, v, scale=scale, is_causal=is_causal)
    assert_close("out", out, plain_attention(q, k, v, scale=scale, is_causal=is_causal), ref_out, jnp.float32)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=2e-5, atol=2e-5)
    grads = jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v)[0] * dout), argnums=(0, 1, 2))(q, k, v)
    plain = jax.grad(lambda q, k, v: jnp.sum(plain_attention(q, k, v, scale=scale, is_causal=is_causal) * dout),
                     argnums=(0, 1, 2))(q, k, v)
    refs = reference64.backward(q, k, v, dout, scale=scale, is_causal=is_causal)
    for name, g, pg, r in zip(("dq", "dk", "dv"), grads, plain, refs):
        assert_close(name, g, pg, r, jnp.float32)


# --- Bad input: clear ValueErrors at trace time. ---

def test_unbound_axis_outside_shard_map():
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(ValueError, match="'seq' is not bound.*shard_map"):
        jaxattn.ring_attention(q, q, q, axis_name="seq")


def test_bad_axis_name_type():
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(ValueError, match="axis_name must be"):
        jaxattn.ring_attention(q, q, q, axis_name=0)


def test_bad_layout():
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(ValueError, match="layout must be one of"):
        _one_device_ring(layout="striped")(q, q, q)


def test_zigzag_needs_even_local_length():
    q = jnp.ones((1, 7, 2, 16))
    with pytest.raises(ValueError, match="zigzag.*even"):
        _one_device_ring(layout="zigzag")(q, q, q)


def test_causal_needs_equal_lengths():
    q, k = jnp.ones((1, 6, 2, 16)), jnp.ones((1, 8, 2, 16))
    with pytest.raises(ValueError, match="is_causal needs as many queries as keys"):
        _one_device_ring(is_causal=True)(q, k, k)


def test_flash_attention_errors_apply():
    q, k = jnp.ones((1, 8, 3, 16)), jnp.ones((1, 8, 2, 16))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        _one_device_ring()(q, k, k)


def test_empty_query_gives_empty_results():
    q, k = jnp.ones((1, 0, 2, 16)), jnp.ones((1, 4, 2, 16))
    out, lse = _one_device_ring()(q, k, k)
    assert out.shape == (1, 0, 2, 16) and lse.shape == (1, 0, 2) and lse.dtype == jnp.float32
