"""Calls with candidate planes: filters, top log-probs, samples without replacement.

The filtered half of tpsample/pipeline.py's Pipeline (a base class of it: the same object,
its transport, replays, graphs and fallback choice): stage 1 with candidate planes (and,
where rows may take the cut's fast path, their fp32 logits as a side output), the exchange, the
candidate reduce (tpsample/filters.py), then the exact fallback of the rows it could not
certify: on the device (launchers.fallback_on_device; one device or a transport that
gathers rows) or from the host (tpsample/host_fallback.py), as
tpsample/fallback_choice.py decides. Repeated calls re-issue their recorded launches in two
parts (stage 1, keyed by what it reads; stage 2 per filter layout and fallback path under
it) and, where the fallback runs on the device, replay one CUDA graph whose fallback sits
behind the gate (tpsample/fallback_gate.py).
"""
from __future__ import annotations

import torch

from . import constraints as C
from . import filters as F
from . import knobs, launchers, records, replay
from .call_graphs import RETURNED, with_sink
from .filters import cut_rows_possible
from .constrained_stage1 import constraint_key, listed_scratch, stage1_constrained
from .host_fallback import redo_rows_on_host
from .params import Filters, RowParams
from .plan import Plan
from .torch_records import merge_records, records_torch


class FilteredCalls:
    """Pipeline's filtered calls (module docstring); Pipeline sets every attribute used here."""

    def _run_filtered(self, hidden, weight, bias, params: RowParams, *, n_real: int, merge: str,
                      num_samples: int, vocab_start: int, tiles: int | None, filters: Filters,
                      constraints: C.Constraints = C.NO_CONSTRAINTS,
                      in_capture: bool | None = None, logprobs: bool = True,
                      tokens_out: torch.Tensor | None = None):
        """A call with candidate planes (tpsample/filters.py): stage 1 with candidates, the
        exchange, the candidate reduce (which, with merge "max", also takes the unfiltered
        rows' winners; other merges run over the sample planes first), and the exact
        fallback for rows without a certificate: on the device for a one-device Triton call
        or a transport that gathers rows (no host synchronisation), else from the host (one
        synchronisation per call)."""
        B, S = hidden.shape[0], num_samples
        T = tiles if tiles is not None else records.num_tiles(weight.shape[0])
        if self.backend == "torch":
            out = self._filtered_torch(hidden, weight, bias, params, merge, S, n_real,
                                       vocab_start, T, filters, constraints, logprobs)
            side = None
        else:
            if in_capture is None:
                in_capture = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
            out, on_device, side = self._filtered_launches(
                hidden, weight, bias, params, merge, S, n_real, vocab_start, T, filters,
                constraints, in_capture, logprobs, tokens_out)
            if on_device:
                self.candidate_rows += B
                if hidden.is_cuda and not in_capture:
                    self.fallback.watch()
                top = (out.top_tokens, out.top_logprobs) if filters.top_n else None
                return out.tokens, out.logprobs, out.logz, top
        tokens, logprobs, logz, top, redone = redo_rows_on_host(
            out, self.transport, hidden, weight, bias, params, filters, n_real, vocab_start, T,
            S, constraints, side)
        self.candidate_rows += B
        self.host_fallback_rows += redone
        if self.fallback.host_mode and (redone == 0 or not bool(  # (synchronised already)
                ((out.fallback == 2) | ((out.fallback != 0)
                                        & ~F.cut_path_rows(filters, params.inv_temp))).any())):
            self.fallback.host_mode = False  # (no row for the per-row path: the device's)
        return tokens, logprobs, logz, top

    def _filtered_torch(self, hidden, weight, bias, params: RowParams, merge: str, S: int,
                        n_real: int, vocab_start: int, T: int, filters: Filters,
                        constraints: C.Constraints, logprobs: bool = True) -> F.FilteredOutput:
        """The torch backend's records with candidates, the exchange and the candidate
        reduce (flagged rows left to the host fallback; logprobs False: a tokens-only call,
        whose rows the winner certificate may clear)."""
        B, Tx, planes = hidden.shape[0], T + int(constraints.listed), records.planes(S, True)
        mine, full = self.transport.slots(planes * B * Tx * records.WIDTH)
        plan = self.plan(hidden, weight, merge=merge, num_samples=S, need_mass=True,
                         vocab_start=vocab_start, tiles=T, filters=filters,
                         masked=constraints.any)
        rec = records_torch(hidden, weight, bias=bias, inv_temp=params.inv_temp,
                            seed=params.seed, offset=params.offset, num_samples=S,
                            n_real=n_real, vocab_start=vocab_start, num_tiles=T,
                            cdf=plan.cdf and filters.replacement, candidates=True,
                            replacement=filters.replacement, constraints=constraints)
        records.records_view(mine, planes, B, Tx).copy_(rec)
        self.transport.exchange(mine, full)
        recs = records.records_view(full, planes, B, Tx)
        base = merge_records(recs[:, :S], params, merge if filters.replacement else "max")
        winner = base[0][:, 0] if launchers.winner_certificate(merge, S, filters,
                                                               not logprobs) else None
        return F.reduce_candidates(recs, params, filters, S, base, winner=winner)

    def _filtered_launches(self, hidden, weight, bias, params, merge, S, n_real, vocab_start,
                           T, filters, constraints: C.Constraints,
                           in_capture: bool, logprobs: bool = True,
                           tokens_out: torch.Tensor | None = None
                           ) -> tuple[F.FilteredOutput, bool, torch.Tensor | None]:
        """Stage 1, exchange and launchers.stage2_filtered, replayed like run()'s launches;
        returns (outputs, whether the exact fallback ran on the device, stage 1's logits side
        output or None).

        Stage 1 is launched (replayed) before anything only stage 2 needs is prepared: the
        fallback path's decision, its buffers, the filters' part of the key and the outputs
        cost host time that an eager call would otherwise spend before the GPU starts. Its
        replay is keyed by what stage 1 reads; each stage-1 replay keeps the stage-2 replays
        of the filters' layouts and fallback paths seen with it. tokens_out (run's): where a
        call through its graph writes the tokens; re-issued launches leave it to the caller."""
        B = hidden.shape[0]
        Tx = T + int(constraints.listed)
        planes = records.planes(S, True)
        numel = planes * B * Tx * records.WIDTH
        slots = self._slots_first(numel)
        fanout = self.transport.fanout()
        tile_major = fanout is not None  # (one device: row-major, docs/design.md)
        per_call = self._call_tensors(hidden, weight, bias, params, constraints, vocab_start)
        # stage 1 also writes the transformed logits (B·V·4 bytes, `side`) in calls whose
        # rows may fall back on heavy tails (top-p / min-p rows without a top-k), while
        # recent such calls flagged rows (lazy_side): the exact fallback then reads them
        # instead of W. Other filtered calls rarely fall back and skip the write (it cost
        # top_k 50 3-5 % at B <= 64, docs/design.md).
        fast = fast_fallback(filters)
        side_out = cut_rows_possible(filters) and not self.lazy_side(hidden, in_capture)
        key = stage2s = stream = plan = log1 = None
        on_device = None
        if hidden.is_cuda and replay.Replay.usable():
            key = ("filtered", merge, S, hidden.device, hidden.shape, hidden.stride(), n_real,
                   vocab_start, T, filters.replacement, filters.raw, constraint_key(constraints),
                   self.transport.key(), replay.tensor_key(tuple(per_call.values())), side_out,
                   None if weight is self.fixed_weight else (weight.shape, weight.stride()))
            hit = self.replays.get(key)
            if hit is not None:  # (a launch takes only a tensor's address, which a records
                stage1, stage2s = hit  # view shares with its flat buffer: the key has the layout)
                stream = replay.current_stream(hidden.device.index)
                # (a call whose fallback has moved to the host re-issues its launches)
                if (self.graphs is not None and self.graphs.usable(in_capture, filtered=True)
                        and not constraints.listed):
                    on_device = self._on_device(fast, hidden, in_capture)
                    if on_device:
                        out = self._filtered_graph_call(key, stage1, stage2s, per_call, filters,
                                                        side_out, B, S, T, numel, stream,
                                                        logprobs, tokens_out)
                        if out is not None:
                            return out, True, None
        per_call["side"] = (torch.empty(B, T * records.TILE, dtype=torch.float32,
                                        device=hidden.device) if side_out else None)
        mine, full = slots or self.transport.slots(numel)
        if stage2s is not None:
            stage1(stream, records=mine, **per_call)
        else:
            plan = self.plan(hidden, weight, merge=merge, num_samples=S, need_mass=True,
                             vocab_start=vocab_start, tiles=T, filters=filters,
                             masked=constraints.any)
            out_view = records.records_view(mine, planes, B, Tx, tile_major)
            with replay.record() as log1:
                stage1_constrained(plan, hidden, weight, bias, params, out_view, per_call,
                                   constraints, n_real=n_real, vocab_start=vocab_start,
                                   fanout=fanout[:2] if fanout else None)

        if on_device is None:
            on_device = self._on_device(fast, hidden, in_capture)
        later, gathered = self._fallback_buffers(on_device, filters, per_call, B, T)
        key2 = None if key is None else self._key2(on_device, filters, per_call, later, logprobs)
        stage2 = None if stage2s is None else stage2s.get(key2)
        if stage2 is not None:
            self.transport.exchange(mine, full)
            out = self._filtered_outputs(B, S, filters.top_n, hidden.device, stream,
                                         logprobs or in_capture)
            stage2(stream, records=full, sample_records=full, **dict(zip(OUT_NAMES, out)),
                   **per_call, **later)
            return out, on_device, per_call["side"]
        if plan is None:
            plan = self.plan(hidden, weight, merge=merge, num_samples=S, need_mass=True,
                             vocab_start=vocab_start, tiles=T, filters=filters,
                             masked=constraints.any)
        self.transport.exchange(mine, full)
        recs = records.records_view(full, planes, B, Tx, tile_major)
        with replay.record() as log2:
            out = self._filtered_stage2(plan, recs, hidden, weight, bias, params, filters,
                                        merge, S, n_real, vocab_start, constraints, per_call,
                                        later, on_device, gathered, logprobs)
        named2 = dict(per_call, **later, records=recs, sample_records=recs[:, :S],
                      **out._asdict())
        if stage2s is not None:
            self.replays.add_stage2(stage2s, key2, log2, named2)
        elif key is not None:
            self.replays.add_split(key, log1, dict(per_call, records=out_view), key2, log2,
                                   named2)
        return out, on_device, per_call["side"]

    def _filtered_outputs(self, B: int, S: int, n: int, device, stream: int,
                          logprobs: bool) -> F.FilteredOutput:
        """launchers.filtered_outputs for a replayed call; logprobs False (an eager call
        that returns neither log-probs nor top tokens): tokens fresh, the rest (log-probs,
        log Z, flags, the filter kernel's scratch) in buffers kept per (B, S, stream), as
        _outputs does (the host fallback reads the flags before the next call)."""
        if logprobs:
            return launchers.filtered_outputs(B, S, n, device, flat=True)
        key = ("filtered", B, S, stream)
        kept = self._discard.get(key)
        if kept is None:
            if len(self._discard) >= 16:
                self._discard.clear()
            kept = self._discard[key] = launchers.filtered_outputs(B, S, 0, device, flat=True)
        return kept._replace(tokens=torch.empty(kept.tokens.shape, dtype=torch.int64,
                                                device=device))

    def _fallback_buffers(self, on_device: bool, filters: Filters, per_call: dict, B: int,
                          T: int):
        """(later: the stage-2 launches' per-call tensors beyond per_call, gathered: the
        transport's rows_gather views or None) of a filtered call."""
        later = dict(top_k=filters.top_k, top_p=filters.top_p, min_p=filters.min_p)
        if on_device:
            self._with_gate(later)
        gathered = None
        if on_device and self.gather_fallback:  # the flagged rows' logit shards, gathered
            # (before key2: a grown buffer changes the transport's key)
            gathered = self.transport.rows_gather(B, T * records.TILE)
        elif on_device and per_call["side"] is None:  # the rows' logits, recomputed there
            later["fallback_logits"] = torch.empty(B, T * records.TILE, dtype=torch.float32,
                                                   device=per_call["hidden"].device)
        return later, gathered

    def _with_gate(self, later: dict) -> None:
        """later with the gate of the current stream (tpsample/fallback_gate.py), in a
        one-device call whose fallback runs on the device (TPSAMPLE_FALLBACK_GATE on)."""
        if knobs.FALLBACK_GATE and not self.gather_fallback:
            dev = self.device
            later["gate"] = self.gates.get(replay.current_stream(dev.index)
                                           if dev.type == "cuda" else None)

    def _filtered_stage2(self, plan: Plan, recs, hidden, weight, bias, params: RowParams,
                         filters: Filters, merge: str, S: int, n_real: int, vocab_start: int,
                         constraints: C.Constraints, per_call: dict, later: dict,
                         on_device: bool, gathered, logprobs: bool) -> F.FilteredOutput:
        """A filtered call's stage 2 through Triton's dispatch (run inside a replay record):
        the candidate reduce, then the device fallback where on_device (gathered: the
        transport's rows_gather views under TP)."""
        fanout = self.transport.fanout()
        gather = None
        if gathered is not None:
            gather = launchers.FallbackGather(*gathered, self.transport.calls, self.shard_starts,
                                              self.transport.gather_exchange,
                                              self.transport.rank)
        out = launchers.filtered_outputs(hidden.shape[0], S, filters.top_n, hidden.device)
        launchers.stage2_filtered(plan, recs, params, filters,
                                  *(fanout[1:] if fanout else ()), head=recs[:, :S], out=out,
                                  tokens_only=not logprobs, gate=later.get("gate"))
        if on_device:
            launchers.fallback_on_device(hidden, weight, bias, params, filters, out,
                                         later.get("fallback_logits"),
                                         self.fallback.counter(), n_real=n_real,
                                         vocab_start=vocab_start, constraints=constraints,
                                         listed=listed_scratch(per_call), pdl=plan.pdl,
                                         gather=gather, side=per_call["side"],
                                         winner=merge == "max", logprobs=logprobs, recs=recs,
                                         parity=fanout[1] if fanout else None,
                                         parity_stride=fanout[2] if fanout else 0,
                                         gate=later.get("gate"))
        return out

    def _on_device(self, fast: bool, hidden, in_capture) -> bool:
        """Whether this filtered call's exact fallback runs on the device (decided once per
        call: FallbackChoice counts the calls it is asked about). Calls on the cut's fast
        path (fast_fallback) always take the device path (kernels/filter_cut.py)."""
        return ((self.transport.world == 1 or self.gather_fallback)
                and (fast or self.fallback.device_now(hidden, in_capture)))

    def lazy_side(self, hidden, in_capture) -> bool:
        """Whether a one-device call whose rows may take the cut's fast path
        (cut_rows_possible) skips the side output (FallbackChoice.side_output decides;
        counted per call)."""
        return (self.transport.world == 1 and self.backend != "torch"
                and not self.fallback.side_output(hidden, in_capture))

    def _key2(self, on_device: bool, filters: Filters, per_call: dict, later: dict,
              logprobs: bool) -> tuple:
        """A filtered call's stage-2 replay key under its stage-1 key: the fallback path, the
        top log-probs, whether every row has a top-k (the fallback then launches no fast-path
        step), whether log-probs are returned (a tokens-only call's fallback skips
        the cut where it can), the transport's buffers, and the per-call tensors' alignments
        and layout (per_call with its side output, later: the filters' tensors and the
        fallback's logits buffer)."""
        return (on_device, filters.top_n, filters.top_k_every_row, logprobs,
                self.transport.key(),
                replay.tensor_key(tuple(per_call.values()) + tuple(later.values())))

    def _filtered_graph_call(self, key, stage1, stage2s: dict, per_call: dict, filters,
                             side_out: bool, B: int, S: int, T: int, numel: int, stream: int,
                             logprobs: bool, tokens_out: torch.Tensor | None = None):
        """A filtered call whose fallback runs on the device, through its CUDA graph
        (tpsample/call_graphs.py; _graph_call for the plain path): a FilteredOutput with
        the returned outputs (tokens; log-probs and log Z with `logprobs`; the top tokens
        with top_logprobs), or None where the launches are re-issued instead. The side
        output, the records, the fallback's logits and the outputs live in the graph's
        pool; the graph is captured from the stage-2 replay these launches would take."""
        later = dict(top_k=filters.top_k, top_p=filters.top_p, min_p=filters.min_p)
        self._with_gate(later)
        n = T * records.TILE
        if self.gather_fallback:  # (a grown buffer changes the transport's key)
            self.transport.rows_gather(B, n)
        gkey = (key, filters.top_n, filters.top_k_every_row, logprobs, self.transport.key(),
                replay.tensor_key(tuple(later.values())), stream, tokens_out is not None)
        named = with_sink(dict(per_call, **later), tokens_out)
        graph = self.graphs.get(gkey)
        if graph is None:
            bound = self.graphs.due(gkey, named)
            if bound is None:
                return None
            dev = self.device

            def fresh():  # the per-call buffers the re-issued launches allocate
                side = torch.empty(B, n, dtype=torch.float32, device=dev) if side_out else None
                extra = {} if side_out or self.gather_fallback else dict(
                    fallback_logits=torch.empty(B, n, dtype=torch.float32, device=dev))
                return side, extra
            side, extra = fresh()
            stage2 = stage2s.get(self._key2(True, filters, dict(per_call, side=side),
                                            dict(later, **extra), logprobs))
            del side, extra
            if stage2 is None:  # (not recorded yet for this layout)
                return None

            def launch(stream, named, outputs=None):
                side, extra = fresh()
                mine, full = self.transport.slots(numel)
                stage1(stream, records=mine, side=side, **named)
                self.transport.exchange(mine, full)
                out = launchers.filtered_outputs(B, S, filters.top_n, dev, flat=True)._asdict()
                if named.get("out") is not None:  # (the caller's out: tokens straight there)
                    out["tokens"] = named["out"]
                out.update(outputs or ())  # (an output slot's: call_graphs.Slot)
                stage2(stream, records=full, sample_records=full, **out, **named,
                       side=side, **extra)
                return out
            graph = self.graphs.capture(gkey, named, bound, launch, gated="gate" in later)
            if graph is None:
                return None
        returned = RETURNED[logprobs] + (TOP if filters.top_n else ())
        out = self.graphs.replay(gkey, graph, named, returned)
        if out is None:
            return None
        side = ("side" if side_out else "lazy") if cut_rows_possible(filters) else None
        self.last_graph = (gkey, graph, named, returned, True,
                           side if fast_fallback(filters) else
                           "device" if side is None else "device " + side)
        return F.FilteredOutput(*(out.get(f) for f in OUT_NAMES))

OUT_NAMES = F.FilteredOutput._fields
TOP = ("top_tokens", "top_logprobs")


def fast_fallback(filters: Filters) -> bool:
    """Whether every row such a call flags takes kernels/filter_cut.py's fast path (top-p /
    min-p without top-k, top log-probs (a row whose top n the known prefix lacks takes the
    per-row path) or samples without replacement): such calls always take the device
    fallback where there is one."""
    return (filters.replacement and not filters.top_n and filters.top_k is None
            and (filters.top_p is not None or filters.min_p is not None))


def special(filters: Filters) -> bool:
    """Whether a call takes the candidate path (tpsample/filters.py)."""
    return filters.needs_candidates or not filters.replacement
