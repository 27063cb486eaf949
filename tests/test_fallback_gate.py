"""The exact fallback's gate (tpsample/fallback_gate.py), interpreted kernels on the CPU.

The filter kernel sets a call's gate exactly when it flags a row and the fallback's rows
kernel clears it, so every call starts with it clear; a recorded call brackets the
fallback's launches, and only those, with the gate's two steps; inside a capture those
steps open and close one conditional node (a stand-in graph here: tests/gpu replays real
graphs with and without the gate and compares tokens).
"""
import pytest
import torch

import tpsample
from tpsample import fallback_gate, knobs, launchers, replay
from tpsample.api import _pipeline
from tpsample.fallback_choice import FallbackChoice
from tpsample.kernels import filter_cut, filter_fallback, filter_records

from test_filter_cut import flat_rows


def _calls(monkeypatch):
    """The gate on (TPSAMPLE_FALLBACK_GATE=1). Spies: the list of (what, value) each filter-kernel launch, fallback step and gate
    step appends, in launch order (the gate's value read right after the filter kernel)."""
    seen = []
    run_kernel, run_step, stage2 = replay.run_kernel, launchers.run_step, launchers.stage2_filtered

    def kernel(k, grid, args, const, opts):
        seen.append(("kernel", k))
        return run_kernel(k, grid, args, const, opts)

    def step(fn, args):
        seen.append(("step", fn))
        return run_step(fn, args)

    def filtered(*args, gate=None, **kw):
        out = stage2(*args, gate=gate, **kw)
        seen.append(("gate", None if gate is None else (bool(gate.item()),
                                                        bool(out.fallback.any()))))
        return out
    monkeypatch.setattr(replay, "run_kernel", kernel)
    monkeypatch.setattr(launchers, "run_step", step)
    monkeypatch.setattr(launchers, "stage2_filtered", filtered)
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 5)
    monkeypatch.setattr(knobs, "FALLBACK_GATE", True)
    return seen


@pytest.mark.parametrize("scale,flagged", [(1.0, True), (40.0, False)], ids=["flat", "peaked"])
def test_the_filter_kernel_sets_the_gate_when_it_flags_a_row(scale, flagged, monkeypatch):
    """Flat rows (top-p 0.9 reaches past the known prefix: flagged) and peaked ones (the
    candidates certify them): the gate after the filter kernel equals "some row flagged",
    and after the call it is clear again."""
    seen = _calls(monkeypatch)
    h, w = flat_rows(V=900, B=4)
    tpsample.sample(h * scale, w, seed=torch.arange(4) + 3, backend="triton", top_p=0.9)
    gates = [v for what, v in seen if what == "gate"]
    assert gates == [(flagged, flagged)]
    gate = _pipeline("triton", h.device).gates.get(None)
    assert not gate.item()


def test_the_gate_steps_bracket_the_fallback_launches_only(monkeypatch):
    """filter kernel, open, the fast path's steps and the rows kernel, close: nothing of the
    fallback outside the bracket, nothing else inside it."""
    seen = _calls(monkeypatch)
    h, w = flat_rows(V=900, B=4)
    tpsample.sample(h, w, seed=torch.arange(4) + 3, backend="triton", top_p=0.9, min_p=0.01)
    order = [v for what, v in seen if what != "gate"]
    opened = order.index(fallback_gate.open_body)
    closed = order.index(fallback_gate.close_body)
    assert order[opened - 1] is filter_records.filter_records_kernel
    inside = order[opened + 1:closed]
    assert inside[-1] is filter_fallback.fallback_rows_kernel
    assert set(inside[:-1]) == {filter_cut.cut_step_kernel}
    assert closed == len(order) - 1


def test_the_knob_off_takes_no_gate(monkeypatch):
    """TPSAMPLE_FALLBACK_GATE=0: no gate, no steps, the kernels as without the gate."""
    seen = _calls(monkeypatch)
    monkeypatch.setattr(knobs, "FALLBACK_GATE", False)
    h, w = flat_rows(V=900, B=2)
    tpsample.sample(h, w, seed=torch.arange(2), backend="triton", top_p=0.9)
    assert [v for what, v in seen if what == "gate"] == [None]
    assert not any(what == "step" for what, _ in seen)


@pytest.mark.parametrize("filters,lazy", [(dict(top_k=50, top_p=0.9), False),
                                          (dict(top_p=0.9, min_p=0.01), True)],
                         ids=["top-k", "no-side-output"])
def test_recomputed_rows_are_gated_with_their_logits_kernel(filters, lazy, monkeypatch):
    """A call whose flagged rows' logits are recomputed from W (top-k; or the cut's fast
    path without the side output, FallbackChoice.side_output): the logits kernel is inside
    the bracket too, first, and the gate is clear after the call."""
    seen = _calls(monkeypatch)
    if lazy:
        monkeypatch.setattr(FallbackChoice, "side_output", lambda self, h, c: False)
    h, w = flat_rows(V=900, B=4)
    tpsample.sample(h, w, seed=torch.arange(4) + 3, backend="triton", **filters)
    assert [v for what, v in seen if what == "gate"] == [(True, True)]
    order = [v for what, v in seen if what != "gate"]
    opened = order.index(fallback_gate.open_body)
    closed = order.index(fallback_gate.close_body)
    assert order[opened - 1] is filter_records.filter_records_kernel
    inside = order[opened + 1:closed]
    assert inside[0] is filter_fallback.fallback_logits_kernel
    assert inside[-1] is filter_fallback.fallback_rows_kernel
    assert set(inside[1:-1]) == ({filter_cut.cut_step_kernel} if lazy else set())
    assert not _pipeline("triton", h.device).gates.get(None).item()


class _Maker:
    """A stand-in NodeMaker: its nodes log enter / leave (a real one needs a GPU)."""
    calls: list = []

    def __init__(self, device):
        self.device = device
        self.calls.append(("made", device))

    def __call__(self, gate):
        calls = self.calls

        class Node:
            stream, outer = 11, None
            body = type("Body", (), {"cuda_stream": 22})()

            def enter(self):
                calls.append(("enter", gate))

            def leave(self):
                calls.append(("leave",))
        return Node()


class _Gate:
    is_cuda = True


CUDA = torch.device("cuda", 0)


@pytest.fixture
def maker(monkeypatch):
    monkeypatch.setattr(fallback_gate, "NodeMaker", _Maker)
    monkeypatch.setattr(fallback_gate, "available", lambda: None)
    monkeypatch.setattr(fallback_gate, "FAILED", None)
    monkeypatch.setattr(knobs, "FALLBACK_GATE", True)
    _Maker.calls = []
    return _Maker


def test_inside_a_capture_the_steps_open_and_close_one_conditional_node(maker, monkeypatch):
    gate = _Gate()
    assert fallback_gate.open_body(gate) is gate  # (no capture: nothing)
    fallback_gate.close_body(gate)
    assert fallback_gate.next_stream(5) == 5
    with fallback_gate.capturing(CUDA):
        fallback_gate.open_body(gate)
        assert fallback_gate.next_stream(5) == 22  # (a replay's launches: into the body)
        fallback_gate.close_body(gate)
        assert fallback_gate.next_stream(22) == 11  # (and back out)
        with fallback_gate.capturing(torch.device("cpu")):  # (a nested block, no node)
            fallback_gate.open_body(gate)
            fallback_gate.close_body(gate)
        fallback_gate.open_body(torch.zeros(1, dtype=torch.bool))  # (a CPU gate: no node)
        assert fallback_gate.next_stream(5) == 5
        fallback_gate.close_body(gate)
    assert maker.calls == [("made", CUDA), ("enter", gate), ("leave",)]
    maker.calls.clear()
    with fallback_gate.capturing(None):  # (a capture without a gate: plain calls)
        fallback_gate.open_body(gate)
        fallback_gate.close_body(gate)
    assert maker.calls == []
    with knobs.overridden(FALLBACK_GATE=False), fallback_gate.capturing(CUDA):
        fallback_gate.open_body(gate)
        fallback_gate.close_body(gate)
    assert maker.calls == []
    monkeypatch.setattr(fallback_gate, "available", lambda: "no cuda.bindings")
    with fallback_gate.capturing(CUDA):  # (without the CUDA wheels: silently none)
        fallback_gate.open_body(gate)
        fallback_gate.close_body(gate)
    assert maker.calls == [] and fallback_gate.FAILED == "no cuda.bindings"


def test_a_capture_that_fails_inside_the_body_leaves_it(maker, monkeypatch):
    """abandon() (before the graph's capture ends) leaves the open body once; the torch
    stream goes back to the node's outer one."""
    streams = []
    monkeypatch.setattr(torch.cuda, "set_stream", streams.append)
    gate = _Gate()
    with pytest.raises(RuntimeError, match="inside"):
        with fallback_gate.capturing(CUDA):
            fallback_gate.open_body(gate)
            try:
                raise RuntimeError("inside")
            finally:
                fallback_gate.abandon()
    assert maker.calls == [("made", CUDA), ("enter", gate), ("leave",)] and streams == [None]


def test_the_set_kernel_links_without_a_gpu():
    """NVRTC's PTX of the one-thread set kernel links with libcudadevrt.a (skipped where
    cuda.bindings or the CUDA wheels are missing, as on a CPU-only install)."""
    if fallback_gate.available() is not None:
        pytest.skip(fallback_gate.available())
    cubin = fallback_gate.set_condition_cubin("sm_90")
    assert cubin[:4] == b"\x7fELF"


COMPILE = r'''
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tpsample import replay
from tpsample.kernels import filter_fallback, filter_records

POINTERS = dict(rec_ptr="*fp32", inv_temp_ptr="*fp32", seed_ptr="*i64", offset_ptr="*i64",
                top_k_ptr="*i64", top_p_ptr="*fp32", min_p_ptr="*fp32", tokens_ptr="*i64",
                logprobs_ptr="*fp32", logz_ptr="*fp32", top_tok_ptr="*i64", top_lp_ptr="*fp32",
                flag_ptr="*i32", scratch_ptr="*i64", parity_ptr="*i32", gate_ptr="*i1",
                l_ptr="*fp32", count_ptr="*i32", starts_ptr="*i64", calls_ptr="*i32")
FILTERS = dict(HAS_K=False, HAS_P=True, HAS_M=True, RAW=False, REPLACE=True, PDL=True)
for fn, c in ((filter_records.filter_records_kernel,
               dict(FILTERS, USE_PARITY=False, K=4, BLOCK_N=2048, BLOCK_U=1024, CAP=2048,
                    SORT_A=256, SORT_B=512, PATHWISE=True, WINNER_CERT=True, GATE=True)),
              (filter_fallback.fallback_rows_kernel,
               dict(FILTERS, BLOCK=1024, BLOCK_N=16, CAP=2048, FAST=True, GATE=True))):
    runtime, _ = replay._signature(fn)
    defaults = {n: q.default for n, q in inspect.signature(fn.fn).parameters.items()
                if q.default is not inspect.Parameter.empty and "constexpr" in str(q.annotation)}
    sig = {n: POINTERS.get(n, "i32") for n in runtime} | {k: "constexpr" for k in defaults | c}
    triton.compile(ASTSource(fn, sig, defaults | c, {}), target=GPUTarget("cuda", 90, 32))
print("compiled")
'''


@pytest.mark.slow
def test_the_gated_kernels_compile_for_sm90(tmp_path):
    """The interpreter types a bool pointer's stores loosely: the gate's set and clear
    compile with Triton's frontend and ptxas (the same check as tests/test_cut_compiles.py)."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split()[-1] == "compiled", \
        (out.stdout + out.stderr)[-3000:]
