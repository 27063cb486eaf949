"""The reference's own inverse CDF (float64, from the definition) agrees with the torch
stage 1 (float32 running sums) and picks tokens with the probabilities fact 6 says."""
import torch

from tpsample import noise
from tpsample.reference import inverse_cdf_in_tiles
from tpsample.torch_records import cdf_pick

from stats import ALPHA, chi2_pvalue


def test_reference_inverse_cdf_equals_the_torch_stage1_pick():
    g = torch.Generator().manual_seed(3)
    B, T, tile = 64, 16, 128
    l = torch.randn(B, T * tile, generator=g) * 3
    l[:, 5 * tile: 5 * tile + 40] = float("-inf")  # an empty subgroup and a partial one
    l[3, 7 * tile: 8 * tile] = float("-inf")  # an empty tile
    seed = torch.randint(0, 1 << 40, (B,), generator=g)
    offset = torch.arange(B)
    for s in range(3):
        want = cdf_pick(l.view(B, T, tile), seed, offset, s, torch.arange(T) * tile)
        got = inverse_cdf_in_tiles(l, seed, offset, s, tile)
        assert torch.equal(got, want)
        assert (l.view(B, T, tile).gather(-1, got[..., None])[..., 0] > float("-inf"))[l.view(B, T, tile).amax(-1) > float("-inf")].all()


def test_reference_inverse_cdf_follows_the_softmax_of_its_tile():
    g = torch.Generator().manual_seed(5)
    tile = 128
    row = torch.randn(tile, generator=g) * 2
    n = 20000
    l = row.expand(n, -1).contiguous()
    seed = torch.arange(n) * 7919
    picks = inverse_cdf_in_tiles(l, seed, torch.zeros(n, dtype=torch.int64), 0, tile)[:, 0]
    assert chi2_pvalue(picks, torch.softmax(row.double(), -1)) > ALPHA
    # negative control: the same uniforms through the wrong weights (exp(l / 2)) are rejected
    wrong = inverse_cdf_in_tiles(l / 2, seed, torch.zeros(n, dtype=torch.int64), 0, tile)[:, 0]
    assert chi2_pvalue(wrong, torch.softmax(row.double(), -1)) < ALPHA
    assert noise.CDF_STREAM != noise.GROUP_STREAM
