"""The GPU's SM clock and board power, sampled in the background through NVML.

The H200 runs power-capped: its SM clock follows an average of the board power,
so a benchmark that times implementations in turns runs each at a clock set by
what ran before it. ClockSampler reads the SM clock and the power every few
milliseconds from a background thread (ctypes on the driver's libnvidia-ml.so.1:
no extra package; ctypes releases the GIL during each call), stamping every
reading with time.perf_counter(), so the readings that fall inside an
implementation's timed windows say at what clock and power it was timed
(window_stats).

NVML's power reading is the driver's own average (about a second on recent
GPUs), so it lags the clock; the clock reading is the current one. The NVML
device index is taken from CUDA_VISIBLE_DEVICES when that lists indices, else
the JAX device's id: on a machine with one GPU both are 0.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time

_NVML_CLOCK_SM = 1


def nvml_index(device_id: int) -> int:
    """NVML index of the CUDA device JAX calls `device_id` (see the module docstring)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [x.strip() for x in visible.split(",") if x.strip()]
    if ids and all(x.isdigit() for x in ids) and device_id < len(ids):
        return int(ids[device_id])
    return device_id


def window_stats(readings, windows) -> dict:
    """Medians of the (t, sm_mhz, watts) readings whose t lies in one of the (t0, t1)
    windows: {"sm_clock_mhz", "power_w", "readings"} (None values when none do)."""
    spans = sorted(windows)
    inside = []
    for t, mhz, watts in readings:
        if any(t0 <= t <= t1 for t0, t1 in spans):
            inside.append((mhz, watts))
    if not inside:
        return {"sm_clock_mhz": None, "power_w": None, "readings": 0}
    return {"sm_clock_mhz": round(statistics.median(m for m, _ in inside), 1),
            "power_w": round(statistics.median(w for _, w in inside), 1),
            "readings": len(inside)}


class ClockSampler:
    """Background NVML sampling of one GPU's SM clock (MHz) and power (W).

    Raises OSError / RuntimeError from the constructor when NVML cannot be used
    (no driver library, no such device): callers report that and go on without.
    """

    def __init__(self, index: int = 0, interval_s: float = 0.005):
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit_v2 failed")
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
            lib.nvmlShutdown()
            raise RuntimeError(f"NVML has no device {index}")
        self._lib, self._handle, self._interval = lib, handle, interval_s
        self.readings: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-clock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        mhz, mw = ctypes.c_uint(), ctypes.c_uint()
        lib, handle = self._lib, self._handle
        while not self._stop.is_set():
            if (lib.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM, ctypes.byref(mhz)) == 0
                    and lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(mw)) == 0):
                self.readings.append((time.perf_counter(), float(mhz.value), mw.value / 1000.0))
            self._stop.wait(self._interval)

    def stats(self, windows) -> dict:
        """window_stats over the readings so far."""
        return window_stats(list(self.readings), windows)

    def clear(self) -> None:
        """Drops the readings so far (between rows: the list stays short)."""
        self.readings = []

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        self._lib.nvmlShutdown()
