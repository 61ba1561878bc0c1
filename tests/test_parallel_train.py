"""A jitted training step on data, tensor and sequence parallel meshes follows the
single-device loss (tests/parallel_train_worker.py; 8 simulated CPU devices, and
the real GPUs when there are 2 or more). The sequence-parallel meshes run
flash_attention as ring attention under plain jax.jit (docs/sharding.md)."""

from __future__ import annotations

import os

import pytest

from conftest import CUDA_READY, gpu_count, run_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel_train_worker.py")
MESHES = ["single", "data", "tensor", "sequence", "data_tensor_sequence"]

_results: dict = {}


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    if not _results:
        _results.update(run_worker(WORKER, str(tmp_path_factory.mktemp("train") / "train.json")))
    return _results


def test_worker_ran_every_mesh(cpu_results):
    assert "__error__" not in cpu_results, cpu_results.get("__error__")
    assert sorted(cpu_results) == sorted(MESHES)


@pytest.mark.parametrize("mesh", MESHES)
def test_parallel_train_8_devices(mesh, cpu_results):
    assert "__error__" not in cpu_results, cpu_results.get("__error__")
    assert cpu_results[mesh]["ok"], cpu_results[mesh]["detail"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_READY or gpu_count() < 2, reason="needs 2+ CUDA GPUs and the CUDA kernels")
def test_parallel_train_gpus(tmp_path):
    res = run_worker(WORKER, str(tmp_path / "train_gpu.json"), gpu=True)
    assert "__error__" not in res, res.get("__error__")
    failed = {k: v["detail"] for k, v in res.items() if not v["ok"]}
    assert sorted(res) == ["data", "sequence", "single", "tensor"] and not failed, failed
