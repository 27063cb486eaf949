"""API contract: shapes, dtypes, bad input, empty batches, degenerate rows."""
import pytest
import torch

import tpsample
from tpsample import SampleOutput

from cases import random_inputs


@pytest.fixture
def hw(device):
    return random_inputs(4, 32, 300, torch.float32, device)


def test_shapes_and_dtypes(hw):
    h, w = hw
    t = tpsample.sample(h, w, seed=1)
    assert t.shape == (4,) and t.dtype == torch.int64 and t.device == h.device
    out = tpsample.sample(h, w, seed=1, num_samples=3, return_logprobs=True)
    assert isinstance(out, SampleOutput)
    assert out.tokens.shape == (4, 3) and out.logprobs.shape == (4, 3) and out.logz.shape == (4,)
    assert out.logprobs.dtype == torch.float32 and out.logz.dtype == torch.float32
    assert (out.logprobs <= 0).all()


@pytest.mark.parametrize("num_samples", [1, 2])
def test_empty_batch(hw, num_samples):
    h, w = hw
    t = tpsample.sample(h[:0], w, num_samples=num_samples)
    assert t.shape == ((0,) if num_samples == 1 else (0, num_samples)) and t.dtype == torch.int64
    out = tpsample.sample(h[:0], w, return_logprobs=True)
    assert out.logz.shape == (0,)


BAD = [
    (lambda h, w: dict(hidden=h[0]), ValueError, "hidden"),
    (lambda h, w: dict(hidden=h.long()), TypeError, "hidden"),
    (lambda h, w: dict(weight=w[:, :16]), ValueError, "weight"),
    (lambda h, w: dict(weight=w.double()), TypeError, "weight"),
    (lambda h, w: dict(weight=w.half()), TypeError, "weight"),
    (lambda h, w: dict(weight=w.T.contiguous().T), ValueError, "weight"),
    (lambda h, w: dict(temperature=-1.0), ValueError, "temperature"),
    (lambda h, w: dict(temperature=float("nan")), ValueError, "temperature"),
    (lambda h, w: dict(temperature=float("inf")), ValueError, "temperature"),
    (lambda h, w: dict(temperature=torch.tensor([1.0, -0.5, 1.0, 1.0], device=h.device)), ValueError, "temperature"),
    (lambda h, w: dict(temperature=torch.tensor([1.0, float("nan"), 1.0, 1.0], device=h.device)), ValueError, "temperature"),
    (lambda h, w: dict(temperature=torch.ones(3, device=h.device)), ValueError, "temperature"),
    (lambda h, w: dict(temperature=torch.ones(4, dtype=torch.int64, device=h.device)), TypeError, "temperature"),
    (lambda h, w: dict(temperature="hot"), TypeError, "temperature"),
    (lambda h, w: dict(seed=torch.ones(4, dtype=torch.int32)), TypeError, "seed"),
    (lambda h, w: dict(seed=torch.ones(5, dtype=torch.int64)), ValueError, "seed"),
    (lambda h, w: dict(seed=1.5), TypeError, "seed"),
    (lambda h, w: dict(offset=torch.ones(4, dtype=torch.float32)), TypeError, "offset"),
    (lambda h, w: dict(offset=torch.ones(2, 2, dtype=torch.int64)), ValueError, "offset"),
    (lambda h, w: dict(bias=torch.zeros(299, device=h.device)), ValueError, "bias"),
    (lambda h, w: dict(bias=torch.zeros(300, dtype=torch.int64, device=h.device)), TypeError, "bias"),
    (lambda h, w: dict(vocab_size=0), ValueError, "vocab_size"),
    (lambda h, w: dict(vocab_size=301), ValueError, "vocab_size"),
    (lambda h, w: dict(vocab_size=2.5), ValueError, "vocab_size"),
    (lambda h, w: dict(num_samples=0), ValueError, "num_samples"),
    (lambda h, w: dict(num_samples=1 << 29), ValueError, "num_samples"),
    (lambda h, w: dict(merge="sum"), ValueError, "merge"),
    (lambda h, w: dict(backend="cuda"), ValueError, "backend"),
    (lambda h, w: dict(out=torch.empty(3, dtype=torch.int64, device=h.device)), ValueError, "out"),
    (lambda h, w: dict(out=torch.empty(4, 1, dtype=torch.int64, device=h.device)), ValueError, "out"),
    (lambda h, w: dict(out=torch.empty(4, dtype=torch.int32, device=h.device)), TypeError, "out"),
    (lambda h, w: dict(out=torch.empty(4, 2, dtype=torch.int64, device=h.device)[:, 0]), ValueError,
     "out"),
    (lambda h, w: dict(out=[0, 0, 0, 0]), TypeError, "out"),
]


@pytest.mark.parametrize("make,exc,name", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_names_the_argument(hw, make, exc, name):
    h, w = hw
    kw = dict(hidden=h, weight=w)
    kw.update(make(h, w))
    hidden, weight = kw.pop("hidden"), kw.pop("weight")
    with pytest.raises(exc, match=name):
        tpsample.sample(hidden, weight, **kw)


def test_device_mismatch_is_an_error():
    if not torch.cuda.is_available():
        h, w = random_inputs(2, 8, 20)
        with pytest.raises(ValueError, match="bias"):
            tpsample.sample(h, w, bias=torch.zeros(20, device="meta"))
        return
    h, w = random_inputs(2, 8, 20, device="cuda")
    with pytest.raises(ValueError, match="weight"):
        tpsample.sample(h, w.cpu())


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("merge", ["max", "logmass", "cdf"])
def test_degenerate_rows(backend, merge, device):
    """All -inf → token -1, logz -inf; any NaN → token -1, logz NaN; normal rows unaffected;
    the same in filtered calls (their top tokens -1 too)."""
    h, w = random_inputs(4, 16, 300, torch.float32, device)
    h = h.clone()
    h[1, 3] = float("nan")
    bias = torch.zeros(300, device=device)
    ok = tpsample.sample(h, w, bias=bias, seed=3, merge=merge, return_logprobs=True, backend=backend)
    assert torch.isnan(ok.logz[1]) and ok.tokens[1] == -1 and torch.isnan(ok.logprobs[1])
    assert (ok.tokens[[0, 2, 3]] >= 0).all()
    assert torch.isfinite(ok.logz[[0, 2, 3]]).all() and torch.isfinite(ok.logprobs[[0, 2, 3]]).all()
    dead = tpsample.sample(h, w, bias=torch.full((300,), float("-inf"), device=device), seed=3,
                           merge=merge, return_logprobs=True, backend=backend)
    assert (dead.tokens == -1).all()
    assert dead.logz[0] == float("-inf") and torch.isnan(dead.logprobs).all()
    if merge == "max":
        f = tpsample.sample(h, w, bias=bias, seed=3, top_p=0.9, top_logprobs=2,
                            return_logprobs=True, backend=backend)
        assert f.tokens[1] == -1 and torch.isnan(f.logz[1]) and (f.top_tokens[1] == -1).all()
        assert (f.tokens[[0, 2, 3]] >= 0).all() and (f.top_tokens[[0, 2, 3]] >= 0).all()


def test_greedy_rows_mixed_with_sampled_rows(device):
    h, w = random_inputs(6, 32, 500, torch.float32, device, seed=2)
    temp = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 0.5], device=device)
    out = tpsample.sample(h, w, temperature=temp, num_samples=3, return_logprobs=True)
    l = (h.double() @ w.double().T).cpu()
    greedy = (temp == 0).cpu()
    t = temp.cpu().double()
    l = l / torch.where(greedy, torch.ones_like(t), t)[:, None]  # greedy rows: T = 1 logprobs
    assert (out.tokens.cpu()[greedy] == l[greedy].argmax(-1, keepdim=True)).all()
    want = torch.log_softmax(l, -1).gather(1, out.tokens.cpu())
    assert torch.allclose(out.logprobs.cpu().double(), want, atol=1e-4)
    # sampled rows are not stuck on the argmax across 3 samples × 3 rows (p of that ~ 0)
    assert not (out.tokens.cpu()[~greedy] == l[~greedy].argmax(-1, keepdim=True)).all()




@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("num_samples,logprobs", [(1, False), (2, True),
                                                   pytest.param(1, True, marks=pytest.mark.slow)])
def test_out_receives_the_tokens_and_is_returned(hw, backend, num_samples, logprobs):
    """out=: the call's tokens written into the given tensor, which is returned in their
    place (the SampleOutput's tokens with log-probs); the tokens, log-probs and log Z are
    those of the call without out. An out that is not 16-byte aligned (a view one element
    in) gets them too."""
    h, w = hw
    kw = dict(seed=torch.arange(4) * 7 + 1, offset=3, backend=backend, top_k=20,
              num_samples=num_samples, return_logprobs=logprobs)
    ref = tpsample.sample(h, w, **kw)
    shape = (4,) if num_samples == 1 else (4, num_samples)
    for out in (torch.full(shape, -7, dtype=torch.int64, device=h.device),
                torch.full((1 + 4 * num_samples,), -7, dtype=torch.int64,
                           device=h.device)[1:].view(shape)):
        got = tpsample.sample(h, w, out=out, **kw)
        if logprobs:
            assert got.tokens is out and torch.equal(out, ref.tokens)
            assert torch.equal(got.logprobs, ref.logprobs) and torch.equal(got.logz, ref.logz)
        else:
            assert got is out and torch.equal(out, ref)
    empty = torch.empty((0,) + shape[1:], dtype=torch.int64, device=h.device)
    assert tpsample.sample(h[:0], w, out=empty, num_samples=num_samples) is empty


def test_sample_and_the_tp_sampler_take_the_same_arguments():
    """Every argument of sample() but weight is one of VocabParallelSampler's (per call, or
    per sampler: vocab_size, merge, backend), the per-call ones with the same default; the
    sampler's call takes nothing sample() does not. (vocab_size is required per sampler: a
    shard does not tell the vocabulary's size.)"""
    import inspect
    sample = inspect.signature(tpsample.sample).parameters
    call = inspect.signature(tpsample.VocabParallelSampler.__call__).parameters
    init = inspect.signature(tpsample.VocabParallelSampler.__init__).parameters
    assert set(call) - {"self"} <= set(sample)
    for name, p in sample.items():
        if name == "weight":
            continue
        assert name in call or name in init, f"VocabParallelSampler does not take {name}"
        if name in call:
            assert call[name].default == p.default, (name, call[name].default, p.default)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_per_row_tensors_in_any_layout(backend):
    """Strided seed / offset / temperature tensors (views of wider ones) give the tokens of
    their contiguous copies: the kernels read one value per row."""
    h, w = random_inputs(B=4, D=16, V=200, seed=3)
    wide = torch.arange(8).view(4, 2) * 1000 + 11
    temps = torch.tensor([[0.7, 9.0], [1.0, 9.0], [1.3, 9.0], [0.0, 9.0]])
    kw = dict(backend=backend, return_logprobs=True)
    a = tpsample.sample(h, w, seed=wide[:, 0], offset=wide[:, 1], temperature=temps[:, 0], **kw)
    b = tpsample.sample(h, w, seed=wide[:, 0].contiguous(), offset=wide[:, 1].contiguous(),
                        temperature=temps[:, 0].contiguous(), **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
