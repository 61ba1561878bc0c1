"""How many threads the CPU kernels start: JAXATTN_CPU_THREADS, else the CPUs of
the calling thread's affinity mask (taskset, cpusets, a batch scheduler's
binding: a job bound to 8 CPUs of a 128-CPU node starts 8, as XLA's own pool
does), never the machine's whole count. Results do not depend on it
(test_cpu_backward_forms.py::test_thread_count_does_not_change_gradients).
"""

from __future__ import annotations

import os

import pytest

from jaxattn import _jaxattn

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity API here")


def test_threads_follow_the_affinity_mask(monkeypatch):
    monkeypatch.delenv("JAXATTN_CPU_THREADS", raising=False)
    cpus = os.sched_getaffinity(0)
    assert _jaxattn.cpu_threads() == len(cpus)
    if len(cpus) < 2:
        pytest.skip("one CPU: no smaller mask to set")
    os.sched_setaffinity(0, {min(cpus)})
    try:
        assert _jaxattn.cpu_threads() == 1
    finally:
        os.sched_setaffinity(0, cpus)
    assert _jaxattn.cpu_threads() == len(cpus)


@pytest.mark.parametrize("value,want", [("3", 3), ("1", 1), ("5000", 1024)])
def test_environment_variable_wins(monkeypatch, value, want):
    monkeypatch.setenv("JAXATTN_CPU_THREADS", value)
    assert _jaxattn.cpu_threads() == want


@pytest.mark.parametrize("value", ["0", "-2", "many", ""])
def test_bad_environment_values_are_ignored(monkeypatch, value):
    monkeypatch.setenv("JAXATTN_CPU_THREADS", value)
    assert _jaxattn.cpu_threads() == len(os.sched_getaffinity(0))
