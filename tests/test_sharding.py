"""flash_attention on sharded inputs: batch/head sharding runs locally, the rest raises.

The multi-device checks need 8 simulated CPU devices, which must be configured
before jax is imported: they run in a subprocess (tests/sharding_worker.py),
once per partitioner (Shardy and GSPMD), and each check is reported here as its
own test. See docs/sharding.md.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

import jaxattn
from conftest import CUDA_READY, gpu_count, run_worker
from jaxattn import sharding

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharding_worker.py")
PARTITIONERS = ("shardy", "gspmd")

# The checks of sharding_worker.checks(), by name.
CHECKS = [
    *(f"{name}{sfx}" for sfx in ("", "_causal")
      for name in ("batch", "batch_8", "heads", "batch_heads", "gqa_heads", "gqa_batch_heads")),
    "heads_over_8",
    "mqa_batch",
    "bf16_batch_heads",
    "reference_impl",
    "default_impl_set_mesh",
    "seq",
    "seq_causal_gqa",
    "seq_causal_odd_local",
    "seq_causal_mqa_bf16",
    "seq_over_8_causal",
    "batch_seq_causal",
    "heads_seq_gqa_causal",
    "seq_default_impl_set_mesh",
    "seq_q_only",
    "seq_kv_only",
    "vmap_seq",
    "raises_seq_mismatch",
    "raises_seq_causal_cross",
    "raises_seq_window",
    "raises_head_dim",
    "raises_seq_backward",
    "raises_gqa_split",
    "raises_mqa_split",
    "shard_map",
    "shard_map_gqa",
    "shard_map_default_impl",
    "shard_map_reference_impl",
    "shard_map_partial_manual",
    "vmap_batch_sharded",
    "vmap_mapped_dim_sharded",
    "output_sequence_sharded",
    "eager_and_size1_axis",
    "explicit_batch_heads",
    "explicit_gqa",
    "explicit_seq_causal",
    "explicit_raises_seq_mismatch",
    "explicit_raises_gqa_split",
]

_results: dict[str, dict] = {}


def _run_worker(partitioner: str, tmp_dir) -> dict:
    if partitioner not in _results:
        out = os.path.join(str(tmp_dir), f"sharding_{partitioner}.json")
        _results[partitioner] = run_worker(WORKER, out, (partitioner, out), timeout=900)
    return _results[partitioner]


@pytest.fixture(scope="module")
def worker_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sharding")


@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_worker_ran_every_check(partitioner, worker_dir):
    res = _run_worker(partitioner, worker_dir)
    assert "__error__" not in res, res.get("__error__")
    assert sorted(res) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_sharded(partitioner, check, worker_dir):
    res = _run_worker(partitioner, worker_dir)
    assert "__error__" not in res, res.get("__error__")
    assert check in res, f"the worker did not run {check}"
    assert res[check]["ok"], res[check]["detail"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_READY or gpu_count() < 2, reason="needs 2+ CUDA GPUs and the CUDA kernels")
@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_sharded_gpus(partitioner, tmp_path):
    """Batch, heads and sequence (ring) sharding on 2 real GPUs (sharding_worker.gpu_checks)."""
    out = str(tmp_path / f"sharding_gpu_{partitioner}.json")
    res = run_worker(WORKER, out, (partitioner, out), gpu=True, timeout=900)
    assert "__error__" not in res, res.get("__error__")
    failed = {k: v["detail"] for k, v in res.items() if not v["ok"]}
    assert len(res) == 5 and not failed, failed


# --- In-process checks (one device): the single-device path is unchanged. ---

def test_single_device_lowering_is_the_plain_kernel_call():
    q = jnp.ones((2, 16, 4, 32), jnp.float32)
    k = jnp.ones((2, 24, 2, 32), jnp.float32)
    f = lambda q, k: jaxattn.flash_attention(q, k, k, implementation="cpu")  # noqa: E731
    fwd = jax.jit(f).lower(q, k).as_text()
    bwd = jax.jit(jax.grad(lambda q, k: jnp.sum(f(q, k)), argnums=(0, 1))).lower(q, k).as_text()
    for text in (fwd, bwd):
        assert "CustomSPMDPartitioning" not in text
    assert "jaxattn_cpu_fwd" in fwd and "jaxattn_cpu_bwd" in bwd


@pytest.mark.parametrize(
    "N,K,expected_heads,sizes",
    [(8, 8, "k", {}), (8, 2, "(k g)", {"g": 4}), (8, 1, "g", {})],
)
def test_shardy_rule_strings(N, K, expected_heads, sizes):
    rule, got_sizes = sharding._rule_string(
        sharding._FWD_IN, sharding._FWD_OUT, 0, N, K)
    n = expected_heads
    assert rule == f"b0 t {n} h, b0 s k h, b0 s k h -> b0 t {n} h, b0 t {n}"
    assert got_sizes == sizes
    rule, _ = sharding._rule_string(sharding._BWD_IN, sharding._BWD_OUT, 1, N, K)
    assert rule.startswith("b0 b1 t ") and rule.endswith("-> b0 b1 t " + n + " h, b0 b1 s k h, b0 b1 s k h")


@pytest.mark.parametrize("T,S", [(30, 32), (32, 30)])
def test_uneven_sequence_sharding_raises(T, S):
    """A sequence not divisible by the devices would reach the partition callback
    padded (jit's in_shardings refuse it, XLA's propagation need not): the ring
    would attend the padding, so the rule raises."""
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

    mesh = AbstractMesh((4,), ("model",))

    class Arg:
        def __init__(self, shape):
            self.shape, self.sharding = shape, NamedSharding(mesh, P(None, "model"))

    args = [Arg((2, T, 8, 16)), Arg((2, S, 8, 16)), Arg((2, S, 8, 16))]
    rule = sharding.SequenceRule(lambda axes: None)
    with pytest.raises(ValueError, match=f"T={T} or the key/value's S={S} is not divisible by 4"):
        sharding._choose(mesh, args, ("query", "key", "value"), strict=True, seq_rule=rule)
    args = [Arg((2, 32, 8, 16))] * 3  # divisible: the ring runs over 'model'
    assert sharding._choose(mesh, args, ("query", "key", "value"), strict=True, seq_rule=rule)[2] == ("model",)
