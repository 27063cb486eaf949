"""Goodness-of-fit helpers shared by the statistical tests.

Every statistical test draws with fixed seeds, so its outcome is deterministic; the
significance level ALPHA is the chance that an exact sampler fails one test on a fresh
seed (the false-alarm rate). With ~60 such tests the family-wise rate is below 1 %.
Negative controls (test_exactness.py) show the same test rejects slightly wrong samplers.
"""
import numpy as np
import torch
from scipy import stats

ALPHA = 1e-4
MIN_EXPECTED = 5.0


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-squared p-value of token counts against float64 probabilities [V].

    Categories with expected count < MIN_EXPECTED are pooled into one bin (and that bin
    too is dropped into the smallest kept bin if it stays below MIN_EXPECTED)."""
    tokens = tokens.reshape(-1).cpu().numpy()
    p = probs.double().cpu().numpy()
    n = tokens.size
    assert tokens.min() >= 0 and tokens.max() < p.size, "token outside the vocabulary"
    counts = np.bincount(tokens, minlength=p.size).astype(np.float64)
    expected = p * n
    keep = expected >= MIN_EXPECTED
    obs = list(counts[keep])
    exp = list(expected[keep])
    rest_obs, rest_exp = counts[~keep].sum(), expected[~keep].sum()
    if rest_exp >= MIN_EXPECTED:
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_exp > 0 or rest_obs > 0:
        i = int(np.argmin(exp))
        obs[i] += rest_obs
        exp[i] += rest_exp
    assert len(obs) >= 2, "not enough categories with expected count >= 5"
    exp = np.asarray(exp)
    exp *= np.sum(obs) / exp.sum()  # guards against float64 round-off in sum(p) != 1
    return float(stats.chisquare(obs, exp).pvalue)
