"""The shipped config tables and their lookup (CPU only: no kernel runs here)."""
import json

import pytest
import torch

from tpsample import fused, tune

A, B64, C, X, Y, Z = ({"strategy": s} for s in "abcxyz")


def test_table_config_buckets_and_thin_head_overrides():
    buckets = {16: A, 64: B64, 256: C}
    by_max_d = {2048: {64: X}, 4096: {64: Y, 256: Z}}
    look = lambda b, d: fused.table_config(buckets, by_max_d, b, d)["strategy"]  # noqa: E731
    assert look(64, 2048) == "x" and look(40, 2048) == "x"  # 40 falls in bucket 64
    assert look(64, 1024) == "x"  # the smallest max_d >= D wins
    assert look(256, 2048) == "z"  # 2048 has no bucket 256: the next override has
    assert look(64, 3000) == "y" and look(64, 4096) == "y"
    assert look(64, 4097) == "b" and look(16, 2048) == "a" and look(300, 1024) == "z"
    assert look(300, 8192) == "c"  # beyond the largest bucket: the largest
    # a copy: callers pop keys from it
    got = fused.table_config(buckets, by_max_d, 1, 8192)
    got.pop("strategy")
    assert A == {"strategy": "a"}


@pytest.mark.parametrize("name", ["h100.json", "h200.json"])
def test_shipped_tables_are_consistent(name):
    data = json.loads((fused.CONFIG_DIR / name).read_text())
    buckets = {int(b) for b in data["buckets"]}
    assert buckets and all(cfg["strategy"] in ("fused", "persistent", "logits", "ws", "pp")
                           for cfg in data["buckets"].values())
    for max_d, over in data.get("by_max_d", {}).items():
        assert int(max_d) > 0 and {int(b) for b in over} <= buckets, (max_d, over)


def test_tune_override_arguments_are_checked(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(SystemExit, match="missing"):
        tune.check_override(2048, [(2048, 1000)], [64], path)
    path.write_text(json.dumps({"buckets": {"16": A, "64": B64}}))
    tune.check_override(2048, [(2048, 1000), (1024, 500)], [16, 64], path)
    with pytest.raises(SystemExit, match="<= 2048"):
        tune.check_override(2048, [(4096, 1000)], [64], path)
    with pytest.raises(SystemExit, match=r"buckets of t.json \[16, 64\], got \[32\]"):
        tune.check_override(2048, [(2048, 1000)], [32, 64], path)
    with pytest.raises(SystemExit, match="--max-d must be >= 1"):
        tune.check_override(0, [(2048, 1000)], [64], path)


def test_tune_passes_alternate_order_and_are_checked(tmp_path):
    assert tune.pass_orders(3, 3) == [[0, 1, 2], [2, 1, 0], [0, 1, 2]]
    assert tune.pass_orders(0, 2) == [[], []]
    with pytest.raises(ValueError, match="passes"):
        tune.pass_orders(3, 0)
    with pytest.raises(SystemExit, match="--passes"):
        tune.main(["--passes", "0", "--out", str(tmp_path / "t.json")])


def test_hopper_kernels_fall_back_with_one_warning_without_their_gluon_api(monkeypatch):
    """On a Triton whose Gluon API the ws/pp kernels are not written for, a Hopper GPU gets
    the records-pass path (ws_supported is False, so pp falls back too) and one warning."""
    import types
    import warnings
    monkeypatch.setattr(fused.gluon_sample, "AVAILABLE", False)
    monkeypatch.setattr(fused, "_is_hopper", lambda index: True)
    fused._warn_no_gluon.cache_clear()
    h = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.warns(RuntimeWarning, match="Gluon API"):
        assert not fused.ws_supported(h, h, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not fused.ws_supported(h, h, 0) and not fused.pp_supported(h, h, 0)
    fused._warn_no_gluon.cache_clear()


def test_ab_arm_specs_are_checked():
    """tpsample.ab: arms are NAME:VAR=VALUE[,...]; at least two are needed."""
    from tpsample import ab
    for argv in (["--arm", "a:X=1"], ["--arm", "a:X=1", "--arm", "bX=1"],
                 ["--arm", "a:X=1", "--arm", "b:X"]):
        with pytest.raises(SystemExit) as e:
            ab.main(argv)
        assert e.value.code == 2  # argparse's usage error, before any arm runs


def test_kernel_knobs_are_checked(tmp_path):
    """A bad TPSAMPLE_PHILOX_MUL / TPSAMPLE_PHILOX_HALVES / TPSAMPLE_PP_UNROLL fails at
    import, naming the knob. (Run outside the checkout, so the installed package is imported.)"""
    import os
    import subprocess
    import sys
    for var, value in (("TPSAMPLE_PHILOX_MUL", "narrow"), ("TPSAMPLE_PHILOX_HALVES", "21"),
                       ("TPSAMPLE_PP_UNROLL", "3")):
        out = subprocess.run([sys.executable, "-c", "import tpsample.kernels"],
                             env=dict(os.environ, **{var: value}), cwd=tmp_path,
                             capture_output=True, text=True)
        assert out.returncode != 0 and var in out.stderr, out.stderr[-500:]
