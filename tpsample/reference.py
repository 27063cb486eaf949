"""Reference sampler: the full row in plain torch, with the SAME noise function.

Slow and memory-hungry on purpose ([B, V] logits in fp32, log Z in float64): it is what
the fused kernels are tested against. Tokens agree with tpsample.sample except for rows
whose top-2 perturbed scores are within fp32 rounding of the logits.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import noise
from .torch_records import DEFAULT_TILE, cdf_pick


class ReferenceOutput(NamedTuple):
    tokens: torch.Tensor    # int64 [B, S]
    logprobs: torch.Tensor  # float64 [B, S]
    logz: torch.Tensor      # float64 [B]
    scores: torch.Tensor    # float32 [B, S, V] perturbed scores (for near-tie checks)
    logits: torch.Tensor    # float32 [B, V] transformed logits (-inf beyond vocab_size)


def transformed_logits(hidden, weight, *, temperature=1.0, bias=None, vocab_size=None):
    """l = ((h @ W.T)[:, :vocab] + bias) / T in fp32; T = 0 rows use T = 1. [B, V]."""
    V = weight.shape[0]
    vocab_size = V if vocab_size is None else vocab_size
    logits = hidden.float() @ weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    t = torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device).expand(hidden.shape[0])
    inv = torch.where(t == 0, torch.ones_like(t), 1.0 / t)
    logits = logits * inv[:, None]
    logits[:, vocab_size:] = float("-inf")
    return logits


def reference_sample(hidden, weight, *, temperature=1.0, seed=0, offset=0, bias=None,
                     vocab_size=None, num_samples=1, merge="max", tile=DEFAULT_TILE):
    """Full-row Gumbel-max (merge="max") or Group-Gumbel-Max over `tile`-token groups, the
    token in the chosen group by Gumbel-max ("logmass") or inverse CDF ("cdf")."""
    B, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    l = transformed_logits(hidden, weight, temperature=temperature, bias=bias, vocab_size=vocab_size)
    greedy = torch.as_tensor(temperature, device=dev).expand(B) == 0
    seed = torch.as_tensor(seed, dtype=torch.int64, device=dev).expand(B)[:, None]
    offset = torch.as_tensor(offset, dtype=torch.int64, device=dev).expand(B)[:, None]
    ids = torch.arange(V, device=dev)[None, :]
    l64 = l.double()
    logz = torch.logsumexp(l64, dim=-1)
    tokens, scores = [], []
    for s in range(num_samples):
        z = torch.where(greedy[:, None], l, l + noise.gumbel(seed, offset, s, ids))
        scores.append(z)
        tok = z.argmax(dim=-1)
        if merge in ("logmass", "cdf"):
            T = -(-V // tile)
            pad = T * tile - V
            zt = torch.nn.functional.pad(z, (0, pad), value=float("-inf")).view(B, T, tile)
            lt = torch.nn.functional.pad(l64, (0, pad), value=float("-inf")).view(B, T, tile)
            mass = torch.logsumexp(lt, dim=-1).float()
            h = noise.gumbel(seed, offset, s, torch.arange(T, device=dev)[None, :],
                             stream=noise.GROUP_STREAM)
            group = (mass + h).argmax(dim=-1)
            if merge == "cdf":
                l32 = torch.nn.functional.pad(l, (0, pad), value=float("-inf")).view(B, T, tile)
                picks = cdf_pick(l32.nan_to_num(nan=float("-inf")), seed[:, 0], offset[:, 0], s,
                                 torch.arange(T, device=dev) * tile)
                in_group = picks[torch.arange(B, device=dev), group]
            else:
                in_group = zt[torch.arange(B, device=dev), group].argmax(dim=-1)
            tok = torch.where(greedy, tok, group * tile + in_group)
        tokens.append(tok)
    tokens = torch.stack(tokens, dim=1)
    logprobs = l64.gather(1, tokens) - logz[:, None]
    return ReferenceOutput(tokens, logprobs, logz, torch.stack(scores, dim=1), l)
