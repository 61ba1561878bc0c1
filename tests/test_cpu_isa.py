"""The CPU kernels on every instruction-set path this machine can run.

The C++ kernels are compiled for AVX-512, AVX2+FMA and SSE2 and pick the best
one at run time; JAXATTN_CPU_ISA forces one (read at each call, so it can be
set per test). The other test files run the default path only: here the
forward, the backward (both its forms) and the decode kernel run on each path
against the float64 references, on shapes that leave partial vectors (odd head dims,
partial key tiles, pages smaller than a key tile).
"""

from __future__ import annotations

import pytest

import test_backward as backward
import test_decode as decode
import test_forward as forward


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = _cpu_flags()
NEEDS = {"sse2": {"sse2"}, "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512vl", "avx512bw", "avx512dq"}}


@pytest.fixture(params=sorted(NEEDS))
def isa(request, monkeypatch):
    if not NEEDS[request.param] <= FLAGS:
        pytest.skip(f"this CPU has no {request.param}")
    monkeypatch.setenv("JAXATTN_CPU_ISA", request.param)
    return request.param


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward(isa, dtype):
    forward.check_forward("cpu", 2, 37, 83, 4, 2, 40, dtype, is_causal=True)
    forward.check_forward("cpu", 1, 5, 300, 8, 1, 128, dtype, is_causal=False)


@pytest.mark.parametrize("form", ["fused", "two_pass"])
def test_backward(isa, form, monkeypatch):
    monkeypatch.setenv("JAXATTN_CPU_BWD", form)  # (test_cpu_backward_forms.py)
    backward.check_backward("cpu", 2, 37, 83, 4, 2, 40, "float32", is_causal=True)
    backward.check_backward("cpu", 1, 65, 130, 4, 4, 128, "bfloat16", is_causal=False)


@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "page16"])
def test_decode(isa, layout):
    import jax.numpy as jnp

    case = decode.make_case(3, 4, 8, 2, 40, 320, jnp.float32, page_size=layout, seed=11,
                                 lengths=[320, 77, 5])
    decode.check("cpu", *case, jnp.float32, local_window_size=100)
    case = decode.make_case(2, 1, 32, 8, 128, 1024, jnp.bfloat16, page_size=layout, seed=12,
                                 lengths=[1024, 333])
    decode.check("cpu", *case, jnp.bfloat16)
