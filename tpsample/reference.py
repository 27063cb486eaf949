"""Reference sampler: the full row in plain torch, with the SAME noise function.

Slow and memory-hungry on purpose ([B, V] logits in fp32, log Z and the inverse-CDF choices
in float64): it is what the kernels are tested against, so it shares only the noise
(tpsample/noise.py) and the argument checks (tpsample/params.py) with them. Tokens agree with
tpsample.sample except for rows whose top-2 perturbed scores are within fp32 rounding of
the logits (merge "cdf": a uniform within rounding of a cumulative-probability boundary).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import noise
from . import params as P
from .records import CDF_SUBGROUPS, TILE


class ReferenceOutput(NamedTuple):
    tokens: torch.Tensor    # int64 [B, S]
    logprobs: torch.Tensor  # float64 [B, S]
    logz: torch.Tensor      # float64 [B]
    scores: torch.Tensor    # float32 [B, S, V] perturbed scores (for near-tie checks)
    logits: torch.Tensor    # float32 [B, V] transformed logits (-inf beyond vocab_size)


def transformed_logits(hidden: torch.Tensor, weight: torch.Tensor, *,
                       temperature: float | torch.Tensor = 1.0, bias: torch.Tensor | None = None,
                       vocab_size: int | None = None) -> torch.Tensor:
    """l = ((h @ W.T) + bias) / T in fp32, -inf from vocab_size on; T = 0 rows use T = 1,
    and temperatures take the limits tpsample.sample gives them. [B, V]."""
    V = weight.shape[0]
    vocab_size = V if vocab_size is None else vocab_size
    logits = hidden.float() @ weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    inv = P.row_params(hidden, temperature, 0, 0).inv_temp.to(logits.device)
    logits = logits * torch.where(inv == 0, torch.ones_like(inv), inv)[:, None]
    logits[:, vocab_size:] = float("-inf")
    return logits


def _first_above(cum: torch.Tensor, u: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative probability exceeds u, restricted to positive
    weights; past the end (rounding) the last positive one; none positive: 0."""
    n = cum.shape[-1]
    pos = torch.arange(n, device=cum.device)
    first = torch.where((cum > u[..., None]) & positive, pos, n).amin(dim=-1)
    last = torch.where(positive, pos, -1).amax(dim=-1).clamp(min=0)
    return torch.where(first < n, first, last)


def inverse_cdf_in_tiles(l: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, sample: int,
                         tile: int) -> torch.Tensor:
    """Merge "cdf"'s token in every tile (tpsample/merge.py, fact 6), in float64 from the
    definition: subgroup j (tile // 4 consecutive ids) picks id i with probability
    exp(l_i) / Z_j by its uniform; the tile picks subgroup j with probability Z_j / Z_tile by
    one more. l [B, T * tile] float32 (-inf padded), seed/offset [B] → index in tile [B, T]."""
    B = l.shape[0]
    T = l.shape[1] // tile
    sub = l.double().nan_to_num(nan=float("-inf")).view(B, T, CDF_SUBGROUPS, tile // CDF_SUBGROUPS)
    u_sub, u_pick = noise.cdf_uniforms(seed, offset, sample,
                                       torch.arange(T, device=l.device) * tile, CDF_SUBGROUPS)
    log_z = torch.logsumexp(sub, dim=-1)  # [B, T, 4]
    p_in = torch.exp(sub - log_z.nan_to_num(neginf=0.0)[..., None])
    within = _first_above(p_in.cumsum(-1), u_sub.double(), sub > float("-inf"))
    p_sub = torch.exp(log_z - torch.logsumexp(log_z, -1, keepdim=True).nan_to_num(neginf=0.0))
    j = _first_above(p_sub.cumsum(-1), u_pick.double(), log_z > float("-inf"))
    return j * (tile // CDF_SUBGROUPS) + within.gather(-1, j[..., None])[..., 0]


def reference_sample(hidden: torch.Tensor, weight: torch.Tensor, *,
                     temperature: float | torch.Tensor = 1.0, seed: int | torch.Tensor | None = 0,
                     offset: int | torch.Tensor = 0, bias: torch.Tensor | None = None,
                     vocab_size: int | None = None, num_samples: int = 1, merge: str = "max",
                     tile: int = TILE) -> ReferenceOutput:
    """Full-row Gumbel-max (merge="max") or Group-Gumbel-Max over `tile`-token groups, the
    token in the chosen group by Gumbel-max ("logmass") or inverse CDF ("cdf"). Arguments
    as tpsample.sample (checked the same way); tile: a positive multiple of 4."""
    P.check_hidden_weight(hidden, weight)
    B, V = hidden.shape[0], weight.shape[0]
    vocab_size = P.check_vocab_size(V if vocab_size is None else vocab_size, V)
    P.check_options(num_samples, merge)
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 4 or tile % 4:
        raise ValueError(f"tile must be a positive multiple of 4, got {tile!r}")
    bias = P.check_bias(bias, V, hidden.device)
    row = P.row_params(hidden, temperature, seed, offset)
    dev = hidden.device
    l = transformed_logits(hidden, weight, temperature=temperature, bias=bias, vocab_size=vocab_size)
    greedy = row.inv_temp == 0
    seed, offset = row.seed, row.offset
    ids = torch.arange(V, device=dev)[None, :]
    l64 = l.double()
    logz = torch.logsumexp(l64, dim=-1)
    T = -(-V // tile)
    pad = torch.nn.functional.pad
    tokens, scores = [], []
    for s in range(num_samples):
        z = torch.where(greedy[:, None], l, l + noise.gumbel(seed[:, None], offset[:, None], s, ids))
        scores.append(z)
        tok = z.argmax(dim=-1)
        if merge in ("logmass", "cdf"):
            lt = pad(l64, (0, T * tile - V), value=float("-inf")).view(B, T, tile)
            mass = torch.logsumexp(lt, dim=-1).float()
            h = noise.gumbel(seed[:, None], offset[:, None], s, torch.arange(T, device=dev)[None, :],
                             stream=noise.GROUP_STREAM)
            group = (mass + h).argmax(dim=-1)
            rows = torch.arange(B, device=dev)
            if merge == "cdf":
                picks = inverse_cdf_in_tiles(pad(l, (0, T * tile - V), value=float("-inf")),
                                             seed, offset, s, tile)
                in_group = picks[rows, group]
            else:
                zt = pad(z, (0, T * tile - V), value=float("-inf")).view(B, T, tile)
                in_group = zt[rows, group].argmax(dim=-1)
            tok = torch.where(greedy, tok, group * tile + in_group)
        tokens.append(tok)
    tokens = torch.stack(tokens, dim=1)
    logprobs = l64.gather(1, tokens) - logz[:, None]
    return ReferenceOutput(tokens, logprobs, logz, torch.stack(scores, dim=1), l)
