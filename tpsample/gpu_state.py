"""SM clock, board power and clock-limit reasons of one GPU, sampled while a benchmark runs.

On the lent H100/H200, every variant of the LM-head shapes at B >= 64 (cuBLAS's matmul
included) runs at the 700 W board limit, where the driver lowers the SM clock (1350–1500 MHz
instead of 1980 on the H100; perf notes v1.9). Times there measure energy per call as much as
bandwidth, and two variants timed one after the other can run at different clocks. The
bench puts the clock and power next to each timing, so a table says which regime it is in.

Sampling uses NVML through pynvml when it is importable, else `nvidia-smi` (one query per
sample, every ~30 ms). No GPU, no tool: the monitor records nothing and summary() is None.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading

# NVML clocks-event (throttle) reason bits that lower the clock below what was asked for
REASONS = {0x4: "power cap", 0x8: "hw slowdown", 0x20: "sw thermal", 0x40: "hw thermal",
           0x80: "power brake"}


def summarize(samples: list[tuple[float, float, int]]) -> dict | None:
    """samples: (SM MHz, board W, reason bits) → median clock and power, the fraction of
    samples under each clock-lowering reason."""
    if not samples:
        return None
    out = {"sm_mhz": statistics.median(s[0] for s in samples),
           "power_w": statistics.median(s[1] for s in samples), "samples": len(samples)}
    for bit, name in REASONS.items():
        share = sum(1 for s in samples if s[2] & bit) / len(samples)
        if share:
            out[name] = round(share, 2)
    return out


class GpuState:
    """with GpuState(index) as g: ...  → g.summary(): {"sm_mhz", "power_w", "samples",
    "power cap": share of samples, ...} over the block, or None where nothing could be read."""

    def __init__(self, index: int, period_s: float = 0.03):
        self.index, self.period = index, period_s
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = None
        self._read = self._nvml_reader() or self._smi_reader()

    def _nvml_reader(self):
        try:
            import pynvml
            import torch
            pynvml.nvmlInit()
            uuid = "GPU-" + str(torch.cuda.get_device_properties(self.index).uuid)
            h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:  # noqa: BLE001 - no pynvml, no NVML, no CUDA: try nvidia-smi
            return None
        reasons = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                   or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        return lambda: (float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                        pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0, int(reasons(h)))

    def _smi_reader(self):
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return None
        try:
            import torch
            targets = ["GPU-" + str(torch.cuda.get_device_properties(self.index).uuid)]
        except Exception:  # noqa: BLE001
            targets = []
        if "CUDA_VISIBLE_DEVICES" not in os.environ:  # otherwise NVML's index is another GPU's
            targets.append(str(self.index))
        for target in targets:
            cmd = [smi, "-i", target, "--format=csv,noheader,nounits",
                   "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active"]

            def read(cmd=cmd):
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
                clk, watts, bits = (x.strip() for x in out.strip().split(","))
                return float(clk), float(watts), int(bits, 16)
            try:
                read()
                return read
            except Exception:  # noqa: BLE001 - try the next way of naming the GPU
                continue
        return None

    def _loop(self):
        while not self._stop.is_set():
            try:
                self.samples.append(self._read())
            except Exception:  # noqa: BLE001 - a failed read loses one sample, not the run
                pass
            self._stop.wait(self.period)

    def __enter__(self):
        if self._read is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return False

    def summary(self) -> dict | None:
        return summarize(self.samples)
