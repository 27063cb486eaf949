"""Speculative-decoding verification: exact, through the fused sampler, one device and TP.

A draft proposes x_1 .. x_s for a request; the target's distributions p_0 .. p_s at those
positions (hidden [B, S + 1, D]: the S draft positions and the bonus one) accept x_i with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection a token from
normalise(max(0, p_i - q_i)) is emitted and the request stops; if all s drafts are accepted
a token from p_s is emitted. The emitted tokens are then distributed as s + 1 tokens
sampled from the target one after the other (the standard speculative-sampling argument).

One-hot drafts (draft_probs None: n-gram drafts, greedy draft heads): q_i is the point mass
at x_i, so x_i is accepted with probability p_i(x_i) and the residual is p_i without x_i,
renormalised. Both are what one sample y_i ~ p_i gives: P(y_i = x_i) = p_i(x_i), and given
y_i != x_i, y_i is distributed as p_i without x_i renormalised. So verification is one
ordinary sampler call on the B·(S + 1) rows — the fused kernel, its filters and its
exchange under TP, nothing materialised — with position i of request b sampled with
(seed_b, offset_b + i), and a scan: accept while y_i = x_i, emit the first y_i that differs
(or the bonus y_s). The tokens are those that ordinary decoding with the same seed and
offsets would have drawn at those positions, on any TP degree and at any batch position.

Full draft distributions (draft_probs [B, S, V]): the acceptance needs p_i(x_i) and the
residual needs p_i over the whole vocabulary, so the B·(S + 1) rows' logits are computed
(one matmul, W read once; under TP each rank's shard, all-gathered) and their log p taken
in float64 (the semantics of tpsample/filters.py); no sampler call, nothing fused. x_i is
accepted when u_i · q_i(x_i) < p_i(x_i), u_i = noise.uniform(seed_b, offset_b + i, 0, 0,
ACCEPT_STREAM). The verdicts come first; then one Gumbel-max pick per request with the
sampler's token noise at its position: at the first rejection over log max(0, p_i - q_i)
(so a draft equal to the target is always accepted), else at the bonus position over log
p (the token the sampler would draw there, up to the logits' rounding).
"""
from __future__ import annotations

import numbers
from typing import Callable, NamedTuple

import torch
import triton

from . import merge, noise, replay
from . import filters as F
from . import params as P
from .kernels import draft_scan
from .launchers import logits_fp32
from .records import ACCEPT_STREAM
from .spec import sampling_spec

DRAFT_PROBS_TOL = 1e-3  # |sum(q_i) - 1| allowed for a draft position's distribution


class VerifyOutput(NamedTuple):
    """tokens int64 [B, S + 1]: the accepted drafts, then the token from the residual (or the
    bonus token when every draft was accepted), then -1; num_accepted int64 [B]; logprobs
    fp32 [B, S + 1] (return_logprobs): the emitted tokens' log-probs under p (the processed
    distribution at their position), NaN after; else None."""
    tokens: torch.Tensor
    num_accepted: torch.Tensor
    logprobs: torch.Tensor | None


def check_hidden3(hidden) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3 or hidden.shape[1] < 1:
        raise ValueError("hidden must be a Tensor [B, S + 1, D] (the S draft positions and the "
                         f"bonus position), got {getattr(hidden, 'shape', type(hidden))}")


def check_drafts(hidden: torch.Tensor, draft_tokens, draft_probs, vocab_size: int) -> None:
    """Validate the shapes, dtypes and devices of hidden [B, S + 1, D], draft_tokens [B, S]
    and draft_probs (None or fp32 [B, S, vocab_size]); no device work (draft_rows checks the
    contents)."""
    check_hidden3(hidden)
    B, S1, _ = hidden.shape
    S = S1 - 1
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dtype not in (torch.int64,
                                                                                 torch.int32):
        raise TypeError("draft_tokens must be an int64 (or int32) Tensor [B, S], got "
                        f"{getattr(draft_tokens, 'dtype', type(draft_tokens))}")
    if tuple(draft_tokens.shape) != (B, S):
        raise ValueError(f"draft_tokens must be [B, S] = [{B}, {S}] (hidden is [B, S + 1, D]), "
                         f"got {list(draft_tokens.shape)}")
    if draft_tokens.device != hidden.device:
        raise ValueError(f"draft_tokens is on {draft_tokens.device}, hidden on {hidden.device}")
    if draft_probs is not None:
        if not isinstance(draft_probs, torch.Tensor) or draft_probs.dtype != torch.float32:
            raise TypeError("draft_probs must be None or a float32 Tensor [B, S, V], got "
                            f"{getattr(draft_probs, 'dtype', type(draft_probs))}")
        if tuple(draft_probs.shape) != (B, S, vocab_size):
            raise ValueError(f"draft_probs must be [B, S, V] = [{B}, {S}, {vocab_size}] (the "
                             f"full vocabulary), got {list(draft_probs.shape)}")
        if draft_probs.device != hidden.device:
            raise ValueError(f"draft_probs is on {draft_probs.device}, hidden on {hidden.device}")


_ROW_BUFFERS: dict = {}  # (B, S + 1, device, stream) -> draft_rows' outputs, reused


def _row_buffers(B: int, S1: int, dev) -> tuple:
    """draft_rows' outputs n int64 [B], bad int32 [B], seed_rows and offset_rows int64
    [B·S1], and an int64 [B] its int offset is filled into: one set per (B, S1, device,
    stream), written again by each call. Everything that reads them runs within the call,
    after the write, in the same stream, so the next call's write comes after those reads;
    and the sampler then gets the same seed and offset tensors every call, which its call
    memo (tpsample/call_memo.py) needs to serve it. New
    tensors during a CUDA-graph capture (the graph keeps those)."""
    def fresh():
        return (torch.empty(B, dtype=torch.int64, device=dev),
                torch.empty(B, dtype=torch.int32, device=dev),
                torch.empty(B * S1, dtype=torch.int64, device=dev),
                torch.empty(B * S1, dtype=torch.int64, device=dev),
                torch.empty(B, dtype=torch.int64, device=dev))
    return _per_stream(_ROW_BUFFERS, (B, S1), dev, fresh)


def _per_stream(cache: dict, key: tuple, dev, fresh: Callable):
    """fresh()'s tensors kept in cache per (key, device, stream): a call writes and reads
    them within itself, in stream order, so the next call on that stream may write them
    again. New ones during a CUDA-graph capture (the graph keeps those)."""
    if P.capturing(dev):
        return fresh()
    key = key + (dev, replay.current_stream(dev.index) if dev.type == "cuda" else 0)
    got = cache.get(key)
    if got is None:
        if len(cache) >= 64:
            cache.clear()
        got = cache[key] = fresh()
    return got


def request_key(name: str, value, B: int, device) -> torch.Tensor:
    """seed or offset (an int, or a Tensor[B] int64 / int32 per request) as a contiguous
    int64 [B] on device (the kernel reads one value per request)."""
    if isinstance(value, torch.Tensor):
        _check_per_request(name, value, B)
        if value.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} tensor must have dtype torch.int64, got {value.dtype}")
        return value.to(device, torch.int64).contiguous()
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a Tensor[B] int64, got {type(value).__name__}")
    if not -(1 << 63) <= int(value) < (1 << 63):
        raise ValueError(f"{name} must fit in int64, got {value}")
    return P._filled(B, int(value), torch.int64, device)


def draft_rows(hidden: torch.Tensor, draft_tokens: torch.Tensor, draft_probs, vocab_size: int,
               seed, offset, draw_seed: Callable[[int], torch.Tensor], kernels: bool):
    """The drafts per request, n int64 [B], and the (seed, offset) of the flattened
    B·(S + 1) positions: request b's seed, and its offset + i at position i (seed None: one
    drawn per request with draw_seed(B)). kernels: one launch (kernels/draft_scan.py), else
    torch. The contents (ids in range, -1 only at the end, distributions that sum to 1) cost
    one host synchronisation, skipped during CUDA-graph capture and with
    TPSAMPLE_CHECK_TENSORS=0."""
    B, S1, _ = hidden.shape
    S = S1 - 1
    dev = hidden.device
    if seed is None:
        seed = draw_seed(B)
    if kernels:
        n, bad, seed_rows, offset_rows, offset_fill = _row_buffers(B, S1, dev)
        seed_b = request_key("seed", seed, B, dev)
        if type(offset) is int and -(1 << 63) <= offset < (1 << 63):  # (a loop's step:
            offset_b = offset_fill.fill_(offset)  # a fill, not an allocation and a fill)
        else:
            offset_b = request_key("offset", offset, B, dev)
        _launch(draft_scan.draft_rows_kernel, B, (S, vocab_size), dict(
            draft_ptr=draft_tokens.contiguous(), seed_ptr=seed_b, offset_ptr=offset_b, n_ptr=n,
            bad_ptr=bad, seed_rows_ptr=seed_rows, offset_rows_ptr=offset_rows),
            vocab=vocab_size, S=S, BLOCK=triton.next_power_of_2(S1))
        flags = [bad]
    else:
        seed_rows, offset_rows = positions(hidden, seed, offset)
        d = draft_tokens.long()
        ended = torch.cumsum((d < 0).long(), dim=1) > 0
        n = (~ended).sum(1)
        flags = [(d < -1) | (d >= vocab_size) | (ended & (d >= 0))]
    if P.skip_tensor_checks(dev):  # (during capture, or TPSAMPLE_CHECK_TENSORS=0)
        return n, seed_rows, offset_rows
    flags = [flags[0].any()]
    if draft_probs is not None:
        live = torch.arange(S, device=dev)[None, :] < n[:, None]
        sums = draft_probs.sum(-1, dtype=torch.float64)
        off = live & (~torch.isfinite(sums) | ((sums - 1).abs() > DRAFT_PROBS_TOL)
                      | (draft_probs < 0).any(-1))
        flags.append(off.any())
    if bool(flags[0] if len(flags) == 1 else torch.stack(flags).any()):  # (one synchronisation)
        _raise_bad_drafts(draft_tokens, draft_probs, vocab_size, n)
    return n, seed_rows, offset_rows


def _raise_bad_drafts(draft_tokens, draft_probs, vocab_size: int, n: torch.Tensor):
    d = draft_tokens.long()
    out_of_range = (d < -1) | (d >= vocab_size)
    if bool(out_of_range.any()):
        raise ValueError(f"draft_tokens must be ids in [0, {vocab_size}) or -1 (no more drafts), "
                         f"got {d[out_of_range][:4].tolist()}")
    ended = torch.cumsum((d < 0).long(), dim=1) > 0
    after_end = ended & (d >= 0)
    if bool(after_end.any()):
        raise ValueError("draft_tokens: a -1 ends a request's drafts; an id after it in rows "
                         f"{after_end.any(1).nonzero()[:4, 0].tolist()}")
    if draft_probs is None:  # (the flags said so; the torch re-check disagrees)
        raise ValueError("draft_tokens: ids out of range or after a -1")
    sums = draft_probs.sum(-1, dtype=torch.float64)
    off = ~ended & (~torch.isfinite(sums) | ((sums - 1).abs() > DRAFT_PROBS_TOL)
                    | (draft_probs < 0).any(-1))
    raise ValueError("draft_probs: each draft position's distribution must be >= 0 and sum to 1 "
                     f"within {DRAFT_PROBS_TOL}; not at (request, position) "
                     f"{off.nonzero()[:4].tolist()}")


PROBS_CHUNK = 4096  # columns per program of the draft-probs row passes (38 chunks at V = 151936)
PICK_CHUNK = 1024  # columns per program of the draft-probs pick (149 per request at V = 151936)
_REPLAYS: dict = {}  # (kernel, grid, scalars, constexprs, device, tensor_key) -> replay.Replay


def _launch(fn, B: int, scalars: tuple, named: dict, num_warps: int = 4, tkey=None,
            **args) -> None:
    """fn[(B,)](**named, **args). On CUDA a launch seen before (same scalars, constexprs and
    tensor layout: what Triton specialized on) is re-issued through its recorded launcher
    (tpsample/replay.py: ~8 µs of host time against ~30 for Triton's dispatch). tkey: the
    tensor layout, when the caller took it once for several launches (replay.tensor_key of
    every tensor they take that is not a fresh, unshared allocation of its own)."""
    if B == 0:  # (an empty grid launches nothing)
        return
    dev = next(iter(named.values())).device
    options = {"num_warps": num_warps}
    if dev.type != "cuda" or not replay.Replay.usable():
        replay.run_named(fn, (B,), options, **named, **args)
        return
    key = (fn.__name__, B, scalars, num_warps, tuple(sorted(args.items())), dev.index,
           replay.tensor_key(tuple(named.values())) if tkey is None else tkey)
    again = _REPLAYS.get(key)
    if again is not None:
        again(replay.current_stream(dev.index), **named)
        return
    with replay.record() as log:
        replay.run_named(fn, (B,), options, **named, **args)
    if replay._replayable(log):
        if len(_REPLAYS) >= 256:
            _REPLAYS.clear()
        _REPLAYS[key] = replay.Replay(log, named)


def per_request(name: str, value, B: int, S1: int):
    """A scalar stays as it is; a Tensor[B] (one value per request) is repeated for the
    S + 1 positions of each request."""
    if isinstance(value, torch.Tensor):
        _check_per_request(name, value, B)
        return value.repeat_interleave(S1)
    return value


def _check_per_request(name: str, value: torch.Tensor, B: int) -> None:
    if value.ndim != 1 or value.shape[0] != B:
        raise ValueError(f"{name} must be a scalar or a Tensor[B] with B = {B} requests, got "
                         f"shape {list(value.shape)}")


def positions(hidden: torch.Tensor, seed, offset):
    """(seed, offset) per row of the flattened [B·(S + 1)] positions (torch): request b's
    seed (an int or a Tensor[B]), and its offset + i at position i."""
    B, S1, _ = hidden.shape
    dev = hidden.device
    seed_rows = per_request("seed", seed, B, S1)
    if not isinstance(seed_rows, torch.Tensor):
        seed_rows = torch.full((B * S1,), int(seed), dtype=torch.int64, device=dev)
    off = per_request("offset", offset, B, S1)
    if isinstance(off, torch.Tensor):
        off = off.to(dev, torch.int64)
    step = torch.arange(S1, device=dev, dtype=torch.int64).repeat(B)
    return seed_rows, off + step


def scan(y: torch.Tensor, lp: torch.Tensor | None, draft: torch.Tensor, n: torch.Tensor):
    """The acceptance scan of one-hot drafts per request (torch). y [B, S + 1]: the sampler's
    token at each position (lp: its log-prob); draft [B, S], n [B] drafts per request. x_i
    is accepted while y_i == x_i, and the first y_i that differs (or the bonus y at position
    n) is emitted. Returns tokens, num_accepted, logprobs."""
    B, S1 = y.shape
    S = S1 - 1
    pos = torch.arange(S1, device=y.device)
    ok = (y[:, :S] == draft) & (pos[None, :S] < n[:, None])
    acc = torch.cumprod(ok.long(), dim=1).sum(1)
    at = acc[:, None]
    tokens = torch.where(pos[None, :] <= at, y, -1)
    logprobs = None if lp is None else torch.where(pos[None, :] <= at, lp, float("nan"))
    return tokens, acc, logprobs


def accept_scan(y: torch.Tensor, lp: torch.Tensor | None, draft: torch.Tensor,
                n: torch.Tensor):
    """scan for one-hot drafts in one launch (kernels/draft_scan.py)."""
    B, S1 = y.shape
    y = y.contiguous()
    tokens = torch.empty_like(y)
    acc = torch.empty(B, dtype=torch.int64, device=y.device)
    lp_out = None if lp is None else torch.empty_like(lp)
    _launch(draft_scan.accept_scan_kernel, B, (), dict(
        y_ptr=y, lp_ptr=y if lp is None else lp.contiguous(), draft_ptr=draft.contiguous(),
        n_ptr=n, tokens_ptr=tokens, accepted_ptr=acc,
        out_lp_ptr=tokens if lp is None else lp_out),
        S=S1 - 1, BLOCK=triton.next_power_of_2(S1), HAS_LP=lp is not None)
    return tokens, acc, lp_out


def residual_weights(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The residual's unnormalised weights max(0, p - q) (float64; Gumbel-max needs no
    normalisation)."""
    return torch.clamp(p - q, min=0.0)


def target_logprobs(l: torch.Tensor, ids: torch.Tensor, inv_temp: torch.Tensor,
                    filters: P.Filters) -> torch.Tensor:
    """log p over R rows' columns, float64 [R, C] (-inf where p is 0): p the processed
    distribution (tpsample/filters.py's semantics; greedy rows: the point mass at the
    argmax, the smallest id among equal logits). l [R, C] fp32 transformed logits (-inf in
    padding columns), ids [C] int64 each column's global id; inv_temp and filters per row.
    Rows sort only where top_k or top_p can cut; min_p is a threshold on the logit."""
    R, C = l.shape
    dev = l.device
    x = l.double()
    greedy = inv_temp == 0
    k, p_, m = row_filter_values(filters, inv_temp)
    logz = torch.logsumexp(x, dim=1)
    xmax = x.amax(1, keepdim=True)
    finite_max = torch.where(torch.isfinite(xmax), xmax, 0.0)
    if filters.top_k is not None or filters.top_p is not None:
        kept = sorted_kept(l, ids, x, k, p_, m, logz)
    else:  # min-p alone: the kept set is exp(x - x_max) >= min_p (filters.kept_prefix)
        kept = (x > float("-inf")) & (torch.exp(x - finite_max) >= m.double()[:, None])
    top = torch.where(x == xmax, ids[None, :], torch.iinfo(torch.int64).max).argmin(1)
    kept = torch.where(greedy[:, None], torch.arange(C, device=dev)[None, :] == top[:, None],
                       kept)
    logz_kept = finite_max[:, 0] + torch.log((torch.exp(x - finite_max) * kept).sum(1))
    lp = torch.where(kept, x - logz_kept[:, None], float("-inf"))
    lp = torch.where(greedy[:, None], torch.where(kept, 0.0, float("-inf")), lp)
    # a row whose log Z is not finite (NaN, +inf, nothing finite) has no answer: NaN, so no
    # draft is accepted there and no token is picked (-1), as the sampler does
    return torch.where(torch.isfinite(logz)[:, None], lp, float("nan"))


def row_filter_values(filters: P.Filters, inv_temp: torch.Tensor):
    """(top_k int64, top_p fp32, min_p fp32) [R] with the 'off' values on rows that are not
    filtered (greedy rows included)."""
    on = F.row_is_filtered(filters, inv_temp)
    k, p_, m = F.row_filters(filters, inv_temp.shape[0], inv_temp.device)
    return torch.where(on, k, 0), torch.where(on, p_, 1.0), torch.where(on, m, 0.0)


def sorted_kept(l, ids, x, k, p_, m, logz) -> torch.Tensor:
    """bool [R, C]: the tokens top-k, top-p and min-p keep (a prefix of each row's order,
    logit descending then id ascending; filters.kept_prefix on the sorted row). l [R, C]
    fp32, ids [C], x = l in float64, logz [R] its log-sum-exp."""
    by_id = torch.argsort(ids, stable=True)
    order = by_id[torch.argsort(l[:, by_id], dim=1, descending=True, stable=True)]
    kept_sorted, _ = F.kept_prefix(x.gather(1, order), torch.ones_like(x, dtype=torch.bool),
                                   k, p_, m, logz)
    return torch.zeros_like(kept_sorted).scatter_(1, order, kept_sorted)


def residual_pick(lp: torch.Tensor, ids: torch.Tensor, q: torch.Tensor, seed: torch.Tensor,
                  offset: torch.Tensor):
    """A token from normalise(max(0, p - q)) per row by Gumbel-max with the sampler's token
    noise at (seed, offset): lp [R, C] float64 log p (target_logprobs), ids [C], q [R, C]
    the draft probabilities of those columns. Where p == q up to rounding (no residual
    mass) the token is drawn from p. Returns (token [R] int64, log p(token) [R] float64)."""
    R, C = lp.shape
    p = torch.exp(lp)
    r = residual_weights(p, q.double())
    g = noise.gumbel(seed[:, None], offset[:, None], 0, ids[None, :])
    z = torch.where(r > 0, torch.log(r).float() + g, float("-inf"))
    none = ~(r > 0).any(1)
    z = torch.where(none[:, None], torch.where(p > 0, lp.float() + g, float("-inf")), z)
    pick = merge.pathwise_max(z, ids.float().expand(R, C))
    found = z.amax(1) > float("-inf")  # (NaN or no mass: no token, -1)
    return (torch.where(found, ids[pick], -1),
            torch.where(found, lp.gather(1, pick[:, None])[:, 0], float("nan")))


def verify(hidden: torch.Tensor, draft_tokens: torch.Tensor, draft_probs, *,
           sample_rows: Callable, draft_logits: Callable, draw_seed: Callable, vocab_size: int,
           temperature, seed, offset, top_k, top_p, min_p, return_logprobs: bool,
           kernels: bool, shard_logits: Callable | None = None,
           gather: Callable | None = None) -> VerifyOutput:
    """The shared body of verify_drafts and VocabParallelSampler.verify_drafts, after
    check_drafts. hidden [B, S + 1, D]; sample_rows(rows [R, D], **sampler keywords) is the
    sampler (one-hot drafts); draft_logits(rows [R, D], inv_temp [R] or None) returns (l
    [R, C] fp32 transformed logits, times 1 / T unless inv_temp is None (the kernels apply
    it), ids [C] int64 global ids) for draft_probs; draw_seed(B) draws the
    requests' seeds when seed is None; kernels: the Triton kernels around the sampler call
    (kernels/draft_scan.py), else torch. Tensor parallel: shard_logits (as draft_logits,
    this rank's columns only) and gather (t [...] → [world, ...] from every rank): the
    draft-probs kernels without top-k or top-p exchange their per-chunk partials instead of
    the rows' logits (_draft_probs_kernels)."""
    B, S1, D = hidden.shape
    S = S1 - 1
    rows = hidden.reshape(B * S1, D)
    n, seed_rows, offset_rows = draft_rows(hidden, draft_tokens, draft_probs, vocab_size, seed,
                                           offset, draw_seed, kernels)
    kw = dict(temperature=per_request("temperature", temperature, B, S1),
              top_k=per_request("top_k", top_k, B, S1), top_p=per_request("top_p", top_p, B, S1),
              min_p=per_request("min_p", min_p, B, S1), seed=seed_rows, offset=offset_rows)
    if draft_probs is None or S == 0:
        out = sample_rows(rows, return_logprobs=return_logprobs, **kw)
        y = (out.tokens if return_logprobs else out).view(B, S1)
        lp = out.logprobs.view(B, S1) if return_logprobs else None
        return VerifyOutput(*(accept_scan if kernels else scan)(y, lp, draft_tokens, n))
    return _verify_draft_probs(rows, draft_tokens.long(), draft_probs, n, seed_rows,
                               offset_rows, kw, draft_logits, vocab_size, return_logprobs,
                               kernels, shard_logits, gather)


def _verify_draft_probs(rows, draft, draft_probs, n, seed_rows, offset_rows, kw, draft_logits,
                        vocab_size: int, return_logprobs: bool, kernels: bool,
                        shard_logits: Callable | None = None,
                        gather: Callable | None = None) -> VerifyOutput:
    """Full draft distributions from the B·(S + 1) rows' logits (one matmul): x_i accepted
    when u_i · q_i(x_i) < p_i(x_i) at every draft position, then one Gumbel-max pick per
    request at its first rejection (from max(0, p - q)) or at its bonus position (from p,
    with the noise the sampler would use there)."""
    B, S = draft.shape
    S1 = S + 1
    dev = rows.device
    spec = sampling_spec(rows, vocab_size=vocab_size, rows=vocab_size, merge="max",
                         num_samples=1, return_logprobs=False, top_logprobs=0, replacement=True,
                         logprobs_mode="processed", allowed_mask=None, logit_adjust=None,
                         repetition_penalty=None, **kw)
    inv = spec.row.inv_temp
    if (kernels and gather is not None and spec.filters.top_k is None
            and spec.filters.top_p is None):  # (a cut needs whole rows: sorted_kept)
        l, ids = shard_logits(rows, None)
        return _draft_probs_kernels(l, ids, inv, spec.filters, draft, draft_probs, n,
                                    seed_rows, offset_rows, return_logprobs, gather)
    l, ids = draft_logits(rows, None if kernels else inv)  # (the kernels apply 1 / T)
    if kernels:
        return _draft_probs_kernels(l, ids, inv, spec.filters, draft, draft_probs, n,
                                    seed_rows, offset_rows, return_logprobs)
    lp_all = target_logprobs(l, ids, inv, spec.filters)  # [B·(S + 1), C]
    at = (torch.arange(B, device=dev)[:, None] * S1
          + torch.arange(S, device=dev)[None, :]).reshape(-1)  # the draft positions
    x = draft.reshape(-1)
    # (a shard's padding columns may repeat a real id; their log p is -inf)
    lp_x = torch.where(ids == x.view(B, S, 1), lp_all.view(B, S1, lp_all.shape[1])[:, :S],
                       float("-inf")).amax(-1).reshape(-1)
    q = draft_probs.reshape(B * S, vocab_size)
    q_x = q.gather(1, x.clamp(0, vocab_size - 1)[:, None])[:, 0].double()
    u = noise.uniform(seed_rows[at], offset_rows[at], 0,
                      torch.zeros(B * S, dtype=torch.int64, device=dev),
                      stream=ACCEPT_STREAM).double()
    live = torch.arange(S, device=dev)[None, :] < n[:, None]
    accept = ((x >= 0) & (u * q_x < torch.exp(lp_x))).view(B, S) & live
    acc = torch.cumprod(accept.long(), dim=1).sum(1)
    rejected = acc < n
    pick_row = torch.arange(B, device=dev) * S1 + acc  # a rejection's position, or the bonus
    q_row = q[torch.arange(B, device=dev) * S + acc.clamp(max=S - 1)]
    q_cols = q_row.gather(1, ids.clamp(max=vocab_size - 1)[None, :].expand(B, -1))
    q_cols = torch.where(rejected[:, None] & torch.isfinite(l[pick_row]), q_cols, 0.0)
    tok, lp_tok = residual_pick(lp_all[pick_row], ids, q_cols, seed_rows[pick_row],
                                offset_rows[pick_row])
    pos = torch.arange(S1, device=dev)[None, :]
    drafts = torch.cat([draft, draft[:, :1]], 1)  # (the extra column is never below acc)
    tokens = torch.where(pos < acc[:, None], drafts, -1)
    tokens = torch.where(pos == acc[:, None], tok[:, None], tokens)
    logprobs = None
    if return_logprobs:
        lp_d = torch.cat([lp_x.view(B, S), lp_x.new_zeros(B, 1)], 1).float()
        logprobs = torch.where(pos < acc[:, None], lp_d, float("nan"))
        logprobs = torch.where(pos == acc[:, None], lp_tok.float()[:, None], logprobs)
        logprobs = torch.where(tokens < 0, float("nan"), logprobs)
    return VerifyOutput(tokens, acc, logprobs)


def _draft_probs_kernels(l, ids, inv, filters, draft, q, n, seed_rows, offset_rows,
                         return_logprobs: bool, gather: Callable | None = None) -> VerifyOutput:
    """_verify_draft_probs after the matmul, on l [R, C] the rows' logits before the
    temperature (the kernels apply it), in four launches without a filter and five with one
    (kernels/draft_scan.py: each row chunk's max (and mass), with a filter each chunk's kept
    mass, per request the verdicts and the picked row's log Z, per request and chunk the
    best pick, per request the pick and the outputs); top-k and top-p first find each row's
    cut by a sort (sorted_kept), the last kept (logit, id). gather (tensor parallel, no
    top-k or top-p; l this rank's columns): the per-chunk partials go to every rank after
    the first launch, after the mass and after the picks (_gather_chunks: 36 bytes per row
    and chunk of PROBS_CHUNK columns, 44 per request and chunk of PICK_CHUNK, against 4 per
    row and column for the rows' logits), so every rank runs the rest on all ranks' chunks
    and returns the same output."""
    R, C = l.shape
    B, S = draft.shape
    dev = l.device
    has_cut = filters.top_k is not None or filters.top_p is not None
    filtered = has_cut or filters.min_p is not None
    G = triton.cdiv(C, PROBS_CHUNK)
    G2 = triton.cdiv(C, PICK_CHUNK)
    ws = _probs_workspace(R, G, B, S, G2, dev)
    if filtered:
        k, p_, m = row_filter_values(filters, inv)
    else:  # (no filter: nothing but the kernels' min_p, 0)
        m = ws["zeros"]
    if has_cut:
        ls = l * torch.where(inv == 0, 1.0, inv)[:, None]  # (the kernels' multiply)
        x = ls.double()
        kept = sorted_kept(ls, ids, x, k, p_, m, torch.logsumexp(x, dim=1))
        cut_l = torch.where(kept, ls, float("inf")).amin(1)
        cut_id = torch.where(kept & (ls == cut_l[:, None]), ids[None, :], -1).amax(1)
    else:
        cut_l, cut_id = m, seed_rows  # (not read; fp32 and int64 [R] as the cut's)
    part = lambda dtype, *shape: torch.empty(*shape, dtype=dtype, device=dev)  # noqa: E731
    stats = {k: ws[k] for k in STATS}
    filt = dict(inv_ptr=inv.contiguous(), min_p_ptr=m.float().contiguous(),
                cut_l_ptr=cut_l.contiguous(), cut_id_ptr=cut_id.contiguous())
    l, ids, draft = l.contiguous(), ids.contiguous(), draft.contiguous()
    V = q.shape[-1]
    q = q.contiguous()
    tokens = part(torch.int64, B, S + 1)
    acc = part(torch.int64, B)
    lp = part(torch.float32, B, S + 1) if return_logprobs else tokens
    # one layout key for the call's launches: the workspace's and the gathered partials are
    # fresh allocations of their own (16-byte aligned, unshared)
    tkey = ("probs",) + replay.tensor_key((l, ids, draft, q, n, seed_rows, offset_rows,
                                           *filt.values(), tokens, acc, lp))
    id0 = _ARANGE_START.get(id(ids))  # (ids made by _column_ids: the kernels compute them)
    cols = dict(l_ptr=l, ids_ptr=ids)
    arange = dict(id0=0 if id0 is None else id0, ARANGE=id0 is not None)
    _launch(draft_scan.probs_max_kernel, R * G, (C, G), dict(
        **cols, inv_ptr=filt["inv_ptr"], draft_ptr=draft, **stats), num_warps=8, tkey=tkey,
        S=S, G=G, C=C, CHUNK=PROBS_CHUNK, SCALE=True, MASS=not filtered, **arange)
    if gather is not None:
        names = STATS if not filtered else STATS[:-1]  # (a filter's mass: its own launch)
        stats.update(zip(names, _gather_chunks(gather, [stats[k] for k in names])))
    GT = stats["pmax_ptr"].shape[1]  # (every rank's chunks)
    BLOCK_G = triton.next_power_of_2(GT)
    if filtered:
        pz = stats["pz_ptr"]  # (this rank's; the first launch did not write it)
        _launch(draft_scan.probs_mass_kernel, R * G, (C, G, GT), dict(
            **cols, **filt, **stats), tkey=tkey, HAS_CUT=has_cut, BLOCK_G=BLOCK_G, G=G,
            GT=GT, SCALE=True, C=C, CHUNK=PROBS_CHUNK, BLOCK=min(1024, PROBS_CHUNK), **arange)
        stats["pz_ptr"] = pz if gather is None else _gather_chunks(gather, [pz])[0]
    lpx, bad = ws["lpx"], ws["bad"]
    row = {k: ws[k] for k in ROW}
    _launch(draft_scan.probs_accept_kernel, B, (GT, V), dict(
        **filt, **stats, q_ptr=q, draft_ptr=draft, n_ptr=n, seed_rows_ptr=seed_rows,
        offset_rows_ptr=offset_rows, accepted_ptr=acc, lpx_ptr=lpx, bad_ptr=bad, **row),
        tkey=tkey, GT=GT, V=V, ACCEPT=ACCEPT_STREAM, S=S, HAS_CUT=has_cut, BLOCK_G=BLOCK_G,
        BLOCK_S=triton.next_power_of_2(S + 1), MASS=not filtered)
    picks = {k: ws[k] for k in PICKS}
    _launch(draft_scan.probs_pick_kernel, B * G2, (C, G2, V), dict(
        **cols, **filt, q_ptr=q, n_ptr=n, seed_rows_ptr=seed_rows,
        offset_rows_ptr=offset_rows, accepted_ptr=acc, **row, **picks), tkey=tkey, C=C, V=V,
        G=G2, S=S, HAS_CUT=has_cut, CHUNK=PICK_CHUNK, BLOCK=min(256, PICK_CHUNK), SCALE=True,
        **arange)
    if gather is not None:
        picks = dict(zip(picks, _gather_chunks(gather, list(picks.values()))))
    GT2 = picks["pmass_ptr"].shape[1]
    _launch(draft_scan.probs_finish_kernel, B, (GT2,), dict(
        draft_ptr=draft, accepted_ptr=acc, lpx_ptr=lpx, bad_ptr=bad, **picks, tokens_ptr=tokens,
        lp_out_ptr=lp), tkey=tkey, G=GT2, S=S, HAS_LP=return_logprobs,
        BLOCK_G=triton.next_power_of_2(GT2), BLOCK_S=triton.next_power_of_2(S + 1))
    return VerifyOutput(tokens, acc, lp if return_logprobs else None)


STATS = ("pmax_ptr", "ptop_ptr", "plx_ptr", "pnan_ptr", "pz_ptr")  # [R, G] per row chunk
ROW = ("rmax_ptr", "rtop_ptr", "rlogz_ptr")  # [B] the picked rows' max, id there, log Z
PICKS = ("pbest_ptr", "pid_ptr", "plp_ptr", "pmass_ptr")  # [B, G2(, 2)] per pick chunk
_WORKSPACES: dict = {}  # (R, G, B, S, G2, device, stream) -> _probs_workspace's tensors


def _probs_workspace(R: int, G: int, B: int, S: int, G2: int, dev) -> dict:
    """The draft-probs kernels' partials and per-request scratch (STATS, ROW, PICKS, lpx,
    bad) and a zero min_p [R] (only read), kept per shape (_per_stream). A few KB a shape."""
    def fresh():
        e = lambda dtype, *shape: torch.empty(*shape, dtype=dtype, device=dev)  # noqa: E731
        return dict(zip(STATS + ROW + PICKS + ("lpx", "bad", "zeros"), (
            e(torch.float32, R, G), e(torch.int64, R, G), e(torch.float32, R, G),
            e(torch.int32, R, G), e(torch.float64, R, G),
            e(torch.float32, B), e(torch.int64, B), e(torch.float64, B),
            e(torch.float32, B, G2, 2), e(torch.int64, B, G2, 2), e(torch.float64, B, G2, 2),
            e(torch.int32, B, G2), e(torch.float64, B, S + 1), e(torch.int32, B),
            torch.zeros(R, dtype=torch.float32, device=dev))))
    return _per_stream(_WORKSPACES, (R, G, B, S, G2), dev, fresh)


def _gather_chunks(gather: Callable, parts: list) -> list:
    """Per-chunk partials [N, G, ...] of this rank → [N, world · G, ...] of all ranks (rank
    r's chunks at r · G + c), in one exchange of their bytes."""
    N = parts[0].shape[0]
    flat = [t.contiguous().view(N, -1) for t in parts]
    sent = torch.cat([t.view(torch.uint8) for t in flat], 1)
    got = gather(sent)  # [world, N, bytes]
    out, at = [], 0
    for t, f in zip(parts, flat):
        width = f.shape[1] * f.element_size()
        ranks = got[:, :, at:at + width].contiguous().view(t.dtype)  # [world, N, G · ...]
        out.append(ranks.permute(1, 0, 2).reshape(N, -1, *t.shape[2:]).contiguous())
        at += width
    return out


def local_logits(weight: torch.Tensor, bias, n_real: int, vocab_start: int = 0,
                 columns: int | None = None):
    """draft_logits for one device, or one rank's shard before its all-gather: rows [R, D]
    and inv_temp [R] → (fp32 ((rows @ W.T + bias) · 1/T) [R, columns], -inf from n_real on
    (greedy rows: T = 1; inv_temp None: no 1/T); the columns' global ids vocab_start + j
    [columns]). columns (default: the weight's rows) pads a shard to the ranks' common
    width."""
    V_rows = weight.shape[0]
    width = V_rows if columns is None else columns

    def logits(rows: torch.Tensor, inv_temp: torch.Tensor):
        x = logits_fp32(rows, weight[:n_real])  # (fp32 accumulation, W never copied)
        if bias is not None:
            x += bias[:n_real].float()
        if inv_temp is not None:
            x *= torch.where(inv_temp == 0, 1.0, inv_temp)[:, None]
        if width > n_real:  # (padding columns: -inf)
            x = torch.nn.functional.pad(x, (0, width - n_real), value=float("-inf"))
        return x, _column_ids(vocab_start, width, rows.device)
    return logits


_COLUMN_IDS: dict = {}  # (vocab_start, width, device) -> int64 [width], only read
_ARANGE_START: dict = {}  # id of a _COLUMN_IDS tensor -> its vocab_start


def _column_ids(vocab_start: int, width: int, dev) -> torch.Tensor:
    """vocab_start + arange(width) on dev, made once per (start, width, device); new
    during a CUDA-graph capture."""
    if P.capturing(dev):
        return vocab_start + torch.arange(width, device=dev)
    key = (vocab_start, width, dev)
    ids = _COLUMN_IDS.get(key)
    if ids is None:
        if len(_COLUMN_IDS) >= 64:
            _COLUMN_IDS.clear()
            _ARANGE_START.clear()
        ids = _COLUMN_IDS[key] = vocab_start + torch.arange(width, device=dev)
        _ARANGE_START[id(ids)] = vocab_start
    return ids


__all__ = ["VerifyOutput", "check_hidden3", "check_drafts", "verify", "local_logits"]
