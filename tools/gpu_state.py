"""SM clock, board power and clock-limit reasons of one GPU, sampled while a benchmark runs.

On the lent H100/H200, every variant of the LM-head shapes at B >= 64 (cuBLAS's matmul
included) runs at the 700 W board limit, where the driver lowers the SM clock (1350–1500 MHz
instead of 1980 on the H100; docs/design.md). Times there measure energy per call as much as
bandwidth, and two variants timed one after the other can run at different clocks. The
bench puts the clock and power next to each timing, so a table says which regime it is in.

Sampling uses NVML through pynvml when it is importable, else one `nvidia-smi -lms`
process that prints a sample every ~20 ms while the block runs. No GPU, no tool: the monitor records nothing and summary() is None.
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


_SOURCES: dict = {}  # (GPU index, period) -> (NVML reader or None, nvidia-smi command or None)


class GpuState:
    """with GpuState(index) as g: ...  → g.summary(): {"sm_mhz", "power_w", "samples",
    "power cap": share of samples, ...} over the block, or None where nothing could be read."""

    def __init__(self, index: int, period_s: float = 0.02):
        self.index, self.period = index, period_s
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = self._proc = None
        key = (index, period_s)  # resolved once (the nvidia-smi probe takes ~0.1 s)
        if key not in _SOURCES:
            read = self._nvml_reader()
            _SOURCES[key] = (read, None if read else self._smi_command())
        self._read, self._smi = _SOURCES[key]  # NVML: one sample per call; smi: a stream

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

    def _smi_command(self):
        """The nvidia-smi command that prints one sample line every period (None if none
        works here): the GPU by UUID (or NVML index), instantaneous power where the driver
        has it (power.draw is a 1 s average on recent drivers)."""
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
            for power in ("power.draw.instant", "power.draw"):
                cmd = [smi, "-i", target, "--format=csv,noheader,nounits",
                       f"--query-gpu=clocks.sm,{power},clocks_event_reasons.active"]
                try:
                    out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
                    parse_line(out.stdout)
                except Exception:  # noqa: BLE001 - try the next field / way of naming the GPU
                    continue
                return cmd + ["-lms", str(max(1, int(self.period * 1000)))]
        return None

    def _poll(self):
        while not self._stop.is_set():
            try:
                self.samples.append(self._read())
            except Exception:  # noqa: BLE001 - a failed read loses one sample, not the run
                pass
            self._stop.wait(self.period)

    def _stream(self):
        for line in self._proc.stdout:
            try:
                self.samples.append(parse_line(line))
            except ValueError:
                pass

    def __enter__(self):
        if self._read is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
        elif self._smi is not None:
            self._proc = subprocess.Popen(self._smi, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._stream, daemon=True)
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        if self._thread is not None:
            self._thread.join()
        return False

    def summary(self) -> dict | None:
        return summarize(self.samples)


def parse_line(line: str) -> tuple[float, float, int]:
    """One nvidia-smi CSV line "MHz, W, 0xBITS" → (MHz, W, bits); ValueError otherwise."""
    fields = [x.strip() for x in line.strip().split(",")]
    if len(fields) != 3:
        raise ValueError(f"not a sample line: {line!r}")
    return float(fields[0]), float(fields[1]), int(fields[2], 16)
