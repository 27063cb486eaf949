"""Filtered sampling from candidate records: top-k, top-p, min-p, top log-probs and samples
without replacement, exact, without the [B, V] logits.

Semantics (filtered_rows, at the end of this module, implements them on full rows in float64).
Row b has transformed logits x_i (bias, vocabulary mask, 1/T); "the order" sorts its tokens
by (x desc, id asc). top-k keeps the first k tokens of the order; top-p keeps the shortest
prefix of what top-k kept whose mass under the renormalised top-k distribution reaches p;
min-p keeps the tokens with p_i >= min_p * p_max, i.e. exp(x_i - x_max) >= min_p (p_i / p_max
does not depend on the renormalisation). The row samples softmax(x) restricted to the kept
set. Every filter keeps a prefix of the order, so the kept set is one. Greedy rows (T = 0)
ignore the filters.

1. Candidates. Stage 1 writes, per tile, the logits and ids of its CANDIDATES best tokens
   (tpsample/records.py). With tau = the largest CANDIDATES-th best logit over all tiles,
   every token with x > tau is a candidate (a tile's other tokens are <= its CANDIDATES-th
   best <= tau): the first M tokens of the order are known, M = #{candidates with x > tau},
   capped at KNOWN_CAP (the kernel compacts and sorts them; a shorter known prefix only
   weakens the certificates).
2. Certificates: the kept set is known once it lies in that known prefix.
     top-k   k <= M (top-k off: nothing to know; its mass is Z, exact from the tile masses)
     top-p   top-k certified, and top-k on (its set and mass are known) or the known
             prefix's mass reaches p * Z (the prefix then ends inside it)
     min-p   exp(tau - x_max) < min_p: no token at or below tau survives min-p, so the kept
             set lies in the known prefix, provided top-p's cut is known or lies past it
             (top-p off, or top-k certified: the known prefix then fell short of p * Z);
             min-p alone has only this certificate
     top-n   n <= M
     winner  a call that returns tokens only, one sample with replacement, merge "max": the
             row's unfiltered Gumbel-max winner (its pathwise winner, 3.) is kept, as known
             either from the known prefix (the winner is a known token there, and top-k is
             off or top-p is: a known token's keep is then exact, the order before it being
             known and top-p's target needing only Z) or, with min-p alone, from its own
             logit (exp(x_w - x_max) >= min_p). The kept set's winner is the largest
             perturbed score among the kept tokens, so it is that token. Its log-prob and
             log Z are not computed (NaN).
   A row without its certificate takes the fallback (5); never an approximation.
3. Sampling. Token = argmax over the kept set of (x_i + g_i) with stage 1's token noise
   g_i(seed, offset, sample, id): the Gumbel-max over the kept set, the same token as a
   full row's for any tiling, batch position or TP degree (merge "max"'s pathwise
   property). Rows with filters take it whatever the merge. Without replacement: the S
   largest (x_i + g_i) under sample 0's noise (Gumbel-top-S = sequential sampling without
   replacement); a row that keeps fewer than S tokens returns token -1 (log-prob -inf) in
   the positions past them.
4. Unfiltered rows without replacement: sample plane s of a tile holds its (s+1)-th best
   perturbed score under sample 0's noise, and the S best of a row are among the S best of
   their tiles.
5. Fallback. The rows without a certificate are recomputed from their full logits, for
   those rows only. One device, Triton: on the GPU after the candidate reduce
   with no host synchronisation, so such calls can be captured in a CUDA graph. The rows'
   logits are the ones stage 1 wrote beside its records (else recomputed); rows with top-p
   and/or min-p and no top-k take kernels/filter_cut.py (the cut bracketed over many
   programs per row), the others kernels/filter_fallback.py (bisections on the order key,
   one program per row: while such rows keep falling back the pipeline takes the host
   path below instead, fallback_choice.FallbackChoice.device_now). Under TP over
   symmetric memory the same, with the flagged rows' logit shards gathered into every rank
   on the device (the flags agree on every rank; transport.SymmMemTransport.rows_gather).
   Under TP over NCCL or gloo (the rows' logits are split over the ranks) and on the torch
   path: the pipeline reads the flags back (one host synchronisation), gathers the flagged
   rows' logit shards and runs filtered_rows on them.

Log-probs (SampleOutput): "processed" = x - log Z_kept for filtered rows (log Z over the kept
set; -inf outside it), x - log Z otherwise; "raw" = x_raw - log Z_raw at T = 1 (x_raw = x * T,
log Z_raw from the raw plane).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import merge, noise
from .params import Filters, RowParams
from .records import CANDIDATE_PLANES, CANDIDATES

NEG_INF = float("-inf")
KNOWN_CAP = 1024  # the known prefix holds at most this many tokens (the kernel sorts them)


class FilteredOutput(NamedTuple):
    tokens: torch.Tensor        # int64 [B, S] ([B] from a replayed call with S = 1)
    logprobs: torch.Tensor      # fp32 [B, S] (the same)
    logz: torch.Tensor          # fp32 [B]
    top_tokens: torch.Tensor    # int64 [B, n]
    top_logprobs: torch.Tensor  # fp32 [B, n]
    fallback: torch.Tensor      # bool or int32 [B]: rows without a certificate (their
                                # other outputs are not valid)
    scratch: torch.Tensor | None = None  # the filter kernels' int64 [scratch_words(B)]


def scratch_words(B: int) -> int:
    """int64 words of the filter kernels' scratch: a row's sort scratch (B·KNOWN_CAP), then
    per row its sample-0 winner's order key, its largest logit's and its log Z's (B each), then
    the fast path's cut list, int32 [1 + B] (its count zeroed by the filter kernel)."""
    return B * (KNOWN_CAP + 3) + (B + 2) // 2


def cut_list(scratch: torch.Tensor, B: int) -> torch.Tensor:
    """The cut list inside the scratch (scratch_words): int32 [1 + B]."""
    return scratch[B * (KNOWN_CAP + 3):].view(torch.int32)[:B + 1]


def cut_rows_possible(filters: Filters) -> bool:
    """Whether some row such a call flags may take kernels/filter_cut.py's fast path: top-p /
    min-p rows without a top-k (a per-row top_k tensor may leave rows without one), samples
    with replacement (top log-probs too: rows whose top n the filter kernel knows). Such calls
    launch the fast path's steps and write the side output (FallbackChoice.side_output),
    which spares their flagged rows a pass over W."""
    return (filters.replacement and not filters.top_k_every_row
            and (filters.top_p is not None or filters.min_p is not None))


def cut_path_rows(filters: Filters, inv_temp: torch.Tensor) -> torch.Tensor:
    """bool [B]: the rows that the device fallback redoes, when flagged 1, on kernels/
    filter_cut.py's fast path (filter_fallback.fast_row within a call whose launchers take
    that path: samples with replacement, not a top-k on every row); the other flagged rows
    (and those flagged 2: top n past the known prefix) take one program per row (~5 ms at
    V = 151,936), which is what the host path is for (tpsample/fallback_choice.py)."""
    if not cut_rows_possible(filters):
        return torch.zeros(inv_temp.shape, dtype=torch.bool, device=inv_temp.device)
    on = torch.zeros(inv_temp.shape, dtype=torch.bool, device=inv_temp.device)
    if filters.top_p is not None:
        on = on | (filters.top_p < 1)
    if filters.min_p is not None:
        on = on | (filters.min_p > 0)
    if filters.top_k is not None:
        on = on & (filters.top_k <= 0)
    return on & (inv_temp != 0)


def row_is_filtered(filters: Filters, inv_temp: torch.Tensor) -> torch.Tensor:
    """bool [B]: rows with top_k > 0, top_p < 1 or min_p > 0 that are not greedy (the one
    definition of a filtered row)."""
    on = torch.zeros(inv_temp.shape, dtype=torch.bool, device=inv_temp.device)
    if filters.top_k is not None:
        on = on | (filters.top_k > 0)
    if filters.top_p is not None:
        on = on | (filters.top_p < 1)
    if filters.min_p is not None:
        on = on | (filters.min_p > 0)
    return on & (inv_temp != 0)


def row_filters(filters: Filters, B: int, device):
    """(top_k int64, top_p fp32, min_p fp32) [B] with the 'off' values where None."""
    k = filters.top_k.long() if filters.top_k is not None else torch.zeros(B, dtype=torch.int64,
                                                                            device=device)
    p = filters.top_p if filters.top_p is not None else torch.ones(B, device=device)
    m = filters.min_p if filters.min_p is not None else torch.zeros(B, device=device)
    return k, p, m


def take_rows(filters: Filters, rows: torch.Tensor) -> Filters:
    """The filters of a subset of rows (index tensor)."""
    pick = (lambda t: None if t is None else t[rows])
    return filters._replace(top_k=pick(filters.top_k), top_p=pick(filters.top_p),
                            min_p=pick(filters.min_p))


def kept_prefix(xs, known, k, p, m, logz):
    """The filters on rows in the order: xs [R, n] logits sorted by (x desc, id asc) (float32
    or float64), known [R, n] bool: which positions are known (the candidates above tau; all
    True for full rows); k/p/m [R] the filters; logz [R] log Z of the whole row.
    Returns kept [R, n] bool and certified [R] bool (2. above)."""
    R, n = xs.shape
    pos = torch.arange(n, device=xs.device)[None, :]
    finite = xs > NEG_INF
    xmax = xs[:, 0]
    xmax = torch.where(torch.isfinite(xmax), xmax, torch.zeros_like(xmax))
    e = torch.exp(xs - xmax[:, None])
    kon, pon, mon = k > 0, p < 1, m > 0
    keep_k = torch.where(kon[:, None], pos < k[:, None], True) & finite
    cert_k = ~kon | (k <= known.sum(-1))
    ek = e * keep_k
    zk = torch.where(kon, ek.sum(-1), torch.exp(logz.to(xs.dtype) - xmax))
    target = p.to(xs.dtype) * zk
    before = ek.cumsum(-1) - ek  # the mass of the order before each token
    keep_p = torch.where(pon[:, None], before < target[:, None], True)
    cert_p = ~pon | kon | ((e * known).sum(-1) >= target)
    keep_m = e >= m.to(xs.dtype)[:, None]
    tau_gap = torch.exp(torch.where(known.all(-1), NEG_INF,
                                    _first_unknown(xs, known)) - xmax)
    cert_m = mon & (tau_gap < m.to(xs.dtype)) & (cert_k | ~pon)
    return keep_k & keep_p & keep_m, ((kon | pon) & cert_k & cert_p) | cert_m


def _first_unknown(xs, known):
    """The logit of the first unknown position (an upper bound on every unknown token)."""
    first = torch.where(known, xs.shape[1], torch.arange(xs.shape[1], device=xs.device)).amin(-1)
    return xs.gather(-1, first.clamp(max=xs.shape[1] - 1)[:, None])[:, 0]


def sort_order(x, ids):
    """x, ids [R, n] → both sorted by (x desc, id asc)."""
    o = torch.argsort(ids, dim=-1, stable=True)
    x, ids = x.gather(-1, o), ids.gather(-1, o)
    o = torch.argsort(x, dim=-1, descending=True, stable=True)
    return x.gather(-1, o), ids.gather(-1, o)


def gumbel_pick(xs, ids, kept, seed, offset, num_samples: int, replacement: bool):
    """3. above: positions [R, S] into xs of the samples (-1: none left)."""
    R, n = xs.shape
    if replacement:
        picks = []
        for s in range(num_samples):
            g = noise.gumbel(seed[:, None], offset[:, None], s, ids)
            z = torch.where(kept, xs.float() + g, NEG_INF)
            picks.append(merge.pathwise_max(z, ids.float()))
        return torch.stack(picks, dim=1)
    g = noise.gumbel(seed[:, None], offset[:, None], 0, ids)
    z = torch.where(kept, xs.float() + g, NEG_INF)
    zs, order = sort_order(z, torch.arange(n, device=xs.device).expand(R, n).contiguous())
    # (ids ascend with position among equal x; equal perturbed scores are ties of measure 0)
    order = order[:, :num_samples]
    return torch.where(zs[:, :num_samples] > NEG_INF, order, -1)


def candidate_planes(recs: torch.Tensor, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """recs [slots, planes, B, T, 4] → the candidates' logits and ids (float), each
    [B, slots·T, CANDIDATES], a record's candidates in their order (logit desc, id asc)."""
    slots, _, B, T, _ = recs.shape
    cand = recs[:, num_samples:num_samples + CANDIDATE_PLANES].permute(2, 0, 3, 1, 4)
    cand = cand.reshape(B, slots * T, CANDIDATES, 2)
    return cand[..., 0], cand[..., 1]


def reduce_candidates(recs: torch.Tensor, params: RowParams, filters: Filters, num_samples: int,
                      base, winner: torch.Tensor | None = None) -> FilteredOutput:
    """Stage 2 of a call with candidate planes, in torch.

    recs [slots, planes, B, T, 4] (records.planes); base: (tokens [B, S], logprobs, logz) of
    the call's merge over the sample planes (used for the rows without filters, with
    replacement); winner: int64 [B], the rows' pathwise winners in a call that takes the
    winner certificate (2. above; launchers.winner_certificate), else None. Rows whose
    fallback flag is set must be recomputed (5. above)."""
    slots, _, B, T, _ = recs.shape
    S = num_samples
    dev = recs.device
    greedy = params.inv_temp == 0
    x, ids = candidate_planes(recs, S)
    tau = x[..., -1].amax(-1)
    lse = recs[:, 0, :, :, 3].permute(1, 0, 2).reshape(B, slots * T)
    logz = torch.logsumexp(lse, dim=-1)
    logz_raw = torch.logsumexp(recs[:, S + CANDIDATE_PLANES, :, :, 0].permute(1, 0, 2)
                               .reshape(B, slots * T), dim=-1)
    xs, ids = sort_order(x.reshape(B, -1), ids.reshape(B, -1))
    ids = ids.long()
    known = (xs > tau[:, None]) & (torch.arange(xs.shape[1], device=dev) < KNOWN_CAP)[None, :]
    k, p, m = row_filters(filters, B, dev)
    kept, cert = kept_prefix(xs, known, k, p, m, logz)
    filtered = row_is_filtered(filters, params.inv_temp)
    ok = torch.isfinite(logz)

    xmax = torch.where(torch.isfinite(xs[:, 0]), xs[:, 0], torch.zeros_like(xs[:, 0]))
    logz_kept = xmax + torch.log((torch.exp(xs - xmax[:, None]) * kept).sum(-1))
    inv = params.inv_temp
    to_raw = torch.where(greedy, torch.ones_like(inv), 1.0 / torch.where(greedy, 1.0, inv))

    tokens, logprobs, logz_out = base
    # rows that sample from candidates: filtered ones, and without replacement every row
    pick = gumbel_pick(xs, ids, kept, params.seed, params.offset, S, filters.replacement)
    f_tok = torch.where(pick >= 0, ids.gather(-1, pick.clamp(min=0)), -1)
    f_x = torch.where(pick >= 0, xs.gather(-1, pick.clamp(min=0)), NEG_INF)
    if not filters.replacement:  # unfiltered rows: 4. above, from the sample planes
        u_tok, u_x = top_perturbed(recs[:, :S], S)
        f_tok = torch.where(filtered[:, None], f_tok, u_tok)
        f_x = torch.where(filtered[:, None], f_x, u_x)
        use = torch.ones_like(filtered)
    else:
        use = filtered
    lz = torch.where(filtered & ok, logz_kept, logz)  # degenerate rows keep their log Z
    tokens = torch.where(use[:, None], f_tok, tokens)
    x_tok = torch.where(use[:, None], f_x, logprobs + logz_out[:, None])
    if filters.raw:
        logz_out = logz_raw
        logprobs = x_tok * to_raw[:, None] - logz_raw[:, None]
    else:
        logz_out = lz
        logprobs = x_tok - lz[:, None]
    logprobs = torch.where(tokens >= 0, logprobs, NEG_INF)

    n = filters.top_n
    top_tok = ids[:, :n]
    if filters.raw:
        top_lp = xs[:, :n] * to_raw[:, None] - logz_raw[:, None]
    else:
        top_lp = torch.where(filtered[:, None] & ~kept[:, :n], NEG_INF, xs[:, :n] - lz[:, None])
    won = torch.zeros_like(cert)
    if winner is not None:  # (one sample, no top-n: a tokens-only call)
        head = recs[:, 0].permute(1, 0, 2, 3).reshape(B, slots * T, 4)  # sample plane 0
        x_w = torch.where(head[..., 1] == winner[:, None].float(), head[..., 2],
                          NEG_INF).amax(-1)  # the winner's logit, from its tile's record
        min_p_kept = (k <= 0) & (p >= 1) & (torch.exp(x_w - xmax) >= m)
        won = ((((known & kept & (ids == winner[:, None])).any(-1) & ((k <= 0) | (p >= 1)))
                | min_p_kept) & ~cert & filtered & ok)
        tokens = torch.where(won[:, None], winner[:, None], tokens)
        logprobs = torch.where(won[:, None], float("nan"), logprobs)
        logz_out = torch.where(won, float("nan"), logz_out)
    fallback = ok & ((filtered & ~cert & ~won) | ((n > 0) & (known.sum(-1) < n)))
    # degenerate rows (log Z not finite): token -1, log-probs NaN (tpsample/merge.py)
    tokens = torch.where(ok[:, None], tokens, -1)
    logprobs = torch.where(ok[:, None], logprobs, float("nan"))
    top_tok = torch.where(ok[:, None], top_tok, -1)
    top_lp = torch.where(ok[:, None], top_lp, float("nan"))
    return FilteredOutput(tokens, logprobs.float(), logz_out.float(), top_tok,
                          top_lp.float(), fallback)


def top_perturbed(samples: torch.Tensor, S: int):
    """4. above: sample planes [slots, S, B, T, 4] of (s+1)-th best perturbed scores → the
    row's S best (token int64 [B, S], -1 where fewer than S are allowed; logit [B, S])."""
    slots, _, B, T, _ = samples.shape
    r = samples.permute(2, 0, 1, 3, 4).reshape(B, slots * S * T, 4)
    score, tok, logit = r[..., 0], r[..., 1], r[..., 2]
    o = torch.argsort(tok, dim=-1, stable=True)
    score, tok, logit = score.gather(-1, o), tok.gather(-1, o), logit.gather(-1, o)
    o = torch.argsort(score, dim=-1, descending=True, stable=True)[:, :S]
    # a slot past the row's allowed tokens (score -inf) has no token: -1, as the kernel gives
    tok = torch.where(score.gather(-1, o) > NEG_INF, tok.gather(-1, o).long(), -1)
    return tok, logit.gather(-1, o)


def filtered_rows(l: torch.Tensor, inv_temp: torch.Tensor, seed: torch.Tensor,
                  offset: torch.Tensor, filters: Filters, num_samples: int,
                  ids: torch.Tensor | None = None):
    """Filtered sampling on full rows (the semantics above, in float64): the host path's
    exact fallback, and the definition the candidate path is tested against
    (tpsample/reference.py builds its filtered calls on it).

    l [R, V] float32 transformed logits (-inf past the vocabulary), inv_temp [R] (0 =
    greedy: no filters, the argmax, or the S largest without replacement), seed/offset [R];
    ids [V] int64: the global id of each column (default: the column index).
    Returns (tokens int64 [R, S] (-1: no token left), logprobs float64 [R, S], logz float64
    [R], top_tokens int64 [R, n], top_logprobs float64 [R, n]) in filters.raw's mode."""
    R, V = l.shape
    dev = l.device
    logz_nan = torch.isnan(l).any(-1)  # rows with a NaN are degenerate (log Z NaN)
    l = l.masked_fill(torch.isnan(l), float("-inf"))
    ids = (torch.arange(V, device=dev) if ids is None else ids).expand(R, V).contiguous()
    xs, ids = sort_order(l, ids)
    x64 = xs.double()
    logz = torch.logsumexp(l.double(), dim=-1).masked_fill(logz_nan, float("nan"))
    greedy = inv_temp == 0
    k, p, m = row_filters(filters, R, dev)
    off = ~row_is_filtered(filters, inv_temp)
    k, p, m = (torch.where(off, 0, k), torch.where(off, 1.0, p), torch.where(off, 0.0, m))
    kept, _ = kept_prefix(x64, torch.ones_like(xs, dtype=torch.bool), k, p, m, logz)
    pick = gumbel_pick(xs, ids, kept, seed, offset, num_samples, filters.replacement)
    first = torch.zeros_like(pick) if filters.replacement else \
        torch.arange(num_samples, device=dev).expand(R, num_samples)
    pick = torch.where(greedy[:, None], first, pick)
    xmax = x64[:, :1].nan_to_num(neginf=0.0, posinf=0.0)
    logz_kept = xmax[:, 0] + torch.log((torch.exp(x64 - xmax) * kept).sum(-1))
    lz = torch.where(off | ~torch.isfinite(logz), logz, logz_kept)
    tokens = torch.where(pick >= 0, ids.gather(-1, pick.clamp(min=0)), -1)
    x_tok = x64.gather(-1, pick.clamp(min=0))
    n = filters.top_n
    if filters.raw:
        to_raw = torch.where(greedy, 1.0, 1.0 / torch.where(greedy, 1.0, inv_temp)).double()
        logz_raw = torch.logsumexp(l.double() * to_raw[:, None], dim=-1)
        logprobs = x_tok * to_raw[:, None] - logz_raw[:, None]
        top = x64[:, :n] * to_raw[:, None] - logz_raw[:, None]
        lz = logz_raw
    else:
        logprobs = x_tok - lz[:, None]
        top = torch.where(kept[:, :n] | off[:, None], x64[:, :n] - lz[:, None], float("-inf"))
    logprobs = torch.where(pick >= 0, logprobs, float("-inf"))
    return tokens, logprobs, lz, ids[:, :n], top
