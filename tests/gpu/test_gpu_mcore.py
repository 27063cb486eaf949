"""examples/mcore_decode.py on a real megatron-core GPTModel (local layer spec, random weights,
bf16, megatron-core's static KV cache): greedy tokens equal the stock path's argmax step by
step, every TP rank gets the same tokens (device: one GPU for TP1, nvidia-h200-x2 for TP2)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mcore_decode.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def torchrun(nproc, *args, tmp_path):
    cmd = [str(TORCHRUN) if TORCHRUN.exists() else "torchrun", "--standalone",
           f"--nproc-per-node={nproc}", str(EXAMPLE), *args]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout


def check(nproc, tmp_path):
    text = torchrun(nproc, "--check", "--batch", "1,8,33", "--new-tokens", "12", tmp_path=tmp_path)
    lines = [line for line in text.splitlines() if line.startswith("tiny")]
    assert len(lines) == 3, text
    for line in lines:
        assert "'wrong': 0" in line and "'ranks_agree': True" in line, line
    text = torchrun(nproc, "--batch", "3", tmp_path=tmp_path)  # temperature sampling runs
    assert "ms per decode step" in text, text


@pytest.mark.gpu
def test_decode_loop_tp1(tmp_path):
    check(1, tmp_path)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_decode_loop_tp2(tmp_path):
    check(2, tmp_path)
