"""A repeated eager call replayed as one CUDA graph.

An eager call whose replay key (tpsample/pipeline.py) comes back re-issues its recorded
launches one by one (tpsample/replay.py): a few µs of host time per launch and per output
allocation. From the third call of a key, the pipeline captures those launches once into a
CUDA graph and replays that instead: one launch for the whole call.

A graph reads fixed addresses, so every per-call tensor is either
  bound   read where the graph was captured with it (its address, checked per call; the
          graph holds the tensor it was captured with): tensors the caller passes again,
          e.g. a seed / offset tensor updated in place, the cached tensors of scalar
          parameters, the weight;
  copied  into a tensor the graph owns, before the replay (one copy launch each): tensors
          that were new at the call before the capture, e.g. the hidden states.
A call whose bound tensor lies elsewhere re-issues the launches instead, and the graph is
dropped; the key's next capture copies that tensor (a loop that passes the same seed tensor
for a while, then new ones, ends up with it copied). The graph's outputs are its
own; the call returns clones of those it returns (a fresh tensor per call, as without the
graph), except where the caller gave a tensor for an output (SINKS: `out=` for the
tokens): a bound one the graph writes itself (no launch after the replay), a copied one
it fills after the replay. Its intermediates (records) live in the graph's memory pool.

Returned outputs without a copy (TPSAMPLE_REUSE_OUTPUTS=1): a clone is an allocation and a
launch after the replay, 7-12 µs of host time each. A graph captured without the caller's
`out` is captured OUTPUT_SLOTS more times, each writing its returnable outputs (RETURNABLE:
tokens, log-probs, log Z, top tokens) into tensors of its own (the slot's, allocated outside
the graph's pool, so that no graph's intermediates share their memory). A call replays the
first slot whose outputs no tensor outside the slot refers to any more (the storages' use
counts: the caller dropped what the call that returned them gave back, and every view of
it) and returns them; where every slot is still held, the first graph and clones, as
before. A decode loop that keeps one step's result while it calls the next
(`tok = sample(...)`) alternates between two slots. The slot graphs share the first graph's
pool and inputs: they are replayed only in the order of their key's stream, never at once,
and hold no output in the pool that another graph's intermediates could overwrite. As with
memory from the caching allocator, outputs that another stream still reads after the caller
drops them (`record_stream`) are not protected: keep a reference until that stream's work
is ordered before the next call, or set TPSAMPLE_REUSE_OUTPUTS=0.

Plain calls take graphs, and filtered calls whose exact fallback always runs on the
device (top-p / min-p without top-k, top log-probs or samples without replacement: no
host decision per call); TPSAMPLE_GRAPHS=plain keeps filtered calls on re-issued
launches, TPSAMPLE_GRAPHS=0 turns graphs off. tpsample/call_memo.py sends a call that
repeats a graphed call's arguments straight to its graph.
"""
from __future__ import annotations

import threading
import warnings
import weakref

import torch

from . import drawn_seeds, fallback_gate, graph_args, knobs

CAPTURE_AT = 3  # the call of a key that captures its graph (earlier ones re-issue launches)
MAX_CAPTURES = 4  # per key: a graph whose bound tensor moves is dropped and captured
                  # again with that name copied from then on (moving names only add up),
                  # at most this many times; then the key keeps re-issuing its launches
NEVER_COPIED = ("weight",)  # per-call tensors a graph must find bound (an LM head's size)
SINKS = {"out": "tokens"}  # per-call tensors the graph's output of that name goes into
MAX_GRAPHS = 16  # per pipeline; all are dropped when full (keys change only with shapes)
OUTPUT_SLOTS = 2  # per graph captured without the caller's out: see the module docstring
RETURNABLE = ("tokens", "logprobs", "logz", "top_tokens", "top_logprobs")
RETURNED = {False: ("tokens",), True: ("tokens", "logprobs", "logz")}  # (by return_logprobs)


def with_sink(per_call: dict, tokens_out) -> dict:
    """A graph call's named tensors: with the caller's tokens tensor as "out" where given
    (SINKS: the graph writes the tokens there, or copies them there when it was captured
    with another)."""
    return per_call if tokens_out is None else dict(per_call, out=tokens_out)
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # (None: never reused)


class Slot:
    """A capture of a CallGraph's launches whose returnable outputs go to tensors of its
    own: graph, outputs ({name: tensor}), own (the names among RETURNABLE it owns),
    storages (the owned outputs' storages, kept for their use counts), idle (those counts
    with only the slot's references, taken once every slot of the graph is captured)."""
    __slots__ = ("graph", "outputs", "own", "storages", "idle")

    def free(self) -> bool:
        return all(_use_count(st._cdata) <= n for st, n in zip(self.storages, self.idle))


class CallGraph:
    """One captured call. inputs: {name: tensor the graph reads}; bound: names whose
    tensor must lie at the address in bound_ptrs per call; copied: the other names (filled
    before the replay); outputs: {name: tensor the graph writes}; sinks: {output name:
    (the per-call name it goes into, whether copied there after the replay)}; live: False
    once its CallGraphs dropped it."""
    __slots__ = ("graph", "inputs", "bound", "bound_ptrs", "copied", "outputs", "sinks", "lock",
                 "live", "slots", "args", "__weakref__")

    def __init__(self):
        self.lock, self.live, self.sinks, self.slots = threading.Lock(), True, {}, ()
        self.args = None  # tpsample/graph_args.GraphArgs: the copied hidden / offset / seed

    def __call__(self, tensors: dict, returned: tuple[str, ...]) -> dict | None:
        """Replay with this call's tensors; {name: a fresh clone, or the call's sink
        tensor} of the `returned` outputs, or None (a bound tensor lies elsewhere: not this
        graph's call). The lock keeps another thread's copies out from between this call's
        copies and replay."""
        if not self.binds(tensors):
            return None
        return self.run(tensors, returned)

    def binds(self, tensors: dict) -> bool:
        """Whether every bound tensor of this call lies where the graph reads it."""
        for name, ptr in zip(self.bound, self.bound_ptrs):
            if tensors[name].data_ptr() != ptr:  # (the address is what the graph reads)
                return False
        return True

    def run(self, tensors: dict, returned: tuple[str, ...], values: dict | None = None) -> dict:
        """The replay of a call that binds (see binds). values: {"offset": int, "seed": a
        drawn base (tpsample/drawn_seeds.py)} for copied inputs the call has as such
        (tpsample/call_memo.py), in place of tensors[name]. The hidden states, offset and
        seeds go through the graph's GraphArgs where it has one; other copied inputs are
        copied (one launch each)."""
        inputs, sinks, args = self.inputs, self.sinks, self.args
        with self.lock:
            for name in self.copied:
                if name in SINKS or (args is not None and name in args.names):
                    continue
                if values is not None and name in values:
                    _fill(inputs[name], name, values[name])
                else:
                    inputs[name].copy_(tensors[name])
            slot = self._free_slot() if self.slots else None
            if args is not None:  # (just before the replay: each replay reads one slot)
                args.write(tensors, values)
            if slot is None:
                self.graph.replay()
                outputs = self.outputs
            else:
                slot.graph.replay()
                outputs = slot.outputs
            out = {}
            for name in returned:
                sink = sinks.get(name)
                if sink is None:
                    out[name] = (outputs[name].detach() if slot is not None and name in slot.own
                                 else outputs[name].clone())  # (detach: a tensor of its own
                    continue  # over the slot's memory, counted while the caller holds it)
                t = tensors[sink[0]]
                if sink[1]:  # (captured with another tensor there: the graph's own)
                    t.copy_(self.outputs[name])
                out[name] = t
            return out

    def _free_slot(self) -> Slot | None:
        for slot in self.slots:
            if slot.free():
                return slot
        return None


def _fill(t: torch.Tensor, name: str, value) -> None:
    """A copied input written from a value (a graph without GraphArgs)."""
    if name == "seed":
        host = torch.from_numpy(drawn_seeds.row_seeds(value, t.shape[0]))
        if t.is_cuda:  # (pinned: the copy does not wait for the stream)
            host = host.pin_memory()
        t.copy_(host, non_blocking=True)
    else:
        t.fill_(value)


class CallGraphs:
    """The graphs of one pipeline by replay key, and the calls seen per key until capture."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict = {}
        self.seen: dict = {}  # key -> (calls so far, weak references to the previous
        # call's tensors)
        self.captures: dict = {}  # key -> graphs captured for it
        self.moved: dict = {}  # key -> names whose bound tensor moved once: copied since

    def __len__(self) -> int:
        return len(self.graphs)

    @staticmethod
    def usable(in_capture, filtered: bool = False) -> bool:
        """Graphs for eager calls only (a call inside the caller's own capture is part of
        that graph already); filtered calls unless TPSAMPLE_GRAPHS=plain."""
        return (knobs.GRAPHS_FILTERED if filtered else knobs.GRAPHS) and in_capture is False

    def get(self, key) -> CallGraph | None:
        return self.graphs.get(key)

    def due(self, key, tensors: dict) -> frozenset | None:
        """Count a call of `key` that re-issued its launches; at the CAPTURE_AT-th, the
        names to bind (the tensors that were the same objects at the call before), else
        None. A weight that was another object is never copied: no graph then (counted
        like a capture)."""
        if self.captures.get(key, 0) >= MAX_CAPTURES:
            return None
        calls, before = self.seen.get(key, (0, None))
        calls += 1
        if calls < CAPTURE_AT:
            if len(self.seen) >= 4 * MAX_GRAPHS:
                self.seen.clear()
            # weak references, not ids: a tensor freed after its call (seeds drawn per
            # call) may leave its id to the next call's, which is not the same object
            # (bound by mistake, its graph would be dropped at the first call whose address
            # differs, and the key would soon stop capturing)
            self.seen[key] = (calls, tuple(None if t is None else weakref.ref(t)
                                           for t in tensors.values()))
            return None
        self.seen.pop(key, None)
        moved = self.moved.get(key, ())
        bound = frozenset(n for (n, t), old in zip(tensors.items(), before or ())
                          if t is not None and old is not None and old() is t
                          and n not in moved)
        if any(n in tensors and tensors[n] is not None and n not in bound for n in NEVER_COPIED):
            self.captures[key] = self.captures.get(key, 0) + 1
            return None
        return bound

    def capture(self, key, tensors: dict, bound: frozenset, launch,
                gated: bool = False) -> CallGraph | None:
        """Capture launch(stream, inputs, outputs=None) -> {name: output tensor} (outputs:
        {name: tensor} the launches write in place of fresh ones) with `tensors` (None
        entries stay None; bound ones as they are, the others copied into tensors the graph
        owns) on a side stream, and keep it under `key`. The graph has not run yet. None if
        the capture fails (with a warning): the key then keeps re-issuing its launches.
        gated: the launches hold a fallback gate's steps (tpsample/fallback_gate.py), whose
        node is prepared for the capture."""
        try:
            try:
                g = self._capture(tensors, bound, launch, gated)
            except Exception as e:  # noqa: BLE001 - once more without the fallback's node
                if not fallback_gate.failed_with_node(e):
                    raise
                g = self._capture(tensors, bound, launch, gated)
        except Exception as e:  # noqa: BLE001 - the launches still work without a graph
            self.captures[key] = MAX_CAPTURES
            warnings.warn(f"tpsample: CUDA-graph capture of a repeated call failed ({e}); its "
                          "launches are re-issued per call instead", RuntimeWarning, stacklevel=4)
            return None
        if len(self.graphs) >= MAX_GRAPHS:
            self._drop_all()
        if len(self.captures) >= 4 * MAX_GRAPHS:
            self.captures.clear()
        self.graphs[key] = g
        self.captures[key] = self.captures.get(key, 0) + 1
        return g

    def replay(self, key, graph: CallGraph, tensors: dict, returned: tuple) -> dict | None:
        """graph(tensors, returned); where a bound tensor lies elsewhere, None and the graph
        is dropped."""
        out = graph(tensors, returned)
        if out is None:
            self.drop(key, graph, tensors)
        return out

    def drop(self, key, graph: CallGraph, tensors: dict) -> None:
        """Drop the graph of a call whose bound tensor lies elsewhere: the next capture of
        `key` copies the names that moved."""
        moved = {n for n, p in zip(graph.bound, graph.bound_ptrs) if tensors[n].data_ptr() != p}
        if len(self.moved) >= 4 * MAX_GRAPHS:
            self.moved.clear()
        self.moved[key] = self.moved.get(key, frozenset()) | moved
        graph.live = False
        if self.graphs.get(key) is graph:
            del self.graphs[key]

    def clear(self) -> None:
        """Every graph dropped and every key's count started afresh."""
        self._drop_all()
        self.seen.clear()
        self.captures.clear()
        self.moved.clear()

    def _drop_all(self) -> None:
        for g in self.graphs.values():
            g.live = False  # (tpsample/call_memo.py keeps using a graph only while live)
        self.graphs.clear()

    def _capture(self, tensors: dict, bound: frozenset, launch, gated: bool) -> CallGraph:
        g = CallGraph()
        g.inputs = {n: (t if t is None or n in bound else torch.empty_like(t))
                    for n, t in tensors.items()}
        g.bound = tuple(n for n, t in tensors.items() if t is not None and n in bound)
        g.bound_ptrs = tuple(tensors[n].data_ptr() for n in g.bound)
        g.copied = tuple(n for n, t in tensors.items() if t is not None and n not in bound)
        g.args = graph_args.for_graph(g, g.inputs, g.copied, self.device) if knobs.GRAPH_ARGS \
            else None
        g.graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)  # (the owned inputs' allocations are ordered on current)
        with torch.cuda.stream(side):
            if g.args is not None:  # (compiled and loaded outside the capture)
                g.args.skip()
                g.args.launch(g.inputs)
            with fallback_gate.capturing(self.device if gated else None):
                g.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    if g.args is not None:
                        g.args.launch(g.inputs)
                    g.outputs = launch(side.cuda_stream, g.inputs)
                finally:
                    fallback_gate.abandon()
                    g.graph.capture_end()
        g.sinks = {SINKS[n]: (n, n in g.copied) for n in SINKS if tensors.get(n) is not None}
        if knobs.REUSE_OUTPUTS and _use_count is not None and not g.sinks:
            try:
                g.slots = tuple(self._capture_slot(g, launch, side,
                                                    self.device if gated else None)
                                for _ in range(OUTPUT_SLOTS))
            except Exception as e:  # noqa: BLE001 - the first graph works without slots
                warnings.warn(f"tpsample: CUDA-graph capture of a call's output slots failed "
                              f"({e}); its outputs are copied per call instead", RuntimeWarning,
                              stacklevel=5)
            for slot in g.slots:  # (after the captures: their temporaries are gone)
                slot.idle = tuple(_use_count(st._cdata) for st in slot.storages)
        current.wait_stream(side)
        return g

    @staticmethod
    def _capture_slot(g: CallGraph, launch, side, device) -> Slot:
        """g's launches captured again, on the side stream and in g's pool, with the
        returnable outputs going to tensors of the slot's own (allocated outside the pool;
        slot.idle is set by _capture)."""
        slot = Slot()
        own = {n: torch.empty_like(g.outputs[n]) for n in RETURNABLE
               if g.outputs.get(n) is not None and g.outputs[n].numel()}
        slot.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            with fallback_gate.capturing(device):
                slot.graph.capture_begin(pool=g.graph.pool(), capture_error_mode="thread_local")
                try:
                    if g.args is not None:
                        g.args.launch(g.inputs)
                    slot.outputs = launch(side.cuda_stream, g.inputs, own)
                finally:
                    fallback_gate.abandon()
                    slot.graph.capture_end()
        slot.own = frozenset(own)
        slot.storages = tuple(t.untyped_storage() for t in own.values())
        return slot
