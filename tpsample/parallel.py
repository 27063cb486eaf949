"""VocabParallelSampler: exact sampling from a vocabulary-sharded LM head.

Each rank runs stage 1 on its shard [V_r, D] (records keyed by GLOBAL token ids), the
records of all ranks meet in every rank's exchange buffer (tpsample.transport), and every
rank reduces all [world × tiles] records locally: the same tokens on every rank, with
O(B × tiles × world) bytes exchanged instead of an all-gather of [B, V] logits.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from . import constraints as C
from . import drawn_seeds, knobs
from . import params as P
from . import verify as VF
from .call_memo import CallMemo, signature
from .pipeline import Pipeline
from .records import num_tiles
from .spec import sampling_spec
from .transport import ExchangeTimeout, GroupRef, all_gather_flat, make_transport

MERGE_IDS = {m: i for i, m in enumerate(P.MERGES)}


class VocabParallelSampler:
    """Sampler over a vocabulary-parallel LM head (Megatron layout).

    Args:
        weight_shard: [V_r, D] this rank's rows of the LM head (bf16 / fp16 / fp32, rows
            contiguous), global ids [vocab_start, vocab_start + V_r).
        vocab_size: global number of real tokens; rows at or beyond it are padding and are
            never sampled. Must not exceed the rows the shards cover.
        vocab_start: first global id of this shard; None = shards are contiguous in rank
            order (rank r starts after the rows of ranks < r). Shards must tile [0, total)
            without gaps or overlaps.
        group: process group (None = WORLD).
        max_batch: the exchange buffer is sized once for this many rows (× num_samples);
            larger calls grow it (a collective re-allocation on every rank).
        transport: "auto" | "symm_mem" | "nccl" | "gloo" (see tpsample.transport).
        merge: "max" (pathwise; tokens identical to tpsample.sample on the full weight, for
            any world size), "logmass" or "cdf" (exact, but tokens depend on the partition;
            see tpsample.sample).
        timeout_s: how long an exchange may wait for peers before ExchangeTimeout (see
            check_exchange and tpsample/transport.py for when each transport raises it).
            With gloo or nccl, build the group with the same timeout (the collective's own
            bound); the transport warns where the group's is longer.
        check_inputs: every call, all ranks compare (B, D, num_samples, merge, dtypes) and
            raise on disagreement. On CUDA this costs a tiny all-gather and a host sync per
            call; turn it off in production once the integration is tested.
        backend: stage-1/2 implementation, as in tpsample.sample ("auto", "triton", "torch").
        logprobs: False promises that no call asks for log-probs (return_logprobs=True then
            raises): stage 1 skips the tile log-masses and the winners' logits, as
            tpsample.sample does when return_logprobs=False. Max merge only; must be the same
            on every rank (checked at construction).

    Call: sampler(hidden [B, D], temperature=1.0, seed=None, offset=0, bias=None,
    num_samples=1, return_logprobs=False, top_k=None, top_p=None, min_p=None,
    top_logprobs=0, replacement=True, logprobs_mode="processed", allowed_mask=None,
    logit_adjust=None, repetition_penalty=None, out=None) → exactly what tpsample.sample
    returns, with global token ids, identical on every rank (filtered rows: the same tokens as
    tpsample.sample on the full weight, whatever the merge). hidden, temperature, seed,
    offset, the filters and the constraints must be equal on all ranks (allowed_mask the
    full [B, ceil(vocab / 32)] mask, logit_adjust's ids global ids: each rank uses the bits
    and ids of its own range); bias is this rank's slice [V_r]. Calls with filters,
    top_logprobs, replacement=False or logprobs_mode="raw" redo a row without a certificate
    from its logit shards on every rank (tpsample/filters.py, 5.). Over symmetric memory the
    shards are gathered on the device (no host synchronisation; such calls can be captured
    in a CUDA graph), into a persistent fp32 [world, B, tiles * 128] symmetric buffer per
    sampler, the size of the batch's logits (156 MB per rank at B = 256, V = 151936), made
    at the first such call of a larger B. Over NCCL and gloo they read the rows' flags back
    to the host (one synchronisation per call, not capturable).

    seed=None: a generator seeded identically on every rank at construction (rank 0 draws
    the base seed from torch's default generator and broadcasts it once) draws the row
    seeds (on CUDA from its Philox state on the host: tpsample/drawn_seeds.py); since all
    ranks make the same calls with the same B, their draws agree without any per-call
    communication or host sync. When capturing a CUDA graph pass explicit
    seed/offset tensors (update them in place between replays).
    """

    def __init__(self, weight_shard: torch.Tensor, *, vocab_size: int, vocab_start: int | None = None,
                 group: dist.ProcessGroup | None = None, max_batch: int = 256,
                 transport: str = "auto", merge: str = "max", timeout_s: float = 300.0,
                 check_inputs: bool = True, backend: str = "auto", logprobs: bool = True):
        if not dist.is_initialized():
            raise RuntimeError("VocabParallelSampler needs torch.distributed to be initialised "
                               "(torchrun + dist.init_process_group)")
        self._group = GroupRef(group if group is not None else dist.group.WORLD)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        P.check_matrix("weight_shard", weight_shard)
        if weight_shard.stride(1) != 1:
            raise ValueError("weight_shard rows must be contiguous (stride(1) == 1)")
        P.check_options(1, merge, backend)
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if vocab_start is not None and (not isinstance(vocab_start, int) or vocab_start < 0):
            raise ValueError(f"vocab_start must be None or an int >= 0, got {vocab_start!r}")
        if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                or not 0 < timeout_s <= 1e6):
            raise ValueError(f"timeout_s must be a number of seconds in (0, 1e6], got {timeout_s!r}")
        if not isinstance(logprobs, bool):
            raise TypeError(f"logprobs must be a bool, got {type(logprobs).__name__}")
        if not logprobs and merge != "max":
            raise ValueError(f"logprobs=False needs merge='max' (merge={merge!r} needs the tile "
                             "masses)")
        self.weight = weight_shard
        self.logprobs = logprobs
        self.device = weight_shard.device
        self.merge = merge
        self.check_inputs = check_inputs
        self.backend = P.resolve_backend(backend, self.device)
        self.transport = make_transport(transport, self.group, self.device, timeout_s)

        V_r, D = weight_shard.shape
        layouts = self._all_gather_object((V_r, D, str(weight_shard.dtype), vocab_start, logprobs))
        if len({l[4] for l in layouts}) != 1:
            raise ValueError(f"logprobs differs across ranks: {[l[4] for l in layouts]}")
        layouts = [l[:4] for l in layouts]
        self._check_layout(layouts, vocab_size)
        starts = [s for (_, _, _, s) in layouts]
        if vocab_start is None:
            vocab_start = sum(v for (v, _, _, _) in layouts[: self.rank])
            starts = [sum(v for (v, _, _, _) in layouts[:r]) for r in range(self.world)]
        self.vocab_start = vocab_start
        self.vocab_size = vocab_size
        self.shard_starts = starts
        self.n_real = max(0, min(V_r, vocab_size - vocab_start))
        self.tiles = max(num_tiles(v) for (v, _, _, _) in layouts)
        self.rows_total = sum(v for (v, _, _, _) in layouts)
        self.shard_width = max(v for (v, _, _, _) in layouts)  # (verify_drafts' all-gather)
        self._gathered_ids = None  # verify_drafts: the all-gathered columns' ids, built once
        self.transport.reserve(max_batch * self.tiles * 4)

        base = torch.randint(0, P.SEED_HIGH, (1,), dtype=torch.int64)
        base = self._broadcast_cpu(base)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int(base))
        self.pipeline = Pipeline(self.backend, self.device, self.transport, fixed_weight=weight_shard,
                                 shard_starts=starts)
        self.memo = CallMemo()  # repeated calls straight to their graph (call_memo.py)

    # -- construction helpers ------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup:
        """The process group (held by weak reference: transport.GroupRef)."""
        return self._group()

    def _all_gather_object(self, obj):
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _broadcast_cpu(self, t: torch.Tensor) -> torch.Tensor:
        src = dist.get_global_rank(self.group, 0)
        if self.device.type == "cuda":
            t = t.to(self.device)
            dist.broadcast(t, src=src, group=self.group)
            return t.cpu()
        dist.broadcast(t, src=src, group=self.group)
        return t

    def _check_layout(self, layouts, vocab_size):
        Ds = {d for (_, d, _, _) in layouts}
        if len(Ds) != 1:
            raise ValueError(f"weight_shard D differs across ranks: {[d for (_, d, _, _) in layouts]}")
        dtypes = {t for (_, _, t, _) in layouts}
        if len(dtypes) != 1:
            raise TypeError(f"weight_shard dtype differs across ranks: {[t for (_, _, t, _) in layouts]}")
        given = [s is not None for (_, _, _, s) in layouts]
        if any(given) and not all(given):
            raise ValueError("vocab_start must be given on every rank or on none")
        sizes = [v for (v, _, _, _) in layouts]
        if all(given):
            order = sorted(range(self.world), key=lambda r: layouts[r][3])
            pos = 0
            for r in order:
                if layouts[r][3] != pos:
                    raise ValueError(
                        "vocab_start layout is inconsistent: shards must tile [0, total) without gaps "
                        f"or overlaps; got (start, rows) per rank {[(l[3], l[0]) for l in layouts]}")
                pos += sizes[r]
        total = sum(sizes)
        P.check_vocab_size(vocab_size, total, "the rows all shards cover")

    def check_exchange(self, synchronize: bool = True) -> None:
        """Raise ExchangeTimeout now if an exchange of the calls issued so far failed.

        synchronize=True waits for those calls (a host synchronisation: symm_mem waits for
        the current stream, nccl for the newest all-gather, at most timeout_s).
        synchronize=False only reports what the host already knows (the device wait's status
        in pinned memory, NCCL results already in), without blocking: what a loop replaying
        a captured CUDA graph calls between replays, since replays never call the sampler.
        Without either, a failure raises at the sampler's next call. After an
        ExchangeTimeout every call raises it again: the ranks are out of step; build a new
        sampler on a new group."""
        self.transport.check(synchronize=synchronize)

    # -- the call ----------------------------------------------------------------------------
    def _check_call(self, hidden, num_samples, constraints):
        layout = (-1 if constraints.mask is None else constraints.mask.shape[1],
                  -1 if constraints.ids is None else constraints.ids.shape[1])
        meta = torch.tensor([hidden.shape[0], hidden.shape[1], num_samples, MERGE_IDS[self.merge],
                             P.FLOAT_DTYPES.index(hidden.dtype), *layout], dtype=torch.int64,
                            device=self.device)
        allm = torch.empty(self.world, meta.numel(), dtype=torch.int64, device=self.device)
        work = all_gather_flat(allm.view(-1), meta, group=self.group, async_op=True)
        self.transport.wait(work, "the per-call input check")
        allm = allm.cpu()
        if not (allm == allm[0]).all():
            names = ["B", "D", "num_samples", "merge", "dtype", "allowed_mask width",
                     "logit_adjust width"]
            bad = [n for i, n in enumerate(names) if not (allm[:, i] == allm[0, i]).all()]
            raise ValueError(f"ranks disagree on {', '.join(bad)}: per-rank (B, D, num_samples, "
                             f"merge, dtype, mask words, adjust ids) = "
                             f"{allm.tolist()}; every rank must call the sampler with the same batch")

    def __call__(self, hidden: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                 seed: int | torch.Tensor | None = None, offset: int | torch.Tensor = 0,
                 bias: torch.Tensor | None = None, num_samples: int = 1,
                 return_logprobs: bool = False, top_k=None, top_p=None, min_p=None,
                 top_logprobs: int = 0, replacement: bool = True,
                 logprobs_mode: str = "processed", allowed_mask: torch.Tensor | None = None,
                 logit_adjust=None, repetition_penalty=None,
                 out: torch.Tensor | None = None) -> torch.Tensor | P.SampleOutput:
        self.transport.check()  # an earlier exchange that failed on the device raises here
        sig, checked = None, False
        if knobs.MEMO and type(hidden) is torch.Tensor and hidden.is_cuda:
            sig = signature(hidden, self.weight, bias, seed, offset, (
                temperature, num_samples, return_logprobs, top_k, top_p, min_p, top_logprobs,
                replacement, logprobs_mode, allowed_mask, logit_adjust, repetition_penalty), out)
            if sig is not None and sig in self.memo.entries:  # (a call validated before)
                checked = self.check_inputs and not P.capturing(hidden.device)
                if checked:
                    self._check_call(hidden, num_samples, C.NO_CONSTRAINTS)
                res = self.memo.call(sig, hidden, seed, offset)
                if res is not None:
                    return res if out is None else P.write_out(res, out)
        P.check_hidden_weight(hidden, self.weight, "weight_shard")
        if return_logprobs is True and not self.logprobs:
            raise ValueError("return_logprobs=True, but this sampler was built with logprobs=False")
        if replacement is False and self.merge != "max":
            raise ValueError(f"replacement=False needs merge='max' (Gumbel-top-S); this sampler "
                             f"was built with merge={self.merge!r}")
        P.check_out(out, hidden, num_samples)
        given_bias, given_seed = bias, seed
        bias = P.check_bias(bias, self.weight.shape[0], hidden.device)
        B = hidden.shape[0]
        capturing = P.capturing(hidden.device)
        if seed is None:
            seed = self._draw_seed(B, self.device, capturing)
        spec = sampling_spec(hidden, vocab_size=self.vocab_size, rows=self.rows_total,
                             merge=self.merge, temperature=temperature, seed=seed,
                             offset=offset, num_samples=num_samples,
                             return_logprobs=return_logprobs, top_k=top_k, top_p=top_p,
                             min_p=min_p, top_logprobs=top_logprobs, replacement=replacement,
                             logprobs_mode=logprobs_mode, allowed_mask=allowed_mask,
                             logit_adjust=logit_adjust, repetition_penalty=repetition_penalty,
                             in_capture=capturing)
        if spec.candidates and not self.logprobs:
            raise ValueError("filters, top_logprobs, replacement=False and logprobs_mode='raw' "
                             "need the tile log-masses; this sampler was built with logprobs=False")
        if self.check_inputs and not capturing and not checked:  # (a host sync cannot be
            self._check_call(hidden, num_samples, spec.constraints)  # captured)
        if B == 0:
            return P.write_out(P.empty_result(hidden.device, num_samples, return_logprobs,
                                              spec.filters.top_n), out)
        tokens, logprobs, logz, top = self.pipeline.run(
            hidden.contiguous(), self.weight, bias, spec, n_real=self.n_real,
            need_mass=self.logprobs, vocab_start=self.vocab_start, tiles=self.tiles,
            in_capture=capturing, tokens_out=P.sink(out))
        if sig is not None and self.pipeline.last_graph is not None:
            self.memo.store(sig, self.pipeline, spec, given_seed, offset, given_bias, bias,
                            self._draw_base, out)
        return P.write_out(P.package(tokens, logprobs, logz, num_samples, return_logprobs, top),
                           out)

    def _draw_seed(self, B: int, device: torch.device, in_capture: bool = False) -> torch.Tensor:
        """The row seeds of a call with seed=None, from the generator every rank shares
        (tpsample/drawn_seeds.py, as tpsample.api's from torch's default generator)."""
        return drawn_seeds.draw(B, device, self.generator, in_capture)

    def _draw_base(self, device: torch.device) -> int:
        """The base of a memoised call's seeds for seed=None (the same values as _draw_seed)."""
        return drawn_seeds.next_base(self.generator)

    def verify_drafts(self, hidden: torch.Tensor, draft_tokens: torch.Tensor, *,
                      draft_probs: torch.Tensor | None = None,
                      temperature: float | torch.Tensor = 1.0,
                      seed: int | torch.Tensor | None = None, offset: int | torch.Tensor = 0,
                      bias: torch.Tensor | None = None, top_k=None, top_p=None, min_p=None,
                      return_logprobs: bool = False) -> VF.VerifyOutput:
        """tpsample.verify_drafts on this vocabulary-parallel head: hidden [B, S + 1, D],
        draft_tokens int64 [B, S] (global ids, -1 ends a request's drafts), draft_probs None
        or fp32 [B, S, vocab_size] (the full vocabulary on every rank), bias this rank's
        shard [V_r]; every argument equal on all ranks. The same VerifyOutput on every rank,
        equal to tpsample.verify_drafts on the full weight. One-hot drafts exchange what a
        sampler call on the B·(S + 1) rows exchanges; draft_probs exchanges the draft-probs
        kernels' per-chunk partials (two small all-gathers, three with min-p: tpsample/verify.py,
        _draft_probs_kernels) or, with top-k or top-p (their cut sorts whole rows) or the
        torch backend, all-gathers the rows' fp32 logits (B·(S + 1)·V·4 bytes)."""
        VF.check_hidden3(hidden)
        P.check_hidden_weight(hidden[:, 0], self.weight, "weight_shard")
        bias = P.check_bias(bias, self.weight.shape[0], hidden.device)
        VF.check_drafts(hidden, draft_tokens, draft_probs, self.vocab_size)
        local = VF.local_logits(self.weight, bias, self.n_real, self.vocab_start,
                                self.shard_width)

        def draft_logits(rows, inv_temp):
            l, _ = local(rows, inv_temp)
            full = self.transport.all_gather(l)  # [world, R, width]
            if self._gathered_ids is None:  # each gathered column's global id (fixed)
                width = torch.arange(self.shard_width, device=l.device)
                self._gathered_ids = torch.cat([s + width for s in self.shard_starts])
            return full.permute(1, 0, 2).reshape(l.shape[0], -1), self._gathered_ids

        def draw_seed(B):
            return torch.randint(0, P.SEED_HIGH, (B,), dtype=torch.int64, device=self.device,
                                 generator=self.generator)
        return VF.verify(hidden, draft_tokens, draft_probs,
                         sample_rows=lambda rows, **kw: self(rows, bias=bias, **kw),
                         draft_logits=draft_logits, draw_seed=draw_seed,
                         vocab_size=self.vocab_size, temperature=temperature, seed=seed,
                         offset=offset, top_k=top_k, top_p=top_p, min_p=min_p,
                         return_logprobs=return_logprobs, kernels=self.backend == "triton",
                         shard_logits=local, gather=self.transport.all_gather)


__all__ = ["VocabParallelSampler", "ExchangeTimeout"]
