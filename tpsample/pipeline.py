"""One call's data flow: stage 1 → exchange → stage 2, and the launch-replay cache.

    plan      which kernels (tpsample/plan.py), resolved on the first call of a shape
    stage 1   records of this device's rows into its exchange slot (tpsample/launchers.py,
              or the torch path: tpsample/torch_records.py)
    exchange  the transport makes every rank's slot valid on every rank (tpsample/transport.py;
              one device: nothing to do)
    stage 2   the records of all slots → tokens, log-probs, log Z (launchers.stage2, or the
              torch merge: tpsample/merge.py); with filters, top log-probs or samples without
              replacement also the candidate reduce (tpsample/filters.py), then the exact
              fallback for the rows it could not certify (on the device, or from the host:
              tpsample/host_fallback.py, as tpsample/fallback_choice.py decides)

tpsample.sample runs a process-wide local pipeline; every VocabParallelSampler owns one
with its transport. On CUDA, a call with the key of an earlier one (shapes, strides,
dtypes, pointer alignments, options, exchange buffers) re-issues that call's recorded
launches with the new tensors (tpsample/replay.py): no plan lookup and no Triton dispatch;
from the key's third such eager call, as one CUDA graph (tpsample/call_graphs.py).
A call's parameters arrive validated as a SamplingSpec (tpsample/spec.py).
"""
from __future__ import annotations

import warnings

import torch

from . import constraints as C
from . import fallback_gate, launchers, records, replay
from .params import NO_FILTERS, Filters, RowParams
from .spec import SamplingSpec
from .plan import DeviceKind, Layout, Plan, make_plan
from .torch_records import merge_records, records_torch
from .transport import LocalTransport, Transport
from .constrained_stage1 import constraint_key, constraint_tensors, stage1_constrained
from .call_graphs import RETURNED, CallGraphs, with_sink
from .fallback_choice import FallbackChoice
from .filtered_calls import FilteredCalls, fast_fallback, special

__all__ = ["Pipeline", "fast_fallback", "merge_records", "special", "with_sink"]

_WARNED: set = set()


def _warn_gluon_fallback(plan: Plan, device: DeviceKind) -> None:
    """One warning per process when a Hopper GPU cannot run the Gluon kernels its table
    chose because of the installed Triton (the plan says so; other fallbacks are silent)."""
    missing = device.gluon_missing
    if (device.hopper and missing and missing not in _WARNED
            and any(why == missing for _, why in plan.fallbacks)):
        _WARNED.add(missing)
        warnings.warn(f"tpsample: {missing}; the cuBLAS + records-pass path runs instead "
                      "(same tokens, slower at B >= 64). tpsample.explain(...) shows the plan.",
                      RuntimeWarning, stacklevel=4)


class Pipeline(FilteredCalls):
    """Stage 1 → exchange → stage 2 on one device for a given transport (default: local).
    fixed_weight: the weight every call passes (a sampler's shard): its launches then keep
    it instead of substituting it per call, and the replay key leaves it out."""

    def __init__(self, backend: str, device: torch.device, transport: Transport | None = None,
                 fixed_weight: torch.Tensor | None = None, shard_starts: list[int] | None = None):
        self.backend = backend
        self.device = device
        self.transport = transport if transport is not None else LocalTransport(device)
        self.fixed_weight = fixed_weight
        self.replays = replay.CallReplays()
        self._discard: dict = {}  # (B, S, stream) -> outputs of tokens-only calls (see _outputs)
        # repeated eager calls as CUDA graphs: one device, or a transport whose exchange is a
        # device-side kernel (symm_mem); not NCCL / gloo (host-side bookkeeping per call)
        graphable = device.type == "cuda" and (self.transport.world == 1 or
                                               getattr(self.transport, "device_gather", False))
        self.graphs = CallGraphs(device) if graphable else None
        self.candidate_rows = 0  # rows of candidate-path calls, and how many of them took
        self.host_fallback_rows = 0  # the exact fallback (tpsample/filters.py, 5.) from the
        # host (the device's count: self.fallback.device_rows)
        # transports that gather rows on the device (symm_mem): the exact fallback of
        # filtered calls stays on the device under TP too, with the flagged rows' logit
        # shards gathered through the transport; shard_starts: each rank's first global id
        self.gather_fallback = getattr(self.transport, "device_gather", False)
        self.shard_starts = None
        if self.gather_fallback:
            self.shard_starts = torch.tensor(shard_starts if shard_starts is not None else [0],
                                             dtype=torch.int64, device=device)
        self.fallback = FallbackChoice(device, deterministic=self.gather_fallback)
        self.gates = fallback_gate.Gates(device)  # (one device's filtered calls)
        # (graph key, graph, the tensors it read, returned names, filtered, what its fallback
        # depends on: None, "device" (FallbackChoice.device_now), "side" / "lazy" (the side
        # output written or not: lazy_side), or "device side" / "device lazy" (both)) of the
        # last run() that went through a graph, else None: what tpsample/call_memo.py keeps
        self.last_graph = None

    @property
    def fallback_rows(self) -> int:
        """Rows that took the exact fallback so far (reading it synchronises with the device)."""
        rows = self.fallback.device_rows
        dev = 0 if rows is None else int(rows.sum().item())
        return self.host_fallback_rows + dev

    def _graph_call(self, key, per_call: dict, returned: tuple, stage1, stage2, sizes):
        """The call through its CUDA graph (tpsample/call_graphs.py; key: (replay key, the
        current stream), so that a graph's inputs are only ever written in its stream's
        order): {name: output} of the `returned` outputs, or None where the launches are
        re-issued instead (before the capture, a failed capture, or a bound tensor that lies
        elsewhere)."""
        graph = self.graphs.get(key)
        if graph is None:
            bound = self.graphs.due(key, per_call)
            if bound is None:
                return None
            numel, B, S = sizes

            def launch(stream, named, outputs=None):
                mine, full = self.transport.slots(numel)
                stage1(stream, records=mine, **named)
                self.transport.exchange(mine, full)
                out = replay.reduce_outputs(B, S, self.device)
                if named.get("out") is not None:  # (the caller's out: tokens straight there)
                    out["tokens"] = named["out"]
                out.update(outputs or ())  # (an output slot's: call_graphs.Slot)
                stage2(stream, records=full, **out, **named)
                return out
            graph = self.graphs.capture(key, per_call, bound, launch)
            if graph is None:
                return None
        out = self.graphs.replay(key, graph, per_call, returned)
        if out is not None:
            self.last_graph = (key, graph, per_call, returned, False, None)
        return out

    def _outputs(self, B: int, S: int, device, stream: int, logprobs: bool) -> dict:
        """Fresh stage-2 outputs for a replayed call; logprobs False (a tokens-only eager
        call): the log-probs and log Z go to a buffer kept per (B, S, stream), never returned
        (two allocations less per call; one per stream, so that its memory is only reused
        after that stream's last write)."""
        if logprobs:
            return replay.reduce_outputs(B, S, device)
        shape = (B,) if S == 1 else (B, S)
        discard = self._discard.get((B, S, stream))
        if discard is None:
            if len(self._discard) >= 16:
                self._discard.clear()
            discard = self._discard[(B, S, stream)] = (torch.empty(shape, device=device),
                                               torch.empty(B, device=device))
        return dict(tokens=torch.empty(shape, dtype=torch.int64, device=device),
                    logprobs=discard[0], logz=discard[1])

    @staticmethod
    def _mask_words(weight: torch.Tensor, vocab_start: int) -> int:
        """Words of a mask covering this slot's global ids."""
        return C.mask_words(vocab_start + weight.shape[0])

    def plan(self, hidden: torch.Tensor, weight: torch.Tensor, *, merge: str, num_samples: int,
             need_mass: bool, vocab_start: int = 0, tiles: int | None = None,
             filters: Filters = NO_FILTERS, masked: bool = False) -> Plan:
        """The plan of a call with these tensors (what run() uses when given none)."""
        kind = DeviceKind.of(hidden.device)
        fan = self.transport.fanout()
        layout = Layout.of(hidden, weight, vocab_start, 0 if fan is None else self.transport.world)
        plan = make_plan(kind, B=hidden.shape[0], D=hidden.shape[1], V=weight.shape[0],
                         dtype=hidden.dtype, merge=merge, num_samples=num_samples,
                         need_mass=need_mass, layout=layout, tiles=tiles,
                         slots=self.transport.world, backend=self.backend,
                         candidates=special(filters), replacement=filters.replacement,
                         raw_mass=filters.raw, masked=masked)
        _warn_gluon_fallback(plan, kind)
        return plan

    def run(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            spec: SamplingSpec, *, n_real: int, need_mass: bool, vocab_start: int = 0,
            tiles: int | None = None, plan: Plan | None = None,
            trace: torch.Tensor | None = None, in_capture: bool | None = None,
            tokens_out: torch.Tensor | None = None):
        """tokens int64 [B, S], logprobs fp32 [B, S], logz fp32 [B] and top (None, or
        (top_tokens int64 [B, n], top_logprobs fp32 [B, n])) of one call.

        hidden [B, D] contiguous, weight [V_rows, D] (this device's rows: global ids
        [vocab_start, vocab_start + V_rows)), bias fp32 [V_rows] or None, spec: the call's
        validated parameters (tpsample/spec.py; with filters, top log-probs or samples
        without replacement the plan emits candidate planes, listed tokens add one tile per
        slot); rows [n_real, V_rows) are padding; tiles: tiles per slot (default: this
        weight's); plan: an explicit plan (tools) instead of make_plan's; trace: see
        launchers.stage1; in_capture: whether the current stream captures a CUDA graph, when
        the caller knows (params.capturing); tokens_out: the caller's int64 tokens tensor
        (params.sink: aligned, the public shape) that replayed launches and graphs write the
        tokens into, else None; the returned tokens may then be it (or not: the caller
        copies them, params.write_out).

        With S = 1 a filtered call's tokens and logprobs may come back [B] or [B, 1]; a
        tokens-only call (spec.return_logprobs False, merge "max", no candidates) may return
        logprobs and logz that a later call overwrites."""
        self.last_graph = None
        if special(spec.filters):
            return self._run_filtered(hidden, weight, bias, spec.row, n_real=n_real,
                                      merge=spec.merge, num_samples=spec.num_samples,
                                      vocab_start=vocab_start, tiles=tiles, filters=spec.filters,
                                      constraints=spec.constraints, in_capture=in_capture,
                                      tokens_out=tokens_out, logprobs=spec.return_logprobs
                                      or bool(spec.filters.top_n))
        T = tiles if tiles is not None else records.num_tiles(weight.shape[0])
        Tx = T + int(spec.constraints.listed)  # tiles per slot in the records
        numel = spec.num_samples * hidden.shape[0] * Tx * records.WIDTH
        if self.backend == "torch":
            return self._run_torch(hidden, weight, bias, spec, plan or self._plain_plan(
                hidden, weight, spec, need_mass, vocab_start, T), n_real, vocab_start, T, numel)
        slots = self._slots_first(numel)
        per_call = self._call_tensors(hidden, weight, bias, spec.row, spec.constraints,
                                      vocab_start)
        key = None
        if hidden.is_cuda and trace is None and replay.Replay.usable():
            key = (plan, hidden.device, hidden.shape, hidden.stride(), n_real, vocab_start, T,
                   spec.num_samples, spec.merge, need_mass, self.transport.key(),
                   constraint_key(spec.constraints), replay.tensor_key(tuple(per_call.values())),
                   None if weight is self.fixed_weight else (weight.shape, weight.stride()))
            # (the records buffers need no key: fresh ones are allocator-aligned, and the
            # transports' persistent ones are in transport.key())
            hit = self.replays.get(key)
            if hit is not None:
                return self._replayed(key, hit, per_call, slots, spec, numel, in_capture,
                                      tokens_out)
        plan = plan or self._plain_plan(hidden, weight, spec, need_mass, vocab_start, T)
        return self._recorded(key, plan, hidden, weight, bias, spec, per_call, slots, numel,
                              n_real=n_real, vocab_start=vocab_start, Tx=Tx, trace=trace)

    def _plain_plan(self, hidden, weight, spec: SamplingSpec, need_mass: bool,
                    vocab_start: int, T: int) -> Plan:
        return self.plan(hidden, weight, merge=spec.merge, num_samples=spec.num_samples,
                         need_mass=need_mass, vocab_start=vocab_start, tiles=T,
                         masked=spec.constraints.any)

    def _call_tensors(self, hidden, weight, bias, params: RowParams, constraints, vocab_start):
        """{name: tensor} of what a call's launches take per call, which a replay substitutes
        (the weight only when it is not the sampler's fixed shard)."""
        per_call = dict(hidden=hidden, inv_temp=params.inv_temp, seed=params.seed,
                        offset=params.offset, bias=bias)
        if constraints.any:
            per_call.update(constraint_tensors(constraints, hidden,
                                               self._mask_words(weight, vocab_start)))
        if weight is not self.fixed_weight:
            per_call["weight"] = weight
        return per_call

    def _run_torch(self, hidden, weight, bias, spec: SamplingSpec, plan: Plan, n_real: int,
                   vocab_start: int, T: int, numel: int):
        """A plain call of the torch backend: records in torch, the exchange, the torch merge."""
        params, constraints, S = spec.row, spec.constraints, spec.num_samples
        B, Tx = hidden.shape[0], T + int(constraints.listed)
        mine, full = self.transport.slots(numel)
        rec = records_torch(hidden, weight, bias=bias, inv_temp=params.inv_temp,
                            seed=params.seed, offset=params.offset, num_samples=S,
                            n_real=n_real, vocab_start=vocab_start, num_tiles=T, cdf=plan.cdf,
                            constraints=constraints)
        records.records_view(mine, S, B, Tx).copy_(rec)
        self.transport.exchange(mine, full)
        return (*merge_records(records.records_view(full, S, B, Tx), params, spec.merge), None)

    def _replayed(self, key, hit, per_call: dict, slots, spec: SamplingSpec, numel: int,
                  in_capture, tokens_out):
        """A plain call whose launches were recorded under key: through its CUDA graph where
        it has one, else its launches re-issued with this call's tensors."""
        stage1, stage2 = hit
        hidden, S = per_call["hidden"], spec.num_samples
        B = hidden.shape[0]
        stream = replay.current_stream(hidden.device.index)
        if (self.graphs is not None and self.graphs.usable(in_capture)
                and not spec.constraints.listed):  # (its scratch is per call)
            out = self._graph_call((key, stream, tokens_out is not None),
                                   with_sink(per_call, tokens_out),
                                   RETURNED[spec.return_logprobs], stage1, stage2,
                                   (numel, B, S))
            if out is not None:
                return out.get("tokens"), out.get("logprobs"), out.get("logz"), None
        mine, full = slots or self.transport.slots(numel)
        stage1(stream, records=mine, **per_call)
        self.transport.exchange(mine, full)
        out = self._outputs(B, S, hidden.device, stream,
                            spec.return_logprobs or in_capture is not False)
        if tokens_out is not None:
            out["tokens"] = tokens_out
        stage2(stream, records=full, **out, **per_call)
        return out["tokens"], out["logprobs"], out["logz"], None

    def _recorded(self, key, plan: Plan, hidden, weight, bias, spec: SamplingSpec,
                  per_call: dict, slots, numel: int, *, n_real: int, vocab_start: int, Tx: int,
                  trace):
        """A plain call through Triton's dispatch, its launches recorded under key (None:
        not replayable)."""
        params, S, B = spec.row, spec.num_samples, hidden.shape[0]
        fanout = self.transport.fanout()
        tile_major = fanout is not None  # P2P stores: one contiguous run per stage-1 program
        mine, full = slots or self.transport.slots(numel)
        out_view = records.records_view(mine, S, B, Tx, tile_major)
        with replay.record() as log1:
            stage1_constrained(plan, hidden, weight, bias, params, out_view, per_call,
                               spec.constraints, n_real=n_real, vocab_start=vocab_start,
                               fanout=fanout[:2] if fanout else None, trace=trace)
        self.transport.exchange(mine, full)
        full_view = records.records_view(full, S, B, Tx, tile_major)
        with replay.record() as log2:
            tokens, logprobs, logz = launchers.stage2(
                plan, full_view, params, *(fanout[1:] if fanout else ()))
        self.replays.add(key, log1, dict(per_call, records=out_view), log2,
                         dict(per_call, records=full_view, tokens=tokens, logprobs=logprobs,
                              logz=logz))
        return tokens, logprobs, logz, None

    def _slots_first(self, numel: int):
        """The exchange slots of a transport with a persistent buffer, taken before its
        fanout and key are read (a larger call grows the buffer: new peer addresses, a new
        key); None for the local transport, whose fresh buffer is taken only where a call
        uses it (a graph replay does not)."""
        return None if self.transport.world == 1 else self.transport.slots(numel)
