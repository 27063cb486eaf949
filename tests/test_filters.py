"""Filtered sampling (tpsample/filters.py): top-k, top-p, min-p, top log-probs, raw log-probs,
samples without replacement.

Exactness: chi-squared against float64 probabilities of the filtered distribution computed
here from the definition (sorted logits, independent of tpsample's code), with negative
controls that the same test must reject; pathwise: tokens equal the full-row reference and
the torch path equals the interpreted kernels on the same records; certificates and the
fallback: counted rows of each; TP with gloo; bad parameters.
"""
import numpy as np
import pytest
import torch

import tpsample
from tpsample import filters as F
from tpsample import launchers, params as P
from tpsample.api import _pipeline
from tpsample.plan import DeviceKind, make_plan
from tpsample.reference import reference_sample, transformed_logits
from tpsample.torch_records import records_torch

from cases import lm_head_case, random_inputs
from dist_utils import run_world
from stats import ALPHA, chi2_pvalue


# ----- the definition, in numpy float64 (what the chi-squared tests compare against) -------
def filtered_probs(logits, top_k=0, top_p=1.0, min_p=0.0, *, renormalise_after_k=True,
                   min_p_first=False, ties_larger_id=False):
    """float64 probabilities [V] of one row's filtered distribution; the keyword switches
    build the negative controls (a filter in the wrong order, top-p on the unrenormalised
    distribution, ties at the boundary broken towards the larger id)."""
    l = np.asarray(logits, dtype=np.float64)
    V = l.size
    ids = np.arange(V)
    order = np.lexsort((-ids if ties_larger_id else ids, -l))  # logit desc, then id
    p = np.exp(l - l.max())
    p /= p.sum()
    keep = np.ones(V, bool)

    def apply_min_p(keep):
        pm = np.where(keep, p, 0.0)
        return keep & (pm >= min_p * pm.max())

    if min_p_first and min_p > 0:
        keep = apply_min_p(keep)
    if top_k > 0:
        kk = np.zeros(V, bool)
        kk[order[:top_k]] = True
        keep &= kk
    if top_p < 1:
        q = np.where(keep, p, 0.0)
        if renormalise_after_k:
            q = q / q.sum()
        qs = q[order]
        before = np.cumsum(qs) - qs
        kp = np.zeros(V, bool)
        kp[order[before < top_p]] = True
        keep &= kp
    if not min_p_first and min_p > 0:
        keep = apply_min_p(keep)
    out = np.where(keep, p, 0.0)
    return torch.from_numpy(out / out.sum())


def row_logits(h, w, temperature=1.0):
    return (h.double() @ w.double().T / temperature).numpy()


def counts(pipe):
    return pipe.candidate_rows, pipe.fallback_rows


def winner_cleared(h, w, seeds, filt, temperature=1.0) -> int:
    """float64: how many of the rows (one hidden state h [D], seeds [R]) a tokens-only call
    clears by the winner certificate (tpsample/filters.py, 2.) when the candidates do not
    certify their kept set: the rows whose unfiltered Gumbel-max winner (same noise) is kept
    and, unless the row has min-p alone, a known token (above tau, the largest 4th-best
    logit of a 128-token tile), with top-k or top-p off."""
    x = row_logits(h, w, temperature)
    k, p, m = filt.get("top_k", 0), filt.get("top_p", 1.0), filt.get("min_p", 0.0)
    if k <= 0 and p >= 1 and m <= 0:  # (no filter: nothing to certify)
        return 0
    tiles = np.pad(x, (0, -x.size % 128), constant_values=-np.inf).reshape(-1, 128)
    known = x > np.sort(tiles, axis=1)[:, -4].max()
    kept = filtered_probs(x, **filt).numpy() > 0
    if not (k <= 0 or p >= 1) or not (kept & ~known).any():
        return 0
    plain = reference_sample(h.expand(len(seeds), -1).contiguous(), w, seed=seeds,
                             temperature=temperature).tokens[:, 0]
    return int((kept & (known | (k <= 0 and p >= 1)))[plain.numpy()].sum())


# ----- exactness: chi-squared, torch path ---------------------------------------------------
CASES = [  # (kind, V, filters, temperature); the long ones run with -m slow
    pytest.param("zipf", 4096, dict(top_k=20), 1.0, marks=pytest.mark.slow),
    pytest.param("zipf", 4096, dict(top_p=0.6), 0.8, marks=pytest.mark.slow),
    pytest.param("zipf", 4096, dict(min_p=0.05), 1.0, marks=pytest.mark.slow),
    pytest.param("peaked", 4096, dict(top_k=20, top_p=0.9, min_p=0.05), 1.0,
                 marks=pytest.mark.slow),
    pytest.param("zipf", 4096, dict(top_k=20, top_p=0.7), 1.3, marks=pytest.mark.slow),
    ("flat", 600, dict(top_p=0.5), 1.0),  # flat: no certificate, every row takes the fallback
]


@pytest.mark.parametrize("kind,V,filt,temp", CASES,
                         ids=["zipf-k", "zipf-p", "zipf-minp", "peaked-kpm", "zipf-kp", "flat-p"])
def test_chi2_filtered_torch(kind, V, filt, temp):
    h, w = lm_head_case(kind, V, seed=3)
    rows = 4000
    pipe = _pipeline("torch", h.device)
    before = counts(pipe)
    tok = tpsample.sample(h.expand(rows, -1).contiguous(), w, temperature=temp,
                          seed=torch.arange(rows), backend="torch", **filt)
    p = filtered_probs(row_logits(h, w, temp), **filt)
    assert p[tok].min() > 0, "a token outside the kept set"
    assert chi2_pvalue(tok, p) > ALPHA
    cand, fb = (a - b for a, b in zip(counts(pipe), before))
    assert cand == rows
    if kind == "flat":
        # no row's kept set is certified: a tokens-only call clears the rows whose winner is
        # a known, kept token (the winner certificate), the others take the fallback; with
        # log-probs every row takes it (the forced fallback path), with the same tokens
        assert 0 < rows - fb == winner_cleared(h, w, torch.arange(rows), filt, temp)
        before = counts(pipe)
        out = tpsample.sample(h.expand(rows, -1).contiguous(), w, temperature=temp,
                              seed=torch.arange(rows), backend="torch", return_logprobs=True,
                              **filt)
        assert counts(pipe)[1] - before[1] == rows
        assert torch.equal(out.tokens, tok)
    else:
        assert fb == 0  # the certified path


NEGATIVE = [  # (kind, V, filters, wrong semantics)
    ("zipf", 4096, dict(top_k=20, top_p=0.5), dict(renormalise_after_k=False)),
    ("zipf", 4096, dict(top_p=0.5, min_p=0.1), dict(min_p_first=True)),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,V,filt,wrong", NEGATIVE, ids=["no-renormalise", "min-p-first"])
def test_chi2_rejects_wrong_semantics(kind, V, filt, wrong):
    """Negative controls: the same test rejects the samples against a near miss."""
    h, w = lm_head_case(kind, V, seed=3)
    rows = 4000
    tok = tpsample.sample(h.expand(rows, -1).contiguous(), w, seed=torch.arange(rows),
                          backend="torch", **filt)
    logits = row_logits(h, w)
    right, near = filtered_probs(logits, **filt), filtered_probs(logits, **filt, **wrong)
    assert not torch.allclose(right, near)
    assert chi2_pvalue(tok, right) > ALPHA
    assert (near[tok] == 0).any() or chi2_pvalue(tok, near.clamp(min=1e-12)) < ALPHA


def tie_case():
    """Logits with a 4-way exact tie straddling the top-k = 3 boundary (ids 5, 9, 40, 77)."""
    V, D = 256, 8
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, D, generator=g) * 0.1
    h = torch.zeros(D)
    h[0] = 1.0
    w[:, 0] = torch.linspace(-2, 0, V)
    w[[5, 9, 40, 77], :] = torch.tensor([1.5] + [0.0] * (D - 1))  # equal rows: equal logits
    w[120, 0] = 2.0  # the top token
    return h, w


def test_ties_at_the_top_k_boundary_go_to_the_smaller_id():
    h, w = tie_case()
    rows = 3000
    tok = tpsample.sample(h.expand(rows, -1).contiguous(), w, seed=torch.arange(rows), top_k=3,
                          backend="torch")
    assert set(tok.unique().tolist()) == {120, 5, 9}
    right = filtered_probs(row_logits(h, w), top_k=3)
    wrong = filtered_probs(row_logits(h, w), top_k=3, ties_larger_id=True)
    assert chi2_pvalue(tok, right) > ALPHA
    assert (wrong[tok] == 0).any()  # the tie broken the other way is rejected


def test_without_replacement_ordered_pairs():
    """S = 2 distinct tokens: the pair (i, j) has probability q_i q_j / (1 - q_i) under the
    filtered distribution q (sequential sampling without replacement)."""
    h, w = lm_head_case("zipf", 400, seed=5)
    rows = 6000
    out = tpsample.sample(h.expand(rows, -1).contiguous(), w, seed=torch.arange(rows), top_k=6,
                          num_samples=2, replacement=False, backend="torch")
    assert (out[:, 0] != out[:, 1]).all()
    q = filtered_probs(row_logits(h, w), top_k=6).numpy()
    kept = np.nonzero(q)[0]
    index = {t: i for i, t in enumerate(kept)}
    pair = torch.tensor([index[a] * len(kept) + index[b] for a, b in out.tolist()])
    probs = np.zeros(len(kept) ** 2)
    for a in range(len(kept)):
        for b in range(len(kept)):
            if a != b:
                qa, qb = q[kept[a]], q[kept[b]]
                probs[a * len(kept) + b] = qa * qb / (1 - qa)
    assert chi2_pvalue(pair, torch.from_numpy(probs)) > ALPHA
    indep = np.outer(q[kept], q[kept]).reshape(-1)  # with replacement: a wrong model
    assert chi2_pvalue(pair, torch.from_numpy(indep / indep.sum())) < ALPHA


# ----- pathwise: the reference, the torch path, the interpreted kernels ---------------------
MIXED = dict(top_k=torch.tensor([0, 5, 0, 50, 3, 0, 7, -1]),
             top_p=torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 0.5, 0.95, 1.0]),
             min_p=torch.tensor([0.0, 0.0, 0.0, 0.05, 0.2, 0.1, 0.0, 0.0]),
             temperature=torch.tensor([1.0, 0.7, 1.0, 1.3, 0.0, 1.0, 0.9, 1.1]))


def mixed_inputs(device="cpu"):
    g = torch.Generator().manual_seed(11)
    h = torch.randn(8, 16, generator=g) * 2.5
    w = torch.randn(4096, 16, generator=g)
    return h.to(device), w.to(device)


# "distinct" and "raw" run with -m slow (the README command keeps "replacement")
CALL_KINDS = pytest.mark.parametrize("extra", [
    dict(), pytest.param(dict(num_samples=3, replacement=False), marks=pytest.mark.slow),
    pytest.param(dict(num_samples=2, logprobs_mode="raw"), marks=pytest.mark.slow)],
    ids=["replacement", "distinct", "raw"])


def assert_matches_reference(out, ref):
    """Tokens and top tokens equal, log-probs, log Z and top log-probs within 1e-4 (fp32)."""
    tokens = out.tokens if out.tokens.ndim == 2 else out.tokens[:, None]
    lp = out.logprobs if out.logprobs.ndim == 2 else out.logprobs[:, None]
    assert torch.equal(tokens, ref.tokens)
    assert torch.allclose(lp.double(), ref.logprobs, atol=1e-4)
    assert torch.allclose(out.logz.double(), ref.logz, atol=1e-4)
    if out.top_tokens is None:  # (a call without top log-probs)
        assert ref.top_tokens is None or ref.top_tokens.numel() == 0
        return
    assert torch.equal(out.top_tokens, ref.top_tokens)
    fin = torch.isfinite(ref.top_logprobs)
    assert torch.equal(fin, torch.isfinite(out.top_logprobs))
    assert torch.allclose(out.top_logprobs.double()[fin], ref.top_logprobs[fin], atol=1e-4)


@CALL_KINDS
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_matches_reference_pathwise(backend, extra):
    h, w = mixed_inputs()
    kw = dict(MIXED, seed=torch.arange(8) * 7, top_logprobs=4, **extra)
    out = tpsample.sample(h, w, backend=backend, return_logprobs=True, **kw)
    ref = reference_sample(h, w, **kw)
    assert_matches_reference(out, ref)


@pytest.mark.slow
@CALL_KINDS
def test_device_fallback_matches_reference(extra, monkeypatch):
    """Near-flat rows on the Triton path: their kept sets reach below the candidates, so
    they take the fallback on the device (kernels/filter_fallback.py, no host sync); tokens,
    log-probs and top log-probs equal the float64 reference's. Its logits kernel runs with
    fewer programs than tiles, as on a GPU."""
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 3)
    h, w = mixed_inputs()
    h *= 0.05
    kw = dict(MIXED, seed=torch.arange(8) * 7, top_logprobs=4, **extra)
    pipe = _pipeline("triton", h.device)
    before = counts(pipe)
    out = tpsample.sample(h, w, backend="triton", return_logprobs=True, **kw)
    assert counts(pipe)[1] - before[1] >= 3  # rows 2, 3 and 5: top-p reaching below tau
    ref = reference_sample(h, w, **kw)
    assert_matches_reference(out, ref)


@pytest.mark.parametrize("sorts,cap", [(None, None),
                                       pytest.param((32, 64), None, marks=pytest.mark.slow),
                                       pytest.param((16, 32), None, marks=pytest.mark.slow),
                                       (None, 32)],
                         ids=["default", "sorts-32-64", "sorts-16-32", "capped"])
def test_filtered_kernel_equals_torch_on_the_same_records(monkeypatch, sorts, cap):
    """kernels/filter_records.py and filters.reduce_candidates on identical records:
    the same tokens, top tokens and fallback flags (certified and uncertified rows).
    The rows' known prefixes hold 21-49 tokens: with sorts of 32 and 64 slots the first two
    of the kernel's three sort sizes serve rows, with 16 and 32 the last two (128 slots);
    capped at 32 tokens (KNOWN_CAP), the rows above it take the kernel's k-th-key cut, which
    the torch path takes by position."""
    if sorts is not None:
        monkeypatch.setattr(launchers, "FILTER_SORTS", sorts)
    if cap is not None:
        monkeypatch.setattr(F, "KNOWN_CAP", cap)
    h, w = mixed_inputs()
    h[2] *= 0.05  # a near-flat row: its top-p 0.9 has no certificate
    row = P.row_params(h, MIXED["temperature"], torch.arange(8) * 3, 0)
    min_p = MIXED["min_p"].clone()
    for S, replacement, raw in ((1, True, False), (2, False, False), (2, True, True)):
        rec = records_torch(h, w, bias=None, inv_temp=row.inv_temp, seed=row.seed,
                            offset=row.offset, num_samples=S, n_real=4096, candidates=True,
                            replacement=replacement)[None]
        if cap is not None:
            # row 0 (40 known tokens, no filter): a min-p between tau's ratio and the capped
            # prefix's first unknown token's, so only the capped bound withholds the certificate
            x = F.candidate_planes(rec, S)[0][0]
            xs = x.flatten().sort(descending=True).values
            min_p[0] = torch.exp((xs[cap] + x[:, -1].max()) / 2 - xs[0])
        filt = P.filter_params(h, MIXED["top_k"], MIXED["top_p"], min_p, 5, S,
                               replacement, "raw" if raw else "processed", 4096)
        plan = make_plan(DeviceKind.of(h.device), B=8, D=16, V=4096, dtype=torch.float32,
                         num_samples=S, candidates=True, replacement=replacement, raw_mass=raw)
        tk = launchers.stage2_filtered(plan, rec.clone(), row, filt)
        tk = tk._replace(fallback=tk.fallback.bool())
        base = tpsample.pipeline.merge_records(rec[:, :S], row, "max")
        tt = F.reduce_candidates(rec, row, filt, S, base)
        assert torch.equal(tk.fallback, tt.fallback)
        assert tk.fallback[2] and (~tk.fallback).sum() >= (4 if cap else 6)
        assert tk.fallback[0] == (cap is not None)
        ok = ~tt.fallback
        assert torch.equal(tk.tokens[ok], tt.tokens[ok])
        assert torch.equal(tk.top_tokens[ok], tt.top_tokens[ok])
        assert torch.allclose(tk.logprobs[ok], tt.logprobs[ok], atol=1e-5, equal_nan=True)
        assert torch.allclose(tk.top_logprobs[ok], tt.top_logprobs[ok], atol=1e-5, equal_nan=True)


def test_filter_kernel_takes_the_pathwise_winner_with_ties():
    """With merge "max" the filter kernel is the whole stage 2: rows without filters take the
    sample planes' pathwise winner (reduce_records' rule: the largest score, ties to the
    smaller id). Sample planes with a tie across tiles, a tie of -0.0 and +0.0, -inf
    scores and two samples: the same tokens as the torch merge, and
    log-probs = the winner's logit - log Z. (Negative control: a larger-id tie-break fails.)"""
    h, w = mixed_inputs()
    B, S = 4, 2
    h = h[:B]
    row = P.row_params(h, 1.0, torch.arange(B) * 3, 0)
    rec = records_torch(h, w, bias=None, inv_temp=row.inv_temp, seed=row.seed,
                        offset=row.offset, num_samples=S, n_real=4096, candidates=True)[None]
    sc = rec[0, :S, :, :, 0]  # [S, B, T] scores of the sample planes
    top = sc.amax(-1, keepdim=True)
    sc[:, 0, 3] = sc[:, 0, 9] = top[:, 0, 0] + 1.0  # tile 3 holds the smaller ids
    sc[:, 1] = -1.0
    sc[:, 1, 5], sc[:, 1, 2] = 0.0, -0.0  # equal scores: tile 2's token
    sc[:, 2, ::2] = float("-inf")
    filt = P.filter_params(h, None, None, None, 2, S, True, "processed", 4096)
    plan = make_plan(DeviceKind.of(h.device), B=B, D=16, V=4096, dtype=torch.float32,
                     num_samples=S, candidates=True)
    out = launchers.stage2_filtered(plan, rec.clone(), row, filt)
    tokens, _, _ = tpsample.pipeline.merge_records(rec[:, :S], row, "max")
    assert torch.equal(out.tokens, tokens)
    assert out.tokens[0, 0] == rec[0, 0, 0, 3, 1] and out.tokens[1, 1] == rec[0, 1, 1, 2, 1]
    tile = out.tokens // 128
    logit = torch.stack([rec[0, s, torch.arange(B), tile[:, s], 2] for s in range(S)], 1)
    assert torch.equal(out.logprobs, logit - out.logz[:, None])


@pytest.mark.parametrize("filt,falls_back", [(dict(min_p=0.05), True), (dict(top_p=0.9), True),
                                             (dict(top_k=5), False), (dict(top_k=40), True),
                                             (dict(top_k=5, top_p=0.9), False)])
def test_certificates_on_a_flat_row(filt, falls_back):
    """A near-uniform row (16 tiles, 8 known tokens): min-p or top-p alone cannot be certified
    from the candidates (their kept sets reach below tau), top-k can when k <= 8; the
    fallback still gives exact samples (the chi-squared tests above) and the same tokens as
    the reference. The counts are those of calls with log-probs: a tokens-only call's winner
    certificate also clears min-p 0.05's rows, whose kept set is nearly the whole row (the
    same tokens, no fallback)."""
    h, w = lm_head_case("flat", 2048, seed=1)
    hh = h.expand(6, -1).contiguous()
    pipe = _pipeline("torch", h.device)
    want = reference_sample(hh, w, seed=torch.arange(6), **filt).tokens[:, 0]
    before = counts(pipe)
    out = tpsample.sample(hh, w, seed=torch.arange(6), backend="torch", return_logprobs=True,
                          **filt)
    assert counts(pipe)[1] - before[1] == (6 if falls_back else 0)
    assert torch.equal(out.tokens.view(-1), want)
    before = counts(pipe)
    assert torch.equal(tpsample.sample(hh, w, seed=torch.arange(6), backend="torch", **filt), want)
    if "min_p" in filt:
        assert counts(pipe)[1] == before[1]


def test_filters_that_keep_everything_change_nothing():
    """top_k = V, top_p = 1, min_p = 0 on every row: the unfiltered tokens (merge max)."""
    h, w = random_inputs(5, 16, 700, seed=2)
    plain = tpsample.sample(h, w, seed=4, backend="torch")
    assert torch.equal(plain, tpsample.sample(h, w, seed=4, top_k=700, backend="torch"))
    assert torch.equal(plain, tpsample.sample(h, w, seed=4, top_k=0, top_p=1.0, min_p=0.0,
                                              top_logprobs=2, backend="torch").tokens)


def test_greedy_rows_ignore_filters_and_top_logprobs_are_sorted():
    h, w = random_inputs(4, 16, 500, seed=8)
    out = tpsample.sample(h, w, temperature=0.0, top_k=1, top_p=0.1, min_p=0.5, top_logprobs=5,
                          backend="torch", return_logprobs=True)
    l = transformed_logits(h, w)
    assert torch.equal(out.tokens, l.argmax(-1))
    assert torch.equal(out.top_tokens[:, 0], out.tokens)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert torch.allclose(out.top_logprobs.double(), torch.log_softmax(l.double(), -1)
                          .gather(1, out.top_tokens), atol=1e-5)


def test_processed_and_raw_logprobs():
    h, w = random_inputs(3, 16, 500, seed=9)
    kw = dict(temperature=0.5, top_k=10, seed=1, top_logprobs=12, backend="torch")
    proc = tpsample.sample(h, w, return_logprobs=True, **kw)
    raw = tpsample.sample(h, w, return_logprobs=True, logprobs_mode="raw", **kw)
    assert torch.equal(proc.tokens, raw.tokens) and torch.equal(proc.top_tokens, raw.top_tokens)
    l1 = (h.double() @ w.double().T)
    assert torch.allclose(raw.top_logprobs.double(), torch.log_softmax(l1, -1)
                          .gather(1, raw.top_tokens), atol=1e-5)
    kept = torch.log_softmax(l1.gather(1, proc.top_tokens[:, :10]) / 0.5, -1)
    assert torch.allclose(proc.top_logprobs[:, :10].double(), kept, atol=1e-5)
    assert torch.isinf(proc.top_logprobs[:, 10:]).all()  # outside the top-10: -inf
    assert torch.allclose(proc.logprobs.exp().double(), kept.exp().gather(
        1, (proc.top_tokens[:, :10] == proc.tokens[:, None]).int().argmax(1, keepdim=True))[:, 0],
        atol=1e-5)


def test_without_replacement_distinct_and_short_rows():
    h, w = random_inputs(3, 16, 300, seed=4)
    out = tpsample.sample(h, w, seed=2, num_samples=5, replacement=False, backend="torch",
                          return_logprobs=True)
    assert all(len(set(r)) == 5 for r in out.tokens.tolist())
    short = tpsample.sample(h, w, seed=2, num_samples=5, replacement=False, top_k=3,
                            backend="torch", return_logprobs=True)
    assert (short.tokens[:, 3:] == -1).all() and torch.isinf(short.logprobs[:, 3:]).all()
    assert (short.tokens[:, :3] >= 0).all()


# ----- tensor parallel (gloo): the same tokens as one device --------------------------------
def tp_filtered(rank, world, merge):
    h, w = mixed_inputs()
    V = w.shape[0]
    lo, hi = rank * V // world + 3 * (rank > 0), (rank + 1) * V // world + 3 * (rank + 1 < world)
    sampler = tpsample.VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=V - 5, merge=merge,
                                            backend="torch")
    h = h.clone()
    h[2] *= 0.05  # one row through the fallback (its logit shards are gathered)
    return sampler(h, seed=torch.arange(8) * 5, num_samples=2, return_logprobs=True,
                   top_logprobs=3, **MIXED)


@pytest.mark.parametrize("world,merge", [(2, "max"), pytest.param(3, "cdf", marks=pytest.mark.slow)])
def test_tp_filtered_equals_single_device(world, merge):
    outs = run_world(world, tp_filtered, merge)
    for o in outs:
        assert not isinstance(o, dict), o
        assert torch.equal(o.tokens, outs[0].tokens) and torch.equal(o.top_tokens, outs[0].top_tokens)
    h, w = mixed_inputs()
    h[2] *= 0.05
    single = tpsample.sample(h, w, vocab_size=w.shape[0] - 5, seed=torch.arange(8) * 5,
                             num_samples=2, return_logprobs=True, top_logprobs=3,
                             backend="torch", **MIXED)
    filtered = ((MIXED["top_k"] > 0) | (MIXED["top_p"] < 1) | (MIXED["min_p"] > 0)) \
        & (MIXED["temperature"] > 0)
    rows = filtered if merge != "max" else torch.ones(8, dtype=torch.bool)
    assert torch.equal(outs[0].tokens[rows], single.tokens[rows])
    assert torch.equal(outs[0].top_tokens, single.top_tokens)
    assert torch.allclose(outs[0].logprobs[rows], single.logprobs[rows], atol=1e-5)


# ----- bad parameters ------------------------------------------------------------------------
BAD = [
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(top_k=torch.tensor([1, 2, -3, 0])), ValueError, "top_k"),
    (dict(top_k=torch.ones(4)), TypeError, "top_k"),
    (dict(top_k=torch.ones(3, dtype=torch.int64)), ValueError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=float("nan")), ValueError, "top_p"),
    (dict(top_p=torch.tensor([0.5, 0.0, 1.0, 1.0])), ValueError, "top_p"),
    (dict(top_p=torch.tensor([0.5, float("nan"), 1.0, 1.0])), ValueError, "top_p"),
    (dict(min_p=1.0), ValueError, "min_p"),
    (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(min_p=float("nan")), ValueError, "min_p"),
    (dict(min_p=torch.ones(2, 2)), ValueError, "min_p"),
    (dict(top_logprobs=-1), ValueError, "top_logprobs"),
    (dict(top_logprobs=65), ValueError, "top_logprobs"),
    (dict(replacement=0), TypeError, "replacement"),
    (dict(num_samples=301, replacement=False), ValueError, "num_samples"),
    (dict(num_samples=2, replacement=False, merge="cdf"), ValueError, "replacement"),
    (dict(logprobs_mode="log"), ValueError, "logprobs_mode"),
]


@pytest.mark.parametrize("kw,exc,name", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_filter_parameters_name_the_argument(kw, exc, name):
    h, w = random_inputs(4, 8, 300)
    with pytest.raises(exc, match=name):
        tpsample.sample(h, w, backend="torch", **kw)


def test_scalar_filters_checked_once_still_reject_bad_values():
    """Scalar filters are normalised once per combination and then looked up: a repeat gives
    the same normalised tensors, and values equal to a cached one but of another type (True
    for 1, 50.0 for 50), unhashable or invalid still raise, naming the argument."""
    h, _ = random_inputs(4, 8, 300)
    args = (0, 1, True, "processed", 300)
    first = P.filter_params(h, 50, 0.9, 0.05, *args)
    again = P.filter_params(h, 50, 0.9, 0.05, *args)
    assert all(a is b for a, b in zip(first[:3], again[:3]))
    assert first.top_k.tolist() == [50] * 4 and torch.allclose(first.top_p, torch.full((4,), 0.9))
    assert P.filter_params(h, 1, None, None, *args).top_k.tolist() == [1] * 4
    P.filter_params(h, 1, 0.9, 0.05, *args)  # (equal to top_k=True's arguments but for types)
    assert P.filter_params(h[:2], 50, 0.9, 0.05, *args).top_k.shape == (2,)
    for kw, exc in ((dict(top_k=True), TypeError), (dict(top_k=50.0), TypeError),
                    (dict(top_k=[50]), TypeError), (dict(top_p=float("nan")), ValueError),
                    (dict(min_p=1.0), ValueError)):
        for _ in range(2):
            with pytest.raises(exc, match=next(iter(kw))):
                P.filter_params(h, **{**dict(top_k=50, top_p=0.9, min_p=0.05), **kw}, top_logprobs=0,
                                num_samples=1, replacement=True, logprobs_mode="processed",
                                vocab_size=300)
    with pytest.raises(TypeError, match="replacement"):
        P.filter_params(h, 50, 0.9, 0.05, 0, 1, 1, "processed", 300)


# ----- the interpreted kernels: exactness (long) -------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("filt", [dict(top_k=6, top_p=0.8), dict(min_p=0.2, top_p=0.9)],
                         ids=["k-p", "min-p-p"])
def test_chi2_filtered_interpreted_kernels(filt):
    """The certified path of the interpreted kernels (no row falls back)."""
    h, w = lm_head_case("peaked", 1024, seed=4)
    rows = 600
    pipe = _pipeline("triton", h.device)
    before = counts(pipe)
    tok = tpsample.sample(h.expand(rows, -1).contiguous(), w, seed=torch.arange(rows),
                          backend="triton", **filt)
    assert counts(pipe)[1] == before[1]
    p = filtered_probs(row_logits(h, w), **filt)
    assert p[tok].min() > 0, "a token outside the kept set"
    assert chi2_pvalue(tok, p) > ALPHA


def test_fallback_logits_kernel_recomputes_exactly_the_flagged_rows():
    """kernels/filter_fallback.py's logits kernel without the side output: the flagged rows
    of a batch larger than its row block (bias, a grammar mask, per-row temperatures with a
    greedy row, padded vocabulary, float32 and bfloat16), recomputed by tl.dot, equal the
    float64 transformed logits within fp32 sums; rows not flagged are not written."""
    from tpsample.kernels import filter_fallback
    g = torch.Generator().manual_seed(4)
    B, D, V, n_real, tile = 37, 48, 700, 650, 128
    n_tiles = -(-V // tile)
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(B, D, generator=g).to(dtype)
        w = torch.randn(V, D, generator=g).to(dtype)
        bias = torch.randn(V, generator=g)
        inv = 1 / (torch.rand(B, generator=g) + 0.5)
        inv[5] = 0.0  # greedy: its logits at T = 1
        mask = torch.randint(-2**31, 2**31 - 1, (B, (n_real + 31) // 32), generator=g,
                             dtype=torch.int64).to(torch.int32)
        flags = (torch.rand(B, generator=g) < 0.4).to(torch.int32)
        flags[[0, 5, 36]] = 1
        out = torch.full((B, n_tiles * tile), 7.0)
        filter_fallback.fallback_logits_kernel[(3,)](
            h, w, bias, inv, flags, out, B, V, n_real, D, h.stride(0), w.stride(0),
            out.stride(0), mask, mask.stride(0), 0, flags, 1, flags, n_tiles, out, 0,
            HAS_BIAS=True, BLOCK_V=tile, BLOCK_D=32, BLOCK_F=64, HAS_MASK=True,
            F32_DOT=dtype == torch.float32 or not h.is_cuda)
        want = (h.double() @ w.double().T + bias.double()) * torch.where(inv == 0, 1.0,
                                                                           inv).double()[:, None]
        ids = torch.arange(V)
        allowed = (mask[:, ids.clamp(max=n_real - 1) // 32] >> (ids % 32)) & 1
        want = torch.where((allowed != 0) & (ids < n_real), want, float("-inf"))
        f = flags.bool()
        got = out[:, :V].double()
        assert torch.equal(torch.isinf(got[f]), torch.isinf(want[f]))
        fin = torch.isfinite(want[f])
        torch.testing.assert_close(got[f][fin], want[f][fin], rtol=1e-5, atol=1e-4)
        assert (out[~f] == 7.0).all() and (out[f][:, V:] == float("-inf")).all()


@pytest.mark.slow
@pytest.mark.parametrize("side", [True, False], ids=["side-output", "recomputed"])
def test_chi2_device_fallback_interpreted(side, monkeypatch):
    """Every row through the device fallback but those the winner certificate clears (a flat
    row, top-p 0.5 and min-p), its logits from stage 1's side output or recomputed from W
    (FallbackChoice.side_output): chi-squared against the float64 filtered distribution;
    the same samples must fail against a wrong kept set (top-p 0.65), the negative control."""
    from tpsample.fallback_choice import FallbackChoice
    monkeypatch.setattr(FallbackChoice, "side_output", lambda self, h, c: side)
    h, w = lm_head_case("flat", 64, seed=5)
    rows = 600
    filt = dict(top_p=0.5, min_p=0.3)
    pipe = _pipeline("triton", h.device)
    before = counts(pipe)
    tok = tpsample.sample(h.expand(rows, -1).contiguous(), w, seed=torch.arange(rows),
                          backend="triton", **filt)
    cleared = winner_cleared(h, w, torch.arange(rows), filt)  # (tokens only)
    assert 0 < cleared < rows // 2 and counts(pipe)[1] - before[1] == rows - cleared
    p = filtered_probs(row_logits(h, w), **filt)
    assert p[tok].min() > 0, "a token outside the kept set"
    assert chi2_pvalue(tok, p) > ALPHA
    wrong = filtered_probs(row_logits(h, w), top_p=0.65, min_p=0.3)
    assert chi2_pvalue(tok, wrong) < ALPHA
