"""Constrained decoding (tpsample/constraints.py): the allowed-token mask, listed logit
adjustments, the repetition penalty, and their combination with filters and greedy rows.

Exactness: chi-squared against float64 probabilities built here in numpy from the definition
(independent of tpsample's code), with negative controls the same test must reject;
pathwise: tokens of the torch path and of the interpreted kernels equal the full-row
reference; TP with gloo on shards that do not start at multiples of 32; bad inputs.
"""
import numpy as np
import pytest
import torch

import tpsample
from tpsample import constraints as C
from tpsample.api import _pipeline
from tpsample.reference import reference_sample

from cases import lm_head_case, random_inputs
from dist_utils import run_world
from stats import ALPHA, chi2_pvalue


# ----- the definition in numpy float64 (what the chi-squared tests compare against) -------
def pack(allowed: np.ndarray) -> torch.Tensor:
    """bool [B, V] → int32 [B, ceil(V / 32)], bit j of word i = token 32 i + j."""
    B, V = allowed.shape
    W = -(-V // 32)
    bits = np.zeros((B, W * 32), dtype=np.uint64)
    bits[:, :V] = allowed
    words = (bits.reshape(B, W, 32) << np.arange(32, dtype=np.uint64)).sum(-1)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def constrained_probs(logits, allowed=None, ids=(), values=(), penalty=1.0, temperature=1.0,
                      top_k=0, *, penalty_on_negative=True):
    """float64 probabilities [V] of one row; penalty_on_negative=False builds the negative
    control that divides every listed logit by the penalty."""
    x = np.array(logits, dtype=np.float64)
    listed = np.zeros(x.size, bool)
    add = np.zeros(x.size)
    for i, v in zip(ids, values):
        if i >= 0:
            listed[i] = True
            add[i] += v
    if penalty != 1.0:
        pen = np.where(x > 0, x / penalty, x * penalty) if penalty_on_negative else x / penalty
        x = np.where(listed, pen, x)
    x = np.where(listed, x + add, x)
    if allowed is not None:
        x = np.where(allowed, x, -np.inf)
    x = x / temperature
    if top_k:
        cut = np.sort(x)[::-1][top_k - 1]
        x = np.where(x >= cut, x, -np.inf)
    p = np.exp(x - x.max())
    return torch.from_numpy(p / p.sum())


def draw(h, w, rows, backend="torch", **kw):
    return tpsample.sample(h.expand(rows, -1).contiguous(), w, seed=torch.arange(rows),
                           backend=backend, **kw)


def logits_of(h, w):
    return (h.double() @ w.double().T).numpy()


V = 600


def case():
    h, w = lm_head_case("zipf", V, seed=5)
    return h, w, logits_of(h, w)


def masks():
    g = np.random.default_rng(0)
    return {
        "one": np.arange(V) == 17,
        "half": g.random(V) < 0.5,
        "range": (np.arange(V) >= 40) & (np.arange(V) < 300),
    }


# ----- exactness: chi-squared, torch path ---------------------------------------------------
@pytest.mark.parametrize("name", ["half", "range"])
def test_chi2_mask(name):
    h, w, l = case()
    allowed = masks()[name]
    rows = 4000
    tok = draw(h, w, rows, allowed_mask=pack(allowed[None]).expand(rows, -1).contiguous())
    p = constrained_probs(l, allowed)
    assert p[tok].min() > 0, "a disallowed token"
    assert chi2_pvalue(tok, p) > ALPHA
    # negative control: the unmasked distribution renormalised over the allowed set is right,
    # the unmasked one is not
    assert chi2_pvalue(tok, constrained_probs(l).clamp(min=1e-12)) < ALPHA


def test_mask_allowing_one_token_and_nothing():
    h, w, _ = case()
    one = pack(masks()["one"][None]).expand(64, -1).contiguous()
    out = draw(h, w, 64, allowed_mask=one, return_logprobs=True)
    assert (out.tokens == 17).all() and torch.allclose(out.logprobs, torch.zeros(64), atol=1e-6)
    none = torch.zeros(4, -(-V // 32), dtype=torch.int32)
    for backend in ("torch", "triton"):
        out = draw(h, w, 4, backend, allowed_mask=none, return_logprobs=True)
        assert (out.tokens == -1).all() and (out.logz == float("-inf")).all()  # degenerate rows


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fewer_allowed_tokens_than_samples_without_replacement(backend):
    """Two allowed tokens, four samples without replacement: both allowed ids, then -1 with
    log-prob -inf (never a forbidden id), on every backend."""
    h, w = random_inputs(3, 8, 64, seed=0)
    mask = torch.zeros(3, 2, dtype=torch.int32)
    mask[:, 1] = (1 << 0) | (1 << 2)  # ids 32 and 34
    out = tpsample.sample(h, w, seed=1, num_samples=4, replacement=False, allowed_mask=mask,
                          backend=backend, return_logprobs=True)
    assert (out.tokens[:, 2:] == -1).all() and torch.isinf(out.logprobs[:, 2:]).all()
    assert (out.tokens[:, :2].sort(-1).values == torch.tensor([32, 34])).all()


def test_chi2_adjustments_promote_and_demote():
    """The top token pushed below the rest, a low one promoted to near the top."""
    h, w, l = case()
    top, low = int(np.argmax(l)), int(np.argsort(l)[V // 2])
    ids = torch.tensor([[top, low, -1]])
    values = torch.tensor([[-30.0, float(l.max() - l[low] - 0.5), 0.0]])
    rows = 4000
    tok = draw(h, w, rows, logit_adjust=(ids.expand(rows, -1), values.expand(rows, -1)))
    p = constrained_probs(l, ids=[top, low], values=values[0, :2].tolist())
    assert p[low] > 0.1 and p[top] < 1e-9
    assert chi2_pvalue(tok, p) > ALPHA
    assert chi2_pvalue(tok, constrained_probs(l).clamp(min=1e-12)) < ALPHA  # control


def test_chi2_repetition_penalty_on_positive_and_negative_logits():
    h, w, l = case()
    order = np.argsort(l)[::-1]
    ids = torch.tensor([list(order[:6]) + [int(i) for i in np.where(l < -0.5)[0][:6]]])
    assert (l[ids[0, :6]] > 0).all() and (l[ids[0, 6:]] < 0).all()
    rows = 6000
    kw = dict(logit_adjust=(ids.expand(rows, -1), torch.zeros(rows, ids.shape[1])),
              repetition_penalty=2.0)
    tok = draw(h, w, rows, **kw)
    right = constrained_probs(l, ids=ids[0].tolist(), values=[0.0] * 12, penalty=2.0)
    near = constrained_probs(l, ids=ids[0].tolist(), values=[0.0] * 12, penalty=2.0,
                             penalty_on_negative=False)
    assert chi2_pvalue(tok, right) > ALPHA
    assert chi2_pvalue(tok, near) < ALPHA  # control: l / r on negative logits too


@pytest.mark.parametrize("merge", ["logmass", "cdf"])
def test_chi2_group_merges_with_listed_tokens(merge):
    """The listed tokens form one more group (the extra tile): the group merges stay exact."""
    h, w, l = case()
    allowed = masks()["half"]
    top = int(np.argmax(np.where(allowed, l, -np.inf)))
    ids = torch.tensor([[top, 3, 3, 250]])
    values = torch.tensor([[-1.0, 1.5, 0.5, 2.0]])
    rows = 4000
    tok = draw(h, w, rows, merge=merge, allowed_mask=pack(allowed[None]).expand(rows, -1),
               logit_adjust=(ids.expand(rows, -1), values.expand(rows, -1)),
               repetition_penalty=1.2)
    p = constrained_probs(l, allowed, ids=ids[0].tolist(), values=values[0].tolist(),
                          penalty=1.2)
    assert chi2_pvalue(tok, p) > ALPHA


def test_chi2_combined_with_top_k_and_temperature():
    h, w, l = case()
    allowed = masks()["half"]
    low = int(np.argsort(np.where(allowed, l, np.inf))[10])
    ids = torch.tensor([[low, -1]])
    values = torch.tensor([[4.0, 0.0]])
    rows = 4000
    tok = draw(h, w, rows, temperature=0.8, top_k=15,
               allowed_mask=pack(allowed[None]).expand(rows, -1),
               logit_adjust=(ids.expand(rows, -1), values.expand(rows, -1)))
    p = constrained_probs(l, allowed, ids=[low], values=[4.0], temperature=0.8, top_k=15)
    assert p[tok].min() > 0
    assert chi2_pvalue(tok, p) > ALPHA


# ----- pathwise: the torch path and the kernels equal the reference -----------------------
def mixed(device="cpu"):
    """8 rows over V = 1000 (not a multiple of 128 or 32), a random mask per row (row 6
    allows nothing), listed tokens with duplicates, padding and masked ids, penalties,
    filters on some rows and two greedy rows."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(8, 16, generator=g) * 2.0
    w = torch.randn(1000, 16, generator=g)
    allowed = torch.rand(8, 1000, generator=g) < 0.6
    allowed[6] = False
    ids = torch.randint(0, 1000, (8, 12), generator=g)
    ids[:, 10:] = -1
    ids[1, 3] = ids[1, 2]  # a repeated id: values add, the penalty applies once
    values = torch.randn(8, 12, generator=g) * 2
    values[0, 0] = float("-inf")  # a ban
    kw = dict(allowed_mask=pack(allowed.numpy()), logit_adjust=(ids, values),
              repetition_penalty=torch.tensor([1.0, 1.3, 2.0, 1.1, 1.0, 1.5, 1.2, 1.0]),
              temperature=torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.0, 0.9, 1.1]),
              seed=torch.arange(8) * 7)
    to = (lambda v: v.to(device) if isinstance(v, torch.Tensor) else
          tuple(t.to(device) for t in v) if isinstance(v, tuple) else v)
    return h.to(device), w.to(device), {k: to(v) for k, v in kw.items()}


KINDS = [dict(), dict(num_samples=3), dict(top_k=torch.tensor([0, 5, 3, 0, 20, 0, 2, 4]),
                                           top_p=0.9, top_logprobs=3),
         dict(num_samples=2, replacement=False, top_logprobs=2),
         dict(min_p=0.1, logprobs_mode="raw", top_logprobs=2)]
KIND_IDS = ["plain", "samples", "filters", "distinct", "raw"]


def assert_same(out, ref, top: bool):
    tokens = out.tokens if out.tokens.ndim == 2 else out.tokens[:, None]
    lp = out.logprobs if out.logprobs.ndim == 2 else out.logprobs[:, None]
    ok = torch.isfinite(ref.logz)
    assert torch.equal(tokens[ok], ref.tokens[ok])
    assert torch.allclose(lp[ok].double(), ref.logprobs[ok], atol=1e-4)
    assert torch.allclose(out.logz[ok].double(), ref.logz[ok], atol=1e-4)
    assert torch.equal(torch.isfinite(out.logz), ok)
    if top:
        assert torch.equal(out.top_tokens[ok], ref.top_tokens[ok])


@pytest.mark.parametrize("extra", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_matches_reference_pathwise(backend, extra):
    h, w, kw = mixed()
    out = tpsample.sample(h, w, backend=backend, return_logprobs=True, **kw, **extra)
    ref = reference_sample(h, w, **kw, **extra)
    assert_same(out, ref, "top_logprobs" in extra)


@pytest.mark.slow
def test_device_fallback_with_constraints():
    """Near-flat rows with top-p: the interpreted device fallback recomputes them with the
    mask and the listed tokens (listed_fallback_kernel), equal to the reference."""
    h, w, kw = mixed()
    h *= 0.05
    pipe = _pipeline("triton", h.device)
    before = pipe.fallback_rows
    out = tpsample.sample(h, w, backend="triton", return_logprobs=True, top_p=0.7,
                          top_logprobs=2, **kw)
    assert pipe.fallback_rows - before >= 3
    assert_same(out, reference_sample(h, w, top_p=0.7, top_logprobs=2, **kw), True)


@pytest.mark.parametrize("merge", ["logmass", "cdf"])
def test_group_merges_kernels_equal_torch(merge):
    h, w, kw = mixed()
    a = tpsample.sample(h, w, backend="torch", merge=merge, num_samples=2, **kw)
    b = tpsample.sample(h, w, backend="triton", merge=merge, num_samples=2, **kw)
    assert torch.equal(a, b)


def test_repeated_ids_add_their_values():
    h, w, _ = case()
    h = h.expand(6, -1).contiguous()
    ids, values = torch.tensor([[5, 5, 9]] * 6), torch.tensor([[1.0, 2.0, 0.5]] * 6)
    once = (torch.tensor([[5, 9, -1]] * 6), torch.tensor([[3.0, 0.5, 0.0]] * 6))
    for backend in ("torch", "triton"):
        a = tpsample.sample(h, w, seed=torch.arange(6), backend=backend, return_logprobs=True,
                            logit_adjust=(ids, values), repetition_penalty=1.5)
        b = tpsample.sample(h, w, seed=torch.arange(6), backend=backend, return_logprobs=True,
                            logit_adjust=once, repetition_penalty=1.5)
        assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.logz, b.logz, atol=1e-5)


def test_constraints_that_change_nothing():
    """An all-ones mask and zero adjustments give the unconstrained tokens (merge max)."""
    h, w, kw = mixed()
    for backend in ("torch", "triton"):
        plain = tpsample.sample(h, w, seed=kw["seed"], backend=backend)
        same = tpsample.sample(h, w, seed=kw["seed"], backend=backend,
                               allowed_mask=torch.full((8, 32), -1, dtype=torch.int32),
                               logit_adjust=(kw["logit_adjust"][0], torch.zeros(8, 12)))
        assert torch.equal(plain, same)


# ----- TP (gloo): shards that do not start at multiples of 32 ------------------------------
def tp_constrained(rank, world, extra):
    h, w, kw = mixed()
    V = w.shape[0]
    cuts = [0, 333, 678, V][: world] + [V]
    lo, hi = cuts[rank], cuts[rank + 1]
    sampler = tpsample.VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=V - 3,
                                            backend="torch")
    return sampler(h, return_logprobs=True, **kw, **extra)


@pytest.mark.parametrize("world,extra", [pytest.param(3, dict(), marks=pytest.mark.slow),
                                         (2, dict(top_k=4, top_logprobs=2))],
                         ids=["tp3", "tp2-filtered"])
def test_tp_equals_single_device(world, extra):
    outs = run_world(world, tp_constrained, extra)
    for o in outs:
        assert not isinstance(o, dict), o
        assert torch.equal(o.tokens, outs[0].tokens)
    h, w, kw = mixed()
    single = tpsample.sample(h, w, vocab_size=w.shape[0] - 3, backend="torch",
                             return_logprobs=True, **kw, **extra)
    ok = torch.isfinite(single.logz)
    assert torch.equal(outs[0].tokens[ok], single.tokens[ok])
    assert torch.allclose(outs[0].logz[ok], single.logz[ok], atol=1e-5)


# ----- the helper -----------------------------------------------------------------------------
def test_penalty_adjustments_from_a_history():
    hist = torch.tensor([[5, 3, 5, 5, -1, 9], [-1, -1, -1, -1, -1, -1], [2, 2, 2, 2, 2, 2]])
    ids, values = tpsample.penalty_adjustments(hist, presence_penalty=0.5,
                                               frequency_penalty=torch.tensor([0.1, 0.2, 1.0]))
    got = [{int(i): float(v) for i, v in zip(r, vr) if i >= 0} for r, vr in zip(ids, values)]
    assert got[0] == pytest.approx({3: -0.6, 5: -0.8, 9: -0.6})
    assert got[1] == {} and got[2] == pytest.approx({2: -6.5})
    assert (values[ids < 0] == 0).all()
    bias_ids, bias_vals = torch.tensor([[7], [7], [2]]), torch.tensor([[1.0], [2.0], [3.0]])
    ids, values = tpsample.penalty_adjustments(hist, 0.5, 0.0, logit_bias=(bias_ids, bias_vals))
    assert ids.shape == (3, 7) and ids[2, -1] == 2 and values[2, -1] == 3.0


# ----- bad inputs ------------------------------------------------------------------------------
def bad_cases():
    W = -(-300 // 32)
    ids = torch.zeros(4, 3, dtype=torch.int64)
    vals = torch.zeros(4, 3)
    return [
        (dict(allowed_mask=torch.zeros(4, W + 1, dtype=torch.int32)), ValueError, "allowed_mask"),
        (dict(allowed_mask=torch.zeros(4, W, dtype=torch.int64)), TypeError, "allowed_mask"),
        (dict(allowed_mask=torch.zeros(3, W, dtype=torch.int32)), ValueError, "allowed_mask"),
        (dict(allowed_mask=[1, 2]), TypeError, "allowed_mask"),
        (dict(logit_adjust=ids), TypeError, "logit_adjust"),
        (dict(logit_adjust=(ids.int(), vals)), TypeError, "ids"),
        (dict(logit_adjust=(ids + 300, vals)), ValueError, "ids"),
        (dict(logit_adjust=(ids - 2, vals)), ValueError, "ids"),
        (dict(logit_adjust=(ids, vals[:, :2])), ValueError, "values"),
        (dict(logit_adjust=(ids, vals + float("nan"))), ValueError, "values"),
        (dict(logit_adjust=(ids, vals + float("inf"))), ValueError, "values"),
        (dict(logit_adjust=(torch.zeros(4, 257, dtype=torch.int64), torch.zeros(4, 257))),
         ValueError, "K <= 256"),
        (dict(logit_adjust=(ids, vals), repetition_penalty=0.9), ValueError, "repetition_penalty"),
        (dict(logit_adjust=(ids, vals), repetition_penalty=torch.tensor([1.0, 2, 0.5, 1])),
         ValueError, "repetition_penalty"),
        (dict(repetition_penalty=1.2), ValueError, "logit_adjust"),
        (dict(logit_adjust=(ids, vals), repetition_penalty="2"), TypeError, "repetition_penalty"),
    ]


@pytest.mark.parametrize("i", range(16))
def test_bad_inputs_name_the_argument(i):
    kw, exc, name = bad_cases()[i]
    h, w = random_inputs(4, 8, 300)
    with pytest.raises(exc, match=name):
        tpsample.sample(h, w, backend="torch", **kw)


def test_padded_vocabulary_mask_widths():
    """Both ceil(vocab_size / 32) and ceil(rows / 32) words are accepted."""
    h, w = random_inputs(4, 8, 300)
    for W in (-(-250 // 32), -(-300 // 32)):
        tok = tpsample.sample(h, w, vocab_size=250, backend="torch", seed=1,
                              allowed_mask=torch.full((4, W), -1, dtype=torch.int32))
        assert (tok < 250).all()


# ----- the interpreted kernels: exactness (long) ---------------------------------------------
@pytest.mark.slow
def test_chi2_interpreted_kernels():
    h, w, l = case()
    allowed = masks()["half"]
    low = int(np.argsort(np.where(allowed, l, np.inf))[5])
    ids = torch.tensor([[low, int(np.argmax(l)), -1]])
    values = torch.tensor([[5.0, -2.0, 0.0]])
    rows = 2000
    tok = draw(h, w, rows, "triton", allowed_mask=pack(allowed[None]).expand(rows, -1),
               logit_adjust=(ids.expand(rows, -1), values.expand(rows, -1)),
               repetition_penalty=1.4)
    p = constrained_probs(l, allowed, ids=ids[0, :2].tolist(), values=values[0, :2].tolist(),
                          penalty=1.4)
    assert p[tok].min() > 0
    assert chi2_pvalue(tok, p) > ALPHA
    near = constrained_probs(l, allowed, ids=ids[0, :2].tolist(), values=values[0, :2].tolist())
    assert chi2_pvalue(tok, near.clamp(min=1e-12)) < ALPHA  # control: without the penalty


def test_plan_routes_masked_calls_to_a_mask_epilogue():
    """On Hopper the ping-pong kernel has no mask epilogue: a constrained call takes ws (its
    mask epilogue), merge "cdf" the records pass; explain says why."""
    plain = tpsample.explain(256, 4096, 151936, device="h100")
    if plain.strategy != "pp":
        pytest.skip(f"this Triton gives no pp plan: {plain.fallbacks}")
    masked = tpsample.explain(256, 4096, 151936, device="h100", constrained=True)
    assert masked.strategy == "ws" and "mask" in str(masked)
    cdf = tpsample.explain(256, 4096, 151936, device="h100", constrained=True, merge="cdf")
    assert cdf.strategy == "logits"


def test_tile_pass_keeps_the_first_listed_token_of_each_word():
    """The listed tokens' logits: a word's first listed token (the smallest listed id in its
    32-token word over every rank's range) is kept by the tile pass (its bit in `first`);
    the others get their own dot products (listed_prep_kernel), the first ones none. Checked
    on the slot [70, 170) of a 200-token head (it starts inside word 2) against the
    definition, interpreted."""
    from tpsample import launchers
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(3, 16, generator=g), torch.randn(100, 16, generator=g)
    ids = torch.tensor([[75, 80, 80, 130, -1, -1],     # 75 first of word 2; 80 twice, after it
                        [66, 72, 96, 100, 101, 20],    # 66 (another slot) is first of word 2
                        [95, 96, 169, 170, 160, -1]])  # 170: beyond the slot; 160 first of 5
    c = C.Constraints(None, ids, torch.zeros(3, 6), None)
    start, n_real, words = 70, 100, 7
    scratch = launchers.listed_scratch(h, c, words)
    launchers.listed_prep(h, w, c, scratch, n_real=n_real, vocab_start=start)
    for b in range(3):
        listed = [int(i) for i in ids[b] if i >= 0]
        mine = [i for i in listed if start <= i < start + n_real]
        firsts = {i for i in mine if not any(j >> 5 == i >> 5 and j < i for j in listed)}
        eff = np.full(words * 32, True)
        eff[mine] = False
        first = np.zeros(words * 32, bool)
        first[list(firsts)] = True
        bits = lambda t: ((t[b].numpy()[:, None] >> np.arange(32)) & 1).astype(bool).reshape(-1)
        assert (bits(scratch.eff) == eff).all() and (bits(scratch.first) == first).all(), b
        dots = scratch.dots[b].sum(0)[:6]
        for k, i in enumerate(ids[b].tolist()):
            want = float(h[b] @ w[i - start]) if i in mine and i not in firsts else 0.0
            assert abs(float(dots[k]) - want) < 1e-4, (b, k, i)
    assert scratch.first[0, 2] == 1 << (75 - 64) and scratch.first[1, 2] == 0
    assert scratch.first[2, 5] == 1 << (160 - 160)


@pytest.mark.parametrize("B,strategy", [(1, "fused"), (64, "ws"), (256, "logits")])
def test_only_a_stage1_that_waits_for_prep_is_its_dependent_launch(B, strategy, monkeypatch):
    """On Hopper a call with listed tokens launches listed_prep_kernel (stream-ordered, so after
    everything before it) and then stage 1. Stage 1 may be a programmatic dependent launch
    (running before prep's planes are written) only if it waits for them before its epilogue
    (AFTER_PREP): the fused kernel does; ws (docs/design.md) and the records pass (cuBLAS is
    between) are stream-ordered. The launches of tpsample.launchers, intercepted on CPU
    tensors with the H100 table's plans."""
    from tpsample import constrained_stage1, launchers, replay
    from tpsample.params import RowParams
    from tpsample.plan import DeviceKind, make_plan
    D, V = 4096, 151936
    h100 = DeviceKind.named("h100")
    if h100.gluon_missing and strategy == "ws":
        pytest.skip(f"no ws kernel with this Triton: {h100.gluon_missing}")
    plan = make_plan(h100, B=B, D=D, V=V, dtype=torch.bfloat16,
                     masked=True, merge="cdf" if strategy == "logits" else "max")
    assert plan.strategy == strategy and plan.pdl
    launched = []
    def spy(fn, grid, args, constexprs, options):
        launched.append((getattr(fn, "fn", fn).__name__, constexprs, options))
    monkeypatch.setattr(replay, "run_kernel", spy)  # (every launch: run_named calls it)
    monkeypatch.setattr(launchers, "run_step", lambda fn, args: torch.empty(B, V))
    monkeypatch.setattr(launchers, "_num_sms", lambda device: 132)
    h, w = torch.empty(B, D, dtype=torch.bfloat16), torch.empty(V, D, dtype=torch.bfloat16)
    c = C.Constraints(None, torch.zeros(B, 8, dtype=torch.int64), torch.zeros(B, 8), None)
    per_call = constrained_stage1.constraint_tensors(c, h, -(-V // 32))
    T = -(-V // 128)
    out = torch.empty(1, B, T + 1, 4)
    seed = torch.zeros(B, dtype=torch.int64)
    constrained_stage1.stage1_constrained(plan, h, w, None, RowParams(torch.ones(B), seed, seed),
                                          out, per_call, c, n_real=V, vocab_start=0, fanout=None)
    names = [n for n, _, _ in launched]
    assert names[0] == "listed_prep_kernel" and names[-1] == "listed_records_kernel", names
    assert not launched[0][2].get("launch_pdl"), "prep must wait for the work before it"
    assert launched[0][1]["PDL"]  # it lets a dependent start early
    _, consts, options = launched[1]
    assert bool(options.get("launch_pdl")) == bool(consts.get("AFTER_PREP")), names[1]
    assert bool(consts.get("AFTER_PREP")) == (strategy == "fused"), names[1]
    assert launched[-1][2].get("launch_pdl") and launched[-1][1]["PDL"]
