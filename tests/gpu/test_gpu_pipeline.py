"""Single-GPU checks of the whole call: exactness through tpsample.sample, CUDA graphs, the
launch replay (pytest -m gpu)."""
import pytest
import torch

import tpsample
from tpsample.plan import DeviceKind

from cases import exact_probs, lm_head_case
from stats import ALPHA, chi2_pvalue

pytestmark = pytest.mark.gpu


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("merge,V", [("max", 1000), ("logmass", 1000), ("cdf", 1000), ("cdf", 1024)])
def test_chi2_on_gpu_bf16(merge, V):
    """40 000 draws through tpsample.sample: the tables' large-batch kernel (pp or ws); for
    cdf at V = 1000 the cuBLAS + records pass, at V = 1024 (a multiple of 32, one sample) the
    ping-pong kernel's cdf records on Hopper."""
    S = 1 if V == 1024 else 20
    h, w = lm_head_case("zipf", V=V, dtype=torch.bfloat16, device="cuda", seed=3)
    rows = 40000 // S
    seeds = torch.arange(rows, device="cuda") * 7919
    hh = h.expand(rows, -1).contiguous()
    tokens = tpsample.sample(hh, w, temperature=0.9, seed=seeds, num_samples=S, merge=merge)
    assert chi2_pvalue(tokens, exact_probs(h, w, temperature=0.9)) > ALPHA
    plan = tpsample.explain(rows, h.shape[0], V, merge=merge, num_samples=S)
    gluon = DeviceKind.of(hh.device).gluon_missing is None
    if merge == "cdf" and gluon and plan.source.endswith("bucket 256"):
        assert plan.strategy == ("pp" if V == 1024 else "logits"), str(plan)


def test_cuda_graph_capture_and_replay_equals_eager():
    D, V, B = 1024, 32000, 8
    h = torch.randn(B, D, device="cuda").bfloat16()
    w = (torch.randn(V, D, device="cuda") * 0.05).bfloat16()
    seeds = torch.arange(B, device="cuda")
    offset = torch.zeros(B, dtype=torch.int64, device="cuda")
    eager = tpsample.sample(h, w, seed=seeds, offset=offset)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tpsample.sample(h, w, seed=seeds, offset=offset)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tpsample.sample(h, w, seed=seeds, offset=offset)
    graph.replay()
    assert torch.equal(out, eager)
    offset += 1
    graph.replay()
    assert torch.equal(out, tpsample.sample(h, w, seed=seeds, offset=offset))




@pytest.mark.parametrize("B,S,with_bias,force", [(1, 1, False, None), (3, 2, True, None),
                                                  (64, 1, False, None), (200, 1, True, None),
                                                  (200, 2, False, "logits"), (200, 1, True, "pp")])
def test_sample_replay_equals_a_dispatched_call(B, S, with_bias, force, monkeypatch):
    """A call with the key of an earlier one re-issues its recorded launches (the pipeline's
    replays):
    with new hidden, weight, bias and per-row parameters it returns bit for bit what a
    dispatched call returns. D = 512 takes the thin-head table entries (TMA descriptors of
    W, rebased on the new weight); B = 200 the warp-specialized kernel on Hopper (descriptors
    of h and W); "logits" the hybrid (its GEMM re-run as a recorded torch step); "pp" the
    ping-pong kernel on Hopper (its 5-d W descriptor; V a multiple of 32)."""
    from tpsample import api, launchers, pipeline, replay
    if force == "pp":
        cfg = dict(strategy="pp", BLOCK_B=128, NUM_STAGES=6, num_warps=4)
    elif force is not None:
        cfg = dict(strategy=force, BLOCK_B=64, num_warps=8)
    if force is not None:
        real = pipeline.make_plan
        monkeypatch.setattr(pipeline, "make_plan", lambda *a, **k: real(*a, **dict(k, config=cfg)))
    api._PIPELINES.clear()
    D, V = 512, 5024 if force == "pp" else 5000
    g = torch.Generator(device="cuda").manual_seed(B)

    def inputs():
        h = torch.randn(B, D, device="cuda", generator=g).bfloat16()
        w = (torch.randn(V, D, device="cuda", generator=g) * 0.1).bfloat16()
        bias = torch.randn(V, device="cuda", generator=g) if with_bias else None
        temp = torch.rand(B, device="cuda", generator=g) + 0.5
        temp[::3] = 0.0
        seed = torch.randint(0, 1 << 40, (B,), device="cuda", generator=g)
        return dict(hidden=h, weight=w, temperature=temp, seed=seed, offset=7, bias=bias,
                    num_samples=S, return_logprobs=True)

    first = inputs()
    tpsample.sample(**first)
    (pipe,) = api._PIPELINES.values()
    assert len(pipe.replays) == 1
    if replay.TRITON_VERSION == (3, 6) and replay.knobs.DIRECT_LAUNCH:  # what is compared below
        launches = [c for stage in next(iter(pipe.replays.calls.values()))
                    for _, c, *_ in stage.launches if c is not None]
        assert launches and all(isinstance(c, replay._DirectLaunch) for c in launches)
    if force == "pp" and hopper():  # the recorded stage 1 is the ping-pong kernel's launch
        from tpsample.kernels import gluon_pingpong
        stage1 = next(iter(pipe.replays.calls.values()))[0]
        assert [fn for fn, *_ in stage1.launches] == [gluon_pingpong.pp_records_kernel]
    second = inputs()

    def dispatched(*a, **k):
        raise AssertionError("the second call must be a replay")
    with monkeypatch.context() as m:
        m.setattr(launchers, "stage1", dispatched)
        m.setattr(launchers, "stage2", dispatched)
        got = tpsample.sample(**second)
    monkeypatch.setattr(replay, "ENABLED", False)
    want = tpsample.sample(**second)
    for a, b in zip(got, want):
        if a is None and b is None:  # top_tokens / top_logprobs when not asked
            continue
        assert a.shape == b.shape and torch.equal(a, b)


def _calls(monkeypatch, graphs: bool, states, w, **kw):
    """tpsample.sample on each of `states` (seed tensor i at call i, one object: the graph
    binds it) with TPSAMPLE_GRAPHS and _FILTERED on or off, from a fresh pipeline: (the
    outputs, the pipeline)."""
    from tpsample import api, knobs
    monkeypatch.setattr(knobs, "GRAPHS", graphs)
    monkeypatch.setattr(knobs, "GRAPHS_FILTERED", graphs)
    api._PIPELINES.clear()
    seed = torch.zeros(states[0].shape[0], dtype=torch.int64, device="cuda")
    outs = []
    for i, h in enumerate(states):
        seed.fill_(i)
        outs.append(tpsample.sample(h, w, seed=seed, **kw))
    torch.cuda.synchronize()
    (pipe,) = api._PIPELINES.values()
    return outs, pipe


@pytest.mark.parametrize("B,S,logprobs", [(1, 1, False), (64, 1, True), (33, 2, False)])
def test_repeated_calls_through_their_graph_equal_reissued_launches(B, S, logprobs, monkeypatch):
    """From a key's third replayed call the pipeline replays one CUDA graph
    (tpsample/call_graphs.py): per call the same tokens, log-probs and log Z as re-issued
    launches, with the seed tensor updated in place (bound), fresh hidden states (copied),
    scalar parameters (cached tensors, bound) and a new seed tensor object (the graph is
    bypassed); the outputs are fresh tensors per call."""
    from tpsample import api, knobs
    D, V = 512, 5000
    g = torch.Generator(device="cuda").manual_seed(B)
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.1).bfloat16()
    hs = [torch.randn(B, D, device="cuda", generator=g).bfloat16() for _ in range(10)]
    temp = torch.rand(B, device="cuda", generator=g) + 0.5

    def run(graphs: bool):
        monkeypatch.setattr(knobs, "GRAPHS", graphs)
        api._PIPELINES.clear()
        seed = torch.zeros(B, dtype=torch.int64, device="cuda")
        outs = []
        for i, h in enumerate(hs):
            seed.fill_(i)  # in place: the same object every call
            s = seed if i != 8 else seed.clone()  # call 8: another object
            h = h if i % 2 else hs[0]  # odd calls fresh states, even ones the same object
            out = tpsample.sample(h, w, temperature=temp if i < 7 else 0.7, seed=s, offset=3,
                                  num_samples=S, return_logprobs=logprobs)
            outs.append(out)
        torch.cuda.synchronize()
        (pipe,) = api._PIPELINES.values()
        return outs, pipe

    want, _ = run(False)
    got, pipe = run(True)
    # captured at the key's third replay, dropped at call 8 (another seed tensor object);
    # call 9 starts counting again
    assert sum(pipe.graphs.captures.values()) == 1 and len(pipe.graphs) == 0
    for i, (a, b) in enumerate(zip(want, got)):
        if logprobs:
            assert torch.equal(a.tokens, b.tokens), i
            assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.logz, b.logz), i
        else:
            assert torch.equal(a, b), i
    toks = [o.tokens if logprobs else o for o in got]
    assert len({t.data_ptr() for t in toks}) == len(toks)  # fresh outputs, none aliased


def head_and_states(seed: int, B: int, calls: int, flat: bool, D: int = 512, V: int = 5000):
    """A bf16 head [V, D] (flat: near-uniform rows, whose nucleus no candidate certifies)
    and `calls` hidden-state tensors [B, D], from a seeded generator."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(V, D, device="cuda", generator=g) * (0.01 if flat else 0.1)).bfloat16()
    return w, [torch.randn(B, D, device="cuda", generator=g).bfloat16() for _ in range(calls)]


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_k=50, top_p=0.9),
                                dict(min_p=0.05, top_logprobs=3), dict(top_p=0.95, flat=True)])
def test_repeated_filtered_calls_through_their_graph_equal_reissued_launches(kw, monkeypatch):
    """Filtered calls whose exact fallback runs on the device replay one graph too (the
    default; TPSAMPLE_GRAPHS=plain not): the same tokens, log-probs, log Z and top tokens
    per call as re-issued launches, the fallback included (flat: near-uniform rows, whose
    nucleus no candidate certifies). The one-device fallback choice is pinned to the
    device: it moves to the host at a call set by when a CUDA event completes, so two runs
    could switch at different calls (the same tokens, log-probs that differ in the last
    bits); the next test moves it."""
    from tpsample.fallback_choice import FallbackChoice
    monkeypatch.setattr(FallbackChoice, "device_now", lambda self, hidden, in_capture: True)
    kw = dict(kw)
    flat = kw.pop("flat", False)
    B = 48
    w, hs = head_and_states(5, B, 8, flat)

    def run(graphs: bool):
        return _calls(monkeypatch, graphs, hs, w, temperature=1.2, offset=1,
                      return_logprobs=True, **kw)

    want, _ = run(False)
    got, pipe = run(True)
    assert sum(pipe.graphs.captures.values()) == 1
    if flat:
        assert pipe.fallback_rows > 0
    for i, (a, b) in enumerate(zip(want, got)):
        for f in ("tokens", "logprobs", "logz", "top_tokens", "top_logprobs"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None and y is None) or torch.equal(x, y), (i, f)


def alternating_states(B: int):
    """(W, ten batches of B states): flat rows (top-p 0.9 flags every row), peaked ones (it
    flags none) and peaked ones with one flat row, in turn."""
    w, hs = head_and_states(9, B, 4, flat=False)
    scale = torch.ones(B, 1, device="cuda", dtype=torch.bfloat16)
    scale[3] = 0.02
    kinds = [0.02, 8.0, scale * 8.0, 8.0, 0.02, 0.02, scale * 8.0, 8.0, 8.0, 0.02]
    return w, [hs[i % len(hs)] * k for i, k in enumerate(kinds)]


@pytest.mark.parametrize("logprobs", [False, True], ids=["tokens", "logprobs"])
def test_a_graph_skips_its_fallback_only_where_no_row_is_flagged(logprobs, monkeypatch):
    """A one-GPU top-p call's graph holds its fallback's launches in a conditional node
    (tpsample/fallback_gate.py). Calls through one graph that alternate between flat rows
    (all flagged), peaked rows (none) and a batch with one flat row give, call by call, the
    tokens (log-probs, log Z) of re-issued launches, with the gate and without it; the
    gate is clear after each run and the device counted the same fallback rows."""
    from tpsample import fallback_gate, knobs, replay
    why = fallback_gate.available()
    assert why is None, why  # (cuda.bindings and torch's CUDA wheels: what this test is for)
    entered = []
    enter = fallback_gate.Node.enter
    monkeypatch.setattr(fallback_gate.Node, "enter", lambda node: (entered.append(1),
                                                                    enter(node))[1])
    B = 24
    w, states = alternating_states(B)

    def run(graphs: bool, gate: bool):
        monkeypatch.setattr(knobs, "FALLBACK_GATE", gate)
        outs, pipe = _calls(monkeypatch, graphs, states, w, offset=2, top_p=0.9,
                            return_logprobs=logprobs)
        gate_now = pipe.gates.get(replay.current_stream(torch.cuda.current_device()))
        assert not gate_now.item()
        return outs, pipe

    want, plain = run(False, True)
    rows = plain.fallback_rows
    assert 0 < rows < B * len(states)
    for gate in (True, False):
        got, pipe = run(True, gate)
        assert sum(pipe.graphs.captures.values()) == 1
        assert fallback_gate.FAILED is None and bool(entered) == gate, (gate, len(entered))
        entered.clear()
        assert pipe.fallback_rows == rows, gate
        for i, (a, b) in enumerate(zip(want, got)):
            if not logprobs:
                assert torch.equal(a, b), (gate, i)
                continue
            for f in ("tokens", "logprobs", "logz"):
                assert torch.equal(getattr(a, f), getattr(b, f)), (gate, i, f)


@pytest.mark.parametrize("logprobs", [False, True], ids=["tokens", "logprobs"])
def test_a_graph_without_the_side_output_recomputes_its_flagged_rows(logprobs, monkeypatch):
    """Top-p calls whose stage 1 skips the side output (FallbackChoice.side_output says
    so): through one gated graph, alternating flat, peaked and mixed batches, each call's
    flagged rows recomputed from W by the logits kernel give the tokens of re-issued
    launches that read the side output (log-probs and log Z within fp32 rounding: the
    recomputed logits are summed in another order); no side output is allocated."""
    from tpsample import knobs
    from tpsample.fallback_choice import FallbackChoice
    from test_filter_cut import side_outputs
    B = 24
    w, states = alternating_states(B)
    monkeypatch.setattr(knobs, "FALLBACK_GATE", True)
    want, plain = _calls(monkeypatch, False, states, w, offset=2, top_p=0.9,
                         return_logprobs=logprobs)
    sides = side_outputs(monkeypatch)
    monkeypatch.setattr(FallbackChoice, "side_output", lambda self, h, c: False)
    got, pipe = _calls(monkeypatch, True, states, w, offset=2, top_p=0.9,
                       return_logprobs=logprobs)
    assert sum(pipe.graphs.captures.values()) == 1 and not any(sides)
    assert pipe.fallback_rows == plain.fallback_rows
    for i, (a, b) in enumerate(zip(want, got)):
        if not logprobs:
            assert torch.equal(a, b), i
            continue
        assert torch.equal(a.tokens, b.tokens), i
        for f in ("logprobs", "logz"):
            torch.testing.assert_close(getattr(b, f), getattr(a, f), rtol=1e-5, atol=1e-4,
                                       equal_nan=True)


@pytest.mark.parametrize("memo", [False, True])
def test_a_top_k_call_leaves_its_graph_while_its_fallback_is_on_the_host(memo, monkeypatch):
    """A call outside the cut's fast path (top-k: its fallback may move to the host, which
    FallbackChoice decides per call) goes through its graph, through the call memo too,
    only while the choice says device: once it says host the calls re-issue their launches
    and redo their flagged rows from the host (host_fallback_rows grows, the graph does not
    replay), and when it says device again the graph serves them again. Tokens: the same
    as every call re-issued with the same choices (flat rows and top_k 2000, beyond what
    the candidates certify, so nearly every row falls back)."""
    from tpsample import api, knobs
    from tpsample.fallback_choice import FallbackChoice
    B = 16
    w, hs = head_and_states(7, B, 1, flat=True)
    h = hs[0]
    on_device = [True] * 5 + [False] * 3 + [True] * 3
    monkeypatch.setattr(knobs, "MEMO", memo)

    def run(graphs: bool):
        monkeypatch.setattr(knobs, "GRAPHS", graphs)
        monkeypatch.setattr(knobs, "GRAPHS_FILTERED", graphs)
        api._PIPELINES.clear()
        step = iter(on_device)
        now = [True]

        def device_now(self, hidden, in_capture):
            return now[0]
        monkeypatch.setattr(FallbackChoice, "device_now", device_now)
        seed = torch.zeros(B, dtype=torch.int64, device="cuda")
        toks, host_rows = [], []
        for i in range(len(on_device)):
            now[0] = next(step)
            seed.fill_(i)
            toks.append(tpsample.sample(h, w, seed=seed, offset=3, top_k=2000))
            (pipe,) = api._PIPELINES.values()
            host_rows.append(pipe.host_fallback_rows)
        torch.cuda.synchronize()
        return toks, host_rows, pipe

    want, want_rows, _ = run(False)
    got, got_rows, pipe = run(True)
    assert sum(pipe.graphs.captures.values()) == 1
    assert got_rows == want_rows and want_rows[4] == 0
    # each host-mode call redoes its flagged rows from the host (all of them but those the
    # winner certificate clears: a top-k row whose winner is a known token it keeps)
    assert all(0 < b - a <= B for a, b in zip(want_rows[4:7], want_rows[5:8]))
    assert want_rows[-1] == want_rows[7]  # (back on the device)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("kw", [dict(), dict(return_logprobs=True), dict(top_p=0.9),
                                dict(min_p=0.1, flat=True)])
def test_memoised_calls_equal_the_full_path(kw, monkeypatch):
    """A decode loop (new hidden states, the step as an int offset, seed=None drawn per
    call) through tpsample/call_memo.py: every call's tokens (and log-probs, log Z) equal
    the same loop with TPSAMPLE_MEMO=0, a call with another temperature in the middle takes
    the full path, and the memo serves the calls after the capture."""
    from tpsample import api, knobs
    kw = dict(kw)
    flat = kw.pop("flat", False)
    B = 24
    w, hs = head_and_states(3, B, 12, flat)

    def run(memo: bool):
        monkeypatch.setattr(knobs, "MEMO", memo)
        api._PIPELINES.clear()
        torch.manual_seed(0)  # the drawn seeds
        hits = api._MEMO.hits
        outs = []
        for step, h in enumerate(hs):
            temp = 0.5 if step == 7 else 0.8
            outs.append(tpsample.sample(h, w, temperature=temp, offset=step, **kw))
        torch.cuda.synchronize()
        return outs, api._MEMO.hits - hits

    want, none = run(False)
    got, hits = run(True)
    assert none == 0 and hits >= 3
    for i, (a, b) in enumerate(zip(want, got)):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), i
        else:
            for x, y in zip(a, b):
                assert (x is None and y is None) or torch.equal(x, y), i


def test_drawn_seeds_follow_the_cuda_generators_state():
    """seed=None on CUDA: the row seeds are drawn_seeds.row_seeds of a base taken from the
    default generator's Philox seed and offset (moved on by 4 per draw), repeat after
    torch.manual_seed, differ between draws, and leave torch's own draws after them alone
    (the generator's offset moved, not reused)."""
    from tpsample import drawn_seeds as DS
    dev = torch.device("cuda")
    torch.manual_seed(5)
    gen = DS.default_generator(dev)
    off = gen.get_offset()
    first = DS.draw(6, dev)
    assert gen.get_offset() == off + DS.OFFSET_STEP
    second = DS.draw(6, dev)
    torch.manual_seed(5)
    base = DS.next_base(DS.default_generator(dev))
    assert first.tolist() == DS.row_seeds(base, 6).tolist()
    assert not torch.equal(first, second) and int(first.min()) >= 0
    torch.manual_seed(5)
    assert torch.equal(DS.draw(6, dev), first)
    torch.manual_seed(5)
    plain = torch.rand(8, device=dev)
    torch.manual_seed(5)
    DS.draw(6, dev)
    assert not torch.equal(torch.rand(8, device=dev), plain)  # (the offset moved on)


@pytest.mark.parametrize("kw", [dict(), dict(top_p=0.9), dict(seed="tensor")])
def test_graph_args_give_the_tokens_of_copied_inputs_round_the_ring(kw, monkeypatch):
    """A decode loop of 2 · RING_SLOTS + 9 steps with no host synchronisation (new hidden
    states, the step as an int offset, seed=None drawn per call, or new seed tensors)
    through graphs that read them from their GraphArgs slot (tpsample/graph_args.py): every
    step's tokens equal the same loop with TPSAMPLE_GRAPH_ARGS=0 (each input copied into
    the graph's own, one launch each), the memo served the steps after the capture (new
    seed tensors: the full path, through the graph with the tensors' addresses), and the
    ring went round more than twice."""
    from tpsample import api, graph_args, knobs
    kw = dict(kw)
    tensor_seed = kw.pop("seed", None) == "tensor"
    B, steps = 24, 2 * graph_args.RING_SLOTS + 9
    w, hs = head_and_states(7, B, 5, False)

    def run(on: bool):
        monkeypatch.setattr(knobs, "GRAPH_ARGS", on)
        api._PIPELINES.clear()
        api._MEMO.clear()
        torch.manual_seed(0)  # (the drawn seeds)
        hits = api._MEMO.hits
        outs = []
        for step in range(steps):
            seed = (torch.full((B,), step % 3, dtype=torch.int64, device="cuda")
                    if tensor_seed else None)
            outs.append(tpsample.sample(hs[step % 5] * (1 + step / 64), w, seed=seed,
                                        offset=step, **kw))
        torch.cuda.synchronize()
        (pipe,) = api._PIPELINES.values()
        graphs = list(pipe.graphs.graphs.values())
        assert graphs and all((g.args is not None) == on for g in graphs)
        if on:
            assert max(g.args.issued for g in graphs) > 2 * graph_args.RING_SLOTS
        return outs, api._MEMO.hits - hits

    want, _ = run(False)
    got, hits = run(True)
    assert hits >= steps - 4 or tensor_seed  # (a new seed tensor: the full path's graph)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("kw", [dict(), dict(return_logprobs=True), dict(top_p=0.9),
                                dict(num_samples=2)])
def test_returned_tokens_reuse_a_slot_only_once_nothing_holds_it(kw, monkeypatch):
    """TPSAMPLE_REUSE_OUTPUTS (tpsample/call_graphs.py): a loop through the call's graph
    that keeps one step's tokens while it calls the next (`tok = sample(...)`) gets the
    slots' tokens back (no clone), and with one slot held for good (step 6's tokens, and
    step 9's through a view only; with log-probs, step 6's log Z alone) the calls that find
    no free slot return clones. Every call's tokens (and log-probs, log Z) equal the same
    loop with reuse off, and every held tensor still holds its own call's values at the end
    (a slot replayed while held would overwrite them)."""
    from tpsample import api, knobs
    from tpsample.fallback_choice import FallbackChoice
    monkeypatch.setattr(FallbackChoice, "device_now", lambda self, hidden, in_capture: True)
    B = 24
    w, hs = head_and_states(5, B, 16, False)

    def run(reuse: bool):
        monkeypatch.setattr(knobs, "REUSE_OUTPUTS", reuse)
        api._PIPELINES.clear()
        api._MEMO.clear()
        seed = torch.zeros(B, dtype=torch.int64, device="cuda")
        copies, held, in_slot = [], {}, []
        tok = None
        for step in range(16):
            seed.fill_(step)
            r = tpsample.sample(hs[step], w, seed=seed, offset=step, **kw)
            tok = r if isinstance(r, torch.Tensor) else r.tokens
            copies.append((tok.clone(), None if isinstance(r, torch.Tensor)
                           else (r.logprobs.clone(), r.logz.clone())))
            (pipe,) = api._PIPELINES.values()
            slots = () if pipe.last_graph is None else pipe.last_graph[1].slots
            in_slot.append(any(tok.untyped_storage().data_ptr() ==
                               s.outputs["tokens"].untyped_storage().data_ptr() for s in slots))
            if step == 6:
                held[6] = tok
                if not isinstance(r, torch.Tensor):
                    held["logz"] = r.logz
            if step == 9:
                held[9] = tok[: B // 2]
            del r
        torch.cuda.synchronize()
        for step, t in held.items():
            if step == "logz":
                assert torch.equal(t, copies[6][1][1])
            else:
                assert torch.equal(t, copies[step][0][: t.shape[0]]), step
        return copies, in_slot

    want, none = run(False)
    got, in_slot = run(True)
    assert not any(none)
    assert in_slot[3:8] == [True] * 5 and not in_slot[8], in_slot  # (8: slot of 6 held,
    # slot of 7 held by tok)
    assert 0 < sum(in_slot[8:]) < 8, in_slot
    for step, ((a, al), (b, bl)) in enumerate(zip(want, got)):
        assert torch.equal(a, b), step
        if al is not None:
            assert torch.equal(al[0], bl[0]) and torch.equal(al[1], bl[1]), step


@pytest.mark.parametrize("kw", [dict(), dict(return_logprobs=True), dict(top_p=0.9),
                                dict(num_samples=2)])
def test_calls_with_out_equal_calls_without(kw, monkeypatch):
    """out= through every path a decode loop takes (recorded, re-issued, the graph's
    capture, the memo), with the same out each step, then two outs taking turns (the graph
    recaptured with out copied after the replay), then an out one element into its buffer
    (not 16-byte aligned: copied): each call returns its out holding the tokens of the same
    loop without out, and log-probs / log Z equal; a graph captured with the loop's out
    writes it itself."""
    from tpsample import api
    B = 24
    w, hs = head_and_states(4, B, 16, False)
    S = kw.get("num_samples", 1)
    shape = (B,) if S == 1 else (B, S)
    same = torch.empty(shape, dtype=torch.int64, device="cuda")
    turns = [torch.empty(shape, dtype=torch.int64, device="cuda") for _ in range(2)]
    odd = torch.empty(B * S + 1, dtype=torch.int64, device="cuda")[1:].view(shape)
    outs = [same] * 6 + [turns[i % 2] for i in range(6)] + [odd] * 4

    def run(with_out: bool):
        api._PIPELINES.clear()
        seed = torch.zeros(B, dtype=torch.int64, device="cuda")
        res = []
        for step, out in enumerate(outs):
            seed.fill_(step)
            r = tpsample.sample(hs[step % len(hs)], w, seed=seed, offset=step,
                                out=out if with_out else None, **kw)
            t = r if isinstance(r, torch.Tensor) else r.tokens
            if with_out:
                assert t is out, step
            res.append((t.clone(), None if isinstance(r, torch.Tensor) else r[1:3]))
            if with_out and step == 5:
                (pipe,) = api._PIPELINES.values()
                graph = pipe.last_graph[1]
                assert graph.sinks == {"tokens": ("out", False)}
                assert graph.outputs["tokens"] is same
        torch.cuda.synchronize()
        return res

    want, got = run(False), run(True)
    for step, ((a, al), (b, bl)) in enumerate(zip(want, got)):
        assert torch.equal(a, b), step
        if al is not None:
            assert torch.equal(al[0], bl[0]) and torch.equal(al[1], bl[1]), step


@pytest.mark.parametrize("kw", [dict(), dict(return_logprobs=True, top_p=0.9)])
def test_a_verification_loop_goes_through_the_call_memo(kw, monkeypatch):
    """verify_drafts at every step of a loop (new drafts and states, the step as an int
    offset, seed=None): its sampler call gets the same seed / offset tensors every call
    (verify._row_buffers), so the call memo serves it once its graph is captured; the
    outputs equal the same loop with TPSAMPLE_MEMO=0."""
    from tpsample import api, knobs
    B, S, D, V = 6, 3, 256, 5000
    g = torch.Generator(device="cuda").manual_seed(2)
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.1).bfloat16()
    hs = [torch.randn(B, S + 1, D, device="cuda", generator=g).bfloat16() for _ in range(8)]
    drafts = [torch.randint(0, V, (B, S), device="cuda", generator=g) for _ in range(8)]

    def run(memo: bool):
        monkeypatch.setattr(knobs, "MEMO", memo)
        api._PIPELINES.clear()
        torch.manual_seed(0)  # the drawn seeds
        hits = api._MEMO.hits
        outs = [tpsample.verify_drafts(h, w, d, offset=step, **kw)
                for step, (h, d) in enumerate(zip(hs, drafts))]
        torch.cuda.synchronize()
        return outs, api._MEMO.hits - hits

    (want, none), (got, hits) = run(False), run(True)
    assert none == 0 and hits >= 4
    for step, (a, b) in enumerate(zip(want, got)):
        for x, y in zip(a, b):  # (log-probs are NaN after the emitted tokens)
            assert (x is None and y is None) or torch.equal(x.nan_to_num(7.0),
                                                            y.nan_to_num(7.0)), step


def test_verify_drafts_kernels_and_their_replays_equal_the_torch_scan():
    """verify_drafts on CUDA (kernels/draft_scan.py around the sampler call; from the second
    call the two launches are re-issued through their recorded launchers) against the
    sampler's own tokens and the torch scan, over calls with new drafts, offsets and
    ragged drafts; and captured in a CUDA graph."""
    from tpsample import verify as VF
    B, S, D, V = 8, 4, 256, 5000
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(B, S + 1, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.1).bfloat16()
    seed = torch.arange(B, device="cuda") * 13 + 1
    for call in range(4):
        offset = torch.full((B,), call * 10, dtype=torch.int64, device="cuda")
        rows = h.reshape(-1, D)
        y = tpsample.sample(rows, w, seed=seed.repeat_interleave(S + 1),
                            offset=offset.repeat_interleave(S + 1)
                            + torch.arange(S + 1, device="cuda").repeat(B),
                            return_logprobs=True)
        keep = torch.arange(B, device="cuda") % (S + 1)
        draft = torch.where(torch.arange(S, device="cuda")[None, :] < keep[:, None],
                            y.tokens.view(B, S + 1)[:, :S], (y.tokens.view(B, S + 1)[:, :S] + 1) % V)
        draft[call % B, S - 1:] = -1
        n = (draft >= 0).cumprod(1).sum(1)
        ref = VF.scan(y.tokens.view(B, S + 1), y.logprobs.view(B, S + 1), draft, n)
        out = tpsample.verify_drafts(h, w, draft, seed=seed, offset=offset, return_logprobs=True)
        assert torch.equal(out.tokens, ref[0]) and torch.equal(out.num_accepted, ref[1]), call
        assert torch.equal(out.logprobs.isnan(), ref[2].isnan())
    from tpsample import replay
    assert VF._REPLAYS or not replay.Replay.usable()  # (calls 2-4 went through the replays)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = tpsample.verify_drafts(h, w, draft, seed=seed, offset=offset)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tpsample.verify_drafts(h, w, draft, seed=seed, offset=offset)
    graph.replay()
    assert torch.equal(captured.tokens, eager.tokens)


def test_verify_draft_probs_kernels_equal_the_torch_path():
    """verify_drafts with draft distributions at the LM head's vocabulary: the kernels'
    tokens and counts are the torch path's (verify.verify with kernels off), filtered and
    not, with greedy rows and ragged drafts."""
    from tpsample import verify as VF
    B, S, D, V = 16, 4, 1024, 151936
    g = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(B, S + 1, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, D, device="cuda", generator=g) / D ** 0.5 * 4).bfloat16()
    exact = torch.softmax(VF.logits_fp32(h[:, :S].reshape(-1, D), w), -1).view(B, S, V)
    top = torch.nn.functional.one_hot(exact.argmax(-1), V)
    q = torch.where((torch.arange(B, device="cuda") % 2 == 0)[:, None, None],
                    0.5 * top + 0.5 * exact, torch.softmax(torch.randn_like(exact), -1))
    draft = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, S)
    draft[3, 2:] = -1
    T = torch.where(torch.arange(B, device="cuda") % 5 == 0, 0.0, 1.0)
    for filt in (dict(), dict(top_p=0.9), dict(min_p=0.05, top_k=40)):
        outs = [VF.verify(h, draft, q, sample_rows=None, draft_logits=VF.local_logits(w, None, V),
                          draw_seed=None, vocab_size=V, temperature=T,
                          seed=torch.arange(B, device="cuda") + 1, offset=0,
                          top_k=filt.get("top_k"), top_p=filt.get("top_p"),
                          min_p=filt.get("min_p"), return_logprobs=True, kernels=kernels)
                for kernels in (False, True)]
        a, b = outs
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted), filt
        assert torch.allclose(a.logprobs.nan_to_num(), b.logprobs.nan_to_num(), atol=1e-4)
        assert int(a.num_accepted.max()) >= 2
