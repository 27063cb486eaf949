"""The exactness math: how candidate records become exact samples.

Setting. Row b has transformed logits l_i over the real vocabulary, p = softmax(l),
and log Z = logsumexp(l). The vocabulary is partitioned into groups (kernel tiles,
tensor-parallel shards × tiles, or streamed chunks). Group k reports a record
(best perturbed score z*_k, its token i*_k, its logit l_{i*_k}, its log-mass L_k =
logsumexp(l over k)).

1. Gumbel-max. With g_i i.i.d. Gumbel(0, 1), argmax_i (l_i + g_i) ~ p.
2. Pathwise max ("max" merge). max_i = max_k max_{i in k}, so the token of the record
   with the largest z*_k IS the full-row argmax, path by path, for any partition.
   Since g_i depends only on (seed, offset, sample, global id i), the token is the
   same for every tiling, batch layout and TP degree (up to fp32 rounding of l).
3. Max-stability ("logmass" merge). max_{i in k}(l_i + g_i) ~ Gumbel(L_k, 1),
   independent across disjoint groups, and independent of which i attains it. So
   choose group k with fresh Gumbels h_k: argmax_k (L_k + h_k) ~ softmax(L), then
   take that group's within-group winner i*_k ~ softmax(l over k). The product is
   P(k) P(i | k) = (Z_k / Z) (p_i Z / Z_k) = p_i: exact in distribution. It depends on
   the partition (the fresh h_k are per group), so tokens are not TP-invariant.
4. Binary merge (streaming, OnlineSampler). State (L_A, i_A) and a new group
   (L_B, i_B): L = logaddexp(L_A, L_B); keep i_B with probability exp(L_B - L) =
   1 / (1 + exp(L_A - L_B)). By induction the state after the last group is an exact
   sample from p and L = log Z.
5. log Z = logsumexp_k L_k in every mode, and log p(token) = l_token - log Z.
6. Inverse CDF ("cdf" merge: fact 3 without per-token noise). Group k (a 128-token tile) is
   split into 4 subgroups j of 32 consecutive ids. Subgroup j, with max m_j, weights
   e_i = exp(l_i - m_j) and S_j = sum e_i, picks the first i (in id order) whose running
   sum C_i exceeds u_j S_j, u_j uniform: P(i | j) = e_i / S_j = exp(l_i) / Z_j. The group
   then picks subgroup j the same way with one more uniform over W_j = S_j exp(m_j - M),
   M = max_j m_j: P(j | k) = Z_j / Z_k. So i*_k ~ softmax(l over k), independently of the
   other groups (the uniforms are keyed by (seed, offset, sample, tile), noise.cdf_uniforms),
   which is all fact 3 needs: with its group choice P(i) = p_i. Five uniforms per (row,
   tile) replace 128 Gumbels, and no logarithm is taken. In float32 each interval boundary
   is rounded (~2**-24 of the running sum) and u has 23 bits: a total-variation distortion
   of at most ~32 * 2**-23 = 4e-6 per choice, and a token whose share of its subgroup is
   below ~2**-24 can be unreachable, as the Gumbel tails' truncation (noise.py) makes tokens
   ~19.5 nats below the max unreachable. A token of weight 0 is never chosen; if rounding
   puts u S at or above every running sum, the last token of positive weight is.

Degenerate rows (log Z not finite: every logit -inf, a NaN, or +inf) return token -1,
logprob NaN and their non-finite log Z (tokens < 0, or isfinite(logz), find them without a
host sync); an index outside [0, vocab_size) other than -1 is never returned.
"""
from __future__ import annotations

import torch

from . import noise
from .records import NO_TOKEN

GROUP_MERGES = ("logmass", "cdf")  # merges that choose among the records by log-mass


def pathwise_max(score: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Index (along the last dim) of the largest score; ties go to the smallest token id."""
    best = score.amax(dim=-1, keepdim=True)
    cand = torch.where(score == best, token, torch.full_like(token, NO_TOKEN))
    return cand.argmin(dim=-1)


def group_gumbel_choice(log_mass: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                        sample: int) -> torch.Tensor:
    """argmax_k (L_k + h_k), h_k fresh Gumbels keyed by the group's record index k.

    log_mass [B, N] float32, seed/offset [B] int64 → index [B] (fact 3).
    """
    index = torch.arange(log_mass.shape[-1], device=log_mass.device)[None, :]
    h = noise.gumbel(seed[:, None], offset[:, None], sample, index, stream=noise.GROUP_STREAM)
    return (log_mass + h).nan_to_num(nan=float("-inf")).argmax(dim=-1)


def inverse_cdf(weight: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Fact 6's choice along the last dim: the first index whose running sum exceeds u times
    the total among those of positive weight, else the last of positive weight, else 0.
    weight [..., n] >= 0 float32, u [...] in (0, 1) → index int64 [...]."""
    csum = weight.cumsum(dim=-1)
    positive = weight > 0
    cross = (csum > (u * csum[..., -1])[..., None]) & positive
    n = weight.shape[-1]
    pos = torch.arange(n, device=weight.device)
    first = torch.where(cross, pos, n).amin(dim=-1)
    last = torch.where(positive, pos, -1).amax(dim=-1).clamp(min=0)
    return torch.where(first < n, first, last)


def binary_merge(log_mass_a: torch.Tensor, log_mass_b: torch.Tensor,
                 u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fact 4: (take_b, merged log-mass) given a uniform u in (0, 1) per row."""
    merged = torch.logaddexp(log_mass_a, log_mass_b)
    p_take_b = torch.sigmoid(log_mass_b - log_mass_a)  # 1 / (1 + exp(L_A - L_B))
    p_take_b = torch.where(log_mass_a == float("-inf"),
                           (log_mass_b > float("-inf")).to(p_take_b.dtype), p_take_b)
    return u < p_take_b, merged


def finish(token: torch.Tensor, logit: torch.Tensor, logz: torch.Tensor):
    """Fact 5 and the degenerate-row rule. token/logit [B, S] float32, logz [B]."""
    ok = torch.isfinite(logz)[:, None]
    tokens = torch.where(ok, token, torch.full_like(token, -1)).to(torch.int64)
    logprobs = torch.where(ok, logit - logz[:, None], torch.full_like(logit, float("nan")))
    return tokens, logprobs


def reduce_records(records: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                   greedy: torch.Tensor, merge: str):
    """Records [slots, S, B, T, 4] (score, token, logit, lse) → tokens int64 [B, S],
    logprobs float32 [B, S], logz float32 [B].

    The N = slots × T records of a row are every group of the partition (all tiles of all
    shards); group n is slot n // T, tile n % T. seed/offset [B] int64; greedy [B] bool
    rows always use the pathwise max (their score has no noise).
    """
    slots, S, B, T, _ = records.shape
    records = records.permute(1, 2, 0, 3, 4).reshape(S, B, slots * T, 4)
    score, token, logit, lse = records.unbind(dim=-1)
    logz = torch.logsumexp(lse[0], dim=-1)
    pick = pathwise_max(score, token)  # [S, B]
    if merge in GROUP_MERGES:
        by_mass = torch.stack([group_gumbel_choice(lse[s], seed, offset, s)
                               for s in range(S)])
        pick = torch.where(greedy[None, :], pick, by_mass)
    pick = pick[..., None]
    tok = token.gather(-1, pick)[..., 0].T
    lg = logit.gather(-1, pick)[..., 0].T
    return (*finish(tok, lg, logz), logz)
