"""A decode loop's repeated call, straight to its CUDA graph.

A decode loop calls the sampler with the same arguments at every step except three: new
hidden states, the step as an int offset, and seeds drawn per call (seed=None). Once such a
call has gone through its CUDA graph (tpsample/call_graphs.py), the memo maps the call's
signature to that graph and the tensors the graph read:

    signature   the hidden states' shape / dtype / device, the weight, bias, seed, offset
                and out tensors by identity (the memo holds them, so no other object can
                take their id), every other argument by value and type, and whether seed /
                offset are None / int / tensors (an int seed by value; an int offset per
                call)

A call with a known signature skips validation, the SamplingSpec, the plan and replay keys
and the graph lookup: it hands the graph the hidden states, the int offset itself and, for
seed=None, a drawn base (tpsample/drawn_seeds.py) in place of the tensors the full path would
make, and replays; the graph reads them from its GraphArgs slot (tpsample/graph_args.py: no
launch for them). The tokens are the full path's: the same graph, the same values in its
inputs.

What is memoised is what the full path would validate the same way every call: tensor
arguments whose contents the full path range-checks per call (temperature, top_k / top_p /
min_p, the constraints) keep the full path, as do calls whose bias is converted (not fp32)
and non-contiguous hidden states. An entry is used only while its graph is live and
enabled (TPSAMPLE_GRAPHS), outside any CUDA-graph capture, on the stream it was captured
on, with the transport's buffers unmoved; otherwise, or when the graph finds a bound
tensor elsewhere, the call takes the full path, which decides as it always does.
TPSAMPLE_MEMO=0 turns the memo off.
"""
from __future__ import annotations

import weakref

import torch

from . import knobs
from . import params as P
from .replay import current_stream

_SCALARS = frozenset({int, float, bool, str, type(None)})
MAX_ENTRIES = 8  # per memo; all are dropped when full (a loop has one or two signatures)


def signature(hidden: torch.Tensor, weight, bias, seed, offset, scalars: tuple, out=None):
    """The memo key of a call (see the module docstring), or None where the call is not
    memoised (a tensor or container among `scalars`, non-contiguous hidden states, a seed
    or offset that is neither None / int nor a tensor). scalars: every other argument;
    out: the call's tokens tensor (by identity) or None."""
    types = tuple(map(type, scalars))
    if not _SCALARS.issuperset(types) or not hidden.is_contiguous():
        return None
    ts, to = type(seed), type(offset)
    if ts is int or seed is None:
        s = seed
    elif isinstance(seed, torch.Tensor):
        s = id(seed)
    else:
        return None
    if to is int:
        o = None
    elif isinstance(offset, torch.Tensor):
        o = id(offset)
    else:
        return None
    return (hidden.shape, hidden.dtype, hidden.get_device(), id(weight),
            None if bias is None else id(bias), ts, s, to, o, scalars, types,
            None if out is None else id(out))


class Entry:
    """What a memoised call replays: the pipeline's graph under its key (a weak reference:
    the pipeline's CallGraphs owns it), the tensors it read (the template a call fills with
    its hidden states, offset and seeds), the outputs it returns, and the conditions it was
    captured under."""
    __slots__ = ("pipeline", "gkey", "graph", "tensors", "returned", "filtered",
                 "fallback", "stream", "transport_key", "device", "draw", "int_offset",
                 "num_samples", "return_logprobs", "refs")


class CallMemo:
    """Signature → Entry for one entry point (tpsample.sample's process-wide pipelines, or
    one VocabParallelSampler)."""

    def __init__(self):
        self.entries: dict = {}
        self.hits = 0  # calls served from the memo (tests and tools)

    def clear(self) -> None:
        self.entries.clear()

    def call(self, sig, hidden: torch.Tensor, seed, offset):
        """The call's result through its memoised graph, or None (no entry, or the entry no
        longer applies: the caller takes the full path)."""
        e = self.entries.get(sig)
        if e is None:
            return None
        pipe, graph = e.pipeline, e.graph()
        if (not knobs.MEMO or graph is None or not graph.live
                or not pipe.graphs.usable(False, filtered=e.filtered)
                or torch.cuda.is_current_stream_capturing()
                or current_stream(e.device.index) != e.stream
                or pipe.transport.key() != e.transport_key):
            self.entries.pop(sig, None)
            return None
        if e.fallback is not None:
            if e.fallback.startswith("device") and not pipe.fallback.device_now(hidden, False):
                return None  # (its fallback moved to the host: the full path takes it there)
            if (e.fallback != "device"
                    and pipe.lazy_side(hidden, False) != e.fallback.endswith("lazy")):
                return None  # (the side output comes or goes: the full path takes the other
                # graph)
        tensors = dict(e.tensors)
        tensors["hidden"] = hidden
        values = None
        if e.int_offset:
            if not -(1 << 63) <= offset < (1 << 63):
                return None  # (the full path raises, naming it)
            if "offset" in graph.copied:  # (the value itself: tpsample/graph_args.py)
                values = {"offset": offset}
            else:  # (bound: the cached tensor of this value, as the full path passes)
                tensors["offset"] = P._filled(hidden.shape[0], offset, torch.int64, e.device,
                                              False)
        if not graph.binds(tensors):  # a bound tensor lies elsewhere: as the full path
            pipe.graphs.drop(e.gkey, graph, tensors)  # would, drop the graph (before any
            self.entries.pop(sig, None)  # seed is drawn: the full path draws them then)
            return None
        if e.draw is not None:  # (a base the graph derives the row seeds from: the same
            values = dict(values or {}, seed=e.draw(e.device))  # values as the full path's draw)
        out = graph.run(tensors, e.returned, values)
        self.hits += 1
        top = None
        if e.filtered:  # as the full path's filtered graph call counts and watches
            pipe.candidate_rows += hidden.shape[0]
            pipe.fallback.watch()
            top = (out["top_tokens"], out["top_logprobs"]) if "top_tokens" in out else None
        return P.package(out["tokens"], out.get("logprobs"), out.get("logz"), e.num_samples,
                         e.return_logprobs, top)

    def store(self, sig, pipeline, spec, seed, offset, bias, checked_bias, draw,
              out=None) -> None:
        """After a full call with signature `sig` (not None) whose launches went through
        the pipeline's graph (pipeline.last_graph): keep it where a repeat can skip to the
        graph. seed / offset / bias / out: the call's arguments; checked_bias:
        params.check_bias's result; draw(device): the base of the seeds the full path draws for
        seed=None (tpsample/drawn_seeds.next_base on the call's generator)."""
        last = pipeline.last_graph
        if last is None or not knobs.MEMO or spec.constrained:
            return
        if checked_bias is not bias:  # converted per call (not fp32 / contiguous)
            return
        if isinstance(seed, torch.Tensor) and spec.row.seed is not seed:
            return
        if isinstance(offset, torch.Tensor) and spec.row.offset is not offset:
            return
        gkey, graph, tensors, returned, filtered, fallback = last
        if seed is None and "seed" in graph.bound:  # (drawn seeds are new tensors per call)
            return
        e = Entry()
        e.pipeline, e.gkey, e.returned, e.filtered = pipeline, gkey, returned, filtered
        e.fallback = fallback  # None, "device" (asks FallbackChoice.device_now), "side" or
        # "lazy" (a call on the cut's fast path with or without the side output: asks
        # lazy_side), "device side" / "device lazy" (a call that may have rows for the fast
        # path and others: asks both)
        e.graph = weakref.ref(graph)
        e.tensors = {n: t for n, t in tensors.items() if n != "hidden"}
        e.device = pipeline.device
        e.stream = current_stream(e.device.index)
        e.transport_key = pipeline.transport.key()
        e.draw = draw if seed is None else None
        e.int_offset = type(offset) is int
        e.num_samples, e.return_logprobs = spec.num_samples, spec.return_logprobs
        e.refs = (seed, offset, bias, out)  # (their ids are in sig; the weight is in tensors
        # or is the pipeline's fixed weight)
        if len(self.entries) >= MAX_ENTRIES:
            self.entries.clear()
        self.entries[sig] = e
