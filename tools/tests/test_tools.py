"""Argument checks of the tuner, the A/B driver and the probe (no GPU needed)."""
import json
import sys
import types

import pytest

from tools import ab, filtered_ab, probe, tune


def test_tune_passes_alternate_order_and_are_checked():
    assert tune.pass_orders(3, 3) == [[0, 1, 2], [2, 1, 0], [0, 1, 2]]
    assert tune.pass_orders(0, 2) == [[], []]
    with pytest.raises(ValueError, match="passes"):
        tune.pass_orders(3, 0)


def test_tune_needs_an_out_path_and_checks_its_arguments(tmp_path):
    with pytest.raises(SystemExit) as e:
        tune.main([])  # --out is required: tables are written where the user says
    assert e.value.code == 2
    with pytest.raises(SystemExit, match="passes"):
        tune.main(["--passes", "0", "--out", str(tmp_path / "t.json")])


def test_tune_override_arguments_are_checked(tmp_path):
    path = tmp_path / "h.json"
    with pytest.raises(SystemExit, match="existing table"):
        tune.check_override(2048, [(2048, 1000)], [64], path)
    path.write_text('{"buckets": {"16": {}, "64": {}}}')
    tune.check_override(2048, [(2048, 1000), (1024, 500)], [16, 64], path)
    with pytest.raises(SystemExit, match="<= 2048"):
        tune.check_override(2048, [(4096, 1000)], [64], path)
    with pytest.raises(SystemExit, match="buckets"):
        tune.check_override(2048, [(2048, 1000)], [32, 64], path)
    with pytest.raises(SystemExit, match="max-d"):
        tune.check_override(0, [(2048, 1000)], [64], path)


def test_tune_candidates_are_strategies_the_plan_takes():
    strategies = {c["strategy"] for B in (1, 64, 256) for c in tune.candidates(B)}
    assert strategies == {"fused", "logits", "ws", "pp"}


def test_ab_arm_specs_are_checked():
    """arms are NAME:VAR=VALUE[,...]; at least two are needed."""
    for argv in (["--arm", "a:X=1"], ["--arm", "a:X=1", "--arm", "bX=1"],
                 ["--arm", "a:X=1", "--arm", "b:X"]):
        with pytest.raises(SystemExit) as e:
            ab.main(argv)
        assert e.value.code == 2  # argparse's usage error, before any arm runs


def test_ab_bucket_override_changes_the_plan_and_checks_its_text():
    """AB_BUCKETS 192:256: the tables' bucket 192 plans as their bucket 256 does (the
    override mutates the cached tables, so the test drops them after)."""
    import tpsample
    from tpsample import plan
    before = tpsample.explain(160, 4096, 151936, device="h100").config
    try:
        ab.override_buckets("192:256")
        after = tpsample.explain(160, 4096, 151936, device="h100").config
        assert after == tpsample.explain(256, 4096, 151936, device="h100").config
        assert after != before
        with pytest.raises(SystemExit, match="AB_BUCKETS"):
            ab.override_buckets("192")
    finally:
        plan.load_table.cache_clear()
    assert tpsample.explain(160, 4096, 151936, device="h100").config == before


def test_probe_help_lists_its_modes(capsys):
    with pytest.raises(SystemExit) as e:
        probe.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--pp-trace" in out and "--candidates" in out and "--filters" in out


def test_ab_worker_checks_its_call(monkeypatch):
    """AB_CALL picks what a worker times (the stages, or the public call): anything else stops
    the worker with a message naming the variable, before it touches a GPU."""
    monkeypatch.setenv("AB_CALL", "everything")
    with pytest.raises(SystemExit, match="AB_CALL"):
        ab.worker([(64, 128)], [1], 10)


def test_exchange_cost_report_states_the_ab_ratio_and_the_bound(tmp_path):
    import json
    from tools import exchange_cost
    rows = [{"D": 4096, "V": 151936, "B": 1, "world": 2, "mm": 0.25, "signal_wait": 0.30,
             "torch_barrier": 0.32},
            {"D": 4096, "V": 151936, "B": 256, "world": 2, "mm": 0.25, "signal_wait": 0.40,
             "torch_barrier": 0.38}]
    path = tmp_path / "exchange_cost_tp2.json"
    path.write_text(json.dumps({"device": "GPU", "rows": rows}))
    doc = tmp_path / "perf.md"
    exchange_cost.main(["--report", str(path), "--doc", str(doc), "--label", "x"])
    text = doc.read_text()
    assert "| 4096 | 1 | 0.250 | 0.300 | 0.320 | 0.938 | 0.320 | yes |" in text
    assert "| 4096 | 256 | 0.250 | 0.400 | 0.380 | 1.053 | 0.320 | no |" in text
    assert text.startswith("<!-- bench:x -->") and "GPU, TP2" in text


def test_timeline_summary_matches_ops_by_position_and_renders_gaps(tmp_path, capsys):
    """tools.timeline: per-op medians over the calls with the usual op count (a call that
    lost an op is left out), the GPU end, and the gaps the report prints."""
    import json
    from tools import timeline

    def call(shift, ops=("stage1", "wait", "reduce")):
        spans = {"stage1": (10.0 + shift, 200.0), "wait": (212.0 + shift, 5.0),
                 "reduce": (220.0 + shift, 4.0)}
        return {"host_us": 50.0 + shift, "gpu": [(n, *spans[n]) for n in ops],
                "api": [("cuLaunchKernelEx", 5.0 + shift, 4.0)]}
    calls = [call(0.0), call(2.0), call(4.0), call(1.0, ops=("stage1",))]
    s = timeline.summarise(calls)
    assert s["calls"] == 3 and s["host_us"] == 52.0
    assert [op["name"] for op in s["ops"]] == ["stage1", "wait", "reduce"]
    assert s["ops"][1]["start_us"] == 214.0 and s["end_us"] == 226.0
    meta = {"device": "GPU", "world": 2, "calls": 4,
            "rows": [{"D": 8, "B": 1, "ranks": [{"tp_symm_mem": s}, {"tp_symm_mem": s}]}]}
    path = tmp_path / "timeline_tp2.json"
    path.write_text(json.dumps(meta))
    timeline.main(["--report", str(path)])
    text = capsys.readouterr().out
    assert "D=8 B=1 rank 1 tp_symm_mem: host 52.0, GPU end 226.0 (3 calls)" in text
    assert "(gap     2.0)  wait" in text and "cuLaunchKernelEx @7.0+4.0" in text


def test_host_cost_report_pairs_the_memo_arms_with_the_tp_bound(tmp_path):
    """One --ab-memo run: <kind>_nomemo and <kind> become the "memo off" / "memo on"
    columns of one row; TP rows get 1.2 x mm_local + 20 us, TP1 rows none; the memo's share
    of the timed calls shows beside "memo on"."""
    import json
    from tools import host_cost
    rows = [dict(call="floor", B=64, D=4096, host_us=0.0, eager_ms=0.0, tokens=0, empty=3.0,
                 add_=8.0, copy_h=8.0, graph_replay=4.0, clone=10.0),
            dict(call="tp1_plain_nomemo", B=1, D=4096, host_us=50.0, eager_ms=0.30,
                 graph_ms=0.28, tokens=7, memo_share=0.0),
            dict(call="tp1_plain", B=1, D=4096, host_us=20.0, eager_ms=0.29, graph_ms=0.28,
                 tokens=7, memo_share=0.95),
            dict(call="tp2_mm_local", B=1, D=4096, host_us=0.0, eager_ms=0.1, tokens=0),
            dict(call="tp2_loop_nomemo", B=1, D=4096, host_us=90.0, eager_ms=0.2, tokens=1),
            dict(call="tp2_loop", B=1, D=4096, host_us=40.0, eager_ms=0.15, tokens=2)]
    path = tmp_path / "host_cost.json"
    path.write_text(json.dumps(rows))
    lines = host_cost.report([f"={path}"]).splitlines()
    assert "host µs memo off | host µs memo on" in lines[0] and "TP bound ms" in lines[0]
    assert lines[2] == "| 4096 | tp1_plain | 1 | 50.0 | 20.0 (95% memo) | 0.300 / 0.280 | " \
                       "0.290 / 0.280 |  |"
    assert lines[3] == "| 4096 | tp2_loop | 1 | 90.0 | 40.0 | 0.200 / – | 0.150 / – | 0.140 |"
    assert lines[-1].startswith("Floor (host µs): empty 3.0")


def test_host_cost_report_pairs_the_graph_args_arms(tmp_path):
    """One --ab-args run: <kind>_noargs and <kind> become "graph args off" / "on" columns."""
    import json
    from tools import host_cost
    rows = [dict(call="tp1_loop_noargs", B=1, D=4096, host_us=80.0, eager_ms=0.36, tokens=3,
                 memo_share=1.0),
            dict(call="tp1_loop", B=1, D=4096, host_us=25.0, eager_ms=0.33, tokens=4,
                 memo_share=1.0)]
    path = tmp_path / "host_cost.json"
    path.write_text(json.dumps(rows))
    lines = host_cost.report([f"={path}"]).splitlines()
    assert "host µs graph args off | host µs graph args on" in lines[0]
    assert lines[2] == "| 4096 | tp1_loop | 1 | 80.0 | 25.0 (100% memo) | 0.360 / – | 0.330 / – |"


def test_tp_filtered_summary_names_the_worst_cell_and_the_split_ab():
    from tools import tp_filtered
    rows = [{"head": "zipf1.3", "B": 16, "world": 4, "plain": 0.1, "k50": 0.13, "p0.9": 0.16,
             "m0.1": 0.12, "p0.9_unsplit": 0.2, "p0.9_same_tokens": True},
            {"head": "gauss1", "B": 64, "world": 4, "plain": 0.1, "k50": 0.14, "p0.9": 0.2,
             "m0.1": 0.19, "p0.9_unsplit": 0.18, "p0.9_same_tokens": False}]
    line = tp_filtered.summary(rows)
    assert line.startswith("TP4 summary: k50 worst 1.40x (gauss1, B=64)")
    assert "p0.9 worst 2.00x (gauss1, B=64), median 2.00x" in line
    assert "split / unsplit worst 1.11x, same tokens in 1 of 2 cells" in line


def test_filtered_ab_table_gives_ratios_and_flags_cells_whose_tokens_differ():
    """Means over runs, the ratio to the first arm, and a cell whose tokens differ between
    arms (or between one arm's runs) marked False and counted in the last line."""
    run = lambda ms, tok: {"ms": ms, "tokens": tok}  # noqa: E731
    res = {"old": [run({"p@g@64": 1.0, "m@g@64": 0.5}, {"p@g@64": [1, 2], "m@g@64": [3]}),
                   run({"p@g@64": 1.2, "m@g@64": 0.5}, {"p@g@64": [1, 2], "m@g@64": [3]})],
           "new": [run({"p@g@64": 0.99, "m@g@64": 0.55}, {"p@g@64": [1, 2], "m@g@64": [4]}),
                   run({"p@g@64": 0.99, "m@g@64": 0.55}, {"p@g@64": [1, 2], "m@g@64": [3]})]}
    lines = filtered_ab.table([["old", "A"], ["new", "B"]], res).splitlines()
    assert lines[2] == "| p@g@64 | 1.1000 | 0.9900 | 0.900 | True |"
    assert lines[3] == "| m@g@64 | 0.5000 | 0.5500 | 1.100 | False |"
    assert lines[-1] == ("worst 1.100 (new, m@g@64), best 0.900 (new, p@g@64); tokens differ "
                         "in 1 of 2 cells")


def test_filtered_ab_passes_its_cells_on_writes_each_arm_as_it_lands_and_keeps_its_budget(
        monkeypatch, tmp_path, capsys):
    """The workers get --cells; each arm's result is printed and written to --out as soon as
    its process ends (a run cut short keeps it); a round that would end past --budget does
    not start (the first always runs); an unknown cell is an error naming --cells."""
    calls = []
    clock = [0.0]  # each worker process takes 50 s

    def fake_run(cmd, **kw):
        calls.append(cmd)
        clock[0] += 50.0
        cells = cmd[cmd.index("--cells") + 1].split(",")
        out = {"ms": {f"{c}@gauss1@64": 1.0 for c in cells},
               "tokens": {f"{c}@gauss1@64": [1] for c in cells}}
        return types.SimpleNamespace(stdout=json.dumps(out) + "\n")
    monkeypatch.setattr(filtered_ab.subprocess, "run", fake_run)
    monkeypatch.setattr(filtered_ab.time, "time", lambda: clock[0])
    out = tmp_path / "ab.json"
    argv = ["filtered_ab", "--arm", "old:A", "--arm", "new:B", "--heads", "gauss1", "--batches",
            "64", "--cells", "plain,p0.9+lp", "--rounds", "3", "--budget", "250", "--out",
            str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    filtered_ab.main()
    text = capsys.readouterr().out
    assert len(calls) == 4  # rounds 0 and 1 (100 s each); round 2 would end at 300 s
    assert all(c[c.index("--cells") + 1] == "plain,p0.9+lp" for c in calls)
    assert text.count("round 0 arm ") == 2 and "budget: round 2" in text
    saved = json.loads(out.read_text())
    assert len(saved["old"]) == len(saved["new"]) == 2
    assert set(saved["old"][0]["ms"]) == {"plain@gauss1@64", "p0.9+lp@gauss1@64"}
    monkeypatch.setattr(sys, "argv", argv[:10] + ["plain,nope"])
    with pytest.raises(SystemExit):
        filtered_ab.main()
    assert "--cells: unknown ['nope']" in capsys.readouterr().err


def test_filtered_ab_arms_take_environment_variables(monkeypatch):
    """NAME:DIR:VAR=VALUE,... puts those variables in that arm's workers only."""
    assert filtered_ab.parse_arms(["off:/a:TPSAMPLE_FALLBACK_GATE=0,X=1=2", "on:/a"]) == (
        [["off", "/a"], ["on", "/a"]], {"off": {"TPSAMPLE_FALLBACK_GATE": "0", "X": "1=2"},
                                         "on": {}})
    envs = []

    def fake_run(cmd, env, **kw):
        envs.append((env["PYTHONPATH"], env.get("TPSAMPLE_FALLBACK_GATE")))
        return types.SimpleNamespace(stdout=json.dumps({"ms": {"c": 1.0}, "tokens": {"c": [1]}}))
    monkeypatch.setattr(filtered_ab.subprocess, "run", fake_run)
    monkeypatch.delenv("TPSAMPLE_FALLBACK_GATE", raising=False)
    monkeypatch.setattr(sys, "argv", ["filtered_ab", "--arm", "off:/a:TPSAMPLE_FALLBACK_GATE=0",
                                      "--arm", "on:/a:TPSAMPLE_FALLBACK_GATE=1", "--rounds", "1"])
    filtered_ab.main()
    assert envs == [("/a", "0"), ("/a", "1")]


def test_count_bins_brackets_hold_the_cut_and_a_wrong_lower_bound_does_not():
    """tools.count_bins: the bracket one count pass leaves has A(lo) >= p·Z > A(hi) and the
    tokens it counts, on flat and Zipf rows (V = 32,768, windows from the simulated records);
    weighing each bin's tokens at its top for the lower bound instead (not a bound) puts lo
    above the cut on some row."""
    import torch

    from tools import count_bins
    g = torch.Generator().manual_seed(3)
    V = 32768
    rank = torch.log(torch.arange(1, V + 1, dtype=torch.float64))
    rows = [torch.randn(V, generator=g, dtype=torch.float64) * s for s in (1.0, 2.0, 4.0)]
    rows += [(-a * rank)[torch.randperm(V, generator=g)] for a in (1.0, 1.3)]
    wrong = 0
    for x in rows:
        for p in (0.5, 0.9, 0.95, 0.99):
            glo, ghi = count_bins.window(x, p, g)
            e = torch.exp(x - x.max())
            target = p * float(e.sum())
            r = count_bins.count_bracket(x, p, glo, ghi, 512)
            assert r["tokens"] is not None, (p, glo, ghi)
            assert float(e[x >= r["lo"]].sum()) >= target > float(e[x >= r["hi"]].sum())
            assert r["tokens"] == int(((x >= r["lo"]) & (x < r["hi"])).sum())
            bad = count_bins.count_bracket(x, p, glo, ghi, 512, lower_edge=0.0)
            wrong += float(e[x >= bad["lo"]].sum()) < target
    assert wrong > 0
