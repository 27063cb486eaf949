"""tpsample/call_memo.py on the CPU: which calls have a signature, which are kept, when a
kept entry stops applying, and what a hit replays (the graph is CallGraph with a stand-in
for the CUDA graph; the GPU tests compare the memo's tokens with the full path's)."""
import ast
import inspect
import textwrap
import threading

import pytest
import torch

import tpsample
from tpsample import call_memo as CM
from tpsample import knobs
from tpsample.call_graphs import CallGraph, CallGraphs
from tpsample.drawn_seeds import row_seed
from tpsample.parallel import VocabParallelSampler
from tpsample.spec import sampling_spec

B, D, V = 3, 4, 50
SCALARS = (1.0, None, 1, "max", False, None, None, None, 0, True, "processed", None, None,
           None, "auto")  # sample()'s arguments after hidden, weight, bias, seed, offset


def spec_of(h, **kw):
    args = dict(temperature=1.0, seed=None, offset=0, num_samples=1, return_logprobs=False,
                top_k=None, top_p=None, min_p=None, top_logprobs=0, replacement=True,
                logprobs_mode="processed", allowed_mask=None, logit_adjust=None,
                repetition_penalty=None)
    args.update(kw)
    return sampling_spec(h, vocab_size=V, rows=V, merge="max", in_capture=False, **args)


class Fallback:
    def __init__(self):
        self.watched = 0
        self.asked = 0
        self.on_device = True

    def watch(self):
        self.watched += 1

    def device_now(self, hidden, in_capture):
        self.asked += 1
        return self.on_device


class Transport:
    def __init__(self):
        self.buffers = 0

    def key(self):
        return (self.buffers,)


class Pipe:
    """What the memo reads of a Pipeline, around a real CallGraph whose CUDA graph is a
    stand-in: tokens = the row sums of hidden + seed + offset."""

    def __init__(self, bound=("weight",)):
        self.device = torch.device("cpu")
        self.graphs = CallGraphs(self.device)
        self.transport = Transport()
        self.fallback = Fallback()
        self.candidate_rows = 0
        self.bound = bound

    def graph_call(self, tensors: dict, filtered: bool = False, asks=None):
        """As Pipeline._graph_call after a capture: the graph kept under a key, replayed,
        and last_graph set."""
        g = CallGraph()
        g.lock, g.live = threading.Lock(), True
        g.bound = tuple(n for n in self.bound if tensors.get(n) is not None)
        g.bound_ptrs = tuple(tensors[n].data_ptr() for n in g.bound)
        g.copied = tuple(n for n, t in tensors.items() if t is not None and n not in g.bound)
        g.inputs = {n: (t if n in g.bound or t is None else t.clone()) for n, t in tensors.items()}
        g.outputs = dict(tokens=torch.zeros(tensors["hidden"].shape[0], dtype=torch.int64))
        if tensors.get("out") is not None:  # (as a capture with out=: the tokens go there)
            g.outputs["tokens"] = g.inputs["out"]
            g.sinks = {"tokens": ("out", "out" in g.copied)}
        self.replays = 0

        class Graph:
            def replay(inner):
                self.replays += 1
                i = g.inputs
                g.outputs["tokens"].copy_(i["hidden"].sum(1).long() + i["seed"] + i["offset"])
        g.graph = Graph()
        key = ("key", len(self.graphs.graphs))
        self.graphs.graphs[key] = g
        out = self.graphs.replay(key, g, tensors, ("tokens",))
        self.last_graph = (key, g, tensors, ("tokens",), filtered, asks)
        return out


@pytest.fixture
def cpu_memo(monkeypatch):
    """The memo's CUDA queries answered as on an idle GPU's default stream."""
    monkeypatch.setattr(CM, "current_stream", lambda index: 7)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(knobs, "MEMO", True)
    monkeypatch.setattr(knobs, "GRAPHS", True)
    monkeypatch.setattr(knobs, "GRAPHS_FILTERED", True)
    return CM.CallMemo()


def stored(memo, seed=None, offset=5, bias=None, filtered=False, bound=("weight",), out=None,
           asks=None, **kw):
    """A memo holding one call (hidden [B, D] of ones) that went through its graph."""
    h, w = torch.ones(B, D), torch.zeros(V, D)
    spec = spec_of(h, seed=1 if seed is None else seed, offset=offset, **kw)
    pipe = Pipe(bound)
    tensors = dict(hidden=h, inv_temp=spec.row.inv_temp, seed=spec.row.seed,
                   offset=spec.row.offset, bias=bias, weight=w)
    if out is not None:
        tensors["out"] = out
    pipe.graph_call(tensors, filtered, asks)
    sig = CM.signature(h, w, bias, seed, offset, SCALARS, out)
    draws = []

    def draw(device):  # (a base: the graph's input gets drawn_seeds.row_seeds(base, B))
        draws.append(device)
        return 100 * len(draws)
    memo.store(sig, pipe, spec, seed, offset, bias, bias, draw, out)
    return sig, pipe, w, draws


def test_signature_keys_what_the_full_path_would_validate_the_same_way():
    h, w = torch.ones(B, D), torch.zeros(V, D)
    seed, off = torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
    sig = CM.signature(h, w, None, 3, 7, SCALARS)
    assert sig == CM.signature(torch.zeros(B, D), w, None, 3, 8, SCALARS)  # new h, int step
    assert sig != CM.signature(h, w, None, 4, 7, SCALARS)  # an int seed by value
    assert sig != CM.signature(h.double(), w, None, 3, 7, SCALARS)
    assert sig != CM.signature(torch.ones(B + 1, D), w, None, 3, 7, SCALARS)
    assert sig != CM.signature(h, w.clone(), None, 3, 7, SCALARS)  # the weight by identity
    assert CM.signature(h, w, None, seed, off, SCALARS) != CM.signature(
        h, w, None, seed.clone(), off, SCALARS)  # seed / offset tensors by identity
    assert sig != CM.signature(h, w, None, True, 7, SCALARS)  # True is not the seed 1
    assert sig != CM.signature(h, w, None, 3, 7, (True,) + SCALARS[1:])  # nor temperature 1
    assert sig != CM.signature(h, w, None, 3, 7, (1,) + SCALARS[1:])  # 1 is not 1.0
    # a tensor among the scalars (its contents are checked per call), a container, a
    # non-contiguous hidden, a seed or offset of another type: no signature
    assert CM.signature(h, w, None, 3, 7, (torch.ones(B),) + SCALARS[1:]) is None
    assert CM.signature(h, w, None, 3, 7, SCALARS[:-3] + ((seed, off), None, "auto")) is None
    assert CM.signature(torch.ones(D, B).T, w, None, 3, 7, SCALARS) is None
    assert CM.signature(h, w, None, 3.0, 7, SCALARS) is None
    assert CM.signature(h, w, None, 3, [7], SCALARS) is None
    out = torch.zeros(B, dtype=torch.int64)  # out= by identity
    with_out = CM.signature(h, w, None, 3, 7, SCALARS, out)
    assert with_out != sig and with_out == CM.signature(h, w, None, 3, 8, SCALARS, out)
    assert with_out != CM.signature(h, w, None, 3, 7, SCALARS, out.clone())


def test_a_hit_replays_the_graph_with_this_calls_hidden_offset_and_seeds(cpu_memo):
    sig, pipe, _, draws = stored(cpu_memo)  # seed None: drawn; int offset
    assert len(cpu_memo.entries) == 1 and pipe.replays == 1
    h = torch.full((B, D), 2.0)
    tokens = cpu_memo.call(sig, h, None, 9)
    assert draws == [pipe.device] and cpu_memo.hits == 1 and pipe.replays == 2
    # row sums 8, the seeds drawn from base 100, offset 9
    assert tokens.tolist() == [8 + row_seed(100, b) + 9 for b in range(B)]
    again = cpu_memo.call(sig, h, None, 10)
    assert again.tolist() == [8 + row_seed(200, b) + 10 for b in range(B)]
    assert again.data_ptr() != tokens.data_ptr()
    # the offset and the seeds written into the graph's own inputs, not bound
    assert pipe.graphs.graphs and set(next(iter(pipe.graphs.graphs.values())).copied) >= {
        "hidden", "seed", "offset"}
    assert pipe.fallback.watched == 0 and pipe.candidate_rows == 0


@pytest.mark.parametrize("copied", [False, True])
def test_a_hit_with_out_returns_it_holding_the_tokens(cpu_memo, copied):
    """A memoised call with out=: the graph's tokens go into that tensor (bound: the graph
    writes it; copied: after the replay) and the call returns it, no clone."""
    out = torch.full((B,), -1, dtype=torch.int64)
    sig, pipe, _, _ = stored(cpu_memo, out=out,
                             bound=("weight",) if copied else ("weight", "out"))
    graph = next(iter(pipe.graphs.graphs.values()))
    assert graph.sinks == {"tokens": ("out", copied)}
    res = cpu_memo.call(sig, torch.full((B, D), 2.0), None, 9)
    assert res is out and out.tolist() == [8 + row_seed(100, b) + 9 for b in range(B)]
    assert cpu_memo.hits == 1


def test_a_filtered_hit_counts_and_watches_as_the_full_path(cpu_memo):
    sig, pipe, _, _ = stored(cpu_memo, filtered=True, top_p=0.9)
    assert cpu_memo.call(sig, torch.ones(B, D), None, 5) is not None
    assert pipe.fallback.watched == 1 and pipe.candidate_rows == B
    assert pipe.fallback.asked == 0  # (its fallback always runs on the device)


def test_a_hit_whose_fallback_may_move_to_the_host_asks_the_fallback_choice(cpu_memo):
    """A filtered call outside the cut's fast path (top-k here) goes through its graph only
    while its fallback stays on the device: the memo asks the pipeline's FallbackChoice
    first, as the full path does, and leaves a host-mode call to the full path."""
    sig, pipe, _, _ = stored(cpu_memo, filtered=True, asks="device", top_k=5)
    assert cpu_memo.call(sig, torch.ones(B, D), None, 5) is not None
    assert pipe.fallback.asked == 1 and pipe.replays == 2 and cpu_memo.hits == 1
    pipe.fallback.on_device = False
    assert cpu_memo.call(sig, torch.ones(B, D), None, 6) is None
    assert pipe.fallback.asked == 2 and pipe.replays == 2 and cpu_memo.hits == 1
    assert sig in cpu_memo.entries  # (kept: the fallback may come back to the device)


@pytest.mark.parametrize("kept", ["side", "lazy"])
def test_a_fast_path_hit_follows_the_side_output_choice(kept, cpu_memo):
    """A call on the cut's fast path was captured with or without the side output: the memo
    replays its graph only while the pipeline's choice (lazy_side, asked once per call) is
    still the one it was captured under, and leaves the other case to the full path."""
    sig, pipe, _, _ = stored(cpu_memo, filtered=True, asks=kept, top_p=0.9)
    asked = []
    lazy = [kept == "lazy"]
    pipe.lazy_side = lambda hidden, in_capture: (asked.append(in_capture), lazy[0])[1]
    assert cpu_memo.call(sig, torch.ones(B, D), None, 5) is not None
    assert asked == [False] and pipe.fallback.asked == 0 and cpu_memo.hits == 1
    lazy[0] = not lazy[0]
    assert cpu_memo.call(sig, torch.ones(B, D), None, 6) is None
    assert len(asked) == 2 and cpu_memo.hits == 1 and pipe.replays == 2
    assert sig in cpu_memo.entries


@pytest.mark.parametrize("kept", ["device side", "device lazy"])
def test_a_hit_with_rows_for_both_paths_asks_both_choices(kept, cpu_memo):
    """A call with a per-row top_k tensor and top-p may flag rows for the cut's fast path
    (side output or not) and others (the device fallback or the host's): its graph is
    replayed only while both choices are the ones it was captured under."""
    sig, pipe, _, _ = stored(cpu_memo, filtered=True, asks=kept,
                             top_k=torch.tensor([0, 5, 0]), top_p=0.9)
    asked = []
    lazy = [kept.endswith("lazy")]
    pipe.lazy_side = lambda hidden, in_capture: (asked.append(in_capture), lazy[0])[1]
    assert cpu_memo.call(sig, torch.ones(B, D), None, 5) is not None
    assert asked == [False] and pipe.fallback.asked == 1 and cpu_memo.hits == 1
    lazy[0] = not lazy[0]
    assert cpu_memo.call(sig, torch.ones(B, D), None, 6) is None
    lazy[0] = not lazy[0]
    pipe.fallback.on_device = False
    assert cpu_memo.call(sig, torch.ones(B, D), None, 7) is None
    assert pipe.fallback.asked == 3 and cpu_memo.hits == 1 and sig in cpu_memo.entries


@pytest.mark.parametrize("case", ["constrained", "converted bias", "seed copied", "no graph",
                                  "memo off", "drawn seed bound"])
def test_calls_that_are_not_kept(case, cpu_memo, monkeypatch):
    h, w = torch.ones(B, D), torch.zeros(V, D)
    seed = torch.zeros(B, dtype=torch.int64)
    spec = spec_of(h, seed=seed)
    pipe = Pipe(("weight", "seed") if case == "drawn seed bound" else ("weight",))
    pipe.graph_call(dict(hidden=h, inv_temp=spec.row.inv_temp, seed=spec.row.seed,
                         offset=spec.row.offset, bias=None, weight=w))
    given_seed, bias, checked = seed, None, None
    if case == "constrained":
        spec = spec_of(h, seed=seed, repetition_penalty=1.2,
                       logit_adjust=(torch.zeros(B, 1, dtype=torch.int64), torch.ones(B, 1)))
    elif case == "converted bias":
        bias, checked = torch.zeros(V, dtype=torch.bfloat16), torch.zeros(V)
    elif case == "seed copied":  # the spec holds a copy of the given seed tensor
        given_seed = seed.clone()
    elif case == "no graph":
        pipe.last_graph = None
    elif case == "memo off":
        monkeypatch.setattr(knobs, "MEMO", False)
    elif case == "drawn seed bound":
        given_seed = None
    sig = CM.signature(h, w, bias, given_seed, 0, SCALARS)
    cpu_memo.store(sig, pipe, spec, given_seed, 0, bias, checked, lambda n, d, out=None: None)
    assert not cpu_memo.entries


@pytest.mark.parametrize("case", ["memo off", "graphs off", "graph dropped", "capturing",
                                  "other stream", "buffers moved", "offset out of range"])
def test_an_entry_stops_applying(case, cpu_memo, monkeypatch):
    sig, pipe, _, draws = stored(cpu_memo)
    offset = 6
    if case == "memo off":
        monkeypatch.setattr(knobs, "MEMO", False)
    elif case == "graphs off":
        monkeypatch.setattr(knobs, "GRAPHS", False)
    elif case == "graph dropped":
        pipe.graphs._drop_all()
    elif case == "capturing":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    elif case == "other stream":
        monkeypatch.setattr(CM, "current_stream", lambda index: 8)
    elif case == "buffers moved":
        pipe.transport.buffers += 1
    elif case == "offset out of range":
        offset = 1 << 63
    assert cpu_memo.call(sig, torch.ones(B, D), None, offset) is None
    assert pipe.replays == 1 and not draws and cpu_memo.hits == 0
    if case != "offset out of range":  # (the full path raises, naming it)
        assert not cpu_memo.entries


def test_a_bound_tensor_elsewhere_drops_the_graph_before_any_seed_is_drawn(cpu_memo):
    """The full path then draws the seeds, once: under TP every rank's generator stays in
    step whichever path each rank took."""
    sig, pipe, w, draws = stored(cpu_memo, bound=("weight", "offset"), offset=5)
    tokens = cpu_memo.call(sig, torch.ones(B, D), None, 5)  # offset 5: the bound tensor
    assert tokens.tolist() == [4 + row_seed(100, b) + 5 for b in range(B)]
    assert cpu_memo.call(sig, torch.ones(B, D), None, 6) is None  # another offset tensor
    assert draws == [pipe.device] and not cpu_memo.entries and not pipe.graphs.graphs


@pytest.mark.parametrize("fn", [tpsample.sample, VocabParallelSampler.__call__])
def test_the_signature_covers_every_argument(fn):
    """Every parameter of the entry point reaches signature(): one added later without it
    would let a call with another value of it replay the graph of the first."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "signature")
    names = {n.id for n in ast.walk(call) if isinstance(n, ast.Name)} - {"signature"}
    names |= {n.attr for n in ast.walk(call) if isinstance(n, ast.Attribute)}
    params = set(inspect.signature(fn).parameters) - {"self"}
    assert params <= names | {"weight"} and params - names <= {"weight"}, params - names


