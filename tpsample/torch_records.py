"""Stage 1 in torch ops, chunk by chunk (the CPU path).

Produces exactly the records of the kernels (tpsample/records.py): [S, B, T, 4] with
(best perturbed score, global token id, transformed logit, tile log-mass) per
(sample, row, tile of `tile` tokens). Only a [B, chunk] slice of logits exists at a time,
so the full [B, V] row is never materialised.
"""
from __future__ import annotations

import torch

from . import merge, noise
from .constraints import NO_CONSTRAINTS, Constraints, listed_records, tile_pass
from .records import CANDIDATE_PLANES, CANDIDATES, CDF_SUBGROUPS, TILE, planes


def transform(logits: torch.Tensor, bias: torch.Tensor | None, inv_temp: torch.Tensor,
              valid: torch.Tensor) -> torch.Tensor:
    """l = (logits + bias) * (1/T), greedy rows (inv_temp == 0) at T = 1, invalid ids -inf."""
    if bias is not None:
        logits = logits + bias
    scale = torch.where(inv_temp == 0, torch.ones_like(inv_temp), inv_temp)
    logits = logits * scale[:, None]
    return torch.where(valid, logits, torch.full_like(logits, float("-inf")))


def no_nan(x: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(torch.isnan(x), float("-inf"))


def tile_lse(l: torch.Tensor, tile: int) -> torch.Tensor:
    """logsumexp of each tile of l [B, n], NaN where the tile has a NaN."""
    B, n = l.shape
    is_nan = torch.isnan(l).view(B, n // tile, tile).any(dim=-1)
    lse = torch.logsumexp(no_nan(l).view(B, n // tile, tile), dim=-1)
    return lse.masked_fill(is_nan, float("nan"))


def _descending(z: torch.Tensor, count: int):
    """The first `count` of z [..., tile] in (value desc, index asc) order: (values, index)."""
    values, index = torch.sort(z, dim=-1, descending=True, stable=True)
    return values[..., :count], index[..., :count]


def candidate_records(l: torch.Tensor, raw: torch.Tensor, gid: torch.Tensor,
                      tile: int) -> torch.Tensor:
    """The candidate and raw planes (tpsample/records.py) of transformed logits l [B, n]
    (NaN already -inf) and raw (T = 1) logits [B, n] → [CANDIDATE_PLANES + 1, B, n/tile, 4]."""
    B, n = l.shape
    T = n // tile
    x, idx = _descending(l.view(B, T, tile), CANDIDATES)
    ids = gid.view(T, tile)[torch.arange(T)[None, :, None], idx].to(torch.float32)
    pairs = torch.stack([x, ids], dim=-1).view(B, T, CANDIDATE_PLANES, 4).permute(2, 0, 1, 3)
    raw_plane = torch.zeros(1, B, T, 4, dtype=torch.float32, device=l.device)
    raw_plane[0, ..., 0] = tile_lse(raw, tile)
    return torch.cat([pairs, raw_plane])


def tile_records(l: torch.Tensor, gid: torch.Tensor, greedy: torch.Tensor, seed: torch.Tensor,
                 offset: torch.Tensor, num_samples: int, tile: int, cdf: bool = False,
                 replacement: bool = True) -> torch.Tensor:
    """Transformed logits l [B, n] (n a multiple of `tile`) with global ids gid [n] → [S, B, n/tile, 4].
    cdf: the tile's token by inverse CDF (merge.py, fact 6) for rows that are not greedy;
    their record's score is then the token's logit (the log-mass merge does not read it).
    replacement=False: plane s holds the tile's (s+1)-th best score under sample 0's noise."""
    B, n = l.shape
    lse = tile_lse(l, tile)
    l = no_nan(l)
    lt = l.view(B, n // tile, tile)
    if not replacement:
        g = noise.gumbel(seed[:, None], offset[:, None], 0, gid[None, :])
        z = torch.where(greedy[:, None], l, l + g).view(B, n // tile, tile)
        best, idx = _descending(z, num_samples)
        tok = gid.view(n // tile, tile)[torch.arange(n // tile)[None, :, None], idx]
        logit = lt.gather(-1, idx)
        rec = torch.stack([best, tok.to(torch.float32), logit,
                           lse[..., None].expand_as(best)], dim=-1)
        return rec.permute(2, 0, 1, 3)
    out = []
    for s in range(num_samples):
        if cdf:
            z = l.view(B, n // tile, tile)
            idx = torch.where(greedy[:, None], z.argmax(dim=-1),
                              cdf_pick(lt, seed, offset, s, gid.view(n // tile, tile)[:, 0]))
        else:
            g = noise.gumbel(seed[:, None], offset[:, None], s, gid[None, :])
            z = torch.where(greedy[:, None], l, l + g).view(B, n // tile, tile)
            idx = z.argmax(dim=-1)  # first maximal index, as tl.max(..., tie_break_left=True)
        best = z.gather(-1, idx[..., None])[..., 0]
        tok = gid.view(n // tile, tile)[torch.arange(n // tile)[None, :], idx]
        logit = lt.gather(-1, idx[..., None])[..., 0]
        out.append(torch.stack([best, tok.to(torch.float32), logit, lse], dim=-1))
    return torch.stack(out)


def cdf_pick(lt: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, sample: int,
             tile_start: torch.Tensor) -> torch.Tensor:
    """Fact 6 of merge.py: lt [B, T, tile] transformed logits (NaN already -inf), tiles
    starting at global ids tile_start [T] → the index in each tile [B, T] int64."""
    B, T, tile = lt.shape
    sub = lt.view(B, T, CDF_SUBGROUPS, tile // CDF_SUBGROUPS)
    m = sub.amax(dim=-1)  # [B, T, 4]
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp(sub - m_safe[..., None])
    u_sub, u_pick = noise.cdf_uniforms(seed, offset, sample, tile_start, CDF_SUBGROUPS)
    within = merge.inverse_cdf(e, u_sub)  # [B, T, 4]
    top = m.amax(dim=-1, keepdim=True)  # the largest finite subgroup max (if any) as the
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)  # reference: no underflow
    weight = torch.where(m == float("-inf"), torch.zeros_like(m),
                         e.cumsum(dim=-1)[..., -1] * torch.exp(m_safe - top))
    j = merge.inverse_cdf(weight, u_pick)  # [B, T]
    return j * (tile // CDF_SUBGROUPS) + within.gather(-1, j[..., None])[..., 0]


def records_torch(hidden: torch.Tensor, weight: torch.Tensor, *, bias, inv_temp, seed, offset,
                  num_samples: int, n_real: int, vocab_start: int = 0, num_tiles: int | None = None,
                  tile: int = TILE, chunk_tiles: int = 64, cdf: bool = False,
                  candidates: bool = False, replacement: bool = True,
                  constraints: Constraints = NO_CONSTRAINTS, raw_mass: bool = True) -> torch.Tensor:
    """Records for rows [0, weight.shape[0]) of a (shard of the) LM head.

    hidden [B, D], weight [V_rows, D] any float dtype (computed in fp32); bias [V_rows]
    fp32 or None; inv_temp [B] fp32 (0 = greedy); seed/offset [B] int64; rows
    [n_real, V_rows) are padding. num_tiles >= ceil(V_rows / tile) pads the tile axis
    with empty tiles (as the kernel does for uneven shards). cdf, replacement: see
    tile_records; candidates: also the candidate and raw planes (tpsample/records.py).
    Returns [records.planes(S, candidates), B, T, 4] fp32.
    """
    B = hidden.shape[0]
    V_rows = weight.shape[0]
    T = num_tiles if num_tiles is not None else -(-V_rows // tile)
    h = hidden.float()
    greedy = inv_temp == 0
    out = torch.empty(planes(num_samples, candidates), B, T + int(constraints.listed), 4,
                      dtype=torch.float32, device=hidden.device)
    step = tile * chunk_tiles
    for t0 in range(0, T * tile, step):
        t1 = min(t0 + step, T * tile)
        rows = torch.arange(t0, t1, device=hidden.device)
        logits = torch.zeros(B, t1 - t0, dtype=torch.float32, device=hidden.device)
        r1 = min(t1, V_rows)
        if r1 > t0:
            logits[:, : r1 - t0] = h @ weight[t0:r1].float().T
        b = None
        if bias is not None:
            b = torch.zeros(t1 - t0, dtype=torch.float32, device=hidden.device)
            b[: max(r1 - t0, 0)] = bias[t0:r1]
        valid = (rows < n_real)[None, :]
        if constraints.any:
            logits = tile_pass(logits if b is None else logits + b, vocab_start + t0,
                               constraints, n_real - t0)
            b = None
        l = transform(logits, b, inv_temp, valid)
        gid = vocab_start + rows
        span = slice(t0 // tile, t1 // tile)
        out[:num_samples, :, span] = tile_records(l, gid, greedy, seed, offset, num_samples, tile,
                                                  cdf, replacement)
        if candidates:
            raw = transform(logits, b, torch.ones_like(inv_temp), valid) if raw_mass else l
            out[num_samples:, :, span] = candidate_records(no_nan(l), raw,
                                                           gid, tile)
    if constraints.listed:
        out[:, :, T:] = listed_records(
            hidden, weight, bias, constraints, inv_temp, seed, offset, num_samples=num_samples,
            n_real=n_real, vocab_start=vocab_start, candidates=candidates,
            replacement=replacement, raw_mass=raw_mass)
    return out


def merge_records(recs: torch.Tensor, params, merge_name: str):
    """Stage 2 in torch (tpsample/merge.py): records [slots, S, B, T, 4] and the call's
    RowParams → tokens, logprobs, logz."""
    return merge.reduce_records(recs, params.seed, params.offset, params.inv_temp == 0,
                                merge_name)
