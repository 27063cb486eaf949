"""Probe (not product tests): why tests/gpu/test_gpu_pipeline.py's filtered-graph test failed
on H200 for top_k + top_p and min_p + top_logprobs but passed for top_p alone and flat rows.

Finding: those two filter sets take the fallback path that FallbackChoice picks per call, and
the non-deterministic (one-device) choice switches to the host path at a call that depends on
when a CUDA event completes (FallbackChoice.device_now: event.query()). The host and device
fallbacks are both exact but differ in their log-probs' low bits, so two runs (graphs on /
off) that switch at different calls return different log-probs / log Z: torch.equal fails.
Calls with the side output (top-p / min-p alone) never consult the choice (always device).
"""
import types

import pytest
import torch

from tpsample import fallback_choice as FC
from tpsample.pipeline import Pipeline
from tpsample.spec import sampling_spec

ARGS = dict(temperature=1.2, offset=1, num_samples=1, return_logprobs=True, top_k=None,
            top_p=None, min_p=None, top_logprobs=0, replacement=True, logprobs_mode="processed",
            allowed_mask=None, logit_adjust=None, repetition_penalty=None)
FAILED = [dict(top_k=50, top_p=0.9), dict(min_p=0.05, top_logprobs=3)]


def _spec(h, V, seed, **kw):
    return sampling_spec(h, vocab_size=V, rows=V, merge="max", **dict(ARGS, seed=seed, **kw))


@pytest.mark.parametrize("kw", FAILED)
def test_the_gpu_tests_failing_cases_flag_most_rows_every_call(kw):
    """The GPU test's shapes (B = 48, D = 512, V = 5000, W * 0.1): with 4 candidates per
    128-token tile most rows of the two failing filter sets lack their certificate in every
    call, so the device fallback count grows from the first call and FallbackChoice moves
    them to the host (for good: a host call with flagged rows never switches back)."""
    B, D, V = 48, 512, 5000
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(V, D, generator=g) * 0.1).bfloat16().float()
    pipe = Pipeline("torch", torch.device("cpu"))
    for i in range(3):
        h = torch.randn(B, D, generator=g).bfloat16().float()
        before = pipe.host_fallback_rows
        pipe.run(h, w, None, _spec(h, V, torch.full((B,), i), **kw), n_real=V, need_mass=True)
        assert pipe.host_fallback_rows - before >= B // 2


@pytest.mark.parametrize("kw", FAILED)
def test_host_and_device_fallbacks_differ_in_low_bits(kw):
    """The same call through the device fallback (kernels/filter_fallback.py, interpreted)
    and the host fallback (tpsample/host_fallback.py): same tokens here, but log-probs and
    log Z (and top log-probs) not bitwise equal, which the GPU test's torch.equal checks."""
    B, D, V = 8, 64, 1000
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(V, D, generator=g) * 0.28).bfloat16()
    h = torch.randn(B, D, generator=g).bfloat16()
    spec = _spec(h, V, torch.arange(B), **kw)
    outs = {}
    for device_path in (True, False):
        pipe = Pipeline("triton", torch.device("cpu"))
        pipe._on_device = lambda *a, _d=device_path: _d  # pin the path FallbackChoice picks
        outs[device_path] = pipe.run(h, w, None, spec, n_real=V, need_mass=True)
        assert pipe.fallback_rows > 0
    (t1, l1, z1, _), (t2, l2, z2, _) = outs[True], outs[False]
    assert torch.equal(t1.view(-1), t2.view(-1))
    assert torch.allclose(z1, z2, atol=1e-5)
    assert not (torch.equal(l1.view(-1), l2.view(-1)) and torch.equal(z1, z2))


class _Clock:
    """Calls so far; an event completes `latency` calls after the call that recorded it
    (the device's lag behind the host, which differs between graph and eager runs)."""
    call = 0
    latency = 1


class _TimedEvent:
    def record(self):
        self.at = _Clock.call

    def query(self):
        return _Clock.call - self.at >= _Clock.latency

    def synchronize(self):  # a blocking wait: the copy is ready whatever the timing
        pass


def _paths(deterministic: bool, latency: int, calls: int = 40) -> list[bool]:
    """The path of each call of a run whose every call flags rows: device calls add them to
    the counter (the kernels) and watch(); host calls redo them (host_mode stays)."""
    choice = FC.FallbackChoice(torch.device("cpu"), deterministic=deterministic)
    counter = choice.counter()
    hidden = types.SimpleNamespace(is_cuda=True)
    _Clock.latency = latency
    paths = []
    for call in range(calls):
        _Clock.call = call
        on_device = choice.device_now(hidden, in_capture=False)
        paths.append(on_device)
        if on_device:
            counter += 40
            choice.watch()
    return paths


def test_local_choice_switches_at_a_call_that_depends_on_timing(monkeypatch):
    """One device (deterministic=False, what Pipeline builds without a gathering transport):
    the same calls switch to the host path at different calls when the device lags by one
    call or by three. A graph run (less host time per call, and device_now asked before
    stage 1 in the graph branch, pipeline.py:374, vs after it in the eager one, :397) sees
    another lag than the eager run it is compared with."""
    monkeypatch.setattr(FC.torch.cuda, "Event", _TimedEvent)
    fast, slow = _paths(False, 1), _paths(False, 3)
    assert fast != slow
    assert fast.index(False) < slow.index(False)
    assert not Pipeline("triton", torch.device("cpu")).fallback.deterministic


def test_side_output_calls_never_ask_the_choice():
    """Why top_p alone and flat rows passed: with the side output _on_device is True
    whatever the choice says (pipeline.py:459-460)."""
    pipe = Pipeline("triton", torch.device("cpu"))
    pipe.fallback.host_mode = True
    hidden = types.SimpleNamespace(is_cuda=True)
    assert pipe._on_device(True, hidden, False)
    assert not pipe._on_device(False, hidden, False)


def test_deterministic_reads_switch_at_the_same_call_whatever_the_timing(monkeypatch):
    """The proposed fix's property: with DeterministicReads the switch call depends only on
    the counts, not on the device's lag, so a graph run and an eager run take the same path
    at every call."""
    monkeypatch.setattr(FC.torch.cuda, "Event", _TimedEvent)
    assert _paths(True, 1) == _paths(True, 3) == _paths(True, 7)


@pytest.mark.xfail(reason="proposed fix not applied: one-device pipelines use the "
                          "timing-dependent choice", strict=True)
def test_one_device_pipeline_decides_deterministically():
    assert Pipeline("triton", torch.device("cpu")).fallback.deterministic


@pytest.mark.parametrize("kw", FAILED)
def test_recompute_path_graph_wiring(kw, monkeypatch):
    """Rules out the graph's wiring for the two failing filter sets (no side output: the
    fallback's logits recomputed into `fallback_logits`; top log-probs): on fake kernels and
    a fake graph (tests/test_pipeline.py's tape) every replay sees this call's hidden states
    and filters, writes every output it returns (top planes included) into the graph's own
    buffers, and the fallback's logits buffer is the graph's, allocated once in the capture."""
    from test_pipeline import _fake_cuda, _launch, spec_of
    from tpsample import call_graphs as CG
    _fake_cuda(monkeypatch)
    B, S, T = 4, 1, 2
    n, numel = T * 128, 256
    pipe = Pipeline("triton", torch.device("cpu"))
    pipe.graphs = CG.CallGraphs(torch.device("cpu"))
    filters = spec_of(torch.zeros(B, 2), 300, **kw).filters
    top_n = filters.top_n
    logits_bufs = []

    def stage1(stream, records, side, hidden, seed, offset, **_):
        assert side is None
        _launch(lambda: records.view(-1)[:B].copy_((hidden.sum(1).long() + seed + offset)
                                                   .float()))

    def stage2(stream, records, fallback_logits, hidden, tokens, logprobs, logz, top_tokens,
               top_logprobs, fallback, scratch, **f):
        logits_bufs.append(fallback_logits)

        def work():  # the filter kernel, then the device fallback (logits recomputed)
            fallback.fill_(1)
            fallback_logits[:, 0].copy_(hidden.sum(1))
            tokens.copy_(records.view(-1)[:B].long() + fallback_logits[:, 0].long() * 0)
            logprobs.copy_(fallback_logits[:, 0])
            logz.copy_(-fallback_logits[:, 0])
            if top_n:
                top_tokens.copy_(tokens[:, None] + torch.arange(top_n))
                top_logprobs.copy_(logprobs[:, None] - torch.arange(top_n))
        _launch(work)
    seed, offset = torch.zeros(B, dtype=torch.int64), torch.full((B,), 3)
    later = dict(top_k=filters.top_k, top_p=filters.top_p, min_p=filters.min_p)
    for i in range(CG.CAPTURE_AT + 3):
        h = torch.full((B, 2), float(i)) + torch.arange(B)[:, None]
        seed.fill_(i)
        call = dict(hidden=h, inv_temp=None, seed=seed, offset=offset, bias=None)
        key2 = pipe._key2(True, filters, dict(call, side=None),
                          dict(later, fallback_logits=torch.empty(B, n)), True)
        out = pipe._filtered_graph_call("k", stage1, {key2: stage2}, call, filters, False, B,
                                        S, T, numel, 0, True)
        assert (out is None) == (i < CG.CAPTURE_AT - 1), i
        if out is not None:
            want = h.sum(1)
            assert torch.equal(out.tokens, _want_tokens(h, seed, offset)), i
            assert torch.equal(out.logprobs, want) and torch.equal(out.logz, -want), i
            if top_n:
                assert torch.equal(out.top_tokens, out.tokens[:, None] + torch.arange(top_n))
                assert torch.equal(out.top_logprobs, want[:, None] - torch.arange(top_n))
            else:
                assert out.top_tokens is None and out.top_logprobs is None
    assert len(logits_bufs) == 1  # captured once, with its own logits buffer


def _want_tokens(h, seed, offset):
    return h.sum(1).long() + seed + offset
