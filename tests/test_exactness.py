"""Statistical exactness: chi-squared goodness of fit against float64 softmax.

Each call samples B identical rows with distinct seeds × num_samples draws, i.e. B·S
independent draws from one distribution. See stats.py for the false-alarm rate (ALPHA per
test, fixed seeds). The negative controls at the end show the same test rejects samplers
that are only slightly wrong, so these tests can fail.
"""
import pytest
import torch

import tpsample
from tpsample import merge, noise
from tpsample.online import OnlineSampler

from cases import exact_probs, lm_head_case
from stats import ALPHA, chi2_pvalue


def draw(h, w, n_rows, n_samples, *, backend, seed_base=0, **kw):
    seeds = torch.arange(n_rows, dtype=torch.int64, device=h.device) * 7919 + seed_base
    return tpsample.sample(h.expand(n_rows, -1).contiguous(), w, seed=seeds, num_samples=n_samples,
                           backend=backend, **kw)


# the fast suite keeps one shape and temperature per merge; the rest run with -m slow
CHI2_CASES = [pytest.param(kind, t, m, marks=() if (kind, t) == ("zipf", 1.0) else pytest.mark.slow)
              for kind in ("flat", "peaked", "zipf") for t in (0.5, 1.0, 2.0)
              for m in ("max", "logmass", "cdf")]


@pytest.mark.parametrize("kind,temperature,merge", CHI2_CASES)
def test_chi2_torch_path(kind, temperature, merge):
    h, w = lm_head_case(kind, V=300, seed={"flat": 1, "peaked": 2, "zipf": 3}[kind])
    tokens = draw(h, w, 400, 50, backend="torch", temperature=temperature, merge=merge)
    p = exact_probs(h, w, temperature=temperature)
    assert chi2_pvalue(tokens, p) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("merge", ["max", "logmass", "cdf"])
def test_chi2_with_bias_padded_vocab_bf16(merge):
    h, w = lm_head_case("zipf", V=320, dtype=torch.bfloat16, seed=2)
    bias = torch.randn(320, generator=torch.Generator().manual_seed(1))
    bias[300:] = 50.0  # padding rows would dominate if they were ever sampled
    tokens = draw(h, w, 400, 50, backend="torch", temperature=0.8, bias=bias, vocab_size=300,
                  merge=merge)
    assert int(tokens.max()) < 300
    assert chi2_pvalue(tokens, exact_probs(h, w, temperature=0.8, bias=bias, vocab_size=300)[:300]) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("merge", ["max", "logmass", "cdf"])
def test_chi2_triton_kernel(merge, device):
    """The real Triton kernels (interpreted on CPU): 3 tiles, padded vocab, T = 0.7."""
    h, w = lm_head_case("zipf", V=300, device=device, seed=5)
    tokens = draw(h, w, 256, 40, backend="triton", temperature=0.7, vocab_size=290, merge=merge)
    assert chi2_pvalue(tokens, exact_probs(h.cpu(), w.cpu(), temperature=0.7, vocab_size=290)[:290]) > ALPHA


def test_chi2_per_row_temperatures_in_one_batch():
    """Rows with different temperatures in the same call each follow their own softmax."""
    h, w = lm_head_case("peaked", V=200, seed=8)
    temps = torch.tensor([0.5, 2.0]).repeat_interleave(300)
    seeds = torch.arange(600, dtype=torch.int64)
    tokens = tpsample.sample(h.expand(600, -1), w, temperature=temps, seed=seeds, num_samples=30,
                             backend="torch")
    for t, rows in ((0.5, slice(0, 300)), (2.0, slice(300, 600))):
        assert chi2_pvalue(tokens[rows], exact_probs(h, w, temperature=t)) > ALPHA


def online_draw(l, n_rows, n_samples, chunks, seed_base=0):
    sampler = OnlineSampler(n_rows, seed=torch.arange(n_rows, dtype=torch.int64) + seed_base,
                            num_samples=n_samples)
    for lo, hi in chunks:
        sampler.update(l[lo:hi].expand(n_rows, -1), lo)
    return sampler.result()


def test_chi2_online_sampler_uneven_chunks_any_order():
    h, w = lm_head_case("zipf", V=257, seed=4)
    l = (h.float() @ w.float().T)
    edges = [0, 1, 17, 18, 100, 128, 200, 257]
    chunks = list(zip(edges[:-1], edges[1:]))
    chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=torch.Generator().manual_seed(0))]
    out = online_draw(l, 500, 40, chunks)
    assert chi2_pvalue(out.tokens, exact_probs(h, w)) > ALPHA
    assert torch.allclose(out.logz.double(), torch.logsumexp(l.double(), -1).expand(500), atol=1e-4)
    want = torch.log_softmax(l.double(), -1)[out.tokens]
    assert torch.allclose(out.logprobs.double(), want, atol=1e-4)


# ---- negative controls: the tests above must be able to fail ----------------------------

def test_control_wrong_temperature_is_rejected():
    h, w = lm_head_case("zipf", V=300, seed=3)
    tokens = draw(h, w, 400, 50, backend="torch", temperature=1.1)
    assert chi2_pvalue(tokens, exact_probs(h, w, temperature=1.0)) < ALPHA


def test_control_group_choice_without_fresh_noise_is_rejected():
    """Log-mass merge that picks the heaviest group deterministically (no group noise)."""
    h, w = lm_head_case("flat", V=256, seed=6)
    l = h.float() @ w.float().T
    n_rows, S = 400, 50
    seeds = torch.arange(n_rows, dtype=torch.int64)[:, None]
    groups = l.view(2, 128)
    heavy = int(torch.logsumexp(groups, -1).argmax())
    ids = heavy * 128 + torch.arange(128)[None, :]
    tokens = torch.stack([(groups[heavy] + noise.gumbel(seeds, torch.zeros_like(seeds), s, ids)).argmax(-1)
                          for s in range(S)]) + heavy * 128
    assert chi2_pvalue(tokens, exact_probs(h, w)) < ALPHA


def test_control_cdf_subgroups_chosen_by_unscaled_sums_is_rejected():
    """Fact 6 with the subgroups chosen by their sums S_j alone, without exp(m_j - M): wrong
    wherever the subgroup maxima differ (the "peaked" head puts them nats apart)."""
    h, w = lm_head_case("peaked", V=128, seed=2)
    e = torch.softmax((h.float() @ w.float().T).view(4, 32), dim=-1)  # per-subgroup weights
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64)
    u_sub, u_pick = noise.cdf_uniforms(seeds, torch.zeros_like(seeds), 0, torch.zeros(1, dtype=torch.int64))
    within = merge.inverse_cdf(e.expand(n, 1, 4, 32), u_sub)  # [n, 1, 4]
    j = merge.inverse_cdf(e.sum(-1).expand(n, 1, 4), u_pick)  # [n, 1]
    tokens = j * 32 + within.gather(-1, j[..., None])[..., 0]
    assert chi2_pvalue(tokens, exact_probs(h, w)) < ALPHA


def test_control_correlated_noise_across_samples_is_rejected():
    """Reusing one noise draw for all samples of a row makes counts overdispersed."""
    h, w = lm_head_case("flat", V=100, seed=9)
    tokens = draw(h, w, 40, 1, backend="torch").repeat(1, 500)
    assert chi2_pvalue(tokens, exact_probs(h, w)) < ALPHA
