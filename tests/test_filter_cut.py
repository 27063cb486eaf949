"""The exact fallback's fast path (kernels/filter_cut.py): flagged rows with top-p and/or
min-p and no top-k, redone from the logits stage 1 wrote, many programs per row.

Pathwise: tokens equal the float64 reference's on the same noise (log-probs within fp32),
through the bracket-and-sort cut and through its bisection (a bracket larger than CAP), for
top-p, min-p, both, raw log-probs and several samples. Statistical: chi-squared on flat rows
whose nucleus holds hundreds of tokens, top-p alone, min-p alone and both (torch path; the
interpreted kernels' flat-row test is test_filters.test_chi2_device_fallback_interpreted), with
negative controls the same test rejects (top-p against the mass before a top-k, min-p against
the maximum of one 128-token tile instead of the row's, min-p dropped).
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import tpsample
from tpsample import filters as F
from tpsample import launchers, replay
from tpsample import params as P
from tpsample.api import _pipeline
from tpsample.plan import DeviceKind, make_plan
from tpsample.torch_records import records_torch
from tpsample.filters import cut_list
from tpsample.kernels import filter_cut
from tpsample.reference import reference_sample

from cases import lm_head_case
from dist_utils import run_world
from stats import ALPHA, chi2_pvalue
from test_filters import (assert_matches_reference, counts, filtered_probs, row_logits,
                          winner_cleared)

FLAT = dict(top_p=torch.tensor([0.9, 0.5, 1.0, 0.99, 0.95, 0.3]),
            min_p=torch.tensor([0.0, 0.2, 0.3, 0.0, 0.05, 0.0]),
            temperature=torch.tensor([1.0, 0.8, 1.0, 1.5, 1.2, 1.0]))


def flat_rows(V=3000, B=6, seed=2):
    """Rows whose 0.9-nucleus holds most of V: every one is flagged."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 16, generator=g) * 0.15, torch.randn(V, 16, generator=g)


def side_outputs(monkeypatch) -> list:
    """A list that gains, per stage-1 launch through launchers.stage1 (recorded calls, not
    replays), whether it wrote the side output."""
    seen = []
    stage1 = launchers.stage1

    def spy(*args, side=None, **kw):
        seen.append(side is not None)
        return stage1(*args, side=side, **kw)
    monkeypatch.setattr(launchers, "stage1", spy)
    return seen


SLOW = pytest.mark.slow
# (NT, SHORT, MID, CAP) and the sort tier every top-p row must reach: as shipped at small B,
# the passes end once a bracket provably fits MID slots (100-300 keys); with 16 thresholds a
# pass and no early end the flat rows' brackets hold 0-2 keys (the short sort); with 2 they
# hold 470-1,200 (x_max and log Z from the filter kernel: the first bracket starts below the
# row's smallest logit); with the early stop of large batches HIST 1's bracket provably fits
# the CAP slots and the other passes skip the rows (100-400 keys)
TIERS = [pytest.param((None, None, None, None), "early-mid", id="early-mid"),
         pytest.param((None, None, None, None), "short", id="short-sort", marks=SLOW),
         pytest.param((None, None, None, None), "early", id="early-stop", marks=SLOW),
         pytest.param((2, 2, 2048, None), "mid", id="mid-sort", marks=SLOW),
         pytest.param((2, 2, 4, None), "long", id="long-sort", marks=SLOW),
         pytest.param((2, 2, 2, 4), "bisection", id="bisection", marks=SLOW)]


@pytest.mark.parametrize("extra", [dict(), pytest.param(dict(num_samples=2, logprobs_mode="raw"),
                                                  marks=SLOW)], ids=["replacement", "raw-S2"])
@pytest.mark.parametrize("sizes,tier", TIERS)
def test_fast_path_matches_reference(extra, sizes, tier, monkeypatch):
    """Every row flagged and taken by the fast path (the call has no top-k or top log-probs):
    tokens equal the reference's, log-probs and log Z within 1e-4, with the cut from each
    tier of FINISH (the 128-, MID- or CAP-slot sort, or the bisection past CAP) and from a
    bracket that ended the passes early (EARLY: at MID or CAP slots), checked from the
    bracket sizes FINISH saw."""
    for name, value in zip(("NT", "SHORT", "MID", "CAP"), sizes):
        if value is not None:
            monkeypatch.setattr(filter_cut, name, filter_cut.tl.constexpr(value))
    if tier == "early":
        monkeypatch.setattr(launchers, "EARLY_FROM_B", 1)
    if tier != "early-mid":
        monkeypatch.setattr(launchers, "EARLY_SMALL", 0)
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 5)
    seen = []
    run = replay.run_kernel

    def spy(k, grid, args, const, opts):
        out = run(k, grid, args, const, opts)
        if const.get("STEP") == filter_cut.FINISH.value:
            seen.append(args[16][:, filter_cut.CAP.value].clone())  # keys: the counter
        return out
    monkeypatch.setattr(replay, "run_kernel", spy)  # (the steps launch through run_named)
    h, w = flat_rows()
    kw = dict(FLAT, seed=torch.arange(6) * 13 + 1, **extra)
    pipe = _pipeline("triton", h.device)
    before = counts(pipe)
    out = tpsample.sample(h, w, backend="triton", return_logprobs=True, **kw)
    assert counts(pipe)[1] - before[1] == 6
    assert_matches_reference(out, reference_sample(h, w, **kw))
    n = seen[0][FLAT["top_p"] < 1]  # the top-p rows' bracket sizes
    short, mid, cap = (filter_cut.SHORT.value, filter_cut.MID.value, filter_cut.CAP.value)
    assert {"short": (n <= short).all(), "mid": ((n > short) & (n <= mid)).all(),
            "long": ((n > mid) & (n <= cap)).all(), "bisection": (n > cap).all(),
            "early": ((n > 16) & (n <= cap)).all(),
            "early-mid": ((n > 16) & (n <= mid)).all()}[tier], n


@pytest.mark.parametrize("logprobs", [False, True], ids=["tokens", "logprobs"])
def test_fast_path_without_the_side_output_matches_reference(logprobs, monkeypatch):
    """A call whose stage 1 skips the side output (FallbackChoice.side_output: no row was
    flagged lately) and then flags rows: their logits are recomputed from W, no side output
    is written, and the tokens (log-probs, log Z) equal the reference's."""
    from tpsample.fallback_choice import FallbackChoice
    monkeypatch.setattr(FallbackChoice, "side_output", lambda self, h, c: False)
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 5)
    sides = side_outputs(monkeypatch)
    h, w = flat_rows()
    kw = dict(FLAT, seed=torch.arange(6) * 13 + 1)
    pipe = _pipeline("triton", h.device)
    before = counts(pipe)
    out = tpsample.sample(h, w, backend="triton", return_logprobs=logprobs, **kw)
    assert sides == [False] and counts(pipe)[1] > before[1]
    ref = reference_sample(h, w, **kw)
    if logprobs:
        assert_matches_reference(out, ref)
    else:
        assert torch.equal(out, ref.tokens[:, 0])


@pytest.mark.slow
def test_fast_path_leaves_other_rows_to_the_bisection_kernel(monkeypatch):
    """A call with top-k on some rows: the rows without it take the fast path, the others
    the one-program kernel; all equal the reference."""
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 5)
    h, w = flat_rows()
    kw = dict(FLAT, top_k=torch.tensor([0, 0, 400, 0, 2000, -1]), seed=torch.arange(6) + 5)
    out = tpsample.sample(h, w, backend="triton", return_logprobs=True, **kw)
    assert_matches_reference(out, reference_sample(h, w, **kw))


WINNER_ROWS = dict(top_p=torch.tensor([0.9, 0.5, 1.0, 0.99, 0.95, 0.3, 0.9, 0.7] * 2),
                   min_p=torch.tensor([0.0, 0.0, 0.3, 0.0, 0.05, 0.0, 0.02, 0.0] * 2),
                   temperature=torch.tensor([1.0, 0.8, 1.0, 1.5, 1.2, 1.0, 0.9, 1.1] * 2))


def _winner_call(monkeypatch, logprobs=False, **patches):
    """A call on 16 flat rows (every one flagged; tokens only, or with log-probs), with
    filter_cut's helpers replaced by `patches`; returns (h, w, keywords, output), after
    checking that the fast path took its winner check, with STATS for tokens only and with
    the filter kernel's x_max and log Z instead for log-probs (the winner kept by the cut)."""
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 5)
    for name, fn in patches.items():
        monkeypatch.setattr(filter_cut, name, fn)
    modes, steps = [], []
    run = replay.run_kernel

    def spy(k, grid, args, const, opts):
        steps.append(const.get("STEP"))
        if const.get("STEP") == filter_cut.FINAL.value:
            modes.append(const.get("WINNER"))
        return run(k, grid, args, const, opts)
    monkeypatch.setattr(replay, "run_kernel", spy)
    h, w = flat_rows(V=1200, B=16)
    kw = dict(WINNER_ROWS, seed=torch.arange(16) * 5 + 3)
    out = tpsample.sample(h, w, backend="triton", return_logprobs=logprobs, **kw)
    assert modes == [True]
    assert (filter_cut.STATS.value in steps) == (not logprobs), steps
    return h, w, kw, out if logprobs else out.view(-1)


@pytest.mark.slow
def test_winner_check_gives_the_cut_paths_tokens(monkeypatch):
    """A call checks each row's winner, and redraws noise only near tile winners that beat
    the best kept one: every row's token equals the reference's, tokens only (which skips
    the cut where the winner is kept) and with log-probs (every top-p row's cut, for the
    kept mass; log-probs and log Z as the reference's), and equals the tokens of the call
    that draws every token's noise (S = 2's first sample, without the winner check). The
    rows are of both kinds: some rows' unfiltered winner (same noise) is kept, some not."""
    h, w, kw, tok = _winner_call(monkeypatch)
    ref = reference_sample(h, w, **kw)
    assert torch.equal(tok, ref.tokens.view(-1))
    _, _, _, full = _winner_call(monkeypatch, logprobs=True)
    assert torch.equal(tok, full.tokens.view(-1))
    assert_matches_reference(full, ref)
    two = tpsample.sample(h, w, backend="triton", num_samples=2, **kw)
    assert torch.equal(tok, two[:, 0])
    plain = reference_sample(h, w, seed=kw["seed"], temperature=kw["temperature"]).tokens
    kept = torch.stack([filtered_probs(row_logits(h[b], w, float(kw["temperature"][b])),
                                       top_p=float(kw["top_p"][b]),
                                       min_p=float(kw["min_p"][b]))[plain[b, 0]] > 0
                        for b in range(16)])
    assert 0 < int(kept.sum()) < 16, kept


CERT_ROWS = dict(top_k=torch.tensor([0, 0, 0, 0, 50, 60, 0, 0] * 2),
                 top_p=torch.tensor([0.9, 0.99, 1.0, 0.95, 0.9, 1.0, 0.8, 1.0] * 2),
                 min_p=torch.tensor([0.0, 0.0, 0.02, 0.01, 0.0, 0.0, 0.0, 0.03] * 2),
                 temperature=torch.tensor([1.0, 1.0, 1.2, 0.9, 1.0, 1.0, 1.1, 1.0] * 2))


def _winner_certified(h, w, kw):
    """bool [B]: the rows of a tokens-only call (per-row filters and temperatures in kw) that
    the winner certificate clears, each by test_filters.winner_cleared (float64)."""
    return torch.tensor([bool(winner_cleared(
        h[b], w, kw["seed"][b:b + 1],
        dict(top_k=int(kw["top_k"][b]), top_p=float(kw["top_p"][b]), min_p=float(kw["min_p"][b])),
        float(kw["temperature"][b]))) for b in range(h.shape[0])])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_winner_certificate_clears_known_kept_winners(backend, monkeypatch):
    """A tokens-only call clears the flagged rows whose unfiltered winner is a known token
    that the row keeps (the winner certificate): exactly the rows a float64 computation from
    the logits names (some but not all of the flagged rows; never a row with top-k and
    top-p), and every row's token equals the one the call with log-probs gives, which sends
    every uncertified row through the exact fallback."""
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 5)
    h, w = lm_head_case("zipf", 1200, seed=4)
    h = h.expand(16, -1).contiguous()
    kw = dict(CERT_ROWS, seed=torch.arange(16) * 7 + 2)
    want = _winner_certified(h, w, kw)
    assert 0 < int(want.sum()) < 12 and not want[[4, 12]].any(), want
    pipe = _pipeline(backend, h.device)
    before = counts(pipe)[1]
    tok = tpsample.sample(h, w, backend=backend, **kw)
    tokens_only = counts(pipe)[1] - before
    before = counts(pipe)[1]
    full = tpsample.sample(h, w, backend=backend, return_logprobs=True, **kw)
    assert full.tokens.view(-1).tolist() == tok.tolist()
    assert (counts(pipe)[1] - before) - tokens_only == int(want.sum())
    assert tok.tolist() == reference_sample(h, w, **kw).tokens.view(-1).tolist()


def test_winner_certificate_kernel_equals_torch_on_the_same_records():
    """kernels/filter_records.py (WINNER_CERT) and filters.reduce_candidates (winner) on
    identical records: the same flags, and on every cleared row the pathwise winner as its
    token with NaN log-prob and log Z; without the certificate the same rows stay flagged. A
    greedy row (its filters ignored) keeps its argmax and its log-prob."""
    h, w = lm_head_case("zipf", 1200, seed=4)
    h = h.expand(16, -1).contiguous()
    temperature = CERT_ROWS["temperature"].clone()
    temperature[10] = 0.0  # (a min-p row)
    row = P.row_params(h, temperature, torch.arange(16) * 7 + 2, 0)
    rec = records_torch(h, w, bias=None, inv_temp=row.inv_temp, seed=row.seed,
                        offset=row.offset, num_samples=1, n_real=1200, candidates=True)[None]
    filt = P.filter_params(h, CERT_ROWS["top_k"], CERT_ROWS["top_p"], CERT_ROWS["min_p"], 0, 1,
                           True, "processed", 1200)
    plan = make_plan(DeviceKind.of(h.device), B=16, D=h.shape[1], V=1200, dtype=torch.float32,
                     num_samples=1, candidates=True)
    base = tpsample.pipeline.merge_records(rec[:, :1], row, "max")
    winner = base[0][:, 0]
    plain = launchers.stage2_filtered(plan, rec.clone(), row, filt).fallback.bool()
    tk = launchers.stage2_filtered(plan, rec.clone(), row, filt, tokens_only=True)
    tt = F.reduce_candidates(rec, row, filt, 1, base, winner=winner)
    assert torch.equal(tk.fallback.bool(), tt.fallback)
    assert torch.equal(F.reduce_candidates(rec, row, filt, 1, base).fallback, plain)
    cleared = plain & ~tt.fallback
    assert 0 < int(cleared.sum()) < int(plain.sum())
    assert not (tt.fallback & ~plain).any()
    for out in (tk, tt):
        assert torch.equal(out.tokens[cleared, 0], winner[cleared])
        assert out.logprobs[cleared].isnan().all() and out.logz[cleared].isnan().all()
    ok = ~tt.fallback
    assert torch.equal(tk.tokens[ok], tt.tokens[ok])
    assert ok[10] and tk.tokens[10, 0] == winner[10] and tk.logprobs[10].isfinite().all()


@pytest.mark.slow
def test_the_cut_list_takes_more_chunks_than_the_other_steps(monkeypatch):
    """A tokens-only call lists the rows whose winner is not kept (SELECT) and spreads their
    HIST and COMPACT passes over more, smaller chunks than the other steps' (GH > G): the
    tokens still equal the reference's, and the list held exactly the rows the cut ran on."""
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 5)
    monkeypatch.setattr(launchers, "CUT_LIST_CHUNK", 2048)
    seen = []
    named_run = launchers.run_named

    def spy(fn, grid, options, **named):
        out = named_run(fn, grid, options, **named)
        if named.get("STEP") == filter_cut.FINISH.value:
            seen.append((named["G"], named["GH"], cut_list(named["win_ptr"], named["B"]).clone()))
        return out
    monkeypatch.setattr(launchers, "run_named", spy)
    h, w = flat_rows(V=9000, B=8)
    kw = {k: v[:8] for k, v in WINNER_ROWS.items()}
    kw["seed"] = torch.arange(8) * 7 + 1
    tok = tpsample.sample(h, w, backend="triton", **kw).view(-1)
    ref = reference_sample(h, w, **kw)
    assert torch.equal(tok, ref.tokens.view(-1))
    (G, GH, listed), = seen
    assert GH > G, (G, GH)
    n = int(listed[0])
    plain = reference_sample(h, w, seed=kw["seed"], temperature=kw["temperature"]).tokens
    not_kept = [b for b in range(8) if kw["top_p"][b] < 1 and filtered_probs(
        row_logits(h[b], w, float(kw["temperature"][b])), top_p=float(kw["top_p"][b]),
        min_p=float(kw["min_p"][b]))[plain[b, 0]] == 0]
    assert sorted(listed[1:1 + n].tolist()) == not_kept and 0 < n < 8


@triton.jit
def _kept_always(part_ptr, b, B, G, W, w_key, cut, p, m, xmax, z, BY_CUT: tl.constexpr,
                 BLOCK_G: tl.constexpr):
    return w_key == w_key


@triton.jit
def _kept_never(part_ptr, b, B, G, W, w_key, cut, p, m, xmax, z, BY_CUT: tl.constexpr,
                BLOCK_G: tl.constexpr):
    return w_key != w_key


@triton.jit
def _best_tile_winner(rec_row, st_slot, st_t, T_rec, N_rec, cut, m, xmax,
                      BLOCK_R: tl.constexpr):
    n = tl.arange(0, BLOCK_R)
    at = (n // T_rec).to(tl.int64) * st_slot + (n % T_rec).to(tl.int64) * st_t
    sc = tl.load(rec_row + at, mask=n < N_rec, other=float("-inf"))
    tok = tl.load(rec_row + at + 1, mask=n < N_rec, other=0.0)
    x = tl.load(rec_row + at + 2, mask=n < N_rec, other=float("-inf"))
    k = tl.where(sc > float("-inf"), filter_cut.order_key(sc, tok), -1)
    best = tl.max(k)
    return best, tl.max(tl.where(k == best, x, float("-inf")))


@SLOW
@pytest.mark.parametrize("logprobs", [False, True], ids=["tokens", "logprobs"])
@pytest.mark.parametrize("patches,right", [
    (dict(_winner_kept=_kept_always), False),  # every winner taken as kept
    (dict(_winner_kept=_kept_never), True),  # every row through the cut and SAMPLE
    (dict(_winner_kept=_kept_never, _kept_tile_winners=_best_tile_winner), False),  # s* from
], ids=["check-always", "check-never", "s*-not-kept"])  # every tile winner, kept or not
def test_winner_check_negative_controls(patches, right, logprobs, monkeypatch):
    """The reference comparison rejects a winner check that keeps every winner, and a SAMPLE
    whose s* ignores whether the tile winner is kept; with no winner kept (every row through
    the cut and the tile-skipping SAMPLE) it still passes, log-probs included."""
    h, w, kw, out = _winner_call(monkeypatch, logprobs, **patches)
    tok = out.tokens.view(-1) if logprobs else out
    ref = reference_sample(h, w, **kw)
    assert torch.equal(tok, ref.tokens.view(-1)) == right
    if logprobs and right:
        assert_matches_reference(out, ref)


@pytest.mark.parametrize("logprobs", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["tokens", "logprobs"])
def test_min_p_alone_takes_the_row_max_from_the_filter_kernel(logprobs, monkeypatch):
    """A call with min-p and no top-p checks its rows' winners against the filter kernel's
    row max: no STATS launch, tokens equal the reference's (log-probs and log Z within 1e-4);
    with that max read one nat high (the kept set e times smaller) they do not."""
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 5)
    steps = []
    run = replay.run_kernel

    def spy(k, grid, args, const, opts):
        steps.append(const.get("STEP"))
        return run(k, grid, args, const, opts)
    monkeypatch.setattr(replay, "run_kernel", spy)
    h, w = flat_rows(V=1200, B=8)
    kw = dict(min_p=torch.tensor([0.02, 0.05, 0.1, 0.3] * 2),
              temperature=torch.tensor([1.0, 0.8, 1.3, 1.0] * 2), seed=torch.arange(8) * 11 + 4)
    out = tpsample.sample(h, w, backend="triton", return_logprobs=logprobs, **kw)
    ref = reference_sample(h, w, **kw)
    assert filter_cut.SAMPLE.value in steps and filter_cut.STATS.value not in steps
    if logprobs:
        assert_matches_reference(out, ref)
    else:
        assert torch.equal(out.view(-1), ref.tokens.view(-1))
    decode = filter_cut.decode_key
    monkeypatch.setattr(filter_cut, "decode_key", lambda k: decode(k) + 1.0)
    wrong = tpsample.sample(h, w, backend="triton", **kw)
    assert not torch.equal(wrong.view(-1), ref.tokens.view(-1))


@pytest.mark.slow
def test_fast_path_is_deterministic(monkeypatch):
    """The same call twice, and with another grid: the same tokens and log-probs (every
    partial sum is added in a fixed order; the grid only changes which program takes an
    item)."""
    h, w = flat_rows()
    kw = dict(FLAT, seed=torch.arange(6) * 3, return_logprobs=True, backend="triton")
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 5)
    a = tpsample.sample(h, w, **kw)
    b = tpsample.sample(h, w, **kw)
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 2)
    c = tpsample.sample(h, w, **kw)
    for x in (b, c):
        assert torch.equal(a.tokens, x.tokens) and torch.equal(a.logprobs, x.logprobs)


# ----- chi-squared on flat rows ------------------------------------------------------------
def tile_max_min_p(logits, min_p):
    """The negative control for min-p: the threshold against the first 128-token tile's
    maximum instead of the row's (what a per-tile certificate without the row max gives)."""
    l = np.asarray(logits, dtype=np.float64)
    p = np.exp(l - l.max())
    keep = p >= min_p * p[:128].max()
    out = np.where(keep, p, 0.0)
    return torch.from_numpy(out / out.sum())


FLAT_CHI2 = [  # (filters, the negative control's probabilities)
    (dict(top_p=0.9), lambda l: filtered_probs(l, top_k=600, top_p=0.9,
                                              renormalise_after_k=False)),
    (dict(min_p=0.4), lambda l: tile_max_min_p(l, 0.4)),
    (dict(top_p=0.8, min_p=0.3), lambda l: filtered_probs(l, top_p=0.8)),  # min-p dropped
]


def _flat_head(V=1024):
    g = torch.Generator().manual_seed(21)
    x = 0.5 * torch.randn(V, generator=g)
    w = 0.02 * torch.randn(V, 8, generator=g)
    w[:, 0] += x
    h = torch.zeros(8)
    h[0] = 1.0
    return h, w


@pytest.mark.slow
@pytest.mark.parametrize("backend,rows", [("torch", 20000)])  # (interpreted kernels on flat
# rows: test_filters.test_chi2_device_fallback_interpreted, which now takes this path)
@pytest.mark.parametrize("filt,wrong", FLAT_CHI2, ids=["top_p", "min_p", "top_p+min_p"])
def test_chi2_flat_rows(backend, rows, filt, wrong, monkeypatch):
    """A flat row (V = 1024, ~6.9 nats; top-p 0.9 keeps ~800 tokens): every row flagged, and
    taken by the fallback unless the winner certificate clears it (a known or, min-p alone,
    any kept winner: a fixed count, `winner_cleared`); chi-squared against the float64
    filtered distribution at ALPHA, and the same samples rejected against the negative
    control."""
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 64)
    h, w = _flat_head()
    pipe = _pipeline(backend, h.device)
    before = counts(pipe)
    tok = tpsample.sample(h.expand(rows, -1).contiguous(), w, seed=torch.arange(rows) + 7,
                          backend=backend, **filt)
    cleared = winner_cleared(h, w, torch.arange(rows) + 7, filt)
    assert 0 < cleared < rows // 2 and counts(pipe)[1] - before[1] == rows - cleared
    logits = row_logits(h, w)
    p = filtered_probs(logits, **filt)
    assert p[tok].min() > 0, "a token outside the kept set"
    assert chi2_pvalue(tok, p) > ALPHA
    assert chi2_pvalue(tok, wrong(logits)) < ALPHA


# ----- tensor parallel (gloo): the same tokens as one device on flat rows ------------------
FLAT_TP = dict(top_p=torch.tensor([0.9, 0.5, 0.99, 0.95]),
               min_p=torch.tensor([0.0, 0.2, 0.0, 0.05]), seed=torch.arange(4) * 7 + 1)
MIN_P_TP = dict(min_p=torch.tensor([0.02, 0.2, 0.05, 0.1]), seed=torch.arange(4) * 5 + 2)


def _tp_flat(rank, world, backend, kw=FLAT_TP):
    h, w = flat_rows(V=600, B=4)
    V = w.shape[0]
    lo, hi = rank * V // world, (rank + 1) * V // world
    s = tpsample.VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=V, vocab_start=lo,
                                      backend=backend)
    return s(h, return_logprobs=True, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [FLAT_TP, MIN_P_TP], ids=["top_p+min_p", "min_p"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tp_flat_rows_equal_one_device(backend, kw):
    """Two gloo ranks, top-p / min-p only on flat rows (every row falls back: its logit shards
    come from the side output stage 1 wrote, gathered on the host), and min-p alone (the
    filter kernel's row max): tokens equal the one-device call's in every row, log-probs and
    log Z within 1e-5."""
    outs = run_world(2, _tp_flat, backend, kw)
    for o in outs:
        assert not isinstance(o, dict), o
    h, w = flat_rows(V=600, B=4)
    one = tpsample.sample(h, w, backend=backend, return_logprobs=True, **kw)
    for o in outs:
        assert torch.equal(o.tokens, one.tokens)
        assert torch.allclose(o.logprobs, one.logprobs, atol=1e-5)
        assert torch.allclose(o.logz, one.logz, atol=1e-5)


def _tp_certified(rank, world, backend):
    h, w = lm_head_case("zipf", 1200, seed=4)
    h = h.expand(16, -1).contiguous()
    V = w.shape[0]
    lo, hi = rank * V // world, (rank + 1) * V // world
    s = tpsample.VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=V, vocab_start=lo,
                                      backend=backend)
    return s(h, seed=torch.arange(16) * 7 + 2, **CERT_ROWS)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=SLOW)])
def test_tp_winner_certificate_equals_one_device(backend):
    """Two gloo ranks, a tokens-only call on rows that the winner certificate partly clears
    (the rows of test_winner_certificate_clears_known_kept_winners): every rank's tokens
    equal the one-device call's, which equal those of the call with log-probs."""
    outs = run_world(2, _tp_certified, backend)
    for o in outs:
        assert not isinstance(o, dict), o
    h, w = lm_head_case("zipf", 1200, seed=4)
    h = h.expand(16, -1).contiguous()
    kw = dict(CERT_ROWS, seed=torch.arange(16) * 7 + 2)
    one = tpsample.sample(h, w, backend=backend, **kw)
    assert 0 < int(_winner_certified(h, w, kw).sum()) < 16
    assert torch.equal(one, tpsample.sample(h, w, backend=backend, return_logprobs=True,
                                            **kw).tokens.view(-1))
    for o in outs:
        assert torch.equal(o, one)


@pytest.mark.parametrize("filters,writes", [
    (dict(top_p=0.9), True), (dict(min_p=0.1), True), (dict(top_k=50), False),
    (dict(top_k=50, top_p=0.9), False), (dict(top_p=0.9, top_logprobs=2), True),
    (dict(top_p=0.9, num_samples=2, replacement=False), False),
    (dict(top_k=torch.tensor([50, 0]), top_p=0.9), True)])
def test_stage1_writes_the_side_output_only_for_the_fast_path(filters, writes, monkeypatch):
    """The B·V·4-byte side output costs stage 1 a few percent: only calls whose flagged rows
    may take the fast path (top-p / min-p rows without a top-k: a per-row top_k tensor may
    leave rows without one; with top log-probs too; not distinct samples) ask for it."""
    seen = side_outputs(monkeypatch)
    h, w = flat_rows(V=600, B=2)
    tpsample.sample(h, w, seed=1, backend="triton", **filters)
    assert seen == [writes]


@pytest.mark.parametrize("n_top,path,extra", [(5, "cut", {}), (32, "per-row", {}),
                                              (5, "cut", dict(num_samples=2)),
                                              (5, "cut", dict(merge="logmass"))])
def test_top_logprobs_of_flat_rows(n_top, path, extra):
    """Top log-probs with top-p / min-p on flat rows: a flagged row whose top n the filter
    kernel knows (n <= its known prefix) is redone on the cut's fast path, whose FINAL turns
    the n logits the filter kernel left into log-probs; one whose known prefix is shorter
    (12 tiles' candidates here hold fewer than 32 tokens) is flagged 2 and takes the
    one-program-per-row path. Either way the reference's outputs, top n included."""
    h, w = flat_rows(V=1500, B=4)
    kw = dict(top_p=torch.tensor([0.9, 0.5, 0.95, 1.0]), min_p=torch.tensor([0.0, 0.0, 0.0, 0.2]),
              seed=torch.arange(4) * 11 + 3, top_logprobs=n_top, **extra)
    pipe = _pipeline("triton", h.device)
    before = pipe.fallback.counter().clone()
    out = tpsample.sample(h, w, backend="triton", return_logprobs=True, **kw)
    rows, cut_rows = (pipe.fallback.counter() - before).tolist()
    assert (rows, cut_rows) == ((0, 4) if path == "cut" else (4, 0))  # (the FINAL of
    # a one-sample "max" call checks its winner; the others sample the kept set)
    assert_matches_reference(out, reference_sample(h, w, **kw))
    raw = tpsample.sample(h, w, backend="triton", return_logprobs=True,
                          logprobs_mode="raw", **kw)
    assert_matches_reference(raw, reference_sample(h, w, logprobs_mode="raw", **kw))


def test_a_call_whose_every_row_has_a_top_k_launches_no_fast_path_step(monkeypatch):
    """top_k given as one value (every row has it) with top-p and min-p: the flagged rows
    (top-k past the known prefix) go to the one-program kernel, and the call launches none of
    the fast path's steps (no row could take them); the same top-k as a per-row tensor,
    where a row could have none, launches them. Both give the same tokens, log-probs and
    log Z, the reference's."""
    steps = []
    run = replay.run_kernel

    def spy(k, grid, args, const, opts):
        steps.append(k is filter_cut.cut_step_kernel)
        return run(k, grid, args, const, opts)
    monkeypatch.setattr(replay, "run_kernel", spy)
    h, w = flat_rows(V=1000, B=3)
    kw = dict(top_p=0.9, min_p=0.01, seed=torch.arange(3) + 7)
    pipe = _pipeline("triton", h.device)
    before = counts(pipe)
    one = tpsample.sample(h, w, backend="triton", top_k=100, return_logprobs=True, **kw)
    assert counts(pipe)[1] - before[1] == 3  # (every row flagged: 100 > the 32 known)
    assert steps and not any(steps)
    steps.clear()
    per_row = tpsample.sample(h, w, backend="triton", top_k=torch.full((3,), 100),
                              return_logprobs=True, **kw)
    assert any(steps)
    for f in ("tokens", "logprobs", "logz"):
        assert torch.equal(getattr(one, f), getattr(per_row, f)), f
    assert_matches_reference(one, reference_sample(h, w, top_k=100, **kw))


@pytest.mark.parametrize("logprobs", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["tokens", "logprobs"])
def test_every_launch_takes_the_calls_outputs_whole(logprobs, monkeypatch):
    """A replayed call fills in its tensors by identity (tpsample/replay.py): a launch argument
    that is a view of one of the call's outputs, not the output itself, would be replayed on
    the recorded call's memory (the cut list as a view of the filter kernel's scratch was).
    Every launch of a filtered call on flagged rows (the filter kernel and the fast path's
    steps, tokens only and with log-probs) takes each output it touches whole."""
    monkeypatch.setattr(launchers, "fallback_programs", lambda t: 5)
    outs, args = [], []
    make, run = launchers.filtered_outputs, replay.run_kernel

    def made(*a, **k):
        outs.append(make(*a, **k))
        return outs[-1]

    def spy(k, grid, a, const, opts):
        args.append((getattr(k, "__name__", k), const.get("STEP"), a))
        return run(k, grid, a, const, opts)
    monkeypatch.setattr(launchers, "filtered_outputs", made)
    monkeypatch.setattr(replay, "run_kernel", spy)
    h, w = flat_rows(V=1200, B=8)
    kw = {k: v[:8] for k, v in WINNER_ROWS.items()}
    tpsample.sample(h, w, backend="triton", seed=torch.arange(8), return_logprobs=logprobs, **kw)
    (out,) = outs
    steps = {s for _, s, _ in args if s is not None}
    assert filter_cut.FINISH.value in steps and filter_cut.SAMPLE.value in steps, steps
    whole = {t.untyped_storage().data_ptr(): t for t in out if t.numel()}
    for name, step, a in args:
        for t in a:
            if isinstance(t, torch.Tensor) and t.numel():
                o = whole.get(t.untyped_storage().data_ptr())
                assert o is None or t is o, (name, step, t.shape, o.shape)


@triton.jit
def _guess_kernel(rec_ptr, xmax_ptr, lo_ptr, p_ptr, out_ptr, N_rec, BLOCK_R: tl.constexpr):
    b = tl.program_id(0)
    glo, ghi = filter_cut._guess_window(rec_ptr + b * N_rec * 4, 0, 4, N_rec, N_rec,
                                        tl.load(xmax_ptr + b), tl.load(lo_ptr + b),
                                        tl.load(p_ptr + b), BLOCK_R)
    tl.store(out_ptr + 2 * b, glo)
    tl.store(out_ptr + 2 * b + 1, ghi)


def _guess_windows(x, p, winner=True, seed=0):
    """SELECT's window (_guess_window) for rows of logits x [B, V] (V a multiple of 128)
    from records built as stage 1 builds them: per tile its log-mass and its Gumbel-max
    winner's logit (winner False: the tile's largest logit, a negative control). Returns
    the windows [B, 2] and each row's top-p cut logit (float64)."""
    B, V = x.shape
    tiles = x.view(B, V // 128, 128)
    g = torch.Generator().manual_seed(seed)
    gumbel = -torch.log(-torch.log(torch.rand(tiles.shape, generator=g, dtype=torch.float64)))
    pick = (tiles.double() + gumbel).argmax(-1, keepdim=True) if winner else \
        tiles.argmax(-1, keepdim=True)
    rec = torch.zeros(B, V // 128, 4)
    rec[..., 2] = tiles.gather(-1, pick)[..., 0]
    rec[..., 3] = torch.logsumexp(tiles.double(), -1).float()
    xmax = x.max(1).values
    z = torch.exp(x.double() - xmax[:, None].double()).sum(1)
    lo = (xmax.double() + torch.log((1 - p.double()) * z / V) - 0.5).float()  # (_first_lo)
    out = torch.empty(B, 2)
    _guess_kernel[(B,)](rec, xmax.contiguous(), lo, p, out, V // 128,
                        BLOCK_R=triton.next_power_of_2(V // 128))
    xs = x.double().sort(1, descending=True).values
    e = torch.exp(xs - xs[:, :1])
    before = e.cumsum(1) - e
    cut = torch.stack([xs[b][before[b] < p[b] * e[b].sum()][-1] for b in range(B)])
    return out, cut, lo, xmax


def test_the_records_place_the_first_pass_around_the_cut():
    """SELECT's window from the records (GUESS) holds every flat row's top-p cut and is a
    small part of the range HIST 1 would spread its thresholds over without it (Gaussian
    logits of std 1 and 2 over V = 131,072: 1,024 tiles; top-p 0.5-0.99; at 0.99 the window's
    uncertainty in mass exceeds 1 - p, so it reaches down to the range's start). Negative
    control: a record whose logit is the tile's largest instead of its Gumbel-max winner (no
    longer a draw from the tile's softmax) puts the window above the cut of every row whose
    window does not reach the range's start."""
    g = torch.Generator().manual_seed(5)
    B, V = 24, 131072
    x = torch.randn(B, V, generator=g) * torch.tensor([1.0, 2.0]).repeat(B // 2)[:, None]
    p = torch.tensor([0.5, 0.9, 0.95, 0.99]).repeat(B // 4)
    win, cut, lo, xmax = _guess_windows(x, p)
    assert ((win[:, 0] <= cut) & (cut <= win[:, 1])).all(), (win, cut)
    share = (win[:, 1] - win[:, 0]) / (xmax - lo)
    assert (share[p < 0.99] < 0.15).all(), share
    bad, cut, _, _ = _guess_windows(x, p, winner=False)
    assert (bad[:, 0] > cut)[p < 0.99].all(), (bad, cut)


@pytest.mark.slow
def test_a_first_pass_window_that_misses_the_cut_leaves_the_outputs_exact(monkeypatch):
    """HIST 1's thresholds only narrow the bracket: a window from SELECT that lies above
    every row's cut (the passes then continue from below it) or collapses to one logit gives
    the reference's tokens, log-probs and log Z all the same."""
    @triton.jit
    def above(rec_row, st_slot, st_t, T_rec, N_rec, xmax, lo, p, BLOCK_R: tl.constexpr):
        return xmax - 0.01, xmax

    @triton.jit
    def point(rec_row, st_slot, st_t, T_rec, N_rec, xmax, lo, p, BLOCK_R: tl.constexpr):
        return lo + 0.25, lo + 0.25

    for window in (above, point):
        h, w, kw, out = _winner_call(monkeypatch, logprobs=True, _guess_window=window)
        assert_matches_reference(out, reference_sample(h, w, **kw))
