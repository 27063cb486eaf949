"""tools.gpu_state: the summary of clock/power samples, and a monitor that reads nothing
where there is no GPU (CI) still works as a context manager."""
import time

from tools.gpu_state import GpuState, parse_line, summarize


def test_summary_medians_and_reason_shares():
    samples = [(1980.0, 650.0, 0x0), (1500.0, 699.0, 0x4), (1400.0, 700.0, 0x4 | 0x20),
               (1450.0, 698.0, 0x4)]
    s = summarize(samples)
    assert s["sm_mhz"] == 1475.0 and s["power_w"] == 698.5 and s["samples"] == 4
    assert s["power cap"] == 0.75 and s["sw thermal"] == 0.25
    assert "hw slowdown" not in s  # reasons never seen are left out
    assert summarize([]) is None


def test_monitor_without_readings_gives_none():
    g = GpuState(0)
    g._read = g._smi = None  # as on a machine without NVML and nvidia-smi
    with g:
        pass
    assert g.summary() is None


def test_monitor_collects_until_the_block_ends():
    g = GpuState(0, period_s=0.001)
    g._read = lambda: (1000.0, 100.0, 0x4)
    deadline = time.monotonic() + 10
    with g:
        while len(g.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
    assert len(g.samples) >= 3
    n = len(g.samples)
    assert g.summary()["power cap"] == 1.0 and len(g.samples) == n  # stopped with the block


def test_smi_lines_parse_or_are_refused():
    assert parse_line("1410, 697.52, 0x0000000000000004\n") == (1410.0, 697.52, 4)
    for bad in ("", "[N/A], 697.5, 0x4", "1410, 697.5"):
        try:
            parse_line(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")
