"""Candidate records computed with torch ops, chunk by chunk (the CPU path).

Produces exactly the record layout of kernels/fused_sample.py: [S, B, T, 4] with
(best perturbed score, global token id, transformed logit, tile log-mass) per
(sample, row, tile of `tile` tokens). Only a [B, chunk] slice of logits exists at a time,
so the full [B, V] row is never materialised.
"""
from __future__ import annotations

import torch

from . import noise

DEFAULT_TILE = 128


def transform(logits: torch.Tensor, bias: torch.Tensor | None, inv_temp: torch.Tensor,
              valid: torch.Tensor) -> torch.Tensor:
    """l = (logits + bias) * (1/T), greedy rows (inv_temp == 0) at T = 1, invalid ids -inf."""
    if bias is not None:
        logits = logits + bias
    scale = torch.where(inv_temp == 0, torch.ones_like(inv_temp), inv_temp)
    logits = logits * scale[:, None]
    return torch.where(valid, logits, torch.full_like(logits, float("-inf")))


def tile_records(l: torch.Tensor, gid: torch.Tensor, greedy: torch.Tensor, seed: torch.Tensor,
                 offset: torch.Tensor, num_samples: int, tile: int) -> torch.Tensor:
    """Transformed logits l [B, n] (n a multiple of `tile`) with global ids gid [n] → [S, B, n/tile, 4]."""
    B, n = l.shape
    is_nan = torch.isnan(l)
    l = l.masked_fill(is_nan, float("-inf"))
    lt = l.view(B, n // tile, tile)
    lse = torch.logsumexp(lt, dim=-1)
    lse = lse.masked_fill(is_nan.view(B, n // tile, tile).any(dim=-1), float("nan"))
    out = []
    for s in range(num_samples):
        g = noise.gumbel(seed[:, None], offset[:, None], s, gid[None, :])
        z = torch.where(greedy[:, None], l, l + g).view(B, n // tile, tile)
        idx = z.argmax(dim=-1)  # first maximal index, as tl.max(..., tie_break_left=True)
        best = z.gather(-1, idx[..., None])[..., 0]
        tok = gid.view(n // tile, tile)[torch.arange(n // tile)[None, :], idx]
        logit = lt.gather(-1, idx[..., None])[..., 0]
        out.append(torch.stack([best, tok.to(torch.float32), logit, lse], dim=-1))
    return torch.stack(out)


def records_torch(hidden: torch.Tensor, weight: torch.Tensor, *, bias, inv_temp, seed, offset,
                  num_samples: int, n_real: int, vocab_start: int = 0, num_tiles: int | None = None,
                  tile: int = DEFAULT_TILE, chunk_tiles: int = 64) -> torch.Tensor:
    """Records for rows [0, weight.shape[0]) of a (shard of the) LM head.

    hidden [B, D], weight [V_rows, D] any float dtype (computed in fp32); bias [V_rows]
    fp32 or None; inv_temp [B] fp32 (0 = greedy); seed/offset [B] int64; rows
    [n_real, V_rows) are padding. num_tiles >= ceil(V_rows / tile) pads the tile axis
    with empty tiles (as the kernel does for uneven shards). Returns [S, B, T, 4] fp32.
    """
    B = hidden.shape[0]
    V_rows = weight.shape[0]
    T = num_tiles if num_tiles is not None else -(-V_rows // tile)
    h = hidden.float()
    greedy = inv_temp == 0
    out = torch.empty(num_samples, B, T, 4, dtype=torch.float32, device=hidden.device)
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
        l = transform(logits, b, inv_temp, (rows < n_real)[None, :])
        out[:, :, t0 // tile: t1 // tile] = tile_records(l, vocab_start + rows, greedy, seed,
                                                         offset, num_samples, tile)
    return out
