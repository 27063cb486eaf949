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


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to python")
def test_tp_demo_two_ranks(tmp_path):
    text = run([str(TORCHRUN), "--standalone", "--nproc-per-node=2", "-m", "tpsample.launch.demo",
                "--steps", "2", "--vocab", "5000"], tmp_path)
    assert text.count("identical on 2 ranks: True") == 2
    assert text.count("== single-device sample: True") == 2
    assert "transport=gloo" in text


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to python")
@pytest.mark.slow  # (multi-process / subprocess: CI runs it under -m slow)
def test_tp_decode_example_two_ranks(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "tp_decode.py"
    text = run([str(TORCHRUN), "--standalone", "--nproc-per-node=2", str(example)], tmp_path)
    assert text.strip(), "the example printed nothing"


def test_single_device_example(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "single_gpu.py"
    assert run([sys.executable, str(example)], tmp_path).strip()


def test_speculative_example_writes_the_plain_loops_tokens(tmp_path):
    """examples/speculative.py: n-gram drafts verified by tpsample.verify_drafts give the
    plain decoding loop's tokens, in fewer target passes."""
    example = Path(__file__).resolve().parents[1] / "examples" / "speculative.py"
    text = run([sys.executable, str(example), "--steps", "60", "--temperature", "0"], tmp_path)
    assert "same tokens as plain decoding: True" in text
    passes = int(text.split(" target passes")[0].split(" in ")[-1])
    assert passes < 60, text


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to python")
def test_fast_decode_tiny_model_tp1_and_tp2(tmp_path):
    """examples/fast_decode.py --check on its tiny configuration (CPU, gloo): greedy tokens
    of the tpsample head equal the stock head's (logits all-gathered, argmax) at every step,
    and the same seed samples the same sequence at TP1 and TP2."""
    example = Path(__file__).resolve().parents[1] / "examples" / "fast_decode.py"
    seqs = []
    for n in (1, 2):
        text = run([str(TORCHRUN), "--standalone", f"--nproc-per-node={n}", str(example),
                    "--check", "--steps", "5", "--top-p", "0.9"], tmp_path)
        assert "greedy tokens equal the stock head's: True" in text, text
        seqs.append(text.split(f"sampled tokens (tp{n}): ")[1].splitlines()[0])
    assert seqs[0] == seqs[1]


@pytest.mark.slow
def test_fast_decode_compiled_step_samples_the_same_tokens(tmp_path):
    """--compile: the decode step's forward through torch.compile (backend "eager": dynamo's
    trace of the step, KV-cache writes included, without inductor's CPU compile) gives the
    same greedy and sampled tokens as the uncompiled step."""
    example = Path(__file__).resolve().parents[1] / "examples" / "fast_decode.py"
    out = {}
    for extra in ([], ["--compile", "eager"]):
        text = run([sys.executable, str(example), "--check", "--steps", "5", "--top-p", "0.9",
                    *extra], tmp_path)
        assert "greedy tokens equal the stock head's: True" in text, text
        out[bool(extra)] = text.split("sampled tokens (tp1): ")[1].splitlines()[0]
    assert out[True] == out[False]


@pytest.mark.slow  # (multi-process / subprocess: CI runs it under -m slow)
def test_fast_decode_report_renders_gains_and_plot(tmp_path):
    """examples/fast_decode.py --report: per batch, the measured GPU-time gain of the
    tpsample head, the stock head's share and the gain predicted from the heads' own times,
    per top_p (– without); a run without GPU times shows dashes."""
    import json
    example = Path(__file__).resolve().parents[1] / "examples" / "fast_decode.py"
    rows = [dict(B=8, head="stock", wall_ms=10.0, gpu_ms=8.0, head_ms=0.8, tokens_per_s=800.0),
            dict(B=8, head="tpsample", wall_ms=9.5, gpu_ms=7.6, head_ms=0.4, tokens_per_s=842.0)]
    (tmp_path / "a.json").write_text(json.dumps(dict(config="qwen3-1.7b", world=2, rows=rows)))
    (tmp_path / "c.json").write_text(json.dumps(dict(config="qwen3-1.7b", world=2, rows=rows,
                                                     top_p=0.95)))
    (tmp_path / "d.json").write_text(json.dumps(dict(config="qwen3-1.7b", world=2, rows=rows,
                                                     compiled="inductor")))
    cpu = [dict(r, gpu_ms=None, head_ms=None) for r in rows]
    (tmp_path / "b.json").write_text(json.dumps(dict(config="tiny", world=1, rows=cpu)))
    doc = tmp_path / "perf.md"
    run([sys.executable, str(example), "--report", "a.json", "b.json", "c.json", "d.json", "--doc",
         str(doc), "--label", "decode"], tmp_path)
    text = doc.read_text()
    assert ("| qwen3-1.7b | eager ops | – | 2 | 8 | 8.000 | 7.600 | +5.0 % | 10.0 % | +5.0 % |"
            in text), text
    assert "| qwen3-1.7b | eager ops | 0.95 | 2 | 8 | 8.000 |" in text, text
    assert "| qwen3-1.7b | compiled | – | 2 | 8 | 8.000 |" in text, text
    assert "| tiny | eager ops | – | 1 | 8 | – | – | – | – | – |" in text
    assert (tmp_path / "img" / "decode.png").exists()


def test_hf_decode_example(tmp_path):
    """examples/hf_decode.py on its random model: decodes, and at temperature 0 gives
    transformers' own greedy tokens."""
    pytest.importorskip("transformers")
    example = Path(__file__).resolve().parents[1] / "examples" / "hf_decode.py"
    text = run([sys.executable, str(example), "--steps", "6", "--top-k", "50", "--top-p", "0.9"],
               tmp_path)
    assert "greedy tokens equal transformers' generate: True" in text


@pytest.mark.slow  # (multi-process / subprocess: CI runs it under -m slow)
def test_mcore_decode_report_renders_tables_and_plot(tmp_path):
    """examples/mcore_decode.py --report (no GPU needed): a TPOT run's JSON becomes a doc
    section with a row per batch and the plot; a run without GPU-time columns shows dashes."""
    import json
    example = Path(__file__).resolve().parents[1] / "examples" / "mcore_decode.py"
    path = {"stock": 1.0, "tpsample": 0.5}
    points = []
    for B in (1, 8):
        p = {"B": B, "measured_gain": 0.01, "predicted_gain": 0.02, "gpu_gain": 0.03,
             "gpu_predicted_gain": 0.04}
        for name, head in path.items():
            p[name] = {"tpot_ms": 10.0, "tpot_runs": [10.0], "head_share": 0.01,
                       "head_alone_ms": head, "head_gpu_ms": head / 2, "gpu_step_ms": 5.0}
        points.append(p)
    run_ = dict(config="tiny", tp=1, prompt_len=8, new_tokens=4, temperature=0.8, device="dev",
                shape="2 layers", points=points)
    def without_gpu(p):  # a run from before the GPU-time columns
        return {k: ({kk: vv for kk, vv in v.items() if "gpu" not in kk} if isinstance(v, dict)
                    else v) for k, v in p.items() if "gpu" not in k}
    old = dict(run_, config="older", points=[without_gpu(p) for p in points])
    files = []
    for r in (run_, old):
        files.append(tmp_path / f"{r['config']}.json")
        files[-1].write_text(json.dumps(r))
    doc = tmp_path / "docs" / "perf.md"
    doc.parent.mkdir()
    doc.write_text("# Perf\n")
    text = run([sys.executable, str(example), "--report", *map(str, files), "--doc", str(doc),
                "--label", "tpot test"], tmp_path)
    assert "| 1 | 8 | 10.00 / 10.00 | 1.0 % (2.0 %) | 5.00 / 5.00 | 3.0 % (4.0 %) |" in text
    assert "| 1.0 % / 1.0 % | 1.000 / 0.500 | 0.500 / 0.250 |" in text
    assert "| 1 | 8 | 10.00 / 10.00 | 1.0 % (2.0 %) | — | — |" in text
    assert "| 1.000 / 0.500 | — |" in text  # an older run without the heads' GPU time
    body = doc.read_text()
    assert "<!-- bench:tpot test -->" in body and "img/tpot_test.png" in body
    assert (tmp_path / "docs" / "img" / "tpot_test.png").exists()


def test_mcore_decode_gpu_time_counts_each_kernel_at_its_shortest_rank():
    """The TP GPU time per step: a collective that spun on the early rank counts at the late
    rank's duration, compute at either (equal); one rank is the plain sum; a name whose run
    count differs counts its smallest total and is reported."""
    import importlib.util
    example = Path(__file__).resolve().parents[1] / "examples" / "mcore_decode.py"
    spec = importlib.util.spec_from_file_location("mcore_decode", example)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rank0 = {"gemm": [10.0, 10.0], "allreduce": [500.0, 3.0], "sample": [4.0]}
    rank1 = {"gemm": [10.0, 10.0], "allreduce": [2.0, 900.0], "sample": [4.0]}
    assert mod.launched_together_us([rank0, rank1]) == (10 + 10 + 2 + 3 + 4, 0)
    assert mod.launched_together_us([rank0]) == (10 + 10 + 500 + 3 + 4, 0)
    rank1["copy"] = [7.0, 1.0]
    rank0["copy"] = [5.0]
    assert mod.launched_together_us([rank0, rank1]) == (10 + 10 + 2 + 3 + 4 + 5, 1)
