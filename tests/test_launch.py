"""The README's main commands run end to end on a CPU machine (torchrun + gloo)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TORCHRUN = Path(sys.executable).with_name("torchrun")


def run(cmd, tmp_path, timeout=180):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the CPU torch path: the launchers must not need the interpreter
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to python")
def test_tp_demo_two_ranks(tmp_path):
    text = run([str(TORCHRUN), "--standalone", "--nproc-per-node=2", "-m", "tpsample.launch.demo",
                "--steps", "2", "--vocab", "5000"], tmp_path)
    assert text.count("identical on 2 ranks: True") == 2
    assert text.count("== single-device sample: True") == 2
    assert "transport=gloo" in text


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to python")
@pytest.mark.parametrize("merge", ["max", "cdf"])
def test_tp_bench_cpu_sweep(tmp_path, merge):
    run([str(TORCHRUN), "--standalone", "--nproc-per-node=2", "-m", "tpsample.launch.bench",
         "--batches", "1,4", "--iters", "3", "--merge", merge, "--out", str(tmp_path)], tmp_path)
    meta = json.loads((tmp_path / "tp2.json").read_text())
    assert meta["config"]["merge"] == merge


def test_single_device_bench_cpu_sweep(tmp_path):
    run([sys.executable, "-m", "tpsample.bench", "--batches", "1,2", "--out", str(tmp_path)], tmp_path)
    assert (tmp_path / "bench.json").exists()
