"""Stage 2 (kernels/reduce_records.py, interpreted on CPU): the same reduction as
tpsample.merge, bit for bit, and the parity protocol of the P2P fan-out buffers."""
import pytest
import torch

from tpsample import merge, records
from tpsample.params import row_params

import kernel_cases as kc
from cases import random_inputs

def random_records(slots, S, B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    score = torch.randn(slots, S, B, T, generator=g).round(decimals=1)  # many exact ties
    token = torch.randperm(slots * T * 128, generator=g)[: slots * T].view(slots, 1, 1, T).float()
    token = token.expand(slots, S, B, T)
    logit = torch.randn(slots, S, B, T, generator=g)
    lse = torch.randn(slots, 1, B, T, generator=g).expand(slots, S, B, T).clone()
    score[0, :, 0] = float("-inf")  # a row that is -inf in slot 0
    lse[:, :, 1, 0] = float("-inf")
    lse[:, :, 2, 1] = float("nan")  # a NaN row → degenerate
    return torch.stack([score, token, logit, lse], dim=-1).contiguous()


@pytest.mark.parametrize("launch", [None, (1, 128, 4), (1, 64, 4), (4, 32, 4)])  # one pass / chunks
@pytest.mark.parametrize("merge_mode", ["max", "logmass"])
def test_reduce_kernel_equals_merge_module(merge_mode, launch, device):
    slots, S, B, T = 3, 2, 6, 37
    rec = random_records(slots, S, B, T)
    inv_temp = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 2.0])
    seed = torch.arange(B) * 1000 + 1
    off = torch.arange(B)
    want = merge.reduce_records(rec, seed, off, inv_temp == 0, merge_mode)
    got = kc.reduce_records(rec.to(device), inv_temp.to(device), seed.to(device), off.to(device),
                               merge_mode, launch=launch)
    assert torch.equal(got[0].cpu(), want[0])
    assert torch.allclose(got[1].cpu(), want[1], atol=1e-5, equal_nan=True)
    assert torch.allclose(got[2].cpu(), want[2], atol=1e-5, equal_nan=True)
    assert torch.isnan(got[2][2]) and (got[0][2] == -1).all()


@pytest.mark.parametrize("parity_value", [0, 1])
def test_fanout_stores_into_every_peer_buffer_of_the_selected_parity(parity_value, device):
    """The symm_mem store path, with ordinary local buffers standing in for peer buffers."""
    B, D, V, world, rank = 5, 32, 300, 3, 1
    h, w = random_inputs(B, D, V, torch.float32, device, seed=8)
    p = row_params(h, 1.0, torch.arange(B, device=device), 0)
    T = records.num_tiles(V)
    numel = 2 * B * T * 4  # S = 2
    half = world * numel
    peers = [torch.full((2 * half,), -7.0, device=device) for _ in range(world)]
    ptrs = torch.tensor([[t.data_ptr() + (k * half + rank * numel) * 4 for t in peers] for k in range(2)],
                        dtype=torch.int64, device=device)
    parity = torch.tensor([parity_value, 0], dtype=torch.int32, device=device)
    kw = dict(bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=2, n_real=V)
    want = kc.fused_records(h, w, **kw)
    view = lambda flat: records.records_view(flat, 2, B, T, tile_major=True)  # noqa: E731 (as VocabParallelSampler)
    kc.fused_records(h, w, out=view(torch.empty(numel, device=device)), peer_ptrs=ptrs, parity=parity, **kw)
    for t in peers:
        got = view(t.view(2, world, numel)[parity_value, rank])
        assert torch.equal(got, want)
        assert (t.view(2, world, numel)[1 - parity_value] == -7.0).all()  # other buffer untouched
        assert (t.view(2, world, numel)[parity_value, 0] == -7.0).all()  # other ranks' slots too
    full = view(peers[0].view(2, world, numel)[0])
    view(peers[0].view(2, world, numel)[parity_value]).copy_(
        want[None].expand(world, *want.shape))  # every slot valid
    assert parity.tolist() == [parity_value, 0]  # stage 1 reads the parity, never flips it
    got = kc.reduce_records(full, p.inv_temp, p.seed, p.offset, "max", parity=parity, parity_stride=half)
    assert parity.tolist() == [1 - parity_value, 0]  # stage 2's last program flipped it, reset the count
    parity[0] = parity_value  # one program per (sample, row): 10 programs, still one flip
    again = kc.reduce_records(full, p.inv_temp, p.seed, p.offset, "max", parity=parity, parity_stride=half,
                                 launch=(1, 256, 4))
    assert parity.tolist() == [1 - parity_value, 0] and torch.equal(again[0], got[0])
    ref = merge.reduce_records(want[None].expand(world, *want.shape).cpu(), p.seed.cpu(), p.offset.cpu(),
                               p.inv_temp.cpu() == 0, "max")
    assert torch.equal(got[0].cpu(), ref[0])


