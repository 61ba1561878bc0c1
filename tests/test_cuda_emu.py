"""The CUDA decode register loop's source, run on the CPU (tests/cuda_emu).

tests/cuda_emu/reg_loop_check.cc compiles cuda/decode/decode_reg_loop.cuh (and the shared
swapped-orientation softmax) as host C++ against warp_emu.h, which evaluates the warp
collectives (mma.sync m16n8k16, movmatrix, column reductions) from the PTX ISA's fragment
layouts with one std::thread per CUDA thread, and checks the loop against a float64
reference over paged / contiguous caches, tails, windows, soft caps, 1-8 query rows and
several chunks, with NaN in every cache row no query sees and a bounds check on every load.
It checks the loop's logic on machines without a GPU; the GPU tests (test_decode.py) check
the compiled kernel.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_decode_register_loop_on_the_cpu(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "reg_loop_check"
    subprocess.run([cxx, "-std=c++17", "-O2", "-pthread", "-Wno-unknown-pragmas",
                    "-I", os.path.join(ROOT, "tests", "cuda_emu"), "-I", os.path.join(ROOT, "cuda"),
                    os.path.join(ROOT, "tests", "cuda_emu", "reg_loop_check.cc"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    fails = [line for line in run.stdout.splitlines() if line.startswith("FAIL")]
    assert run.returncode == 0 and not fails, "\n".join(fails[:10]) or run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1].endswith(" ok, 0 FAIL")
