"""benchmarks/gpu_clock.py and attention.py's --clocks column (CPU: no NVML needed)."""
from __future__ import annotations

import importlib.util
import os

import pytest

_BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(_BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_clock = _load("gpu_clock")


def test_window_stats_counts_only_readings_inside_windows():
    readings = [(0.5, 1000.0, 100.0),  # before any window
                (1.0, 1500.0, 600.0), (1.5, 1700.0, 650.0), (2.0, 1900.0, 700.0),  # in (1, 2)
                (2.5, 1200.0, 300.0),  # between windows
                (3.2, 1600.0, 690.0),  # in (3, 4)
                (9.0, 1980.0, 50.0)]   # after
    s = gpu_clock.window_stats(readings, [(3.0, 4.0), (1.0, 2.0)])
    assert s["readings"] == 4
    assert s["sm_clock_mhz"] == pytest.approx(1650.0)  # median of 1500, 1600, 1700, 1900
    assert s["power_w"] == pytest.approx(670.0)        # median of 600, 650, 690, 700


def test_window_stats_without_readings():
    assert gpu_clock.window_stats([(5.0, 1.0, 1.0)], [(0.0, 1.0)]) == {
        "sm_clock_mhz": None, "power_w": None, "readings": 0}
    assert gpu_clock.window_stats([], [])["readings"] == 0


def test_nvml_index_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gpu_clock.nvml_index(0) == 3 and gpu_clock.nvml_index(1) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234abcd")  # UUIDs: the JAX id
    assert gpu_clock.nvml_index(0) == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_clock.nvml_index(2) == 2


def test_sampler_reports_missing_nvml_as_an_error(monkeypatch):
    """Without the driver library the constructor raises (OSError), which attention.py
    catches and reports; it must not hang or start a thread."""
    import ctypes

    def no_lib(*a, **k):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    with pytest.raises(OSError):
        gpu_clock.ClockSampler(0)


def test_attention_table_has_a_clock_column_only_with_clocks():
    attention = _load("attention")
    row = {"pass": "fwdbwd", "dtype": "bfloat16", "H": 128, "T": 16384, "causal": False, "kernel": "cuda",
           "check": None, "ratio_to_cudnn": 1.03,
           "results": {"jaxattn": {"tflops": 605.0, "clock": {"sm_clock_mhz": 1665.0, "power_w": 688.0,
                                                              "readings": 9}},
                       "cudnn": {"tflops": 588.0, "clock": {"sm_clock_mhz": 1695.0, "power_w": 692.0,
                                                            "readings": 8}}}}
    table = attention.markdown_table([row], ["jaxattn", "cudnn"])
    assert "SM MHz / W jaxattn, cudnn" in table
    assert "1665 / 688, 1695 / 692" in table
    for r in row["results"].values():
        del r["clock"]
    plain = attention.markdown_table([row], ["jaxattn", "cudnn"])
    assert "SM MHz" not in plain and "| 1.03 | cuda |" in plain


def test_cool_and_settle_are_exclusive_and_nonnegative():
    attention = _load("attention")
    with pytest.raises(SystemExit):
        attention.parse_args(["--cool-ms", "100", "--settle-ms", "100"])
    with pytest.raises(SystemExit):
        attention.parse_args(["--cool-ms", "-1"])
    assert attention.parse_args(["--cool-ms", "2500"]).cool_ms == 2500.0


def test_cool_mode_idles_before_each_turn_and_says_so(tmp_path, monkeypatch):
    """A CPU run with --cool-ms sleeps once per implementation and turn, records the
    mode in the JSON config and names it in the table's header."""
    import json
    import time as _time

    attention = _load("attention")
    slept = []
    real_sleep = _time.sleep
    monkeypatch.setattr(attention.time, "sleep", lambda s: (slept.append(s), real_sleep(0))[1])
    out = tmp_path / "cool"
    rc = attention.main(["--cpu", "--pass", "fwd", "--heads", "32", "--seqlens", "40", "--causal", "0",
                         "--dtypes", "float32", "--impls", "jaxattn,xla", "--reps", "2", "--warmup", "1",
                         "--cool-ms", "7", "--out", str(out)])
    assert rc == 0
    assert [s for s in slept if s == pytest.approx(0.007)] == [pytest.approx(0.007)] * 4  # 2 turns x 2 impls
    doc = json.loads((out / "attention.json").read_text())
    assert doc["config"]["cool_ms"] == 7.0 and doc["config"]["settle_ms"] == 0.0
    assert "cool 7 ms before each turn" in (out / "attention.md").read_text()
