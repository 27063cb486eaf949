"""Speculative-draft verification (tpsample/verify.py): exact, one device and TP.

Pathwise: one-hot drafts are the sampler's tokens at (seed, offset + i) and a scan (tested
against tpsample.sample itself, ragged drafts and greedy requests included); the torch path
and the interpreted kernels agree; two gloo ranks equal one device. Statistical (chi-squared
at ALPHA against float64, torch path): the first emitted token is distributed as p_0 and,
given x_0 accepted, the next as p_1, with and without filters, for one-hot and full draft
distributions; the acceptance rate is p_0(x_0) (one-hot) or sum(min(p_0, q_0)) within its
binomial interval; negative controls the same tests reject (a rejection that resamples from
p_0 with x_0 left in; a residual p instead of max(0, p - q)).
"""
import math

import numpy as np
import pytest
import torch

import tpsample
from tpsample import verify as VF

from dist_utils import run_world
from stats import ALPHA, chi2_pvalue
from test_filters import filtered_probs, row_logits


def head(V=64, D=16, S=2, seed=3):
    """hidden [1, S + 1, D] (a different distribution at each position) and W [V, D]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, S + 1, D, generator=g) * 0.6, torch.randn(V, D, generator=g)


def test_one_hot_drafts_are_the_samplers_tokens_and_a_scan():
    """Request b's drafts are the sampler's own tokens at (seed_b, offset_b + i) for its
    first k_b positions, then another id: k_b are accepted and the emitted token is the
    sampler's at position k_b; -1 drafts end a request early (the bonus at its last
    position); greedy requests accept while the draft is the argmax."""
    B, S, V = 6, 3, 50
    g = torch.Generator().manual_seed(1)
    h = torch.randn(B, S + 1, 8, generator=g)
    w = torch.randn(V, 8, generator=g)
    seed = torch.arange(B) * 11 + 2
    offset = torch.tensor([0, 5, 9, 1, 0, 3])
    T = torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 0.0])
    y = tpsample.sample(h.reshape(-1, 8), w, seed=seed.repeat_interleave(S + 1),
                        offset=offset.repeat_interleave(S + 1) + torch.arange(S + 1).repeat(B),
                        temperature=T.repeat_interleave(S + 1), backend="torch").view(B, S + 1)
    k = torch.tensor([0, 1, 3, 2, 1, 3])
    draft = torch.where(torch.arange(S)[None, :] < k[:, None], y[:, :S], (y[:, :S] + 1) % V)
    draft[4, 1:] = -1  # request 4: one draft, accepted; its bonus is position 1
    out = tpsample.verify_drafts(h, w, draft, seed=seed, offset=offset, temperature=T,
                                 backend="torch", return_logprobs=True)
    assert out.num_accepted.tolist() == k.tolist()
    for b in range(B):
        n = int(k[b])
        assert out.tokens[b, :n + 1].tolist() == y[b, :n + 1].tolist(), b
        assert (out.tokens[b, n + 1:] == -1).all() and torch.isnan(out.logprobs[b, n + 1:]).all()
        assert torch.isfinite(out.logprobs[b, :n + 1]).all()
    again = tpsample.verify_drafts(h, w, draft, seed=seed, offset=offset, temperature=T,
                                   backend="torch")
    assert torch.equal(again.tokens, out.tokens) and again.logprobs is None


@pytest.mark.parametrize("probs", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["one-hot", "draft-probs"])
def test_interpreted_kernels_equal_the_torch_path(probs):
    """The Triton backend (interpreted on the CPU) gives the torch path's tokens, with
    filters."""
    B, S, V = 3, 2, 300
    g = torch.Generator().manual_seed(4)
    h = torch.randn(B, S + 1, 16, generator=g) * 0.3
    w = torch.randn(V, 16, generator=g)
    draft = torch.randint(0, V, (B, S), generator=g)
    q = torch.softmax(torch.randn(B, S, V, generator=g), -1) if probs else None
    kw = dict(draft_probs=q, seed=torch.tensor([3, 4, 5]), top_p=torch.tensor([0.9, 1.0, 0.5]),
              return_logprobs=True)
    a = tpsample.verify_drafts(h, w, draft, backend="torch", **kw)
    b = tpsample.verify_drafts(h, w, draft, backend="triton", **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    fin = torch.isfinite(a.logprobs)
    assert torch.equal(fin, torch.isfinite(b.logprobs))
    assert torch.allclose(a.logprobs[fin], b.logprobs[fin], atol=1e-4)


@pytest.mark.parametrize("filt", [pytest.param(dict(), marks=pytest.mark.slow),
                                  pytest.param(dict(min_p=0.05), marks=pytest.mark.slow),
                                  pytest.param(dict(top_k=7), marks=pytest.mark.slow),
                                  dict(top_p=torch.tensor([0.9, 1.0, 0.6, 0.8, 0.95, 0.7]),
                                       min_p=0.02)],
                         ids=["plain", "min_p", "top_k", "top_p+min_p"])
def test_draft_probs_kernels_equal_the_torch_path(filt, monkeypatch):
    """The draft-probs path's kernels (kernels/draft_scan.py's probs_* launches, interpreted)
    give the torch path's tokens, counts and log-probs:
    a draft distribution near p (long acceptances) on some requests and far from it on
    others, greedy rows, ragged drafts and a request without drafts, a row of NaN logits,
    and columns laid out as two padded vocabulary shards (padding ids repeat real ones),
    each row in one chunk and in five."""
    B, S, V, D = 6, 3, 300, 16
    g = torch.Generator().manual_seed(11)
    h = torch.randn(B, S + 1, D, generator=g) * 1.2  # (argmaxes of p ~0.2-0.9)
    w = torch.randn(V, D, generator=g)
    h[4, 2] = float("nan")
    T = torch.tensor([1.0, 0.0, 0.8, 1.3, 1.0, 0.0])
    exact = torch.softmax((h[:, :S] @ w.T) / T.clamp(min=0.5)[:, None, None], -1).nan_to_num(1 / V)
    noisy = torch.softmax(torch.randn(B, S, V, generator=g), -1)
    near = torch.tensor([True, True, False, True, True, False])
    top = torch.nn.functional.one_hot(exact.argmax(-1), V)  # (residuals far from p)
    q = torch.where(near[:, None, None], 0.5 * top + 0.5 * exact, noisy)
    draft = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, S)
    draft[1] = (h[1, :S] @ w.T).argmax(-1)  # greedy row: the drafts are the argmaxes
    draft[2, 1:] = -1
    draft[5, :] = -1
    half = (V + 1) // 2 + 2  # two shards, padded to a common width
    shards = [VF.local_logits(w[:(V + 1) // 2], None, (V + 1) // 2, 0, half),
              VF.local_logits(w[(V + 1) // 2:], None, V - (V + 1) // 2, (V + 1) // 2, half)]

    def padded(rows, inv):
        parts = [f(rows, inv) for f in shards]
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts])
    for logits, chunk in ((VF.local_logits(w, None, V), 4096), (padded, 64)):
        monkeypatch.setattr(VF, "PROBS_CHUNK", chunk)  # (64: each row over five programs)
        monkeypatch.setattr(VF, "PICK_CHUNK", chunk // 2)  # (32: the pick over ten)
        outs = [VF.verify(h, draft, q, sample_rows=None, draft_logits=logits, draw_seed=None,
                          vocab_size=V, temperature=T, seed=torch.arange(B) * 3 + 1, offset=5,
                          top_k=filt.get("top_k"), top_p=filt.get("top_p"),
                          min_p=filt.get("min_p"), return_logprobs=True, kernels=kernels)
                for kernels in (False, True)]
        a, b = outs
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
        assert torch.equal(a.logprobs.isnan(), b.logprobs.isnan())
        assert torch.allclose(a.logprobs.nan_to_num(), b.logprobs.nan_to_num(), atol=1e-5)
        assert int(a.num_accepted.max()) >= 2 and (a.tokens[4] == -1).any()


@pytest.mark.parametrize("S", [0, 1, 3, 4])
def test_draft_scan_kernels_equal_the_torch_functions(S):
    """kernels/draft_scan.py (interpreted) against verify.draft_rows / scan's torch path:
    the drafts per request, each position's (seed, offset), the scan's tokens, counts and
    log-probs, with ragged drafts, int32 drafts, y equal to the draft on some prefixes."""
    B, V = 7, 40
    g = torch.Generator().manual_seed(S)
    h = torch.zeros(B, S + 1, 4)
    draft = torch.randint(0, V, (B, S), generator=g)
    cut = torch.randint(0, S + 1, (B,), generator=g)
    draft = torch.where(torch.arange(S)[None, :] < cut[:, None], draft, -1)
    y = torch.randint(0, V, (B, S + 1), generator=g)
    keep = torch.randint(0, S + 1, (B,), generator=g)  # y equals the draft on a prefix
    y[:, :S] = torch.where(torch.arange(S)[None, :] < keep[:, None], draft.clamp(min=0), y[:, :S])
    y[0, int(cut[0]):] = -1  # degenerate sampler rows: never accepted as drafts
    y[1, :] = -1
    lp = -torch.rand(B, S + 1, generator=g)
    for seed, offset in [(torch.arange(B) * 5 + 1, torch.arange(B) + 100), (9, 4)]:
        one = VF.draft_rows(h, draft, None, V, seed, offset, None, kernels=False)
        two = VF.draft_rows(h, draft.int(), None, V, seed, offset, None, kernels=True)
        for a, b in zip(one, two):
            assert torch.equal(a, b)
        n = one[0]
        assert n.tolist() == cut.tolist()
        for with_lp in (lp, None):
            ref = VF.scan(y, with_lp, draft, n)
            out = VF.accept_scan(y, with_lp, draft, n)
            assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
            if with_lp is None:
                assert out[2] is None
            else:
                assert torch.equal(out[2].isnan(), ref[2].isnan())
                assert torch.equal(out[2].nan_to_num(), ref[2].nan_to_num())


@pytest.mark.parametrize("draft,match", [([[1, 50], [0, 0]], "ids in \\[0, 50\\)"),
                                         ([[-1, 3], [0, 0]], "a -1 ends")])
def test_bad_drafts_raise_on_the_kernel_path(draft, match):
    h, w = torch.randn(2, 3, 8), torch.randn(50, 8)
    with pytest.raises(ValueError, match=match):
        tpsample.verify_drafts(h, w, torch.tensor(draft), seed=1, backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("probs", [False, True], ids=["one-hot", "draft-probs"])
def test_rows_without_an_answer_give_minus_one(backend, probs):
    """A request whose hidden states are NaN (greedy or sampled) accepts nothing and emits
    -1, never a valid id, whatever its drafts (0 included); the other requests are
    unaffected; B = 0 gives empty outputs."""
    B, S, V = 3, 2, 50
    g = torch.Generator().manual_seed(2)
    h = torch.randn(B, S + 1, 8, generator=g)
    w = torch.randn(V, 8, generator=g)
    h[0] = float("nan")
    h[1, 1] = float("nan")
    draft = torch.zeros(B, S, dtype=torch.int64)
    q = torch.full((B, S, V), 1.0 / V) if probs else None
    for T in (0.0, 1.0):
        out = tpsample.verify_drafts(h, w, draft, draft_probs=q, seed=1, temperature=T,
                                     backend=backend, return_logprobs=True)
        assert out.tokens[0].tolist() == [-1] * (S + 1) and int(out.num_accepted[0]) == 0
        assert out.tokens[1, 1:].tolist() == [-1, -1] and int(out.num_accepted[1]) <= 1
        assert torch.isnan(out.logprobs[0]).all()
        assert (out.tokens[2, :int(out.num_accepted[2]) + 1] >= 0).all()
    empty = tpsample.verify_drafts(h[:0], w, draft[:0], draft_probs=None if q is None else q[:0],
                                   seed=1, backend=backend)
    assert empty.tokens.shape == (0, S + 1) and empty.num_accepted.shape == (0,)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_seed_and_offset_in_any_layout(backend):
    """Per-request seeds and offsets as strided views, int32 offsets and numpy integers give
    the tokens of contiguous int64 tensors."""
    B, S, V = 4, 2, 60
    g = torch.Generator().manual_seed(6)
    h = torch.randn(B, S + 1, 8, generator=g)
    w = torch.randn(V, 8, generator=g)
    draft = torch.randint(0, V, (B, S), generator=g)
    seeds = torch.arange(2 * B).view(B, 2) * 100 + 7
    ref = tpsample.verify_drafts(h, w, draft, seed=seeds[:, 0].contiguous(),
                                 offset=torch.full((B,), 3), backend=backend)
    for seed, offset in [(seeds[:, 0], torch.tensor(3).expand(B)),
                         (seeds[:, 0], torch.full((B,), 3, dtype=torch.int32))]:
        out = tpsample.verify_drafts(h, w, draft, seed=seed, offset=offset, backend=backend)
        assert torch.equal(out.tokens, ref.tokens)
    a = tpsample.verify_drafts(h, w, draft, seed=np.int64(9), offset=np.int32(2), backend=backend)
    b = tpsample.verify_drafts(h, w, draft, seed=9, offset=2, backend=backend)
    assert torch.equal(a.tokens, b.tokens)


# ----- chi-squared ---------------------------------------------------------------------------
N = 20000
FILTERS = [dict(), dict(top_k=12, top_p=0.8)]


def target_probs(h, w, filt, i):
    return filtered_probs(row_logits(h[0, i:i + 1], w)[0], **filt)


def binomial_ok(successes: int, n: int, p: float) -> bool:
    return abs(successes - n * p) <= 4.5 * math.sqrt(n * p * (1 - p))  # two-sided ~7e-6


@pytest.mark.slow
@pytest.mark.parametrize("filt", FILTERS, ids=["plain", "top_k+top_p"])
def test_chi2_one_hot(filt):
    """x_0 fixed (the 3rd most probable token of p_0): tokens[:, 0] ~ p_0, the acceptance
    rate is p_0(x_0), and tokens[:, 1] given acceptance ~ p_1. Negative control: a
    rejection that draws again from p_0 (x_0 not excluded) fails the first test."""
    h, w = head(S=1)
    p0, p1 = target_probs(h, w, filt, 0), target_probs(h, w, filt, 1)
    x0 = int(torch.argsort(torch.as_tensor(p0), descending=True)[2])
    out = tpsample.verify_drafts(h.expand(N, -1, -1).contiguous(), w,
                                 torch.full((N, 1), x0), seed=torch.arange(N) * 7 + 1,
                                 backend="torch", **filt)
    first = out.tokens[:, 0]
    assert chi2_pvalue(first, p0) > ALPHA
    acc = out.num_accepted == 1
    assert binomial_ok(int(acc.sum()), N, float(p0[x0]))
    assert chi2_pvalue(out.tokens[acc, 1], p1) > ALPHA
    again = tpsample.sample(h[0, :1].expand(N, -1).contiguous(), w, seed=torch.arange(N) + 10 ** 6,
                            backend="torch", **filt)
    wrong = torch.where(acc, first, again)
    assert chi2_pvalue(wrong, p0) < ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("filt", FILTERS, ids=["plain", "top_k+top_p"])
def test_chi2_draft_probs(filt, monkeypatch):
    """x_0 ~ q_0 (a draft distribution unlike p_0): tokens[:, 0] ~ p_0, the acceptance rate
    is sum(min(p_0, q_0)), tokens[:, 1] given acceptance ~ p_1. Negative control: the
    residual p_0 instead of max(0, p_0 - q_0) fails the first test."""
    h, w = head(S=1)
    V = w.shape[0]
    p0, p1 = target_probs(h, w, filt, 0), target_probs(h, w, filt, 1)
    g = torch.Generator().manual_seed(9)
    q0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    x0 = torch.multinomial(q0, N, replacement=True, generator=g)[:, None]
    kw = dict(draft_probs=q0.expand(N, 1, V).contiguous(), seed=torch.arange(N) * 5 + 3,
              backend="torch", **filt)
    hh = h.expand(N, -1, -1).contiguous()
    out = tpsample.verify_drafts(hh, w, x0, **kw)
    assert chi2_pvalue(out.tokens[:, 0], p0) > ALPHA
    acc = out.num_accepted == 1
    overlap = float(np.minimum(np.asarray(p0), q0.double().numpy()).sum())
    assert binomial_ok(int(acc.sum()), N, overlap)
    assert chi2_pvalue(out.tokens[acc, 1], p1) > ALPHA
    monkeypatch.setattr(VF, "residual_weights", lambda p, q: p)
    wrong = tpsample.verify_drafts(hh, w, x0, **kw)
    assert chi2_pvalue(wrong.tokens[:, 0], p0) < ALPHA


# ----- tensor parallel -----------------------------------------------------------------------
def _tp_verify(rank, world, probs, backend="torch", filt=None):
    from tpsample import verify as VF
    VF.PROBS_CHUNK = 128  # (several chunks per rank: 250 and 350 columns, padded to 350)
    VF.PICK_CHUNK = 64
    B, S, V = 4, 3, 600
    g = torch.Generator().manual_seed(6)
    h = torch.randn(B, S + 1, 16, generator=g) * 0.3
    w = torch.randn(V, 16, generator=g)
    draft = torch.randint(0, V, (B, S), generator=g)
    draft[1, 2:] = -1
    q = torch.softmax(torch.randn(B, S, V, generator=g), -1) if probs else None
    lo, hi = (0, 250) if rank == 0 else (250, V)
    s = tpsample.VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=V, vocab_start=lo,
                                      backend=backend)
    sent = []
    gather = s.transport.all_gather
    s.transport.all_gather = lambda t: (sent.append(t.numel() * t.element_size()), gather(t))[1]
    kw = dict(draft_probs=q, seed=torch.tensor([1, 2, 3, 4]), return_logprobs=True,
              **(filt or dict(min_p=0.05)))
    return (s.verify_drafts(h, draft, **kw),
            tpsample.verify_drafts(h, w, draft, backend=backend, **kw), sent)


@pytest.mark.parametrize("probs,backend,filt", [
    (False, "torch", None), pytest.param(True, "torch", None, marks=pytest.mark.slow),
    pytest.param(True, "triton", None, marks=pytest.mark.slow),
    pytest.param(True, "triton", dict(top_p=0.9, min_p=0.02), marks=pytest.mark.slow),
    pytest.param(True, "triton", dict(temperature=0.8), marks=pytest.mark.slow)],
    ids=["one-hot", "draft-probs", "draft-probs-kernels", "draft-probs-kernels-top-p",
         "draft-probs-kernels-unfiltered"])
def test_tp_gloo_equals_one_device(probs, backend, filt):
    """Two gloo ranks (uneven shards): the same tokens and acceptances on both ranks as one
    device, log-probs within 1e-5. The draft-probs kernels exchange their per-chunk partials
    (two or, with min-p, three all-gathers of a few hundred bytes a rank), or with top-p the
    rows' logits (their cut sorts whole rows: 16 rows x 350 columns x 4 bytes); the torch
    path, the logits."""
    outs = run_world(2, _tp_verify, probs, backend, filt)
    for o in outs:
        assert not isinstance(o, dict), o
        tp, one, sent = o
        assert torch.equal(tp.tokens, one.tokens) and torch.equal(tp.num_accepted, one.num_accepted)
        assert torch.allclose(tp.logprobs, one.logprobs, atol=1e-5, equal_nan=True)
        if probs:
            logits = 16 * 350 * 4 in sent
            assert logits == (backend == "torch" or (filt or {}).get("top_p") is not None), sent
            if not logits:  # (the rows' partials, the mass with min-p, the picks)
                assert len(sent) == (2 if filt else 3) and max(sent) < 2000, sent


# ----- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("change,err,match", [
    (dict(hidden=torch.randn(2, 8)), ValueError, "hidden must be a Tensor \\[B, S \\+ 1, D\\]"),
    (dict(draft_tokens=torch.zeros(2, 3, dtype=torch.int64)), ValueError, "draft_tokens must be \\[B, S\\]"),
    (dict(draft_tokens=torch.zeros(2, 2)), TypeError, "draft_tokens must be an int64"),
    (dict(draft_tokens=torch.tensor([[1, 50], [0, 0]])), ValueError, "ids in \\[0, 50\\)"),
    (dict(draft_tokens=torch.tensor([[-1, 3], [0, 0]])), ValueError, "a -1 ends"),
    (dict(draft_probs=torch.full((2, 2, 50), 0.03)), ValueError, "sum to 1 within"),
    (dict(draft_probs=torch.full((2, 2, 50), 0.02).index_put_((torch.tensor([0]), torch.tensor([1]), torch.tensor([3])), torch.tensor(-0.01)).index_put_((torch.tensor([0]), torch.tensor([1]), torch.tensor([4])), torch.tensor(0.05))), ValueError, "must be >= 0"),
    (dict(draft_probs=torch.full((2, 2, 49), 1 / 49)), ValueError, "draft_probs must be \\[B, S, V\\]"),
    (dict(draft_probs=torch.full((2, 2, 50), 0.02, dtype=torch.float64)), TypeError, "draft_probs must be None or a float32"),
    (dict(top_p=torch.tensor([0.5, 0.5, 0.5])), ValueError, "top_p must be a scalar or a Tensor\\[B\\]"),
])
def test_bad_input_names_the_argument(change, err, match):
    kw = dict(hidden=torch.randn(2, 3, 8), weight=torch.randn(50, 8),
              draft_tokens=torch.tensor([[1, 2], [3, -1]]), backend="torch")
    kw.update(change)
    h, w, d = kw.pop("hidden"), kw.pop("weight"), kw.pop("draft_tokens")
    with pytest.raises(err, match=match):
        tpsample.verify_drafts(h, w, d, **kw)


@pytest.mark.parametrize("probs", [False, True], ids=["one-hot", "draft-probs"])
def test_logprobs_are_the_emitted_tokens_under_p(probs):
    """return_logprobs: every emitted token's log-prob is log p_i(token) at its position (the
    float64 filtered distribution, within 1e-4), NaN after the emitted ones."""
    B, S, V = 40, 2, 64
    h, w = head(V=V, S=S, seed=8)
    g = torch.Generator().manual_seed(3)
    filt = dict(top_k=20, top_p=0.9)
    p = [torch.as_tensor(target_probs(h, w, filt, i)) for i in range(S + 1)]
    q = torch.softmax(torch.randn(B, S, V, generator=g) * 2, -1) if probs else None
    src = q if probs else torch.stack(p[:S]).float().expand(B, S, V)  # drafts from q (or p)
    draft = torch.multinomial(src.reshape(B * S, V), 1, generator=g).view(B, S)
    out = tpsample.verify_drafts(h.expand(B, -1, -1).contiguous(), w, draft, draft_probs=q,
                                 seed=torch.arange(B), return_logprobs=True, backend="torch",
                                 **filt)
    assert out.num_accepted.max() > 0 and (out.num_accepted < S).any()
    for b in range(B):
        n = int(out.num_accepted[b])
        for i in range(n + 1):
            want = math.log(float(p[i][out.tokens[b, i]]))
            assert abs(float(out.logprobs[b, i]) - want) < 1e-4, (b, i)
        assert torch.isnan(out.logprobs[b, n + 1:]).all()
