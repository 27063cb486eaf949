"""The pipeline's parts on the CPU: the spec it takes, the fallback choice, the host
fallback, and Pipeline.run against the reference (torch backend and interpreted kernels)."""
import types

import pytest
import torch

from tpsample import knobs
from tpsample import fallback_choice as FC
from tpsample import filters as F
from tpsample.host_fallback import redo_rows_on_host
from tpsample.pipeline import Pipeline
from tpsample.reference import reference_sample
from tpsample.spec import sampling_spec
from tpsample.transport import LocalTransport

ARGS = dict(temperature=1.0, seed=3, offset=0, num_samples=1, return_logprobs=False, top_k=None,
            top_p=None, min_p=None, top_logprobs=0, replacement=True, logprobs_mode="processed",
            allowed_mask=None, logit_adjust=None, repetition_penalty=None)


def spec_of(h, V, merge="max", **kw):
    return sampling_spec(h, vocab_size=V, rows=V, merge=merge, **dict(ARGS, **kw))


def test_spec_normalises_once_and_names_the_rows():
    """Scalars that switch a filter off become None (no kernel reads them); per-row tensors
    keep their values; greedy / filtered rows come from one definition."""
    B, V = 4, 50
    h = torch.zeros(B, 8)
    s = spec_of(h, V, top_k=0, top_p=1.0, min_p=0.0)
    assert s.filters.top_k is None and s.filters.top_p is None and s.filters.min_p is None
    assert not s.candidates and not s.constrained
    t = torch.tensor([0.0, 1.0, 0.5, 2.0])
    s = spec_of(h, V, temperature=t, top_p=torch.tensor([0.9, 0.9, 1.0, 0.5]))
    assert s.candidates
    assert s.greedy_rows().tolist() == [True, False, False, False]
    assert s.filtered_rows().tolist() == [False, True, False, True]
    s = spec_of(h, V, top_logprobs=3)  # candidates without a filter
    assert s.candidates and not s.filtered_rows().any()
    mask = torch.full((B, 2), -1, dtype=torch.int32)
    assert spec_of(h, V, allowed_mask=mask).constrained


@pytest.mark.parametrize("bad, match", [
    (dict(num_samples=0), "num_samples"), (dict(return_logprobs=1), "return_logprobs"),
    (dict(top_p=1.5), "top_p"), (dict(replacement=False, num_samples=2), "merge='max'"),
    (dict(temperature=-1.0), "temperature"), (dict(repetition_penalty=2.0), "logit_adjust")])
def test_spec_errors_name_the_argument(bad, match):
    h = torch.zeros(2, 8)
    merge = "logmass" if "replacement" in bad else "max"
    with pytest.raises((TypeError, ValueError), match=match):
        spec_of(h, 50, merge=merge, **bad)


class _Event:  # a CUDA event stand-in: complete once the test says so
    done = True

    def record(self):
        pass

    def query(self):
        return _Event.done

    def synchronize(self):
        pass


def test_deterministic_reads_switch_every_rank_at_the_same_call(monkeypatch):
    """Under TP the fallback path is decided from copies taken every `every` calls and read
    `lag` copies later, whatever the device's timing: the switch to the host path comes at
    a call fixed by when the count grew, and never earlier."""
    monkeypatch.setattr(FC.torch.cuda, "Event", _Event)
    choice = FC.FallbackChoice(torch.device("cpu"), deterministic=True)
    counter = choice.counter()
    hidden = types.SimpleNamespace(is_cuda=True)
    every, lag = FC.FALLBACK_READ_EVERY, FC.FALLBACK_READ_LAG
    paths = []
    for call in range(6 * every):
        paths.append(choice.device_now(hidden, in_capture=False))
        if call == every:  # rows start falling back at this call
            counter += 1
        choice.watch()
    switch = paths.index(False)
    # the copy taken at call 2*every-1 is the first to hold the growth; it is read
    # `lag` copies later
    assert switch == (2 + lag) * every
    assert all(paths[:switch]) and not any(paths[switch:])
    assert choice.device_now(hidden, in_capture=True)  # capture: always the device path


def test_deterministic_copies_are_read_even_when_no_call_asks_for_the_path(monkeypatch):
    """Under TP, calls on the cut's fast path (top-p / min-p) watch the count but never ask
    device_now: watch reads the copies itself, so they do not pile up, and a growth it read
    still sends the next call that asks to the host path."""
    monkeypatch.setattr(FC.torch.cuda, "Event", _Event)
    choice = FC.FallbackChoice(torch.device("cpu"), deterministic=True)
    counter = choice.counter()
    hidden = types.SimpleNamespace(is_cuda=True)
    every, lag = FC.FALLBACK_READ_EVERY, FC.FALLBACK_READ_LAG
    for call in range(50 * every):
        if call == every:
            counter += 1
        choice.watch()
        assert len(choice.reads.pending) <= lag
    assert len(choice.reads.spare) <= lag + 1  # (the copies and events are reused)
    assert not choice.device_now(hidden, False)


def test_local_choice_goes_to_the_host_once_the_count_grew(monkeypatch):
    monkeypatch.setattr(FC.torch.cuda, "Event", _Event)
    monkeypatch.setattr(FC, "LOCAL_READ_EVERY", 1)
    choice = FC.FallbackChoice(torch.device("cpu"), deterministic=False)
    counter = choice.counter()
    hidden = types.SimpleNamespace(is_cuda=True)
    assert choice.device_now(hidden, False)
    choice.watch()  # copies 0
    counter += 2
    assert choice.device_now(hidden, False)  # reads the copy taken before the growth
    choice.watch()  # copies 2
    assert not choice.device_now(hidden, False) and choice.host_mode


def test_one_device_copies_the_count_every_few_calls(monkeypatch):
    """A copy of the count and its event cost ~25 µs of host time: one device copies it at
    most every LOCAL_READ_EVERY-th call, and a growth is still seen by the calls after."""
    copies = []

    class Counted(_Event):
        def record(self):
            copies.append(1)
    monkeypatch.setattr(FC.torch.cuda, "Event", Counted)
    choice = FC.FallbackChoice(torch.device("cpu"), deterministic=False)
    counter = choice.counter()
    hidden = types.SimpleNamespace(is_cuda=True)
    every = FC.LOCAL_READ_EVERY
    assert every > 1
    paths = []
    for call in range(4 * every):
        paths.append(choice.device_now(hidden, False))
        if call == every + 1:
            counter += 1
        choice.watch()
    assert len(copies) == 4
    switch = paths.index(False)
    assert 2 * every <= switch <= 2 * every + 1 and not any(paths[switch:])


def test_side_output_goes_after_clean_calls_and_comes_back_on_a_flagged_row(monkeypatch):
    """The cut's fast path writes the side output until SIDE_LAZY_AFTER calls in a row saw
    no flagged row, skips it from then on, and writes it again from the call after the
    device count is seen to grow; such a miss doubles the wait (up to its cap). Inside a
    capture, under TP and with TPSAMPLE_LAZY_SIDE=0 it is always written."""
    monkeypatch.setattr(FC.torch.cuda, "Event", _Event)
    monkeypatch.setattr(knobs, "LAZY_SIDE", True)
    monkeypatch.setattr(FC, "SIDE_LAZY_AFTER", 4)
    monkeypatch.setattr(FC, "SIDE_LAZY_AFTER_MAX", 16)
    monkeypatch.setattr(FC, "LOCAL_READ_EVERY", 1)
    choice = FC.FallbackChoice(torch.device("cpu"), deterministic=False)
    counter = choice.counter()
    hidden = types.SimpleNamespace(is_cuda=True)

    def calls(n, flag_at=()):
        sides = []
        for i in range(n):
            sides.append(choice.side_output(hidden, False))
            if i in flag_at:
                counter.add_(1)
            choice.watch()
        return sides
    assert calls(6) == [True] * 4 + [False] * 2
    # a flagged row at the next call: seen by the call after it (the copy is read then)
    assert calls(3, flag_at=(0,)) == [False, True, True]
    assert choice.lazy_after == 8 and choice.clean_calls == 2
    assert calls(8) == [True] * 6 + [False] * 2
    for _ in range(3):  # misses double the wait up to SIDE_LAZY_AFTER_MAX
        calls(choice.lazy_after + 2)
        calls(2, flag_at=(0,))
    assert choice.lazy_after == 16
    side = choice.side
    assert choice.side_output(hidden, True)  # (inside a capture)
    monkeypatch.setattr(knobs, "LAZY_SIDE", False)
    assert choice.side_output(hidden, False) and choice.side == side
    tp = FC.FallbackChoice(torch.device("cpu"), deterministic=True)
    monkeypatch.setattr(knobs, "LAZY_SIDE", True)
    assert all(tp.side_output(hidden, False) for _ in range(10))
    assert FC.FallbackChoice(torch.device("cpu"), False).side_output(
        types.SimpleNamespace(is_cuda=False), False)


def test_the_cut_path_rows_bring_the_side_output_back_but_not_the_host_path(monkeypatch):
    """One device: the per-row path's count (counter()[0]) sends the next calls that ask to
    the host; the cut's count ([1]) only brings the side output back."""
    monkeypatch.setattr(FC.torch.cuda, "Event", _Event)
    monkeypatch.setattr(knobs, "LAZY_SIDE", True)
    monkeypatch.setattr(FC, "SIDE_LAZY_AFTER", 2)
    monkeypatch.setattr(FC, "LOCAL_READ_EVERY", 1)
    hidden = types.SimpleNamespace(is_cuda=True)
    choice = FC.FallbackChoice(torch.device("cpu"), deterministic=False)
    counter = choice.counter()
    assert counter.shape == (2,) and counter.dtype == torch.int32

    def call(grow=None):
        side = choice.side_output(hidden, False)
        device = choice.device_now(hidden, False)
        if grow is not None:
            counter[grow] += 1
        choice.watch()
        return side, device
    assert [call() for _ in range(4)][-1] == (False, True)  # (lazy after 2 clean calls)
    call(grow=1)
    assert call() == (True, True) and not choice.host_mode  # the cut's rows: side output
    call(grow=0)
    call()
    assert choice.host_mode and choice.side  # the per-row path's rows: the host


def test_a_forgotten_choice_starts_over_on_the_same_count(monkeypatch):
    """forget() (the sweep's reset between cells): the device path, the side output and the
    first wait again, while the count that captured graphs add to stays the same tensor and
    a growth before the reset is not taken for one after it."""
    monkeypatch.setattr(FC.torch.cuda, "Event", _Event)
    monkeypatch.setattr(knobs, "LAZY_SIDE", True)
    monkeypatch.setattr(FC, "SIDE_LAZY_AFTER", 2)
    monkeypatch.setattr(FC, "LOCAL_READ_EVERY", 1)
    hidden = types.SimpleNamespace(is_cuda=True)
    for deterministic in (False, True):
        choice = FC.FallbackChoice(torch.device("cpu"), deterministic=deterministic)
        counter = choice.counter()
        for _ in range(3):
            choice.side_output(hidden, False)
            choice.watch()
        counter += 1
        choice.watch()  # (a copy of the growth still unread)
        for _ in range((FC.FALLBACK_READ_LAG + 2) * FC.FALLBACK_READ_EVERY):
            choice.device_now(hidden, False)
            choice.watch()
        assert choice.host_mode
        choice.forget()
        assert choice.counter() is counter and not choice.host_mode
        assert choice.lazy_after == 2 and choice.clean_calls == 0
        paths = []
        for _ in range((FC.FALLBACK_READ_LAG + 2) * FC.FALLBACK_READ_EVERY):
            paths.append((choice.device_now(hidden, False), choice.side_output(hidden, False)))
            choice.watch()
        assert all(device for device, _ in paths)
        if not deterministic:
            assert [side for _, side in paths[:4]] == [True, True, False, False]


def test_host_fallback_redoes_exactly_the_flagged_rows():
    """redo_rows_on_host rewrites the flagged rows with the full-row semantics and leaves the
    others as stage 2 wrote them."""
    torch.manual_seed(0)
    B, D, V, S = 6, 16, 300, 1
    h, w = torch.randn(B, D), torch.randn(V, D)
    spec = spec_of(h, V, top_p=0.8, seed=torch.arange(B), temperature=1.3)
    ref = reference_sample(h, w, temperature=1.3, seed=torch.arange(B), top_p=0.8)
    flags = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.int32)
    out = F.FilteredOutput(torch.full((B, S), -7), torch.zeros(B, S), torch.zeros(B),
                           torch.empty(B, 0, dtype=torch.int64), torch.empty(B, 0), flags,
                           torch.empty(B, 1, dtype=torch.int64))
    T = -(-V // 128)
    tokens, logprobs, logz, top, redone = redo_rows_on_host(
        out, LocalTransport(h.device), h, w, None, spec.row, spec.filters, V, 0, T, S)
    assert redone == 3 and top is None
    rows = flags.bool()
    assert torch.equal(tokens[rows], ref.tokens[rows]) and (tokens[~rows] == -7).all()
    assert torch.allclose(logz[rows].double(), ref.logz[rows], atol=1e-4)


@pytest.mark.parametrize("top_k, stays", [(3, False), (200, True)])
def test_the_host_path_ends_once_no_row_needs_the_per_row_path(top_k, stays):
    """A call in host mode hands the device path back once none of its flagged rows would
    take the one-program-per-row kernels (the reason for the host path): flat top-p rows
    without a top-k (the cut's fast path) do not keep it on the host; a top-k row past the
    candidates does."""
    torch.manual_seed(3)
    B, D, V = 4, 16, 300
    h, w = torch.randn(B, D) * 0.01, torch.randn(V, D)  # (near-flat rows: top-p flags them)
    k = torch.tensor([0, 0, top_k, 0])
    spec = spec_of(h, V, top_k=k, top_p=0.5, seed=torch.arange(B))
    fast = F.cut_path_rows(spec.filters, spec.row.inv_temp)
    assert fast.tolist() == [True, True, False, True]
    pipe = Pipeline("torch", h.device)
    pipe.fallback.host_mode = True
    pipe.run(h, w, None, spec, n_real=V, need_mass=True)
    assert pipe.host_fallback_rows == (4 if stays else 3)  # (every flat top-p row, and the
    assert pipe.fallback.host_mode == stays  # top-k 200 row past the 12 candidates)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kw", [dict(), dict(top_k=20, top_p=0.9), dict(min_p=0.2, num_samples=2)])
def test_run_equals_the_reference(backend, kw, monkeypatch):
    """Pipeline.run on a spec: the reference's tokens (torch path; interpreted kernels)."""
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(1)
    B, D, V = 3, 16, 260
    h, w = torch.randn(B, D), torch.randn(V, D)
    seed = torch.tensor([5, 6, 7])
    spec = spec_of(h, V, seed=seed, return_logprobs=True, **kw)
    tokens, logprobs, logz, _ = Pipeline(backend, h.device).run(h, w, None, spec, n_real=V,
                                                                need_mass=True)
    ref = reference_sample(h, w, seed=seed, **kw)
    assert torch.equal(tokens.view(B, -1), ref.tokens)
    assert torch.allclose(logz.double(), ref.logz, atol=1e-4)


def test_call_graphs_bind_what_comes_again_and_copy_the_rest():
    """CallGraphs.due: no capture before the key's CAPTURE_AT-th replayed call; then bound =
    the tensors that were the same objects at the call before; a weight that changed is
    never copied (no graph); a key stops capturing after MAX_CAPTURES."""
    from tpsample import call_graphs as CG
    graphs = CG.CallGraphs(torch.device("cpu"))
    w, seed = torch.zeros(4, 2), torch.zeros(3, dtype=torch.int64)
    calls = [dict(hidden=torch.zeros(3, 2), seed=seed, bias=None, weight=w)
             for _ in range(CG.CAPTURE_AT)]
    for c in calls[:-1]:
        assert graphs.due("k", c) is None
    assert graphs.due("k", calls[-1]) == frozenset({"seed", "weight"})
    other = [dict(c, weight=torch.zeros(4, 2)) for c in calls]  # a new weight object each call
    for c in other[:-1]:
        assert graphs.due("k2", c) is None
    assert graphs.due("k2", other[-1]) is None and graphs.captures["k2"] == 1
    graphs.captures["k3"] = CG.MAX_CAPTURES
    assert all(graphs.due("k3", c) is None for c in calls * 2)


def test_call_graphs_never_bind_a_tensor_freed_after_its_call():
    """Seeds drawn per call are new tensors, each freed after its call: the next one may
    take the freed one's id, but it is another object and must be copied, not bound."""
    from tpsample import call_graphs as CG
    graphs = CG.CallGraphs(torch.device("cpu"))
    w = torch.zeros(4, 2)
    bound = None
    for _ in range(CG.CAPTURE_AT):
        bound = graphs.due("k", dict(seed=torch.zeros(3, dtype=torch.int64), weight=w))
    assert bound == frozenset({"weight"})


def test_call_graphs_copy_a_name_whose_bound_tensor_moved():
    """A graph dropped because its bound seed moved: the key's next capture copies the
    seed, whatever the calls before it pass."""
    from tpsample import call_graphs as CG
    graphs = CG.CallGraphs(torch.device("cpu"))
    w, seed = torch.zeros(4, 2), torch.zeros(3, dtype=torch.int64)
    call = dict(seed=seed, weight=w)
    for _ in range(CG.CAPTURE_AT):
        bound = graphs.due("k", call)
    assert bound == frozenset({"seed", "weight"})
    g = CG.CallGraph()
    g.bound, g.bound_ptrs, g.live = ("seed", "weight"), (seed.data_ptr(), w.data_ptr()), True
    graphs.graphs["k"] = g
    graphs.drop("k", g, dict(seed=seed.clone(), weight=w))
    assert not g.live and "k" not in graphs.graphs and graphs.moved["k"] == {"seed"}
    for _ in range(CG.CAPTURE_AT):
        bound = graphs.due("k", call)
    assert bound == frozenset({"weight"})


def test_call_graph_replays_with_copies_and_returns_fresh_outputs():
    """CallGraph.__call__: a bound tensor at another address → None (no replay); else
    the copied inputs take this call's values before the replay, and the outputs come back
    as clones."""
    import threading
    from tpsample.call_graphs import CallGraph
    seed, h = torch.zeros(2, dtype=torch.int64), torch.zeros(2, 3)
    g = CallGraph()
    g.inputs, g.bound, g.copied = dict(seed=seed, hidden=h.clone()), ("seed",), ("hidden",)
    g.bound_ptrs = (seed.data_ptr(),)
    g.outputs = dict(tokens=torch.zeros(2, dtype=torch.int64))
    g.lock = threading.Lock()
    replays = []

    class Graph:
        def replay(self):  # the "kernel": tokens = hidden's row sums + seed
            replays.append(1)
            g.outputs["tokens"].copy_(g.inputs["hidden"].sum(1).long() + g.inputs["seed"])
    g.graph = Graph()
    assert g(dict(seed=seed.clone(), hidden=h), ("tokens",)) is None and not replays
    seed.fill_(10)
    a = g(dict(seed=seed, hidden=torch.ones(2, 3)), ("tokens",))["tokens"]
    b = g(dict(seed=seed, hidden=torch.full((2, 3), 2.0)), ("tokens",))["tokens"]
    assert a.tolist() == [13, 13] and b.tolist() == [16, 16] and len(replays) == 2


def test_call_graph_returns_a_slots_outputs_only_while_nothing_else_holds_them():
    """CallGraph.run with output slots (call_graphs.Slot): a call replays the first slot
    none of whose outputs a tensor outside it refers to and returns them (no clone); a held
    result, a view of one, or one held output (log Z) keeps its slot from being replayed;
    with every slot held the first graph runs and the call returns clones. Each held result
    keeps its own call's values."""
    import threading
    from tpsample import call_graphs as CG
    h = torch.zeros(2, 3)
    g = CG.CallGraph()
    g.inputs, g.bound, g.bound_ptrs, g.copied = dict(hidden=h.clone()), (), (), ("hidden",)
    g.lock = threading.Lock()
    ran = []

    def outputs():
        return dict(tokens=torch.zeros(2, dtype=torch.int64), logz=torch.zeros(2))

    class Graph:  # the "kernel": tokens = hidden's row sums, log Z = their half
        def __init__(self, outputs, name):
            self.outputs, self.name = outputs, name

        def replay(self):
            ran.append(self.name)
            self.outputs["tokens"].copy_(g.inputs["hidden"].sum(1).long())
            self.outputs["logz"].copy_(g.inputs["hidden"].sum(1) / 2)
    g.outputs = outputs()
    g.graph = Graph(g.outputs, "first")
    slots = []
    for k in range(2):
        slot = CG.Slot()
        slot.outputs = outputs()
        slot.graph = Graph(slot.outputs, k)
        slot.own = frozenset(slot.outputs)
        slot.storages = tuple(t.untyped_storage() for t in slot.outputs.values())
        slot.idle = tuple(CG._use_count(st._cdata) for st in slot.storages)
        slots.append(slot)
    g.slots = tuple(slots)

    def call(v):
        out = g(dict(hidden=torch.full((2, 3), float(v))), ("tokens", "logz"))
        return out["tokens"], out["logz"]

    def mem(t):
        return t.untyped_storage().data_ptr()
    a = call(1)  # slot 0
    b = call(2)  # slot 1 (a holds slot 0)
    c = call(3)  # both held: the first graph, clones
    assert ran == [0, 1, "first"]
    assert [mem(t) for t in a] == [mem(t) for t in slots[0].outputs.values()]
    assert [mem(t) for t in b] == [mem(t) for t in slots[1].outputs.values()]
    assert not {mem(t) for t in c} & {mem(t) for t in (*a, *b, *g.outputs.values())}
    assert [t.tolist() for t in (*a, *b, *c)] == [[3, 3], [1.5, 1.5], [6, 6], [3.0, 3.0],
                                                  [9, 9], [4.5, 4.5]]
    view, logz = b[0][:1], a[1]
    del a, b
    d = call(4)  # slot 0's log Z held, slot 1's tokens through a view: clones
    assert ran[3:] == ["first"]
    del logz
    e = call(5)  # slot 0 again
    assert ran[4:] == [0]
    assert view.tolist() == [6] and d[0].tolist() == [12, 12] and e[0].tolist() == [15, 15]
    del view
    assert call(6)[0].tolist() == [18, 18] and ran[-1] == 1


@pytest.mark.parametrize("copied", [False, True])
def test_call_graph_writes_the_tokens_into_the_callers_out(copied):
    """A graph captured with the caller's out (call_graphs.SINKS): bound, the graph's tokens
    output is that tensor and the call returns it, no clone, no copy; copied (captured with
    another out), the graph writes its own tensor and the call copies it into this call's
    out after the replay, never before."""
    from tpsample.call_graphs import CallGraph
    given, h = torch.full((2,), -1, dtype=torch.int64), torch.zeros(2, 3)
    g = CallGraph()
    own = torch.zeros(2, dtype=torch.int64)
    g.inputs = dict(hidden=h, out=own if copied else given)
    g.bound = ("hidden",) if copied else ("hidden", "out")
    g.bound_ptrs = tuple(g.inputs[n].data_ptr() for n in g.bound)
    g.copied = ("out",) if copied else ()
    g.outputs = dict(tokens=g.inputs["out"])
    g.sinks = {"tokens": ("out", copied)}
    seen = []

    class Graph:
        def replay(self):  # the "kernel": tokens = 5; what out held before is recorded
            seen.append(g.outputs["tokens"].tolist())
            g.outputs["tokens"].fill_(5)
    g.graph = Graph()
    res = g(dict(hidden=h, out=given), ("tokens",))
    assert res["tokens"] is given and given.tolist() == [5, 5]
    assert seen == [[0, 0] if copied else [-1, -1]]  # (a copied out is not read in)


@pytest.mark.parametrize("kw", [dict(), dict(top_p=0.9)])
def test_stage1_gets_the_peers_of_the_grown_buffer(kw, monkeypatch):
    """A call larger than the exchange buffer grows it (new peer addresses): stage 1 must
    store through the grown buffer's fanout, so the slots are taken before the fanout is
    read (plain and filtered calls)."""
    from tpsample import filtered_calls as FCALLS, pipeline as PL
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    class Growing(LocalTransport):  # a persistent buffer whose peers move when it grows
        def __init__(self):
            super().__init__(torch.device("cpu"))
            self.rank, self.world, self.version = 0, 2, 0

        def slots(self, numel):
            if numel > self.capacity:
                self.capacity, self.version = numel, self.version + 1
            buf = torch.zeros(self.world, numel)
            return buf[0], buf

        def fanout(self):
            return (f"peers of buffer {self.version}", None, None)

        def key(self):
            return (self.version,)

    seen = []

    class Stop(Exception):
        pass

    def spy(*a, fanout=None, **k):
        seen.append(fanout[0])
        raise Stop
    monkeypatch.setattr(PL, "stage1_constrained", spy)
    monkeypatch.setattr(FCALLS, "stage1_constrained", spy)
    t = Growing()
    h, w = torch.randn(2, 16), torch.randn(260, 16)
    with pytest.raises(Stop):
        Pipeline("triton", h.device, transport=t).run(h, w, None, spec_of(h, 260, **kw),
                                                      n_real=260, need_mass=True)
    assert seen == [f"peers of buffer {t.version}"] and t.version == 1


class _Tape:
    """A CUDA graph stand-in on the CPU: launches made while capturing are recorded and
    re-run by replay(), as the GPU would re-run the captured kernels."""
    capturing = None

    def __init__(self):
        self.tape = []

    def capture_begin(self, pool=None, capture_error_mode=None):
        _Tape.capturing = self.tape

    def pool(self):
        return id(self)

    def capture_end(self):
        _Tape.capturing = None

    def replay(self):
        for work in self.tape:
            work()


def _launch(work):
    if _Tape.capturing is not None:
        _Tape.capturing.append(work)
    else:
        work()


def _fake_cuda(monkeypatch):
    import contextlib

    class Stream:
        cuda_stream = 7

        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Tape)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


def _want(h, seed, offset):  # the fake kernels' result
    return h.sum(1).long() + seed + offset


def test_plain_call_graph_wiring(monkeypatch):
    """Pipeline._graph_call with CallGraphs on fake kernels and a fake graph: no graph before
    CAPTURE_AT calls, then replays that see each call's new hidden states (copied) and the
    seed tensor updated in place (bound), fresh outputs per call; another seed object goes
    back to re-issued launches and drops the graph."""
    from tpsample import call_graphs as CG
    _fake_cuda(monkeypatch)
    B, S, numel = 4, 1, 64
    pipe = Pipeline("triton", torch.device("cpu"))
    pipe.graphs = CG.CallGraphs(torch.device("cpu"))

    def stage1(stream, records, hidden, seed, offset, **_):
        _launch(lambda: records.view(-1)[:B].copy_((hidden.sum(1).long() + seed + offset).float()))

    def stage2(stream, records, tokens, logprobs, logz, **_):
        _launch(lambda: (tokens.copy_(records.view(-1)[:B].long()),
                         logz.copy_(records.view(-1)[:B] * 2)))
    seed, offset = torch.zeros(B, dtype=torch.int64), torch.full((B,), 3)
    got, want = [], []
    for i in range(CG.CAPTURE_AT + 3):
        h = torch.full((B, 2), float(i)) + torch.arange(B)[:, None]
        seed.fill_(10 * i)
        call = dict(hidden=h, inv_temp=None, seed=seed, offset=offset, bias=None)
        out = pipe._graph_call("k", call, ("tokens", "logz"), stage1, stage2, (numel, B, S))
        assert (out is None) == (i < CG.CAPTURE_AT - 1), i
        if out is not None:
            got.append(out)
            want.append(_want(h, seed, offset))
    assert all(torch.equal(o["tokens"], w) and torch.equal(o["logz"], 2 * w.float())
               for o, w in zip(got, want))
    graph = pipe.graphs.get("k")
    assert graph.bound == ("seed", "offset") and graph.copied == ("hidden",)
    assert len({o["tokens"].data_ptr() for o in got} | {graph.outputs["tokens"].data_ptr()}) \
        == len(got) + 1
    # the first two replays return the output slots' tokens and log Z (each call's result
    # is held in got), the later ones clones of the first graph's
    assert len(graph.slots) == CG.OUTPUT_SLOTS == 2
    assert all(s.own == {"tokens", "logprobs", "logz"} for s in graph.slots)
    for name in ("tokens", "logz"):
        assert [o[name].data_ptr() for o in got[:2]] == \
            [s.outputs[name].data_ptr() for s in graph.slots]
        assert not {o[name].data_ptr() for o in got[2:]} & \
            {s.outputs[name].data_ptr() for s in graph.slots}
    call = dict(call, seed=seed.clone())
    assert pipe._graph_call("k", call, ("tokens",), stage1, stage2, (numel, B, S)) is None
    assert pipe.graphs.get("k") is None


def test_filtered_call_graph_wiring(monkeypatch):
    """Pipeline._filtered_graph_call: captured only from a recorded stage 2 of the same
    layout (the key2 re-issued launches would take), then each replay sees the call's
    inputs and the filters' tensors; the side output is the graph's own."""
    from tpsample import call_graphs as CG
    _fake_cuda(monkeypatch)
    B, S, T = 4, 1, 2
    n, numel = T * 128, 256
    pipe = Pipeline("triton", torch.device("cpu"))
    pipe.graphs = CG.CallGraphs(torch.device("cpu"))
    filters = spec_of(torch.zeros(B, 2), 300, top_p=0.9).filters
    sides = []

    def stage1(stream, records, side, hidden, seed, offset, **_):
        sides.append(side)
        _launch(lambda: (side[:, 0].copy_(hidden.sum(1)),
                         records.view(-1)[:B].copy_((hidden.sum(1).long() + seed + offset)
                                                    .float())))

    def stage2(stream, records, side, tokens, logprobs, logz, top_p, **_):
        _launch(lambda: (tokens.copy_(records.view(-1)[:B].long() + side[:, 0].long() * 0),
                         logprobs.copy_(top_p)))
    seed, offset = torch.zeros(B, dtype=torch.int64), torch.full((B,), 3)
    base = dict(inv_temp=None, seed=seed, offset=offset, bias=None)
    later = dict(top_k=None, top_p=filters.top_p, min_p=None)
    monkeypatch.setattr(knobs, "FALLBACK_GATE", True)
    pipe._with_gate(later)  # (a one-device call with a side output: the stream's gate)
    assert later["gate"] is pipe.gates.get(None)
    gated = []
    capture = pipe.graphs.capture
    monkeypatch.setattr(pipe.graphs, "capture", lambda *a, **k: (gated.append(k.get("gated")),
                                                                  capture(*a, **k))[1])
    for i in range(CG.CAPTURE_AT + 2):
        h = torch.full((B, 2), float(i))
        seed.fill_(i)
        call = dict(hidden=h, **base)
        key2 = pipe._key2(True, filters, dict(call, side=torch.empty(B, n)), later, True)
        out = pipe._filtered_graph_call("k", stage1, {key2: stage2}, call, filters, True, B, S,
                                        T, numel, 0, True)
        assert (out is None) == (i < CG.CAPTURE_AT - 1), i
        if out is not None:
            assert torch.equal(out.tokens, _want(h, seed, offset)), i
            assert torch.equal(out.logprobs, filters.top_p) and out.top_tokens is None
    # captured once (its node prepared: the launches hold the gate's steps), and once per
    # output slot, each capture with its own side output
    assert gated == [True]
    assert len(sides) == 1 + CG.OUTPUT_SLOTS and all(x is not None for x in sides)
    assert len({x.data_ptr() for x in sides}) == len(sides)
    # a stage 2 of another layout was never recorded: no graph for that key
    assert pipe._filtered_graph_call("k2", stage1, {}, call, filters, True, B, S, T, numel,
                                     0, True) is None


def test_a_failed_capture_warns_once_and_the_key_keeps_its_launches(monkeypatch):
    from tpsample import call_graphs as CG
    _fake_cuda(monkeypatch)

    class Broken(_Tape):
        def capture_begin(self, capture_error_mode=None):
            raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Broken)
    graphs = CG.CallGraphs(torch.device("cpu"))
    call = dict(seed=torch.zeros(2, dtype=torch.int64))
    with pytest.warns(RuntimeWarning, match="capture of a repeated call failed"):
        assert graphs.capture("k", call, frozenset({"seed"}), lambda stream, named: {}) is None
    assert all(graphs.due("k", call) is None for _ in range(2 * CG.CAPTURE_AT))


def test_a_capture_whose_conditional_node_fails_is_taken_again_without_it(monkeypatch):
    """A driver or torch that cannot capture the fallback's conditional node
    (tpsample/fallback_gate.py): one warning, the node off for the process, and the same
    capture again without it (the key gets its graph); a capture that fails without a node
    is given up as before."""
    from tpsample import call_graphs as CG
    from tpsample import fallback_gate
    _fake_cuda(monkeypatch)
    monkeypatch.setattr(fallback_gate, "available", lambda: None)
    monkeypatch.setattr(fallback_gate, "FAILED", None)
    monkeypatch.setattr(knobs, "FALLBACK_GATE", True)
    capturing = fallback_gate.capturing  # (as on a GPU: this test's graphs are on the CPU)
    monkeypatch.setattr(fallback_gate, "capturing",
                        lambda device: capturing(torch.device("cuda", 0)))

    class NoNodes:
        def __init__(self, device):
            pass

        def __call__(self, gate):
            class Node:
                def enter(self):
                    raise RuntimeError("conditional nodes not supported")
            return Node()
    monkeypatch.setattr(fallback_gate, "NodeMaker", NoNodes)

    class Gate:
        is_cuda = True
    gate = Gate()
    opened = []

    def launch(stream, named, outputs=None):
        opened.append(fallback_gate.open_body(gate) is gate)
        fallback_gate.close_body(gate)
        return {}
    graphs = CG.CallGraphs(torch.device("cpu"))
    call = dict(seed=torch.zeros(2, dtype=torch.int64))
    with pytest.warns(RuntimeWarning, match="conditional node failed"):
        assert graphs.capture("k", call, frozenset({"seed"}), launch) is not None
    assert fallback_gate.FAILED is not None and opened[:2] == [True, True]
    assert graphs.captures["k"] == 1

    def broken(stream, named, outputs=None):
        raise RuntimeError("not the node")
    with pytest.warns(RuntimeWarning, match="capture of a repeated call failed"):
        assert graphs.capture("k2", call, frozenset({"seed"}), broken) is None
