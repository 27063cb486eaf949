"""Filtered sampling on the GPU (pytest -m gpu): the candidate kernels at a real LM-head
shape against the torch reduce on the same records, exactness through tpsample.sample, and
the typical-entropy head's certificates."""
import functools

import pytest
import torch

import tpsample
from tpsample import filters as F
from tpsample import launchers, params as P, records
from tpsample.launch.bench import typical_head
from tpsample.pipeline import Pipeline, merge_records

from cases import lm_head_case
from stats import ALPHA, chi2_pvalue
from test_filters import filtered_probs, row_logits

pytestmark = pytest.mark.gpu


def mixed_filters(B, g):
    k = torch.randint(0, 100, (B,), generator=g)
    p = 0.5 + 0.5 * torch.rand(B, generator=g)
    m = 0.1 * torch.rand(B, generator=g)
    temp = 0.5 + torch.rand(B, generator=g)
    k[::5], p[1::5], m[2::5], temp[3::7] = 0, 1.0, 0.0, 0.0  # filters off per row, greedy rows
    return {n: t.cuda() for n, t in dict(top_k=k, top_p=p, min_p=m, temperature=temp).items()}


@pytest.mark.parametrize("B,S,replacement,raw", [(1, 1, True, False), (64, 1, True, False),
                                                 (200, 2, True, True), (32, 3, False, False)])
def test_kernels_equal_torch_reduce_on_the_same_records(B, S, replacement, raw):
    """D = 4096, V = 151936 bf16, typical-entropy logits: stage 1's candidate planes through
    kernels/filter_records.py and through filters.reduce_candidates give the same tokens, top
    tokens and fallback flags; and the call's tokens equal the kernels' (fallback included)."""
    g = torch.Generator().manual_seed(B)
    h, w = typical_head(4096, 151936, B, torch.bfloat16, "cuda")
    kw = mixed_filters(B, g)
    row = P.row_params(h, kw["temperature"], torch.arange(B, device="cuda") * 3, 7)
    filt = P.filter_params(h, kw["top_k"], kw["top_p"], kw["min_p"], 6, S, replacement,
                           "raw" if raw else "processed", 151936)
    pipe = Pipeline("triton", h.device)
    plan = pipe.plan(h, w, merge="max", num_samples=S, need_mass=True, filters=filt)
    assert plan.candidates and plan.strategy in ("fused", "ws", "logits"), str(plan)
    T = records.num_tiles(151936)
    rec = torch.empty(1, records.planes(S, True), B, T, 4, device="cuda")
    launchers.stage1(plan, h, w, None, row, rec[0], n_real=151936)
    got = launchers.stage2_filtered(plan, rec, row, filt)
    got = got._replace(fallback=got.fallback.bool())
    base = merge_records(rec[:, :S], row, "max")
    want = F.reduce_candidates(rec, row, filt, S, base)
    assert torch.equal(got.fallback, want.fallback)
    ok = ~want.fallback
    assert torch.equal(got.tokens[ok], want.tokens[ok])
    assert torch.equal(got.top_tokens[ok], want.top_tokens[ok])
    assert torch.allclose(got.logprobs[ok], want.logprobs[ok], atol=2e-4, equal_nan=True)
    assert torch.allclose(got.top_logprobs[ok], want.top_logprobs[ok], atol=2e-4, equal_nan=True)
    assert torch.allclose(got.logz, want.logz, atol=2e-4)
    out = tpsample.sample(h, w, seed=row.seed, offset=7, num_samples=S, replacement=replacement,
                          top_logprobs=6, logprobs_mode="raw" if raw else "processed", **kw)
    tok = out.tokens if S > 1 else out.tokens[:, None]
    assert torch.equal(tok[ok], got.tokens[ok])


@pytest.mark.parametrize("B,raw,masked", [(64, False, False), (200, True, True)])
def test_ws_candidate_planes_equal_the_records_pass(B, raw, masked):
    """The ws kernel's candidate epilogue (kernels/gluon_sample.py) against the records pass
    over cuBLAS logits on the same head (D = 4096, V = 151936 bf16, mixed temperatures with
    greedy rows; with a random-half mask): every candidate's logit within 1e-3 of the
    reference's at that rank and of the reference logit of the token it names (logits up to
    ~40: two fp32 summation orders over D), the same ids but for near-ties (at most 1 in
    1000), the raw / log-mass plane within 1e-3."""
    from tpsample.plan import TO_LOGITS_CANDIDATES, DeviceKind, Layout, make_plan
    from tpsample.kernels import gluon_compat
    if not gluon_compat.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the ws kernel needs a Hopper GPU and a supported Triton")
    g = torch.Generator().manual_seed(B)
    V = 151936
    h, w = typical_head(4096, V, B, torch.bfloat16, "cuda")
    temp = 0.5 + torch.rand(B, generator=g)
    temp[::7] = 0.0
    row = P.row_params(h, temp.cuda(), torch.arange(B, device="cuda"), 3)
    mask = torch.randint(-2**31, 2**31 - 1, (B, V // 32), generator=g, dtype=torch.int32).cuda() \
        if masked else None
    T = records.num_tiles(V)
    got = {}
    for name, config in (("ws", None), ("logits", TO_LOGITS_CANDIDATES)):
        plan = make_plan(DeviceKind.of(h.device), B=B, D=4096, V=V, dtype=h.dtype,
                         layout=Layout.of(h, w, 0, 0), candidates=True, raw_mass=raw,
                         masked=masked, config=config)
        assert plan.strategy == name, str(plan)
        rec = torch.empty(records.planes(1, True), B, T, 4, device="cuda")
        launchers.stage1(plan, h, w, None, row, rec, n_real=V, mask=mask)
        got[name] = rec
    ws, ref = got["ws"], got["logits"]
    x_ws, id_ws = F.candidate_planes(ws[None], 1)
    x_ref, id_ref = F.candidate_planes(ref[None], 1)
    finite = torch.isfinite(x_ref)
    assert torch.equal(finite, torch.isfinite(x_ws))
    assert (x_ws[finite] - x_ref[finite]).abs().max() <= 1e-3
    inv = torch.where(row.inv_temp == 0, 1.0, row.inv_temp)
    logits = (h.float() @ w.float().T) * inv[:, None]
    if masked:
        ids = torch.arange(V, device="cuda")
        allowed = (mask[:, ids // 32] >> (ids % 32)) & 1
        logits = logits.masked_fill(allowed == 0, float("-inf"))
    named = logits.gather(1, id_ws.long().flatten(1).clamp(0, V - 1)).view_as(x_ws)
    assert (named[finite] - x_ws[finite]).abs().max() <= 1e-3
    assert (id_ws[finite] != id_ref[finite]).float().mean() <= 1e-3
    assert torch.allclose(ws[-1, ..., 0], ref[-1, ..., 0], rtol=0, atol=1e-3, equal_nan=True)
    assert (ws[0, ..., 1] != ref[0, ..., 1]).float().mean() <= 1e-3  # the sampled tokens


@pytest.mark.parametrize("filt", [dict(top_k=20, top_p=0.8), dict(min_p=0.05, top_p=0.9),
                                  dict(top_p=0.7)], ids=["k-p", "minp-p", "p"])
def test_chi2_filtered_on_gpu_bf16(filt):
    h, w = lm_head_case("zipf", V=1000, dtype=torch.bfloat16, device="cuda", seed=3)
    rows = 40000
    tok = tpsample.sample(h.expand(rows, -1).contiguous(), w, temperature=0.9,
                          seed=torch.arange(rows, device="cuda") * 7919, **filt)
    p = filtered_probs(row_logits(h.float().cpu(), w.float().cpu(), 0.9), **filt)
    assert p[tok.cpu()].min() > 0
    assert chi2_pvalue(tok, p) > ALPHA


def test_typical_head_is_certified():
    """On the benchmark's head (logits -1.6 ln(rank), ~2.7 nats) every filter of the
    benchmark is certified: no row takes the fallback."""
    h, w = typical_head(4096, 151936, 64, torch.bfloat16, "cuda")
    from tpsample import api
    for kw in (dict(top_k=50), dict(top_p=0.9), dict(min_p=0.05),
               dict(top_k=50, top_p=0.9, min_p=0.05), dict(top_logprobs=20)):
        api._PIPELINES.clear()
        tpsample.sample(h, w, seed=1, **kw)
        pipe = next(iter(api._PIPELINES.values()))
        assert pipe.candidate_rows == 64 and pipe.fallback_rows == 0, kw


@pytest.mark.parametrize("B,S,replacement", [(4, 1, True), (64, 2, False), (200, 1, True)])
def test_filtered_replay_equals_a_dispatched_call(B, S, replacement, monkeypatch):
    """A filtered call with the key of an earlier one re-issues its recorded launches with
    the new hidden states, per-row parameters and per-row filters: bit for bit what a
    dispatched call returns (tokens, log-probs, top log-probs)."""
    from tpsample import api, launchers, replay
    api._PIPELINES.clear()
    g = torch.Generator().manual_seed(B)

    def inputs():
        h, w = typical_head(1024, 20000, B, torch.bfloat16, "cuda")
        h = h + 0.05 * torch.randn(h.shape, generator=g).to(h)
        kw = mixed_filters(B, g)
        return dict(hidden=h, weight=w, seed=torch.randint(0, 1 << 40, (B,), generator=g).cuda(),
                    num_samples=S, replacement=replacement, top_logprobs=3,
                    return_logprobs=True, **kw)

    # two calls first, each waited for: a row that falls back on the device moves the next
    # call to the host fallback (FallbackChoice.device_now), another replay key
    for _ in range(2):
        tpsample.sample(**inputs())
        torch.cuda.synchronize()
    (pipe,) = api._PIPELINES.values()
    assert 1 <= len(pipe.replays) <= 2
    second = inputs()

    def dispatched(*a, **k):
        raise AssertionError("the second call must be a replay")
    with monkeypatch.context() as m:
        m.setattr(launchers, "stage1", dispatched)
        m.setattr(launchers, "stage2_filtered", dispatched)
        got = tpsample.sample(**second)
    monkeypatch.setattr(replay, "ENABLED", False)
    want = tpsample.sample(**second)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)


def test_filtered_replay_keeps_stage1_when_only_the_filters_change(monkeypatch):
    """Filtered calls keyed alike in stage 1 but not in stage 2 (other filters, top
    log-probs): the second re-issues the first's stage 1 and records its own stage 2; both,
    then replayed, return bit for bit what dispatched calls return."""
    from tpsample import api, launchers, replay
    api._PIPELINES.clear()
    B = 16
    h, w = typical_head(1024, 20000, B, torch.bfloat16, "cuda")
    seed = torch.arange(B, device="cuda")
    calls = [dict(top_k=50), dict(top_p=0.9, top_logprobs=3)]
    tpsample.sample(h, w, seed=seed, return_logprobs=True, **calls[0])  # (a tokens-only call
    (pipe,) = api._PIPELINES.values()  # keys its stage 2 apart: its fast path may skip the cut)
    with monkeypatch.context() as m:
        m.setattr(launchers, "stage1", lambda *a, **k: pytest.fail("stage 1 must be replayed"))
        tpsample.sample(h, w, seed=seed, return_logprobs=True, **calls[1])
    (stage1, stage2s), = pipe.replays.calls.values()
    assert len(stage2s) == 2
    with monkeypatch.context() as m:
        m.setattr(launchers, "stage1", lambda *a, **k: pytest.fail("stage 1 must be replayed"))
        m.setattr(launchers, "stage2_filtered", lambda *a, **k: pytest.fail("stage 2 too"))
        got = [tpsample.sample(h, w, seed=seed, return_logprobs=True, **kw) for kw in calls]
    monkeypatch.setattr(replay, "ENABLED", False)
    want = [tpsample.sample(h, w, seed=seed, return_logprobs=True, **kw) for kw in calls]
    for g, x in zip(got, want):
        for a, b in zip(g, x):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("logprobs", [False, True])
def test_chi2_device_fallback_on_gpu(logprobs):
    """Flat rows (no certificate for top-p): every row through the device fallback, exact
    against float64, tokens-only calls and calls with log-probs (each takes the winner check
    its own way); the same samples fail against a wrong kept set (negative control)."""
    from tpsample import api
    h, w = lm_head_case("flat", V=1000, dtype=torch.bfloat16, device="cuda", seed=6)
    rows = 40000
    api._PIPELINES.clear()
    tok = tpsample.sample(h.expand(rows, -1).contiguous(), w, temperature=1.0,
                          seed=torch.arange(rows, device="cuda") * 7919, top_p=0.6,
                          return_logprobs=logprobs)
    tok = (tok.tokens if logprobs else tok).view(-1)
    (pipe,) = api._PIPELINES.values()
    assert pipe.fallback_rows == rows
    logits = row_logits(h.float().cpu(), w.float().cpu(), 1.0)
    p = filtered_probs(logits, top_p=0.6)
    assert p[tok.cpu()].min() > 0
    assert chi2_pvalue(tok, p) > ALPHA
    assert chi2_pvalue(tok, filtered_probs(logits, top_p=0.7)) < ALPHA


def test_device_fallback_at_lm_head_shape_and_in_a_cuda_graph():
    """D = 4096, V = 151936, near-flat rows: the device fallback's tokens and top tokens equal
    the float64 reference's (fp32 near-ties aside), and a captured filtered call replays to
    the eager call's outputs."""
    from tpsample.reference import reference_sample
    B = 16
    h, w = typical_head(4096, 151936, B, torch.bfloat16, "cuda", slope=0.05)
    kw = dict(seed=torch.arange(B, device="cuda") * 11, top_p=0.9, top_k=torch.tensor(
        [0, 3000] * (B // 2), device="cuda"), min_p=0.5, top_logprobs=5)
    out = tpsample.sample(h, w, **kw)
    ref = reference_sample(h, w, **kw)
    assert (out.tokens == ref.tokens[:, 0]).float().mean() >= 0.9
    assert (out.top_tokens == ref.top_tokens).float().mean() >= 0.9
    static_h = h.clone()
    tpsample.sample(static_h, w, **kw)  # warm: compile and record outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tpsample.sample(static_h, w, **kw)
    static_h.copy_(h)
    graph.replay()
    eager = tpsample.sample(h, w, **kw)
    assert torch.equal(captured.tokens, eager.tokens)
    assert torch.equal(captured.top_tokens, eager.top_tokens)


@pytest.mark.parametrize("B,D", [(64, 4096), (200, 4096), (256, 4096)])
def test_ws_side_output_is_the_same_stored_along_rows_or_from_the_lanes(B, D, monkeypatch):
    """The ws kernel's side output (the transformed fp32 logits a filtered call's fallback
    reads) is bit-identical whether stored through shared memory along its rows
    (launchers.WS_SIDE_ROWS, with a pipeline stage less where its scratch needs it) or from
    the lanes' layout, records included, and within 1e-3 of cuBLAS's logits · (1 / T) (a
    greedy row: the raw logits); padding columns beyond V are -inf."""
    from tpsample.plan import DeviceKind, Layout, make_plan
    from tpsample.kernels import gluon_compat
    if not gluon_compat.AVAILABLE or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the ws kernel needs a Hopper GPU and a supported Triton")
    V = 151936 if D == 4096 else 128256
    h, w = typical_head(D, V, B, torch.bfloat16, "cuda")
    temp = 0.5 + torch.rand(B, generator=torch.Generator().manual_seed(B))
    temp[::7] = 0.0
    row = P.row_params(h, temp.cuda(), torch.arange(B, device="cuda"), 3)
    T = records.num_tiles(V)
    plan = make_plan(DeviceKind.of(h.device), B=B, D=D, V=V, dtype=h.dtype,
                     layout=Layout.of(h, w, 0, 0), candidates=True)
    assert plan.strategy == "ws", str(plan)
    got = {}
    for rows in (False, True):
        monkeypatch.setattr(launchers, "WS_SIDE_ROWS", rows)
        rec = torch.empty(records.planes(1, True), B, T, 4, device="cuda")
        side = torch.full((B, T * records.TILE), 7.0, device="cuda")
        launchers.stage1(plan, h, w, None, row, rec, n_real=V, side=side)
        got[rows] = (rec, side)
    assert torch.equal(got[False][1], got[True][1])
    assert torch.equal(got[False][0].nan_to_num(), got[True][0].nan_to_num())
    side = got[True][1]
    inv = torch.where(row.inv_temp == 0, 1.0, row.inv_temp)
    want = (h.float() @ w.float().T) * inv[:, None]
    assert (side[:, :V] - want).abs().max() <= 1e-3
    assert bool((side[:, V:] == float("-inf")).all())


def test_top_p_alone_on_heavy_tails_stays_on_the_device_fast_path():
    """top_p 0.9 alone on a heavy tail falls back on every row, always through the device
    (kernels/filter_cut.py; never the host path): tokens, log-probs and log Z equal the float64
    reference's (fp32 near-ties aside), eager and in a captured CUDA graph."""
    from tpsample import api
    from tpsample.reference import reference_sample
    B = 16
    h, w = typical_head(4096, 151936, B, torch.bfloat16, "cuda", slope=1.1)
    api._PIPELINES.clear()
    kw = dict(seed=torch.arange(B, device="cuda") * 5, top_p=torch.full((B,), 0.9, device="cuda"),
              min_p=torch.tensor([0.0, 0.01] * (B // 2), device="cuda"), return_logprobs=True)
    for step in range(4):
        out = tpsample.sample(h, w, **kw)
        torch.cuda.synchronize()
    (pipe,) = api._PIPELINES.values()
    assert not pipe.fallback.host_mode and pipe.host_fallback_rows == 0
    assert pipe.fallback_rows >= 4 * B // 2  # (min-p 0.01 may certify its rows)
    ref = reference_sample(h, w, **{k: v for k, v in kw.items() if k != "return_logprobs"})
    # tokens only: rows whose winner is kept skip the cut; the same token in every row
    only = tpsample.sample(h, w, **{k: v for k, v in kw.items() if k != "return_logprobs"})
    assert torch.equal(only.view(-1), out.tokens.view(-1))
    same = out.tokens == ref.tokens[:, 0]
    assert same.float().mean() >= 0.9
    assert torch.allclose(out.logz.double(), ref.logz, atol=2e-3)
    assert torch.allclose(out.logprobs.double()[same], ref.logprobs[:, 0][same], atol=2e-3)
    static_h = h.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tpsample.sample(static_h, w, **kw)
    graph.replay()
    assert torch.equal(captured.tokens, out.tokens)


def test_top_p_rows_of_a_call_with_a_per_row_top_k_stay_on_the_device():
    """A serving batch with a per-row top_k tensor (half its rows without a top-k): their
    flat top-p rows fall back on the cut's fast path in every call, and its count (the
    fallback's second) does not send the calls to the host path; tokens as the reference's."""
    from tpsample import api
    from tpsample.reference import reference_sample
    B = 16
    h, w = typical_head(4096, 151936, B, torch.bfloat16, "cuda", slope=1.1)
    api._PIPELINES.clear()
    k = torch.tensor([0, 20] * (B // 2), device="cuda")
    for step in range(24):  # (the count is read back every few calls)
        out = tpsample.sample(h, w, seed=step, top_p=0.9, top_k=k)
        torch.cuda.synchronize()
    (pipe,) = api._PIPELINES.values()
    assert not pipe.fallback.host_mode and pipe.host_fallback_rows == 0
    rows, cut_rows = pipe.fallback.device_rows.tolist()
    assert cut_rows >= 24 * B // 4 and rows == 0
    ref = reference_sample(h, w, seed=23, top_p=0.9, top_k=k).tokens[:, 0]
    assert (out == ref).float().mean() >= 0.9


def test_top_logprobs_of_heavy_tails_stay_on_the_device_fast_path():
    """top_p 0.9 with the top 5 log-probs (an API's logprobs) on a heavy tail: the flagged
    rows' top 5 are in the candidates, so the cut's fast path redoes them (FINAL turns the
    filter kernel's top 5 into log-probs), never the host path; the reference's outputs."""
    from tpsample import api
    from tpsample.reference import reference_sample
    B = 16
    h, w = typical_head(4096, 151936, B, torch.bfloat16, "cuda", slope=1.1)
    api._PIPELINES.clear()
    kw = dict(seed=torch.arange(B, device="cuda") * 3, top_p=0.9, top_logprobs=5)
    for step in range(24):
        out = tpsample.sample(h, w, **kw)
        torch.cuda.synchronize()
    (pipe,) = api._PIPELINES.values()
    assert not pipe.fallback.host_mode and pipe.host_fallback_rows == 0
    rows, cut_rows = pipe.fallback.device_rows.tolist()
    assert rows == 0 and cut_rows >= 24 * B // 2
    ref = reference_sample(h, w, **kw)
    assert torch.equal(out.top_tokens, ref.top_tokens)
    fin = torch.isfinite(ref.top_logprobs)
    assert torch.equal(fin, torch.isfinite(out.top_logprobs))
    assert torch.allclose(out.top_logprobs.double()[fin], ref.top_logprobs[fin], atol=2e-3)
    assert (out.tokens.view(-1) == ref.tokens[:, 0]).float().mean() >= 0.9


def test_rows_that_keep_falling_back_move_to_the_host_fallback_and_back():
    """top_k 3000 + top_p 0.9 on a heavy tail falls back on every row (k > the known prefix),
    through the one-program bisection kernel: once the device fallback's count is seen the
    pipeline takes the host fallback (from stage 1's logits + a sort), and returns to the
    device path after a call where no row fell back; tokens stay exact (reference)."""
    from tpsample import api
    from tpsample.reference import reference_sample
    B = 8
    h, w = typical_head(4096, 151936, B, torch.bfloat16, "cuda", slope=1.1)
    api._PIPELINES.clear()
    for step in range(6):
        out = tpsample.sample(h, w, seed=step, top_p=0.9, top_k=3000)
        torch.cuda.synchronize()
    (pipe,) = api._PIPELINES.values()
    assert pipe.fallback.host_mode and pipe.host_fallback_rows > 0
    ref = reference_sample(h, w, seed=5, top_p=0.9, top_k=3000).tokens[:, 0]
    assert (out == ref).float().mean() >= 0.75
    tpsample.sample(h, w, seed=1, top_k=20)  # certified: no fallback row
    assert not pipe.fallback.host_mode


@functools.lru_cache(maxsize=1)
def _sweep_head():
    from tpsample.launch.sweep import sweep_head
    return sweep_head(4096, 151936, torch.bfloat16, "cuda")


@pytest.mark.parametrize("head", ["gauss1", "zipf1.3", "zipf1.6", "mixed"])
@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_p=0.99), dict(min_p=0.02),
                                dict(top_k=50, top_p=0.95), dict(top_p=0.9, return_logprobs=True)],
                         ids=["p0.9", "p0.99", "m0.02", "k50p0.95", "p0.9+lp"])
def test_sweep_heads_at_lm_head_shape_equal_the_reference(head, kw):
    """The benchmark sweep's heads (tpsample.launch.sweep: flat Gaussian and Zipf 1.3 rows,
    whose top-p rows all take the exact fallback, the typical Zipf 1.6 and a mixed batch; 16
    distinct rows; top-p 0.99: nearly every row's winner kept by STATS' sums) at D = 4096,
    V = 151936: every row's token equals the float64 reference's on the same noise, log-probs
    and log Z within 2e-3. The kernels' fp32 logits differ from the reference's float64 ones
    by up to ~1e-4, so a row can differ only where two perturbed scores or a kept set's
    boundary lie that close: ~1e-4 a row (the gap between a row's two
    best Gumbel scores is about Exp(1)), ~0.2 % for the call."""
    from tpsample.launch.sweep import hidden
    from tpsample.reference import reference_sample
    w, U = _sweep_head()
    B = 16
    h = hidden(U, head, B, torch.bfloat16)
    seed = torch.arange(B, device="cuda") * 3 + 1
    kw = dict(kw)
    logprobs = kw.pop("return_logprobs", False)
    out = tpsample.sample(h, w, seed=seed, return_logprobs=logprobs, **kw)
    ref = reference_sample(h, w, seed=seed, **kw)
    tokens = out.tokens if logprobs else out
    assert torch.equal(tokens.view(-1).cpu(), ref.tokens[:, 0].cpu())
    if logprobs:
        assert torch.allclose(out.logz.double().cpu(), ref.logz.cpu(), atol=2e-3)
        assert torch.allclose(out.logprobs.view(-1).double().cpu(), ref.logprobs[:, 0].cpu(),
                              atol=2e-3)


@pytest.mark.parametrize("head,top_p", [("zipf1.3", 0.95), ("zipf1.6", 0.99)])
def test_winner_certificate_at_lm_head_shape(head, top_p):
    """Flat and typical sweep rows whose top-p kept set the candidates cannot certify
    (D = 4096, V = 151,936, 64 rows): a tokens-only call clears most of them by the winner
    certificate (the winner is a known token, so kept), so fewer rows take the exact fallback
    than in the call with log-probs, and every row's token is that call's."""
    from tpsample import api
    from tpsample.launch.sweep import hidden
    w, U = _sweep_head()
    B = 64
    h = hidden(U, head, B, torch.bfloat16)
    seed = torch.arange(B, device="cuda") * 3 + 1
    api._PIPELINES.clear()
    full = tpsample.sample(h, w, seed=seed, top_p=top_p, return_logprobs=True)
    (pipe,) = api._PIPELINES.values()
    flagged = pipe.fallback_rows
    only = tpsample.sample(h, w, seed=seed, top_p=top_p)
    left = pipe.fallback_rows - flagged
    assert torch.equal(only.view(-1), full.tokens.view(-1))
    assert flagged >= B // 2 and left <= flagged // 2, (flagged, left)
