"""Environment knobs: read and checked in one module, listed, retired ones warned about."""
import os
import subprocess
import sys

import pytest


def run(env: dict, code: str, tmp_path):
    """A fresh interpreter outside the checkout (so the installed package is imported)."""
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), cwd=tmp_path,
                          capture_output=True, text=True)


@pytest.mark.slow  # (multi-process / subprocess: CI runs it under -m slow)
def test_knobs_are_listed_with_their_values(tmp_path):
    out = run({"TPSAMPLE_REPLAY": "0"}, "import runpy; runpy.run_module('tpsample.knobs', run_name='__main__')",
              tmp_path)
    assert out.returncode == 0, out.stderr
    assert "TPSAMPLE_REPLAY=0 (default 1)" in out.stdout and "TPSAMPLE_GLUON=1" in out.stdout


def test_a_bad_value_fails_at_import_naming_the_knob(tmp_path):
    out = run({"TPSAMPLE_GLUON": "yes"}, "import tpsample", tmp_path)
    assert out.returncode != 0 and "TPSAMPLE_GLUON" in out.stderr


def test_retired_and_unknown_knobs_are_warned_about(tmp_path):
    code = "import warnings; warnings.simplefilter('always'); import tpsample"
    out = run({"TPSAMPLE_PP_UNROLL": "2", "TPSAMPLE_REPLAI": "0"}, code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "TPSAMPLE_PP_UNROLL is ignored" in out.stderr and "TPSAMPLE_REPLAI is ignored" in out.stderr


def test_replay_knob_turns_the_replay_off(tmp_path):
    out = run({"TPSAMPLE_REPLAY": "0"}, "from tpsample import replay; print(replay.ENABLED)", tmp_path)
    assert out.stdout.strip() == "False"


def test_overridden_sets_and_restores_switches_and_names_unknown_ones():
    from tpsample import knobs
    before = knobs.MEMO
    with pytest.raises(RuntimeError):
        with knobs.overridden(MEMO=not before, GRAPHS_FILTERED=False):
            assert knobs.MEMO is (not before) and knobs.GRAPHS_FILTERED is False
            raise RuntimeError  # restored on the way out too
    assert knobs.MEMO is before
    with pytest.raises(ValueError, match="MEMOS"):
        with knobs.overridden(MEMOS=False):
            pass
