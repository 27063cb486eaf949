"""Constrained decoding: an allowed-token bitmask and sparse per-row logit adjustments, exact,
without the [B, V] logits.

Semantics (reference.constrained_logits implements them on full rows). Row b's logit of
token i before the temperature, in this order:

    x_i = h_b . w_i + bias_i                 the model
    x_i = -inf                               if bit i % 32 of allowed_mask[b, i // 32] is 0
    x_i = rep(x_i) + a_i                     for each token i listed in ids[b]: a_i the sum of
                                             the values listed for i (a repeated id adds its
                                             values; the penalty applies once);
                                             rep(x) = x / r if x > 0 else x * r,
                                             r = repetition_penalty[b] (HF's and vLLM's)

then 1/T, the filters (tpsample/filters.py) and the sample. A disallowed token stays -inf
whatever its adjustment (and a NaN logit there does not make the row degenerate). A row that
allows nothing is degenerate like a row of -inf logits: token -1, log Z -inf (SampleOutput).
logprobs_mode="raw" is T = 1 without filters, mask and adjustments applied (a disallowed token
cannot be sampled, so it has no log-prob to report).

How it stays exact without the logits:
1. The mask is one bit test per token in stage 1's epilogue: the tile records are the
   records of the masked row.
2. Listed tokens leave the tile pass (their bits are cleared in a per-call copy of the mask)
   and form one more tile per slot, after the slot's vocabulary tiles: per row, the listed
   ids of this slot's range (deduplicated), their K dot products h . w_i, the adjustments,
   the token noise of their ids (the same Philox words as in the tile pass) and that tile's
   records in the format of tpsample/records.py (candidate, raw and without-replacement
   planes included). The tiles still partition the row, so every merge stays exact
   (tpsample/merge.py), and merge "max" gives the token of the full adjusted row, path by
   path: the same token for any tiling or TP degree. The extra tile takes its token by
   Gumbel-max under every merge (merge "cdf"'s inverse CDF is one exact in-tile choice, the
   Gumbel-max another: merge.py, fact 6). Ties between equal scores in it go to the smaller id.
3. Filters, top log-probs and the exact fallback see the extra tile's candidates like any
   other tile's; the fallback's full rows apply the constraints densely (apply_dense).

Under TP every rank receives the full mask and the full lists and uses the bits and ids of
its own range (ranges need not start at a multiple of 32).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .params import _filled, _per_row_tensor, skip_tensor_checks

MAX_ADJUST = 256  # ids per row of logit_adjust


class Constraints(NamedTuple):
    """A call's constraints, normalised (None where the call has none)."""
    mask: torch.Tensor | None     # int32 [B, W], W = ceil(vocab / 32), contiguous
    ids: torch.Tensor | None      # int64 [B, K], -1 = padding
    values: torch.Tensor | None   # fp32 [B, K]
    penalty: torch.Tensor | None  # fp32 [B] >= 1 (1 = off), only with ids

    @property
    def listed(self) -> bool:
        """Whether the call has listed tokens (the extra tile)."""
        return self.ids is not None

    @property
    def any(self) -> bool:
        return self.mask is not None or self.ids is not None


NO_CONSTRAINTS = Constraints(None, None, None, None)


def mask_words(vocab: int) -> int:
    return -(-vocab // 32)


def check_constraints(hidden: torch.Tensor, allowed_mask, logit_adjust, repetition_penalty,
                      vocab_size: int, rows: int) -> Constraints:
    """Validate and normalise the constraint arguments of tpsample.sample (see its docstring).

    vocab_size: the real vocabulary; rows: the weight's rows over all ranks (padded). The
    mask may be ceil(vocab_size / 32) or ceil(rows / 32) words wide. Tensor contents (ids in
    range, finite values, penalties >= 1) are checked with one host synchronisation, except
    during CUDA-graph capture or with TPSAMPLE_CHECK_TENSORS=0, where an id outside
    [0, vocab_size) is ignored like padding.
    """
    if allowed_mask is None and logit_adjust is None and repetition_penalty is None:
        return NO_CONSTRAINTS
    B, dev = hidden.shape[0], hidden.device
    mask = None
    if allowed_mask is not None:
        if not isinstance(allowed_mask, torch.Tensor):
            raise TypeError(f"allowed_mask must be None or a Tensor[B, W] int32, got "
                            f"{type(allowed_mask).__name__}")
        widths = sorted({mask_words(vocab_size), mask_words(rows)})
        if allowed_mask.ndim != 2 or allowed_mask.shape[0] != B or \
                allowed_mask.shape[1] not in widths:
            raise ValueError(f"allowed_mask must have shape [{B}, W] with W = ceil(vocab / 32) "
                             f"in {widths}, got {tuple(allowed_mask.shape)}")
        if allowed_mask.dtype != torch.int32:
            raise TypeError(f"allowed_mask must be int32 (bit j of word i allows token "
                            f"32 i + j), got {allowed_mask.dtype}")
        if allowed_mask.device != dev:
            raise ValueError(f"allowed_mask is on {allowed_mask.device} but hidden is on {dev}")
        mask = allowed_mask.contiguous()

    ids = values = penalty = None
    checks = []
    if logit_adjust is not None:
        if not isinstance(logit_adjust, (tuple, list)) or len(logit_adjust) != 2:
            raise TypeError("logit_adjust must be None or a pair (ids Tensor[B, K] int64, "
                            "values Tensor[B, K] float32)")
        ids, values = logit_adjust
        if not isinstance(ids, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise TypeError("logit_adjust must be a pair of tensors (ids, values)")
        if ids.ndim != 2 or ids.shape[0] != B or not 1 <= ids.shape[1] <= MAX_ADJUST:
            raise ValueError(f"logit_adjust ids must have shape [{B}, K], 1 <= K <= "
                             f"{MAX_ADJUST}, got {tuple(ids.shape)}")
        if ids.dtype != torch.int64:
            raise TypeError(f"logit_adjust ids must be int64, got {ids.dtype}")
        if values.shape != ids.shape:
            raise ValueError(f"logit_adjust values must have the ids' shape {tuple(ids.shape)}, "
                             f"got {tuple(values.shape)}")
        if not values.is_floating_point():
            raise TypeError(f"logit_adjust values must be floating (used as float32), got "
                            f"{values.dtype}")
        for name, t in (("ids", ids), ("values", values)):
            if t.device != dev:
                raise ValueError(f"logit_adjust {name} is on {t.device} but hidden is on {dev}")
        ids, values = ids.contiguous(), values.float().contiguous()
        checks.append(("logit_adjust ids", f"in [-1, {vocab_size}) (-1 = padding)", ids,
                       lambda t: (t < -1) | (t >= vocab_size)))
        checks.append(("logit_adjust values", "finite or -inf", values,
                       lambda t: torch.isnan(t) | (t == math.inf)))
    if repetition_penalty is not None:
        if isinstance(repetition_penalty, torch.Tensor):
            t = _per_row_tensor("repetition_penalty", repetition_penalty, B, dev,
                                (torch.float32, torch.float64, torch.float16, torch.bfloat16))
            penalty = t.float().contiguous()
            checks.append(("repetition_penalty", "finite and >= 1", penalty,
                           lambda t: ~torch.isfinite(t) | (t < 1)))
        elif isinstance(repetition_penalty, (int, float)) and \
                not isinstance(repetition_penalty, bool):
            if not (math.isfinite(repetition_penalty) and repetition_penalty >= 1):
                raise ValueError(f"repetition_penalty must be finite and >= 1, got "
                                 f"{repetition_penalty!r}")
            if repetition_penalty != 1:
                penalty = _filled(B, float(repetition_penalty), torch.float32, dev)
        else:
            raise TypeError(f"repetition_penalty must be None, a float or a Tensor[B], got "
                            f"{type(repetition_penalty).__name__}")
        if ids is None:
            raise ValueError("repetition_penalty applies to the tokens listed in logit_adjust's "
                             "ids: pass logit_adjust (values may be 0)")
    if checks and not skip_tensor_checks(dev):  # (the rules run only here: no launches else)
        bads = [test(t) for _, _, t, test in checks]
        flags = torch.stack([bad.any() for bad in bads]).cpu()  # one synchronisation
        for (name, rule, t, _), bad, hit in zip(checks, bads, flags.tolist()):
            if hit:
                where = bad.nonzero()[:4].tolist()
                raise ValueError(f"{name} must be {rule}; got {t[bad][:4].tolist()} at "
                                 f"{where}")
    return Constraints(mask, ids, values, penalty)


def penalty_adjustments(history: torch.Tensor, presence_penalty: float | torch.Tensor = 0.0,
                        frequency_penalty: float | torch.Tensor = 0.0,
                        logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None):
    """(ids, values) for logit_adjust from a padded token history, the way serving engines
    apply presence and frequency penalties (OpenAI's definition, as vLLM):

        a_i = -frequency_penalty * count_i - presence_penalty * [count_i > 0]  (+ logit bias)

    history: int64 [B, L], -1 = padding (the generated tokens, or prompt + generated);
    presence_penalty / frequency_penalty: float or Tensor[B]; logit_bias: optional
    (ids int64 [B, Kb] padded with -1, values [B, Kb]) appended to the list.
    Returns ids int64 [B, L (+ Kb)] (one entry per distinct token in id order, then -1
    padding) and values fp32 of the same shape. Pass repetition_penalty alongside to
    penalise the same tokens multiplicatively.
    """
    if not isinstance(history, torch.Tensor) or history.ndim != 2 or history.dtype != torch.int64:
        raise TypeError("history must be an int64 Tensor[B, L] padded with -1")
    B, L = history.shape
    dev = history.device

    def per_row(name, v):
        if isinstance(v, torch.Tensor):
            return _per_row_tensor(name, v, B, dev, (torch.float32, torch.float64)).float()
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite float or a Tensor[B], got {v!r}")
        return torch.full((B,), float(v), device=dev)
    pres, freq = per_row("presence_penalty", presence_penalty), per_row("frequency_penalty",
                                                                        frequency_penalty)
    big = torch.iinfo(torch.int64).max
    ordered = torch.where(history >= 0, history, big).sort(dim=1).values
    valid = ordered != big
    start = valid.clone()
    start[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    group = start.long().cumsum(1) - 1  # the distinct token's slot in the row
    dummy = torch.full_like(group, L)  # entries that write nothing go to column L
    counts = torch.zeros(B, L + 1, device=dev).scatter_add_(
        1, torch.where(valid, group, dummy), valid.float())[:, :L]
    uniq = torch.full((B, L + 1), -1, dtype=torch.int64, device=dev).scatter_(
        1, torch.where(start, group, dummy), torch.where(start, ordered, -1))[:, :L]
    values = torch.where(uniq >= 0, -freq[:, None] * counts - pres[:, None] * (counts > 0), 0.0)
    if logit_bias is not None:
        b_ids, b_vals = logit_bias
        uniq = torch.cat([uniq, b_ids.to(torch.int64)], dim=1)
        values = torch.cat([values, torch.where(b_ids >= 0, b_vals.float(), 0.0)], dim=1)
    return uniq, values


def apply_dense(x: torch.Tensor, gid0: int, c: Constraints, rows: torch.Tensor | None = None,
                n_real: int | None = None) -> torch.Tensor:
    """The constraints on a dense slice of logits: x [R, n] fp32 (bias applied, before the
    temperature) of the global ids gid0 + [0, n) → constrained logits [R, n] (a new tensor).
    rows: int64 [R], which of the call's rows x holds (default: all, R = B); n_real: ids
    from gid0 + n_real on are padding (-inf anyway)."""
    if not c.any:
        return x
    R, n = x.shape
    dev = x.device
    pick = (lambda t: t if rows is None else t[rows])
    gid = gid0 + torch.arange(n, device=dev)
    if c.ids is not None:
        ids, vals = pick(c.ids), pick(c.values)
        pos = ids - gid0
        inside = (ids >= 0) & (pos >= 0) & (pos < (n if n_real is None else min(n, n_real)))
        posc = torch.where(inside, pos, 0)
        add = torch.zeros(R, n, device=dev).scatter_add_(1, posc, torch.where(inside, vals, 0.0))
        hits = torch.zeros(R, n, device=dev).scatter_add_(1, posc, inside.float()) > 0
        if c.penalty is not None:
            r = pick(c.penalty)[:, None]
            x = torch.where(hits, torch.where(x > 0, x / r, x * r), x)
        x = torch.where(hits, x + add, x)
    if c.mask is not None:
        words = pick(c.mask)
        w = gid >> 5
        inside_w = w < words.shape[1]
        bits = (words[:, w.clamp(max=words.shape[1] - 1)] >> (gid & 31)) & 1
        x = torch.where((bits != 0) & inside_w, x, float("-inf"))
    return x


def tile_pass(x: torch.Tensor, gid0: int, c: Constraints, n_real: int) -> torch.Tensor:
    """What the tile pass sees of a dense slice (as apply_dense's x, gid0; columns from n_real
    on are padding): the mask applied, and this slot's listed tokens -inf (the extra tile
    holds them, 2. above)."""
    if c.ids is not None:
        R, n = x.shape
        pos = c.ids - gid0
        inside = (c.ids >= 0) & (pos >= 0) & (pos < min(n, n_real))
        hits = torch.zeros(R, n, device=x.device).scatter_add_(
            1, torch.where(inside, pos, 0), inside.float()) > 0
        x = torch.where(hits, float("-inf"), x)
    return apply_dense(x, gid0, Constraints(c.mask, None, None, None))


def listed_records(hidden: torch.Tensor, weight: torch.Tensor, bias, c: Constraints,
                   inv_temp: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, *,
                   num_samples: int, n_real: int, vocab_start: int, candidates: bool,
                   replacement: bool, raw_mass: bool) -> torch.Tensor:
    """The extra tile's records in torch (2. above): [planes, B, 1, 4] fp32, the same values
    as kernels/listed_records.py."""
    from . import noise
    from .records import CANDIDATE_PLANES, CANDIDATES, NO_TOKEN, planes
    B = hidden.shape[0]
    dev = hidden.device
    ids, vals = c.ids, c.values
    K = ids.shape[1]
    loc = ids - vocab_start
    ok = (ids >= 0) & (loc >= 0) & (loc < n_real)
    eq = ids[:, :, None] == ids[:, None, :]
    earlier = torch.arange(K, device=dev)[None, :] < torch.arange(K, device=dev)[:, None]
    first = ok & ~(eq & earlier[None]).any(-1)
    vsum = torch.where(eq, vals[:, None, :], 0.0).sum(-1)
    locc = torch.where(ok, loc, 0)
    x = torch.einsum("bd,bkd->bk", hidden.float(), weight[locc].float())
    if bias is not None:
        x = x + bias[locc]
    if c.penalty is not None:
        r = c.penalty[:, None]
        x = torch.where(x > 0, x / r, x * r)
    x = x + vsum
    keep = first
    if c.mask is not None:
        w = (ids.clamp(min=0) >> 5).clamp(max=c.mask.shape[1] - 1)
        keep = keep & (((c.mask.gather(1, w) >> (ids.clamp(min=0) & 31)) & 1) != 0)
    x = torch.where(keep, x, float("-inf"))
    greedy = inv_temp == 0
    l = x * torch.where(greedy, 1.0, inv_temp)[:, None]
    m = l.amax(-1)
    is_nan = torch.isnan(l).any(-1)
    l = l.masked_fill(torch.isnan(l), float("-inf"))
    ms = l.amax(-1)
    ms = torch.where(torch.isfinite(ms), ms, torch.zeros_like(ms))
    lse = ms + torch.log(torch.exp(l - ms[:, None]).sum(-1))
    lse = torch.where(is_nan, float("nan"), lse)
    del m
    idkey = torch.where(keep, ids, int(NO_TOKEN)).float()
    out = torch.empty(planes(num_samples, candidates), B, 1, 4, device=dev)

    def best_of(z):
        best = z.amax(-1)
        tok = torch.where(z == best[:, None], idkey, NO_TOKEN).amin(-1)
        tok = torch.where(tok == NO_TOKEN, 0.0, tok)
        logit = torch.where(idkey == tok[:, None], l, float("-inf")).amax(-1)
        return best, tok, logit

    gids = ids.clamp(min=0)
    if not replacement:
        g = noise.gumbel(seed[:, None], offset[:, None], 0, gids)
        z = torch.where(greedy[:, None] | ~keep, l, l + g)
        for s in range(num_samples):
            best, tok, logit = best_of(z)
            out[s, :, 0] = torch.stack([best, tok, logit, lse], -1)
            z = torch.where(idkey == tok[:, None], float("-inf"), z)
    else:
        for s in range(num_samples):
            g = noise.gumbel(seed[:, None], offset[:, None], s, gids)
            z = torch.where(greedy[:, None] | ~keep, l, l + g)
            best, tok, logit = best_of(z)
            out[s, :, 0] = torch.stack([best, tok, logit, lse], -1)
    if candidates:
        c_l = l.clone()
        for j in range(CANDIDATE_PLANES):
            pair = []
            for _ in range(2):
                x_a = c_l.amax(-1)
                i_a = torch.where(c_l == x_a[:, None], idkey, NO_TOKEN).amin(-1)
                i_a = torch.where(i_a == NO_TOKEN, 0.0, i_a)
                c_l = torch.where((idkey == i_a[:, None]) & (c_l == x_a[:, None]),
                                  float("-inf"), c_l)
                pair += [x_a, i_a]
            out[num_samples + j, :, 0] = torch.stack(pair, -1)
        if raw_mass:
            xr = x.masked_fill(torch.isnan(x), float("-inf"))
            mr = xr.amax(-1)
            mr = torch.where(torch.isfinite(mr), mr, torch.zeros_like(mr))
            raw = torch.where(is_nan, float("nan"), mr + torch.log(torch.exp(xr - mr[:, None])
                                                                   .sum(-1)))
        else:
            raw = lse
        zero = torch.zeros_like(raw)
        out[num_samples + CANDIDATE_PLANES, :, 0] = torch.stack([raw, zero, zero, zero], -1)
    assert CANDIDATES == 2 * CANDIDATE_PLANES
    return out
