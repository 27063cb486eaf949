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

from .filters import filtered_rows  # noqa: F401  (the full-row semantics, shared)
from . import noise
from . import params as P
from .records import CDF_SUBGROUPS, TILE
from .spec import sampling_spec


class ReferenceOutput(NamedTuple):
    tokens: torch.Tensor    # int64 [B, S]
    logprobs: torch.Tensor  # float64 [B, S]
    logz: torch.Tensor      # float64 [B]
    scores: torch.Tensor    # float32 [B, S, V] perturbed scores (for near-tie checks)
    logits: torch.Tensor    # float32 [B, V] transformed logits (-inf beyond vocab_size)
    top_tokens: torch.Tensor | None = None    # int64 [B, n] (top_logprobs=n)
    top_logprobs: torch.Tensor | None = None  # float64 [B, n]


def constrained_logits(logits: torch.Tensor, allowed_mask=None, logit_adjust=None,
                       repetition_penalty=None) -> torch.Tensor:
    """The semantics of tpsample/constraints.py on full rows: logits [B, V] (bias applied,
    before the temperature) → the same dtype, with the mask (-inf where the bit is 0), then
    the repetition penalty (once per listed token) and the summed adjustments."""
    B, V = logits.shape
    x = logits.clone()
    if logit_adjust is not None:
        ids, values = logit_adjust
        listed = torch.zeros(B, V, dtype=torch.int64, device=x.device)
        add = torch.zeros(B, V, dtype=x.dtype, device=x.device)
        rows = torch.arange(B, device=x.device)[:, None].expand_as(ids)
        real = ids >= 0
        listed.index_put_((rows[real], ids[real]), torch.ones_like(ids[real]), accumulate=True)
        add.index_put_((rows[real], ids[real]), values[real].to(x.dtype), accumulate=True)
        if repetition_penalty is not None:
            r = torch.as_tensor(repetition_penalty, dtype=x.dtype, device=x.device)
            r = r.expand(B)[:, None]
            x = torch.where((listed > 0) & (x > 0), x / r, torch.where(listed > 0, x * r, x))
        x = torch.where(listed > 0, x + add, x)
    if allowed_mask is not None:
        i = torch.arange(V, device=x.device)
        bits = (allowed_mask.long()[:, i // 32] >> (i % 32)) & 1
        x = x.masked_fill(bits == 0, float("-inf"))
    return x


def transformed_logits(hidden: torch.Tensor, weight: torch.Tensor, *,
                       temperature: float | torch.Tensor = 1.0, bias: torch.Tensor | None = None,
                       vocab_size: int | None = None, allowed_mask=None, logit_adjust=None,
                       repetition_penalty=None) -> torch.Tensor:
    """l = ((h @ W.T) + bias, constrained) / T in fp32, -inf from vocab_size on; T = 0 rows
    use T = 1, and temperatures take the limits tpsample.sample gives them. [B, V]."""
    V = weight.shape[0]
    vocab_size = V if vocab_size is None else vocab_size
    logits = hidden.float() @ weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    logits = constrained_logits(logits, allowed_mask, logit_adjust, repetition_penalty)
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
                     tile: int = TILE, top_k=None, top_p=None, min_p=None,
                     top_logprobs: int = 0, replacement: bool = True,
                     logprobs_mode: str = "processed", allowed_mask=None, logit_adjust=None,
                     repetition_penalty=None) -> ReferenceOutput:
    """Full-row Gumbel-max (merge="max") or Group-Gumbel-Max over `tile`-token groups, the
    token in the chosen group by Gumbel-max ("logmass") or inverse CDF ("cdf"). Arguments
    as tpsample.sample (checked the same way); tile: a positive multiple of 4. With
    filters, top_logprobs, replacement=False or logprobs_mode="raw": filtered_rows (rows
    with filters sample by Gumbel-max over their kept set whatever the merge). The
    constraints (tpsample/constraints.py) with merge "max" only: the group merges put the
    listed tokens in a group of their own, which this full-row reference does not model."""
    P.check_hidden_weight(hidden, weight)
    B, V = hidden.shape[0], weight.shape[0]
    vocab_size = P.check_vocab_size(V if vocab_size is None else vocab_size, V)
    P.check_options(num_samples, merge)
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 4 or tile % 4:
        raise ValueError(f"tile must be a positive multiple of 4, got {tile!r}")
    bias = P.check_bias(bias, V, hidden.device)
    if logit_adjust is not None and merge != "max":
        raise ValueError("reference_sample: logit_adjust with merge='max' only")
    spec = sampling_spec(hidden, vocab_size=vocab_size, rows=V, merge=merge,
                         temperature=temperature, seed=seed, offset=offset,
                         num_samples=num_samples, return_logprobs=True, top_k=top_k,
                         top_p=top_p, min_p=min_p, top_logprobs=top_logprobs,
                         replacement=replacement, logprobs_mode=logprobs_mode,
                         allowed_mask=allowed_mask, logit_adjust=logit_adjust,
                         repetition_penalty=repetition_penalty)
    row, filt = spec.row, spec.filters
    dev = hidden.device
    l = transformed_logits(hidden, weight, temperature=temperature, bias=bias,
                           vocab_size=vocab_size, allowed_mask=allowed_mask,
                           logit_adjust=logit_adjust, repetition_penalty=repetition_penalty)
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
    if not spec.candidates:
        tokens, logprobs = _degenerate(tokens, logprobs, logz)
        return ReferenceOutput(tokens, logprobs, logz, torch.stack(scores, dim=1), l)
    f_tok, f_lp, f_lz, top_tok, top_lp = filtered_rows(l, row.inv_temp, seed, offset, filt,
                                                       num_samples)
    use = spec.filtered_rows()[:, None] | (not filt.replacement)
    tokens = torch.where(use, f_tok, tokens)
    x_tok = torch.where(tokens >= 0, l64.gather(1, tokens.clamp(min=0)), float("-inf"))
    if filt.raw:
        # (unfiltered rows with replacement keep their merge's token; its raw log-prob:)
        to_raw = torch.where(greedy, 1.0, 1.0 / torch.where(greedy, 1.0, row.inv_temp)).double()
        logprobs = torch.where(use, f_lp, x_tok * to_raw[:, None] - f_lz[:, None])
    else:
        logprobs = torch.where(use, f_lp, x_tok - f_lz[:, None])
    logprobs = torch.where(tokens >= 0, logprobs, float("-inf"))
    tokens, logprobs = _degenerate(tokens, logprobs, f_lz)
    top_tok, top_lp = _degenerate(top_tok, top_lp, f_lz)
    return ReferenceOutput(tokens, logprobs, f_lz, torch.stack(scores, dim=1), l, top_tok,
                           top_lp)


def _degenerate(tokens, logprobs, logz):
    """The degenerate-row rule (tpsample/merge.py): rows whose log Z is not finite give
    token -1 and log-prob NaN in every slot."""
    ok = torch.isfinite(logz)[:, None]
    return (torch.where(ok, tokens, -1),
            torch.where(ok, logprobs, torch.full_like(logprobs, float("nan"))))
