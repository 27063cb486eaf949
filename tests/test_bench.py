"""The benchmark's one entry point: both modes run on a CPU machine, and --doc rewrites only
its own section."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpsample.launch import bench

TORCHRUN = Path(sys.executable).with_name("torchrun")


def run(cmd, tmp_path, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the CPU torch path
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@pytest.mark.slow
def test_single_device_mode_writes_json_doc_and_summary(tmp_path):
    doc = tmp_path / "perf.md"
    text = run([sys.executable, "-m", "tpsample.launch.bench", "--shapes", "64x1000", "--batches",
                "1,4", "--out", str(tmp_path), "--doc", str(doc), "--label", "CPU"], tmp_path)
    meta = json.loads((tmp_path / "single.json").read_text())
    assert {"device", "torch", "triton", "date", "command", "bandwidth_bytes_per_s", "shapes"} <= set(meta)
    assert [r["B"] for r in meta["shapes"][0]["rows"]] == [1, 4]
    assert "tpsample" in meta["shapes"][0]["rows"][0]["ms"]
    assert "bench: 2 cells" in text.splitlines()[-1]
    section = doc.read_text()
    assert section.startswith("<!-- bench:CPU -->") and "| 4 |" in section
    assert (tmp_path / "img" / "cpu_64x1000.png").exists()


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to python")
@pytest.mark.slow
def test_tp_mode_under_torchrun_and_report(tmp_path):
    for n in (1, 2):
        run([str(TORCHRUN), "--standalone", f"--nproc-per-node={n}", "-m", "tpsample.launch.bench",
             "--shapes", "64x1000", "--batches", "1,4", "--iters", "3", "--out", str(tmp_path)]
            + (["--filters"] if n == 2 else ["--merge", "cdf"]), tmp_path)
    # TP2: merge max, whose plain sampler has no log-masses; the filtered calls get their own
    meta = json.loads((tmp_path / "tp2.json").read_text())
    assert meta["world"] == 2 and meta["config"]["merge"] == "max" and meta["shapes"][0]["D"] == 64
    assert json.loads((tmp_path / "tp1.json").read_text())["config"]["merge"] == "cdf"
    assert set(meta["shapes"][0]["results"]["4"]) == {"mm_local", "allgather_multinomial",
                                                      "allgather_gumbel", "tpsample_gloo",
                                                      "tpsample_gloo_kpm"}
    kpm = meta["shapes"][0]["results"]["4"]["tpsample_gloo_kpm"]
    assert 0 <= kpm["fallback_share"] <= 1  # the filtered calls' rows: counted
    text = run([sys.executable, "-m", "tpsample.launch.bench", "--report", str(tmp_path / "tp1.json"),
                str(tmp_path / "tp2.json"), "--doc", str(tmp_path / "p.md"), "--label", "TP"], tmp_path)
    assert "Scaling, D=64, V=1000" in text and "| TP1 | TP2 |" in text
    assert "of their rows took the exact fallback" in text or "none of their rows" in text


def run_mode(tmp_path, flag: str, label: str):
    """bench `flag` at D=64, V=1000, B=2 with --doc, then --report of its json: (its one
    row, the doc's text, the report's text); the plot must exist."""
    doc = tmp_path / "perf.md"
    run([sys.executable, "-m", "tpsample.launch.bench", flag, "--shapes", "64x1000",
         "--batches", "2", "--out", str(tmp_path), "--doc", str(doc), "--label", label],
        tmp_path)
    name = flag.lstrip("-")
    meta = json.loads((tmp_path / f"{name}.json").read_text())
    slug = label.lower().replace(" ", "_")
    assert (tmp_path / "img" / f"{slug}_64x1000.png").exists()
    report = run([sys.executable, "-m", "tpsample.launch.bench", "--report",
                  str(tmp_path / f"{name}.json")], tmp_path)
    return meta["shapes"][0]["rows"][0], doc.read_text(), report


@pytest.mark.slow
def test_filters_mode_writes_json_doc_and_report(tmp_path):
    row, doc, report = run_mode(tmp_path, "--filters", "CPU filters")
    assert row["B"] == 2 and {"mm", "tpsample", "tps_kpm", "sort_kpm", "topk_kpm"} <= set(row["ms"])
    assert set(row["fallback_share"]) >= {"tps_k", "tps_kpm"}
    assert "| 2 |" in doc and "kpm / floor" in report


def test_filters_runs_of_one_device_render_as_one_section():
    """One run per shape (where one run would not fit a time limit): one section, every
    shape's table, each run's command and copy bandwidth."""
    def run_of(D, bw, cmd):
        ms = dict(mm=1.0, tpsample=0.9, tps_kpm=1.0, sort_kpm=2.0, topk_kpm=1.5)
        return dict(device="GPU", torch="t", triton="3.6", date=cmd, command=cmd,
                    bandwidth_bytes_per_s=bw, shapes=[dict(D=D, V=1000, floor_ms=0.5, rows=[
                        dict(B=1, ms=ms, fallback_share={})])])
    text = bench.filters_markdown(bench.merge_runs([run_of(64, 3e12, "a"), run_of(128, 3.1e12, "b")]),
                                  "/dev/null", "x")
    assert "`a` and `b`" in text and "3000/3100 GB/s" in text
    assert "**D=64, V=1000**" in text and "**D=128, V=1000**" in text


def test_a_cut_off_filters_run_keeps_the_batches_it_finished(tmp_path):
    """A run stopped by a time limit mid-shape (the GPU machines' calls are capped) leaves
    the rows it timed in its json, renderable by --report."""
    args = bench.parse_args(["--filters", "--cpu", "--shapes", "64x1000", "--batches", "1,2",
                             "--out", str(tmp_path)])
    seen = []

    def variants(h, w):
        seen.append(h.shape[0])
        if len(seen) == 2:
            raise KeyboardInterrupt  # the run stops during its second batch
        return {n: (lambda: h @ w.T) for n in ("mm", "tpsample", "tps_kpm", "sort_kpm", "topk_kpm")}

    with pytest.raises(KeyboardInterrupt):
        bench.run_filters(args, variants)
    meta = json.loads((tmp_path / "filters.json").read_text())
    assert [r["B"] for r in meta["shapes"][0]["rows"]] == [1]
    assert "| 1 |" in bench.filters_markdown(meta, os.devnull, "cut")


def test_a_cut_off_tp_run_keeps_the_batches_it_finished(tmp_path, monkeypatch):
    """The TP mode too (one gloo rank in this process): stopped during its second batch, its
    json holds the first, renderable by --report."""
    import socket

    import torch.distributed as dist
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                     WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)
    args = bench.parse_args(["--cpu", "--shapes", "64x1000", "--batches", "1,2", "--iters", "2",
                             "--out", str(tmp_path)])
    real = bench.bench_batch

    def bench_batch(D, V, B, *rest, **kw):
        if B == 2:
            raise KeyboardInterrupt  # the run stops during its second batch
        return real(D, V, B, *rest, **kw)
    monkeypatch.setattr(bench, "bench_batch", bench_batch)
    try:
        with pytest.raises(KeyboardInterrupt):
            bench.run_tp(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    meta = json.loads((tmp_path / "tp1.json").read_text())
    assert list(meta["shapes"][0]["results"]) == ["1"]
    assert "| 1 |" in bench.tp_markdown([meta], os.devnull, "cut")


@pytest.mark.slow
def test_constraints_mode_writes_json_doc_and_report(tmp_path):
    row, doc, report = run_mode(tmp_path, "--constraints", "CPU c")
    assert row["B"] == 2 and {"tpsample", "tps_mask", "tps_adj64", "tps_adj64_nc",
                              "tps_mask_adj", "mm_mask_mult"} <= set(row["ms"])
    assert "mask / plain" in doc and "adj64 / plain" in report


def test_doc_sections_are_replaced_in_place_or_appended(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("# Title\n\n<!-- bench:A -->\nold A\n<!-- /bench:A -->\n\ntext\n\n"
                   "<!-- bench:B -->\nold B\n<!-- /bench:B -->\n")
    bench.write_doc(str(doc), "A", "new A")
    text = doc.read_text()
    assert "new A" in text and "old A" not in text and "old B" in text and "text" in text
    assert text.index("new A") < text.index("text")
    bench.write_doc(str(doc), "C", "new C")
    assert doc.read_text().rstrip().endswith("new C\n<!-- /bench:C -->")
    bench.write_doc(str(tmp_path / "sub" / "new.md"), "X", "x")
    assert (tmp_path / "sub" / "new.md").read_text().startswith("<!-- bench:X -->")


def test_mode_defaults_follow_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert bench.parse_args(["--cpu"]).mode == "single"
    monkeypatch.setenv("WORLD_SIZE", "2")
    a = bench.parse_args(["--cpu"])
    assert a.mode == "tp" and a.transports == ["gloo"] and a.batches == [1, 4, 16]
    assert bench.parse_args(["--cpu", "--mode", "single"]).mode == "single"


@pytest.mark.slow  # (multi-process / subprocess: CI runs it under -m slow)
def test_verify_bench_writes_json_doc_and_summary(tmp_path):
    """python -m tpsample.launch.verify_bench on the CPU: every variant timed per (B, S), the
    summary line, the doc section and its plot."""
    doc = tmp_path / "perf.md"
    text = run([sys.executable, "-m", "tpsample.launch.verify_bench", "--batches", "2",
                "--drafts", "1,3", "--out", str(tmp_path), "--doc", str(doc), "--label", "CPU"],
               tmp_path)
    meta = json.loads((tmp_path / "verify.json").read_text())
    rows = meta["shapes"][0]["rows"]
    assert [(r["B"], r["S"], r["rows"]) for r in rows] == [(2, 1, 4), (2, 3, 8)]
    assert set(rows[0]["ms"]) == {"plain", "onehot", "probs", "mm", "torch_onehot", "torch_probs"}
    assert "summary: D=64 V=1000: onehot / plain worst" in text
    assert "| 2 | 3 | 8 |" in doc.read_text() and (tmp_path / "img" / "cpu_64x1000.png").exists()


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to python")
@pytest.mark.slow
def test_verify_bench_tp_mode_under_torchrun_and_report(tmp_path):
    """torchrun -m tpsample.launch.verify_bench (gloo, two ranks): VocabParallelSampler's
    verify_drafts and the local matmul per (B, S), the bound 1.3 x mm_local + 30 us, and the
    report of its JSON."""
    run([str(TORCHRUN), "--standalone", "--nproc-per-node=2", "-m", "tpsample.launch.verify_bench",
         "--batches", "2", "--drafts", "1", "--iters", "2", "--out", str(tmp_path)], tmp_path)
    meta = json.loads((tmp_path / "verify_tp2.json").read_text())
    (row,) = meta["shapes"][0]["rows"]
    assert meta["world"] == 2 and (row["B"], row["S"], row["rows"]) == (2, 1, 4)
    assert set(row["ms"]) == {"mm_local", "onehot", "probs"}
    assert abs(row["bound"] - (1.3 * row["ms"]["mm_local"] + 0.03)) < 1e-9
    doc = tmp_path / "perf.md"
    text = run([sys.executable, "-m", "tpsample.launch.verify_bench", "--report",
                str(tmp_path / "verify_tp2.json"), "--doc", str(doc), "--label", "TP"], tmp_path)
    assert "summary: TP2 D=64 V=1000: worst / (1.3 x mm_local + 30 us)" in text
    assert "| 2 | 1 | 4 |" in doc.read_text()


def test_verify_bench_torch_rejection_baseline_is_exact():
    """The benchmark's torch rejection sampler (its baseline) emits p_0 as the first token
    (chi-squared at ALPHA), one-hot drafts and draft distributions."""
    import torch
    from stats import ALPHA, chi2_pvalue
    from tpsample.launch.verify_bench import torch_verify
    g = torch.Generator().manual_seed(2)
    N, V, D = 20000, 40, 8
    h = torch.randn(1, 2, D, generator=g).expand(N, -1, -1).contiguous()
    w = torch.randn(V, D, generator=g)
    p0 = torch.softmax((h[0, 0] @ w.T).double(), -1)
    tok = torch_verify(h, w, torch.full((N, 1), int(p0.argmax())), None, g)
    assert chi2_pvalue(tok[:, 0], p0) > ALPHA
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    draft = torch.multinomial(q, N, replacement=True, generator=g)[:, None]
    tok = torch_verify(h, w, draft, q.float().expand(N, 1, V), g)
    assert chi2_pvalue(tok[:, 0], p0) > ALPHA


def test_sweep_warm_task_reports_a_failure():
    """A warm-up task that fails says so in its log line instead of raising (which would end
    the run before its first timed row)."""
    from tpsample.launch import sweep
    assert sweep._warm_one((64, 1000, 2, "p0.9", "fp32", False)).startswith("D=64 V=1000 B=2 p0.9 (")
    assert "FAILED" in sweep._warm_one((64, 1000, 2, "no_such_filter", "fp32", False))


def test_sweep_times_every_call_with_a_seed_per_row(tmp_path, monkeypatch):
    """One seed for a call's rows would give them the same noise (it is keyed by seed,
    offset and token id): a head's rows, ~0.001 apart, would then be certified or fall back
    together. Every timed call passes distinct seeds, one per row."""
    import torch
    from tpsample.launch import sweep
    seeds = []

    def fake_sample(h, w, seed=None, **kw):
        seeds.append((h.shape[0], seed))
        return torch.zeros(h.shape[0], dtype=torch.int64)
    monkeypatch.setattr(sweep.tpsample, "sample", fake_sample)
    monkeypatch.setattr(sweep, "time_fn", lambda fn, cuda: (fn(), 1.0)[1])
    monkeypatch.setattr(sweep, "sort_top_p", lambda h, w, T: None)
    monkeypatch.setattr(sweep, "measure_bandwidth", lambda device: 1.0)
    sweep.run(sweep.parse_args(["--shapes", "16x300", "--batches", "1,4", "--heads", "zipf1.6",
                                "--temps", "1.0", "--warm", "0", "--out", str(tmp_path)]))
    assert {B for B, _ in seeds} == {1, 4} and len(seeds) == 2 * (1 + len(sweep.FILTERS))
    for B, seed in seeds:
        assert isinstance(seed, torch.Tensor) and seed.shape == (B,)
        assert len(set(seed.tolist())) == B


@pytest.mark.slow
def test_sweep_warms_in_processes_then_writes_json_doc_and_summary(tmp_path):
    """python -m tpsample.launch.sweep on the CPU with --warm 2: the warm-up runs every batch
    in worker processes first, then the rows are timed; json, summary and doc section."""
    doc = tmp_path / "perf.md"
    text = run([sys.executable, "-m", "tpsample.launch.sweep", "--shapes", "64x4096",
                "--batches", "1,4", "--heads", "zipf1.6,mixed", "--temps", "1.0", "--warm", "2",
                "--out", str(tmp_path), "--doc", str(doc), "--label", "CPU"], tmp_path)
    meta = json.loads((tmp_path / "sweep.json").read_text())
    rows = meta["shapes"][0]["rows"]
    assert [(r["head"], r["B"]) for r in rows] == [("zipf1.6", 1), ("zipf1.6", 4), ("mixed", 1),
                                                   ("mixed", 4)]
    assert {"plain", "mm", "sort_p0.9", "p0.9", "k50p0.95m0.05"} <= set(rows[0]["ms"])
    assert "summary: D=64 V=4096: worst B<=64:" in text
    assert "| zipf1.6 | 1.0 | 4 |" in doc.read_text()


def test_sweep_flashinfer_columns_summary_table_and_plot(tmp_path):
    """A run with FlashInfer's columns (as a GPU run with it installed writes them): the
    summary names the cell where tpsample's lead over FlashInfer is smallest, a second table
    gives FlashInfer / tpsample per filter set, the plot has FlashInfer's panel; on CPU
    tensors there is no FlashInfer variant."""
    import torch
    from tpsample.launch import sweep
    assert sweep.flashinfer_variants(torch.zeros(2, 8), torch.zeros(16, 8), 1.0) == {}
    rows = []
    for i, (head, B) in enumerate([("zipf1.6", 16), ("gauss1", 16), ("gauss1", 64)]):
        ms = {"plain": 1.0, "mm": 1.0, "sort_p0.9": 3.0}
        ms.update({f: 1.1 + 0.01 * i for f in sweep.FILTERS})
        ms.update({f"fi_{f}": 2.0 for f in sweep.FI_FILTERS})
        ms["fi_m0.1"] = 0.9 if (head, B) == ("gauss1", 64) else 2.0
        rows.append(dict(head=head, T=1.0, B=B, ms=ms, entropy=2.7 + 4 * i, n90=27 * 10 ** i,
                         kept={f: 10 for f in sweep.FILTERS}))
    meta = dict(command="python -m tpsample.launch.sweep", device="GPU", torch="t",
                triton="t", date="d", shapes=[dict(D=64, V=4096, rows=rows)])
    line = sweep.summary(meta)[0]
    assert "FlashInfer / tpsample, same filters: min 0.80 (m0.1, gauss1, T=1.0, B=64)" in line
    text = sweep.markdown(meta, str(tmp_path / "perf.md"), "GPU sweep")
    assert "| head | T | B | " + " | ".join(sweep.FI_FILTERS) + " |" in text
    assert "| gauss1 | 1.0 | 64 | " + " | ".join(
        "0.80" if f == "m0.1" else "1.79" for f in sweep.FI_FILTERS) + " |" in text
    assert (tmp_path / "img" / "gpu_sweep_64x4096.png").exists()
    for r in rows:  # a report of a run from before a filter set existed: "–" there
        del r["ms"]["k50/2p0.9"]
    assert "| – |" in sweep.markdown(meta, str(tmp_path / "perf.md"), "GPU sweep")
    assert "k50/2p0.9" not in sweep.summary(meta)[0]


def test_sweep_every_other_row_set_is_a_per_row_tensor():
    """k50/2p0.9: top-p 0.9 on every row and top-k 50 on the even rows only, as one per-row
    top_k tensor (a serving batch's mix), and its kept size the larger of its two kinds of
    rows (the rows without the top-k)."""
    import torch
    from tpsample.launch import sweep
    kw = sweep.call_kwargs(sweep.FILTERS["k50/2p0.9"], 5, torch.device("cpu"))
    assert kw["top_k"].tolist() == [50, 0, 50, 0, 50] and kw["top_p"] == 0.9
    assert "every_other" not in kw
    l = -1.0 * torch.log(torch.arange(1, 4097, dtype=torch.float64))  # (a flat Zipf head)
    kept = sweep.kept_sizes(l)
    assert kept["k50/2p0.9"] == kept["p0.9"] > 50 == kept["k50"]
