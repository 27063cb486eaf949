"""Argument checks and per-row parameters shared by every entry point (tpsample/params.py)."""
import pytest
import torch

import tpsample
from tpsample import params as P
from tpsample.reference import reference_sample

from cases import random_inputs


def test_temperature_limits_are_the_limits():
    """T -> 0+ is greedy, T -> inf is uniform over the real vocabulary; neither becomes a
    degenerate row or the greedy marker by float32 under/overflow."""
    h, w = random_inputs(4, 16, 300)
    argmax = (h @ w.T).argmax(-1)
    tiny = torch.tensor([1e-40, 1e-30, 2.0 ** -65, 1e-300], dtype=torch.float64)
    out = tpsample.sample(h, w, temperature=tiny, seed=1, return_logprobs=True)
    assert torch.equal(out.tokens, argmax) and torch.isfinite(out.logz).all()
    for t in (1e-45, 1e-300):  # python floats below T_MIN: greedy too
        assert torch.equal(tpsample.sample(h, w, temperature=t, seed=1), argmax)
    hh = h[:1].expand(3000, -1).contiguous()
    for t in (1e300, torch.full((3000,), 1e300, dtype=torch.float64), torch.full((3000,), 3e38)):
        out = tpsample.sample(hh, w, temperature=t, seed=torch.arange(3000), return_logprobs=True,
                              backend="torch")
        counts = torch.bincount(out.tokens, minlength=300).double()
        assert counts.max() < 30  # uniform: 10 per token expected, the row's argmax not favoured
        assert torch.allclose(out.logprobs, torch.full_like(out.logprobs, -torch.log(torch.tensor(300.0))),
                              atol=1e-6)
    inv = P.row_params(h, torch.tensor([0.0, 1e-40, 0.5, 1e30]), 0, 0).inv_temp
    assert inv[0] == 0 and inv[1] == 0 and inv[2] == 2.0 and inv[3] == pytest.approx(1e-30)


def test_invalid_temperature_rows_under_capture_are_nan():
    """Without the host check (as under CUDA-graph capture) invalid rows get a NaN 1/T."""
    t = torch.tensor([-1.0, float("nan"), float("inf"), 1.0])
    valid = torch.isfinite(t) & (t >= 0)
    inv = torch.where(valid, torch.where(t >= P.T_MIN, 1.0 / t.clamp(max=P.T_MAX), 0.0), float("nan"))
    assert torch.isnan(inv[:3]).all() and inv[3] == 1.0


REF_BAD = [
    (dict(merge="bogus"), ValueError, "merge"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(vocab_size=0), ValueError, "vocab_size"),
    (dict(num_samples=0), ValueError, "num_samples"),
    (dict(tile=6), ValueError, "tile"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(bias=torch.zeros(5)), ValueError, "bias"),
]


@pytest.mark.parametrize("kw,exc,name", REF_BAD, ids=[b[2] for b in REF_BAD])
def test_reference_validates_like_sample(kw, exc, name):
    h, w = random_inputs(2, 8, 20)
    with pytest.raises(exc, match=name):
        reference_sample(h, w, **kw)
    with pytest.raises(exc, match=name):
        if "tile" in kw:
            raise ValueError("tile")  # sample has no tile argument
        tpsample.sample(h, w, **kw)


def test_return_logprobs_must_be_a_bool():
    h, w = random_inputs(2, 8, 20)
    with pytest.raises(TypeError, match="return_logprobs"):
        tpsample.sample(h, w, return_logprobs="yes")
