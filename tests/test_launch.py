"""The README's demo and the examples run end to end on a CPU machine (torchrun + gloo)."""
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
def test_tp_decode_example_two_ranks(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "tp_decode.py"
    text = run([str(TORCHRUN), "--standalone", "--nproc-per-node=2", str(example)], tmp_path)
    assert text.strip(), "the example printed nothing"


def test_single_device_example(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "single_gpu.py"
    assert run([sys.executable, str(example)], tmp_path).strip()


def test_hf_decode_example(tmp_path):
    """examples/hf_decode.py on its random model: decodes, and at temperature 0 gives
    transformers' own greedy tokens."""
    pytest.importorskip("transformers")
    example = Path(__file__).resolve().parents[1] / "examples" / "hf_decode.py"
    text = run([sys.executable, str(example), "--steps", "6", "--top-k", "50", "--top-p", "0.9"],
               tmp_path)
    assert "greedy tokens equal transformers' generate: True" in text
